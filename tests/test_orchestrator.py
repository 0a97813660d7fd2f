"""Orchestrator and episode-start logic on both databases, without workers: one owner per run,
staleness gating, groups started together, attempts fenced against zombie workers."""

from __future__ import annotations

import asyncio
import uuid
from datetime import timedelta

import pytest
import sqlalchemy as sa

from service.store import db
from service.store.records import TurnRecord
from service.store.buffer import Buffer, Superseded
from service.control.orchestrator import Supervisor, _tick, orchestrate
from service.worker.executor import _start
from service.control.runs import create_run
from service.worker.config import RunConfig
from service.store.tables import Episode, Group, Policy, Run, Suite, Task, utcnow


@pytest.fixture
async def engine(db_url):
    engine = db.make_async_engine(db_url)
    yield engine
    await engine.dispose()


async def make_suite(engine, n_tasks: int = 3) -> uuid.UUID:
    suite_id = uuid.uuid4()
    async with engine.begin() as conn:
        await conn.execute(sa.insert(Suite).values(id=suite_id, name=f"s-{suite_id.hex[:6]}", task_count=n_tasks,
                                                   created_at=utcnow()))
        await conn.execute(sa.insert(Task), [{
            "id": uuid.uuid4(), "suite_id": suite_id, "position": i, "instance_id": f"t-{i}", "repo": "r/r",
            "base_commit": "0" * 40, "problem_statement": "p", "patch": "", "test_patch": "",
            "fail_to_pass": [], "pass_to_pass": [], "log_parser": "pytest"} for i in range(n_tasks)])
    return suite_id


async def make_run(engine, sampler: str = "vllm", **overrides) -> uuid.UUID:
    suite_id = await make_suite(engine)
    pol = {"type": "vllm", "endpoints": ["http://127.0.0.1:9"], "tokenizer": "/nonexistent"} if sampler == "vllm" \
        else {"type": "oracle", "tokenizer": "/nonexistent"}
    cfg = RunConfig.model_validate({"suite_id": suite_id, "sampler": pol, "samples_per_task": 2,
                                    "concurrency": 100} | overrides)
    return await create_run(engine, cfg)


async def config(engine, run_id) -> RunConfig:
    async with engine.connect() as conn:
        return RunConfig.model_validate(await conn.scalar(sa.select(Run.config).where(Run.id == run_id)))


async def statuses(engine, run_id) -> dict[str, int]:
    async with engine.connect() as conn:
        rows = (await conn.execute(sa.select(Episode.status, sa.func.count()).where(Episode.run_id == run_id)
                                   .group_by(Episode.status))).all()
    return dict(rows)


async def publish(engine, *versions: int) -> None:
    async with engine.begin() as conn:
        await conn.execute(sa.insert(Policy), [{"version": v, "created_at": utcnow()} for v in versions])


async def test_one_owner_per_run_and_takeover_after_the_lease(engine):
    run_id = await make_run(engine, sampler="oracle")
    cfg = await config(engine, run_id)
    sent_a, sent_b = [], []
    assert await _tick(engine, run_id, cfg, sent_a.append, "a", 15.0, None) is None
    assert len(sent_a) == 6
    # b cannot take the run while a's lease is fresh
    assert await _tick(engine, run_id, cfg, sent_b.append, "b", 15.0, None) == "not owner"
    assert await orchestrate(engine, run_id, sent_b.append, owner="b", poll_s=0.01) is None
    assert sent_b == []
    async with engine.begin() as conn:  # a dies: its lease lapses
        await conn.execute(sa.update(Run).values(owner_heartbeat_at=utcnow() - timedelta(seconds=60)))
    assert await _tick(engine, run_id, cfg, sent_b.append, "b", 15.0, None, takeover=True) is None
    # the new owner sends every queued episode again (a's messages may be lost); duplicates are harmless
    assert sorted(sent_b) == sorted(sent_a)
    assert await _tick(engine, run_id, cfg, sent_a.append, "a", 15.0, None) == "not owner"
    async with engine.connect() as conn:
        assert await conn.scalar(sa.select(Run.owner).where(Run.id == run_id)) == "b"


async def test_supervisor_takes_over_orphaned_runs_and_releases_on_close(engine):
    run_id = await make_run(engine, sampler="oracle")
    async with engine.begin() as conn:
        await conn.execute(sa.update(Run).values(owner="dead:1:x", owner_heartbeat_at=utcnow() - timedelta(seconds=60)))
    sent = []
    supervisor = Supervisor(engine, sent.append, owner="me", poll_s=0.01)
    await supervisor.scan()
    for _ in range(200):
        if len(sent) >= 6:
            break
        import asyncio

        await asyncio.sleep(0.01)
    assert len(sent) == 6
    await supervisor.close()
    async with engine.connect() as conn:
        assert await conn.scalar(sa.select(Run.owner).where(Run.id == run_id)) is None


