"""Predictions graded like the SWE-bench harness, as a service (`POST /api/v1/evaluations`).

An evaluation is one model's predictions for instances of an imported suite. The API process
that owns it (a lease on the evaluation row, renewed every tick, taken over when it lapses, as
runs are owned) hands its predictions to the workers, at most `concurrency` at a time; a worker
grades one by swerve's rule (envs.swe_env.grade) and stores SWE-bench's report.json of it and the
whole test log. Each hand-over is an attempt: a grading whose worker stops renewing its heartbeat
is handed over again, and the attempt number fences a late write of the lost one. When nothing
is left to grade, the run report (make_run_report's fields) is stored and the evaluation is done.
Like the harness, a prediction whose grading failed (its patch does not apply, the harness broke)
is an error, not unresolved.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Callable
from datetime import timedelta
import sqlalchemy as sa
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncEngine

from envs.predictions import Prediction, PredictionsError, make_run_report
from service.control.leases import LeaseSupervisor
from service.store.tables import Evaluation, EvaluationInstance, Suite, Task, utcnow
from service.worker.grading import EVALUATION_ACTIVE, EvaluationConfig


logger = logging.getLogger(__name__)

GRADED = ("resolved", "unresolved")
GRADING_LEASE_S = 120.0
"""A grading whose heartbeat is older than this is handed to a worker again."""
MAX_ATTEMPTS = 3
"""Hand-overs of one prediction before it is an error (a grading that kills its worker)."""


class EvaluationExists(Exception):
    def __init__(self, run_id: str, model: str):
        super().__init__(f"run_id: the suite already has an evaluation {run_id!r} of {model!r}; "
                         "pick another run_id, or read that one")


async def create_evaluation(engine: AsyncEngine, suite_id: uuid.UUID, run_id: str, predictions: list[Prediction],
                            config: EvaluationConfig) -> uuid.UUID:  # fmt: skip
    """Store an evaluation and its predictions; raises PredictionsError (422) or EvaluationExists."""
    if not predictions:
        raise PredictionsError("predictions: none given; send at least one prediction")
    models = {p.model_name_or_path for p in predictions}
    if len(models) > 1:
        raise PredictionsError(f"model_name_or_path: the predictions name {len(models)} models "
                               f"({', '.join(sorted(models)[:5])}); grade one model's predictions per evaluation")
    async with engine.connect() as conn:
        tasks = dict((await conn.execute(sa.select(Task.instance_id, Task.id).where(Task.suite_id == suite_id))).all())
    unknown = [p.instance_id for p in predictions if p.instance_id not in tasks]
    if unknown:
        raise PredictionsError(f"instance_id: {', '.join(unknown[:10])}{' ...' if len(unknown) > 10 else ''} not in "
                               f"the suite ({len(unknown)} in all); predict only the suite's instances")
    evaluation_id = uuid.uuid4()
    [model] = models
    try:
        async with engine.begin() as conn:
            await conn.execute(sa.insert(Evaluation).values(
                id=evaluation_id, suite_id=suite_id, run_id=run_id, model_name_or_path=model, status="running",
                config=config.model_dump(), created_at=utcnow()))
            rows = [{"evaluation_id": evaluation_id, "instance_id": p.instance_id, "task_id": tasks[p.instance_id],
                     "model_patch": p.model_patch, "attempt": 0,
                     "status": "pending" if p.model_patch else "empty_patch"} for p in predictions]
            for i in range(0, len(rows), 500):
                await conn.execute(sa.insert(EvaluationInstance), rows[i:i + 500])
    except IntegrityError as e:
        raise EvaluationExists(run_id, model) from e
    return evaluation_id


async def cancel_evaluation(engine: AsyncEngine, evaluation_id: uuid.UUID) -> str:
    """Stop handing predictions over (gradings in flight still store their result); no run report."""
    async with engine.begin() as conn:
        await conn.execute(sa.update(Evaluation).where(Evaluation.id == evaluation_id,
                                                       Evaluation.status.in_(EVALUATION_ACTIVE))
                           .values(status="cancelled", finished_at=utcnow(), owner=None))
        return (await conn.execute(sa.select(Evaluation.status).where(Evaluation.id == evaluation_id))).scalar_one()


async def run_report(conn, evaluation: Evaluation | sa.Row) -> dict:
    rows = (await conn.execute(sa.select(EvaluationInstance.instance_id, EvaluationInstance.model_patch,
                                         EvaluationInstance.status, Evaluation.model_name_or_path)
                               .join(Evaluation, Evaluation.id == EvaluationInstance.evaluation_id)
                               .where(EvaluationInstance.evaluation_id == evaluation.id))).all()
    instance_ids = (await conn.execute(sa.select(Task.instance_id).where(Task.suite_id == evaluation.suite_id)
                                       .order_by(Task.position))).scalars().all()
    predictions = [Prediction(r.instance_id, r.model_name_or_path, r.model_patch) for r in rows]
    return make_run_report(predictions, list(instance_ids), {r.instance_id: r.status for r in rows if r.status in GRADED})


async def tick(engine: AsyncEngine, evaluation_id: uuid.UUID, owner: str, lease_s: float,
               submit: Callable[[str, str, int], None]) -> str:  # fmt: skip
    """One step of the owner: renew the lease, hand over what may be graded now, finish when
    nothing is left. Returns the evaluation's status, or "not owner"."""
    now = utcnow()
    async with engine.begin() as conn:
        owned = await conn.execute(sa.update(Evaluation).where(
            Evaluation.id == evaluation_id, Evaluation.status.in_(EVALUATION_ACTIVE),
            sa.or_(Evaluation.owner.is_(None), Evaluation.owner == owner,
                   Evaluation.owner_heartbeat_at < now - timedelta(seconds=lease_s)),
        ).values(owner=owner, owner_heartbeat_at=now))
        evaluation = (await conn.execute(sa.select(Evaluation).where(Evaluation.id == evaluation_id))).one()
        if owned.rowcount != 1:
            return evaluation.status if evaluation.status not in EVALUATION_ACTIVE else "not owner"
        config = EvaluationConfig.model_validate(evaluation.config)
        stale = now - timedelta(seconds=GRADING_LEASE_S)
        live = await conn.scalar(sa.select(sa.func.count()).select_from(EvaluationInstance).where(
            EvaluationInstance.evaluation_id == evaluation_id, EvaluationInstance.status == "grading",
            EvaluationInstance.heartbeat_at >= stale))
        hand = (await conn.execute(
            sa.select(EvaluationInstance.instance_id, EvaluationInstance.attempt).where(
                EvaluationInstance.evaluation_id == evaluation_id,
                sa.or_(EvaluationInstance.status == "pending",
                       sa.and_(EvaluationInstance.status == "grading", EvaluationInstance.heartbeat_at < stale)))
            .order_by(EvaluationInstance.instance_id).limit(max(0, config.concurrency - live)))).all()
        lost = [(i, a) for i, a in hand if a >= MAX_ATTEMPTS]
        for instance_id, attempt in lost:
            await conn.execute(sa.update(EvaluationInstance).where(
                EvaluationInstance.evaluation_id == evaluation_id, EvaluationInstance.instance_id == instance_id)
                .values(status="error", heartbeat_at=None, graded_at=now,
                        error=f"no worker finished grading it in {attempt} attempts (each lost its heartbeat)"))
        hand = [(i, a) for i, a in hand if a < MAX_ATTEMPTS]
        for instance_id, attempt in hand:
            await conn.execute(sa.update(EvaluationInstance).where(
                EvaluationInstance.evaluation_id == evaluation_id, EvaluationInstance.instance_id == instance_id)
                .values(status="grading", attempt=attempt + 1, heartbeat_at=now))
        if not hand and not live and not lost:
            report = await run_report(conn, evaluation)
            await conn.execute(sa.update(Evaluation).where(Evaluation.id == evaluation_id).values(
                status="done", report=report, finished_at=utcnow(), owner=None))
            return "done"
    for instance_id, attempt in hand:  # after the commit: a worker finds the attempt it was given
        submit(str(evaluation_id), instance_id, attempt + 1)
    return "running"


