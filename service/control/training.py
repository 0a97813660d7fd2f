"""The orchestrator's part of a training run: groups added as they are needed, following the
schedule (service.control.schedule) and the difficulty filter; an evaluation started for every
policy version that is due one; the run's end once the trainer published its last version (and
that version is evaluated) or the schedule is done and trained on. Each function runs in the
orchestrator's transaction, with the run row locked."""

from __future__ import annotations

import math
import uuid

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection

from service.control.runs import create_eval, select_tasks
from service.control.schedule import GroupOutcome, eval_due, schedule_length, skip_reason, slot
from service.store.buffer import Buffer, PlannedGroup
from service.store.status import EPISODE_FINAL, RUN_ACTIVE
from service.store.tables import Episode, Group, Policy, Run
from service.worker.config import RunConfig

FINISHED_GROUP = ("ready", "claimed", "consumed", "dropped")


class Tasks:
    """A training run's tasks in the suite's order, read once per orchestrator."""

    def __init__(self) -> None:
        self.ids: list[uuid.UUID] | None = None

    async def get(self, conn: AsyncConnection, cfg: RunConfig) -> list[uuid.UUID]:
        if self.ids is None:
            self.ids = await select_tasks(conn, cfg.suite_id, cfg.instance_ids, cfg.repos)
        return self.ids


async def add_groups(conn: AsyncConnection, run_id: uuid.UUID, cfg: RunConfig, tasks: list[uuid.UUID],
                     room: int, new_groups: int | None, fleet_version: int | None) -> None:  # fmt: skip
    """Groups enough to fill `room` episode slots (at most `new_groups` new ones when the gate
    limits them), beyond the groups created and not started yet."""
    training = cfg.training
    wanted = math.ceil(room / cfg.samples_per_task) if room > 0 else 0
    if new_groups is not None:
        wanted = min(wanted, new_groups)
    started = sa.select(Episode.group_id).where(Episode.run_id == run_id, Episode.status != "pending")
    fresh = await conn.scalar(sa.select(sa.func.count()).select_from(Group).where(
        Group.run_id == run_id, Group.status == "pending", Group.id.not_in(started)))
    wanted -= fresh
    if wanted <= 0 or await conn.scalar(sa.select(Run.exhausted_at).where(Run.id == run_id)) is not None:
        return
    seq = (await conn.scalar(sa.select(sa.func.max(Group.seq)).where(Group.run_id == run_id)))
    seq = 0 if seq is None else seq + 1
    end = schedule_length(training, len(tasks))
    horizon = wanted + len(tasks)  # a whole epoch passed over in one tick at most
    slots = [(s, *slot(s, len(tasks), training.seed)) for s in range(seq, seq + horizon) if end is None or s < end]
    history = await _history(conn, run_id, {tasks[i] for _, _, i in slots}) if _filtering(cfg) else {}
    planned, made = [], 0
    for s, epoch, i in slots:
        if made == wanted:
            break
        task_id = tasks[i]
        reason = skip_reason(history.get(task_id, []), training.filter, s, training.seed) if history else None
        planned.append(PlannedGroup(s, epoch, task_id, skipped=reason, version=fleet_version if reason else None))
        made += reason is None
    await Buffer.add_groups(conn, run_id, planned, samples=cfg.samples_per_task, trainable=True,
                            config_hash=cfg.hash())
    if planned and end is not None and planned[-1].seq == end - 1:
        await Buffer.mark_exhausted(conn, run_id)


def _filtering(cfg: RunConfig) -> bool:
    return cfg.training.filter.skip_solved or cfg.training.filter.skip_unsolved


async def _history(conn: AsyncConnection, run_id: uuid.UUID, task_ids: set[uuid.UUID]) -> dict:
    """Each task's finished groups in the run, newest first."""
    solved = sa.func.sum(sa.case((Episode.reward >= 1.0, 1), else_=0))
    rows = (await conn.execute(
        sa.select(Group.task_id, Group.seq, sa.func.count(Episode.reward), solved)
        .join(Episode, Episode.group_id == Group.id)
        .where(Group.run_id == run_id, Group.status.in_(FINISHED_GROUP), Group.task_id.in_(task_ids))
        .group_by(Group.task_id, Group.seq).order_by(Group.seq.desc()))).all()
    out: dict[uuid.UUID, list[GroupOutcome]] = {}
    for task_id, _, graded, n_solved in rows:
        out.setdefault(task_id, []).append(GroupOutcome(int(graded or 0), int(n_solved or 0)))
    return out


