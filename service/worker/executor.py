"""One episode, start to final status: the single capture point for episode failures.

Idempotent on the episode id: a redelivered task finds the episode final and does nothing,
or finds it running from a lost worker and restarts it cleanly (its turns cleared, attempt+1).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time
import uuid
import weakref
from datetime import datetime, timedelta, timezone
from functools import lru_cache

from sqlalchemy.exc import InterfaceError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout
from sqlalchemy.ext.asyncio import AsyncEngine

from envs.grading import RewardError
from envs.swe_env import EXAMPLE_BUNDLES, SWEEnv, SWEEnvConfig, grade, task_sandbox
from sandboxes.base import SandboxError
from service.worker.agent import EpisodeResult, TokenRenderer, failure_status, run_episode
from service.store.buffer import Buffer, StorageError, Superseded, TurnsLost
from service.config import Settings
from service.fleet.client import FleetConfig, ProviderError, VLLMClient, load_tokenizer
from service.worker.scripted import demonstration, oracle, replay
from service.worker.config import RunConfig
from service.store.tasks import task_from_row
from service.store.tables import utcnow
from service.store.status import EPISODE_FINAL, GRADED, RUN_ACTIVE

logger = logging.getLogger(__name__)


class DbTurnSink:
    def __init__(self, buffer: Buffer, episode_id: uuid.UUID, attempt: int | None = None):
        self.buffer, self.episode_id, self.attempt = buffer, episode_id, attempt

    async def append(self, turn) -> None:
        await db_retry(lambda: self.buffer.append_turn(self.episode_id, turn, attempt=self.attempt),
                       f"turn {turn.idx} of episode {self.episode_id}")


_SCHEMA_ERRORS = ("no such table", "no such column", "has no column named")
"""SQLite files these as OperationalError, as it does a locked database; no wait mends them (a
database without swerve's tables: another service's, or not migrated), PostgreSQL raises them as
ProgrammingError."""


def _transient(e: Exception) -> bool:
    return not any(text in str(getattr(e, "orig", e)) for text in _SCHEMA_ERRORS)


async def db_retry(make, what: str, budget_s: float = 300.0):
    """Await make() again while the database is unreachable (a restart, a failover) or locked,
    up to budget_s; an episode outlives a database blip instead of being thrown away. A missing
    table or column is raised at once."""
    delay, deadline = 0.25, time.monotonic() + budget_s
    while True:
        try:
            return await make()
        except (OperationalError, InterfaceError, PoolTimeout) as e:
            if time.monotonic() > deadline or not _transient(e):
                raise
            logger.warning("database unavailable writing %s (%s); retrying in %.1f s", what,
                           str(e).splitlines()[0][:200], delay)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 5.0)


async def _start(engine: AsyncEngine, episode_id: uuid.UUID):
    """Claim the episode for this worker as a new attempt; None if there is nothing to do
    (final, or running under a live worker: a duplicate message). Two round trips: the
    episode read with its run and task, then the claim, made only if the episode is still as
    read (Buffer.start_attempt)."""
    buffer = Buffer(engine)
    found = await buffer.episode_to_start(episode_id)
    if found is None or found[0].status in EPISODE_FINAL:
        return None
    row, task = found
    if row.status == "running":  # a lost worker's attempt (stale heartbeat) starts over; a live one is left alone
        timeout = RunConfig.model_validate(row.config).worker_timeout_s
        if row.heartbeat_at is not None and _aware(row.heartbeat_at) > utcnow() - timedelta(seconds=timeout):
            return None
    attempt = await buffer.claim_attempt(episode_id, seen_status=row.status, seen_attempt=row.attempt)
    if attempt is None:
        return None  # another worker got it first
    return row, task, attempt


def _aware(ts: datetime) -> datetime:
    return ts if ts.tzinfo is not None else ts.replace(tzinfo=timezone.utc)


async def execute_episode(engine: AsyncEngine, settings: Settings, episode_id: uuid.UUID) -> str | None:
    """Run the episode to its final status (None: nothing to do, or a newer attempt owns it)."""
    for _ in range(3):
        try:
            return await _execute(engine, settings, episode_id)
        except TurnsLost as e:  # the database lost committed turns in a crash: start over
            logger.warning("%s; starting the episode over", e)
            async with engine.begin() as conn:
                await Buffer.restart_attempts(conn, [episode_id])
    raise RuntimeError(f"episode {episode_id}: turns kept getting lost; the orchestrator will send it again")


async def _execute(engine: AsyncEngine, settings: Settings, episode_id: uuid.UUID) -> str | None:
    started = await db_retry(lambda: _start(engine, episode_id), f"start of episode {episode_id}")
    if started is None:
        return None
    row, task_row, attempt = started
    buffer = Buffer(engine)
    cfg = RunConfig.model_validate(row.config)
    if row.run_status not in RUN_ACTIVE or row.run_status == "cancelling":
        await db_retry(lambda: buffer.finish_episode(episode_id, status="cancelled", attempt=attempt),
                       f"end of episode {episode_id}")
        return "cancelled"
    env_cfg = SWEEnvConfig(backend=cfg.backend, limits=cfg.limits, integrity=cfg.integrity,
                           image_cache_dir=settings.data_dir / "images",
                           bundle_dirs=(settings.data_dir / "bundles", EXAMPLE_BUNDLES),
                           source_roots=settings.source_root_list)
    result, fields = EpisodeResult(status="sandbox_error"), {}
    try:
        task = task_from_row(task_row)  # a stored row that no longer validates ends the episode too
        result = await _supervised(engine, row.run_id, episode_id, attempt,
                                   _run(cfg, task, env_cfg, buffer, episode_id, attempt))
        if result.status in GRADED and result.diff is not None:
            report = await grade(task, result.diff, env_cfg)
            fields = {"reward": report.reward(cfg.partial_credit), "report": report.to_json(), "graded_at": utcnow()}
            if report.guards:  # left NULL otherwise: runs count the episodes that have some
                fields["guards"] = sorted({g["guard"] for g in report.guards})
    except RewardError as e:
        result.status = e.kind
        fields = {"report": {"error": str(e), "log_tail": e.log[-4000:]}}
        result.error_type, result.error_message = "RewardError", str(e)
    except Superseded:
        result.status = "superseded"
    except (SandboxError, ProviderError) as e:
        result.status, result.error_type, result.error_message = failure_status(e), type(e).__name__, str(e)
    except (TurnsLost, OperationalError, InterfaceError, PoolTimeout):
        raise  # the database: the episode starts over (TurnsLost) or its heartbeat lapses and it restarts
    except Exception as e:  # anything else ends the episode as data, never as a redelivery loop
        logger.exception("episode %s failed in the worker", episode_id)
        result.status, result.error_type, result.error_message = "worker_error", type(e).__name__, str(e) or repr(e)
    if result.status == "superseded":
        logger.warning("episode %s attempt %d was superseded by a newer attempt; stopped it", episode_id, attempt)
        return None
    counts = {"n_turns": result.n_turns, "input_tokens": result.input_tokens, "output_tokens": result.output_tokens,
              "policy_version_min": result.policy_version_min, "policy_version_max": result.policy_version_max}
    if result.status in ("worker_error", "cancelled"):
        # the loop never returned its count (it failed, or its run was cancelled under it): the
        # turns it stored stay as they are. A count of 0 here read as turns lost and started a
        # cancelled episode over as a new attempt (the RL job's end, 2026-12-06)
        del counts["n_turns"]
    try:
        await db_retry(lambda: buffer.finish_episode(
            episode_id, attempt=attempt, status=result.status, segment_starts=result.segment_starts, diff=result.diff,
            error_type=result.error_type, error_message=result.error_message, **counts, **fields),
            f"end of episode {episode_id}")
    except StorageError as e:  # the database refuses what the episode produced: keep the reason, not a retry loop
        result.status = failure_status(e)
        await db_retry(lambda: buffer.finish_episode(
            episode_id, attempt=attempt, status=result.status, error_type=type(e).__name__, error_message=str(e),
            **counts), f"end of episode {episode_id}")
    logger.info("episode finished", extra={"episode_id": str(episode_id), "task_id": task_row.instance_id,
                                           "status": result.status, "reward": fields.get("reward")})
    return result.status


async def _supervised(engine: AsyncEngine, run_id: uuid.UUID, episode_id: uuid.UUID, attempt: int, work,
                      poll_s: float = 1.0) -> EpisodeResult:  # fmt: skip
    """Run `work` under the loop's shared heartbeat; stop it (closing its sandbox) within
    about poll_s of its run being cancelled or of a newer attempt taking over."""
    beat = Heartbeat.of(engine, poll_s)
    stop = beat.watch(episode_id, attempt, run_id)
    job = asyncio.ensure_future(work)
    try:
        await asyncio.wait([job, stop], return_when=asyncio.FIRST_COMPLETED)
        if job.done():
            return job.result()
        job.cancel()
        try:
            await job
        except asyncio.CancelledError:
            pass
        return EpisodeResult(status=stop.result())
    finally:
        beat.unwatch(episode_id, attempt)
        if not job.done():  # we were cancelled ourselves: the sandbox must still close
            job.cancel()


class Heartbeat:
    """One heartbeat for all the episodes an event loop runs: every poll_s, one UPDATE marks
    them alive and one SELECT reads their runs' statuses (Buffer.beat: one round trip on
    PostgreSQL), however many episodes there are. An
    episode whose run is being cancelled, or whose attempt is no longer the running one, is
    told through its stop future ("cancelled" / "superseded").

    Watched by (episode, attempt): a worker whose own attempt was presumed dead (a heartbeat
    that lapsed under load) may run the next attempt of the same episode beside it, and the
    old attempt must still be told it was superseded, not lose its entry to the new one."""

    _by_loop: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def __init__(self, engine: AsyncEngine, poll_s: float):
        self.engine, self.poll_s = engine, poll_s
        self.episodes: dict[tuple[uuid.UUID, int], tuple[uuid.UUID, asyncio.Future]] = {}
        self.task: asyncio.Task | None = None

    @classmethod
    def of(cls, engine: AsyncEngine, poll_s: float) -> Heartbeat:
        per_loop = cls._by_loop.setdefault(asyncio.get_running_loop(), {})
        if id(engine) not in per_loop:
            per_loop[id(engine)] = cls(engine, poll_s)
        return per_loop[id(engine)]

    def watch(self, episode_id: uuid.UUID, attempt: int, run_id: uuid.UUID) -> asyncio.Future:
        stop = asyncio.get_running_loop().create_future()
        self.episodes[(episode_id, attempt)] = (run_id, stop)
        if self.task is None or self.task.done():
            self.task = asyncio.get_running_loop().create_task(self._beat())
        return stop

    def unwatch(self, episode_id: uuid.UUID, attempt: int) -> None:
        self.episodes.pop((episode_id, attempt), None)

    async def _beat(self) -> None:
        while self.episodes:
            await asyncio.sleep(self.poll_s)
            watched = dict(self.episodes)
            if not watched:
                break
            try:
                alive, runs = await Buffer(self.engine).beat(list({episode_id for episode_id, _ in watched}),
                                                             list({run_id for run_id, _ in watched.values()}))
            except (OperationalError, InterfaceError, PoolTimeout) as e:  # keep working; turns wait for it
                logger.warning("heartbeat of %d episode(s) failed: %s", len(watched), str(e).splitlines()[0][:200])
                continue
            for (episode_id, attempt), (run_id, stop) in watched.items():
                status = runs.get(run_id)
                why = "superseded" if alive.get(episode_id) != attempt else (
                    "cancelled" if status not in RUN_ACTIVE or status == "cancelling" else None)
                if why is not None and not stop.done():
                    stop.set_result(why)


class ConfigError(Exception):
    """The run's config names something the worker cannot use (episode status worker_error)."""


