"""API request and response models (`<Thing>Public`, `<Thing>Created`, `Page`)."""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Any, Generic, TypeVar

from pydantic import BaseModel, ConfigDict

T = TypeVar("T")


class Page(BaseModel, Generic[T]):
    items: list[T]
    total: int
    limit: int
    offset: int


class SuiteCreated(BaseModel):
    id: uuid.UUID
    name: str
    task_count: int


class SuitePublic(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    id: uuid.UUID
    name: str
    task_count: int
    created_at: datetime


class RecordErrorPublic(BaseModel):
    line: int | None
    index: int | None
    instance_id: str | None
    field: str | None
    message: str


class SuiteRejectedPublic(BaseModel):
    detail: str
    error_count: int
    errors: list[RecordErrorPublic]


class TaskValidationPublic(BaseModel):
    task_id: uuid.UUID
    instance_id: str
    valid: bool
    gold: str | None
    """Resolution with the gold patch (FULL when valid); None when grading failed."""
    empty: str | None
    """Resolution with no change (never FULL when valid)."""
    error: str | None
    redacted: list[str] = []
    """["error"] when the error is the grading harness's output and the caller has no API token."""


class SuiteValidationPublic(BaseModel):
    status: str
    """never, running, done or failed."""
    validated_at: datetime | None
    results: list[TaskValidationPublic]


class _TaskIdentity(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    id: uuid.UUID
    suite_id: uuid.UUID
    position: int
    instance_id: str
    repo: str
    base_commit: str
    version: str | None


class TaskSummary(_TaskIdentity):
    n_fail_to_pass: int
    n_pass_to_pass: int


class TaskPublic(_TaskIdentity):
    """A task as stored; `patch` and `test_patch` are the answers, present only with the token."""

    problem_statement: str
    FAIL_TO_PASS: list[str]
    PASS_TO_PASS: list[str]
    environment_setup_commit: str | None
    hints_text: str | None
    created_at: datetime | None
    source: str | None
    image: str | None
    install: list[str] | None
    test_cmd: str | None
    log_parser: str
    extra: dict[str, Any] | None
    answers_included: bool
    """False when the caller had no token: `patch` and `test_patch` are then null."""
    patch: str | None
    test_patch: str | None
    redacted: list[str] = []
    """The fields of `extra` withheld without the token (`extra.NAME`: they carry the answers)."""


class ValidationIssue(BaseModel):
    loc: list[str | int]
    msg: str
    type: str


class HTTPValidationError(BaseModel):
    """FastAPI's answer to a request whose parameters do not validate."""

    detail: list[ValidationIssue]


class Problem(BaseModel):
    detail: str


class Health(BaseModel):
    status: str
    database: str
    """The SQL dialect: postgresql or sqlite."""
    local_mode: bool


class RunStatusPublic(BaseModel):
    """The answer to creating or cancelling a run."""

    id: uuid.UUID
    status: str


class RunProgress(BaseModel):
    id: uuid.UUID
    name: str | None
    status: str
    """A RunStatus: pending, running, cancelling, finished, failed or cancelled."""
    suite_id: uuid.UUID
    created_at: datetime
    finished_at: datetime | None
    episodes: dict[str, int]
    """Episodes by status (service.store.status.EpisodeStatus)."""
    final: int
    """Episodes in a final status."""
    reward_mean: float | None
    graded: int
    """Episodes with a reward."""
    tokens: int
    pass_at_1: float | None
    """Mean over tasks of the task's mean reward."""
    pass_at_k: float | None
    """Fraction of tasks with at least one episode of reward 1."""
    tokens_per_s: float | None
    episodes_per_s: float | None
    gate: dict[str, Any] | None
    """Why the orchestrator holds episodes back (staleness), while it does."""
    error: str | None = None
    """Why the run failed (or was cancelled) when it could not go on: the failure stop's
    last error, an endpoint that is not a vLLM server, an orchestrator error repeated every
    tick. Host paths withheld without the token."""
    owner: str | None
    guarded: int
    """Episodes on which an integrity guard fired at grading."""
    kind: str
    """A RunKind: sample (one pass), train (a training run) or eval (an evaluation)."""
    parent_id: uuid.UUID | None
    """An evaluation's training run."""
    policy_version: int | None
    """The policy version an evaluation evaluates."""
    training: TrainingPublic | None = None
    """A training run's steps and evaluations (GET /runs/{id} only)."""


class EpisodePublic(BaseModel):
    id: uuid.UUID
    run_id: uuid.UUID
    group_id: uuid.UUID
    task_id: uuid.UUID
    instance_id: str
    sample_index: int
    status: str
    """An EpisodeStatus (service.store.status)."""
    attempt: int
    trainable: bool
    reward: float | None
    policy_version_min: int | None
    policy_version_max: int | None
    n_turns: int
    input_tokens: int
    output_tokens: int
    error_type: str | None
    error_message: str | None
    started_at: datetime | None
    finished_at: datetime | None
    guards: list[str] | None
    redacted: list[str]
    """Fields withheld from a caller without the API token (they are null)."""


class TurnPublic(BaseModel):
    idx: int
    segment: int
    policy_version: int | None
    finish_reason: str | None
    text: str | None
    tool_call: dict[str, Any] | None
    observation: str | None
    n_input_tokens: int
    n_output_tokens: int
    generation_s: float | None
    tool_s: float | None
    input_ids: list[int] | str | None = None
    """With `arrays=json` a list, with `arrays=base64` the stored compact array; absent by default."""
    output_ids: list[int] | str | None = None
    output_logprobs: list[float] | str | None = None
    routed_experts: list[Any] | str | None = None
    redacted: list[str]


class EpisodeDetail(EpisodePublic):
    report: dict[str, Any] | None
    diff: str | None
    segment_starts: list[int] | None
    turns: list[TurnPublic]


class TokenPublic(BaseModel):
    id: int
    text: str
    logprob: float | None


class TurnTokens(BaseModel):
    turn: int
    tokens: list[TokenPublic]
    redacted: list[str]


class BufferStats(BaseModel):
    """Groups by status (service.store.status.GroupStatus)."""

    pending: int
    ready: int
    claimed: int
    consumed: int
    dropped: int
    skipped: int
    evaluated: int


class EvalPublic(BaseModel):
    """An evaluation of one policy version over a held-out suite (never trained on)."""

    run_id: uuid.UUID
    parent_id: uuid.UUID | None
    policy_version: int | None
    status: str
    suite_id: uuid.UUID
    created_at: datetime
    finished_at: datetime | None
    pass_at_1: float | None
    """Mean over tasks of the solved fraction of the task's graded samples."""
    pass_at_1_ci: tuple[float, float] | None
    """95% Wilson interval over the graded samples."""
    pass_at_k: float | None
    """Unbiased pass@k estimator (Chen et al.), k = the samples per task."""
    k: int
    tasks: int
    samples: int
    format_error_rate: float | None
    """Turns whose text held no well-formed tool call, over all turns."""
    mean_turns: float | None
    mean_tokens: float | None
    episodes: int
    final: int
    versions_sampled: tuple[int, int] | None
    """The oldest and newest policy versions that sampled its tokens."""


class StepPublic(BaseModel):
    """One trainer step of a training run: the version it made and what it measured."""

    model_config = ConfigDict(extra="allow")
    version: int
    created_at: datetime
    reward_mean: float | None = None
    loss: float | None = None
    mismatch_kl: float | None = None
    entropy: float | None = None
    staleness_mean: float | None = None
    staleness_max: int | None = None
    useful_fraction: float | None = None
    """Groups with a non-zero advantage over the step's groups."""
    filtered: int = 0
    """Tasks the difficulty filter skipped while the previous version was served."""
    wait_s: float | None = None
    """Waiting for rollouts (and for an evaluation the trainer held for)."""
    step_s: float | None = None
    """Forward and backward."""
    publish_s: float | None = None
    """Writing the weights, recording the version, reloading the fleet."""


class TrainingPublic(BaseModel):
    step: int
    last_step: int | None
    """The version that ends the run: training.steps, or where the job's time limit stopped it."""
    stopped_early: bool = False
    """The trainer stopped at last_step before training.steps: the job's time limit."""
    epoch: int | None
    epochs: int | None
    exhausted: bool
    """The schedule made its last group."""
    groups: dict[str, int]
    """The run's groups by status."""
    filtered: int
    dropped: int
    """Groups dropped too stale to train on."""
    left_at_end: int = 0
    """Groups sampled ahead, or still being sampled, when the run ended: dropped untrained."""
    steps_per_hour: float | None
    steps: list[StepPublic]
    evals: list[EvalPublic]


class TaskDifficulty(BaseModel):
    instance_id: str
    pass_rate: list[float | None]
    """The solved fraction of its graded samples, per epoch."""
    skipped: int


class DifficultyPublic(BaseModel):
    epochs: int
    tasks: list[TaskDifficulty]
    total: int


class GroupEpisode(EpisodePublic):
    diff: str | None = None
    advantage: float | None
    """Reward minus the mean of the group's rewarded samples."""
    advantage_std_normalized: float | None


class GroupDetail(BaseModel):
    id: uuid.UUID
    run_id: uuid.UUID
    task_id: uuid.UUID
    instance_id: str
    seq: int
    epoch: int
    status: str
    size: int
    min_policy_version: int | None
    trainer_step: int | None
    skipped_reason: str | None
    dropped_reason: str | None
    reward_mean: float | None
    reward_std: float | None
    teaches: bool
    """Whether its advantages are not all zero."""
    episodes: list[GroupEpisode]


class PolicyPublic(BaseModel):
    version: int
    trainer_step: int | None
    weights_path: str | None
    created_at: datetime
    metrics: dict[str, Any]
    """The metrics of the trainer step that made this version (loss, reward, mismatch KL...)."""
    evals: list[EvalPublic]
    """Evaluations of this version made after it was published."""


class ValidationStarted(BaseModel):
    status: str
    results: str
    """Where the validation's results appear (GET)."""


RunProgress.model_rebuild()