async def test_fleet_behind_the_trainer_holds_back_new_groups(engine):
    run_id = await make_run(engine, max_off_policy_steps=2, concurrency=1)
    cfg = await config(engine, run_id)
    await publish(engine, 0, 1, 2, 3, 4, 5)
    sent = []
    assert await _tick(engine, run_id, cfg, sent.append, "o", 15.0, fleet_version=2) is None
    assert sent == []  # trainer at 5, fleet at 2: 3 > 2 steps behind
    async with engine.connect() as conn:
        gate = await conn.scalar(sa.select(Run.gate).where(Run.id == run_id))
    assert "fleet serves policy version 2, trainer is at 5" in gate
    assert await _tick(engine, run_id, cfg, sent.append, "o", 15.0, fleet_version=3) is None
    assert len(sent) == 1  # caught up to within 2 steps: launching resumes
    async with engine.connect() as conn:
        assert await conn.scalar(sa.select(Run.gate).where(Run.id == run_id)) is None


async def test_gated_run_still_completes_started_groups(engine):
    run_id = await make_run(engine, max_off_policy_steps=0, concurrency=1)
    cfg = await config(engine, run_id)
    sent = []
    await _tick(engine, run_id, cfg, sent.append, "o", 15.0, fleet_version=0)
    assert len(sent) == 1
    await publish(engine, 0, 1)  # the trainer moves on: new groups wait, the started one completes
    async with engine.begin() as conn:
        await conn.execute(sa.update(Episode).where(Episode.id == uuid.UUID(sent[0])).values(status="submitted"))
    await _tick(engine, run_id, cfg, sent.append, "o", 15.0, fleet_version=0)
    async with engine.connect() as conn:
        groups = (await conn.execute(sa.select(Episode.group_id).where(
            Episode.id.in_([uuid.UUID(s) for s in sent])))).scalars().all()
    assert len(sent) == 2 and len(set(groups)) == 1


async def test_groups_per_step_bounds_the_backlog(engine):
    run_id = await make_run(engine, max_off_policy_steps=0, groups_per_step=1)
    cfg = await config(engine, run_id)
    sent = []
    await _tick(engine, run_id, cfg, sent.append, "o", 15.0, fleet_version=0)
    assert len(sent) == 2  # one group (both samples); (0 + 1) x 1 group may wait for the trainer
    buffer = Buffer(engine)
    for episode_id in sent:
        await buffer.finish_episode(uuid.UUID(episode_id), status="submitted", policy_version_min=0)
    await _tick(engine, run_id, cfg, sent.append, "o", 15.0, fleet_version=0)
    assert len(sent) == 2  # its group is ready but not trained on yet
    claim = await buffer.claim(1, trainer_step=0, max_staleness=0)
    await buffer.commit(claim, trainer_step=0)
    await _tick(engine, run_id, cfg, sent.append, "o", 15.0, fleet_version=0)
    assert len(sent) == 4


async def test_scripted_runs_are_never_gated(engine):
    run_id = await make_run(engine, sampler="oracle", max_off_policy_steps=0, groups_per_step=1)
    await publish(engine, 0, 1, 2)
    sent = []
    await _tick(engine, run_id, await config(engine, run_id), sent.append, "o", 15.0, fleet_version=None)
    assert len(sent) == 6


def turn(idx: int) -> TurnRecord:
    return TurnRecord(idx=idx, segment=0, input_ids=[1, 2], output_ids=[3], output_logprobs=[-0.1],
                      policy_version=0, policy_version_end=0, finish_reason="stop", text="x", tool_call=None,
                      observation="o", generation_s=0.0, tool_s=0.0)


async def test_a_zombie_attempt_can_write_nothing(engine):
    run_id = await make_run(engine, sampler="oracle")
    async with engine.begin() as conn:
        episode_id = await conn.scalar(sa.select(Episode.id).where(Episode.run_id == run_id).limit(1))
        await conn.execute(sa.update(Episode).where(Episode.id == episode_id).values(status="queued"))
    _, _, first = await _start(engine, episode_id)
    buffer = Buffer(engine)
    await buffer.append_turn(episode_id, turn(0), attempt=first)
    assert await _start(engine, episode_id) is None  # a duplicate message: the live attempt keeps it
    async with engine.begin() as conn:  # the worker went quiet: its heartbeat is stale
        await conn.execute(sa.update(Episode).where(Episode.id == episode_id)
                           .values(heartbeat_at=utcnow() - timedelta(hours=1)))
    _, _, second = await _start(engine, episode_id)
    assert second == first + 1
    with pytest.raises(Superseded):  # the old worker wakes up and tries to go on
        await buffer.append_turn(episode_id, turn(1), attempt=first)
    assert not await buffer.finish_episode(episode_id, attempt=first, status="submitted")
    await buffer.append_turn(episode_id, turn(0), attempt=second)
    assert await buffer.finish_episode(episode_id, attempt=second, status="submitted")
    async with engine.connect() as conn:
        from service.store.tables import Turn

        turns = (await conn.execute(sa.select(Turn.idx).where(Turn.episode_id == episode_id))).scalars().all()
        group = await conn.scalar(sa.select(Group.status).join(Episode, Episode.group_id == Group.id)
                                  .where(Episode.id == episode_id))
    assert turns == [0] and group == "pending"  # the other sample of the group is not final


