"""The orchestrator of a run: keeps `concurrency` episodes in flight, stops a run whose
sandboxes or fleet keep failing, finishes or cancels it. All its state is in the database,
so a restarted orchestrator picks up where the last one stopped."""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Callable

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine

from service.buffer import Buffer
from service.runs import RunConfig
from service.tables import EPISODE_FINAL_STATUSES, Episode, Run, utcnow

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
            if starts:
                await conn.execute(sa.update(Episode).where(Episode.id.in_(starts)).values(status="queued"))
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


async def _failing(conn, run_id: uuid.UUID, limit: int) -> bool:
    recent = (await conn.execute(sa.select(Episode.status).where(
        Episode.run_id == run_id, Episode.finished_at.is_not(None))
        .order_by(Episode.finished_at.desc()).limit(limit))).scalars().all()
    return len(recent) == limit and all(s in FAILURES for s in recent)
