"""A worker's part of an evaluation (service.control.evaluations): grade one prediction, this
attempt only, and store what SWE-bench's harness writes for it (report.json, test_output.txt)."""

from __future__ import annotations

import asyncio
import logging
import uuid
from typing import Literal

import sqlalchemy as sa
from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy.ext.asyncio import AsyncEngine

from envs.predictions import Prediction, instance_report
from service.store.tables import Evaluation, EvaluationInstance, Task, utcnow

logger = logging.getLogger(__name__)

EVALUATION_ACTIVE = ("running",)
HEARTBEAT_S = 10.0
"""How often a grading renews its heartbeat (its lease is control.evaluations.GRADING_LEASE_S)."""


class EvaluationConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    backend: Literal["bwrap", "docker"] = "bwrap"
    concurrency: int = Field(4, ge=1, le=256)
    """Predictions graded at once."""
    integrity: Literal["revert", "reject", "off"] = "revert"
    """The agent's changes to how tests run (envs/integrity.py); SWE-bench's harness has no guard."""


async def grade_prediction(engine: AsyncEngine, settings, evaluation_id: uuid.UUID, instance_id: str,
                           attempt: int) -> str | None:  # fmt: skip
    """A worker's part: grade one prediction (this attempt only) and store what SWE-bench's
    harness writes for it. Idempotent: a stale or repeated hand-over does nothing."""
    from envs.grading import RewardError
    from sandboxes.base import SandboxError
    from envs.swe_env import EXAMPLE_BUNDLES, SWEEnvConfig, grade
    from service.store.tasks import task_from_row

    pk = (EvaluationInstance.evaluation_id == evaluation_id, EvaluationInstance.instance_id == instance_id)
    mine = (*pk, EvaluationInstance.attempt == attempt, EvaluationInstance.status == "grading")
    async with engine.begin() as conn:
        row = (await conn.execute(sa.select(EvaluationInstance.task_id, EvaluationInstance.model_patch,
                                            Evaluation.status.label("evaluation_status"), Evaluation.config,
                                            Evaluation.model_name_or_path)
                                  .join(Evaluation, Evaluation.id == EvaluationInstance.evaluation_id)
                                  .where(*mine))).first()
        if row is None or row.evaluation_status not in EVALUATION_ACTIVE:
            return None
        await conn.execute(sa.update(EvaluationInstance).where(*mine).values(heartbeat_at=utcnow()))
        task = task_from_row((await conn.execute(sa.select(Task).where(Task.id == row.task_id))).one())
    config = EvaluationConfig.model_validate(row.config)
    cfg = SWEEnvConfig(backend=config.backend, integrity=config.integrity, image_cache_dir=settings.data_dir / "images",
                       bundle_dirs=(settings.data_dir / "bundles", EXAMPLE_BUNDLES), source_roots=settings.source_root_list)
    prediction = Prediction(instance_id, row.model_name_or_path, row.model_patch)

    async def beat() -> None:
        while True:
            await asyncio.sleep(HEARTBEAT_S)
            async with engine.begin() as conn:
                await conn.execute(sa.update(EvaluationInstance).where(*mine).values(heartbeat_at=utcnow()))

    heart = asyncio.create_task(beat())
    try:
        report = await grade(task, prediction.model_patch or "", cfg)
        values = {"status": "resolved" if report.resolution == "FULL" else "unresolved", "error": None,
                  "report": instance_report(prediction, report), "test_output": report.log or report.log_tail}
    except (RewardError, SandboxError) as e:
        values = {"status": "error", "report": None, "test_output": getattr(e, "log", "") or None,
                  "error": f"{type(e).__name__}: {e}"}
    except Exception as e:  # the harness broke on this prediction: an error, as SWE-bench's
        logger.exception("grading %s of evaluation %s failed", instance_id, evaluation_id)
        values = {"status": "error", "report": None, "test_output": None, "error": f"{type(e).__name__}: {e}"}
    finally:
        heart.cancel()
    async with engine.begin() as conn:
        done = await conn.execute(sa.update(EvaluationInstance).where(*mine).values(
            **values, graded_at=utcnow(), heartbeat_at=None))
    return values["status"] if done.rowcount == 1 else None
