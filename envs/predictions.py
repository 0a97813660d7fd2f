"""Grading predictions as the SWE-bench harness does (`swebench.harness.run_evaluation`): its
predictions in (`instance_id`, `model_name_or_path`, `model_patch`; JSON Lines, a JSON list or a
JSON object keyed by instance id), its reports out, in its layout:

    OUT/RUN_ID/MODEL/INSTANCE/report.json    {instance: {patch_is_None, patch_exists,
                                              patch_successfully_applied, resolved, tests_status}}
    OUT/RUN_ID/MODEL/INSTANCE/test_output.txt
    OUT/MODEL.RUN_ID.json                    the run report (resolved_ids, unresolved_ids,
                                              empty_patch_ids, error_ids, ...)

Each prediction is graded by swerve's own rule (envs.swe_env.grade: a fresh copy of the task's
environment, the integrity guards, the hidden tests), several at once. Resumable as SWE-bench's:
an instance whose report.json exists is not graded again; one whose grading failed (the patch
does not apply, the harness broke) has none, is an error, and is graded again on the next run.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from envs.grading import GradingReport, RewardError
from envs.swe_env import SWEEnvConfig, grade
from envs.task import Task

REPORT = "report.json"
TEST_OUTPUT = "test_output.txt"
ERROR = "error.txt"
KEYS = ("instance_id", "model_name_or_path", "model_patch")


class PredictionsError(ValueError):
    """A predictions file that cannot be graded; the message names where and what to do."""


@dataclass(frozen=True)
class Prediction:
    instance_id: str
    model_name_or_path: str
    model_patch: str | None


def load_predictions(path: Path) -> list[Prediction]:
    """SWE-bench's accepted shapes: JSON Lines, a JSON list, or a JSON object keyed by instance."""
    return parse_predictions(path.read_text(), str(path), as_json=path.suffix == ".json")


def parse_predictions(text: str, path: str, as_json: bool, max_record_bytes: int | None = None) -> list[Prediction]:
    """`text` as a JSON document (a list, or an object keyed by instance) or as JSON Lines
    (each at most `max_record_bytes`, None: any). Raises PredictionsError naming where and
    what to do."""
    rows: list[tuple[str, object]] = []
    if as_json:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise PredictionsError(f"{path}: not JSON ({e}); write a list of predictions or JSON Lines (.jsonl)") from e
        except RecursionError as e:
            raise PredictionsError(f"{path}: nested too deeply to be predictions; write a list of objects") from e
        items = list(data.values()) if isinstance(data, dict) else data
        if not isinstance(items, list):
            raise PredictionsError(f"{path}: a JSON predictions file holds a list or an object of predictions")
        rows = [(f"item {i}", r) for i, r in enumerate(items)]
    else:
        for n, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            if max_record_bytes is not None and len(line) > max_record_bytes:
                raise PredictionsError(f"{path}:{n}: longer than {max_record_bytes} characters (SWERVE_MAX_RECORD_BYTES); "
                                       "shorten the prediction or raise the limit")
            try:
                rows.append((f"line {n}", json.loads(line)))
            except json.JSONDecodeError as e:
                raise PredictionsError(f"{path}:{n}: not JSON ({e.msg})") from e
            except RecursionError as e:
                raise PredictionsError(f"{path}:{n}: nested too deeply to be a prediction") from e
    out, seen = [], set()
    for where, row in rows:
        if not isinstance(row, dict):
            raise PredictionsError(f"{path}:{where}: a prediction is an object with {', '.join(KEYS)}")
        missing = [k for k in KEYS if k not in row]
        if missing:
            raise PredictionsError(f"{path}:{where}: {', '.join(missing)}: missing; every prediction has "
                                   f"{', '.join(KEYS)} (model_patch may be empty)")
        for k in ("instance_id", "model_name_or_path"):
            if not isinstance(row[k], str) or not row[k]:
                raise PredictionsError(f"{path}:{where}: {k}: must be a non-empty string")
        if row["model_patch"] is not None and not isinstance(row["model_patch"], str):
            raise PredictionsError(f"{path}:{where}: model_patch: must be a string (a diff) or null")
        if row["instance_id"] in seen:
            raise PredictionsError(f"{path}:{where}: instance_id: {row['instance_id']!r} is predicted twice; "
                                   "keep one prediction per instance")
        seen.add(row["instance_id"])
        out.append(Prediction(row["instance_id"], row["model_name_or_path"], row["model_patch"]))
    return out


def instance_dir(out: Path, run_id: str, p: Prediction) -> Path:
    return out / run_id / p.model_name_or_path.replace("/", "__") / p.instance_id


def instance_report(p: Prediction, report: GradingReport) -> dict:
    """SWE-bench's report.json of one instance (get_eval_report with tests_status), plus what
    swerve's grading adds under "swerve" (its resolution, guards and the tests' exit code)."""
    return {p.instance_id: {
        "patch_is_None": p.model_patch is None, "patch_exists": p.model_patch is not None,
        "patch_successfully_applied": True, "resolved": report.resolution == "FULL",
        "tests_status": {"FAIL_TO_PASS": report.fail_to_pass, "PASS_TO_PASS": report.pass_to_pass,
                         "FAIL_TO_FAIL": {"success": [], "failure": []},
                         "PASS_TO_FAIL": {"success": [], "failure": []}},
        "swerve": {"resolution": report.resolution, "guards": report.guards,
                   "test_exit_code": report.test_exit_code, "duration_s": report.duration_s},
    }}


