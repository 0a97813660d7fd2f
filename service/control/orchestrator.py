"""The orchestrator of a run: keeps `concurrency` episodes in flight, starts the samples of a
task together (a group), holds back new groups that would train too far off-policy, stops a
run whose sandboxes or fleet keep failing, finishes or cancels it. For a training run it also
adds the groups as it needs them, starts the evaluations and decides the end
(service.control.training).

One owner per run: an orchestrator holds a lease on the run row (`owner`,
`owner_heartbeat_at`) that every tick renews under the row's lock; another process takes the
run over only once the lease has lapsed. All other state is in the database, so a new owner
picks up where the last one stopped. `Supervisor` runs in every API process (and in the
embedded `swerve run`): it starts orchestrators for active runs that nobody owns.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import uuid
from collections.abc import Callable
from datetime import timedelta

import sqlalchemy as sa
from pydantic import ValidationError
from sqlalchemy.exc import InterfaceError, OperationalError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from service.control import training
from service.store.buffer import Buffer
from service.fleet.client import FleetConfig, NotVLLM, ProviderError, VLLMClient
from service.worker.config import RunConfig
from service.store.tables import Episode, Group, Policy, Run, utcnow
from service.store.status import EPISODE_FINAL, FAILURES, IN_FLIGHT, RUN_ACTIVE

logger = logging.getLogger(__name__)


TRANSIENT = (OperationalError, InterfaceError, OSError, asyncio.TimeoutError)
"""Errors of the database or the network that the next tick may not meet: retried forever.
Anything else an orchestrator meets on a run (a bug, a config no check caught) fails the run
after `MAX_ERRORS` ticks in a row: an error repeated every tick must not keep a run active."""
MAX_ERRORS = 3


class RunFailed(Exception):
    """The run cannot go on (the message says why): it ends as failed, or as cancelled when
    it was being cancelled."""


def new_owner() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


class FleetVersion:
    """The policy version a new episode of a vLLM run would be sampled with (oldest served)."""

    def __init__(self, cfg: RunConfig):
        self.fleet_cfg = (FleetConfig(endpoints=cfg.sampler.endpoints, model=cfg.sampler.model, max_retries=0)
                          if cfg.sampler.type == "vllm" else None)  # fmt: skip
        self.client: VLLMClient | None = None

    async def get(self) -> int | None:
        if self.fleet_cfg is None:
            return None
        try:
            if self.client is None:
                self.client = await VLLMClient(self.fleet_cfg).start()
            version = await self.client.refresh_versions()
            return None if version < 0 else version
        except NotVLLM as e:  # answers, but wrongly: no episode can ever sample
            raise RunFailed(f"sampler.endpoints: {e}") from e
        except ProviderError:
            return None  # unreachable: its episodes fail and the failure stop decides

    async def close(self) -> None:
        if self.client is not None:
            await self.client.close()


async def orchestrate(engine: AsyncEngine, run_id: uuid.UUID, submit: Callable[[str], None], *,
                      owner: str | None = None, poll_s: float = 0.5, lease_s: float = 15.0) -> str | None:  # fmt: skip
    """Drive a run to finished, cancelled or failed and return that status; None when another
    live orchestrator owns the run (or takes it over from this one)."""
    owner = owner or new_owner()
    async with engine.connect() as conn:
        row = (await conn.execute(sa.select(Run.config, Run.kind).where(Run.id == run_id))).one()
    try:
        cfg = RunConfig.model_validate(row.config)
    except ValidationError as e:
        return await abort_run(engine, run_id, owner, lease_s, f"the run's stored config is no longer valid: {e}")
    fleet = FleetVersion(cfg)
    tasks = training.Tasks() if row.kind == "train" else None
    first, errors = True, 0
    try:
        while True:
            try:
                version = await fleet.get()
                status = await _tick(engine, run_id, cfg, submit, owner, lease_s, version, takeover=first,
                                     tasks=tasks, kind=row.kind)
                errors = 0
            except RunFailed as e:
                return await abort_run(engine, run_id, owner, lease_s, str(e))
            except TRANSIENT:
                raise  # the supervisor's next scan starts it again
            except Exception as e:
                errors += 1
                logger.exception("run %s: orchestrator tick failed (%d in a row)", run_id, errors)
                if errors >= MAX_ERRORS:
                    return await abort_run(engine, run_id, owner, lease_s,
                                           f"the orchestrator failed {errors} times in a row: {type(e).__name__}: {e}")
                status = None
            first = False
            if status == "not owner":
                return None
            if status is not None:
                logger.info("run %s %s", run_id, status)
                return status
            await asyncio.sleep(poll_s)
    finally:
        await fleet.close()


async def abort_run(engine: AsyncEngine, run_id: uuid.UUID, owner: str, lease_s: float, error: str) -> str | None:
    """End a run that cannot go on, with `error` on it: failed (cancelled if it was being
    cancelled); its episodes that never started are cancelled, running ones see the run end
    and stop. Reads nothing of the run's config, so a config it cannot read still ends."""
    async with engine.begin() as conn:
        if not await Buffer.own_run(conn, run_id, owner, lease_s):
            return None
        status = await conn.scalar(sa.select(Run.status).where(Run.id == run_id))
        final = "cancelled" if status == "cancelling" else "failed"
        pending = (await conn.execute(sa.select(Episode.id).where(
            Episode.run_id == run_id, Episode.status.in_(("pending", "queued"))))).scalars().all()
    buffer = Buffer(engine)
    for episode_id in pending:
        await buffer.finish_episode(episode_id, status="cancelled")
    async with engine.begin() as conn:
        await Buffer.finish_run(conn, run_id, final, error=error[:4000])
        for child in (await conn.execute(sa.select(Run.id).where(Run.parent_id == run_id))).scalars():
            await Buffer.request_cancel(conn, child)
    logger.error("run %s %s: %s", run_id, final, error)
    return final


