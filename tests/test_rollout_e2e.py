"""End to end on real services: the API creates a run of the example suite with the oracle
policy, its orchestrator schedules episodes through Redis onto a separate Celery worker
process, which runs them in bubblewrap sandboxes and streams turns into PostgreSQL. Replay runs
check that any bytes a tool prints are data, and that a write the database refuses ends the
episode instead of restarting it forever."""

from __future__ import annotations

import asyncio
import os
import uuid
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
import redis
import sqlalchemy as sa

from service.store import db
from service.store.buffer import Buffer
from service.fleet.tiny_model import init_tiny
from tests.conftest import clean_env, auth, client_for, make_settings, missing_service
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
    return clean_env() | {
        "SWERVE_DATABASE_URL": db_url, "SWERVE_BROKER_URL": BROKER, "SWERVE_DATA_DIR": str(data_dir)}


@contextmanager
def running_worker(db_url: str, data_dir: Path) -> Iterator[tuple[str, Path]]:
    proc = subprocess.Popen([sys.executable, "-m", "service.cli", "worker", "--concurrency", "3"],
                            env=worker_env(db_url, data_dir), stdout=open(data_dir / "worker.log", "w"),
                            stderr=subprocess.STDOUT)
    try:
        yield db_url, data_dir
    finally:
        proc.terminate()
        proc.wait(timeout=60)


@pytest.fixture
def worker(migrated_pg_url, tmp_path):
    with running_worker(migrated_pg_url, tmp_path) as handle:
        yield handle