async def test_a_process_running_two_attempts_of_one_episode_stops_the_old_one(engine):
    """A worker whose heartbeat lapsed under load is handed the episode's next attempt while its
    old attempt still runs: the shared heartbeat tells the old one it was superseded (and keeps
    beating for the new one), instead of the new attempt taking over the old one's entry."""
    import asyncio

    from service.worker.executor import Heartbeat, _supervised

    run_id = await make_run(engine, sampler="oracle")
    async with engine.begin() as conn:
        episode_id = await conn.scalar(sa.select(Episode.id).where(Episode.run_id == run_id).limit(1))
        await conn.execute(sa.update(Episode).where(Episode.id == episode_id).values(status="queued"))
    _, _, first = await _start(engine, episode_id)
    never = asyncio.get_running_loop().create_future()
    old = asyncio.ensure_future(_supervised(engine, run_id, episode_id, first, never, poll_s=0.05))
    await asyncio.sleep(0.2)
    async with engine.begin() as conn:  # presumed dead: the orchestrator restarts it
        await Buffer.restart_attempts(conn, [episode_id])
    _, _, second = await _start(engine, episode_id)
    release = asyncio.get_running_loop().create_future()
    new = asyncio.ensure_future(_supervised(engine, run_id, episode_id, second, release, poll_s=0.05))
    result = await asyncio.wait_for(old, 10)
    assert result.status == "superseded" and never.cancelled()
    assert not new.done()  # the live attempt is still watched and beating
    async with engine.connect() as conn:
        beat = await conn.scalar(sa.select(Episode.heartbeat_at).where(Episode.id == episode_id))
    await asyncio.sleep(0.3)
    async with engine.connect() as conn:
        assert await conn.scalar(sa.select(Episode.heartbeat_at).where(Episode.id == episode_id)) > beat
    from service.worker.agent import EpisodeResult

    release.set_result(EpisodeResult(status="submitted"))
    assert (await asyncio.wait_for(new, 10)).status == "submitted"
    assert Heartbeat.of(engine, 0.05).episodes == {}


async def test_lost_workers_episodes_go_back_to_queued_as_a_new_attempt(engine):
    run_id = await make_run(engine, sampler="oracle", worker_timeout_s=5)
    cfg = await config(engine, run_id)
    sent = []
    await _tick(engine, run_id, cfg, sent.append, "o", 15.0, None)
    episode_id = uuid.UUID(sent[0])
    _, _, attempt = await _start(engine, episode_id)
    await Buffer(engine).append_turn(episode_id, turn(0), attempt=attempt)
    async with engine.begin() as conn:
        await conn.execute(sa.update(Episode).where(Episode.id == episode_id)
                           .values(heartbeat_at=utcnow() - timedelta(seconds=30)))
    sent.clear()
    await _tick(engine, run_id, cfg, sent.append, "o", 15.0, None)
    assert sent == [str(episode_id)]
    async with engine.connect() as conn:
        row = (await conn.execute(sa.select(Episode.status, Episode.attempt).where(Episode.id == episode_id))).one()
        from service.store.tables import Turn

        n_turns = await conn.scalar(sa.select(sa.func.count()).select_from(Turn).where(Turn.episode_id == episode_id))
    assert (row.status, row.attempt, n_turns) == ("queued", attempt + 1, 0)
    assert (await statuses(engine, run_id)) == {"queued": 6}


class NotVLLMServer:
    """An OpenAI-compatible server that is not vLLM (or a wrong URL answering 200): its
    /v1/models has no `data` list."""

    def __init__(self):
        import http.server
        import threading

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 - http.server's name
                body = b'{"object": "list", "models": ["gpt-x"]}'
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


async def run_row(engine, run_id):
    async with engine.connect() as conn:
        return (await conn.execute(sa.select(Run.status, Run.error, Run.owner).where(Run.id == run_id))).one()


