"""Rows of the public datasets as they ship (envs/datasets.py): each format is told from its
fields, imported (JSON Lines, JSON, Parquet; CLI and API) and run. A SWE-rebench V2 row runs in
its image, built here under its name with the repository at /<repo name>: gold FULL, empty NO,
by the row's own test command and parser. SWE-smith and R2E-Gym rows run in tests/test_harnesses.py."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from envs import datasets
from envs.swe_env import SWEEnvConfig, grade, task_sandbox
from envs.task import Task
from tests.conftest import auth
from tests.dataset_images import generated_task, image_with_repo
from tests.sandbox_fixtures import require_docker
from tests.test_cli import run_cli

SWE_BENCH = {"instance_id": "django__django-11099", "repo": "django/django", "base_commit": "a" * 40,
             "patch": "p", "test_patch": "t", "problem_statement": "x", "hints_text": "", "created_at": "2019-03-20",
             "version": "3.0", "FAIL_TO_PASS": '["a"]', "PASS_TO_PASS": "[]", "environment_setup_commit": "b" * 40}
SWE_SMITH = {"instance_id": "oauthlib__oauthlib.1fd52536.combine_file__09vlzwgc",
             "patch": "diff --git a/a.py b/a.py\n--- a/a.py\n+++ b/a.py\n@@ -1 +1 @@\n-x = 1\n+x = 2\n",
             "FAIL_TO_PASS": ["tests/test_a.py::test_a"], "PASS_TO_PASS": [], "image_name": "jyangballin/swesmith.x86_64.oauthlib_1776_oauthlib.1fd52536",
             "repo": "swesmith/oauthlib__oauthlib.1fd52536", "problem_statement": "x"}
R2E = {"repo_name": "aiohttp", "docker_image": "namanjain12/aiohttp_final:f0d74880", "commit_hash": "f0d74880",
       "problem_statement": "x", "expected_output_json": "{}"}


def rebench(row: dict, image: str | None) -> dict:
    """`row` as SWE-rebench ships it (V2 with image_name, V1 without)."""
    out = {k: row[k] for k in ("instance_id", "repo", "base_commit", "test_patch", "problem_statement", "patch",
                               "FAIL_TO_PASS", "PASS_TO_PASS")}
    config = {"test_cmd": [row["test_cmd"]], "log_parser": f"parse_log_{row['log_parser']}", "install": [],
              "base_image_name": "python:3.11"}
    return out | {"language": "python", "install_config": config} | ({"image_name": image} if image else {})


def test_each_format_is_told_from_its_fields():
    assert datasets.detect(SWE_BENCH) == "swe-bench"
    assert datasets.detect(SWE_SMITH) == "swe-smith" and datasets.detect(R2E) == "r2e-gym"
    assert datasets.detect(rebench(SWE_BENCH | {"test_cmd": "pytest", "log_parser": "pytest"}, "img")) == "swe-rebench"
    gym = Task.model_validate(datasets.adapt(SWE_BENCH | {"instance_id": "getmoto__moto-7365"}, "swe-gym"))
    assert gym.image == "xingyaoww/sweb.eval.x86_64.getmoto_s_moto-7365" and gym.repo_dir() == "/testbed"
    smith = Task.model_validate(datasets.adapt(SWE_SMITH))
    assert (smith.harness, smith.image, smith.base_commit, smith.bug_patch, smith.test_patch) == (
        "swe-smith", SWE_SMITH["image_name"], "1fd52536", SWE_SMITH["patch"], "")
    assert smith.patch == datasets.adapt(SWE_SMITH | {"patch": smith.patch})["bug_patch"] != smith.bug_patch
    assert datasets.adapt(SWE_SMITH | {"image_name": None})["image"] == SWE_SMITH["image_name"]  # the profile's name
    with pytest.raises(datasets.DatasetRowError, match="install_config.test_cmd: missing") as info:
        datasets.adapt(SWE_BENCH | {"install_config": {"log_parser": "parse_log_pytest"}})
    assert info.value.field == "install_config.test_cmd"
    with pytest.raises(datasets.DatasetRowError, match="unknown dataset format 'swe-x'"):
        datasets.adapt(SWE_BENCH, "swe-x")


@pytest.fixture(scope="module")
def rebench_v2(tmp_path_factory):
    client = require_docker()
    tmp = tmp_path_factory.mktemp("rebench")
    row, repo = generated_task(tmp, 11)
    name = row["repo"].rsplit("/", 1)[-1]
    image = image_with_repo(client, repo, f"swerebench/sweb.eval.x86_64.{row['instance_id'].lower()}", at=f"/{name}")
    yield rebench(row, image), row
    client.images.remove(image, force=True)


@pytest.mark.slow
@pytest.mark.docker
async def test_a_swe_rebench_v2_row_runs_in_its_image_by_its_own_command(rebench_v2, tmp_path):
    shipped, row = rebench_v2
    task = Task.model_validate(datasets.adapt(shipped))
    name = row["repo"].rsplit("/", 1)[-1]
    assert (task.image, task.repo_dir(), task.install) == (shipped["image_name"], f"/{name}", None)
    cfg = SWEEnvConfig(backend="docker", image_cache_dir=tmp_path / "images")
    async with task_sandbox(task, cfg) as sandbox:
        r = await sandbox.execute("pwd; git log --format=%H")
        assert r.output.split() == [f"/{name}", task.base_commit], r.output
    assert (await grade(task, task.patch, cfg)).resolution == "FULL"
    empty = await grade(task, "", cfg)
    assert empty.resolution == "NO" and sorted(empty.fail_to_pass["failure"]) == sorted(task.FAIL_TO_PASS)


@pytest.mark.slow
@pytest.mark.docker
def test_import_and_validate_take_the_files_as_they_ship(rebench_v2, tmp_path, db_url):
    shipped, _ = rebench_v2
    parquet = tmp_path / "rebench.parquet"
    pq.write_table(pa.Table.from_pylist([shipped | {"install_config": json.dumps(shipped["install_config"])}]),
                   parquet)  # HF ships install_config as a JSON string
    env = {"SWERVE_DATA_DIR": str(tmp_path / "var"), "SWERVE_DATABASE_URL": db_url}
    done = run_cli(["suite", "validate", str(parquet), "--backend", "docker", "--json"], env, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert json.loads(done.stdout)[0]["valid"]
    done = run_cli(["suite", "import", str(parquet), "--format", "swe-rebench"], env)
    assert done.returncode == 0 and json.loads(done.stdout)["task_count"] == 1, done.stderr
    bad = tmp_path / "smith.jsonl"
    bad.write_text(json.dumps(SWE_SMITH | {"patch": ""}) + "\n")
    done = run_cli(["suite", "import", str(bad)], env)
    assert done.returncode == 1 and "patch: missing" in done.stderr and "line 1" in done.stderr, done.stderr


async def test_the_api_imports_with_a_format(app_client):
    row = SWE_BENCH | {"install_config": {"test_cmd": "pytest -rA tests", "log_parser": "parse_log_pytest",
                                          "install": ["pip install -e ."]}}
    r = await app_client.post("/api/v1/suites", params={"name": "rb", "format": "swe-rebench"},
                              content=json.dumps(row).encode(), headers=auth() | {"Content-Type": "application/x-ndjson"})
    assert r.status_code == 201, r.text
    [item] = (await app_client.get(f"/api/v1/suites/{r.json()['id']}/tasks")).json()["items"]
    task = (await app_client.get(f"/api/v1/tasks/{item['id']}", headers=auth())).json()
    assert task["test_cmd"] == "pytest -rA tests" and task["install"] == ["pip install -e ."]
    assert task["environment_setup_commit"] == SWE_BENCH["base_commit"]  # V1: built at the base, as the fork does
    r = await app_client.post("/api/v1/suites", params={"name": "bad", "format": "swe-rebench"},
                              content=json.dumps(SWE_BENCH).encode(),
                              headers=auth() | {"Content-Type": "application/x-ndjson"})
    assert r.status_code == 422


async def test_the_api_imports_parquet_as_the_datasets_ship_it(app_client):
    import io

    row = SWE_BENCH | {"install_config": json.dumps({"test_cmd": ["pytest -rA tests"], "log_parser": "parse_log_pytest",
                                                     "install": ["pip install -e ."]})}
    buf = io.BytesIO()
    pq.write_table(pa.Table.from_pylist([row, row | {"instance_id": "django__django-11100"}]), buf, row_group_size=1)
    headers = auth() | {"Content-Type": "application/vnd.apache.parquet"}
    r = await app_client.post("/api/v1/suites", params={"name": "pq", "format": "auto"}, content=buf.getvalue(),
                              headers=headers)
    assert r.status_code == 201 and r.json()["task_count"] == 2, r.text
    items = (await app_client.get(f"/api/v1/suites/{r.json()['id']}/tasks")).json()["items"]
    assert [i["instance_id"] for i in items] == ["django__django-11099", "django__django-11100"]
    r = await app_client.post("/api/v1/suites", params={"name": "notpq"}, content=b"PAR1 but not really", headers=headers)
    assert r.status_code == 422 and "not a Parquet file" in r.text, r.text
