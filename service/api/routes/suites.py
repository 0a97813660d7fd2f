"""Suites: streaming upload, list, show, tasks, delete."""

from __future__ import annotations

import uuid
from typing import Annotated, Literal

import sqlalchemy as sa
from fastapi import APIRouter, HTTPException, Query, Request, Response

from service.control import suites as importer
from service.api.answers import AnswersDep
from service.api.deps import TOKEN_REQUIRED, EngineDep, SessionDep, SettingsDep
from service.api.routes.tasks import task_summary
from service.api.schemas import (
    HTTPValidationError,
    Page,
    Problem,
    SuiteCreated,
    SuitePublic,
    SuiteRejectedPublic,
    SuiteValidationPublic,
    TaskSummary,
    ValidationStarted,
)
from service.control.evaluations import EVALUATION_ACTIVE
from service.store.tables import Evaluation, Run, Suite, Task, utcnow
from service.store.status import RUN_ACTIVE

router = APIRouter(prefix="/suites", tags=["suites"])
DatasetFormat = Literal["auto", "swe-bench", "swe-gym", "swe-smith", "swe-rebench", "r2e-gym"]
"""envs.datasets.FORMATS: how the rows are shaped (auto: told from each row's fields)."""

_TASK_ITEM = {"type": "object", "additionalProperties": True,
              "required": ["instance_id", "repo", "base_commit", "problem_statement",
                           "test_patch", "FAIL_TO_PASS", "PASS_TO_PASS"]}
_UPLOAD_BODY = {
    "requestBody": {
        "required": True,
        "description": "A suite: JSONL (one task per line), a JSON array of tasks, or Parquet as the "
                       "datasets ship on Hugging Face.",
        "content": {
            "application/x-ndjson": {"schema": {"type": "string"}},
            "application/json": {"schema": {"type": "array", "items": _TASK_ITEM}},
            "application/vnd.apache.parquet": {"schema": {"type": "string", "format": "binary"}},
        },
    }
}
Limit = Annotated[int, Query(ge=1, le=500)]
Offset = Annotated[int, Query(ge=0, le=2**31 - 1)]


async def live_suite(session: SessionDep, suite_id: uuid.UUID) -> Suite:
    suite = await session.get(Suite, suite_id)
    if suite is None or suite.deleted_at is not None:
        raise HTTPException(status_code=404, detail=f"suite {suite_id} not found")
    return suite


@router.post(
    "", status_code=201, response_model=SuiteCreated, dependencies=TOKEN_REQUIRED,
    openapi_extra=_UPLOAD_BODY,
    responses={401: {"model": Problem}, 409: {"model": Problem}, 413: {"model": Problem},
               415: {"model": Problem}, 422: {"model": SuiteRejectedPublic | HTTPValidationError}},
)  # fmt: skip
async def upload_suite(
    request: Request,
    engine: EngineDep,
    settings: SettingsDep,
    name: Annotated[str, Query(min_length=1, max_length=200, pattern=r"^[^\x00-\x1f]+$")],
    format: DatasetFormat = "auto",  # noqa: A002
) -> SuiteCreated:
    """Import a suite; every record is validated and nothing is written if one is bad."""
    parse = importer.parser_for(request.headers.get("content-type", ""))
    if parse is None:
        raise HTTPException(status_code=415, detail="send the suite as application/x-ndjson "
                            "(JSONL), application/json (an array of tasks) or application/vnd.apache.parquet")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > settings.max_upload_bytes:
        raise importer.UploadTooLarge(settings.max_upload_bytes)
    chunks = importer.limit_size(request.stream(), settings.max_upload_bytes)
    result = await importer.import_suite(
        engine, name, parse(chunks, settings.max_record_bytes), max_listed_errors=settings.max_listed_errors, fmt=format,
        source_roots=settings.source_root_list,
    )
    return SuiteCreated(id=result.suite_id, name=result.name, task_count=result.task_count)


@router.get("", response_model=Page[SuitePublic])
async def list_suites(session: SessionDep, limit: Limit = 100, offset: Offset = 0) -> dict:
    live = Suite.deleted_at.is_(None)
    total = await session.scalar(sa.select(sa.func.count()).select_from(Suite).where(live))
    rows = await session.scalars(
        sa.select(Suite).where(live).order_by(Suite.created_at.desc(), Suite.id)
        .limit(limit).offset(offset)
    )
    return {"items": list(rows), "total": total, "limit": limit, "offset": offset}