@pytest.mark.parametrize("cancel", [False, True])
async def test_an_endpoint_that_is_not_vllm_ends_the_run_with_why(engine, cancel):
    server = NotVLLMServer()
    try:
        run_id = await make_run(engine, sampler="vllm")
        async with engine.begin() as conn:
            cfg = await conn.scalar(sa.select(Run.config).where(Run.id == run_id))
            cfg["sampler"]["endpoints"] = [server.url]
            await conn.execute(sa.update(Run).where(Run.id == run_id).values(config=cfg))
            if cancel:
                await Buffer.request_cancel(conn, run_id)
        sent = []
        status = await asyncio.wait_for(orchestrate(engine, run_id, sent.append, owner="a", poll_s=0.01), 30)
        row = await run_row(engine, run_id)
        assert status == row.status == ("cancelled" if cancel else "failed") and row.owner is None
        assert "sampler.endpoints" in row.error and "not a vLLM server" in row.error and server.url in row.error
        assert sent == [] and await statuses(engine, run_id) == {"cancelled": 6}
    finally:
        server.close()


@pytest.mark.parametrize("cancel", [False, True])
async def test_an_error_on_every_tick_ends_the_run_instead_of_retrying_forever(engine, monkeypatch, cancel):
    from service.control import orchestrator

    run_id = await make_run(engine, sampler="oracle")
    if cancel:
        async with engine.begin() as conn:
            await Buffer.request_cancel(conn, run_id)
    ticks = []

    async def broken(*args, **kwargs):
        ticks.append(1)
        raise KeyError("data")

    monkeypatch.setattr(orchestrator, "_lost", broken)
    status = await asyncio.wait_for(orchestrate(engine, run_id, [].append, owner="a", poll_s=0.01), 30)
    row = await run_row(engine, run_id)
    assert status == row.status == ("cancelled" if cancel else "failed") and len(ticks) == orchestrator.MAX_ERRORS
    assert f"failed {orchestrator.MAX_ERRORS} times in a row: KeyError" in row.error
    assert await statuses(engine, run_id) == {"cancelled": 6}


async def test_a_database_blip_is_retried_not_a_failed_run(engine, monkeypatch):
    from sqlalchemy.exc import OperationalError

    from service.control import orchestrator

    run_id = await make_run(engine, sampler="oracle")

    async def blip(*args, **kwargs):
        raise OperationalError("SELECT 1", {}, ConnectionError("server closed the connection"))

    monkeypatch.setattr(orchestrator, "_lost", blip)
    with pytest.raises(OperationalError):  # to the supervisor, whose next scan starts it again
        await orchestrate(engine, run_id, [].append, owner="a", poll_s=0.01)
    row = await run_row(engine, run_id)
    assert row.status == "running" and row.error is None


async def test_a_stored_config_that_no_longer_validates_fails_the_run(engine):
    run_id = await make_run(engine, sampler="oracle")
    async with engine.begin() as conn:
        await conn.execute(sa.update(Run).where(Run.id == run_id).values(config={"suite_id": "not a uuid"}))
    assert await orchestrate(engine, run_id, [].append, owner="a", poll_s=0.01) == "failed"
    row = await run_row(engine, run_id)
    assert row.status == "failed" and "stored config is no longer valid" in row.error and "sampler" in row.error


async def test_an_episode_the_worker_cannot_run_is_final_and_the_run_fails_with_why(engine, tmp_path):
    """A tokenizer folder that is gone (created before the check, or removed since) ends each
    episode as worker_error with the reason, and the failure stop ends the run with it, instead
    of a redelivery loop with an empty error."""
    from service.config import load_settings
    from service.worker.executor import execute_episode

    run_id = await make_run(engine, sampler="oracle", max_consecutive_failures=2, concurrency=2)
    async with engine.begin() as conn:  # rows the worker can read (make_suite's have no tests to fail)
        await conn.execute(sa.update(Task).values(fail_to_pass=["t::a"]))
    cfg = await config(engine, run_id)
    sent = []
    assert await _tick(engine, run_id, cfg, sent.append, "a", 15.0, None) is None
    settings = load_settings(data_dir=tmp_path)
    for episode_id in sent:
        assert await execute_episode(engine, settings, uuid.UUID(episode_id)) == "worker_error"
    async with engine.connect() as conn:
        errors = (await conn.execute(sa.select(Episode.error_type, Episode.error_message)
                                     .where(Episode.status == "worker_error"))).all()
    assert len(errors) == 2 and all(e.error_type == "ConfigError" for e in errors)
    assert all("sampler.tokenizer: /nonexistent cannot be loaded" in e.error_message for e in errors)
    assert await _tick(engine, run_id, cfg, sent.append, "a", 15.0, None) == "failed"
    row = await run_row(engine, run_id)
    assert "the last 2 episodes failed" in row.error and "sampler.tokenizer" in row.error
