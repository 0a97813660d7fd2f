"""A training run's orchestration on both databases, without workers or a trainer: groups made
lazily in each epoch's shuffled order, bounded by the staleness gate and the schedule; the
difficulty filter; evaluations started per due version and never handed to a trainer; the
run's end."""

from __future__ import annotations

import uuid

import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncSession

from service.control import views
from service.control.orchestrator import _tick
from service.control.runs import RunError, create_run
from service.control.schedule import epoch_order
from service.store import db
from service.store.buffer import Buffer
from service.store.tables import Episode, Group, Policy, Run, Task, utcnow
from service.worker.config import RunConfig
from tests.test_orchestrator import make_suite

VLLM = {"type": "vllm", "endpoints": ["http://127.0.0.1:9"], "tokenizer": "/nonexistent"}


@pytest.fixture
async def engine(db_url):
    engine = db.make_async_engine(db_url)
    yield engine
    await engine.dispose()


async def training_run(engine, n_tasks: int = 3, **training) -> tuple[uuid.UUID, RunConfig]:
    suite_id = await make_suite(engine, n_tasks)
    cfg = RunConfig.model_validate({"suite_id": suite_id, "sampler": VLLM, "samples_per_task": 2, "concurrency": 4,
                                    "max_off_policy_steps": 0, "groups_per_step": 1,
                                    "training": {"steps": 3, "seed": 5} | training})
    return await create_run(engine, cfg), cfg


async def groups(engine, run_id) -> list:
    async with engine.connect() as conn:
        return (await conn.execute(sa.select(Group.seq, Group.epoch, Task.position, Group.status, Group.id,
                                             Group.dropped_reason)
                                   .join(Task, Task.id == Group.task_id).where(Group.run_id == run_id)
                                   .order_by(Group.seq))).all()


async def finish_group(engine, group_id, rewards: list[float]) -> None:
    async with engine.connect() as conn:
        ids = (await conn.execute(sa.select(Episode.id).where(Episode.group_id == group_id)
                                  .order_by(Episode.sample_index))).scalars().all()
    for episode_id, reward in zip(ids, rewards):
        async with engine.begin() as conn:
            await conn.execute(sa.update(Episode).where(Episode.id == episode_id).values(status="running"))
        await Buffer(engine).finish_episode(episode_id, status="submitted", reward=reward, policy_version_min=0)


async def publish(engine, version: int) -> None:
    async with engine.begin() as conn:
        await conn.execute(sa.insert(Policy).values(version=version, created_at=utcnow(), trainer_step=version,
                                                    info={}))


async def test_a_training_run_starts_empty_and_adds_groups_as_the_gate_allows(engine):
    run_id, cfg = await training_run(engine, epochs=2)
    assert await groups(engine, run_id) == []  # nothing of the future is written up front
    sent = []
    assert await _tick(engine, run_id, cfg, sent.append, "o", 15.0, fleet_version=0, kind="train") is None
    made = await groups(engine, run_id)
    # (max_off_policy_steps + 1) x groups_per_step = 1 group may wait for the trainer: one group, both samples
    assert len(made) == 1 and len(sent) == 2
    assert made[0].position == epoch_order(3, 0, seed=5)[0]
    await finish_group(engine, made[0].id, [1.0, 0.0])
    claim = await Buffer(engine).claim(1, trainer_step=0, max_staleness=0, run_id=run_id)
    await Buffer(engine).commit(claim, trainer_step=1)
    for _ in range(6):  # the trainer takes each group as soon as it is ready
        await _tick(engine, run_id, cfg, sent.append, "o", 15.0, fleet_version=0, kind="train")
        for g in await groups(engine, run_id):
            if g.status == "pending":
                await finish_group(engine, g.id, [0.0, 1.0])
                claim = await Buffer(engine).claim(1, trainer_step=0, max_staleness=0, run_id=run_id)
                await Buffer(engine).commit(claim, trainer_step=1)
    made = await groups(engine, run_id)
    # two epochs over 3 tasks, each epoch in its own shuffled order, then the schedule is done
    assert [g.seq for g in made] == list(range(6))
    assert [g.epoch for g in made] == [0, 0, 0, 1, 1, 1]
    assert [g.position for g in made] == epoch_order(3, 0, seed=5) + epoch_order(3, 1, seed=5)
    async with engine.connect() as conn:
        assert await conn.scalar(sa.select(Run.exhausted_at).where(Run.id == run_id)) is not None
    assert await Buffer(engine).schedule_done(run_id)


