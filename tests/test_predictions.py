"""`swerve eval`: predictions graded as the SWE-bench harness does, on the example suite under
bubblewrap, as a user runs it: SWE-bench's report layout and fields, resumable, bad files named."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from tests.sandbox_fixtures import require_bwrap
from tests.test_cli import run_cli

pytestmark = pytest.mark.slow
SUITE = Path(__file__).resolve().parents[1] / "envs" / "example_suite" / "suite.jsonl"
ROWS = [json.loads(line) for line in SUITE.read_text().splitlines()]
MODEL = "org/model-7b"
APPLIES_FIXES_NOTHING = ("diff --git a/notes.txt b/notes.txt\nnew file mode 100644\n--- /dev/null\n+++ b/notes.txt\n"
                         "@@ -0,0 +1 @@\n+hello\n")
DOES_NOT_APPLY = "diff --git a/nope.py b/nope.py\n--- a/nope.py\n+++ b/nope.py\n@@ -1 +1 @@\n-old\n+new\n"


def write(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def predictions(tmp_path: Path) -> Path:
    patches = [ROWS[0]["patch"], "", DOES_NOT_APPLY, APPLIES_FIXES_NOTHING]
    return write(tmp_path / "preds.jsonl", [{"instance_id": r["instance_id"], "model_name_or_path": MODEL,
                                             "model_patch": p} for r, p in zip(ROWS, patches)])


def test_reports_in_swebench_shape_and_a_rerun_resumes(tmp_path):
    require_bwrap()
    env = {"SWERVE_DATA_DIR": str(tmp_path / "var"), "PATH": os.environ["PATH"]}
    out = tmp_path / "results"
    args = ["eval", str(predictions(tmp_path)), "--suite", str(SUITE), "--run-id", "r1", "--out", str(out)]
    done = run_cli(args, env, timeout=600)
    assert done.returncode == 0, done.stderr
    ids = [r["instance_id"] for r in ROWS]
    report = json.loads(done.stdout)
    assert report == json.loads((out / "org__model-7b.r1.json").read_text())
    assert report["resolved_ids"] == [ids[0]] and report["empty_patch_ids"] == [ids[1]]
    assert report["error_ids"] == [ids[2]] and report["unresolved_ids"] == [ids[3]]
    assert report["completed_ids"] == sorted([ids[0], ids[3]]) and len(report["incomplete_ids"]) == len(ROWS) - 4
    assert (report["total_instances"], report["submitted_instances"], report["resolved_instances"]) == (len(ROWS), 4, 1)
    folder = out / "r1" / "org__model-7b"
    solved = json.loads((folder / ids[0] / "report.json").read_text())[ids[0]]
    assert solved["resolved"] and solved["patch_exists"] and solved["patch_successfully_applied"]
    assert solved["tests_status"]["FAIL_TO_PASS"] == {"success": ROWS[0]["FAIL_TO_PASS"], "failure": []}
    assert sorted(solved["tests_status"]["PASS_TO_PASS"]["success"]) == sorted(ROWS[0]["PASS_TO_PASS"])
    assert set(solved["tests_status"]) == {"FAIL_TO_PASS", "PASS_TO_PASS", "FAIL_TO_FAIL", "PASS_TO_FAIL"}
    unsolved = json.loads((folder / ids[3] / "report.json").read_text())[ids[3]]
    assert not unsolved["resolved"] and unsolved["tests_status"]["FAIL_TO_PASS"]["failure"] == ROWS[3]["FAIL_TO_PASS"]
    assert "does not apply" in (folder / ids[2] / "error.txt").read_text()
    assert not (folder / ids[2] / "report.json").exists() and not (folder / ids[1]).exists()

    stamps = {i: (folder / i / "report.json").stat().st_mtime_ns for i in (ids[0], ids[3])}
    again = run_cli(args, env, timeout=600)
    assert again.returncode == 0 and json.loads(again.stdout) == report
    assert {i: (folder / i / "report.json").stat().st_mtime_ns for i in stamps} == stamps  # not graded again
    assert again.stderr.split() == [f"{ids[2]}:", "error"]  # only the error is tried again


@pytest.mark.parametrize(("rows", "says"), [
    ([{"instance_id": "x", "model_name_or_path": MODEL}], "line 1: model_patch: missing"),
    ([{"instance_id": ROWS[0]["instance_id"], "model_name_or_path": MODEL, "model_patch": 3}], "model_patch: must be"),
    ([{"instance_id": "nope__nope-1", "model_name_or_path": MODEL, "model_patch": ""}], "instance_id: nope__nope-1 not in the suite"),
    ([{"instance_id": ROWS[0]["instance_id"], "model_name_or_path": MODEL, "model_patch": ""}] * 2, "predicted twice"),
])  # fmt: skip
def test_bad_predictions_are_named_and_nothing_is_written(tmp_path, rows, says):
    out = tmp_path / "results"
    done = run_cli(["eval", str(write(tmp_path / "p.jsonl", rows)), "--suite", str(SUITE), "--out", str(out)],
                   {"SWERVE_DATA_DIR": str(tmp_path / "var")})
    assert done.returncode == 2 and says in done.stderr, done.stderr
    assert not out.exists()


def test_the_json_shapes_swebench_accepts_load_the_same(tmp_path):
    from envs.predictions import load_predictions

    rows = [{"instance_id": r["instance_id"], "model_name_or_path": MODEL, "model_patch": r["patch"]} for r in ROWS[:3]]
    as_list, as_object = tmp_path / "list.json", tmp_path / "object.json"
    as_list.write_text(json.dumps(rows))
    as_object.write_text(json.dumps({r["instance_id"]: r for r in rows}))
    want = load_predictions(write(tmp_path / "p.jsonl", rows))
    assert load_predictions(as_list) == load_predictions(as_object) == want and len(want) == 3


def test_a_swebench_v4_row_without_its_spec_is_refused_by_name_not_graded_on_defaults(tmp_path):
    """A v4-shaped row (repo + version, nothing to build or run it with) names what to add;
    graded on defaults it would have been a whole-repository pytest on a bare checkout."""
    row = json.loads((Path(__file__).parent / "data" / "swebench_sample.jsonl").read_text().splitlines()[0])
    assert row.get("version") and not {"install", "test_cmd", "image", "eval_script"} & set(row)
    suite = write(tmp_path / "v4.jsonl", [row])
    done = run_cli(["suite", "validate", str(suite), "--json"], {"SWERVE_DATA_DIR": str(tmp_path / "var")})
    assert done.returncode == 1, done.stderr
    [result] = json.loads(done.stdout)
    assert not result["valid"] and "SWE-bench row of the v4 shape" in result["error"]
    assert "add `install` and `test_cmd`" in result["error"] and row["instance_id"] in result["error"]
    assert not (tmp_path / "var" / "images").exists() or not any((tmp_path / "var" / "images").iterdir())


def test_an_imported_suite_is_named_instead_of_a_file(tmp_path):
    require_bwrap()
    env = {"SWERVE_DATA_DIR": str(tmp_path / "var"), "PATH": os.environ["PATH"]}
    assert run_cli(["db", "upgrade"], env).returncode == 0
    done = run_cli(["suite", "import", str(SUITE), "--name", "examples"], env)
    assert done.returncode == 0, done.stderr
    preds = write(tmp_path / "p.jsonl", [{"instance_id": ROWS[0]["instance_id"], "model_name_or_path": MODEL,
                                          "model_patch": ROWS[0]["patch"]}])
    out = tmp_path / "results"
    done = run_cli(["eval", str(preds), "--suite", "examples", "--run-id", "r", "--out", str(out)], env, timeout=600)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["resolved_ids"] == [ROWS[0]["instance_id"]]
    log = (out / "r" / "org__model-7b" / ROWS[0]["instance_id"] / "test_output.txt").read_text()
    assert all(t.split(" ")[0] in log for t in ROWS[0]["FAIL_TO_PASS"] + ROWS[0]["PASS_TO_PASS"]), log[-2000:]
    done = run_cli(["eval", str(preds), "--suite", "no-such-suite"], env)
    assert done.returncode == 2 and "neither a file nor an imported suite" in done.stderr


def test_suite_validate_says_how_far_it_is_and_never_cuts_an_id(tmp_path):
    require_bwrap()
    rows = [r | {"instance_id": r["instance_id"] + "-with-a-name-long-enough-to-be-cut-at-eighty-columns"}
            for r in ROWS[:2]]
    suite = write(tmp_path / "suite.jsonl", rows)
    shutil.copytree(SUITE.parent / "bundles", tmp_path / "bundles")
    done = run_cli(["suite", "validate", str(suite)], {"SWERVE_DATA_DIR": str(tmp_path / "var"), "COLUMNS": "80"},
                   timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    said = [line for line in done.stderr.splitlines() if line.startswith("[")]
    assert [line.split()[0] for line in said] == ["[1/2]", "[2/2]"] and all("valid" in line for line in said), done.stderr
    assert all(r["instance_id"] in done.stdout for r in rows), done.stdout
