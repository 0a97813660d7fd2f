"""SWE-bench 5 rows as they ship (`image`, `eval_script`, `log_parser`, `eval_type`), in the
docker backend: the agent works in the image's /testbed with no history after base_commit, and
grading runs the row's eval script as the swebench harness does, judged by its own functions.
The image is built here under SWE-bench's naming (no registry is reachable), holding a generated
task's repository at /testbed owned by root, as SWE-bench's images are."""

from __future__ import annotations

import json

import pytest

from envs.grading import RewardError
from envs.swe_env import SWEEnvConfig, grade, task_sandbox
from envs.task import Task
from sandboxes.base import SandboxError
from tests.dataset_images import generated_task, image_with_repo, touched_tests
from tests.sandbox_fixtures import require_docker

pytestmark = [pytest.mark.slow, pytest.mark.docker]
EVAL_SCRIPT = """#!/bin/bash
set -uxo pipefail
cd /testbed
git config --global --add safe.directory /testbed
git status
git -c core.fileMode=false diff {base}
git checkout {base} {tests}
git apply -v - <<'EOF_114329324912'
{test_patch}
EOF_114329324912
: '>>>>> Start Test Output'
python3 -B -m unittest -v
: '>>>>> End Test Output'
git checkout {base} {tests}
"""


@pytest.fixture(scope="module")
def v5_row(tmp_path_factory):
    client = require_docker()
    tmp = tmp_path_factory.mktemp("v5")
    row, repo = generated_task(tmp, 7)
    owner, name = row["instance_id"].split("__")
    image = image_with_repo(client, repo, f"swebench/sweb.eval.x86_64.{owner}_1776_{name}:latest".lower())
    tests = " ".join(touched_tests(row))
    shipped = {k: v for k, v in row.items() if k not in ("source", "install", "test_cmd", "log_parser")} | {
        "image": image, "version": "1.0", "log_parser": "parse_log_django", "eval_type": "pass_and_fail",
        "eval_script": EVAL_SCRIPT.format(base=row["base_commit"], tests=tests, test_patch=row["test_patch"].rstrip("\n"))}
    yield shipped
    client.images.remove(image, force=True)


def config(tmp_path) -> SWEEnvConfig:
    return SWEEnvConfig(backend="docker", image_cache_dir=tmp_path / "images")


async def test_the_gold_patch_is_full_and_the_empty_one_no_by_the_rows_own_script(v5_row, tmp_path):
    task = Task.model_validate(v5_row)
    assert task.repo_dir() == "/testbed" and task.log_parser == "django"
    gold = await grade(task, task.patch, config(tmp_path))
    assert gold.resolution == "FULL", gold.log_tail
    assert gold.fail_to_pass == {"success": task.FAIL_TO_PASS, "failure": []} and gold.test_exit_code == 0
    empty = await grade(task, "", config(tmp_path))
    assert empty.resolution == "NO" and sorted(empty.fail_to_pass["failure"]) == sorted(task.FAIL_TO_PASS)
    assert empty.test_exit_code not in (None, 0)
    with pytest.raises(RewardError, match=">>>>> Patch Apply Failed"):
        await grade(task, "diff --git a/nope.py b/nope.py\n--- a/nope.py\n+++ b/nope.py\n@@ -1 +1 @@\n-a\n+b\n",
                    config(tmp_path))


async def test_the_agent_works_in_testbed_with_nothing_after_the_base(v5_row, tmp_path):
    task = Task.model_validate(v5_row)
    async with task_sandbox(task, config(tmp_path)) as sandbox:
        r = await sandbox.execute("pwd; id -u; stat -c %u .; git log --format=%H | head -5; git status --porcelain")
        lines = r.output.split()
        assert lines[:3] == ["/testbed", "1000", "1000"] and lines[3] == task.base_commit and len(lines) == 4, r.output
        r = await sandbox.execute("echo '# edited' >> README.md 2>/dev/null || echo x > new.txt; echo ok")
        assert r.output.strip().endswith("ok")


async def test_a_v5_row_elsewhere_says_what_it_needs(v5_row, tmp_path):
    task = Task.model_validate(v5_row)
    with pytest.raises(SandboxError, match="only the docker backend runs"):
        async with task_sandbox(task, SWEEnvConfig(backend="bwrap", image_cache_dir=tmp_path / "images")):
            pass
    without = {k: v for k, v in v5_row.items() if k != "eval_script"}
    with pytest.raises(ValueError, match="(?s)log_parser.*grades an `eval_script` row only"):
        Task.model_validate(without | {"log_parser": "parse_log_astropy"})
    absent = Task.model_validate(v5_row | {"image": "swerve-nowhere/sweb.eval.x86_64.absent:1"})
    with pytest.raises(SandboxError, match="is not on this Docker engine and could not be pulled"):
        async with task_sandbox(absent, config(tmp_path)):
            pass
    bad = Task.model_validate(v5_row | {"log_parser": "parse_log_nonesuch"})
    with pytest.raises(RewardError, match="parse_log_nonesuch.*is not a parser of the installed swebench"):
        await grade(bad, bad.patch, config(tmp_path))


def test_validate_and_eval_take_the_rows_as_they_ship(v5_row, tmp_path):
    from tests.test_cli import run_cli

    suite = tmp_path / "v5.jsonl"
    suite.write_text(json.dumps(v5_row) + "\n")
    env = {"SWERVE_DATA_DIR": str(tmp_path / "var")}
    done = run_cli(["suite", "validate", str(suite), "--backend", "docker", "--json"], env, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    [result] = json.loads(done.stdout)
    assert result["valid"] and result["gold"]["resolution"] == "FULL" and result["empty"]["resolution"] == "NO"
    preds = tmp_path / "preds.jsonl"
    preds.write_text(json.dumps({"instance_id": v5_row["instance_id"], "model_name_or_path": "m",
                                 "model_patch": v5_row["patch"]}) + "\n")
    done = run_cli(["eval", str(preds), "--suite", str(suite), "--backend", "docker", "--out", str(tmp_path / "o")],
                   env, timeout=600)
    assert done.returncode == 0 and json.loads(done.stdout)["resolved_ids"] == [v5_row["instance_id"]], done.stderr
