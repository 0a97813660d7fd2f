"""Rows of the public SWE datasets, as they ship, turned into swerve's suite rows (envs.task.Task),
one adapter each; `detect` tells the format from a row's fields.

- swe-bench: SWE-bench's own schema, unchanged (v5 rows with `image` + `eval_script` run as its
  harness runs them: envs/swebench5.py; v4-shaped rows name what they lack).
- swe-gym: the SWE-bench schema; its image is `xingyaoww/sweb.eval.x86_64.<id, __ as _s_>` (the
  SWE-Gym README), the repository at /testbed.
- swe-rebench: the SWE-bench schema plus `install_config` (`test_cmd` a string or a list,
  `log_parser`, `install`): V2 rows name their `image_name`, whose repository is at /<repo name>
  and whose install is not run again; V1 rows build from the repository with that install
  (`environment_setup_commit` is the base commit, as SWE-rebench's fork sets it).

- swe-smith: `image_name` (the mirror's code at /testbed), `patch` the bug (the gold fix is its
  reverse), the instance's branch; its F2P test files hidden from the agent and restored for
  grading (envs/harnesses.py). `repo` is the mirror, `swesmith/<owner>__<name>.<commit8>`.
- r2e-gym: `docker_image` (/testbed, `.venv`, run_tests.sh, hidden tests at /r2e_tests), the
  reward exact-match with `expected_output_json`; the base commit and the gold fix come from
  `parsed_commit_content`, FAIL_TO_PASS and PASS_TO_PASS from `execution_result_content`.
  R2E-Gym's SWE-bench rows (its SWE-Bench-Verified and -Lite: a `docker_image` naming a SWE-bench
  image, the SWE-bench fields, `parsed_commit`) run the image's own /run_tests.sh, graded by the
  repository's SWE-bench parser (envs/harnesses.py, "r2e-swebench").
"""

from __future__ import annotations

import json
import re
from typing import Any

from envs import swesmith_profiles

FORMATS = ("auto", "swe-bench", "swe-gym", "swe-smith", "swe-rebench", "r2e-gym")


class DatasetRowError(ValueError):
    """A row its format cannot take; `field` names what to fix."""

    def __init__(self, field: str | None, message: str):
        self.field = field
        super().__init__(message)


def detect(row: dict) -> str:
    """The row's dataset, from fields only it has."""
    if "install_config" in row:
        return "swe-rebench"
    if "docker_image" in row or "expected_output_json" in row:
        return "r2e-gym"
    if "image_name" in row and "base_commit" not in row:  # the bug is on a branch: no base commit
        return "swe-smith"
    return "swe-bench"


def adapt(row: Any, fmt: str = "auto") -> Any:
    """`row` as a swerve suite row (a dict for envs.task.Task). Raises DatasetRowError."""
    if fmt not in FORMATS:
        raise DatasetRowError("format", f"unknown dataset format {fmt!r}; use one of {', '.join(FORMATS)}")
    if not isinstance(row, dict):
        return row  # Task's own validation says what is wrong
    kind = detect(row) if fmt == "auto" else fmt
    return {"swe-bench": dict, "swe-gym": _swe_gym, "swe-rebench": _swe_rebench, "swe-smith": _swe_smith,
            "r2e-gym": _r2e_gym}[kind](row)


def swe_gym_image(instance_id: str) -> str:
    return f"xingyaoww/sweb.eval.x86_64.{instance_id.replace('__', '_s_').lower()}"


def _swe_gym(row: dict) -> dict:
    out = dict(row)
    if not out.get("image") and isinstance(out.get("instance_id"), str):
        out["image"] = swe_gym_image(out["instance_id"])
    out.setdefault("workdir", "/testbed")
    return out


def _swe_rebench(row: dict) -> dict:
    out = {k: v for k, v in row.items() if k not in ("install_config", "image_name", "language")}
    if "install_config" not in row:
        raise DatasetRowError("install_config", "install_config: missing; a SWE-rebench row carries its "
                                                "test_cmd, log_parser and install there")
    config = _json_field(row, "install_config", dict, "an object with test_cmd and log_parser")
    test_cmd = config.get("test_cmd")
    if isinstance(test_cmd, list):
        test_cmd = "\n".join(str(c) for c in test_cmd)  # run in order, as SWE-rebench runs them
    if not isinstance(test_cmd, str) or not test_cmd.strip():
        raise DatasetRowError("install_config.test_cmd", "install_config.test_cmd: missing; a SWE-rebench row "
                                                         "names the command its tests run with")
    out["test_cmd"] = test_cmd
    if config.get("log_parser"):
        out["log_parser"] = config["log_parser"]
    extra = {"language": row.get("language"), "base_image_name": config.get("base_image_name")}
    if row.get("image_name"):  # V2: a prebuilt image; its install already ran
        out["image"] = row["image_name"]
        repo = str(row.get("repo", ""))
        out.setdefault("workdir", f"/{repo.rsplit('/', 1)[-1]}")
    else:  # V1: built from the repository at the base commit
        install = config.get("install") or []
        out["install"] = [install] if isinstance(install, str) else list(install)
        out["environment_setup_commit"] = row.get("base_commit")  # as the fork sets it
    out["swe_rebench"] = {k: v for k, v in extra.items() if v is not None}
    return out


