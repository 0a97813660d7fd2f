"""End to end on real services: the API creates a run of the example suite with the oracle
policy, its orchestrator schedules episodes through Redis onto a separate Celery worker
process, which runs them in bubblewrap sandboxes and streams turns into PostgreSQL."""

from __future__ import annotations

import asyncio
import os
import uuid
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import redis

from service import db
from service.buffer import Buffer
from service.tiny_model import init_tiny
from tests.conftest import auth, client_for, make_settings, missing_service
from tests.sandbox_fixtures import require_bwrap

pytestmark = pytest.mark.slow
SUITE = Path(__file__).resolve().parent.parent / "envs" / "example_suite" / "suite.jsonl"
BROKER = os.environ.get("SWERVE_TEST_REDIS_URL", "redis://127.0.0.1:6379/15").rsplit("/", 1)[0] + "/14"


def worker_env(db_url: str, data_dir: Path) -> dict:
    """Fresh broker queue and database for a worker process; skip/fail if a service is missing."""
    from tests.conftest import _truncate_pg

    require_bwrap()
    try:
        redis.Redis.from_url(BROKER).flushdb()
    except redis.ConnectionError as e:
        missing_service(f"Redis at {BROKER} ({e})")
    _truncate_pg(db_url)
    return {k: v for k, v in os.environ.items() if not k.startswith("SWERVE_")} | {
        "SWERVE_DATABASE_URL": db_url, "SWERVE_BROKER_URL": BROKER, "SWERVE_DATA_DIR": str(data_dir)}


@pytest.fixture
def worker(migrated_pg_url, tmp_path):
    env = worker_env(migrated_pg_url, tmp_path)
    proc = subprocess.Popen([sys.executable, "-m", "service.cli", "worker", "--concurrency", "3"], env=env,
                            stdout=open(tmp_path / "worker.log", "w"), stderr=subprocess.STDOUT)
    yield migrated_pg_url, tmp_path
    proc.terminate()
    proc.wait(timeout=60)


async def test_oracle_run_through_api_redis_worker_and_postgres(worker, tmp_path):
    db_url, data_dir = worker
    tokenizer = init_tiny(tmp_path / "tiny")
    body = "\n".join(SUITE.read_text().splitlines()[:3]) + "\n"
    settings = make_settings(db_url, broker_url=BROKER, data_dir=data_dir)
    async with client_for(settings) as client:
        suite = (await client.post("/api/v1/suites", params={"name": "ex"}, content=body,
                                   headers={"Content-Type": "application/x-ndjson", **auth()})).json()
        bad = await client.post("/api/v1/runs", headers=auth(), json={"suite_id": suite["id"], "policy": {"type": "gpt"}})
        assert bad.status_code == 422 and "policy" in str(bad.json())
        run = await client.post("/api/v1/runs", headers=auth(), json={
            "suite_id": suite["id"], "policy": {"type": "oracle", "tokenizer": str(tokenizer)},
            "samples_per_task": 2, "concurrency": 4})
        assert run.status_code == 201, run.text
        run_id = run.json()["id"]
        for _ in range(600):
            state = (await client.get(f"/api/v1/runs/{run_id}")).json()
            if state["status"] != "running":
                break
            await asyncio.sleep(0.5)
        assert state["status"] == "finished", (state, (data_dir / "worker.log").read_text()[-3000:])
        assert state["episodes"] == {"submitted": 6}
        assert (state["reward_mean"], state["pass_at_1"], state["pass_at_k"]) == (1.0, 1.0, 1.0)
        episodes = (await client.get(f"/api/v1/runs/{run_id}/episodes")).json()
        assert episodes["total"] == 6 and all(e["trainable"] is False for e in episodes["items"])
        detail = (await client.get(f"/api/v1/episodes/{episodes['items'][0]['id']}", params={"arrays": "json"})).json()
        assert [t["tool_call"]["name"] for t in detail["turns"]] == ["str_replace_editor", "bash", "submit"]
        assert detail["report"]["resolution"] == "FULL" and detail["diff"].startswith("diff --git")
        assert all(len(t["output_ids"]) == len(t["output_logprobs"]) == t["n_output_tokens"] for t in detail["turns"])
        assert (await client.get("/api/v1/buffer")).json()["ready"] == 3
        async with client.stream("GET", "/api/v1/events", params={"run": run_id, "poll_s": 0.1}) as sse:
            assert sse.headers["content-type"].startswith("text/event-stream")
            kinds = [line.split(": ", 1)[1] async for line in sse.aiter_lines() if line.startswith("event: ")]
        assert kinds.count("episode") == 6 and kinds[-2:] == ["progress", "end"]
        assert (await client.get("/api/v1/events", params={"run": str(uuid.uuid4())})).status_code == 404

    engine = db.make_async_engine(db_url)
    try:
        buffer = Buffer(engine)
        claim = await buffer.claim(10, trainer_step=0, max_staleness=1)
        groups = await buffer.load(claim)
        assert len(groups) == 3 and all(len(g.episodes) == 2 for g in groups)
        turns = groups[0].episodes[0].turns
        sequence = np.concatenate([np.concatenate([t["input_ids"], t["output_ids"]]) for t in turns])
        assert len(sequence) == sum(len(t["input_ids"]) + len(t["output_ids"]) for t in turns) > 100
        await buffer.commit(claim, trainer_step=0)
    finally:
        await engine.dispose()


