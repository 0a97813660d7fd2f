"""Run creation: one group per task, `samples_per_task` episodes per group, all written before
anything is scheduled (the orchestrator only reads the database)."""

from __future__ import annotations

import json
import uuid

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine

from service.store.buffer import Buffer
from service.store.tables import Suite, Task
from service.worker.config import RunConfig


class RunError(ValueError):
    """The run cannot be created as configured; the message says which field and why."""


async def create_run(engine: AsyncEngine, cfg: RunConfig) -> uuid.UUID:
    run_id = uuid.uuid4()
    async with engine.begin() as conn:
        suite = (await conn.execute(sa.select(Suite).where(Suite.id == cfg.suite_id,
                                                           Suite.deleted_at.is_(None)))).first()
        if suite is None:
            raise RunError(f"suite_id: suite {cfg.suite_id} not found")
        query = sa.select(Task.id, Task.instance_id).where(Task.suite_id == cfg.suite_id).order_by(Task.position)
        if cfg.instance_ids is not None:
            query = query.where(Task.instance_id.in_(cfg.instance_ids))
        if cfg.repos is not None:
            query = query.where(Task.repo.in_(cfg.repos))
        tasks = (await conn.execute(query)).all()
        if not tasks:
            raise RunError("instance_ids/repos: no task of the suite matches the filters")
        if cfg.instance_ids is not None and len(tasks) != len(set(cfg.instance_ids)):
            missing = set(cfg.instance_ids) - {t.instance_id for t in tasks}
            raise RunError(f"instance_ids: not in the suite: {sorted(missing)[:10]}")
        await Buffer.create_run(conn, run_id, suite_id=cfg.suite_id, name=cfg.name,
                                config=json.loads(cfg.model_dump_json()), config_hash=cfg.hash(),
                                task_ids=[t.id for t in tasks], samples=cfg.samples_per_task,
                                trainable=cfg.sampler.type == "vllm")
    return run_id