_MIRROR = re.compile(r"^swesmith/(?P<owner>[^/_]+(?:_[^/_]+)*?)__(?P<name>[^/]+)\.(?P<commit>[0-9a-f]{8})$")


def swe_smith_image(mirror: str, arch: str = "x86_64") -> str | None:
    """RepoProfile.image_name for a mirror name (None: not a mirror name)."""
    if not (m := _MIRROR.match(mirror)):
        return None
    return f"jyangballin/swesmith.{arch}.{m['owner']}_1776_{m['name']}.{m['commit']}".lower()


def _json_field(row: dict, field: str, kind: type, want: str | None = None) -> Any:
    """`row[field]` as `kind`, decoded when the dataset ships it as a JSON string."""
    value = row.get(field)
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise DatasetRowError(field, f"{field}: not JSON ({e.msg})") from e
    if not isinstance(value, kind):
        raise DatasetRowError(field, f"{field}: must be {want}" if want else
                              f"{field}: missing or not a JSON {kind.__name__}")
    return value


def _swe_smith(row: dict) -> dict:
    from envs.harnesses import reverse_patch

    out = {k: v for k, v in row.items() if k not in ("image_name", "patch")}
    repo = str(row.get("repo", ""))
    m = _MIRROR.match(repo)
    if not m and not row.get("base_commit"):
        raise DatasetRowError("repo", f"repo: {repo!r} is not a SWE-smith mirror name "
                                      "(swesmith/<owner>__<name>.<commit8>), and the row has no base_commit")
    out.setdefault("base_commit", m["commit"] if m else None)  # the upstream commit the mirror holds
    image = row.get("image_name") or swe_smith_image(repo)
    if not image:
        raise DatasetRowError("image_name", "image_name: missing; a SWE-smith row runs in its image")
    bug = row.get("patch")
    if not isinstance(bug, str) or not bug.strip():
        raise DatasetRowError("patch", "patch: missing; a SWE-smith row's patch is the diff that makes its bug")
    try:
        gold = reverse_patch(bug)
    except ValueError as e:
        raise DatasetRowError("patch", f"patch: {e}") from e
    f2p = row.get("FAIL_TO_PASS")
    f2p = json.loads(f2p) if isinstance(f2p, str) else f2p
    out.update(image=image, bug_patch=bug, patch=gold, test_patch="", harness="swe-smith")
    try:  # the harness runs a row by its repository's profile
        prof, why = swesmith_profiles.profile(repo), ""
    except swesmith_profiles.ProfileUnavailable as e:
        prof, why = None, str(e)
    if prof is not None:
        out.setdefault("test_cmd", prof.test_cmd)
        out.setdefault("log_parser", "swe_smith" if swesmith_profiles.is_python(prof) else swesmith_profiles.PROFILE_PARSER)
    elif not row.get("test_cmd") and isinstance(f2p, list) and any("::" not in str(t) for t in f2p):
        raise DatasetRowError("test_cmd", f"test_cmd: missing; these FAIL_TO_PASS ids are not pytest's, so the row is "
                                          f"not of a Python profile, and its profile is not at hand ({why}): add its "
                                          "profile's test_cmd and log_parser")
    out.setdefault("log_parser", "swe_smith")
    return out


def _r2e_gym(row: dict) -> dict:
    from envs.harnesses import r2e_gold_patch
    from envs.log_parsers import parse_r2e_gym

    if "swebench" in str(row.get("docker_image") or ""):  # DockerRuntime's own test (swebench_verified)
        return _r2e_swebench(row)
    name = str(row.get("repo_name") or "")
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", name):
        raise DatasetRowError("repo_name", "repo_name: missing or not a repository name")
    if not row.get("docker_image"):
        raise DatasetRowError("docker_image", "docker_image: missing; an R2E-Gym row runs in its image")
    commit = _json_field(row, "parsed_commit_content", dict)
    expected = _json_field(row, "expected_output_json", dict)
    if not expected:
        raise DatasetRowError("expected_output_json", "expected_output_json: empty; the reward needs the tests' statuses")
    f2p, p2p = [], []
    if row.get("execution_result_content"):
        run = _json_field(row, "execution_result_content", dict)
        old, new = (parse_r2e_gym(run.get(k) or "") for k in ("old_commit_res_stdout", "new_commit_res_stdout"))
        f2p = sorted(k for k, v in new.items() if v == "PASSED" and old.get(k) != "PASSED")
        p2p = sorted(k for k, v in new.items() if v == "PASSED" and old.get(k) == "PASSED")
    if not f2p:  # no run recorded: the tests the reward needs passing
        f2p = sorted(k for k, v in expected.items() if v == "PASSED" and k not in p2p)
    statement = str(row.get("problem_statement") or "")
    if issue := re.search(r"\[ISSUE\](.*)\[/ISSUE\]", statement, re.DOTALL):  # get_task_instruction
        statement = issue.group(1)
    known = ("repo_name", "docker_image", "commit_hash", "parsed_commit_content", "execution_result_content",
             "expected_output_json", "problem_statement")
    out = {k: v for k, v in row.items() if k not in known}
    new_commit = str(row.get("commit_hash") or commit.get("new_commit_hash") or "")
    out.update(instance_id=f"{name}__{new_commit}", repo=f"r2e-gym/{name}", base_commit=commit.get("old_commit_hash"),
               problem_statement=statement, patch=r2e_gold_patch(commit), test_patch="", FAIL_TO_PASS=f2p,
               PASS_TO_PASS=p2p, image=row["docker_image"], harness="r2e-gym", log_parser="r2e_gym",
               expected_output=expected, r2e_gym={"commit_hash": new_commit})
    return out


