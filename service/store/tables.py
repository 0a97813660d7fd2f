"""Database tables. Token arrays are compact binary (service.store.records), never JSON lists.

The same tables run on PostgreSQL and SQLite; store/migrations/ holds their history.
"""

from __future__ import annotations

import uuid
from datetime import datetime, timezone

import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

JSONType = sa.JSON().with_variant(JSONB(), "postgresql")
BigIntPK = sa.BigInteger().with_variant(sa.Integer(), "sqlite")

def utcnow() -> datetime:
    return datetime.now(timezone.utc)


class Base(DeclarativeBase):
    metadata = sa.MetaData(
        naming_convention={
            "ix": "ix_%(table_name)s_%(column_0_N_name)s",
            "uq": "uq_%(table_name)s_%(column_0_N_name)s",
            "ck": "ck_%(table_name)s_%(constraint_name)s",
            "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
            "pk": "pk_%(table_name)s",
        }
    )


def _uuid_pk() -> Mapped[uuid.UUID]:
    return mapped_column(sa.Uuid, primary_key=True, default=uuid.uuid4)


def _created_at() -> Mapped[datetime]:
    return mapped_column(sa.DateTime(timezone=True), default=utcnow, nullable=False)


class Suite(Base):
    __tablename__ = "suites"
    __table_args__ = (
        # Names are unique among live suites; a soft-deleted suite frees its name.
        sa.Index(
            "uq_suites_live_name", "name", unique=True,
            postgresql_where=sa.text("deleted_at IS NULL"),
            sqlite_where=sa.text("deleted_at IS NULL"),
        ),
    )  # fmt: skip

    id: Mapped[uuid.UUID] = _uuid_pk()
    name: Mapped[str] = mapped_column(sa.String(200))
    task_count: Mapped[int] = mapped_column(default=0)
    created_at: Mapped[datetime] = _created_at()
    deleted_at: Mapped[datetime | None] = mapped_column(sa.DateTime(timezone=True))
    """Set when the suite is deleted while finished runs still reference its tasks."""
    validation_status: Mapped[str | None] = mapped_column(sa.String(16))
    """None (never validated), running, done or failed."""
    validated_at: Mapped[datetime | None] = mapped_column(sa.DateTime(timezone=True))
    validation_owner: Mapped[str | None] = mapped_column(sa.String(200))
    """The process running the validation; another takes it over when its heartbeat lapses."""
    validation_heartbeat_at: Mapped[datetime | None] = mapped_column(sa.DateTime(timezone=True))


class Task(Base):
    """One SWE-bench instance; the columns mirror envs.task.Task."""

    __tablename__ = "tasks"
    __table_args__ = (
        sa.UniqueConstraint("suite_id", "instance_id"),
        sa.Index(None, "suite_id", "position"),
        sa.Index(None, "suite_id", "repo"),
    )

    id: Mapped[uuid.UUID] = _uuid_pk()
    suite_id: Mapped[uuid.UUID] = mapped_column(sa.ForeignKey("suites.id", ondelete="CASCADE"))
    position: Mapped[int] = mapped_column()
    """0-based order of the record in the uploaded suite."""
    instance_id: Mapped[str] = mapped_column(sa.String(256))
    repo: Mapped[str] = mapped_column(sa.String(256))
    base_commit: Mapped[str] = mapped_column(sa.String(64))
    problem_statement: Mapped[str] = mapped_column(sa.Text)
    test_patch: Mapped[str] = mapped_column(sa.Text)
    patch: Mapped[str | None] = mapped_column(sa.Text)
    fail_to_pass: Mapped[list] = mapped_column(JSONType)
    pass_to_pass: Mapped[list] = mapped_column(JSONType)
    version: Mapped[str | None] = mapped_column(sa.String(64))
    environment_setup_commit: Mapped[str | None] = mapped_column(sa.String(64))
    hints_text: Mapped[str | None] = mapped_column(sa.Text)
    task_created_at: Mapped[datetime | None] = mapped_column(sa.DateTime(timezone=True))
    source: Mapped[str | None] = mapped_column(sa.Text)
    image: Mapped[str | None] = mapped_column(sa.Text)
    install: Mapped[list | None] = mapped_column(JSONType)
    test_cmd: Mapped[str | None] = mapped_column(sa.Text)
    log_parser: Mapped[str] = mapped_column(sa.String(64))
    extra: Mapped[dict | None] = mapped_column(JSONType)
    """Fields of the record that swerve does not know, kept verbatim."""
    validation: Mapped[dict | None] = mapped_column(JSONType)
    """The last validation: gold and empty-patch reports, whether the task is valid."""


