"""Suite validation as SWE-bench's harness does it: the gold patch must resolve the task
(FULL) and the empty patch must not (every FAIL_TO_PASS test fails)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

from envs.grading import GradingReport, RewardError
from envs.swe_env import SWEEnvConfig, grade
from envs.task import Task
from sandboxes.base import SandboxError


@dataclass
class ValidationResult:
    instance_id: str
    valid: bool
    gold: dict | None
    empty: dict | None
    gold_s: float
    empty_s: float
    error: str | None = None

    def to_json(self) -> dict:
        return asdict(self)


async def _timed_grade(task: Task, diff: str, cfg: SWEEnvConfig) -> tuple[GradingReport, float]:
    started = time.monotonic()
    report = await grade(task, diff, cfg)
    return report, time.monotonic() - started


async def validate_task(task: Task, cfg: SWEEnvConfig) -> ValidationResult:
    try:
        gold, gold_s = await _timed_grade(task, task.patch or "", cfg)
        empty, empty_s = await _timed_grade(task, "", cfg)
    except (RewardError, SandboxError) as e:
        return ValidationResult(task.instance_id, False, None, None, 0.0, 0.0, f"{type(e).__name__}: {e}")
    problems = []
    if gold.resolution != "FULL":
        problems.append(f"gold patch gives {gold.resolution}")
    if empty.fail_to_pass["success"] or sorted(empty.fail_to_pass["failure"]) != sorted(task.FAIL_TO_PASS):
        problems.append(f"FAIL_TO_PASS tests that pass without a fix: {empty.fail_to_pass['success']}")
    return ValidationResult(task.instance_id, not problems, gold.to_json(), empty.to_json(), gold_s, empty_s,
                            "; ".join(problems) or None)


async def validate_suite(tasks: list[Task], cfg: SWEEnvConfig, concurrency: int = 4,
                         progress: Callable[[ValidationResult, int, int], None] | None = None) -> list[ValidationResult]:  # fmt: skip
    """Validate every task, `concurrency` at once; `progress(result, done, total)` as each ends."""
    gate = asyncio.Semaphore(concurrency)
    done = 0

    async def one(task: Task) -> ValidationResult:
        nonlocal done
        async with gate:
            result = await validate_task(task, cfg)
        done += 1
        if progress:
            progress(result, done, len(tasks))
        return result

    return list(await asyncio.gather(*(one(t) for t in tasks)))
