"""Hostile data for the UI tests: everything an agent or a task can write, full of markup."""

from __future__ import annotations

import uuid
from datetime import timedelta

import sqlalchemy as sa

from service.store.records import TurnRecord
from service.store.buffer import Buffer
from service.control.runs import create_run
from service.worker.config import RunConfig
from service.store.tables import Episode, Run, Suite, Task, utcnow

XSS = ('<script>window.__xss = 1</script><img src=x onerror="window.__xss = 2">'
       '<a id="evil" href="javascript:window.__xss = 3">click me</a><svg onload="window.__xss = 4"></svg>')


async def hold(engine, run_id: uuid.UUID) -> None:
    """Take the run's lease for a day, as a live orchestrator elsewhere would: a service's
    scanner adopts active runs that nobody owns, and would run the episodes a test writes."""
    async with engine.begin() as conn:
        await conn.execute(sa.update(Run).where(Run.id == run_id).values(
            owner="tests-writing-it", owner_heartbeat_at=utcnow() + timedelta(days=1)))


async def hostile_run(engine, n_turns: int = 3) -> tuple[uuid.UUID, list[uuid.UUID]]:
    """A suite whose problem statement, and a finished run whose model text, tool calls,
    observations, diff and grading report all carry XSS payloads. Returns (run, episodes)."""
    suite_id = uuid.uuid4()
    async with engine.begin() as conn:
        await conn.execute(sa.insert(Suite).values(id=suite_id, name=f"hostile-{suite_id.hex[:6]}", task_count=2,
                                                   created_at=utcnow()))
        await conn.execute(sa.insert(Task), [{
            "id": uuid.uuid4(), "suite_id": suite_id, "position": i, "instance_id": f"evil__{i}{XSS[:40]}",
            "repo": "evil/repo", "base_commit": "0" * 40, "problem_statement": f"Fix this: {XSS}", "patch": "",
            "test_patch": "", "fail_to_pass": [f"tests/test_x.py::test_{XSS[:30]}"], "pass_to_pass": [],
            "log_parser": "pytest"} for i in range(2)])
    cfg = RunConfig.model_validate({"suite_id": suite_id, "name": f"run {XSS}", "samples_per_task": 2,
                                    "sampler": {"type": "oracle", "tokenizer": "/nonexistent"}})
    run_id = await create_run(engine, cfg)
    await hold(engine, run_id)  # written here turn by turn, not run by a service's worker
    buffer = Buffer(engine)
    async with engine.connect() as conn:
        episodes = (await conn.execute(sa.select(Episode.id).where(Episode.run_id == run_id)
                                       .order_by(Episode.created_at, Episode.sample_index))).scalars().all()
    for n, episode_id in enumerate(episodes):
        for idx in range(n_turns):
            await buffer.append_turn(episode_id, TurnRecord(
                idx=idx, segment=0, input_ids=[1, 2, 3], output_ids=[4, 5], output_logprobs=[-0.1, -0.2],
                policy_version=0, policy_version_end=0, finish_reason="stop", text=f"turn {idx} says {XSS}",
                tool_call={"name": "bash", "arguments": {"command": f"echo '{XSS}'"}},
                observation=f"observation {idx}: {XSS}" + ("x" * 3000 if idx == 1 else ""),
                generation_s=0.5, tool_s=0.1))
        await buffer.finish_episode(
            episode_id, status="submitted", reward=float(n % 2), n_turns=n_turns, input_tokens=9, output_tokens=6,
            policy_version_min=0, policy_version_max=0, diff=f"diff --git a/x b/x\n--- a/x\n+++ b/x\n@@ -1 +1 @@\n-old\n+{XSS}\n",
            report={"resolution": "FULL" if n % 2 else "NO",
                    "fail_to_pass": {"success": [f"t::{XSS}"] if n % 2 else [], "failure": [] if n % 2 else [f"t::{XSS}"]},
                    "pass_to_pass": {"success": [], "failure": []}, "log_tail": XSS})
    async with engine.begin() as conn:
        await conn.execute(sa.update(Run).where(Run.id == run_id).values(status="finished", finished_at=utcnow()))
    return run_id, list(episodes)