class Policy(Base):
    """A policy version published by the trainer; version 0 is the initial weights."""

    __tablename__ = "policies"

    version: Mapped[int] = mapped_column(sa.Integer, primary_key=True, autoincrement=False)
    weights_path: Mapped[str | None] = mapped_column(sa.Text)
    trainer_step: Mapped[int | None] = mapped_column()
    created_at: Mapped[datetime] = _created_at()
    info: Mapped[dict | None] = mapped_column(JSONType)


class Run(Base):
    __tablename__ = "runs"
    __table_args__ = (sa.Index(None, "status"), sa.Index(None, "suite_id"), sa.Index(None, "parent_id"))

    id: Mapped[uuid.UUID] = _uuid_pk()
    kind: Mapped[str] = mapped_column(sa.String(16), default="sample", server_default="sample")
    """A RunKind (service.store.status): one pass (sample), a training run, or an evaluation."""
    parent_id: Mapped[uuid.UUID | None] = mapped_column(sa.ForeignKey("runs.id", ondelete="CASCADE"))
    """An evaluation's training run."""
    policy_version: Mapped[int | None] = mapped_column()
    """The policy version an evaluation evaluates."""
    exhausted_at: Mapped[datetime | None] = mapped_column(sa.DateTime(timezone=True))
    """A training run: when the last group of its schedule (epochs, max_groups) was created."""
    last_version: Mapped[int | None] = mapped_column()
    """A training run whose trainer stopped early (the job's time limit): its last version, which
    ends the run as `training.steps` does; None: `training.steps`."""
    suite_id: Mapped[uuid.UUID] = mapped_column(sa.ForeignKey("suites.id", ondelete="RESTRICT"))
    name: Mapped[str | None] = mapped_column(sa.String(200))
    status: Mapped[str] = mapped_column(sa.String(32), default="pending")
    config: Mapped[dict] = mapped_column(JSONType)
    """The resolved run config (policy, sampling, limits, sandbox, concurrency)."""
    config_hash: Mapped[str] = mapped_column(sa.String(64))
    created_at: Mapped[datetime] = _created_at()
    started_at: Mapped[datetime | None] = mapped_column(sa.DateTime(timezone=True))
    finished_at: Mapped[datetime | None] = mapped_column(sa.DateTime(timezone=True))
    owner: Mapped[str | None] = mapped_column(sa.String(200))
    """Orchestrator that owns the run (host:pid:nonce); taken over when its heartbeat lapses."""
    owner_heartbeat_at: Mapped[datetime | None] = mapped_column(sa.DateTime(timezone=True))
    error: Mapped[str | None] = mapped_column(sa.Text)
    gate: Mapped[str | None] = mapped_column(sa.Text)
    """Why the orchestrator holds back new groups now (staleness control); None: it does not."""


class Group(Base):
    """All samples of one task in one run; the unit the buffer hands to the trainer."""

    __tablename__ = "groups"
    __table_args__ = (
        sa.UniqueConstraint("run_id", "seq"),
        sa.Index(None, "run_id", "task_id"),
        sa.Index(None, "status", "ready_at"),
        sa.Index(None, "claim_id"),
    )

    id: Mapped[uuid.UUID] = _uuid_pk()
    run_id: Mapped[uuid.UUID] = mapped_column(sa.ForeignKey("runs.id", ondelete="CASCADE"))
    task_id: Mapped[uuid.UUID] = mapped_column(sa.ForeignKey("tasks.id", ondelete="RESTRICT"))
    seq: Mapped[int] = mapped_column()
    """The group's place in its run's schedule (0, 1, ...)."""
    epoch: Mapped[int] = mapped_column(default=0, server_default="0")
    size: Mapped[int] = mapped_column()
    status: Mapped[str] = mapped_column(sa.String(16), default="pending")
    """A GroupStatus (service.store.status)."""
    min_policy_version: Mapped[int | None] = mapped_column()
    created_at: Mapped[datetime] = _created_at()
    ready_at: Mapped[datetime | None] = mapped_column(sa.DateTime(timezone=True))
    claim_id: Mapped[uuid.UUID | None] = mapped_column(sa.Uuid)
    claim_expires_at: Mapped[datetime | None] = mapped_column(sa.DateTime(timezone=True))
    claimed_by: Mapped[str | None] = mapped_column(sa.Text)
    """The trainer (its name) that claimed the group; a restarted trainer takes back its own claims."""
    consumed_at: Mapped[datetime | None] = mapped_column(sa.DateTime(timezone=True))
    trainer_step: Mapped[int | None] = mapped_column()
    dropped_reason: Mapped[str | None] = mapped_column(sa.String(64))


