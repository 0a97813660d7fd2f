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

SWE-smith (the bug as `patch` on an instance branch) and R2E-Gym (hidden tests in the image,
reward by exact match to `expected_output_json`) are detected and refused by name: their
environments are not built yet.
"""

from __future__ import annotations

import json
from typing import Any

FORMATS = ("auto", "swe-bench", "swe-gym", "swe-smith", "swe-rebench", "r2e-gym")
NOT_YET = {
    "swe-smith": "SWE-smith rows (the bug on an instance branch of image_name's mirror) are not supported yet",
    "r2e-gym": "R2E-Gym rows (hidden tests in docker_image, expected_output_json) are not supported yet",
}


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
    if kind in NOT_YET:
        raise DatasetRowError(None, f"{NOT_YET[kind]} (format {kind})")
    return {"swe-bench": dict, "swe-gym": _swe_gym, "swe-rebench": _swe_rebench}[kind](row)


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
    config = row["install_config"]
    if isinstance(config, str):
        try:
            config = json.loads(config)
        except json.JSONDecodeError as e:
            raise DatasetRowError("install_config", f"install_config: not JSON ({e.msg})") from e
    if not isinstance(config, dict):
        raise DatasetRowError("install_config", "install_config: must be an object with test_cmd and log_parser")
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
