"""Suite validation in the background of the API process; results land on each task row."""

from __future__ import annotations

import asyncio
import logging
import uuid
from datetime import timedelta

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine

from envs.swe_env import EXAMPLE_BUNDLES, SWEEnvConfig
from envs.validate import validate_task
from service.control.leases import LeaseSupervisor
from service.store.buffer import storable
from service.config import Settings
from service.store.tasks import task_from_row
from service.store.tables import Suite, Task, utcnow

logger = logging.getLogger(__name__)


def env_config(settings: Settings) -> SWEEnvConfig:
    return SWEEnvConfig(image_cache_dir=settings.data_dir / "images",
                        bundle_dirs=(settings.data_dir / "bundles", EXAMPLE_BUNDLES),
                        source_roots=settings.source_root_list)


async def claim_validation(engine: AsyncEngine, suite_id: uuid.UUID, owner: str, lease_s: float) -> bool:
    """Start (or take over) the suite's validation for `owner`: refused while another process's
    validation of it is alive (its heartbeat within the lease)."""
    now = utcnow()
    async with engine.begin() as conn:
        taken = await conn.execute(sa.update(Suite).where(
            Suite.id == suite_id, Suite.deleted_at.is_(None),
            sa.or_(Suite.validation_status.is_distinct_from("running"), Suite.validation_owner.is_(None),
                   Suite.validation_heartbeat_at.is_(None),
                   Suite.validation_heartbeat_at < now - timedelta(seconds=lease_s)),
        ).values(validation_status="running", validation_owner=owner, validation_heartbeat_at=now))
    return taken.rowcount == 1


async def run_suite_validation(engine: AsyncEngine, settings: Settings, suite_id: uuid.UUID, owner: str,
                               lease_s: float) -> None:  # fmt: skip
    """Validate every task of a suite, one at a time, storing each result as it comes, the
    lease renewed all along; it stops when another process has taken the validation over."""
    cfg = env_config(settings)
    mine = (Suite.id == suite_id, Suite.validation_owner == owner, Suite.validation_status == "running")

    async def beat() -> None:
        while True:
            await asyncio.sleep(lease_s / 3)
            async with engine.begin() as conn:
                await conn.execute(sa.update(Suite).where(*mine).values(validation_heartbeat_at=utcnow()))

    heart = asyncio.create_task(beat())
    try:
        async with engine.connect() as conn:
            rows = (await conn.execute(sa.select(Task).where(Task.suite_id == suite_id)
                                       .order_by(Task.position))).all()
        for row in rows:
            result = await validate_task(task_from_row(row), cfg)
            async with engine.begin() as conn:
                if (await conn.execute(sa.select(Suite.id).where(*mine))).first() is None:
                    return  # taken over (this process was thought dead): the new owner validates
                await conn.execute(sa.update(Task).where(Task.id == row.id).values(validation=storable(result.to_json())))
        status = "done"
    except Exception:
        logger.exception("validation of suite %s failed", suite_id)
        status = "failed"
    finally:
        heart.cancel()
    async with engine.begin() as conn:
        await conn.execute(sa.update(Suite).where(*mine).values(
            validation_status=status, validated_at=utcnow(), validation_owner=None, validation_heartbeat_at=None))


class ValidationSupervisor(LeaseSupervisor):
    """Takes over, in this process, every validation whose owner stopped renewing its lease
    (its process died): a validation always ends, and a new one is never refused for a dead one."""

    what = "validations"

    def __init__(self, engine: AsyncEngine, settings: Settings, owner: str, *, lease_s: float = 15.0,
                 scan_s: float = 2.0):  # fmt: skip
        super().__init__(scan_s)
        self.engine, self.settings, self.owner, self.lease_s = engine, settings, owner, lease_s

    def start(self, suite_id: uuid.UUID) -> None:
        """Run a validation this process has claimed."""
        job = self.jobs.get(suite_id)
        if job is None or job.done():
            self.jobs[suite_id] = asyncio.get_running_loop().create_task(
                run_suite_validation(self.engine, self.settings, suite_id, self.owner, self.lease_s))

    async def scan(self) -> None:
        lapsed = utcnow() - timedelta(seconds=self.lease_s)
        async with self.engine.connect() as conn:
            orphans = (await conn.execute(sa.select(Suite.id).where(
                Suite.validation_status == "running", Suite.deleted_at.is_(None),
                sa.or_(Suite.validation_owner.is_(None), Suite.validation_heartbeat_at.is_(None),
                       Suite.validation_heartbeat_at < lapsed)))).scalars().all()
        for suite_id in orphans:
            if await claim_validation(self.engine, suite_id, self.owner, self.lease_s):
                self.start(suite_id)

    async def release(self, conn) -> None:
        await conn.execute(sa.update(Suite).where(Suite.validation_owner == self.owner).values(validation_owner=None))
