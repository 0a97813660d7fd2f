"""Evaluations: SWE-bench predictions graded by the workers (service.control.evaluations)."""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Annotated, Literal

import sqlalchemy as sa
from fastapi import APIRouter, HTTPException, Query, Request
from pydantic import BaseModel

from envs.predictions import PredictionsError, parse_predictions
from service.api.answers import AnswersDep
from service.api.deps import TOKEN_REQUIRED, EngineDep, SessionDep, SettingsDep
from service.api.schemas import HTTPValidationError, Page, Problem
from service.control import suites as importer
from service.control.evaluations import EvaluationConfig, cancel_evaluation, create_evaluation, run_report
from service.store.tables import Evaluation, EvaluationInstance, Suite

router = APIRouter(prefix="/evaluations", tags=["evaluations"])
Limit = Annotated[int, Query(ge=1, le=500)]
Offset = Annotated[int, Query(ge=0, le=2**31 - 1)]
InstanceStatus = Literal["pending", "grading", "resolved", "unresolved", "empty_patch", "error"]

_BODY = {"requestBody": {"required": True, "description": "SWE-bench predictions (instance_id, "
                         "model_name_or_path, model_patch): JSON Lines, a JSON list, or a JSON object keyed by "
                         "instance id.", "content": {"application/x-ndjson": {"schema": {"type": "string"}},
                                                     "application/json": {"schema": {}}}}}


class EvaluationPublic(BaseModel):
    id: uuid.UUID
    suite_id: uuid.UUID
    suite_name: str
    run_id: str
    model_name_or_path: str
    status: str
    config: dict
    created_at: datetime
    finished_at: datetime | None
    counts: dict[str, int]
    """Predictions by status: pending, grading, resolved, unresolved, empty_patch, error."""
    report: dict | None
    """SWE-bench's run report (make_run_report's fields): final once done, as of now before."""


class InstanceSummary(BaseModel):
    instance_id: str
    task_id: uuid.UUID
    status: str
    attempt: int
    graded_at: datetime | None


class InstancePublic(InstanceSummary):
    model_patch: str | None
    report: dict | None
    """SWE-bench's report.json of the instance."""
    test_output: str | None
    """The tests' whole log (SWE-bench's test_output.txt); withheld without the API token."""
    error: str | None
    redacted: list[str]


async def _summary(session, evaluation: Evaluation, suite_name: str) -> dict:
    counts = dict((await session.execute(
        sa.select(EvaluationInstance.status, sa.func.count()).where(EvaluationInstance.evaluation_id == evaluation.id)
        .group_by(EvaluationInstance.status))).all())
    report = evaluation.report
    if report is None:
        report = await run_report(await session.connection(), evaluation)
    return {**{c: getattr(evaluation, c) for c in ("id", "suite_id", "run_id", "model_name_or_path", "status", "config",
                                                   "created_at", "finished_at")},
            "suite_name": suite_name, "counts": counts, "report": report}


async def _evaluation(session, evaluation_id: uuid.UUID) -> tuple[Evaluation, str]:
    row = (await session.execute(sa.select(Evaluation, Suite.name).join(Suite, Suite.id == Evaluation.suite_id)
                                 .where(Evaluation.id == evaluation_id))).first()
    if row is None:
        raise HTTPException(status_code=404, detail=f"evaluation {evaluation_id} not found")
    return row[0], row[1]


@router.post("", status_code=201, dependencies=TOKEN_REQUIRED, response_model=EvaluationPublic, openapi_extra=_BODY,
             responses={401: {"model": Problem}, 404: {"model": Problem}, 409: {"model": Problem},
                        413: {"model": Problem}, 415: {"model": Problem}, 422: {"model": Problem | HTTPValidationError}})
