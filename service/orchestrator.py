"""The orchestrator of a run: keeps `concurrency` episodes in flight, stops a run whose
sandboxes or fleet keep failing, finishes or cancels it. All its state is in the database,
so a restarted orchestrator picks up where the last one stopped."""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Callable
from datetime import timedelta

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine

from service.buffer import Buffer
from service.runs import RunConfig
from service.tables import EPISODE_FINAL_STATUSES, Episode, Run, Turn, utcnow

logger = logging.getLogger(__name__)
FAILURES = ("sandbox_error", "provider_error")


async def orchestrate(engine: AsyncEngine, run_id: uuid.UUID, submit: Callable[[str], None],
                      poll_s: float = 0.5) -> str:  # fmt: skip
    """Drive a run to finished, cancelled or failed; returns that status."""
    while True:
        status = await _tick(engine, run_id, submit)
        if status is not None:
            logger.info("run %s %s", run_id, status)
            return status
        await asyncio.sleep(poll_s)


async def _tick(engine: AsyncEngine, run_id: uuid.UUID, submit: Callable[[str], None]) -> str | None:
    async with engine.begin() as conn:
        run = (await conn.execute(sa.select(Run.status, Run.config).where(Run.id == run_id))).one()
        cfg = RunConfig.model_validate(run.config)
        counts = dict((await conn.execute(sa.select(Episode.status, sa.func.count())
                                          .where(Episode.run_id == run_id).group_by(Episode.status))).all())
        if run.status not in ("running", "cancelling"):
            return run.status
        lost = await _requeue_lost(conn, run_id, cfg)
        in_flight = counts.get("queued", 0) + counts.get("running", 0)
        if run.status == "cancelling" or await _failing(conn, run_id, cfg.max_consecutive_failures):
            final = "cancelled" if run.status == "cancelling" else "failed"
            pending = (await conn.execute(sa.select(Episode.id).where(
                Episode.run_id == run_id, Episode.status.in_(("pending", "queued"))))).scalars().all()
        elif sum(counts.values()) == sum(counts.get(s, 0) for s in EPISODE_FINAL_STATUSES):
            await conn.execute(sa.update(Run).where(Run.id == run_id).values(status="finished", finished_at=utcnow()))
            return "finished"
        else:
            starts = (await conn.execute(sa.select(Episode.id).where(
                Episode.run_id == run_id, Episode.status == "pending")
                .order_by(Episode.group_id, Episode.sample_index)
                .limit(max(0, cfg.concurrency - in_flight)))).scalars().all()
            starts = list(starts) + lost
            if starts:
                await conn.execute(sa.update(Episode).where(Episode.id.in_(starts))
                                   .values(status="queued", queued_at=utcnow()))
            pending, final = [], None
    if final is None:
        for episode_id in starts:
            submit(str(episode_id))
        return None
    buffer = Buffer(engine)
    for episode_id in pending:  # never started: final now; running ones see the run and stop
        await buffer.finish_episode(episode_id, status="cancelled")
    if final == "cancelled" and counts.get("running", 0):
        return None  # wait for running episodes to end
    async with engine.begin() as conn:
        await conn.execute(sa.update(Run).where(Run.id == run_id).values(status=final, finished_at=utcnow()))
    return final


async def _requeue_lost(conn, run_id: uuid.UUID, cfg: RunConfig) -> list[uuid.UUID]:
    """Episodes whose worker died (stale heartbeat) or whose message was lost (queued too long).
    Sending them again is safe: the episode task restarts a running episode cleanly."""
    now = utcnow()
    lost = (await conn.execute(sa.select(Episode.id).where(Episode.run_id == run_id, sa.or_(
        sa.and_(Episode.status == "running", Episode.heartbeat_at < now - timedelta(seconds=cfg.worker_timeout_s)),
        sa.and_(Episode.status == "queued", Episode.queued_at < now - timedelta(seconds=cfg.queue_timeout_s)),
    )))).scalars().all()
    if lost:
        logger.warning("run %s: sending %d episode(s) again (lost worker or message)", run_id, len(lost))
        # the dead attempt's turns go: the next attempt records its own from turn 0
        await conn.execute(sa.delete(Turn).where(Turn.episode_id.in_(lost)))
        await conn.execute(sa.update(Episode).where(Episode.id.in_(lost), Episode.status == "running")
                           .values(attempt=Episode.attempt + 1))
    return list(lost)


async def _failing(conn, run_id: uuid.UUID, limit: int) -> bool:
    recent = (await conn.execute(sa.select(Episode.status).where(
        Episode.run_id == run_id, Episode.finished_at.is_not(None))
        .order_by(Episode.finished_at.desc()).limit(limit))).scalars().all()
    return len(recent) == limit and all(s in FAILURES for s in recent)
