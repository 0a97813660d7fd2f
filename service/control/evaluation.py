"""What an evaluation run measured: pass@1 with a 95% interval, pass@k, the format-error rate,
mean turns and tokens, and the policy versions that sampled it. Pure statistics first, then the
one query that gathers them for many runs."""

from __future__ import annotations

import math
import uuid
from math import comb

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncSession

from service.store.tables import Episode, Task, Turn

Z95 = 1.959963984540054


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased estimator of pass@k from n samples of which c passed (Chen et al. 2021):
    1 - C(n-c, k) / C(n, k); k is cut to n."""
    k = min(k, n)
    if n == 0 or k == 0:
        return 0.0
    return 1.0 - comb(n - c, k) / comb(n, k)


def wilson(successes: int, n: int, z: float = Z95) -> tuple[float, float] | None:
    """The Wilson score interval of a proportion (sound at 0 and 1 and for few samples)."""
    if n == 0:
        return None
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)  # rounding may leave 1 - 1e-16 at p = 1


def summarize(per_task: dict[object, list[float]], k: int) -> dict:
    """pass@1 (the mean over tasks of each task's solved fraction), its 95% Wilson interval over
    the samples, and pass@k, from each task's graded rewards (1.0 solved)."""
    tasks = [rs for rs in per_task.values() if rs]
    if not tasks:
        return {"pass_at_1": None, "pass_at_1_ci": None, "pass_at_k": None, "k": k, "tasks": 0, "samples": 0}
    solved = [sum(1 for r in rs if r >= 1.0) for rs in tasks]
    n = sum(len(rs) for rs in tasks)
    return {"pass_at_1": sum(c / len(rs) for c, rs in zip(solved, tasks)) / len(tasks),
            "pass_at_1_ci": wilson(sum(solved), n),
            "pass_at_k": sum(pass_at_k(len(rs), c, k) for c, rs in zip(solved, tasks)) / len(tasks),
            "k": k, "tasks": len(tasks), "samples": n}


def paired_difference(before: dict[object, float], after: dict[object, float], *, resamples: int = 10_000,
                      seed: int = 0) -> dict | None:  # fmt: skip
    """after - before in pass@1 over the tasks both evaluated (each task's solved fraction), with
    a 95% percentile-bootstrap interval that resamples tasks, keeping each task's pair together:
    the tasks' own difficulty cancels out of the difference, so the interval is the one a
    comparison of two policies on the same tasks needs (two separate intervals overlap long after
    the difference is clear). None without a task in common."""
    import numpy as np

    tasks = sorted((t for t in before if t in after), key=str)
    if not tasks:
        return None
    diff = np.array([after[t] - before[t] for t in tasks], dtype=np.float64)
    picks = np.random.default_rng(seed).integers(0, len(diff), size=(resamples, len(diff)))
    means = diff[picks].mean(axis=1)
    low, high = np.quantile(means, [0.025, 0.975])
    return {"difference": float(diff.mean()), "ci": (float(low), float(high)), "tasks": len(tasks),
            "better": int((diff > 0).sum()), "worse": int((diff < 0).sum())}


def solved_fractions(per_task: dict[object, list[float]]) -> dict[object, float]:
    """Each task's solved fraction of its graded samples (tasks without one left out)."""
    return {t: sum(1 for r in rs if r >= 1.0) / len(rs) for t, rs in per_task.items() if rs}


async def eval_results(session: AsyncSession, runs: dict[uuid.UUID, int]) -> dict[uuid.UUID, dict]:
    """For each evaluation run (id: its samples per task, the k of pass@k): the summary, the
    format-error rate (turns whose text held no well-formed tool call), mean turns and tokens
    per episode, the episodes final and in all, and the versions that sampled it."""
    if not runs:
        return {}
    ids = list(runs)
    rewards: dict[uuid.UUID, dict] = {i: {} for i in ids}
    counts = {i: {"episodes": 0, "final": 0, "turns": 0, "tokens": 0, "versions": [None, None]} for i in ids}
    rows = (await session.execute(sa.select(
        Episode.run_id, Episode.task_id, Episode.reward, Episode.finished_at, Episode.n_turns,
        Episode.input_tokens + Episode.output_tokens, Episode.policy_version_min, Episode.policy_version_max)
        .where(Episode.run_id.in_(ids)))).all()
    for run_id, task_id, reward, finished, turns, tokens, vmin, vmax in rows:
        c = counts[run_id]
        c["episodes"] += 1
        if finished is None:
            continue
        c["final"] += 1
        c["turns"] += turns or 0
        c["tokens"] += tokens or 0
        if vmin is not None:
            c["versions"][0] = vmin if c["versions"][0] is None else min(c["versions"][0], vmin)
        if vmax is not None:
            c["versions"][1] = vmax if c["versions"][1] is None else max(c["versions"][1], vmax)
        if reward is not None:
            rewards[run_id].setdefault(task_id, []).append(float(reward))
    malformed = dict((await session.execute(
        sa.select(Episode.run_id, sa.func.count()).join(Turn, Turn.episode_id == Episode.id)
        .where(Episode.run_id.in_(ids), sa.or_(Turn.tool_call.is_(None), sa.cast(Turn.tool_call, sa.String) == "null"))
        .group_by(Episode.run_id))).all())
    out = {}
    for run_id in ids:
        c = counts[run_id]
        final = c["final"]
        out[run_id] = summarize(rewards[run_id], runs[run_id]) | {
            "format_error_rate": (malformed.get(run_id, 0) / c["turns"]) if c["turns"] else None,
            "mean_turns": c["turns"] / final if final else None,
            "mean_tokens": c["tokens"] / final if final else None,
            "episodes": c["episodes"], "final": final,
            "versions_sampled": c["versions"] if c["versions"][0] is not None else None,
        }  # fmt: skip
    return out


async def task_rewards(session: AsyncSession, run_id: uuid.UUID) -> dict[str, list[float]]:
    """A run's graded rewards by task instance id (what paired_difference compares across runs)."""
    rows = (await session.execute(sa.select(Task.instance_id, Episode.reward).join(Task, Task.id == Episode.task_id)
                                  .where(Episode.run_id == run_id, Episode.reward.is_not(None)))).all()
    out: dict[str, list[float]] = {}
    for instance_id, reward in rows:
        out.setdefault(instance_id, []).append(float(reward))
    return out