async def _tick(engine: AsyncEngine, run_id: uuid.UUID, cfg: RunConfig, submit: Callable[[str], None],
                owner: str, lease_s: float, fleet_version: int | None, takeover: bool = False,
                tasks: training.Tasks | None = None, kind: str = "sample") -> str | None:  # fmt: skip
    async with engine.begin() as conn:
        owned = await Buffer.own_run(conn, run_id, owner, lease_s)
        run_status = await conn.scalar(sa.select(Run.status).where(Run.id == run_id))
        if not owned:
            return run_status if run_status not in RUN_ACTIVE else "not owner"
        counts = dict((await conn.execute(sa.select(Episode.status, sa.func.count())
                                          .where(Episode.run_id == run_id).group_by(Episode.status))).all())
        resend = await _lost(conn, run_id, cfg, all_queued=takeover)
        in_flight = sum(counts.get(s, 0) for s in IN_FLIGHT)
        version = await training.newest_version(conn) if kind == "train" else None
        if kind == "train" and run_status == "running":
            await training.cancel_stale_evaluations(conn, run_id, version)
            await training.start_evaluation(conn, run_id, cfg, version, fleet_version)
        failing = None if run_status == "cancelling" else await _failing(conn, run_id, cfg.max_consecutive_failures)
        if run_status == "cancelling" or failing is not None:
            final = "cancelled" if run_status == "cancelling" else "failed"
            pending = (await conn.execute(sa.select(Episode.id).where(
                Episode.run_id == run_id, Episode.status.in_(("pending", "queued"))))).scalars().all()
        elif kind == "train" and await training.done(conn, run_id, cfg, version, counts):
            final, pending = "finished", await training.stop_sampling(conn, run_id)
        elif kind != "train" and sum(counts.values()) == sum(counts.get(s, 0) for s in EPISODE_FINAL):
            await Buffer.finish_run(conn, run_id, "finished")
            return "finished"
        else:
            gate, new_groups = await _gate(conn, run_id, cfg, fleet_version, kind)
            room = max(0, cfg.concurrency - in_flight)
            if kind == "train":
                task_ids = await (tasks or training.Tasks()).get(conn, cfg)
                await training.add_groups(conn, run_id, cfg, task_ids, room, new_groups, fleet_version)
            starts = await _starts(conn, run_id, room, new_groups)
            if starts:
                await Buffer.queue(conn, starts)
            await Buffer.set_gate(conn, run_id, gate)
            pending, final = [], None
    if final is None:
        for episode_id in starts + resend:
            submit(str(episode_id))
        return None
    buffer = Buffer(engine)
    for episode_id in pending:  # never started: final now; running ones see the run and stop
        await buffer.finish_episode(episode_id, status="cancelled")
    if final == "cancelled" and counts.get("running", 0):
        return None  # wait for running episodes to end
    async with engine.begin() as conn:
        await Buffer.finish_run(conn, run_id, final, error=failing)
        if kind == "train":
            await Buffer.drop_unclaimed(conn, run_id, final)
        for child in (await conn.execute(sa.select(Run.id).where(Run.parent_id == run_id))).scalars():
            await Buffer.request_cancel(conn, child)  # a training run's evaluations end with it
    return final


