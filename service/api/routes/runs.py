"""Runs and episodes: create (schedules on the Celery workers), list, progress, cancel,
episodes with their turns."""

from __future__ import annotations

import asyncio
import base64
import uuid
from typing import Annotated, Literal

import sqlalchemy as sa
from fastapi import APIRouter, HTTPException, Query, Request

from service.api.answers import Answers, AnswersDep, is_oracle
from service.api.deps import TOKEN_REQUIRED, EngineDep, SessionDep
from service.store.buffer import Buffer
from service.store.records import decode_array
from service.control.runs import RunError, create_run
from service.worker.config import RunConfig
from service.api.schemas import HTTPValidationError, Problem
from service.store.tables import EPISODE_FINAL_STATUSES, RUN_ACTIVE_STATUSES, Episode, Run, Task, Turn

router = APIRouter(tags=["runs"])
Limit = Annotated[int, Query(ge=1, le=500)]
Offset = Annotated[int, Query(ge=0, le=2**31 - 1)]


def start_orchestrator(request: Request, run_id: uuid.UUID) -> None:
    request.app.state.supervisor.start(run_id)


@router.post("/runs", status_code=201, dependencies=TOKEN_REQUIRED,
             responses={400: {"model": Problem}, 401: {"model": Problem},
                        422: {"model": Problem | HTTPValidationError}})
async def create(request: Request, engine: EngineDep, cfg: RunConfig) -> dict:
    try:
        run_id = await create_run(engine, cfg)
    except RunError as e:
        raise HTTPException(status_code=422, detail=str(e)) from e
    start_orchestrator(request, run_id)
    return {"id": run_id, "status": "running"}


async def progress(session, run: Run) -> dict:
    """A run's counts by status, reward mean, pass@1 / pass@k over tasks, tokens, throughput."""
    return (await progress_many(session, [run]))[0]


async def progress_many(session, runs: list[Run]) -> list[dict]:
    """progress() of many runs in three queries (the runs page lists hundreds)."""
    ids = [r.id for r in runs]
    if not ids:
        return []
    counts: dict[uuid.UUID, dict[str, int]] = {i: {} for i in ids}
    for run_id, status, n in (await session.execute(
            sa.select(Episode.run_id, Episode.status, sa.func.count()).where(Episode.run_id.in_(ids))
            .group_by(Episode.run_id, Episode.status))).all():
        counts[run_id][status] = n
    aggs = {row[0]: row[1:] for row in (await session.execute(sa.select(
        Episode.run_id, sa.func.avg(Episode.reward), sa.func.count(Episode.reward),
        sa.func.coalesce(sa.func.sum(Episode.input_tokens + Episode.output_tokens), 0),
        sa.func.min(Episode.started_at), sa.func.max(Episode.finished_at),
        sa.func.count(Episode.guards),
    ).where(Episode.run_id.in_(ids)).group_by(Episode.run_id))).all()}
    by_task: dict[uuid.UUID, list[tuple]] = {i: [] for i in ids}
    for run_id, best, mean in (await session.execute(
            sa.select(Episode.run_id, sa.func.max(Episode.reward), sa.func.avg(Episode.reward))
            .where(Episode.run_id.in_(ids), Episode.reward.is_not(None))
            .group_by(Episode.run_id, Episode.task_id))).all():
        by_task[run_id].append((best, mean))
    out = []
    for run in runs:
        reward, graded, tokens, start, end, guarded = aggs.get(run.id, (None, 0, 0, None, None, 0))
        elapsed = (end - start).total_seconds() if start and end else None
        tasks, c = by_task[run.id], counts[run.id]
        out.append({
            "id": run.id, "name": run.name, "status": run.status, "suite_id": run.suite_id,
            "created_at": run.created_at, "finished_at": run.finished_at, "episodes": c,
            "reward_mean": reward, "graded": graded, "tokens": tokens,
            "pass_at_1": sum(t[1] for t in tasks) / len(tasks) if tasks else None,
            "pass_at_k": sum(1 for t in tasks if t[0] == 1.0) / len(tasks) if tasks else None,
            "tokens_per_s": tokens / elapsed if elapsed else None,
            "episodes_per_s": sum(n for st, n in c.items() if st in EPISODE_FINAL_STATUSES) / elapsed if elapsed else None,
            "gate": run.gate, "owner": run.owner, "guarded": guarded,
        })  # fmt: skip
    return out


async def get_run(session, run_id: uuid.UUID) -> Run:
    run = await session.get(Run, run_id)
    if run is None:
        raise HTTPException(status_code=404, detail=f"run {run_id} not found")
    return run


@router.get("/runs")
async def list_runs(session: SessionDep, limit: Limit = 50, offset: Offset = 0) -> dict:
    total = await session.scalar(sa.select(sa.func.count()).select_from(Run))
    runs = (await session.scalars(sa.select(Run).order_by(Run.created_at.desc()).limit(limit).offset(offset))).all()
    return {"items": await progress_many(session, list(runs)), "total": total, "limit": limit, "offset": offset}