async def test_cancel_stops_running_episodes_and_their_sandboxes(worker, tmp_path):
    from tests.test_sandboxes import host_processes_with

    db_url, data_dir = worker
    tokenizer = init_tiny(tmp_path / "tiny")
    body = "\n".join(SUITE.read_text().splitlines()[:2]) + "\n"
    calls = [{"name": "bash", "arguments": {"command": "sleep 31.$((2+3))"}}] * 3
    async with client_for(make_settings(db_url, broker_url=BROKER, data_dir=data_dir)) as client:
        suite = (await client.post("/api/v1/suites", params={"name": "ex"}, content=body,
                                   headers={"Content-Type": "application/x-ndjson", **auth()})).json()
        run_id = (await client.post("/api/v1/runs", headers=auth(), json={
            "suite_id": suite["id"], "policy": {"type": "replay", "tokenizer": str(tokenizer), "calls": calls},
            "samples_per_task": 2, "concurrency": 3})).json()["id"]
        for _ in range(240):  # wait until episodes are inside their sleep
            if len(host_processes_with("sleep 31.5")) >= 2:
                break
            await asyncio.sleep(0.25)
        assert host_processes_with("sleep 31.5")
        cancelled_at = asyncio.get_running_loop().time()
        assert (await client.post(f"/api/v1/runs/{run_id}/cancel", headers=auth())).status_code == 200
        for _ in range(120):
            state = (await client.get(f"/api/v1/runs/{run_id}")).json()
            if state["status"] != "cancelling":
                break
            await asyncio.sleep(0.25)
        assert state["status"] == "cancelled"
        assert asyncio.get_running_loop().time() - cancelled_at < 15
        assert state["episodes"] == {"cancelled": 4}
        assert host_processes_with("sleep 31.5") == []
        assert (await client.post(f"/api/v1/runs/{run_id}/cancel", headers=auth())).status_code == 409


async def test_sigkilled_worker_loses_nothing(migrated_pg_url, tmp_path):
    """Kill the worker mid-episode: the orchestrator sees the stale heartbeats, a new worker
    restarts those episodes cleanly; every episode ends final once, turns are not duplicated,
    and no sandbox of the dead worker survives the new worker's reaper."""
    import signal

    from tests.conftest import count_rows
    from tests.test_sandboxes import host_processes_with

    env = worker_env(migrated_pg_url, tmp_path) | {"SWERVE_SANDBOX_DIR": str(tmp_path / "sandboxes")}

    def start_worker(name: str) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-m", "service.cli", "worker", "--concurrency", "2"], env=env,
                                stdout=open(tmp_path / f"{name}.log", "w"), stderr=subprocess.STDOUT,
                                start_new_session=True)

    tokenizer = init_tiny(tmp_path / "tiny")
    calls = [{"name": "bash", "arguments": {"command": "sleep 4.$((2+3)); echo step"}}] * 2
    body = "\n".join(SUITE.read_text().splitlines()[:2]) + "\n"
    first = start_worker("worker1")
    second = None
    try:
        async with client_for(make_settings(migrated_pg_url, broker_url=BROKER, data_dir=tmp_path)) as client:
            suite = (await client.post("/api/v1/suites", params={"name": "ex"}, content=body,
                                       headers={"Content-Type": "application/x-ndjson", **auth()})).json()
            run_id = (await client.post("/api/v1/runs", headers=auth(), json={
                "suite_id": suite["id"], "policy": {"type": "replay", "tokenizer": str(tokenizer), "calls": calls},
                "samples_per_task": 1, "concurrency": 2, "worker_timeout_s": 4})).json()["id"]
            for _ in range(240):
                if len(host_processes_with("sleep 4.5")) >= 2:
                    break
                await asyncio.sleep(0.25)
            os.killpg(first.pid, signal.SIGKILL)  # the worker and its pool children, mid-episode
            first.wait()
            second = start_worker("worker2")
            for _ in range(400):
                state = (await client.get(f"/api/v1/runs/{run_id}")).json()
                if state["status"] != "running":
                    break
                await asyncio.sleep(0.25)
            assert state["status"] == "finished", state
            assert state["episodes"] == {"submitted": 2}
            episodes = (await client.get(f"/api/v1/runs/{run_id}/episodes")).json()["items"]
            assert all(e["attempt"] >= 1 and e["n_turns"] == 3 for e in episodes), episodes
            for e in episodes:
                turns = (await client.get(f"/api/v1/episodes/{e['id']}")).json()["turns"]
                assert [t["idx"] for t in turns] == [0, 1, 2]
        assert count_rows(migrated_pg_url)["turns"] == 6
        assert host_processes_with("sleep 4.5") == []
        assert not [p for p in (tmp_path / "sandboxes").iterdir() if p.name.startswith("swb-")]
    finally:
        for proc in (first, second):
            if proc is not None and proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait(timeout=60)