class Episode(Base):
    __tablename__ = "episodes"
    __table_args__ = (
        sa.UniqueConstraint("group_id", "sample_index"),
        sa.Index(None, "run_id", "status"),
        sa.Index(None, "run_id", "task_id"),
        sa.Index(None, "run_id", "finished_at"),
    )

    id: Mapped[uuid.UUID] = _uuid_pk()
    run_id: Mapped[uuid.UUID] = mapped_column(sa.ForeignKey("runs.id", ondelete="CASCADE"))
    group_id: Mapped[uuid.UUID] = mapped_column(sa.ForeignKey("groups.id", ondelete="CASCADE"))
    task_id: Mapped[uuid.UUID] = mapped_column(sa.ForeignKey("tasks.id", ondelete="RESTRICT"))
    sample_index: Mapped[int] = mapped_column()
    status: Mapped[str] = mapped_column(sa.String(32), default="pending")
    """An EpisodeStatus (service.store.status)."""
    attempt: Mapped[int] = mapped_column(default=0)
    """How many times the episode was (re)started after a lost worker."""
    trainable: Mapped[bool] = mapped_column(default=True)
    """False for scripted samplers and chat-endpoint runs (no sampled token ids)."""
    reward: Mapped[float | None] = mapped_column(sa.Float)
    """NULL when grading did not happen or failed; never 0.0 for a harness failure."""
    report: Mapped[dict | None] = mapped_column(JSONType)
    guards: Mapped[list | None] = mapped_column(JSONType)
    """Names of the integrity guards that fired at grading (envs/integrity.py); None: none."""
    policy_version_min: Mapped[int | None] = mapped_column()
    policy_version_max: Mapped[int | None] = mapped_column()
    n_turns: Mapped[int] = mapped_column(default=0)
    input_tokens: Mapped[int] = mapped_column(default=0)
    output_tokens: Mapped[int] = mapped_column(default=0)
    segment_starts: Mapped[list | None] = mapped_column(JSONType)
    """Turn indexes where the chat template could not extend the sequence."""
    diff: Mapped[str | None] = mapped_column(sa.Text)
    config_hash: Mapped[str | None] = mapped_column(sa.String(64))
    sandbox_id: Mapped[str | None] = mapped_column(sa.String(200))
    image: Mapped[str | None] = mapped_column(sa.Text)
    """Environment identity (image digest or prepared-environment key)."""
    error_type: Mapped[str | None] = mapped_column(sa.String(200))
    error_message: Mapped[str | None] = mapped_column(sa.Text)
    created_at: Mapped[datetime] = _created_at()
    queued_at: Mapped[datetime | None] = mapped_column(sa.DateTime(timezone=True))
    started_at: Mapped[datetime | None] = mapped_column(sa.DateTime(timezone=True))
    heartbeat_at: Mapped[datetime | None] = mapped_column(sa.DateTime(timezone=True))
    """Refreshed every second by the worker running the episode; a stale one means it died."""
    finished_at: Mapped[datetime | None] = mapped_column(sa.DateTime(timezone=True))
    graded_at: Mapped[datetime | None] = mapped_column(sa.DateTime(timezone=True))


