"""HTML pages: runs, a run, an episode, suites, a suite, a task. Data comes from the same
queries as the REST API, redacted the same way; the pages' scripts read the REST API and the
events stream. POST /ui/token keeps the API token's cookie for reading answers."""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from urllib.parse import parse_qs

import sqlalchemy as sa
from fastapi import APIRouter, HTTPException, Query, Request
from fastapi.responses import HTMLResponse, RedirectResponse
from fastapi.templating import Jinja2Templates

from service.api.answers import AnswersDep, answers, remember
from service.control.redaction import REDACTED
from service.api.deps import SessionDep
from service.api.routes.evaluations import instance_detail, list_evaluations, list_instances, show_evaluation
from service.control.views import (
    episode_detail, get_run, group_detail, list_runs, progress, task_difficulty, training,
)  # fmt: skip
from service.store.tables import Episode, Group, Policy, Run, Suite, Task
from service.store.status import EPISODE_FINAL, RUN_ACTIVE

router = APIRouter(include_in_schema=False)
templates = Jinja2Templates(directory=Path(__file__).resolve().parent / "templates")
templates.env.globals["REDACTED"] = REDACTED
FIRST_TURNS = 50
MAX_FORM_BYTES = 4096


def _page(request: Request, name: str, **context) -> HTMLResponse:
    context |= {"token_required": not request.app.state.settings.local_mode, "answers_shown": answers(request).shown}
    return templates.TemplateResponse(request, name, context)


def diff_lines(diff: str | None) -> list[tuple[str, str]]:
    """(css class, line) for a unified diff; the template escapes the text."""
    out = []
    for line in (diff or "").splitlines():
        kind = ("meta" if line.startswith(("diff --git", "index ", "--- ", "+++ ")) else
                "hunk" if line.startswith("@@") else "add" if line.startswith("+") else
                "del" if line.startswith("-") else "ctx")  # fmt: skip
        out.append((kind, line))
    return out


@router.get("/docs", response_class=HTMLResponse)
async def api_docs(request: Request):
    """The OpenAPI docs: Swagger UI served from static/vendor, under the UI's CSP."""
    return templates.TemplateResponse(request, "docs.html", {"openapi_url": request.app.openapi_url})


@router.get("/", response_class=HTMLResponse)
async def runs_page(request: Request, session: SessionDep, answers: AnswersDep,
                    limit: int = Query(100, ge=1, le=1000)):  # fmt: skip
    page = await list_runs(session, limit, 0, answers)
    return _page(request, "runs.html", runs=page["items"], total=page["total"], active=RUN_ACTIVE)


@router.get("/runs/{run_id}", response_class=HTMLResponse)
async def run_page(request: Request, session: SessionDep, answers: AnswersDep, run_id: uuid.UUID):
    run = await get_run(session, run_id)
    state = await progress(session, run, answers)
    tasks = (await session.execute(
        sa.select(Task.instance_id, sa.func.count(Episode.id), sa.func.avg(Episode.reward), sa.func.avg(Episode.n_turns),
                  sa.func.avg(Episode.input_tokens + Episode.output_tokens))
        .join(Episode, Episode.task_id == Task.id).where(Episode.run_id == run_id)
        .group_by(Task.instance_id).order_by(Task.instance_id))).all()
    episodes = (await session.execute(
        sa.select(Episode.id, Episode.status, Episode.reward, Episode.n_turns, Episode.input_tokens,
                  Episode.output_tokens, Episode.policy_version_min, Episode.finished_at, Task.instance_id,
                  Episode.sample_index, Episode.group_id)
        .join(Task, Task.id == Episode.task_id).where(Episode.run_id == run_id)
        .order_by(Task.instance_id, Episode.sample_index))).all()
    series = {
        "finished": [{"t": e.finished_at.isoformat() if e.finished_at else None, "reward": e.reward,
                      "version": e.policy_version_min, "turns": e.n_turns,
                      "tokens": (e.input_tokens or 0) + (e.output_tokens or 0)}
                     for e in episodes if e.status in EPISODE_FINAL],
    }
    consumed = (await session.execute(sa.select(Group.trainer_step, Group.min_policy_version).where(
        Group.run_id == run_id, Group.status == "consumed", Group.trainer_step.is_not(None),
        Group.min_policy_version.is_not(None)))).all()
    # staleness of a consumed group: the step that trained on it minus its oldest sampling version
    series["staleness"] = [(s - 1) - v for s, v in consumed]
    policies = (await session.execute(sa.select(Policy.version, Policy.info).order_by(Policy.version))).all()
    trainer = [{"version": v, **{k: (info or {}).get(k) for k in ("loss", "mismatch_kl", "entropy", "masked_fraction",
                                                                  "reward_mean", "staleness_mean")}}
               for v, info in policies if info]
    train = await training(session, run)
    difficulty = await task_difficulty(session, run_id, 200) if train else None
    parent = await session.get(Run, run.parent_id) if run.parent_id else None
    return _page(request, "run.html", run=state, tasks=tasks, episodes=episodes, has_staleness=bool(consumed),
                 series_json=json.dumps(series), trainer_json=json.dumps(trainer), has_trainer=bool(trainer),
                 config_json=json.dumps(run.config, indent=1), active=RUN_ACTIVE, training=train,
                 training_json=json.dumps(train, default=str) if train else "null", difficulty=difficulty,
                 parent=parent)