@router.get("/{suite_id}", response_model=SuitePublic, responses={404: {"model": Problem}})
async def show_suite(session: SessionDep, suite_id: uuid.UUID) -> Suite:
    return await live_suite(session, suite_id)


@router.get("/{suite_id}/tasks", response_model=Page[TaskSummary],
            responses={404: {"model": Problem}})
async def list_suite_tasks(
    session: SessionDep, suite_id: uuid.UUID, repo: str | None = None,
    limit: Limit = 100, offset: Offset = 0,
) -> dict:  # fmt: skip
    await live_suite(session, suite_id)
    where = [Task.suite_id == suite_id] + ([Task.repo == repo] if repo is not None else [])
    total = await session.scalar(sa.select(sa.func.count()).select_from(Task).where(*where))
    rows = await session.scalars(
        sa.select(Task).where(*where).order_by(Task.position).limit(limit).offset(offset)
    )
    return {"items": [task_summary(t) for t in rows], "total": total,
            "limit": limit, "offset": offset}


@router.post("/{suite_id}/validate", status_code=202, dependencies=TOKEN_REQUIRED, response_model=ValidationStarted,
             responses={401: {"model": Problem}, 404: {"model": Problem}, 409: {"model": Problem}})
async def validate_suite(request: Request, session: SessionDep, engine: EngineDep, suite_id: uuid.UUID) -> dict:
    """Start validating every task (gold patch FULL, empty patch failing) in the background. The
    validation holds a lease: one whose process died is taken over, never left running."""
    from service.control.validation import claim_validation

    await live_suite(session, suite_id)
    validations = request.app.state.validations
    if not await claim_validation(engine, suite_id, validations.owner, validations.lease_s):
        raise HTTPException(status_code=409, detail="a validation of this suite is already running")
    validations.start(suite_id)
    return {"status": "running", "results": f"/api/v1/suites/{suite_id}/validation"}


@router.get("/{suite_id}/validation", response_model=SuiteValidationPublic, responses={404: {"model": Problem}})
async def show_validation(session: SessionDep, answers: AnswersDep, suite_id: uuid.UUID) -> dict:
    suite = await live_suite(session, suite_id)
    rows = await session.execute(sa.select(Task.id, Task.instance_id, Task.validation)
                                 .where(Task.suite_id == suite_id).order_by(Task.position))
    validations = [(r, answers.validation(r.validation)) for r in rows if r.validation]
    results = [{"task_id": r.id, "instance_id": r.instance_id, "valid": v["valid"],
                "gold": (v["gold"] or {}).get("resolution"), "empty": (v["empty"] or {}).get("resolution"),
                "error": v["error"], "redacted": v["redacted"]} for r, v in validations]
    return {"status": suite.validation_status or "never", "validated_at": suite.validated_at, "results": results}


@router.delete("/{suite_id}", status_code=204, dependencies=TOKEN_REQUIRED,
               responses={401: {"model": Problem}, 404: {"model": Problem},
                          409: {"model": Problem}})
async def delete_suite(session: SessionDep, suite_id: uuid.UUID) -> Response:
    """Delete a suite. Refused while a run or an evaluation uses it; kept hidden while finished
    ones refer to it."""
    suite = await live_suite(session, suite_id)
    runs = (await session.execute(sa.select(Run.id, Run.status).where(Run.suite_id == suite_id)))
    runs = runs.all() + (await session.execute(sa.select(Evaluation.id, Evaluation.status)
                                               .where(Evaluation.suite_id == suite_id))).all()
    active = [str(r.id) for r in runs if r.status in RUN_ACTIVE + EVALUATION_ACTIVE]
    if active:
        raise HTTPException(status_code=409, detail=f"suite is used by active run(s) or evaluation(s) "
                            f"{', '.join(active[:5])}; cancel them first")
    if runs:
        suite.deleted_at = utcnow()  # finished runs keep their tasks and episodes
    else:
        await session.delete(suite)
    await session.commit()
    return Response(status_code=204)
