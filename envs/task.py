"""The task record: a SWE-bench instance plus swerve's optional fields (DESIGN.md, Task).

Validation is strict on the fields swerve uses and keeps unknown fields verbatim in `extra`.
"""

from __future__ import annotations

import json
import re
from datetime import datetime, timezone
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

LOG_PARSERS = (
    "pytest", "pytest_v2", "pytest_options", "django", "sympy", "seaborn", "matplotlib", "swe_smith", "r2e_gym",
    "swe_smith_profile",
)  # fmt: skip
"""Log parsers a task may name (SWE-bench's names, without the `parse_log_` prefix;
swe_smith_profile: the parser of the SWE-smith profile of the task's repo, envs/swesmith_profiles)."""

_COMMIT = re.compile(r"^[0-9a-fA-F]{7,64}$")
_SWEBENCH_PARSER = re.compile(r"^[a-z][a-z0-9_]*$")
"""A parser name of the swebench package (parse_log_NAME), checked against it at grading."""
_INSTANCE_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._\-/+@]*$")
_REPO = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._\-]*(/[A-Za-z0-9._\-]+)+$")
_BUNDLE = re.compile(r"^[A-Za-z0-9_-][A-Za-z0-9._-]{0,199}$")


def _test_list(value: Any) -> Any:
    """SWE-bench ships FAIL_TO_PASS/PASS_TO_PASS as JSON-encoded strings; accept both forms."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"not a JSON list of test names ({e.msg} at char {e.pos})") from e
    return value


class Task(BaseModel):
    """One SWE task. Field names are SWE-bench's, so a dataset row validates as it ships."""

    model_config = ConfigDict(extra="allow", populate_by_name=True, str_strip_whitespace=False)

    instance_id: str = Field(min_length=1, max_length=256)
    repo: str = Field(min_length=3, max_length=256)
    """`owner/name` as on GitHub (also used to group environments)."""
    base_commit: str
    """The commit the agent starts from (hex SHA)."""
    problem_statement: str = Field(min_length=1)
    test_patch: str
    """Hidden tests, applied only at grading."""
    FAIL_TO_PASS: list[str] = Field(min_length=1)
    """Tests that must fail before the fix and pass after it."""
    PASS_TO_PASS: list[str]
    """Tests that must keep passing."""
    patch: str | None = None
    """The gold fix; never shown to the agent."""
    version: str | None = Field(None, max_length=64)
    environment_setup_commit: str | None = None
    hints_text: str | None = None
    created_at: datetime | None = None
    source: str | None = Field(None, min_length=1)
    """Where the repository comes from: a git URL, a local path or `bundle:NAME`."""
    image: str | None = Field(None, min_length=1)
    """A prebuilt environment image; skips building from `source` and `install`."""
    eval_script: str | None = Field(None, min_length=1)
    """SWE-bench 5's grading script (its rows carry it beside `image`): run as SWE-bench's
    harness runs it after the model patch, its log parsed between the harness's markers
    (envs/swebench5.py). Set, it replaces `test_patch` + `test_cmd` at grading."""
    eval_type: Literal["pass_and_fail", "fail_only"] = "pass_and_fail"
    """SWE-bench 5's rule for the test lists (fail_only: an absent F2P test counts as passed)."""
    workdir: str | None = Field(None, pattern=r"^/[A-Za-z0-9._/-]*$")
    """Where the repository is in `image` (None: /testbed for an `eval_script` row, as
    SWE-bench's images; /work otherwise)."""
    install: list[str] | None = None
    """Shell commands that prepare the environment, run in order, in the environment's own
    Python environment (sandboxes.base.PYTHON_ENV), as SWE-bench's specs write them
    (`pip install -e .`); the agent's shell and grading use it too."""
    python: str | None = Field(None, pattern=r"^3(\.\d{1,2})?$")
    """The Python of that environment ("3.11": `python3.11` of the base system; None: its
    `python3`). Setting it makes the environment even without `install`."""
    test_cmd: str | None = Field(None, min_length=1)
    """Runs the tests named in FAIL_TO_PASS and PASS_TO_PASS."""
    log_parser: str = "pytest"
    history: Literal["ancestors", "none"] | None = None
    """The git history the agent's repository keeps: "ancestors" (base_commit and its ancestors,
    no later commit, ref, tag or remote, as SWE-bench), or "none" (one commit holding
    base_commit's tree: for synthetic bugs, whose history is the answer). None: "none" for
    bundles and local folders, "ancestors" for remote repositories."""
    integrity_allow: list[str] = []
    """Test files and test configuration the fix may change (glob patterns, e.g. "conftest.py"):
    grading reverts the agent's changes to any other such file (envs/integrity.py)."""
    harness: Literal["swe-smith", "r2e-gym", "r2e-swebench"] | None = None
    """A dataset whose `image` holds the hidden tests (envs/harnesses.py): the agent's starting
    state is made from the image as that dataset's harness makes it, the hidden tests out of its
    reach, and grading restores them and judges by that harness's rule. Docker backend only."""
    bug_patch: str | None = None
    """SWE-smith: the diff that makes the bug (the dataset's own `patch`), applied to the image's
    checkout when its repository lacks the instance's branch."""
    expected_output: dict[str, str] | None = None
    """R2E-Gym: the test statuses the reward needs, exactly (`expected_output_json`)."""
    exit_code_counts: bool = True
    """The test command must exit 0 for a FULL resolution (SWE-bench 5's rule: printed PASSED
    lines cannot fake a result). False only where the gold fix's own run exits non-zero."""

    def history_mode(self) -> Literal["ancestors", "none"]:
        if self.harness == "swe-smith":
            return "none"  # the branch's parents are the clean code: its history is the answer
        if self.history is not None:
            return self.history
        source = self.source or ""
        remote = not self.source or "://" in source or source.startswith("git@")
        return "ancestors" if remote else "none"

    @field_validator("instance_id")
    @classmethod
    def _instance_id(cls, v: str) -> str:
        if not _INSTANCE_ID.match(v):
            raise ValueError("may hold letters, digits and . _ - / + @ only, starting with a "
                             "letter or digit")
        return v

    @field_validator("source")
    @classmethod
    def _source(cls, v: str | None) -> str | None:
        if v is None:
            return v
        if v.startswith("bundle:"):
            if not _BUNDLE.match(v.removeprefix("bundle:")):
                raise ValueError("bundle:NAME takes a file name without folders (letters, digits and . _ -, "
                                 "not starting with a dot)")
            return v
        if "::" in v or v.startswith("-"):
            raise ValueError("must be a git URL (https, http, git, ssh), user@host:path, a local path or "
                             "bundle:NAME; git's transport::address forms and options are refused")
        if "://" in v and v.split("://", 1)[0] not in ("https", "http", "git", "ssh", "file"):
            raise ValueError(f"URL scheme {v.split('://', 1)[0]!r} is not a git transport this service "
                             "clones from (https, http, git, ssh, file)")
        return v

    @field_validator("repo")
    @classmethod
    def _repo(cls, v: str) -> str:
        if not _REPO.match(v):
            raise ValueError("must look like 'owner/name'")
        return v

    @field_validator("base_commit", "environment_setup_commit")
    @classmethod
    def _commit(cls, v: str | None) -> str | None:
        if v is not None and not _COMMIT.match(v):
            raise ValueError("must be a hex commit SHA (7 to 64 hex digits)")
        return v

    @field_validator("FAIL_TO_PASS", "PASS_TO_PASS", mode="before")
    @classmethod
    def _tests(cls, v: Any) -> Any:
        return _test_list(v)

    @field_validator("FAIL_TO_PASS", "PASS_TO_PASS")
    @classmethod
    def _tests_named(cls, v: list[str]) -> list[str]:
        if any(not name for name in v):
            raise ValueError("test names must not be empty")
        return v

    @field_validator("version", mode="before")
    @classmethod
    def _version(cls, v: Any) -> Any:
        # Some exports write versions as numbers (0.2 for "0.2").
        return str(v) if isinstance(v, int | float) and not isinstance(v, bool) else v

    @field_validator("install", mode="before")
    @classmethod
    def _install(cls, v: Any) -> Any:
        return [v] if isinstance(v, str) else v

    @field_validator("created_at")
    @classmethod
    def _utc(cls, v: datetime | None) -> datetime | None:
        if v is not None and v.tzinfo is None:
            return v.replace(tzinfo=timezone.utc)
        return v

    @field_validator("log_parser", mode="before")
    @classmethod
    def _log_parser(cls, v: Any, info: ValidationInfo) -> Any:
        if isinstance(v, str):
            v = v.removeprefix("parse_log_")
            if v in LOG_PARSERS:
                return v
            if not info.data.get("eval_script"):
                raise ValueError(f"unknown log parser {v!r}; use one of {', '.join(LOG_PARSERS)} (a parser of "
                                 "the swebench package, parse_log_NAME, grades an `eval_script` row only)")
            if not _SWEBENCH_PARSER.match(v):
                raise ValueError(f"{v!r} is no parser name; the swebench package's are parse_log_NAME")
        return v

    def repo_dir(self) -> str:
        """Where the agent works and grading runs: the repository's folder in its sandbox."""
        return self.workdir or ("/testbed" if self.eval_script or self.harness else "/work")

    def unknown_fields(self) -> dict[str, Any]:
        """Fields swerve does not know, kept verbatim."""
        return dict(self.__pydantic_extra__ or {})

    def spec_missing(self) -> str | None:
        """Why this task cannot be run as it ships, or None. A SWE-bench row of the v4 shape
        (`repo` + `version`, no `test_cmd`, `image` or `eval_script`) takes its environment and
        test command from the harness's spec tables by (repo, version), which the swebench
        package ships no longer (5.x rows carry `image` and `eval_script`); run on defaults it
        would be graded by a whole-repository pytest."""
        if self.version is None or self.test_cmd or self.image or self.eval_script:
            return None
        return (f"{self.instance_id}: a SWE-bench row of the v4 shape ({self.repo} version {self.version}, "
                "no test_cmd, image or eval_script); its environment and test command are in the "
                "SWE-bench harness's spec tables, which the installed swebench package does not ship: add "
                "`install` and `test_cmd` (the test files of test_patch, as SWE-bench's eval script runs "
                "them), or use the SWE-bench 5 row with `image` and `eval_script`")

    def grading_options(self) -> dict[str, Any]:
        """swerve's fields without a column of their own, as given (stored beside the unknown ones)."""
        return self.model_dump(include={"history", "integrity_allow", "exit_code_counts", "python", "eval_script",
                                        "eval_type", "workdir", "harness", "bug_patch", "expected_output"},
                               exclude_unset=True)
