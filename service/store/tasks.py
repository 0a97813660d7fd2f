"""Task rows: a Task record as the `tasks` table stores it, and back."""

from __future__ import annotations

import uuid
from typing import Any

from envs.task import Task
from service.store.tables import Task as TaskRow


def task_row(task: Task, suite_id: uuid.UUID, position: int) -> dict[str, Any]:
    return {
        "id": uuid.uuid4(), "suite_id": suite_id, "position": position,
        "instance_id": task.instance_id, "repo": task.repo, "base_commit": task.base_commit,
        "problem_statement": task.problem_statement, "test_patch": task.test_patch,
        "patch": task.patch, "fail_to_pass": task.FAIL_TO_PASS,
        "pass_to_pass": task.PASS_TO_PASS, "version": task.version,
        "environment_setup_commit": task.environment_setup_commit,
        "hints_text": task.hints_text, "task_created_at": task.created_at,
        "source": task.source, "image": task.image, "install": task.install,
        "test_cmd": task.test_cmd, "log_parser": task.log_parser,
        "extra": {**task.unknown_fields(), **task.grading_options()} or None,
    }  # fmt: skip


def task_from_row(row: TaskRow) -> Task:
    """The task record of a stored row (answers included: for the harness, never the agent)."""
    return Task.model_validate({
        "instance_id": row.instance_id, "repo": row.repo, "base_commit": row.base_commit,
        "problem_statement": row.problem_statement, "test_patch": row.test_patch,
        "FAIL_TO_PASS": row.fail_to_pass, "PASS_TO_PASS": row.pass_to_pass, "patch": row.patch,
        "version": row.version, "environment_setup_commit": row.environment_setup_commit,
        "hints_text": row.hints_text, "created_at": row.task_created_at, "source": row.source,
        "image": row.image, "install": row.install, "test_cmd": row.test_cmd,
        "log_parser": row.log_parser, **(row.extra or {}),
    })  # fmt: skip
