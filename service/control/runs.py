"""Run creation. A one-pass run writes one group per task, `samples_per_task` episodes each,
before anything is scheduled (the orchestrator only reads the database); a training run starts
empty and its orchestrator adds groups as it needs them (service.control.training); an
evaluation is a one-pass run of a training run, for one policy version."""

from __future__ import annotations

import json
import uuid

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from service.store.buffer import Buffer
from service.store.tables import Suite, Task
from service.worker.config import RunConfig


class RunError(ValueError):
    """The run cannot be created as configured; the message says which field and why."""


async def select_tasks(conn: AsyncConnection, suite_id: uuid.UUID, instance_ids: list[str] | None,
                       repos: list[str] | None, field: str = "") -> list[uuid.UUID]:  # fmt: skip
    """The suite's tasks that the filters keep, in the suite's order. `field` prefixes the
    names of the fields in errors (e.g. "training.eval.")."""
    suite = (await conn.execute(sa.select(Suite).where(Suite.id == suite_id, Suite.deleted_at.is_(None)))).first()
    if suite is None:
        raise RunError(f"{field}suite_id: suite {suite_id} not found")
    # filtered here, not by IN (...): a filter of any length is one query (bind parameters are few)
    query = sa.select(Task.id, Task.instance_id, Task.repo).where(Task.suite_id == suite_id).order_by(Task.position)
    wanted, kept_repos = set(instance_ids or ()), set(repos or ())
    tasks = [t for t in (await conn.execute(query)).all()
             if (instance_ids is None or t.instance_id in wanted) and (repos is None or t.repo in kept_repos)]
    if not tasks:
        raise RunError(f"{field}instance_ids/{field}repos: no task of the suite matches the filters")
    if instance_ids is not None and len(tasks) != len(set(instance_ids)):
        missing = set(instance_ids) - {t.instance_id for t in tasks}
        raise RunError(f"{field}instance_ids: not in the suite: {sorted(missing)[:10]}")
    return [t.id for t in tasks]


async def create_run(engine: AsyncEngine, cfg: RunConfig) -> uuid.UUID:
    run_id = uuid.uuid4()
    async with engine.begin() as conn:
        tasks = await select_tasks(conn, cfg.suite_id, cfg.instance_ids, cfg.repos)
        training = cfg.training
        if training is not None:
            if training.eval is not None:
                await select_tasks(conn, training.eval.suite_id, training.eval.instance_ids, training.eval.repos,
                                   "training.eval.")
            if training.epochs is not None and cfg.groups_per_step is not None \
                    and training.epochs * len(tasks) < cfg.groups_per_step:
                raise RunError(f"groups_per_step: {cfg.groups_per_step} groups per step, but training.epochs = "
                               f"{training.epochs} over {len(tasks)} task(s) makes only {training.epochs * len(tasks)}")
        await Buffer.create_run(conn, run_id, suite_id=cfg.suite_id, name=cfg.name,
                                config=json.loads(cfg.model_dump_json()), config_hash=cfg.hash(),
                                task_ids=[] if training is not None else tasks, samples=cfg.samples_per_task,
                                trainable=cfg.sampler.type == "vllm",
                                kind="train" if training is not None else "sample")
    return run_id


def eval_config(parent: RunConfig, version: int) -> RunConfig:
    """The run that evaluates `version` for the training run `parent`: its held-out suite with
    its own samples and sampling, the training run's sampler, sandbox and limits."""
    ev = parent.training.eval
    agent = parent.agent.model_copy(update={"max_turns": ev.max_turns or parent.agent.max_turns,
                                            "sampling": ev.sampling or parent.agent.sampling})
    return RunConfig(suite_id=ev.suite_id, name=f"{parent.name or 'training run'}: eval of v{version}",
                     sampler=parent.sampler, samples_per_task=ev.samples_per_task, agent=agent,
                     backend=parent.backend, limits=parent.limits, concurrency=ev.concurrency or parent.concurrency,
                     worker_timeout_s=parent.worker_timeout_s, queue_timeout_s=parent.queue_timeout_s,
                     max_consecutive_failures=parent.max_consecutive_failures, instance_ids=ev.instance_ids,
                     repos=ev.repos, partial_credit=parent.partial_credit, integrity=parent.integrity)


async def create_eval(conn: AsyncConnection, parent_id: uuid.UUID, parent: RunConfig, version: int) -> uuid.UUID:
    """An evaluation of `version` for the training run (in the caller's transaction); an
    orchestrator takes it up at its next scan. Its episodes are never trained on."""
    cfg = eval_config(parent, version)
    tasks = await select_tasks(conn, cfg.suite_id, cfg.instance_ids, cfg.repos, "training.eval.")
    run_id = uuid.uuid4()
    await Buffer.create_run(conn, run_id, suite_id=cfg.suite_id, name=cfg.name,
                            config=json.loads(cfg.model_dump_json()), config_hash=cfg.hash(), task_ids=tasks,
                            samples=cfg.samples_per_task, trainable=False, kind="eval", parent_id=parent_id,
                            policy_version=version)
    return run_id