@router.get("/runs/{run_id}", responses={404: {"model": Problem}})
async def show_run(session: SessionDep, run_id: uuid.UUID) -> dict:
    return await progress(session, await get_run(session, run_id))


@router.post("/runs/{run_id}/cancel", dependencies=TOKEN_REQUIRED,
             responses={401: {"model": Problem}, 404: {"model": Problem}, 409: {"model": Problem}})
async def cancel_run(session: SessionDep, run_id: uuid.UUID) -> dict:
    run = await get_run(session, run_id)
    if not await Buffer.request_cancel(await session.connection(), run_id):
        raise HTTPException(status_code=409, detail=f"run {run_id} is already {run.status}")
    await session.commit()
    return {"id": run_id, "status": "cancelling"}


@router.get("/runs/{run_id}/episodes", responses={404: {"model": Problem}})
async def list_episodes(session: SessionDep, answers: AnswersDep, run_id: uuid.UUID, status: str | None = None,
                        task: str | None = None, min_reward: float | None = None,
                        policy_version: int | None = None, limit: Limit = 100, offset: Offset = 0) -> dict:
    oracle = is_oracle((await get_run(session, run_id)).config)
    where = [Episode.run_id == run_id]
    if status is not None:
        where.append(Episode.status == status)
    if task is not None:
        where.append(Task.instance_id == task)
    if min_reward is not None:
        where.append(Episode.reward >= min_reward)
    if policy_version is not None:
        where += [Episode.policy_version_min <= policy_version, Episode.policy_version_max >= policy_version]
    base = sa.select(Episode, Task.instance_id).join(Task, Task.id == Episode.task_id).where(*where)
    total = await session.scalar(sa.select(sa.func.count()).select_from(base.subquery()))
    rows = (await session.execute(base.order_by(Episode.created_at, Episode.sample_index).limit(limit).offset(offset))).all()
    return {"items": [answers.episode(_episode(e, instance_id), oracle=oracle) for e, instance_id in rows],
            "total": total, "limit": limit, "offset": offset}


def _episode(e: Episode, instance_id: str) -> dict:
    return {
        "id": e.id, "run_id": e.run_id, "group_id": e.group_id, "task_id": e.task_id, "instance_id": instance_id,
        "sample_index": e.sample_index, "status": e.status, "attempt": e.attempt, "trainable": e.trainable,
        "reward": e.reward, "policy_version_min": e.policy_version_min, "policy_version_max": e.policy_version_max,
        "n_turns": e.n_turns, "input_tokens": e.input_tokens, "output_tokens": e.output_tokens,
        "error_type": e.error_type, "error_message": e.error_message, "started_at": e.started_at,
        "finished_at": e.finished_at, "guards": e.guards,
    }  # fmt: skip


def _array(blob: bytes | None, encoding: str):
    if blob is None:
        return None
    if encoding == "base64":
        return base64.b64encode(blob).decode()
    return decode_array(blob).tolist()


def _turn(t: Turn, arrays: str) -> dict:
    item = {"idx": t.idx, "segment": t.segment, "policy_version": t.policy_version, "finish_reason": t.finish_reason,
            "text": t.text, "tool_call": t.tool_call, "observation": t.observation,
            "n_input_tokens": t.n_input_tokens, "n_output_tokens": t.n_output_tokens,
            "generation_s": t.generation_s, "tool_s": t.tool_s}
    if arrays != "none":
        item |= {k: _array(getattr(t, k), arrays) for k in ("input_ids", "output_ids", "output_logprobs", "routed_experts")}
    return item


async def episode_detail(session, answers: Answers, episode_id: uuid.UUID, *, arrays: str = "none",
                         turns_offset: int = 0, turns_limit: int | None = None) -> dict:
    """An episode with its report, diff and turns, as this caller may see them."""
    row = (await session.execute(sa.select(Episode, Task.instance_id, Run.config)
                                 .join(Task, Task.id == Episode.task_id).join(Run, Run.id == Episode.run_id)
                                 .where(Episode.id == episode_id))).first()
    if row is None:
        raise HTTPException(status_code=404, detail=f"episode {episode_id} not found")
    episode, instance_id, config = row
    query = sa.select(Turn).where(Turn.episode_id == episode_id, Turn.idx >= turns_offset).order_by(Turn.idx)
    turns = (await session.scalars(query.limit(turns_limit) if turns_limit else query)).all()
    out = _episode(episode, instance_id) | {"report": episode.report, "diff": episode.diff,
                                           "segment_starts": episode.segment_starts,
                                           "turns": [_turn(t, arrays) for t in turns]}
    return answers.episode(out, oracle=is_oracle(config))


