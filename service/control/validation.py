"""Suite validation in the background of the API process; results land on each task row."""

from __future__ import annotations

import logging
import uuid

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine

from envs.swe_env import EXAMPLE_BUNDLES, SWEEnvConfig
from envs.validate import validate_task
from service.store.buffer import storable
from service.config import Settings
from service.store.tasks import task_from_row
from service.store.tables import Suite, Task, utcnow

logger = logging.getLogger(__name__)


def env_config(settings: Settings) -> SWEEnvConfig:
    return SWEEnvConfig(image_cache_dir=settings.data_dir / "images",
                        bundle_dirs=(settings.data_dir / "bundles", EXAMPLE_BUNDLES))


async def run_suite_validation(engine: AsyncEngine, settings: Settings, suite_id: uuid.UUID) -> None:
    """Validate every task of a suite, one at a time, storing each result as it comes."""
    cfg = env_config(settings)
    try:
        async with engine.connect() as conn:
            rows = (await conn.execute(sa.select(Task).where(Task.suite_id == suite_id)
                                       .order_by(Task.position))).all()
        for row in rows:
            result = await validate_task(task_from_row(row), cfg)
            async with engine.begin() as conn:
                await conn.execute(sa.update(Task).where(Task.id == row.id).values(validation=storable(result.to_json())))
        status = "done"
    except Exception:
        logger.exception("validation of suite %s failed", suite_id)
        status = "failed"
    async with engine.begin() as conn:
        await conn.execute(sa.update(Suite).where(Suite.id == suite_id)
                           .values(validation_status=status, validated_at=utcnow()))