def swebench_parser(repo: str) -> str | None:
    """The name (in envs.log_parsers) of the parser SWE-bench's harness reads `repo`'s logs with
    (the swebench package's MAP_REPO_TO_PARSER_PY), or None: not a SWE-bench repository."""
    try:
        from swebench.harness.log_parsers.python import MAP_REPO_TO_PARSER_PY
    except ImportError as e:
        raise DatasetRowError("repo", "an R2E-Gym SWE-bench row is graded by the swebench package's parser of its "
                                      "repository, which is not installed: pip install 'swerve[swebench]'") from e
    parser = MAP_REPO_TO_PARSER_PY.get(repo)
    if parser is None:
        return None
    from swebench.harness.log_parsers import python as py

    # the package's aliases (parse_log_flask = parse_log_pytest, ...) name the parser they are
    names = [n.removeprefix("parse_log_") for n, f in vars(py).items() if f is parser and n.startswith("parse_log_")]
    from envs.log_parsers import PARSERS

    return next((n for n in sorted(names, key=len) if n in PARSERS), None)


def _r2e_swebench(row: dict) -> dict:
    """R2E-Gym's SWE-bench row: the SWE-bench fields as they are, the image's /run_tests.sh the
    test run (DockerRuntime._calculate_reward_swebench), the gold fix `patch` (or the non-test
    files of `parsed_commit`, as R2E-Gym's own gold patch)."""
    from envs.harnesses import r2e_gold_patch

    for field in ("instance_id", "repo", "base_commit"):
        if not row.get(field):
            raise DatasetRowError(field, f"{field}: missing; an R2E-Gym SWE-bench row carries SWE-bench's fields")
    f2p = _json_field(row, "FAIL_TO_PASS", list, "a list of test ids (or its JSON)")
    p2p = _json_field(row, "PASS_TO_PASS", list, "a list of test ids (or its JSON)") if row.get("PASS_TO_PASS") \
        is not None else []
    parser = row.get("log_parser") or swebench_parser(str(row["repo"]))
    if parser is None:
        raise DatasetRowError("repo", f"repo: {row['repo']!r} has no parser in SWE-bench's harness "
                                      "(MAP_REPO_TO_PARSER_PY): add the row's log_parser")
    gold = row.get("patch")
    if not gold and row.get("parsed_commit"):
        gold = r2e_gold_patch(_json_field(row, "parsed_commit", dict))
    statement = str(row.get("problem_statement") or "")
    if issue := re.search(r"\[ISSUE\](.*)\[/ISSUE\]", statement, re.DOTALL):
        statement = issue.group(1)
    out = {k: v for k, v in row.items() if k not in ("docker_image", "parsed_commit", "run_tests_regression")}
    out.update(problem_statement=statement, patch=gold or "", test_patch=row.get("test_patch") or "",
               FAIL_TO_PASS=f2p, PASS_TO_PASS=p2p, image=row["docker_image"], harness="r2e-swebench",
               log_parser=parser)
    return out


def load_tasks(path, fmt: str = "auto") -> list:
    """Every row of a suite file (JSON Lines, a JSON array or Parquet) as a Task; raises
    DatasetRowError naming the row and the field of the first bad one."""
    from pathlib import Path

    from pydantic import ValidationError

    from envs.task import Task

    path = Path(path)
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        rows = [(f"row {i}", r) for i, r in enumerate(pq.read_table(path).to_pylist())]
    elif path.suffix == ".json" or path.read_text()[:1].strip() == "[":
        rows = [(f"item {i}", r) for i, r in enumerate(json.loads(path.read_text()))]
    else:
        rows = [(f"line {n}", json.loads(line)) for n, line in enumerate(path.read_text().splitlines(), 1)
                if line.strip()]
    out = []
    for where, row in rows:
        try:
            out.append(Task.model_validate(adapt(row, fmt)))
        except DatasetRowError as e:
            raise DatasetRowError(e.field, f"{path}:{where}: {e}") from e
        except ValidationError as e:
            err = e.errors(include_url=False)[0]
            field = ".".join(str(p) for p in err["loc"]) or None
            raise DatasetRowError(field, f"{path}:{where}: {field or '(row)'}: {err['msg']}") from e
    return out