async def test_the_filter_skips_solved_tasks_and_counts_them(engine):
    run_id, cfg = await training_run(engine, n_tasks=2, filter={"skip_solved": True, "min_groups": 1,
                                                                "retry_prob": 0.0})
    cfg = cfg.model_copy(update={"groups_per_step": None})
    sent = []
    await _tick(engine, run_id, cfg, sent.append, "o", 15.0, fleet_version=0, kind="train")
    first = await groups(engine, run_id)
    assert len(first) == 2  # room for 4 episodes: two groups of the first epoch
    solved, unsolved = first
    await finish_group(engine, solved.id, [1.0, 1.0])
    await finish_group(engine, unsolved.id, [0.0, 1.0])
    await _tick(engine, run_id, cfg, sent.append, "o", 15.0, fleet_version=0, kind="train")
    later = (await groups(engine, run_id))[2:]
    skipped = [g for g in later if g.status == "skipped"]
    assert skipped and all(g.position == solved.position for g in skipped)
    assert skipped[0].dropped_reason == "always solved: 2/2 in 1 groups"
    assert {g.position for g in later if g.status == "pending"} == {unsolved.position}
    async with engine.connect() as conn:  # skipped groups have no episodes and are never claimable
        assert await conn.scalar(sa.select(sa.func.count()).select_from(Episode).where(
            Episode.group_id.in_([g.id for g in skipped]))) == 0
    assert (await Buffer(engine).stats())["skipped"] == len(skipped)


async def test_evaluations_start_per_due_version_and_are_never_trained_on(engine):
    held_out = await make_suite(engine, 2)
    run_id, cfg = await training_run(engine, eval={"suite_id": str(held_out), "every": 2, "samples_per_task": 3})
    sent = []
    await _tick(engine, run_id, cfg, sent.append, "o", 15.0, fleet_version=0, kind="train")
    async with engine.connect() as conn:  # no version yet: nothing to evaluate
        assert await conn.scalar(sa.select(sa.func.count()).select_from(Run).where(Run.kind == "eval")) == 0
    for version in (0, 1, 2):
        await publish(engine, version)
        if version == 2:  # recorded, the fleet not reloaded yet: an evaluation now would sample v1
            await _tick(engine, run_id, cfg, sent.append, "o", 15.0, fleet_version=1, kind="train")
            async with engine.connect() as conn:
                assert await conn.scalar(sa.select(sa.func.count()).select_from(Run).where(
                    Run.kind == "eval", Run.policy_version == 2)) == 0
        await _tick(engine, run_id, cfg, sent.append, "o", 15.0, fleet_version=version, kind="train")
    async with engine.connect() as conn:
        evals = (await conn.execute(sa.select(Run.id, Run.policy_version, Run.parent_id).where(Run.kind == "eval")
                                    .order_by(Run.policy_version))).all()
    assert [(e.policy_version, e.parent_id) for e in evals] == [(0, run_id), (2, run_id)]
    # an evaluation's groups, once final, are "evaluated": a trainer never claims them
    async with engine.connect() as conn:
        group_id = await conn.scalar(sa.select(Group.id).where(Group.run_id == evals[0].id).limit(1))
    await finish_group(engine, group_id, [1.0, 0.0, 1.0])
    async with engine.connect() as conn:
        assert await conn.scalar(sa.select(Group.status).where(Group.id == group_id)) == "evaluated"
    assert (await Buffer(engine).claim(10, trainer_step=2, max_staleness=10)).group_ids == []
    assert await Buffer(engine).evaluation(run_id, 2) == "running"
    assert await Buffer(engine).evaluation(run_id, 1) is None


async def test_the_run_ends_once_the_last_version_is_published_and_evaluated(engine):
    held_out = await make_suite(engine, 1)
    run_id, cfg = await training_run(engine, steps=1, eval={"suite_id": str(held_out), "samples_per_task": 1})
    sent = []
    await _tick(engine, run_id, cfg, sent.append, "o", 15.0, fleet_version=0, kind="train")
    await publish(engine, 0)
    await publish(engine, 1)
    assert await _tick(engine, run_id, cfg, sent.append, "o", 15.0, fleet_version=1, kind="train") is None
    async with engine.begin() as conn:  # the evaluation of v1 ends
        await conn.execute(sa.update(Run).where(Run.kind == "eval").values(status="finished"))
    assert await _tick(engine, run_id, cfg, sent.append, "o", 15.0, fleet_version=1, kind="train") == "finished"
    async with engine.connect() as conn:
        left = (await conn.execute(sa.select(Episode.status).where(Episode.run_id == run_id))).scalars().all()
    assert left and set(left) == {"cancelled"}  # queued ones never ran; a worker would see the run end


