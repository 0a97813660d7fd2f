"""Every status a row can take, defined once: Literal types for the code, tuples for queries.
The web UI's script reads the final ones from the page, not from a copy."""

from __future__ import annotations

from typing import Literal

EpisodeStatus = Literal[
    "pending", "queued", "running",
    "submitted", "max_turns", "context_exhausted", "timeout",
    "reward_error", "test_timeout",
    "sandbox_error", "provider_error", "storage_error", "worker_error",
    "cancelled",
]  # fmt: skip
GRADED: tuple[EpisodeStatus, ...] = ("submitted", "max_turns", "context_exhausted", "timeout")
"""The agent submitted or used up one of its budgets (turns, context, its wall-clock `timeout`):
the tests decide the reward, and the episode is trainable."""
HARNESS_FAILURES: tuple[EpisodeStatus, ...] = ("reward_error", "test_timeout")
"""The grading harness failed (`test_timeout`: the hidden tests ran past their limit): reward NULL."""
FAILURES: tuple[EpisodeStatus, ...] = ("sandbox_error", "provider_error", "storage_error", "worker_error")
"""The sandbox, the fleet, the database or the worker itself (`worker_error`: an error no
other status names, such as a tokenizer that cannot be loaded; its message is kept) failed
the episode: no reward; a run stops after `max_consecutive_failures` of them in a row."""
EPISODE_FINAL: tuple[EpisodeStatus, ...] = (*GRADED, *HARNESS_FAILURES, *FAILURES, "cancelled")
IN_FLIGHT: tuple[EpisodeStatus, ...] = ("queued", "running")

RunStatus = Literal["pending", "running", "cancelling", "finished", "failed", "cancelled"]
RUN_ACTIVE: tuple[RunStatus, ...] = ("pending", "running", "cancelling")

RunKind = Literal["sample", "train", "eval"]
"""sample: one pass over the suite (every group created at once); train: a training run (epochs
over the suite, groups created as the orchestrator needs them, evaluations as the policy
changes); eval: an evaluation of one policy version for a training run (never trained on)."""

GroupStatus = Literal["pending", "ready", "claimed", "consumed", "dropped", "skipped", "evaluated"]
"""pending: episodes still running; ready: all final, waiting for the trainer; claimed: under a
trainer's lease; consumed: a committed step trained on it; dropped: too stale to train on;
skipped: the difficulty filter passed its task over (no episodes); evaluated: all final in an
evaluation (never handed to a trainer)."""