async def start_evaluation(
    request: Request, session: SessionDep, engine: EngineDep, settings: SettingsDep,
    suite_id: uuid.UUID,
    run_id: Annotated[str, Query(min_length=1, max_length=200, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")],
    backend: Literal["bwrap", "docker"] = "bwrap",
    concurrency: Annotated[int, Query(ge=1, le=256)] = 4,
) -> dict:  # fmt: skip
    """Grade one model's predictions for a suite's instances, as the SWE-bench harness grades them."""
    media = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if media not in importer.JSONL_TYPES + importer.JSON_TYPES:
        raise HTTPException(status_code=415, detail="send the predictions as application/x-ndjson (JSON Lines) or "
                                                    "application/json (a list, or an object keyed by instance id)")
    suite = await session.get(Suite, suite_id)
    if suite is None or suite.deleted_at is not None:
        raise HTTPException(status_code=404, detail=f"suite {suite_id} not found")
    parts = [chunk async for chunk in importer.limit_size(request.stream(), settings.max_upload_bytes)]
    try:
        text = b"".join(parts).decode()  # joined once: linear in the upload
        del parts
        predictions = parse_predictions(text, "predictions", as_json=media in importer.JSON_TYPES,
                                        max_record_bytes=settings.max_record_bytes)
        evaluation_id = await create_evaluation(engine, suite_id, run_id, predictions,
                                                EvaluationConfig(backend=backend, concurrency=concurrency))
    except UnicodeDecodeError as e:
        raise HTTPException(status_code=422, detail=f"predictions: not UTF-8 ({e.reason} at byte {e.start})") from e
    except PredictionsError as e:
        raise HTTPException(status_code=422, detail=str(e)) from e
    evaluation, name = await _evaluation(session, evaluation_id)
    return await _summary(session, evaluation, name)


@router.get("", response_model=Page[EvaluationPublic])
async def list_evaluations(session: SessionDep, suite_id: uuid.UUID | None = None, limit: Limit = 100,
                           offset: Offset = 0) -> dict:  # fmt: skip
    where = [Evaluation.suite_id == suite_id] if suite_id else []
    total = await session.scalar(sa.select(sa.func.count()).select_from(Evaluation).where(*where))
    rows = (await session.execute(sa.select(Evaluation, Suite.name).join(Suite, Suite.id == Evaluation.suite_id)
                                  .where(*where).order_by(Evaluation.created_at.desc(), Evaluation.id)
                                  .limit(limit).offset(offset))).all()
    return {"items": [await _summary(session, e, n) for e, n in rows], "total": total, "limit": limit, "offset": offset}


@router.get("/{evaluation_id}", response_model=EvaluationPublic, responses={404: {"model": Problem}})
async def show_evaluation(session: SessionDep, evaluation_id: uuid.UUID) -> dict:
    return await _summary(session, *await _evaluation(session, evaluation_id))


@router.post("/{evaluation_id}/cancel", response_model=EvaluationPublic, dependencies=TOKEN_REQUIRED,
             responses={401: {"model": Problem}, 404: {"model": Problem}})
async def cancel(session: SessionDep, engine: EngineDep, evaluation_id: uuid.UUID) -> dict:
    await _evaluation(session, evaluation_id)
    await cancel_evaluation(engine, evaluation_id)
    session.expire_all()
    return await _summary(session, *await _evaluation(session, evaluation_id))


@router.get("/{evaluation_id}/instances", response_model=Page[InstanceSummary], responses={404: {"model": Problem}})
async def list_instances(session: SessionDep, evaluation_id: uuid.UUID, status: InstanceStatus | None = None,
                         limit: Limit = 100, offset: Offset = 0) -> dict:  # fmt: skip
    await _evaluation(session, evaluation_id)
    where = [EvaluationInstance.evaluation_id == evaluation_id] + ([EvaluationInstance.status == status] if status else [])
    total = await session.scalar(sa.select(sa.func.count()).select_from(EvaluationInstance).where(*where))
    rows = (await session.execute(sa.select(EvaluationInstance.instance_id, EvaluationInstance.task_id,
                                            EvaluationInstance.status, EvaluationInstance.attempt,
                                            EvaluationInstance.graded_at)
                                  .where(*where).order_by(EvaluationInstance.instance_id).limit(limit)
                                  .offset(offset))).all()
    return {"items": [r._asdict() for r in rows], "total": total, "limit": limit, "offset": offset}


async def instance_detail(session, answers, evaluation_id: uuid.UUID, instance_id: str) -> dict:
    row = await session.get(EvaluationInstance, (evaluation_id, instance_id))
    if row is None:
        raise HTTPException(status_code=404, detail=f"instance {instance_id!r} is not in evaluation {evaluation_id}")
    out = {c: getattr(row, c) for c in ("instance_id", "task_id", "status", "attempt", "graded_at", "model_patch",
                                        "report", "test_output", "error")}
    return answers.evaluation_instance(out)


@router.get("/{evaluation_id}/instances/{instance_id:path}", response_model=InstancePublic,
            responses={404: {"model": Problem}})
async def show_instance(session: SessionDep, answers: AnswersDep, evaluation_id: uuid.UUID, instance_id: str) -> dict:
    """One prediction: SWE-bench's report.json, the test log (with the API token) and the patch."""
    return await instance_detail(session, answers, evaluation_id, instance_id)