async def _starts(conn: AsyncConnection, run_id: uuid.UUID, room: int, new_groups: int | None) -> list[uuid.UUID]:
    """Up to `room` pending episodes to start: the rest of groups already started first (a
    group is sampled together), then those of at most `new_groups` new groups (None: any)."""
    if room <= 0:
        return []
    started = sa.select(Episode.group_id).where(Episode.run_id == run_id, Episode.status != "pending")
    pending = sa.select(Episode.id).where(Episode.run_id == run_id, Episode.status == "pending")
    starts = list((await conn.execute(pending.where(Episode.group_id.in_(started))
                                      .order_by(Episode.group_id, Episode.sample_index).limit(room))).scalars())
    room -= len(starts)
    if room > 0 and new_groups != 0:
        fresh = sa.select(Group.id).where(Group.run_id == run_id, Group.status == "pending",
                                          Group.id.not_in(started)).order_by(Group.id).limit(new_groups or room)
        starts += (await conn.execute(pending.where(Episode.group_id.in_(fresh.scalar_subquery()))
                                      .order_by(Episode.group_id, Episode.sample_index).limit(room))).scalars()
    return starts


async def _gate(conn: AsyncConnection, run_id: uuid.UUID, cfg: RunConfig,
                fleet_version: int | None, kind: str = "sample") -> tuple[str | None, int | None]:  # fmt: skip
    """How many new groups may start now (None: no limit), and why not when none may.
    Trainer version: the newest published policy. New groups are held back while the fleet
    serves a version more than max_off_policy_steps behind it, and, with `groups_per_step`
    set, beyond (max_off_policy_steps + 1) x groups_per_step of the run's groups started and
    not yet trained on (a group started later would be consumed too many steps from now)."""
    if cfg.sampler.type != "vllm" or kind == "eval":
        return None, None  # scripted samplers sample nothing to be off-policy from; evaluations train nothing
    trainer = await conn.scalar(sa.select(sa.func.max(Policy.version))) or 0
    if fleet_version is not None and trainer - fleet_version > cfg.max_off_policy_steps:
        return (f"fleet serves policy version {fleet_version}, trainer is at {trainer} "
                f"(max_off_policy_steps={cfg.max_off_policy_steps}): waiting for the fleet to reload"), 0
    if cfg.groups_per_step is None:
        return None, None
    started = sa.select(Episode.group_id).where(Episode.run_id == run_id, Episode.status != "pending")
    waiting = await conn.scalar(sa.select(sa.func.count()).select_from(Group).where(
        Group.run_id == run_id, sa.or_(Group.status.in_(("ready", "claimed")),
                                       sa.and_(Group.status == "pending", Group.id.in_(started)))))
    limit = (cfg.max_off_policy_steps + 1) * cfg.groups_per_step
    if waiting >= limit:
        return (f"{waiting} groups started and not yet trained on, the most that "
                f"(max_off_policy_steps + 1) x groups_per_step = {limit} allows: waiting for the trainer"), 0
    return None, limit - waiting


