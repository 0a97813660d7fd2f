"""Deployment plans: every rendered server command parses with vLLM's own argument parser."""

from __future__ import annotations

import json
import os
import subprocess

import pytest
import yaml

from service.fleet.plan import DeploymentConfig, plan, render
from service.fleet.server import vllm_python
from tests.conftest import missing_service

PARSE = r"""
import json, sys
from vllm.utils.argparse_utils import FlexibleArgumentParser
from vllm.entrypoints.launchers.cli_args import make_arg_parser
from vllm.engine.arg_utils import AsyncEngineArgs
out = []
for argv in json.load(sys.stdin):
    assert argv[:2] == ["vllm", "serve"], argv
    args = make_arg_parser(FlexibleArgumentParser()).parse_args(["--model", argv[2], *argv[3:]])
    engine = AsyncEngineArgs.from_cli_args(args)
    out.append({"dp": engine.data_parallel_size, "ep": engine.enable_expert_parallel,
                "quant": engine.quantization, "kv_dtype": engine.kv_cache_dtype,
                "routed": engine.enable_return_routed_experts,
                "kv_connector": engine.kv_transfer_config.kv_connector if engine.kv_transfer_config else None,
                "offload": engine.kv_offloading_size, "headless": getattr(args, "headless", False)})
print(json.dumps(out))
"""


def parse_with_vllm(commands) -> list[dict]:
    if not os.path.exists(vllm_python()):
        missing_service(f"vLLM at {vllm_python()} (make vllm)")
    done = subprocess.run([vllm_python(), "-c", PARSE], input=json.dumps([c.argv for c in commands]),
                          capture_output=True, text=True, timeout=300, env=os.environ | {"VLLM_TARGET_DEVICE": "cpu"})
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.vllm
def test_wide_ep_fp8_routed_experts_over_32_gpus():
    cfg = DeploymentConfig.preset("wide-ep", model="zai-org/GLM-5-FP8", nodes=4, kv_offload_cpu_gb=256)
    parsed = parse_with_vllm(plan(cfg))
    assert len(parsed) == 4
    assert {p["dp"] for p in parsed} == {32} and all(p["ep"] for p in parsed)
    assert {(p["quant"], p["kv_dtype"], p["routed"], p["offload"]) for p in parsed} == {("fp8", "fp8", True, 256)}
    assert [p["headless"] for p in parsed] == [False, True, True, True]


@pytest.mark.vllm
def test_prefill_decode_disaggregation_with_disk_offload():
    cfg = DeploymentConfig.preset("pd-disagg", model="moonshotai/Kimi-K2-Instruct", nodes=8,
                                  kv_offload_disk="/nvme/kv")
    commands = plan(cfg)
    parsed = parse_with_vllm(commands)
    assert [c.role for c in commands] == ["prefill"] * 2 + ["decode"] * 6
    assert {p["kv_connector"] for p in parsed} == {"MultiConnector"}
    assert parsed[0]["dp"] == 16 and parsed[2]["dp"] == 48
    assert all(c.env["LMCACHE_LOCAL_DISK"] == "file:///nvme/kv" for c in commands)


@pytest.mark.vllm
def test_dense_preset_parses():
    parsed = parse_with_vllm(plan(DeploymentConfig.preset("dense", model="Qwen/Qwen3-8B", nodes=2)))
    assert [p["ep"] for p in parsed] == [False, False] and parsed[0]["quant"] is None


def test_compose_and_kubernetes_snippets_are_valid_yaml():
    cfg = DeploymentConfig.preset("wide-ep", model="m", nodes=2)
    services = yaml.safe_load(render(cfg, "compose"))["services"]
    assert len(services) == 2 and all(s["image"].startswith("vllm/vllm-openai") for s in services.values())
    pods = list(yaml.safe_load_all(render(cfg, "k8s")))
    assert [p["kind"] for p in pods] == ["Pod", "Pod"]
    assert "--enable-return-routed-experts" in pods[0]["spec"]["containers"][0]["args"]


@pytest.mark.parametrize(("kw", "message"), [
    ({"nodes": 1, "disaggregation": "prefill-decode", "prefill_nodes": 1}, "prefill_nodes"),
    ({"gpus_per_node": 8, "tensor_parallel": 3}, "tensor_parallel"),
])
def test_bad_plans_say_how_to_fix_them(kw, message):
    with pytest.raises(ValueError, match=message):
        DeploymentConfig(model="m", **kw)