@router.get("/groups/{group_id}", response_class=HTMLResponse)
async def group_page(request: Request, session: SessionDep, answers: AnswersDep, group_id: uuid.UUID):
    group = await group_detail(session, answers, group_id)
    for e in group["episodes"]:
        e["diff_lines"] = diff_lines(e.get("diff"))
    return _page(request, "group.html", g=group)


@router.get("/episodes/{episode_id}", response_class=HTMLResponse)
async def episode_page(request: Request, session: SessionDep, answers: AnswersDep, episode_id: uuid.UUID):
    e = await episode_detail(session, answers, episode_id, turns_limit=FIRST_TURNS)
    siblings = (await session.execute(sa.select(Episode.id).join(Task, Task.id == Episode.task_id)
                                      .where(Episode.run_id == e["run_id"])
                                      .order_by(Task.instance_id, Episode.sample_index))).scalars().all()
    at = siblings.index(episode_id)
    report = e["report"] or {}
    return _page(request, "episode.html", e=e, turns=e["turns"], report=report, tests=_tests(report),
                 diff=diff_lines(e["diff"]), more=e["n_turns"] > len(e["turns"]),
                 prev_id=siblings[at - 1] if at > 0 else None,
                 next_id=siblings[at + 1] if at + 1 < len(siblings) else None,
                 tool_json=lambda t: json.dumps(t, indent=1, ensure_ascii=False))


def _tests(report: dict) -> list[tuple[str, str, str]]:
    """(list, test, status) from a grading report: FAIL_TO_PASS and PASS_TO_PASS outcomes."""
    out = []
    for group, key in (("FAIL_TO_PASS", "fail_to_pass"), ("PASS_TO_PASS", "pass_to_pass")):
        results = report.get(key) or {}
        for status in ("success", "failure"):
            out += [(group, test, "passed" if status == "success" else "failed") for test in results.get(status, [])]
    return out


@router.get("/suites", response_class=HTMLResponse)
async def suites_page(request: Request, session: SessionDep):
    suites = (await session.scalars(sa.select(Suite).where(Suite.deleted_at.is_(None)).order_by(Suite.created_at.desc()))).all()
    return _page(request, "suites.html", suites=suites)


@router.get("/suites/{suite_id}", response_class=HTMLResponse)
async def suite_page(request: Request, session: SessionDep, suite_id: uuid.UUID,
                     offset: int = Query(0, ge=0), limit: int = Query(200, ge=1, le=1000)):  # fmt: skip
    suite = await session.get(Suite, suite_id)
    if suite is None or suite.deleted_at is not None:
        raise HTTPException(status_code=404, detail=f"suite {suite_id} not found")
    tasks = (await session.scalars(sa.select(Task).where(Task.suite_id == suite_id).order_by(Task.position)
                                   .offset(offset).limit(limit))).all()
    return _page(request, "suite.html", suite=suite, tasks=tasks, offset=offset, limit=limit)


@router.get("/tasks/{task_id}", response_class=HTMLResponse)
async def task_page(request: Request, session: SessionDep, answers: AnswersDep, task_id: uuid.UUID):
    task = await session.get(Task, task_id)
    if task is None:
        raise HTTPException(status_code=404, detail=f"task {task_id} not found")
    return _page(request, "task.html", task=task, validation=answers.validation(task.validation) or {})


@router.get("/evaluations", response_class=HTMLResponse)
async def evaluations_page(request: Request, session: SessionDep, limit: int = Query(100, ge=1, le=500)):
    page = await list_evaluations(session, None, limit, 0)
    return _page(request, "evaluations.html", evaluations=page["items"])


@router.get("/evaluations/{evaluation_id}", response_class=HTMLResponse)
async def evaluation_page(request: Request, session: SessionDep, evaluation_id: uuid.UUID,
                          offset: int = Query(0, ge=0, le=2**31 - 1), limit: int = Query(200, ge=1, le=500)):  # fmt: skip
    evaluation = await show_evaluation(session, evaluation_id)
    instances = await list_instances(session, evaluation_id, None, limit, offset)
    return _page(request, "evaluation.html", e=evaluation, instances=instances["items"], offset=offset, limit=limit)


@router.get("/evaluations/{evaluation_id}/instances/{instance_id:path}", response_class=HTMLResponse)
async def evaluation_instance_page(request: Request, session: SessionDep, answers: AnswersDep,
                                   evaluation_id: uuid.UUID, instance_id: str):  # fmt: skip
    i = await instance_detail(session, answers, evaluation_id, instance_id)
    status = (i["report"] or {}).get(instance_id, {}).get("tests_status") or {}
    report = {"fail_to_pass": status.get("FAIL_TO_PASS"), "pass_to_pass": status.get("PASS_TO_PASS")}
    return _page(request, "evaluation_instance.html", i=i, evaluation_id=evaluation_id, tests=_tests(report),
                 diff=diff_lines(i["model_patch"]))


@router.post("/ui/token")
async def remember_token(request: Request) -> RedirectResponse:
    """The header's form: a right token sets the answers cookie, anything else clears it; back to
    the page it came from (a path on this site only)."""
    body = b""
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_FORM_BYTES:
            raise HTTPException(status_code=413, detail="form too large")
    form = parse_qs(body.decode(errors="replace"))
    back = form.get("next", ["/"])[0]
    if not back.startswith("/") or back.startswith(("//", "/\\")):
        back = "/"
    response = RedirectResponse(back, status_code=303)
    remember(request, response, form.get("token", [""])[0])
    return response