async def own(engine: AsyncEngine, evaluation_id: uuid.UUID, submit, owner: str, lease_s: float,
              poll_s: float) -> str:  # fmt: skip
    """Tick until the evaluation ends or another process owns it."""
    while True:
        try:
            status = await tick(engine, evaluation_id, owner, lease_s, submit)
        except Exception:  # a database blip: the next tick retries; a lapsed lease hands it on
            logger.exception("evaluation %s: tick failed", evaluation_id)
            status = "running"
        if status != "running":
            return status
        await asyncio.sleep(poll_s)


class EvaluationSupervisor(LeaseSupervisor):
    """Owns every running evaluation without a live owner, in this process."""

    what = "evaluations"

    def __init__(self, engine: AsyncEngine, submit: Callable[[str, str, int], None], owner: str, *,
                 lease_s: float = 15.0, poll_s: float = 1.0, scan_s: float = 2.0):  # fmt: skip
        super().__init__(scan_s)
        self.engine, self.submit, self.owner = engine, submit, owner
        self.lease_s, self.poll_s = lease_s, poll_s

    async def scan(self) -> None:
        now = utcnow()
        async with self.engine.connect() as conn:
            orphans = (await conn.execute(sa.select(Evaluation.id).where(
                Evaluation.status.in_(EVALUATION_ACTIVE),
                sa.or_(Evaluation.owner.is_(None), Evaluation.owner == self.owner,
                       Evaluation.owner_heartbeat_at < now - timedelta(seconds=self.lease_s))))).scalars().all()
        for evaluation_id in orphans:
            job = self.jobs.get(evaluation_id)
            if job is None or job.done():
                self.jobs[evaluation_id] = asyncio.get_running_loop().create_task(
                    own(self.engine, evaluation_id, self.submit, self.owner, self.lease_s, self.poll_s))

    async def release(self, conn) -> None:
        await conn.execute(sa.update(Evaluation).where(Evaluation.owner == self.owner).values(owner=None))


async def live_evaluation(conn, evaluation_id: uuid.UUID):
    return (await conn.execute(sa.select(Evaluation, Suite.name.label("suite_name"))
                               .join(Suite, Suite.id == Evaluation.suite_id)
                               .where(Evaluation.id == evaluation_id))).first()
