"""The hidden answers and what a caller without the API token sees of them: gold patches and
hidden tests (`patch`, `test_patch`, and the task fields that carry them: EXTRA_ANSWERS), grading log tails and harness messages, validation logs,
and everything an oracle episode recorded (it applies the gold patch): its turns' text, tool
calls, observations, tokens, diff. A withheld field is null and named in its object's
`redacted` list. Every route and page redacts through `Answers`."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

REDACTED = "redacted: needs the API token"
EXTRA_ANSWERS = ("bug_patch", "eval_script", "parsed_commit_content", "execution_result_content")
"""Fields of a task beside `patch` and `test_patch` that hold its answers: SWE-smith's bug (the
fix reversed), SWE-bench 5's eval script (the hidden tests inline), R2E-Gym's parsed commit (the
fix) and recorded runs (the hidden tests' code and logs)."""
REPORT_SHOWN = ("resolution", "fail_to_pass", "pass_to_pass", "test_exit_code", "duration_s", "guards")
"""A grading report's fields anyone may see: the verdict and the named tests' outcomes."""
TURN_ANSWERS = ("text", "tool_call", "observation",
                "input_ids", "output_ids", "output_logprobs", "routed_experts")


_PATH = re.compile(r"(?<![\w.:/~-])/[^\s'\"(),;:\]\[<>]+")


def without_host_paths(text: str | None) -> str | None:
    """`text` with every path of this host in it (one that exists, or whose folder does)
    replaced by `<host path>`: errors shown without the token tell nothing of the machine.
    Paths that are not the host's (in a sandbox, in a URL, made up) stay."""
    if not text:
        return text

    def scrub(m: re.Match) -> str:
        path = m.group(0).rstrip(".")
        parent = os.path.dirname(path.rstrip("/"))
        on_host = os.path.exists(path) or (parent not in ("", "/") and os.path.isdir(parent))
        return "<host path>" + m.group(0)[len(path):] if on_host else m.group(0)

    return _PATH.sub(scrub, text)


def is_oracle(run_config: dict) -> bool:
    """Whether a run's episodes are the gold patch applied through the tools (the oracle, or a
    demonstration of the same fix as an edit)."""
    return (run_config.get("sampler") or {}).get("type") in ("oracle", "demo")


def _withhold(obj: dict, fields) -> dict:
    out = dict(obj)
    out["redacted"] = [f for f in fields if out.get(f) not in (None, "", [], {})]
    for f in out["redacted"]:
        out[f] = None
    return out


@dataclass(frozen=True)
class Answers:
    """What one caller may see: everything with the token (or in local mode), no answers without."""

    shown: bool

    def hides_turns(self, oracle: bool) -> bool:
        return oracle and not self.shown

    def task(self, patch: str | None, test_patch: str | None, extra: dict | None = None) -> dict:
        """A task's answers, and its other fields (`extra`) with those that carry them withheld."""
        hidden = [] if self.shown else [k for k in EXTRA_ANSWERS if (extra or {}).get(k) not in (None, "", [], {})]
        return {"answers_included": self.shown, "patch": patch if self.shown else None,
                "test_patch": test_patch if self.shown else None,
                "extra": None if extra is None else {k: None if k in hidden else v for k, v in extra.items()},
                "redacted": [f"extra.{k}" for k in hidden]}

    def report(self, report: dict | None) -> dict | None:
        if self.shown or report is None:
            return report
        return _withhold(report, [k for k in report if k not in REPORT_SHOWN])

    def turn(self, turn: dict, *, oracle: bool) -> dict:
        return _withhold(turn, TURN_ANSWERS if self.hides_turns(oracle) else ())

    def episode(self, episode: dict, *, oracle: bool) -> dict:
        """An episode (a list item, an event, or the detail with report, diff and turns)."""
        hidden = ["diff"] if self.hides_turns(oracle) else []
        if not self.shown and episode["error_type"] == "RewardError":  # carries the grading sandbox's output
            hidden.append("error_message")
        out = _withhold(episode, hidden)
        if not self.shown and out.get("error_message"):
            out["error_message"] = without_host_paths(out["error_message"])
        if self.hides_turns(oracle):
            out["redacted"].append("turns")
        if "report" in out:
            out["report"] = self.report(out["report"])
        if "turns" in out:
            out["turns"] = [self.turn(t, oracle=oracle) for t in out["turns"]]
        return out

    def error(self, text: str | None) -> str | None:
        """A run's or a job's error: host paths withheld without the token."""
        return text if self.shown else without_host_paths(text)

    def evaluation_instance(self, instance: dict) -> dict:
        """A graded prediction: the test log and the harness's message carry the hidden tests."""
        return _withhold(instance, () if self.shown else ("test_output", "error"))

    def validation(self, validation: dict | None) -> dict | None:
        """A task's validation; its error is the harness's output when neither patch was graded."""
        if validation is None:
            return None
        harness_failed = validation.get("gold") is None and validation.get("empty") is None
        out = _withhold(validation, ["error"] if harness_failed and not self.shown else [])
        return out | {"gold": self.report(out.get("gold")), "empty": self.report(out.get("empty"))}
