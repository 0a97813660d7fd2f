"""Run configs and run creation: one group per task, `samples_per_task` episodes per group,
all written before anything is scheduled (the orchestrator only reads the database)."""

from __future__ import annotations

import hashlib
import json
import uuid
from pathlib import Path
from typing import Annotated, Literal

import sqlalchemy as sa
from pydantic import BaseModel, ConfigDict, Field, model_validator
from sqlalchemy.ext.asyncio import AsyncEngine

from envs.integrity import IntegrityMode
from sandboxes.base import SandboxLimits
from service.agent import AgentConfig
from service.buffer import Buffer
from service.tables import Suite, Task


class OraclePolicyConfig(BaseModel):
    """Scripted: applies each task's gold patch through the tools (harness checks; not trainable)."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["oracle"] = "oracle"
    tokenizer: Path
    """Model folder whose tokenizer and chat template render the episode."""


class VLLMPolicyConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["vllm"] = "vllm"
    endpoints: list[str] = Field(min_length=1)
    """Base URLs of the vLLM servers."""
    model: str | None = None
    """Served model name; None: what the servers list."""
    tokenizer: Path
    """Model folder with the tokenizer and chat template the servers use."""


class ReplayPolicyConfig(BaseModel):
    """Scripted: replays the same tool calls on every task (pipeline checks, load tests)."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["replay"] = "replay"
    tokenizer: Path
    calls: list[dict] = Field(min_length=1)
    """[{"name": "bash", "arguments": {"command": "..."}}, ...]; submit is added at the end."""
    latency_s: float = Field(0.0, ge=0)
    """Simulated model latency per call (s)."""


PolicyConfig = Annotated[OraclePolicyConfig | VLLMPolicyConfig | ReplayPolicyConfig, Field(discriminator="type")]


class RunConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    suite_id: uuid.UUID
    name: str | None = Field(None, max_length=200)
    policy: PolicyConfig
    samples_per_task: int = Field(1, ge=1, le=1024)
    """Group size: episodes per task (GRPO-style advantages are computed within a group)."""
    agent: AgentConfig = AgentConfig()
    backend: Literal["bwrap", "docker"] = "bwrap"
    limits: SandboxLimits = SandboxLimits(command_timeout_s=180)
    concurrency: int = Field(8, ge=1, le=4096)
    """Episodes in flight at once."""
    max_off_policy_steps: int = Field(4, ge=0)
    """Do not start episodes more than this many trainer steps behind the newest policy."""
    groups_per_step: int | None = Field(None, ge=1)
    """The trainer's batch in groups, when known: the orchestrator then keeps at most
    (max_off_policy_steps + 1) × groups_per_step of the run's groups started and not yet trained
    on, so a group cannot wait in the buffer for more than max_off_policy_steps steps."""
    worker_timeout_s: float = Field(60.0, gt=0)
    """A running episode whose heartbeat is this old lost its worker: it is restarted."""
    queue_timeout_s: float = Field(300.0, gt=0)
    """A queued episode no worker started after this long is sent again (its message may have
    been lost with a broker restart); a duplicate message is harmless."""
    max_consecutive_failures: int = Field(10, ge=1)
    """Stop the run after this many sandbox, provider or storage errors in a row."""
    instance_ids: list[str] | None = None
    """Only these tasks (None: all)."""
    repos: list[str] | None = None
    """Only tasks of these repositories (None: all)."""
    partial_credit: bool = False
    integrity: IntegrityMode = "revert"
    """The agent's changes to test files and test configuration at grading: reverted, rejected
    (resolution NO) or left ("off"); each guard that fires is recorded on the episode."""

    @model_validator(mode="after")
    def _filters(self) -> RunConfig:
        if self.instance_ids is not None and not self.instance_ids:
            raise ValueError("instance_ids, when given, must name at least one task")
        return self

    def hash(self) -> str:
        return hashlib.sha256(self.model_dump_json().encode()).hexdigest()


class RunError(ValueError):
    """The run cannot be created as configured; the message says which field and why."""


async def create_run(engine: AsyncEngine, cfg: RunConfig) -> uuid.UUID:
    run_id = uuid.uuid4()
    async with engine.begin() as conn:
        suite = (await conn.execute(sa.select(Suite).where(Suite.id == cfg.suite_id,
                                                           Suite.deleted_at.is_(None)))).first()
        if suite is None:
            raise RunError(f"suite_id: suite {cfg.suite_id} not found")
        query = sa.select(Task.id, Task.instance_id).where(Task.suite_id == cfg.suite_id).order_by(Task.position)
        if cfg.instance_ids is not None:
            query = query.where(Task.instance_id.in_(cfg.instance_ids))
        if cfg.repos is not None:
            query = query.where(Task.repo.in_(cfg.repos))
        tasks = (await conn.execute(query)).all()
        if not tasks:
            raise RunError("instance_ids/repos: no task of the suite matches the filters")
        if cfg.instance_ids is not None and len(tasks) != len(set(cfg.instance_ids)):
            missing = set(cfg.instance_ids) - {t.instance_id for t in tasks}
            raise RunError(f"instance_ids: not in the suite: {sorted(missing)[:10]}")
        await Buffer.create_run(conn, run_id, suite_id=cfg.suite_id, name=cfg.name,
                                config=json.loads(cfg.model_dump_json()), config_hash=cfg.hash(),
                                task_ids=[t.id for t in tasks], samples=cfg.samples_per_task,
                                trainable=cfg.policy.type == "vllm")
    return run_id
