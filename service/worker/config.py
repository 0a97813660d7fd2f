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
from service.fleet.client import SamplingParams
from service.worker.agent import AgentConfig


class OracleSamplerConfig(BaseModel):
    """Scripted: applies each task's gold patch through the tools (harness checks; not trainable)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    type: Literal["oracle"] = "oracle"
    tokenizer: Path
    """Model folder whose tokenizer and chat template render the episode."""


class DemoSamplerConfig(BaseModel):
    """Scripted: a demonstration of the fix a model could learn to make, derived from each task's
    gold patch (view the file, str_replace the changed lines, submit): the trajectories SFT
    warm-starts a policy on (not trainable as samples of a policy; an SFT trainer takes them)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    type: Literal["demo"] = "demo"
    tokenizer: Path


class VLLMSamplerConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    type: Literal["vllm"] = "vllm"
    endpoints: list[str] = Field(min_length=1)
    """Base URLs of the vLLM servers."""
    model: str | None = None
    """Served model name; None: what the servers list."""
    tokenizer: Path
    """Model folder with the tokenizer and chat template the servers use."""


class ReplaySamplerConfig(BaseModel):
    """Scripted: replays the same tool calls on every task (pipeline checks, load tests)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    type: Literal["replay"] = "replay"
    tokenizer: Path
    calls: list[dict] = Field(min_length=1)
    """[{"name": "bash", "arguments": {"command": "..."}}, ...]; submit is added at the end."""
    latency_s: float = Field(0.0, ge=0)
    """Simulated model latency per call (s)."""


SamplerConfig = Annotated[OracleSamplerConfig | DemoSamplerConfig | VLLMSamplerConfig | ReplaySamplerConfig,
                          Field(discriminator="type")]


class FilterConfig(BaseModel):
    """Online difficulty filtering, as prime-rl's online difficulty filter and DeepSWE's
    solve-all / solve-none filters do it: a task whose recent groups all solved every sample
    (or none) is passed over, with a chance to try it again. Off by default."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    skip_solved: bool = False
    """Pass over tasks every sample of whose recent groups was rewarded."""
    skip_unsolved: bool = False
    """Pass over tasks no sample of whose recent groups was rewarded."""
    min_groups: int = Field(2, ge=1)
    """Finished groups of a task before it may be passed over."""
    window: int = Field(4, ge=1)
    """The task's most recent finished groups that count."""
    retry_prob: float = Field(0.1, ge=0, le=1)
    """Chance that a task the filter would pass over is sampled anyway (its rate may change)."""


class EvalConfig(BaseModel):
    """Evaluation while training: at version 0, every `every` versions and at the last one, a
    run over a held-out suite (never trained on) with the policy version it evaluates."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    suite_id: uuid.UUID
    every: int = Field(1, ge=1)
    """Policy versions between evaluations."""
    samples_per_task: int = Field(4, ge=1, le=1024)
    """n: pass@1 is averaged over n samples per task, pass@k is reported for k = n."""
    instance_ids: list[Annotated[str, Field(max_length=256)]] | None = Field(None, max_length=100_000)
    repos: list[Annotated[str, Field(max_length=256)]] | None = Field(None, max_length=100_000)
    max_turns: int | None = Field(None, ge=1)
    """None: the training run's."""
    sampling: SamplingParams | None = None
    """None: the training run's."""
    concurrency: int | None = Field(None, ge=1, le=4096)
    hold_trainer: bool = True
    """The trainer waits for the evaluation of a version before it trains on, so every
    evaluation episode is sampled by exactly that version."""


class TrainingConfig(BaseModel):
    """A training run: groups are created as the orchestrator needs them, epoch after epoch
    over the suite in an order shuffled per epoch, until the trainer reaches `steps` or the
    schedule (epochs, max_groups) is done."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    steps: int = Field(ge=1)
    """The trainer's last step: the run ends once it published that version (and evaluated it)."""
    epochs: int | None = Field(None, ge=1)
    """Passes over the suite (None: as many as the steps need)."""
    max_groups: int | None = Field(None, ge=1)
    """Groups to create at most, skipped ones included (None: no limit)."""
    seed: int = 0
    """Seed of the per-epoch shuffles and of the filter's retries."""
    filter: FilterConfig = FilterConfig()
    eval: EvalConfig | None = None


class RunConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    suite_id: uuid.UUID
    name: str | None = Field(None, max_length=200, pattern=r"^[^\x00-\x1f]*$")
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
    instance_ids: list[Annotated[str, Field(max_length=256)]] | None = Field(None, max_length=100_000)
    """Only these tasks (None: all)."""
    repos: list[Annotated[str, Field(max_length=256)]] | None = Field(None, max_length=100_000)
    """Only tasks of these repositories (None: all)."""
    partial_credit: bool = False
    integrity: IntegrityMode = "revert"
    """The agent's changes to test files and test configuration at grading: reverted, rejected
    (resolution NO) or left ("off"); each guard that fires is recorded on the episode."""

    training: TrainingConfig | None = None
    """Set: a training run (see TrainingConfig); None: one pass, every group created at once."""

    @model_validator(mode="after")
    def _filters(self) -> RunConfig:
        if self.instance_ids is not None and not self.instance_ids:
            raise ValueError("instance_ids, when given, must name at least one task")
        if self.training is not None and self.sampler.type != "vllm":
            raise ValueError("training: a training run samples with the vLLM fleet (sampler.type = \"vllm\")")
        return self

    def hash(self) -> str:
        return hashlib.sha256(self.model_dump_json().encode()).hexdigest()
