"""A run's config: what its episodes sample with, the agent's limits, the sandbox, the group size
and the scheduling bounds the orchestrator keeps. Stored on the run as JSON; workers read it back."""

from __future__ import annotations

import hashlib
import uuid
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from envs.integrity import IntegrityMode
from sandboxes.base import SandboxLimits
from service.worker.agent import AgentConfig


class OracleSamplerConfig(BaseModel):
    """Scripted: applies each task's gold patch through the tools (harness checks; not trainable)."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["oracle"] = "oracle"
    tokenizer: Path
    """Model folder whose tokenizer and chat template render the episode."""


class VLLMSamplerConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["vllm"] = "vllm"
    endpoints: list[str] = Field(min_length=1)
    """Base URLs of the vLLM servers."""
    model: str | None = None
    """Served model name; None: what the servers list."""
    tokenizer: Path
    """Model folder with the tokenizer and chat template the servers use."""


class ReplaySamplerConfig(BaseModel):
    """Scripted: replays the same tool calls on every task (pipeline checks, load tests)."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["replay"] = "replay"
    tokenizer: Path
    calls: list[dict] = Field(min_length=1)
    """[{"name": "bash", "arguments": {"command": "..."}}, ...]; submit is added at the end."""
    latency_s: float = Field(0.0, ge=0)
    """Simulated model latency per call (s)."""


SamplerConfig = Annotated[OracleSamplerConfig | VLLMSamplerConfig | ReplaySamplerConfig, Field(discriminator="type")]


class RunConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    suite_id: uuid.UUID
    name: str | None = Field(None, max_length=200)
    sampler: SamplerConfig
    """What samples the episodes: the vLLM fleet (trainable) or a scripted sampler (not)."""
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