async def wait_for_run(client, run_id: str, timeout_s: float = 300.0, log: Path | None = None) -> dict:
    for _ in range(int(timeout_s * 4)):
        state = (await client.get(f"/api/v1/runs/{run_id}")).json()
        if state["status"] not in ("pending", "running", "cancelling"):
            return state
        await asyncio.sleep(0.25)
    raise AssertionError(f"run {run_id} still {state['status']} after {timeout_s} s: {state}; "
                         f"{log.read_text()[-3000:] if log else ''}")


async def check_run_trajectories(client, run_id: str, model_dir: Path, version: int) -> list[dict]:
    from tests.trajectories import check_trajectory

    episodes = (await client.get(f"/api/v1/runs/{run_id}/episodes")).json()["items"]
    for e in episodes:
        assert e["trainable"] is True and e["status"] in ("max_turns", "submitted", "context_exhausted"), e
        assert (e["policy_version_min"], e["policy_version_max"]) == (version, version)
        detail = (await client.get(f"/api/v1/episodes/{e['id']}", params={"arrays": "json"})).json()
        assert all(t["policy_version"] == version for t in detail["turns"])
        task = (await client.get(f"/api/v1/tasks/{e['task_id']}")).json()
        check_trajectory(detail, task["problem_statement"], model_dir)
    return episodes


@pytest.mark.vllm
async def test_tiny_model_run_on_vllm_records_the_context_it_sampled(worker, vllm_fleet):
    """The tiny model on a real vLLM server, through Redis, a worker process and PostgreSQL:
    each turn's tokens re-render from the stored messages, and every sampled token's logprob
    recomputed by transformers over the concatenated turns equals what vLLM reported."""
    from service.vllm_server import VLLMServer

    db_url, data_dir = worker
    model_dir = vllm_fleet.models["dense"]
    url = vllm_fleet.url("dense-a")
    version = int(VLLMServer.served_version(vllm_fleet.servers["dense-a"]) or 0)
    body = "\n".join(SUITE.read_text().splitlines()[:2]) + "\n"
    async with client_for(make_settings(db_url, broker_url=BROKER, data_dir=data_dir)) as client:
        suite = (await client.post("/api/v1/suites", params={"name": "ex"}, content=body,
                                   headers={"Content-Type": "application/x-ndjson", **auth()})).json()
        run = await client.post("/api/v1/runs", headers=auth(), json={
            "suite_id": suite["id"], "samples_per_task": 2, "concurrency": 4,
            "policy": {"type": "vllm", "endpoints": [url], "model": "tiny", "tokenizer": str(model_dir)},
            "agent": {"max_turns": 4, "sampling": {"max_tokens": 48}}})
        assert run.status_code == 201, run.text
        state = await wait_for_run(client, run.json()["id"], log=data_dir / "worker.log")
        assert state["status"] == "finished" and sum(state["episodes"].values()) == 4, state
        assert state["graded"] == 4 and state["tokens"] > 0
        episodes = await check_run_trajectories(client, run.json()["id"], model_dir, version)
        assert len(episodes) == 4
        assert (await client.get("/api/v1/buffer")).json()["ready"] == 2
