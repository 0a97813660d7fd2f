"""Tasks: one task by id; the gold patch and hidden tests only for token holders."""

from __future__ import annotations

import uuid

from fastapi import APIRouter, HTTPException

from service.api.answers import AnswersDep
from service.api.deps import SessionDep
from service.api.schemas import Problem, TaskPublic, TaskSummary
from service.store.tables import Task

router = APIRouter(prefix="/tasks", tags=["tasks"])


def task_summary(task: Task) -> TaskSummary:
    return TaskSummary(
        id=task.id, suite_id=task.suite_id, position=task.position,
        instance_id=task.instance_id, repo=task.repo, base_commit=task.base_commit,
        version=task.version, n_fail_to_pass=len(task.fail_to_pass),
        n_pass_to_pass=len(task.pass_to_pass),
    )  # fmt: skip


@router.get("/{task_id}", response_model=TaskPublic, responses={404: {"model": Problem}})
async def show_task(session: SessionDep, task_id: uuid.UUID, answers: AnswersDep) -> TaskPublic:
    task = await session.get(Task, task_id)
    if task is None:
        raise HTTPException(status_code=404, detail=f"task {task_id} not found")
    return TaskPublic(
        **task_summary(task).model_dump(exclude={"n_fail_to_pass", "n_pass_to_pass"}),
        problem_statement=task.problem_statement, FAIL_TO_PASS=task.fail_to_pass,
        PASS_TO_PASS=task.pass_to_pass,
        environment_setup_commit=task.environment_setup_commit, hints_text=task.hints_text,
        created_at=task.task_created_at, source=task.source, image=task.image,
        install=task.install, test_cmd=task.test_cmd, log_parser=task.log_parser,
        **answers.task(task.patch, task.test_patch, task.extra),
    )  # fmt: skip