async def evaluate(predictions: list[Prediction], tasks: list[Task], cfg: SWEEnvConfig, out: Path, run_id: str,
                   concurrency: int = 4, progress: Callable[[str, str], None] | None = None) -> dict:  # fmt: skip
    """Grade every prediction without a report.json yet; write and return the run report."""
    by_id = {t.instance_id: t for t in tasks}
    unknown = [p.instance_id for p in predictions if p.instance_id not in by_id]
    if unknown:
        raise PredictionsError(f"instance_id: {', '.join(unknown[:10])}{' ...' if len(unknown) > 10 else ''} "
                               f"not in the suite ({len(unknown)} in all); predict only the suite's instances")
    models = {p.model_name_or_path for p in predictions}
    if len(models) > 1:
        raise PredictionsError(f"model_name_or_path: the predictions name {len(models)} models "
                               f"({', '.join(sorted(models))}); grade one model's predictions per run")
    gate = asyncio.Semaphore(concurrency)

    async def one(p: Prediction) -> None:
        folder = instance_dir(out, run_id, p)
        if not p.model_patch or (folder / REPORT).exists():
            return
        async with gate:
            folder.mkdir(parents=True, exist_ok=True)
            (folder / ERROR).unlink(missing_ok=True)
            try:
                report = await grade(by_id[p.instance_id], p.model_patch, cfg)
            except RewardError as e:
                (folder / ERROR).write_text(f"{e}\n{e.log}")
                if progress:
                    progress(p.instance_id, "error")
                return
            (folder / TEST_OUTPUT).write_text(report.log or report.log_tail)
            tmp = folder / f".{REPORT}.partial"
            tmp.write_text(json.dumps(instance_report(p, report), indent=4))
            tmp.replace(folder / REPORT)  # a report exists whole or not at all: resumable
            if progress:
                progress(p.instance_id, report.resolution)

    await asyncio.gather(*(one(p) for p in predictions))
    return run_report(predictions, tasks, out, run_id)


def run_report(predictions: list[Prediction], tasks: list[Task], out: Path, run_id: str) -> dict:
    """SWE-bench's make_run_report, from the instance reports on disk (written beside them)."""
    outcomes: dict[str, str] = {}
    for p in predictions:
        path = instance_dir(out, run_id, p) / REPORT
        if not p.model_patch or not path.exists():
            continue
        try:
            outcomes[p.instance_id] = "resolved" if json.loads(path.read_text())[p.instance_id]["resolved"] else "unresolved"
        except (json.JSONDecodeError, KeyError):
            pass
    report = make_run_report(predictions, [t.instance_id for t in tasks], outcomes)
    model = predictions[0].model_name_or_path.replace("/", "__") if predictions else "none"
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{model}.{run_id}.json").write_text(json.dumps(report, indent=4))
    return report


def make_run_report(predictions: list[Prediction], instance_ids: list[str], outcomes: dict[str, str]) -> dict:
    """SWE-bench's make_run_report: `outcomes` holds "resolved" or "unresolved" for each graded
    prediction; a non-empty one without an outcome is an error, an instance not predicted is
    incomplete."""
    by_id = {p.instance_id: p for p in predictions}
    ids: dict[str, set[str]] = {k: set() for k in ("completed", "resolved", "unresolved", "empty_patch", "error",
                                                   "incomplete")}  # fmt: skip
    for instance_id in instance_ids:
        p = by_id.get(instance_id)
        if p is None:
            ids["incomplete"].add(instance_id)
        elif p.model_patch in ("", None):
            ids["empty_patch"].add(instance_id)
        elif instance_id not in outcomes:
            ids["error"].add(instance_id)
        else:
            ids["completed"].add(instance_id)
            ids[outcomes[instance_id]].add(instance_id)
    return {
        "total_instances": len(instance_ids), "submitted_instances": len(predictions),
        **{f"{k}_instances": len(ids[k]) for k in ("completed", "resolved", "unresolved")},
        "infra_failure_instances": 0, "ambiguous_failure_instances": 0,
        "empty_patch_instances": len(ids["empty_patch"]), "error_instances": len(ids["error"]),
        "completed_ids": sorted(ids["completed"]), "incomplete_ids": sorted(ids["incomplete"]),
        "empty_patch_ids": sorted(ids["empty_patch"]), "submitted_ids": sorted(by_id),
        "resolved_ids": sorted(ids["resolved"]), "unresolved_ids": sorted(ids["unresolved"]),
        "infra_failure_ids": [], "ambiguous_failure_ids": [], "failure_reasons": {},
        "error_ids": sorted(ids["error"]), "schema_version": 2,
    }  # fmt: skip
