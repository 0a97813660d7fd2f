"""Grading by SWE-bench's rule: the agent's diff, then the hidden test_patch, in a fresh copy
of the environment; test_cmd's log parsed; FULL / PARTIAL / NO. A harness failure (patch does
not apply, tests time out, sandbox died) raises RewardError: its reward is NULL, never 0.0.
"""

from __future__ import annotations

import posixpath
import re
import shlex
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Literal

from envs.integrity import SECTIONED, Guard, IntegrityMode, allowed, conflicting_results, protected, config_test_sections
from envs.log_parsers import PARSERS

Resolution = Literal["FULL", "PARTIAL", "NO"]
PASSING = ("PASSED", "XFAIL")


class RewardError(Exception):
    """The grading harness failed; `kind` is the episode status it leads to: reward_error, or
    test_timeout when the hidden tests ran past their limit (not the agent's own `timeout`)."""

    def __init__(self, message: str, kind: str = "reward_error", log: str = ""):
        self.kind, self.log = kind, log
        super().__init__(message)


def _resolve(case: str, status_map: dict[str, str]) -> str | None:
    """The status-map key for a test id; tolerates ids truncated inside a parameter (as SWE-bench)."""
    if case in status_map:
        return case
    if case.count("[") > case.count("]"):
        matches = [k for k in status_map if k.startswith(case)]
        if matches and len({status_map[k] in PASSING for k in matches}) == 1:
            return matches[0]
    return None


def test_passed(case: str, sm: dict[str, str]) -> bool:
    key = _resolve(case, sm)
    return key is not None and sm[key] in PASSING


def test_maintained(case: str, sm: dict[str, str]) -> bool:
    """PASS_TO_PASS semantics: a skipped test is not a regression."""
    key = _resolve(case, sm)
    return test_passed(case, sm) or (key is not None and sm[key] == "SKIPPED")


def test_failed(case: str, sm: dict[str, str]) -> bool:
    key = _resolve(case, sm)
    return key is None or sm[key] in ("FAILED", "ERROR", "SKIPPED")


@dataclass
class GradingReport:
    resolution: Resolution
    fail_to_pass: dict[str, list[str]]
    pass_to_pass: dict[str, list[str]]
    tests: dict[str, str] = field(default_factory=dict)
    """Every test id the log named, with its status."""
    test_exit_code: int | None = None
    duration_s: float = 0.0
    log_tail: str = ""
    guards: list[dict] = field(default_factory=list)
    """Integrity guards that fired (envs/integrity.py): {"guard": ..., "detail": ...}."""
    log: str = field(default="", repr=False)
    """The tests' whole output (SWE-bench's test_output.txt); not stored with episodes, whose
    report keeps `log_tail`."""

    def reward(self, partial_credit: bool = False) -> float:
        if self.resolution == "FULL":
            return 1.0
        if partial_credit and self.resolution == "PARTIAL":
            ok, bad = len(self.fail_to_pass["success"]), len(self.fail_to_pass["failure"])
            return ok / (ok + bad)
        return 0.0

    def to_json(self) -> dict:
        out = asdict(self)
        del out["log"]
        return out


def tests_report(status_map: dict[str, str], f2p: list[str], p2p: list[str]) -> tuple[dict, dict]:
    """SWE-bench's get_eval_tests_report for PASS_AND_FAIL: success/failure per list."""
    f2p_report: dict[str, list[str]] = {"success": [], "failure": []}
    for case in f2p:
        if test_passed(case, status_map):
            f2p_report["success"].append(case)
        elif test_failed(case, status_map):
            f2p_report["failure"].append(case)
    p2p_report: dict[str, list[str]] = {"success": [], "failure": []}
    for case in p2p:
        if test_maintained(case, status_map):
            p2p_report["success"].append(case)
        elif test_failed(case, status_map):
            p2p_report["failure"].append(case)
    return f2p_report, p2p_report


def resolution(f2p: dict[str, list[str]], p2p: dict[str, list[str]]) -> Resolution:
    """SWE-bench's get_resolution_status."""
    def rate(report: dict[str, list[str]]) -> float:
        total = len(report["success"]) + len(report["failure"])
        return 1 if total == 0 else len(report["success"]) / total

    f, p = rate(f2p), rate(p2p)
    if f == 1 and p == 1:
        return "FULL"
    if 0 < f < 1 and p == 1:
        return "PARTIAL"
    return "NO"


