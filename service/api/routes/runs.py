"""Runs and episodes: create (schedules on the Celery workers), list, progress, cancel,
episodes with their turns, the events stream, the buffer, the published policies."""

from __future__ import annotations

import asyncio
import json
import uuid
from typing import Annotated

from fastapi import APIRouter, HTTPException, Query, Request
from fastapi.responses import StreamingResponse

from service.api.answers import AnswersDep
from service.api.deps import TOKEN_REQUIRED, EngineDep, SessionDep, SettingsDep
from service.api.schemas import (
    BufferStats, DifficultyPublic, EpisodeDetail, EpisodePublic, GroupDetail, HTTPValidationError, Page, PolicyPublic,
    Problem, RunProgress, RunStatusPublic, TurnTokens,
)  # fmt: skip
from service.control import export, views
from service.control.admission import AdmissionError, check_run
from service.control.redaction import is_oracle
from service.control.runs import RunError, create_run
from service.store.buffer import Buffer
from service.store.status import RUN_ACTIVE
from service.worker.config import RunConfig

router = APIRouter(tags=["runs"])
Limit = Annotated[int, Query(ge=1, le=500)]
Offset = Annotated[int, Query(ge=0, le=2**31 - 1)]
NOT_FOUND = {404: {"model": Problem}}


@router.post("/runs", status_code=201, dependencies=TOKEN_REQUIRED, response_model=RunStatusPublic,
             responses={400: {"model": Problem}, 401: {"model": Problem},
                        422: {"model": Problem | HTTPValidationError}})
async def create(request: Request, engine: EngineDep, settings: SettingsDep, cfg: RunConfig) -> dict:
    """Create a run. Refused (422, naming each field) when it asks for more than this service
    allows: limits above the operator's ceilings, endpoints that are not http(s) to allowed
    hosts, a tokenizer that is neither under a model folder nor the model the endpoints serve
    (service.control.admission)."""
    try:
        await check_run(cfg, settings)
        run_id = await create_run(engine, cfg)
    except (RunError, AdmissionError) as e:
        raise HTTPException(status_code=422, detail=str(e)) from e
    request.app.state.supervisor.start(run_id)
    return {"id": run_id, "status": "running"}


@router.get("/runs", response_model=Page[RunProgress])
async def list_runs(session: SessionDep, answers: AnswersDep, limit: Limit = 50, offset: Offset = 0) -> dict:
    return await views.list_runs(session, limit, offset, answers)


@router.get("/runs/{run_id}", response_model=RunProgress, responses=NOT_FOUND)
async def show_run(session: SessionDep, answers: AnswersDep, run_id: uuid.UUID) -> dict:
    """The run's progress; a training run's also has `training`: every step's metrics (reward,
    mismatch KL, entropy, staleness, useful-group fraction, filtered tasks, the step's time
    split into waiting, training and publishing) and every evaluation (pass@1 with its 95%
    interval, pass@k, format-error rate, mean turns and tokens)."""
    run = await views.get_run(session, run_id)
    return await views.progress(session, run, answers) | {"training": await views.training(session, run)}


@router.get("/runs/{run_id}/tasks", response_model=DifficultyPublic, responses=NOT_FOUND)
async def task_difficulty(session: SessionDep, run_id: uuid.UUID, limit: Limit = 500) -> dict:
    """Per task: its pass rate in each epoch, and how often the difficulty filter skipped it."""
    await views.get_run(session, run_id)
    return await views.task_difficulty(session, run_id, limit)


@router.get("/groups/{group_id}", response_model=GroupDetail, responses=NOT_FOUND)
async def show_group(session: SessionDep, answers: AnswersDep, group_id: uuid.UUID) -> dict:
    """One task's samples side by side: status, reward, advantage, turns, tokens and diff."""
    return await views.group_detail(session, answers, group_id)


@router.post("/runs/{run_id}/cancel", dependencies=TOKEN_REQUIRED, response_model=RunStatusPublic,
             responses={401: {"model": Problem}, 404: {"model": Problem}, 409: {"model": Problem}})
async def cancel_run(session: SessionDep, run_id: uuid.UUID) -> dict:
    run = await views.get_run(session, run_id)
    if not await Buffer.request_cancel(await session.connection(), run_id):
        raise HTTPException(status_code=409, detail=f"run {run_id} is already {run.status}")
    await session.commit()
    return {"id": run_id, "status": "cancelling"}


@router.get("/runs/{run_id}/episodes", response_model=Page[EpisodePublic], responses=NOT_FOUND)
async def list_episodes(session: SessionDep, answers: AnswersDep, run_id: uuid.UUID, status: str | None = None,
                        task: Annotated[str | None, Query(max_length=256)] = None,
                        min_reward: Annotated[float | None, Query(allow_inf_nan=False)] = None,
                        policy_version: Annotated[int | None, Query(ge=0, le=2**31 - 1)] = None,
                        limit: Limit = 100, offset: Offset = 0) -> dict:
    return await views.list_episodes(session, answers, run_id, status=status, task=task, min_reward=min_reward,
                                     policy_version=policy_version, limit=limit, offset=offset)


