"""API request and response models (`<Thing>Public`, `<Thing>Created`, `Page`)."""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Any, Generic, TypeVar

from pydantic import BaseModel, ConfigDict

T = TypeVar("T")


class Page(BaseModel, Generic[T]):
    items: list[T]
    total: int
    limit: int
    offset: int


class SuiteCreated(BaseModel):
    id: uuid.UUID
    name: str
    task_count: int


class SuitePublic(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    id: uuid.UUID
    name: str
    task_count: int
    created_at: datetime


class RecordErrorPublic(BaseModel):
    line: int | None
    index: int | None
    instance_id: str | None
    field: str | None
    message: str


class SuiteRejectedPublic(BaseModel):
    detail: str
    error_count: int
    errors: list[RecordErrorPublic]


class TaskValidationPublic(BaseModel):
    task_id: uuid.UUID
    instance_id: str
    valid: bool
    gold: str | None
    """Resolution with the gold patch (FULL when valid); None when grading failed."""
    empty: str | None
    """Resolution with no change (never FULL when valid)."""
    error: str | None
    redacted: list[str] = []
    """["error"] when the error is the grading harness's output and the caller has no API token."""


class SuiteValidationPublic(BaseModel):
    status: str
    """never, running, done or failed."""
    validated_at: datetime | None
    results: list[TaskValidationPublic]


class _TaskIdentity(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    id: uuid.UUID
    suite_id: uuid.UUID
    position: int
    instance_id: str
    repo: str
    base_commit: str
    version: str | None


class TaskSummary(_TaskIdentity):
    n_fail_to_pass: int
    n_pass_to_pass: int


class TaskPublic(_TaskIdentity):
    """A task as stored; `patch` and `test_patch` are the answers, present only with the token."""

    problem_statement: str
    FAIL_TO_PASS: list[str]
    PASS_TO_PASS: list[str]
    environment_setup_commit: str | None
    hints_text: str | None
    created_at: datetime | None
    source: str | None
    image: str | None
    install: list[str] | None
    test_cmd: str | None
    log_parser: str
    extra: dict[str, Any] | None
    answers_included: bool
    """False when the caller had no token: `patch` and `test_patch` are then null."""
    patch: str | None
    test_patch: str | None


class ValidationIssue(BaseModel):
    loc: list[str | int]
    msg: str
    type: str


class HTTPValidationError(BaseModel):
    """FastAPI's answer to a request whose parameters do not validate."""

    detail: list[ValidationIssue]


class Problem(BaseModel):
    detail: str
