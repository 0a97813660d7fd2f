"""One fleet of real vLLM CPU servers per test session (they take a minute or two to start).

dense/moe "a" start on the initial weights; "b" start fresh on the next policy's weights, so
a reload of "a" can be compared with a fresh start. "tied-a" serves a model whose vocabulary
head is its embedding (as Qwen3-0.6B and the demo's policy), whose reload is checked against
transformers.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import pytest

from service.fleet.tiny_model import TinyModelSpec, init_tiny, perturb
from service.fleet.server import VLLMServer, set_version, vllm_python
from tests.conftest import missing_service
from tests.servers import free_port


@dataclass
class Fleet:
    models: dict[str, Path]
    servers: dict[str, VLLMServer]

    def url(self, name: str) -> str:
        return self.servers[name].url


def make_models(root: Path) -> dict[str, Path]:
    models = {"dense": init_tiny(root / "dense", TinyModelSpec()),
              "moe": init_tiny(root / "moe", TinyModelSpec(moe=True)),
              "tied": init_tiny(root / "tied", TinyModelSpec(tie_embeddings=True, qk_norm_init=0.3))}
    models["dense-v1"] = perturb(models["dense"], root / "dense-v1")
    models["moe-v1"] = perturb(models["moe"], root / "moe-v1")
    models["tied-v1"] = perturb(models["tied"], root / "tied-v1", scale=0.2)
    return models


@pytest.fixture(scope="session")
def vllm_fleet(tmp_path_factory) -> Fleet:
    if not os.path.exists(vllm_python()):
        missing_service(f"vLLM at {vllm_python()} (make vllm)")
    root = tmp_path_factory.mktemp("vllm")
    models = make_models(root / "models")
    servers = {
        name: VLLMServer(models[model], free_port(), served_name="tiny", log_path=root / f"{name}.log",
                         die_with_parent=True)  # a session killed (a CI timeout) takes its servers with it
        for name, model in [("dense-a", "dense"), ("dense-b", "dense-v1"),
                            ("moe-a", "moe"), ("moe-b", "moe-v1"), ("tied-a", "tied")]
    }  # fmt: skip
    for server in servers.values():
        server.start()
    try:
        for name, server in servers.items():
            server.wait_ready(timeout_s=900)
            set_version(server.url, 1 if name.endswith("-b") else 0)
        yield Fleet(models, servers)
    finally:
        for server in servers.values():
            server.stop()
