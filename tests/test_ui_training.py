"""A training run as the API and the UI show it: its steps, its evaluations (pass@1 with its
interval, pass@k, format errors) with the policies, the pass rate per task and epoch, and a
group's samples side by side with their advantages; untrusted text escaped."""

from __future__ import annotations

import uuid

import pytest
import sqlalchemy as sa

from service.control.orchestrator import _tick
from service.store import db
from service.store.records import TurnRecord
from service.store.buffer import Buffer
from service.store.tables import Episode, Group, Policy, Run, utcnow
from tests.conftest import auth, client_for, make_settings
from tests.test_orchestrator import make_suite
from tests.test_training_runs import training_run
from tests.ui_data import XSS, hold


async def finish(engine, group_id, rewards, tool_call=True) -> None:
    async with engine.connect() as conn:
        ids = (await conn.execute(sa.select(Episode.id).where(Episode.group_id == group_id)
                                  .order_by(Episode.sample_index))).scalars().all()
    buffer = Buffer(engine)
    for episode_id, reward in zip(ids, rewards):
        async with engine.begin() as conn:
            await conn.execute(sa.update(Episode).where(Episode.id == episode_id).values(status="running"))
        for idx in range(2):  # one well-formed tool call, one malformed
            await buffer.append_turn(episode_id, TurnRecord(
                idx=idx, segment=0, input_ids=[1, 2], output_ids=[3, 4], output_logprobs=[-0.1, -0.2],
                policy_version=0, policy_version_end=0, finish_reason="stop", text=XSS,
                tool_call={"name": "bash", "arguments": {"command": "ls"}} if idx == 0 and tool_call else None,
                observation="o", generation_s=0.0, tool_s=0.0))
        await buffer.finish_episode(episode_id, status="submitted", reward=reward, policy_version_min=0,
                                    policy_version_max=0, n_turns=2, diff=f"--- a/x\n+++ b/x\n+{XSS}\n")


async def build_training(engine) -> tuple[uuid.UUID, uuid.UUID, uuid.UUID]:
    """A training run at step 1 of 2: one trained group (rewards 1, 0), the evaluation of v0
    finished (one task solved twice, one never, with malformed tool calls). Returns the run, its
    group and the evaluation."""
    held_out = await make_suite(engine, 2)
    run_id, cfg = await training_run(engine, steps=2, eval={"suite_id": str(held_out), "every": 2,
                                                            "samples_per_task": 2})
    cfg = cfg.model_copy(update={"groups_per_step": None})
    sent = []
    await _tick(engine, run_id, cfg, sent.append, "o", 15.0, fleet_version=0, kind="train")
    async with engine.begin() as conn:
        await conn.execute(sa.insert(Policy).values(version=0, created_at=utcnow(), trainer_step=0))
    await _tick(engine, run_id, cfg, sent.append, "o", 15.0, fleet_version=0, kind="train")
    async with engine.connect() as conn:
        groups = (await conn.execute(sa.select(Group.id).where(Group.run_id == run_id, Group.status == "pending")
                                     .order_by(Group.seq))).scalars().all()
        eval_run = await conn.scalar(sa.select(Run.id).where(Run.kind == "eval"))
        eval_groups = (await conn.execute(sa.select(Group.id).where(Group.run_id == eval_run))).scalars().all()
    for run in (run_id, eval_run):  # stepped here by hand (as owner "o"), not by a service's orchestrator
        await hold(engine, run)
    await finish(engine, groups[0], [1.0, 0.0])
    await finish(engine, eval_groups[0], [1.0, 1.0])
    await finish(engine, eval_groups[1], [0.0, 0.0], tool_call=False)
    async with engine.begin() as conn:
        await conn.execute(sa.insert(Policy).values(version=1, created_at=utcnow(), trainer_step=1, info={
            "run_id": str(run_id), "reward_mean": 0.5, "mismatch_kl": 0.001, "entropy": 2.0, "groups": 2,
            "zero_advantage_groups": 1, "staleness_mean": 0.0, "wait_s": 3.0, "step_s": 1.0, "publish_s": 0.5}))
        await conn.execute(sa.update(Run).where(Run.id == eval_run).values(status="finished"))
    return run_id, groups[0], eval_run


@pytest.fixture
async def trained(db_url):
    engine = db.make_async_engine(db_url)
    try:
        run_id, group_id, eval_run = await build_training(engine)
    finally:
        await engine.dispose()
    async with client_for(make_settings(db_url)) as client:
        client.headers.update(auth())
        yield client, run_id, group_id, eval_run


async def test_the_api_reports_steps_evaluations_and_difficulty(trained):
    client, run_id, group_id, eval_run = trained
    run = (await client.get(f"/api/v1/runs/{run_id}")).json()
    t = run["training"]
    assert run["kind"] == "train" and t["step"] == 1 and t["last_step"] == 2
    assert t["steps"][0]["useful_fraction"] == 0.5 and t["steps"][0]["wait_s"] == 3.0
    [ev] = t["evals"]
    assert ev["run_id"] == str(eval_run) and ev["policy_version"] == 0 and ev["status"] == "finished"
    assert ev["pass_at_1"] == 0.5 and ev["pass_at_k"] == 0.5 and ev["k"] == 2
    low, high = ev["pass_at_1_ci"]
    assert low < 0.5 < high
    assert ev["format_error_rate"] == 0.75  # 6 of 8 turns carry no well-formed tool call
    assert ev["mean_turns"] == 2.0 and ev["versions_sampled"] == [0, 0]
    policies = (await client.get("/api/v1/policies")).json()["items"]
    assert [p["version"] for p in policies] == [1, 0]
    assert policies[1]["evals"][0]["pass_at_1"] == 0.5 and policies[0]["evals"] == []
    evaluation = (await client.get(f"/api/v1/runs/{eval_run}")).json()
    assert evaluation["kind"] == "eval" and evaluation["parent_id"] == str(run_id) and evaluation["policy_version"] == 0
    difficulty = (await client.get(f"/api/v1/runs/{run_id}/tasks")).json()
    rates = {t["instance_id"]: t["pass_rate"] for t in difficulty["tasks"]}
    assert sorted(r[0] for r in rates.values() if r[0] is not None) == [0.5]
    group = (await client.get(f"/api/v1/groups/{group_id}")).json()
    assert [e["advantage"] for e in group["episodes"]] == [0.5, -0.5] and group["teaches"] is True
    assert (await client.get(f"/api/v1/groups/{uuid.uuid4()}")).status_code == 404


async def test_the_pages_draw_it_and_escape_what_agents_wrote(trained):
    client, run_id, group_id, eval_run = trained
    html = (await client.get(f"/runs/{run_id}")).text
    for part in ('id="chart-train-reward"', 'id="chart-train-time"', 'id="evals"', 'id="difficulty"',
                 f'href="/runs/{eval_run}"', f'href="/groups/{group_id}"', "0.500 ["):
        assert part in html, part
    assert "evaluation of policy v0" in (await client.get(f"/runs/{eval_run}")).text
    page = (await client.get(f"/groups/{group_id}")).text
    assert page.count('class="sample"') == 2 and "+0.500" in page and "-0.500" in page
    assert "<script>window.__xss" not in page and "&lt;script&gt;window.__xss = 1&lt;/script&gt;" in page
