"""The integrity guard: reward only for a fix. Before the hidden tests run, the agent's changes
to how tests run (test files, `conftest.py`, test configuration, interpreter start-up hooks)
are reverted, or the episode is rejected; after they run, a result the log contradicts (a test
reported both passing and failing, a FULL verdict from a test command that exited non-zero)
is not a pass. Each guard that fires is recorded in the grading report.
"""

from __future__ import annotations

import configparser
import fnmatch
import posixpath
import tomllib
from dataclasses import dataclass
from typing import Literal

IntegrityMode = Literal["revert", "reject", "off"]

# Files that decide how tests are collected and reported, wherever they are.
HOOK_NAMES = ("conftest.py", "pytest.ini", ".pytest.ini", "tox.ini", "sitecustomize.py", "usercustomize.py",
              "noxfile.py")  # fmt: skip
HOOK_PATTERNS = ("*.pth", "test_*.py", "*_test.py")
TEST_DIRS = ("tests", "test", "testing")
# Shared configuration files: only their test sections are the tests' business.
SECTIONED = {"setup.cfg": ("tool:pytest", "pytest"), "pyproject.toml": ("tool.pytest", "tool.pytest.ini_options")}


@dataclass(frozen=True)
class Guard:
    guard: str
    """reverted | rejected | conflicting_results | test_exit_code"""
    detail: str


def file_of_test(path: str) -> str:
    """The file part of a test id ("tests/test_a.py::test_b[x]" -> "tests/test_a.py")."""
    return path.split("::", 1)[0]


def protected(path: str, graded: set[str]) -> bool:
    """Whether the agent's change to `path` could change how the hidden tests run or report."""
    name = posixpath.basename(path)
    parts = path.split("/")[:-1]
    return (path in graded or name in HOOK_NAMES or any(fnmatch.fnmatch(name, p) for p in HOOK_PATTERNS)
            or any(part in TEST_DIRS for part in parts))


def allowed(path: str, patterns: list[str]) -> bool:
    return any(fnmatch.fnmatch(path, p) or fnmatch.fnmatch(posixpath.basename(path), p) for p in patterns)


def config_test_sections(name: str, text: str | None) -> object:
    """The test sections of setup.cfg / pyproject.toml, comparable between two versions."""
    if text is None:
        return None
    keys = SECTIONED[name]
    try:
        if name == "pyproject.toml":
            tool = tomllib.loads(text).get("tool", {})
            return {"tool.pytest": tool.get("pytest")}
        parser = configparser.RawConfigParser()
        parser.read_string(text)
        return {k: dict(parser[k]) for k in keys if parser.has_section(k)}
    except (tomllib.TOMLDecodeError, configparser.Error) as e:
        return f"unparsable: {e}"  # a file the tools cannot read counts as changed


def conflicting_results(log_statuses: dict[str, set[str]]) -> list[str]:
    """Test ids the log reports both as passing and as failing: printed lines, not pytest."""
    passing, failing = {"PASSED", "XFAIL"}, {"FAILED", "ERROR", "SKIPPED"}
    return sorted(k for k, seen in log_statuses.items() if seen & passing and seen & failing)
