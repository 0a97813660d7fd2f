"""A training run's schedule: which task each of its groups samples, epoch after epoch, in an
order shuffled per epoch with the run's seed, and the online difficulty filter that may pass a
task over. Pure functions: the orchestrator reads the history and writes the groups."""

from __future__ import annotations

import random
from dataclasses import dataclass

from service.worker.config import FilterConfig, TrainingConfig


def epoch_order(n_tasks: int, epoch: int, seed: int) -> list[int]:
    """The tasks' indexes in the order epoch `epoch` samples them (the same for a seed)."""
    order = list(range(n_tasks))
    random.Random(f"swerve-epoch:{seed}:{epoch}").shuffle(order)
    return order


def slot(seq: int, n_tasks: int, seed: int) -> tuple[int, int]:
    """(epoch, task index) of the run's group number `seq`."""
    epoch, place = divmod(seq, n_tasks)
    return epoch, epoch_order(n_tasks, epoch, seed)[place]


def schedule_length(cfg: TrainingConfig, n_tasks: int) -> int | None:
    """Groups the schedule makes in all (skipped ones included); None: no end."""
    bounds = [b for b in (cfg.epochs * n_tasks if cfg.epochs else None, cfg.max_groups) if b is not None]
    return min(bounds) if bounds else None


@dataclass(frozen=True)
class GroupOutcome:
    """One finished group of a task: how many samples were graded and how many solved it."""

    graded: int
    solved: int


def skip_reason(history: list[GroupOutcome], cfg: FilterConfig, seq: int, seed: int) -> str | None:
    """Why the filter passes the task over (None: it samples it). `history`: the task's finished
    groups in this run, newest first. A group with no graded sample does not count."""
    recent = [g for g in history if g.graded][: cfg.window]
    if len(recent) < cfg.min_groups:
        return None
    graded, solved = sum(g.graded for g in recent), sum(g.solved for g in recent)
    reason = None
    if cfg.skip_solved and solved == graded:
        reason = f"always solved: {solved}/{graded} in {len(recent)} groups"
    elif cfg.skip_unsolved and solved == 0:
        reason = f"never solved: 0/{graded} in {len(recent)} groups"
    if reason is not None and random.Random(f"swerve-retry:{seed}:{seq}").random() < cfg.retry_prob:
        return None  # tried again: its pass rate may have moved
    return reason


def eval_due(version: int, every: int, last: int) -> bool:
    """Whether policy `version` is evaluated: version 0, every `every`-th, and the last."""
    return version == 0 or version == last or (version % every == 0 and version < last)
