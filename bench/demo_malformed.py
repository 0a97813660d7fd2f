"""Where a finished `swerve demo learn`'s (or demo_rl_variant's) held-out evaluations break their
tool calls: each malformed turn (no well-formed call) of each evaluation, by finish reason (`length`:
cut at max_tokens, a repetition loop; `stop`: the call ended garbled), and for the garbled ones by
the argument the break falls in and by the parser's error.

    .venv/bin/python bench/demo_malformed.py var/demo-learn [var/demo-variant/demo-learn ...]

Reads the folder's results.json and swerve.db (SQLite), re-parses each malformed turn's stored text
with envs.tools.parse_tool_call, and prints one table per folder.
"""

from __future__ import annotations

import argparse
import json
import re
import sqlite3
from collections import Counter
from pathlib import Path

from envs.tools import parse_tool_call

_KEY = re.compile(r'"(\w+)"\s*:\s*"?')


def where(text: str, at: int) -> str:
    """The JSON key whose value holds character `at` of a tool call's text ("structure" before any)."""
    start = text.find("<tool_call>")
    keys = [(m.end(), m.group(1)) for m in _KEY.finditer(text, start) if m.end() <= at]
    return keys[-1][1] if keys else "structure"


def turns_of(db: Path, run_id: str) -> list[tuple[str | None, str | None, bool]]:
    """(finish reason, text, whether it made a well-formed call) of each turn of the run."""
    with sqlite3.connect(db) as conn:
        return conn.execute(
            "SELECT t.finish_reason, t.text, t.tool_call IS NOT NULL AND t.tool_call != 'null' FROM turns t "
            "JOIN episodes e ON e.id = t.episode_id WHERE e.run_id = ?", (run_id.replace("-", ""),)).fetchall()


def report(folder: Path) -> None:
    results = json.loads((folder / "results.json").read_text())
    print(f"\n{folder}")
    print("| policy | turns | malformed | length (loops) | stop (garbled) | garbled: where it broke | garbled: JSON error |")
    print("|---|---|---|---|---|---|---|")
    for label, row in results["evals"].items():
        held = row.get("heldout") or {}
        if not held.get("run_id"):
            continue
        every = turns_of(folder / "swerve.db", held["run_id"])
        turns = [(reason, text) for reason, text, called in every if not called]
        reasons = Counter(reason for reason, _ in turns)
        places, errors = Counter(), Counter()
        for reason, text in turns:
            if reason == "length":
                continue
            parsed = parse_tool_call(text or "")
            json_error = re.search(r"not valid JSON \((.*?)(?: at char \d+)?\)", parsed.error or "")
            errors[json_error.group(1) if json_error else "unclosed" if parsed.error_at is not None else "no call"] += 1
            places["no call" if parsed.error_at is None else where(text, parsed.error_at)] += 1
        top = ", ".join(f"{k} {v}" for k, v in places.most_common(5))
        err = ", ".join(f"{k} {v}" for k, v in errors.most_common(3))
        print(f"| {label} | {len(every)} | {len(turns)} | "
              f"{reasons.get('length', 0)} | {reasons.get('stop', 0)} | {top} | {err} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folders", type=Path, nargs="+", help="demo-learn folders (with results.json and swerve.db)")
    for folder in parser.parse_args().folders:
        report(folder)


if __name__ == "__main__":
    main()
