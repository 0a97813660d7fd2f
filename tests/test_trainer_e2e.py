"""End to end on CPU: the tiny model on vLLM samples a run through Redis, a worker process
and PostgreSQL; the trainer consumes it, publishes two policy versions and reloads the server;
the server then computes what the trainer's weights compute, and the next run's episodes are
tagged with the new version."""

from __future__ import annotations

import httpx
import pytest
import torch

from tests.conftest import auth, client_for, make_settings
from tests.test_rollout_e2e import BROKER, SUITE, wait_for_run, worker  # noqa: F401 - fixture

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
from tests.conftest import require_torchtitan  # noqa: E402

require_torchtitan()


async def start_run(client, suite_id: str, url: str, model_dir) -> str:
    run = await client.post("/api/v1/runs", headers=auth(), json={
        "suite_id": suite_id, "samples_per_task": 2, "concurrency": 4,
        "sampler": {"type": "vllm", "endpoints": [url], "model": "tiny", "tokenizer": str(model_dir)},
        "agent": {"max_turns": 2, "sampling": {"max_tokens": 24}}})
    assert run.status_code == 201, run.text
    return run.json()["id"]


async def test_trainer_consumes_a_run_and_the_fleet_serves_its_versions(worker, vllm_fleet, tmp_path):  # noqa: F811
    from service.fleet.client import FleetConfig, VLLMClient
    from trainer.config import TrainerConfig
    from trainer.train import train

    db_url, data_dir = worker
    model_dir, url = vllm_fleet.models["dense"], vllm_fleet.url("dense-a")
    body = "\n".join(SUITE.read_text().splitlines()[:2]) + "\n"
    try:
        async with client_for(make_settings(db_url, broker_url=BROKER, data_dir=data_dir)) as client:
            suite = (await client.post("/api/v1/suites", params={"name": "ex"}, content=body,
                                       headers={"Content-Type": "application/x-ndjson", **auth()})).json()
            first = await wait_for_run(client, await start_run(client, suite["id"], url, model_dir),
                                       log=data_dir / "worker.log")
            assert first["status"] == "finished" and first["graded"] == 4, first
            # the random tiny model earns no reward: SFT on its own samples exercises the same path
            # 1 MB shards: the server loads a sharded folder through its index, as a real model's
            cfg = TrainerConfig(name="e2e", model=model_dir, out_dir=tmp_path, endpoints=[url], served_model="tiny",
                                steps=2, groups_per_step=1, sft=True, optim={"lr": 1e-2}, wait_s=60,
                                publish_shard_mb=1)
            history = await train(cfg, db_url)
            assert [m["step"] for m in history] == [1, 2] and all(m["reloaded"] == [url] for m in history)
            published = tmp_path / "e2e" / "weights" / "v2"
            assert len(list(published.glob("model-*-of-*.safetensors"))) > 1
            assert (published / "model.safetensors.index.json").exists()
            assert httpx.get(f"{url}/weight_info").json()["weight_version"] == "2"
            # the server now computes what the published (trainer's) weights compute
            prompt = list(range(100, 140))
            async with VLLMClient(FleetConfig(endpoints=[url])) as fleet:
                from service.fleet.client import SamplingParams

                gen = await fleet.generate(prompt, SamplingParams(max_tokens=8, temperature=0.0))
            assert gen.policy_version == 2
            from tests.test_inference_vllm import transformers_logprobs

            expected = transformers_logprobs(tmp_path / "e2e" / "weights" / "v2", prompt, gen.output_ids)
            assert max(abs(a - b) for a, b in zip(gen.output_logprobs, expected)) < 1e-3
            old = transformers_logprobs(model_dir, prompt, gen.output_ids)
            assert max(abs(a - b) for a, b in zip(gen.output_logprobs, old)) > 1e-2  # the weights did change
            second_id = await start_run(client, suite["id"], url, model_dir)
            second = await wait_for_run(client, second_id, log=data_dir / "worker.log")
            assert second["status"] == "finished"
            episodes = (await client.get(f"/api/v1/runs/{second_id}/episodes")).json()["items"]
            assert episodes and all((e["policy_version_min"], e["policy_version_max"]) == (2, 2) for e in episodes)
            policies = (await client.get(f"/api/v1/runs/{second_id}")).json()
            assert policies["status"] == "finished"
    finally:  # the fleet is shared by the session: back to the initial weights
        async with VLLMClient(FleetConfig(endpoints=[url])) as fleet:
            assert await fleet.reload(str(model_dir), version=0) == [url]