async def _lost(conn: AsyncConnection, run_id: uuid.UUID, cfg: RunConfig, all_queued: bool) -> list[uuid.UUID]:
    """Episodes to send again: running ones whose worker died (stale heartbeat) go back to
    queued as a new attempt, with the dead attempt's turns removed; queued ones whose message
    may be lost (too old, or, on taking a run over, all of them) are sent again. Duplicate
    messages are harmless: a worker starts an episode only from queued, under its attempt."""
    now = utcnow()
    dead = (await conn.execute(sa.select(Episode.id).where(
        Episode.run_id == run_id, Episode.status == "running",
        Episode.heartbeat_at < now - timedelta(seconds=cfg.worker_timeout_s)))).scalars().all()
    if dead:
        logger.warning("run %s: %d episode(s) lost their worker; starting them again", run_id, len(dead))
        await Buffer.restart_attempts(conn, dead)
    queued = sa.select(Episode.id).where(Episode.run_id == run_id, Episode.status == "queued",
                                         Episode.id.not_in(dead) if dead else sa.true())
    if not all_queued:
        queued = queued.where(Episode.queued_at < now - timedelta(seconds=cfg.queue_timeout_s))
    again = (await conn.execute(queued)).scalars().all()
    if again:
        await Buffer.requeue(conn, again)
    return list(dead) + list(again)


async def _failing(conn: AsyncConnection, run_id: uuid.UUID, limit: int) -> str | None:
    """Why the run stops when its last `limit` episodes all failed (None: they did not)."""
    recent = (await conn.execute(sa.select(Episode.status, Episode.error_type, Episode.error_message).where(
        Episode.run_id == run_id, Episode.finished_at.is_not(None))
        .order_by(Episode.finished_at.desc()).limit(limit))).all()
    if len(recent) < limit or not all(r.status in FAILURES for r in recent):
        return None
    last = recent[0]
    return (f"the last {limit} episodes failed (max_consecutive_failures); the latest: {last.status}: "
            f"{last.error_type or ''}: {last.error_message or '(no message)'}")[:4000]


def _log_failure(job: asyncio.Task) -> None:
    if not job.cancelled() and job.exception() is not None:
        logger.error("orchestrator stopped on an error (the next scan restarts it): %r", job.exception())


class Supervisor:
    """Starts an orchestrator for every active run without a live owner, in this process."""

    def __init__(self, engine: AsyncEngine, submit: Callable[[str], None], *, owner: str | None = None,
                 poll_s: float = 0.5, lease_s: float = 15.0, scan_s: float = 2.0):  # fmt: skip
        self.engine, self.submit = engine, submit
        self.owner = owner or new_owner()
        self.poll_s, self.lease_s, self.scan_s = poll_s, lease_s, scan_s
        self.jobs: dict[uuid.UUID, asyncio.Task] = {}
        self._scanner: asyncio.Task | None = None

    def start(self, run_id: uuid.UUID) -> None:
        job = self.jobs.get(run_id)
        if job is None or job.done():
            self.jobs[run_id] = asyncio.get_running_loop().create_task(orchestrate(
                self.engine, run_id, self.submit, owner=self.owner, poll_s=self.poll_s, lease_s=self.lease_s))
            self.jobs[run_id].add_done_callback(_log_failure)

    async def scan(self) -> None:
        now = utcnow()
        async with self.engine.connect() as conn:
            orphans = (await conn.execute(sa.select(Run.id).where(
                Run.status.in_(RUN_ACTIVE),
                sa.or_(Run.owner.is_(None), Run.owner == self.owner,
                       Run.owner_heartbeat_at < now - timedelta(seconds=self.lease_s))))).scalars().all()
        for run_id in orphans:
            self.start(run_id)

    async def _scan_forever(self) -> None:
        while True:
            try:
                await self.scan()
            except Exception:  # a database blip: the next scan retries
                logger.exception("orchestrator scan failed")
            await asyncio.sleep(self.scan_s)

    def run_in_background(self) -> None:
        self._scanner = asyncio.get_running_loop().create_task(self._scan_forever())

    async def close(self) -> None:
        """Stop this process's orchestrators and give up their runs, so another process takes
        them over at once instead of after the lease."""
        jobs = [j for j in (self._scanner, *self.jobs.values()) if j is not None]
        for job in jobs:
            job.cancel()
        await asyncio.gather(*jobs, return_exceptions=True)
        try:
            await Buffer(self.engine).release_runs(self.owner)
        except Exception:
            logger.exception("could not release runs owned by %s", self.owner)