class Turn(Base):
    """One model call. input_ids + output_ids over an episode's turns is its exact sequence."""

    __tablename__ = "turns"
    __table_args__ = (sa.UniqueConstraint("episode_id", "idx"),)

    id: Mapped[int] = mapped_column(BigIntPK, primary_key=True, autoincrement=True)
    episode_id: Mapped[uuid.UUID] = mapped_column(
        sa.ForeignKey("episodes.id", ondelete="CASCADE")
    )
    idx: Mapped[int] = mapped_column()
    segment: Mapped[int] = mapped_column(default=0)
    input_ids: Mapped[bytes] = mapped_column(sa.LargeBinary)
    output_ids: Mapped[bytes] = mapped_column(sa.LargeBinary)
    output_logprobs: Mapped[bytes | None] = mapped_column(sa.LargeBinary)
    routed_experts: Mapped[bytes | None] = mapped_column(sa.LargeBinary)
    """[len(input_ids)+len(output_ids), layers, top_k] uint8/uint16, shape in the blob header."""
    n_input_tokens: Mapped[int] = mapped_column()
    n_output_tokens: Mapped[int] = mapped_column()
    policy_version: Mapped[int | None] = mapped_column()
    finish_reason: Mapped[str | None] = mapped_column(sa.String(32))
    text: Mapped[str | None] = mapped_column(sa.Text)
    tool_call: Mapped[dict | None] = mapped_column(JSONType)
    observation: Mapped[str | None] = mapped_column(sa.Text)
    """What the environment answered to this turn's action (the next turn's input, as text)."""
    malformed_at: Mapped[int | None] = mapped_column()
    """Without a well-formed tool call: the first sampled token to blame (TurnRecord.malformed_at)."""
    started_at: Mapped[datetime] = _created_at()
    generation_s: Mapped[float | None] = mapped_column(sa.Float)
    tool_s: Mapped[float | None] = mapped_column(sa.Float)


class Evaluation(Base):
    """Predictions graded like the SWE-bench harness (`POST /api/v1/evaluations`): one model's
    patches for a suite's instances, graded by the workers, the run report once all are."""

    __tablename__ = "evaluations"
    __table_args__ = (sa.UniqueConstraint("suite_id", "run_id", "model_name_or_path"), sa.Index(None, "status"))

    id: Mapped[uuid.UUID] = _uuid_pk()
    suite_id: Mapped[uuid.UUID] = mapped_column(sa.ForeignKey("suites.id", ondelete="RESTRICT"))
    run_id: Mapped[str] = mapped_column(sa.String(200))
    """SWE-bench's run id: names the evaluation in its reports."""
    model_name_or_path: Mapped[str] = mapped_column(sa.String(500))
    status: Mapped[str] = mapped_column(sa.String(16), default="running")
    """running, done, cancelled or failed."""
    config: Mapped[dict] = mapped_column(JSONType)
    """backend, concurrency."""
    created_at: Mapped[datetime] = _created_at()
    finished_at: Mapped[datetime | None] = mapped_column(sa.DateTime(timezone=True))
    owner: Mapped[str | None] = mapped_column(sa.String(200))
    """The process that hands its instances to the workers; taken over when its heartbeat lapses."""
    owner_heartbeat_at: Mapped[datetime | None] = mapped_column(sa.DateTime(timezone=True))
    report: Mapped[dict | None] = mapped_column(JSONType)
    """SWE-bench's run report (make_run_report's fields), set when every instance is graded."""
    error: Mapped[str | None] = mapped_column(sa.Text)


class EvaluationInstance(Base):
    """One prediction of an evaluation and its grading."""

    __tablename__ = "evaluation_instances"
    __table_args__ = (sa.Index(None, "evaluation_id", "status"),)

    evaluation_id: Mapped[uuid.UUID] = mapped_column(sa.ForeignKey("evaluations.id", ondelete="CASCADE"),
                                                     primary_key=True)
    instance_id: Mapped[str] = mapped_column(sa.String(256), primary_key=True)
    task_id: Mapped[uuid.UUID] = mapped_column(sa.ForeignKey("tasks.id", ondelete="RESTRICT"))
    model_patch: Mapped[str | None] = mapped_column(sa.Text)
    status: Mapped[str] = mapped_column(sa.String(16))
    """pending, grading, resolved, unresolved, empty_patch, error."""
    attempt: Mapped[int] = mapped_column(default=0)
    heartbeat_at: Mapped[datetime | None] = mapped_column(sa.DateTime(timezone=True))
    """While grading: renewed by the worker; a lapsed one is graded again."""
    report: Mapped[dict | None] = mapped_column(JSONType)
    """SWE-bench's report.json of the instance (envs.predictions.instance_report)."""
    test_output: Mapped[str | None] = mapped_column(sa.Text)
    """The whole log of the tests (SWE-bench's test_output.txt)."""
    error: Mapped[str | None] = mapped_column(sa.Text)
    graded_at: Mapped[datetime | None] = mapped_column(sa.DateTime(timezone=True))