async def test_groups_left_when_the_run_ends_are_dropped_and_no_trainer_takes_them(engine):
    suite_id = await make_suite(engine, 3)
    cfg = RunConfig.model_validate({"suite_id": suite_id, "sampler": VLLM, "samples_per_task": 2, "concurrency": 4,
                                    "max_off_policy_steps": 1, "groups_per_step": 1,
                                    "training": {"steps": 1, "seed": 5}})
    run_id = await create_run(engine, cfg)
    await _tick(engine, run_id, cfg, [].append, "o", 15.0, fleet_version=0, kind="train")
    first, second = [g.id for g in await groups(engine, run_id)][:2]
    await finish_group(engine, first, [1.0, 0.0])  # sampled ahead: ready, never trained on
    async with engine.begin() as conn:  # the other still being sampled when the run ends
        await conn.execute(sa.update(Episode).where(Episode.group_id == second).values(status="running"))
    assert {g.status for g in await groups(engine, run_id)} == {"ready", "pending"}
    await publish(engine, 0)
    await publish(engine, 1)
    assert await _tick(engine, run_id, cfg, [].append, "o", 15.0, fleet_version=1, kind="train") == "finished"
    left = await groups(engine, run_id)
    assert {(g.status, g.dropped_reason) for g in left} == {("dropped", "the training run finished")}
    assert (await Buffer(engine).claim(10, trainer_step=0, max_staleness=10)).group_ids == []
    async with engine.connect() as conn:  # its running episodes end after the run: the group stays dropped
        running = (await conn.execute(sa.select(Episode.id).where(Episode.group_id == second))).scalars().all()
    for episode_id in running:
        await Buffer(engine).finish_episode(episode_id, status="submitted", reward=1.0, policy_version_min=1)
    assert {g.status for g in await groups(engine, run_id)} == {"dropped"}
    assert (await Buffer(engine).claim(10, trainer_step=0, max_staleness=10)).group_ids == []
    async with AsyncSession(engine) as session:  # not counted as stale
        view = await views.training(session, await session.get(Run, run_id))
    assert (view["dropped"], view["left_at_end"]) == (0, len(left))


async def test_a_schedule_smaller_than_a_step_is_refused(engine):
    suite_id = await make_suite(engine, 2)
    cfg = RunConfig.model_validate({"suite_id": suite_id, "sampler": VLLM, "groups_per_step": 3,
                                    "training": {"steps": 1, "epochs": 1}})
    with pytest.raises(RunError, match="groups_per_step: 3 groups per step, but training.epochs = 1 over 2"):
        await create_run(engine, cfg)
    cfg = RunConfig.model_validate(cfg.model_dump() | {"groups_per_step": 1, "training": {
        "steps": 1, "eval": {"suite_id": str(uuid.uuid4())}}})
    with pytest.raises(RunError, match="training.eval.suite_id: suite .* not found"):
        await create_run(engine, cfg)


async def test_an_evaluation_of_withdrawn_weights_is_cancelled(engine):
    held_out = await make_suite(engine, 1)
    run_id, cfg = await training_run(engine, eval={"suite_id": str(held_out), "every": 1, "samples_per_task": 1})
    sent = []
    for version in (0, 1):
        await publish(engine, version)
        await _tick(engine, run_id, cfg, sent.append, "o", 15.0, fleet_version=version, kind="train")
    await Buffer(engine).rewind(0)  # a trainer resumed at step 0: version 1 is withdrawn
    await _tick(engine, run_id, cfg, sent.append, "o", 15.0, fleet_version=0, kind="train")
    async with engine.connect() as conn:
        evals = dict((await conn.execute(sa.select(Run.policy_version, Run.status).where(Run.kind == "eval"))).all())
    assert evals == {0: "running", 1: "cancelling"}
    await publish(engine, 1)  # published again: evaluated again, by a new evaluation
    await _tick(engine, run_id, cfg, sent.append, "o", 15.0, fleet_version=1, kind="train")
    async with engine.connect() as conn:
        evals = (await conn.execute(sa.select(Run.policy_version, Run.status).where(Run.kind == "eval")
                                    .order_by(Run.created_at))).all()
    assert [tuple(e) for e in evals] == [(0, "running"), (1, "cancelling"), (1, "running")]