@router.get("/episodes/{episode_id}", response_model=EpisodeDetail, response_model_exclude_unset=True,
            responses=NOT_FOUND)
async def show_episode(session: SessionDep, answers: AnswersDep, episode_id: uuid.UUID, arrays: views.Arrays = "none",
                       turns_offset: Annotated[int, Query(ge=0, le=2**31 - 1)] = 0,
                       turns_limit: Annotated[int | None, Query(ge=1, le=100_000)] = None) -> dict:
    """The episode with its turns (all, or `turns_limit` from `turns_offset`: long episodes
    load page by page). Without the API token, `redacted` (on the episode, its report and each
    turn) names what was withheld: an oracle episode's turns and diff, the grading log tail."""
    return await views.episode_detail(session, answers, episode_id, arrays=arrays, turns_offset=turns_offset,
                                      turns_limit=turns_limit)


@router.get("/episodes/{episode_id}/tokens", response_model=TurnTokens,
            responses={404: {"model": Problem}, 409: {"model": Problem}})
async def episode_tokens(session: SessionDep, answers: AnswersDep, episode_id: uuid.UUID,
                         turn: Annotated[int, Query(ge=0, le=2**31 - 1)]) -> dict:
    """A turn's sampled tokens, each decoded alone with the run's tokenizer, with its logprob
    (for logprob shading in the episode viewer); none of an oracle's without the API token."""
    return await views.turn_tokens(session, answers, episode_id, turn)


@router.get("/runs/{run_id}/export", responses={200: {"content": {t: {} for t in export.MEDIA_TYPES.values()}},
                                                **NOT_FOUND, 422: {"model": Problem | HTTPValidationError}})
async def export_run(request: Request, answers: AnswersDep, run_id: uuid.UUID,
                     format: export.Format = "jsonl",  # noqa: A002
                     min_reward: float | None = None, max_reward: float | None = None,
                     status: Annotated[list[str] | None, Query(description="episode statuses to keep")] = None,
                     ) -> StreamingResponse:  # fmt: skip
    """The run's episodes as a dataset file (service.control.export): one row per episode with its
    messages, tool calls, token ids, logprobs, reward and grading report; streamed page by page.
    Without the API token an oracle's or a demonstration's turns are withheld, as everywhere."""
    try:
        fmt = export.check_format(format)
        flt = export.ExportFilter(min_reward=min_reward, max_reward=max_reward, statuses=tuple(status or ()))
    except export.ExportError as e:
        raise HTTPException(422, str(e)) from e
    engine = request.app.state.engine
    await export.get_run(engine, run_id)  # a 404 before the response starts
    return StreamingResponse(export.stream(engine, run_id, fmt, answers, flt), media_type=export.MEDIA_TYPES[fmt],
                             headers={"Content-Disposition": f'attachment; filename="run-{run_id}.{fmt}"'})


@router.get("/events", responses=NOT_FOUND)
async def events(request: Request, answers: AnswersDep, run: uuid.UUID,
                 poll_s: Annotated[float, Query(ge=0.1, le=30)] = 1.0) -> StreamingResponse:
    """Server-sent events for a run: `progress` (the run's counts), `episode` (each episode
    that started or ended since the last event) and `end` when the run is over."""
    sessions = request.app.state.sessions
    async with sessions() as session:
        oracle = is_oracle((await views.get_run(session, run)).config)

    def event(kind: str, data: dict) -> str:
        return f"event: {kind}\ndata: {json.dumps(data, default=str)}\n\n"

    async def stream():
        seen: dict[uuid.UUID, tuple] = {}
        while not await request.is_disconnected():
            async with sessions() as session:
                state, changed = await views.run_events(session, answers, run, oracle, seen)
            for episode in changed:
                yield event("episode", episode)
            yield event("progress", state)
            if state["status"] not in RUN_ACTIVE:
                yield event("end", {"status": state["status"]})
                return
            await asyncio.sleep(poll_s)

    return StreamingResponse(stream(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


@router.get("/buffer", response_model=BufferStats)
async def buffer_stats(request: Request) -> dict:
    return await Buffer(request.app.state.engine).stats()


@router.get("/policies", response_model=Page[PolicyPublic])
async def list_policies(session: SessionDep, limit: Limit = 100, offset: Offset = 0) -> dict:
    """Policy versions the trainer published, newest first, with the metrics of the step that
    made each (loss, reward, mismatch KL, entropy, masked fraction, staleness, tokens/s...)."""
    return await views.list_policies(session, limit, offset)