async def _run(cfg: RunConfig, task, env_cfg: SWEEnvConfig, buffer: Buffer, episode_id: uuid.UUID,
               attempt: int) -> EpisodeResult:  # fmt: skip
    try:
        tokenizer = load_tokenizer(str(cfg.sampler.tokenizer))
    except Exception as e:
        raise ConfigError(f"sampler.tokenizer: {cfg.sampler.tokenizer} cannot be loaded: "
                          f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else repr(e)}") from e
    renderer = _renderer(tokenizer)
    sink = DbTurnSink(buffer, episode_id, attempt)
    async with task_sandbox(task, env_cfg, episode=str(episode_id)) as sandbox:
        env = SWEEnv(task, sandbox, env_cfg)
        if cfg.sampler.type == "oracle":
            return await run_episode(oracle(tokenizer, task), env, renderer, cfg.agent, sink)
        if cfg.sampler.type == "demo":
            return await run_episode(demonstration(tokenizer, task), env, renderer, cfg.agent, sink)
        if cfg.sampler.type == "replay":
            sampler = replay(tokenizer, cfg.sampler.calls, cfg.sampler.latency_s)
            return await run_episode(sampler, env, renderer, cfg.agent, sink)
        fleet = await shared_fleet(FleetConfig(endpoints=cfg.sampler.endpoints, model=cfg.sampler.model))
        try:
            return await run_episode(fleet, env, renderer, cfg.agent, sink, session=str(episode_id))
        finally:
            fleet.end_session(str(episode_id))