async def test_oracle_run_through_api_redis_worker_and_postgres(worker, tmp_path):
    db_url, data_dir = worker
    tokenizer = init_tiny(tmp_path / "tiny")
    body = "\n".join(SUITE.read_text().splitlines()[:3]) + "\n"
    settings = make_settings(db_url, broker_url=BROKER, data_dir=data_dir)
    async with client_for(settings) as client:
        suite = (await client.post("/api/v1/suites", params={"name": "ex"}, content=body,
                                   headers={"Content-Type": "application/x-ndjson", **auth()})).json()
        bad = await client.post("/api/v1/runs", headers=auth(), json={"suite_id": suite["id"], "sampler": {"type": "gpt"}})
        assert bad.status_code == 422 and "sampler" in str(bad.json())
        run = await client.post("/api/v1/runs", headers=auth(), json={
            "suite_id": suite["id"], "sampler": {"type": "oracle", "tokenizer": str(tokenizer)},
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
        detail = (await client.get(f"/api/v1/episodes/{episodes['items'][0]['id']}", params={"arrays": "json"},
                                   headers=auth())).json()  # an oracle's turns carry the answer
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
        sequence = np.concatenate([np.concatenate([t.input_ids, t.output_ids]) for t in turns])
        assert len(sequence) == sum(len(t.input_ids) + len(t.output_ids) for t in turns) > 100
        await buffer.commit(claim, trainer_step=0)
    finally:
        await engine.dispose()


async def test_cancel_stops_running_episodes_and_their_sandboxes(worker, tmp_path):
    from tests.test_sandboxes import host_processes_with

    db_url, data_dir = worker
    tokenizer = init_tiny(tmp_path / "tiny")
    body = "\n".join(SUITE.read_text().splitlines()[:2]) + "\n"
    calls = [{"name": "bash", "arguments": {"command": "echo a first turn"}},
             *[{"name": "bash", "arguments": {"command": "sleep 31.$((2+3))"}}] * 3]
    async with client_for(make_settings(db_url, broker_url=BROKER, data_dir=data_dir)) as client:
        suite = (await client.post("/api/v1/suites", params={"name": "ex"}, content=body,
                                   headers={"Content-Type": "application/x-ndjson", **auth()})).json()
        run_id = (await client.post("/api/v1/runs", headers=auth(), json={
            "suite_id": suite["id"], "sampler": {"type": "replay", "tokenizer": str(tokenizer), "calls": calls},
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
        # an episode cancelled after its first turn keeps that turn and its attempt: it is not
        # taken for one whose turns were lost and started over
        engine = db.make_async_engine(db_url)
        try:
            async with engine.connect() as conn:
                episodes = (await conn.execute(sa.text(
                    "SELECT e.attempt, (SELECT count(*) FROM turns t WHERE t.episode_id = e.id) FROM episodes e "
                    "WHERE e.run_id = :run"), {"run": uuid.UUID(run_id)})).all()
        finally:
            await engine.dispose()
        assert sum(1 for _, turns in episodes if turns == 1) >= 2  # the ones that were in their sleep
        assert all(attempt == 0 for attempt, _ in episodes), episodes  # the first attempt is 0
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
                "suite_id": suite["id"], "sampler": {"type": "replay", "tokenizer": str(tokenizer), "calls": calls},
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
    from service.fleet.server import VLLMServer

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
            "sampler": {"type": "vllm", "endpoints": [url], "model": "tiny", "tokenizer": str(model_dir)},
            "agent": {"max_turns": 4, "sampling": {"max_tokens": 48}}})
        assert run.status_code == 201, run.text
        state = await wait_for_run(client, run.json()["id"], log=data_dir / "worker.log")
        assert state["status"] == "finished" and sum(state["episodes"].values()) == 4, state
        assert state["graded"] == 4 and state["tokens"] > 0
        episodes = await check_run_trajectories(client, run.json()["id"], model_dir, version)
        assert len(episodes) == 4
        assert (await client.get("/api/v1/buffer")).json()["ready"] == 2


async def replay_run(client, tokenizer: Path, calls: list[dict]) -> str:
    """A run of the example suite's first task with the replay sampler; its id."""
    body = SUITE.read_text().splitlines()[0] + "\n"
    suite = (await client.post("/api/v1/suites", params={"name": f"ex-{uuid.uuid4().hex[:6]}"}, content=body,
                               headers={"Content-Type": "application/x-ndjson", **auth()})).json()
    run = await client.post("/api/v1/runs", headers=auth(), json={
        "suite_id": suite["id"], "sampler": {"type": "replay", "tokenizer": str(tokenizer), "calls": calls},
        "samples_per_task": 1, "concurrency": 1})
    assert run.status_code == 201, run.text
    return run.json()["id"]


async def test_any_bytes_are_data(worker, tmp_path):
    """NUL, invalid UTF-8 and terminal escapes in tool output and in a binary file (through cat
    and the editor) are stored, shown with the controls escaped, and trained on as sampled."""
    from transformers import AutoTokenizer

    db_url, data_dir = worker
    tokenizer = init_tiny(tmp_path / "tiny")
    calls = [
        {"name": "bash", "arguments": {"command": "printf 'a\\0b\\377\\033[31mred\\n'"}},
        {"name": "bash", "arguments": {"command": "printf '\\177ELF\\0\\0\\1\\377\\376' > /tmp/blob && cat /tmp/blob"}},
        {"name": "str_replace_editor", "arguments": {"command": "view", "path": "/tmp/blob"}},
        {"name": "str_replace_editor", "arguments": {"command": "view", "path": "/tmp/blob", "view_range": [1, -1]}},
    ]
    async with client_for(make_settings(db_url, broker_url=BROKER, data_dir=data_dir)) as client:
        run_id = await replay_run(client, tokenizer, calls)
        state = await wait_for_run(client, run_id, timeout_s=180, log=data_dir / "worker.log")
        assert state["status"] == "finished" and state["episodes"] == {"submitted": 1}, state
        [episode] = (await client.get(f"/api/v1/runs/{run_id}/episodes", headers=auth())).json()["items"]
        assert episode["attempt"] == 0 and episode["reward"] == 0.0, episode  # graded: the task is not fixed
        detail = (await client.get(f"/api/v1/episodes/{episode['id']}", params={"arrays": "json"},
                                   headers=auth())).json()
        page = await client.get(f"/episodes/{episode['id']}", headers=auth())
    turns = detail["turns"]
    assert detail["report"]["resolution"] == "NO"
    assert [t["tool_call"]["name"] for t in turns] == ["bash"] * 2 + ["str_replace_editor"] * 2 + ["submit"]
    assert turns[0]["observation"] == "a\u2400b\ufffd\u241b[31mred\n\n[exit code 0]"
    assert turns[1]["observation"] == "\u2421ELF\u2400\u2400\u2401\ufffd\ufffd\n[exit code 0]"
    assert turns[2]["observation"] == "/tmp/blob is a binary file (9 bytes); it cannot be shown as text."
    assert turns[3]["observation"].startswith("     1\t\u2421ELF\u2400")
    assert page.status_code == 200 and "a\u2400b\ufffd\u241b[31mred" in page.text
    assert "\x00" not in page.text and "\x1b" not in page.text
    # the model was shown the bytes themselves: the next turn's input tokens hold them, not the pictures
    tok = AutoTokenizer.from_pretrained(tokenizer)
    shown = tok.decode(turns[1]["input_ids"])
    assert "a\x00b\ufffd\x1b[31mred\n" in shown and "\u2400" not in shown
    assert "\x7fELF\x00\x00\x01\ufffd\ufffd" in tok.decode(turns[2]["input_ids"])


async def test_a_gamed_grader_is_recorded_counted_and_shown(worker, tmp_path):
    """A policy that plants a conftest hook making every test pass, through the API, Redis, a
    worker, bubblewrap and PostgreSQL: reward 0, the guard on the episode, counted on the run."""
    db_url, data_dir = worker
    hook = ("import pytest\n\n@pytest.hookimpl(hookwrapper=True)\ndef pytest_runtest_makereport(item, call):\n"
            "    outcome = yield\n    outcome.get_result().outcome = 'passed'\n")
    calls = [{"name": "str_replace_editor", "arguments": {"command": "create", "path": "conftest.py", "file_text": hook}}]
    async with client_for(make_settings(db_url, broker_url=BROKER, data_dir=data_dir)) as client:
        run_id = await replay_run(client, init_tiny(tmp_path / "tiny"), calls)
        state = await wait_for_run(client, run_id, timeout_s=180, log=data_dir / "worker.log")
        [episode] = (await client.get(f"/api/v1/runs/{run_id}/episodes")).json()["items"]
        detail = (await client.get(f"/api/v1/episodes/{episode['id']}")).json()
        run_page = await client.get(f"/runs/{run_id}")
        episode_page = await client.get(f"/episodes/{episode['id']}")
    assert state["status"] == "finished" and state["guarded"] == 1, state
    assert episode["reward"] == 0.0 and episode["guards"] == ["reverted"], episode
    assert detail["report"]["guards"] == [{"guard": "reverted", "detail": "conftest.py"}]  # shown without the token
    assert 'data-field="guarded">1<' in run_page.text
    assert "integrity guards fired" in episode_page.text and "conftest.py" in episode_page.text


@pytest.fixture
def refusing_worker(empty_pg_url, tmp_path):
    """A worker on a database that refuses, for good, turns whose observation and episodes whose
    diff hold the word "forbidden-word" (CHECK constraints: writes no retry can make succeed)."""
    db.upgrade(empty_pg_url)
    engine = db.make_engine(empty_pg_url)
    with engine.begin() as conn:
        conn.execute(sa.text("ALTER TABLE turns ADD CONSTRAINT refuse CHECK (observation NOT LIKE '%forbidden-word%')"))
        conn.execute(sa.text("ALTER TABLE episodes ADD CONSTRAINT refuse CHECK (diff NOT LIKE '%forbidden-word%')"))
    engine.dispose()
    with running_worker(empty_pg_url, tmp_path) as handle:
        yield handle


@pytest.mark.parametrize(("calls", "n_turns", "refused"), [
    ([{"name": "bash", "arguments": {"command": "echo fine"}},
      {"name": "bash", "arguments": {"command": "echo forbidden-word"}}], 1, "turn 1 of episode"),
    ([{"name": "bash", "arguments": {"command": "echo forbidden-word > NOTE.txt"}}], 2, "end of episode"),
])
async def test_a_write_the_database_refuses_ends_the_episode(refusing_worker, tmp_path, calls, n_turns, refused):
    """A non-transient database error (not a lost connection) ends the episode storage_error
    with the database's reason, once: no new attempt, no run that never finishes."""
    db_url, data_dir = refusing_worker
    tokenizer = init_tiny(tmp_path / "tiny")
    async with client_for(make_settings(db_url, broker_url=BROKER, data_dir=data_dir)) as client:
        run_id = await replay_run(client, tokenizer, calls)
        state = await wait_for_run(client, run_id, timeout_s=180, log=data_dir / "worker.log")
        assert state["status"] == "finished" and state["episodes"] == {"storage_error": 1}, state
        [episode] = (await client.get(f"/api/v1/runs/{run_id}/episodes", headers=auth())).json()["items"]
        detail = (await client.get(f"/api/v1/episodes/{episode['id']}", headers=auth())).json()
    assert (episode["attempt"], episode["n_turns"], len(detail["turns"])) == (0, n_turns, n_turns), episode
    assert episode["error_type"] == "StorageError" and refused in episode["error_message"]
    assert 'violates check constraint "refuse"' in episode["error_message"]
    assert detail["diff"] is None and detail["report"] is None