def report_from_log(log: str, parser: str | Callable[[str], dict[str, str]], f2p: list[str], p2p: list[str],
                    exit_code: int | None = None) -> GradingReport:  # fmt: skip
    """The verdict on a test log (`parser`: a name in PARSERS, or a parser itself). A log that
    reports one test both passing and failing is no pass (printed lines); with `exit_code`
    given, a FULL verdict also needs it to be 0."""
    status_map = parser(log) if callable(parser) else PARSERS[parser](log)
    f2p_report, p2p_report = tests_report(status_map, f2p, p2p)
    report = GradingReport(resolution=resolution(f2p_report, p2p_report), fail_to_pass=f2p_report,
                           pass_to_pass=p2p_report, tests=status_map, log_tail=log[-4000:], test_exit_code=exit_code,
                           log=log)
    if parser in PYTEST_PARSERS and (forged := conflicting_results(_all_statuses(log, parser))):
        report.guards.append(asdict(Guard("conflicting_results", ", ".join(forged[:20]))))
    if exit_code is not None and exit_code != 0 and report.resolution == "FULL":
        report.guards.append(asdict(Guard("test_exit_code", f"every named test passed but the tests exited {exit_code}")))
    if report.guards:
        report.resolution = "NO"
    return report


PYTEST_PARSERS = ("pytest", "pytest_v2", "pytest_options", "swe_smith")


def _all_statuses(log: str, parser: str) -> dict[str, set[str]]:
    """Every status each test id is given anywhere in the log (a parser keeps only the last)."""
    seen: dict[str, set[str]] = {}
    for line in log.splitlines():
        for case, status in PARSERS[parser](line).items():
            seen.setdefault(case, set()).add(status)
    return seen


_DIFF_FILE = re.compile(r"^diff --git a/(\S+) b/(\S+)", re.MULTILINE)


def patch_files(patch: str) -> list[str]:
    return sorted({m.group(1) for m in _DIFF_FILE.finditer(patch)} | {m.group(2) for m in _DIFF_FILE.finditer(patch)})


async def apply_patch(sandbox, patch: str, name: str) -> None:
    """Apply a diff in the sandbox's work tree. Raises RewardError if it does not apply."""
    if not patch.strip():
        return
    path = f"/tmp/.swerve-{name}.patch"
    await sandbox.write_file(path, patch if patch.endswith("\n") else patch + "\n")
    result = await sandbox.execute(f"git apply --binary --whitespace=nowarn {path} && rm -f {path}",
                                   timeout_s=120)
    if result.exit_code != 0:
        raise RewardError(f"the {name} patch does not apply: {result.output[-1500:]}", log=result.output)


async def guard_changes(sandbox, *, diff: str, base_commit: str, graded: set[str], mode: IntegrityMode,
                        allow: list[str]) -> list[Guard]:  # fmt: skip
    """With the agent's diff in place: revert (or reject) its changes to how tests run."""
    if mode == "off":
        return []
    hits = []
    for path in patch_files(diff):
        if allowed(path, allow):
            continue
        name = posixpath.basename(path)
        if name in SECTIONED and not protected(path, graded):
            before, after = await _read(sandbox, f"git show {base_commit}:{shlex.quote(path)}"), await _current(sandbox, path)
            if config_test_sections(name, before) == config_test_sections(name, after):
                continue
        elif not protected(path, graded):
            continue
        hits.append(path)
    if mode == "reject" or not hits:
        return [Guard("rejected", path) for path in hits]
    await _reset(sandbox, base_commit, hits)
    return [Guard("reverted", path) for path in hits]


async def _read(sandbox, command: str) -> str | None:
    result = await sandbox.execute(command + " 2>/dev/null", timeout_s=60)
    return result.output if result.exit_code == 0 else None


async def _current(sandbox, path: str) -> str | None:
    try:
        return (await sandbox.read_file(path)).decode(errors="replace")
    except FileNotFoundError:
        return None


async def _reset(sandbox, base_commit: str, paths) -> None:
    """Put paths back as they are at base_commit (removing those it does not have)."""
    result = await sandbox.execute(
        "for f in " + " ".join(shlex.quote(f) for f in paths) + "; do "
        f"git cat-file -e {base_commit}:\"$f\" 2>/dev/null && git checkout -q {base_commit} -- \"$f\" "
        "|| rm -f -- \"$f\"; done", timeout_s=120)
    if result.exit_code != 0:
        raise RewardError(f"cannot reset the test files: {result.output[-1500:]}", log=result.output)


async def run_tests(sandbox, *, base_commit: str, test_patch: str, test_cmd: str,
                    parser: str | Callable[[str], dict[str, str]],
                    f2p: list[str], p2p: list[str], timeout_s: float, exit_code_counts: bool = True,
                    log_of: Callable[[str], str] | None = None) -> GradingReport:  # fmt: skip
    """After the agent's diff is in place: reset the test files, apply test_patch, run, parse
    (the part of the output `log_of` gives, or all of it)."""
    await _reset(sandbox, base_commit, patch_files(test_patch))
    await apply_patch(sandbox, test_patch, "test")
    started = time.monotonic()
    result = await sandbox.execute(test_cmd, timeout_s=timeout_s)
    if result.timed_out:
        raise RewardError(f"tests did not finish within {timeout_s} s", kind="test_timeout", log=result.output)
    log = log_of(result.output) if log_of else result.output
    report = report_from_log(log, parser, f2p, p2p, result.exit_code if exit_code_counts else None)
    report.test_exit_code, report.duration_s, report.log = result.exit_code, time.monotonic() - started, result.output
    return report