YOUNG_COLLECTION_EVERY = 50_000
"""Allocations between two collections of the cyclic collector's youngest generation in a worker
(CPython's default: 700); see freeze_heap."""


def freeze_heap() -> None:
    """Take every object alive now out of the cyclic collector's passes (`gc.freeze`), once the
    process holds what it keeps for its life: modules (torch, transformers and SQLAlchemy come with
    the tokenizer: about 340k tracked objects), tokenizers, templates. A full collection walks
    every tracked object, about 0.1 s each here, and they come while the heap grows: a worker's
    first minutes under bench/rollouts.py spent 1.2 s of 10 s in the collector (0.65 s after), its
    first 80 episodes 3.6-3.9 ms of CPU a turn against 4.3-5.1 before; its steady state did not
    change (2026-12-05). Frozen objects are still freed by reference counting when the last
    reference goes; only a reference cycle among them is never collected, so this runs at a few
    fixed points of a process's life, not on a timer.

    The youngest generation is collected every YOUNG_COLLECTION_EVERY allocations instead of
    CPython's 700, and the older ones as many times less often: what the episodes hold (their
    token lists, messages, connections) is not frozen, and a full collection walks every element
    of every list, about 0.1 s each with 128 episodes in flight. At CPython's thresholds the
    collector took 0.75 s of a bench/rollouts.py row's 6.7 s of worker CPU (515 young, 45 middle
    and 5 full collections), at these 0.36 s (6 young, 2 full; 2026-12-07). Garbage in reference
    cycles waits longer for its collection: at a worker's allocation rate, a fraction of a second."""
    gc.collect()
    gc.freeze()
    young, *older = gc.get_threshold()
    gc.set_threshold(max(young, YOUNG_COLLECTION_EVERY), *older)


@lru_cache(maxsize=8)  # as many as load_tokenizer keeps
def _renderer(tokenizer) -> TokenRenderer:
    """One renderer per tokenizer: building one renders the template several times, and what it
    learns (its frames) holds for every episode. The first episode of a tokenizer loads it and
    the libraries behind it: the heap is frozen after it."""
    renderer = TokenRenderer(tokenizer, SWEEnv.tools)
    freeze_heap()
    return renderer


_fleets: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


async def shared_fleet(cfg: FleetConfig) -> VLLMClient:
    """One fleet client per event loop and fleet: the episodes of a worker share its
    connections, health checks and placement (least-loaded with session affinity)."""
    per_loop = _fleets.setdefault(asyncio.get_running_loop(), {})
    key = cfg.model_dump_json()
    lock = per_loop.setdefault(("lock", key), asyncio.Lock())
    async with lock:
        if key not in per_loop:
            per_loop[key] = await VLLMClient(cfg).start()
        return per_loop[key]


async def close_fleets() -> None:
    for key, client in list(_fleets.pop(asyncio.get_running_loop(), {}).items()):
        if isinstance(client, VLLMClient):
            await client.close()