@router.get("/episodes/{episode_id}", responses={404: {"model": Problem}})
async def show_episode(session: SessionDep, answers: AnswersDep, episode_id: uuid.UUID,
                       arrays: Literal["none", "base64", "json"] = "none",
                       turns_offset: Annotated[int, Query(ge=0, le=2**31 - 1)] = 0,
                       turns_limit: Annotated[int | None, Query(ge=1, le=100_000)] = None) -> dict:
    """The episode with its turns (all, or `turns_limit` from `turns_offset`: long episodes
    load page by page). Without the API token, `redacted` (on the episode, its report and each
    turn) names what was withheld: an oracle episode's turns and diff, the grading log tail."""
    return await episode_detail(session, answers, episode_id, arrays=arrays, turns_offset=turns_offset,
                                turns_limit=turns_limit)


@router.get("/episodes/{episode_id}/tokens", responses={404: {"model": Problem}, 409: {"model": Problem}})
async def episode_tokens(session: SessionDep, answers: AnswersDep, episode_id: uuid.UUID,
                         turn: Annotated[int, Query(ge=0, le=2**31 - 1)]) -> dict:
    """A turn's sampled tokens, each decoded alone with the run's tokenizer, with its logprob
    (for logprob shading in the episode viewer); none of an oracle's without the API token."""
    row = (await session.execute(sa.select(Turn.output_ids, Turn.output_logprobs, Run.config)
                                 .join(Episode, Episode.id == Turn.episode_id).join(Run, Run.id == Episode.run_id)
                                 .where(Turn.episode_id == episode_id, Turn.idx == turn))).first()
    if row is None:
        raise HTTPException(status_code=404, detail=f"episode {episode_id} has no turn {turn}")
    if answers.hides_turns(is_oracle(row.config)):
        return {"turn": turn, "tokens": [], "redacted": ["tokens"]}
    tokenizer_dir = (row.config.get("policy") or {}).get("tokenizer")
    try:
        from service.fleet.client import load_tokenizer

        tok = await asyncio.to_thread(load_tokenizer, str(tokenizer_dir))
    except Exception as e:  # noqa: BLE001 - any loading failure: say which folder
        raise HTTPException(status_code=409, detail=f"the run's tokenizer {tokenizer_dir} cannot be loaded: "
                                                    f"{type(e).__name__}") from e
    ids = decode_array(row.output_ids).tolist()
    logprobs = decode_array(row.output_logprobs).tolist() if row.output_logprobs else [None] * len(ids)
    return {"turn": turn, "tokens": [{"id": i, "text": tok.decode([i], skip_special_tokens=False), "logprob": lp}
                                     for i, lp in zip(ids, logprobs)], "redacted": []}


@router.get("/events", responses={404: {"model": Problem}})
async def events(request: Request, answers: AnswersDep, run: uuid.UUID,
                 poll_s: Annotated[float, Query(ge=0.1, le=30)] = 1.0):
    """Server-sent events for a run: `progress` (the run's counts), `episode` (each episode
    that started or ended since the last event) and `end` when the run is over."""
    import json

    from fastapi.responses import StreamingResponse

    sessions = request.app.state.sessions
    async with sessions() as session:
        oracle = is_oracle((await get_run(session, run)).config)

    def event(kind: str, data: dict) -> str:
        return f"event: {kind}\ndata: {json.dumps(data, default=str)}\n\n"

    async def stream():
        seen: dict[uuid.UUID, tuple] = {}
        while not await request.is_disconnected():
            async with sessions() as session:
                state = await progress(session, await get_run(session, run))
                rows = (await session.execute(sa.select(Episode, Task.instance_id).join(Task, Task.id == Episode.task_id)
                                              .where(Episode.run_id == run))).all()
            for episode, instance_id in rows:
                key = (episode.status, episode.n_turns, episode.reward)
                if seen.get(episode.id) != key:
                    seen[episode.id] = key
                    yield event("episode", answers.episode(_episode(episode, instance_id), oracle=oracle))
            yield event("progress", state)
            if state["status"] not in RUN_ACTIVE_STATUSES:
                yield event("end", {"status": state["status"]})
                return
            await asyncio.sleep(poll_s)

    return StreamingResponse(stream(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


@router.get("/buffer")
async def buffer_stats(request: Request) -> dict:
    from service.store.buffer import Buffer

    return await Buffer(request.app.state.engine).stats()


@router.get("/policies")
async def list_policies(session: SessionDep, limit: Limit = 100, offset: Offset = 0) -> dict:
    """Policy versions the trainer published, newest first, with the metrics of the step that
    made each (loss, reward, mismatch KL, entropy, masked fraction, staleness, tokens/s...)."""
    from service.store.tables import Policy

    total = await session.scalar(sa.select(sa.func.count()).select_from(Policy))
    rows = (await session.scalars(sa.select(Policy).order_by(Policy.version.desc()).limit(limit).offset(offset))).all()
    return {"items": [{"version": p.version, "trainer_step": p.trainer_step, "weights_path": p.weights_path,
                       "created_at": p.created_at, "metrics": p.info or {}} for p in rows],
            "total": total, "limit": limit, "offset": offset}