async def newest_version(conn: AsyncConnection) -> int | None:
    return await conn.scalar(sa.select(sa.func.max(Policy.version)))


def ending_version(steps: int, stopped_at: int | None) -> int:
    """The version that ends a training run: `steps`, or the one its trainer stopped at early
    (runs.last_version: the job's time limit)."""
    return steps if stopped_at is None else min(stopped_at, steps)


async def last_version(conn: AsyncConnection, run_id: uuid.UUID, cfg: RunConfig) -> int:
    """ending_version of the run, read from the database."""
    return ending_version(cfg.training.steps, await conn.scalar(sa.select(Run.last_version).where(Run.id == run_id)))


async def start_evaluation(conn: AsyncConnection, run_id: uuid.UUID, cfg: RunConfig, version: int | None,
                           fleet_version: int | None) -> None:  # fmt: skip
    """An evaluation of the newest version when it is due one, the fleet serves it (the trainer
    records a version before it reloads the fleet: an evaluation started in between would sample
    the previous one) and it has none made after it was published (a version withdrawn by a
    trainer's resume and published again is evaluated again)."""
    ev = cfg.training.eval
    if ev is None or version is None:
        return
    last = await last_version(conn, run_id, cfg)
    if version > last or not eval_due(version, ev.every, last):
        return
    if fleet_version is None or fleet_version < version:
        return
    if await Buffer.evaluation_status(conn, run_id, version) is None:
        await create_eval(conn, run_id, cfg, version)


async def cancel_stale_evaluations(conn: AsyncConnection, run_id: uuid.UUID, version: int | None) -> None:
    """Active evaluations of versions that are gone (a resumed trainer withdrew them) or were
    published again since (the evaluation began on the withdrawn weights) are cancelled: they
    would go on sampling whatever the fleet serves next."""
    published = sa.select(Policy.created_at).where(Policy.version == Run.policy_version).scalar_subquery()
    stale = (await conn.execute(sa.select(Run.id).where(
        Run.parent_id == run_id, Run.kind == "eval", Run.status.in_(RUN_ACTIVE),
        sa.or_(Run.policy_version > (version if version is not None else -1), published.is_(None),
               Run.created_at < published)))).scalars().all()
    for eval_id in stale:
        await Buffer.request_cancel(conn, eval_id)


async def evaluation_pending(conn: AsyncConnection, run_id: uuid.UUID, cfg: RunConfig, version: int,
                             last: int) -> bool:  # fmt: skip
    """Whether the evaluation of `version` (when due one; `last` ends the run) has yet to end."""
    ev = cfg.training.eval
    if ev is None or not eval_due(version, ev.every, last):
        return False
    status = await Buffer.evaluation_status(conn, run_id, version)
    return status is None or status in RUN_ACTIVE


async def done(conn: AsyncConnection, run_id: uuid.UUID, cfg: RunConfig, version: int | None,
               counts: dict[str, int]) -> bool:  # fmt: skip
    """Whether the training run has ended: the trainer published its last version, or the
    schedule is done, every episode final and every group trained on or dropped; and the
    newest version's evaluation, when due, is over."""
    if version is None:
        return False
    last = await last_version(conn, run_id, cfg)
    if version < last:
        exhausted = await conn.scalar(sa.select(Run.exhausted_at).where(Run.id == run_id)) is not None
        all_final = sum(counts.values()) == sum(counts.get(s, 0) for s in EPISODE_FINAL)
        waiting = await conn.scalar(sa.select(sa.func.count()).select_from(Group).where(
            Group.run_id == run_id, Group.status.in_(("pending", "ready", "claimed"))))
        if not (exhausted and all_final and waiting == 0):
            return False
    return not await evaluation_pending(conn, run_id, cfg, version, last)


async def stop_sampling(conn: AsyncConnection, run_id: uuid.UUID) -> list[uuid.UUID]:
    """The trainer is done: episodes not started yet are cancelled (returned), running ones end."""
    return list((await conn.execute(sa.select(Episode.id).where(
        Episode.run_id == run_id, Episode.status.in_(("pending", "queued"))))).scalars())
