"""Deployment plans for large fleets: the vLLM server commands the big runs depend on (FP8
weights and KV cache, wide expert parallelism, prefill/decode disaggregation, KV offload,
routed-expert return), rendered as shell, docker compose or Kubernetes.

They cannot run here; tests parse every rendered command with vLLM's own argument parser.
"""

from __future__ import annotations

import json
import shlex
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

EXTENSION = "service.fleet.extension.SwerveWorkerExtension"


class DeploymentConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str
    nodes: int = Field(1, ge=1)
    gpus_per_node: int = Field(8, ge=1)
    port: int = 8000
    leader: str = "node-0"
    """Address of node 0 (data-parallel coordination)."""
    tensor_parallel: int = Field(1, ge=1)
    expert_parallel: bool = True
    """Wide EP: attention data-parallel across every GPU, experts sharded across them."""
    fp8_weights: bool = True
    fp8_kv_cache: bool = True
    disaggregation: Literal["none", "prefill-decode"] = "none"
    prefill_nodes: int = Field(0, ge=0)
    """With prefill-decode: how many of the nodes run prefill (the rest decode)."""
    kv_offload_cpu_gb: int = Field(0, ge=0)
    """GiB of host memory per server for offloaded KV blocks (0: off)."""
    kv_offload_disk: str | None = None
    """Local disk folder for KV offload through LMCache (None: off)."""
    routed_experts: bool = True
    """Return routed experts with every sample (router replay in the trainer)."""
    max_model_len: int = 131072
    all2all_backend: str = "deepep_high_throughput"

    @model_validator(mode="after")
    def _check(self) -> DeploymentConfig:
        if self.gpus_per_node % self.tensor_parallel:
            raise ValueError(f"tensor_parallel={self.tensor_parallel} must divide "
                             f"gpus_per_node={self.gpus_per_node}")
        if self.disaggregation == "prefill-decode" and not 0 < self.prefill_nodes < self.nodes:
            raise ValueError("prefill-decode needs 1 <= prefill_nodes < nodes; set --nodes 2 or more")
        return self

    @classmethod
    def preset(cls, name: str, **kw) -> DeploymentConfig:
        presets = {
            "wide-ep": {},
            "pd-disagg": {"disaggregation": "prefill-decode",
                          "prefill_nodes": max(1, kw.get("nodes", 2) // 4)},
            "dense": {"expert_parallel": False, "fp8_weights": False, "routed_experts": False},
        }
        if name not in presets:
            raise ValueError(f"unknown preset {name!r}; choose one of {', '.join(presets)}")
        return cls(**{**presets[name], **kw})


class ServerCommand(BaseModel):
    role: str
    node: int
    argv: list[str]
    env: dict[str, str]


def _groups(cfg: DeploymentConfig) -> list[tuple[str, list[int]]]:
    nodes = list(range(cfg.nodes))
    if cfg.disaggregation == "prefill-decode":
        return [("prefill", nodes[: cfg.prefill_nodes]), ("decode", nodes[cfg.prefill_nodes :])]
    return [("serve", nodes)]


def plan(cfg: DeploymentConfig) -> list[ServerCommand]:
    commands = []
    for role, nodes in _groups(cfg):
        dp_local = cfg.gpus_per_node // cfg.tensor_parallel
        for rank, node in enumerate(nodes):
            argv = ["vllm", "serve", cfg.model, "--host", "0.0.0.0", "--port", str(cfg.port),
                    "--tensor-parallel-size", str(cfg.tensor_parallel),
                    "--max-model-len", str(cfg.max_model_len), "--enable-prefix-caching",
                    "--worker-extension-cls", EXTENSION]
            if cfg.expert_parallel:
                argv += ["--enable-expert-parallel", "--all2all-backend", cfg.all2all_backend,
                         "--data-parallel-size", str(dp_local * len(nodes)),
                         "--data-parallel-size-local", str(dp_local),
                         "--data-parallel-address", f"{role}-{cfg.leader}" if role != "serve" else cfg.leader,
                         "--data-parallel-rpc-port", "13345",
                         "--data-parallel-start-rank", str(rank * dp_local)]
                if rank:
                    argv.append("--headless")
            if cfg.fp8_weights:
                argv += ["--quantization", "fp8"]
            if cfg.fp8_kv_cache:
                argv += ["--kv-cache-dtype", "fp8"]
            if cfg.routed_experts:
                argv.append("--enable-return-routed-experts")
            argv += _kv_args(cfg, role)
            env = {"VLLM_SERVER_DEV_MODE": "1"}
            if cfg.kv_offload_disk:
                env |= {"LMCACHE_LOCAL_DISK": f"file://{cfg.kv_offload_disk}",
                        "LMCACHE_MAX_LOCAL_DISK_SIZE": "500", "LMCACHE_CHUNK_SIZE": "256"}
            commands.append(ServerCommand(role=role, node=node, argv=argv, env=env))
    return commands


def _kv_args(cfg: DeploymentConfig, role: str) -> list[str]:
    connectors = []
    if cfg.disaggregation == "prefill-decode":
        connectors.append({"kv_connector": "NixlConnector", "kv_role": "kv_both"})
    if cfg.kv_offload_disk:
        connectors.append({"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"})
    args = []
    if cfg.kv_offload_cpu_gb:
        args += ["--kv-offloading-size", str(cfg.kv_offload_cpu_gb), "--kv-offloading-backend", "native"]
    if len(connectors) == 1:
        args += ["--kv-transfer-config", json.dumps(connectors[0])]
    elif connectors:
        args += ["--kv-transfer-config", json.dumps({
            "kv_connector": "MultiConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"connectors": connectors}})]
    return args


def render(cfg: DeploymentConfig, output: str = "shell") -> str:
    commands = plan(cfg)
    if output == "shell":
        return "\n".join(f"# {c.role} on node {c.node}\n"
                         + " ".join(f"{k}={shlex.quote(v)}" for k, v in c.env.items()) + " "
                         + shlex.join(c.argv) for c in commands)
    if output == "compose":
        return _compose(commands)
    if output == "k8s":
        return _k8s(cfg, commands)
    raise ValueError(f"unknown output {output!r}; use shell, compose or k8s")


def _compose(commands: list[ServerCommand]) -> str:
    import yaml

    services = {f"vllm-{c.role}-{c.node}": {
        "image": "vllm/vllm-openai:latest", "command": c.argv[2:] if c.argv[:2] == ["vllm", "serve"] else c.argv,
        "environment": c.env, "network_mode": "host", "ipc": "host", "shm_size": "64gb",
        "deploy": {"resources": {"reservations": {"devices": [
            {"driver": "nvidia", "count": "all", "capabilities": ["gpu"]}]}}},
    } for c in commands}  # fmt: skip
    return yaml.safe_dump({"services": services}, sort_keys=False)


def _k8s(cfg: DeploymentConfig, commands: list[ServerCommand]) -> str:
    import yaml

    docs = [{
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": f"vllm-{c.role}-{c.node}", "labels": {"app": "swerve-vllm", "role": c.role}},
        "spec": {"hostNetwork": True, "containers": [{
            "name": "vllm", "image": "vllm/vllm-openai:latest", "args": c.argv[1:],
            "command": ["vllm"], "env": [{"name": k, "value": v} for k, v in c.env.items()],
            "resources": {"limits": {"nvidia.com/gpu": cfg.gpus_per_node}},
        }]},
    } for c in commands]  # fmt: skip
    return yaml.safe_dump_all(docs, sort_keys=False)
