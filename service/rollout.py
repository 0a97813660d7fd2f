"""One episode, start to final status: the single capture point for episode failures.

Idempotent on the episode id: a redelivered task finds the episode final and does nothing,
or finds it running from a lost worker and restarts it cleanly (its turns cleared, attempt+1).
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from functools import lru_cache

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine

from envs.grading import RewardError
from envs.swe_env import EXAMPLE_BUNDLES, SWEEnv, SWEEnvConfig, grade, task_sandbox
from sandboxes.base import SandboxError
from service.agent import EpisodeResult, TokenRenderer, run_episode
from service.buffer import Buffer
from service.config import Settings
from service.inference import FleetConfig, ProviderError, VLLMClient
from service.policies import oracle, replay
from service.runs import RunConfig
from service.suites import task_from_row
from service.tables import EPISODE_FINAL_STATUSES, RUN_ACTIVE_STATUSES, Episode, Run, Task, Turn, utcnow

logger = logging.getLogger(__name__)
GRADED = ("submitted", "max_turns", "context_exhausted", "timeout")


class DbTurnSink:
    def __init__(self, buffer: Buffer, episode_id: uuid.UUID):
        self.buffer, self.episode_id = buffer, episode_id

    async def append(self, turn) -> None:
        await self.buffer.append_turn(self.episode_id, turn)


@lru_cache(maxsize=8)
def _tokenizer(path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


async def _start(engine: AsyncEngine, episode_id: uuid.UUID):
    """Claim the episode for this worker; None if there is nothing to do."""
    async with engine.begin() as conn:
        row = (await conn.execute(sa.select(Episode.status, Episode.attempt, Episode.task_id, Episode.run_id,
                                            Run.status.label("run_status"), Run.config)
                                  .join(Run, Run.id == Episode.run_id).where(Episode.id == episode_id))).first()
        if row is None or row.status in EPISODE_FINAL_STATUSES:
            return None
        if row.status == "running":  # a lost worker's attempt: start over cleanly
            await conn.execute(sa.delete(Turn).where(Turn.episode_id == episode_id))
        await conn.execute(sa.update(Episode).where(Episode.id == episode_id).values(
            status="running", started_at=utcnow(), heartbeat_at=utcnow(),
            attempt=row.attempt + (row.status == "running")))
        task = (await conn.execute(sa.select(Task).where(Task.id == row.task_id))).one()
    return row, task


async def execute_episode(engine: AsyncEngine, settings: Settings, episode_id: uuid.UUID) -> str | None:
    started = await _start(engine, episode_id)
    if started is None:
        return None
    row, task_row = started
    buffer = Buffer(engine)
    cfg = RunConfig.model_validate(row.config)
    if row.run_status not in RUN_ACTIVE_STATUSES or row.run_status == "cancelling":
        await buffer.finish_episode(episode_id, status="cancelled")
        return "cancelled"
    task = task_from_row(task_row)
    env_cfg = SWEEnvConfig(backend=cfg.backend, limits=cfg.limits, env_cache_dir=settings.data_dir / "envs",
                           bundle_dirs=(settings.data_dir / "bundles", EXAMPLE_BUNDLES))
    result, fields = EpisodeResult(status="sandbox_error"), {}
    try:
        result = await _supervised(engine, row.run_id, episode_id, _run(cfg, task, env_cfg, buffer, episode_id))
        if result.status in GRADED and result.diff is not None:
            report = await grade(task, result.diff, env_cfg)
            fields = {"reward": report.reward(cfg.partial_credit), "report": report.to_json(), "graded_at": utcnow()}
    except RewardError as e:
        result.status = "timeout" if e.kind == "timeout" else "reward_error"
        fields = {"report": {"error": str(e), "log_tail": e.log[-4000:]}}
        result.error_type, result.error_message = "RewardError", str(e)
    except (SandboxError, ProviderError) as e:
        result.status = "sandbox_error" if isinstance(e, SandboxError) else "provider_error"
        result.error_type, result.error_message = type(e).__name__, str(e)
    await buffer.finish_episode(
        episode_id, status=result.status, n_turns=result.n_turns, input_tokens=result.input_tokens,
        output_tokens=result.output_tokens, segment_starts=result.segment_starts, diff=result.diff,
        policy_version_min=result.policy_version_min, policy_version_max=result.policy_version_max,
        error_type=result.error_type, error_message=result.error_message, **fields)
    logger.info("episode finished", extra={"rollout_id": str(episode_id), "task_id": task.instance_id,
                                           "status": result.status, "reward": fields.get("reward")})
    return result.status


async def _supervised(engine: AsyncEngine, run_id: uuid.UUID, episode_id: uuid.UUID, work,
                      poll_s: float = 1.0) -> EpisodeResult:  # fmt: skip
    """Run `work` with a heartbeat on the episode row every poll_s, and stop it (closing its
    sandbox) within poll_s of its run being cancelled."""
    job = asyncio.ensure_future(work)
    while not job.done():
        await asyncio.wait([job], timeout=poll_s)
        if job.done():
            break
        async with engine.begin() as conn:
            await conn.execute(sa.update(Episode).where(Episode.id == episode_id).values(heartbeat_at=utcnow()))
            status = await conn.scalar(sa.select(Run.status).where(Run.id == run_id))
        if status not in RUN_ACTIVE_STATUSES or status == "cancelling":
            job.cancel()
            try:
                await job
            except asyncio.CancelledError:
                pass
            return EpisodeResult(status="cancelled")
    return job.result()


async def _run(cfg: RunConfig, task, env_cfg: SWEEnvConfig, buffer: Buffer, episode_id: uuid.UUID) -> EpisodeResult:
    tokenizer = _tokenizer(str(cfg.policy.tokenizer))
    renderer = TokenRenderer(tokenizer, SWEEnv.tools)
    sink = DbTurnSink(buffer, episode_id)
    async with task_sandbox(task, env_cfg, episode=str(episode_id)) as sandbox:
        env = SWEEnv(task, sandbox, env_cfg)
        if cfg.policy.type == "oracle":
            return await run_episode(oracle(tokenizer, task), env, renderer, cfg.agent, sink)
        if cfg.policy.type == "replay":
            policy = replay(tokenizer, cfg.policy.calls, cfg.policy.latency_s)
            return await run_episode(policy, env, renderer, cfg.agent, sink)
        fleet = await VLLMClient(FleetConfig(endpoints=cfg.policy.endpoints, model=cfg.policy.model)).start()
        try:
            return await run_episode(fleet, env, renderer, cfg.agent, sink, session=str(episode_id))
        finally:
            await fleet.close()
