"""Test-log parsers, line for line the behaviour of SWE-bench's Python parsers (MIT licensed,
swebench 5.x `harness/log_parsers/python.py`), so that grading here equals grading there.

Each maps a log to {test id: PASSED | FAILED | SKIPPED | ERROR | XFAIL}. `pytest_v2` keeps
parametrized ids that contain spaces whole; `pytest` splits on whitespace as SWE-bench does.
"""

from __future__ import annotations

import re
from collections.abc import Callable

STATUSES = ("FAILED", "PASSED", "SKIPPED", "ERROR", "XFAIL")
_SKIP_SUMMARY_COUNT = re.compile(r"^\[\d+\]$")


def _is_skip_summary(status: str, name: str) -> bool:
    """pytest's `SKIPPED [N] path:line: reason` summary line names no test."""
    return status == "SKIPPED" and bool(_SKIP_SUMMARY_COUNT.match(name))


def _status_line(line: str) -> bool:
    return any(line.startswith(s) for s in STATUSES)


def _pytest_cases(log: str):
    """(status, first token after it) of every pytest status line, as SWE-bench reads them."""
    for line in log.split("\n"):
        if _status_line(line):
            if line.startswith("FAILED"):
                line = line.replace(" - ", " ")
            case = line.split()
            if len(case) > 1 and not _is_skip_summary(case[0], case[1]):
                yield case[0], case[1]


def parse_pytest(log: str) -> dict[str, str]:
    return {name: status for status, name in _pytest_cases(log)}


_OPTION = re.compile(r"(.*?)\[(.*)\]")


def parse_pytest_options(log: str) -> dict[str, str]:
    status_map = {}
    for status, name in _pytest_cases(log):
        if match := _OPTION.search(name):
            main, option = match.groups()
            if option.startswith("/") and not option.startswith("//") and "*" not in option:
                option = "/" + option.split("/")[-1]
            name = f"{main}[{option}]"
        status_map[name] = status
    return status_map


_ESCAPES = str.maketrans("", "", "".join(chr(c) for c in range(1, 32)))


def parse_pytest_v2(log: str) -> dict[str, str]:
    status_map = {}
    for line in log.split("\n"):
        line = re.sub(r"\[(\d+)m", "", line).translate(_ESCAPES)
        if _status_line(line):
            if line.startswith("FAILED"):
                line = line.split(" - ", 1)[0]
            case = line.split()
            if len(case) >= 2 and not _is_skip_summary(case[0], case[1]):
                status_map[" ".join(case[1:])] = case[0]
        elif any(line.endswith(s) for s in STATUSES):
            case = line.split()
            if len(case) >= 2:
                status_map[" ".join(case[:-1])] = case[-1]
    return status_map


_DJANGO_MULTILINE = [
    r"^(.*?)\s\.\.\.\sTesting\ against\ Django\ installed\ in\ ((?s:.*?))\ silenced\)\.\nok$",
    r"^(.*?)\s\.\.\.\sInternal\ Server\ Error:\ \/(.*)\/\nok$",
    r"^(.*?)\s\.\.\.\sSystem check identified no issues \(0 silenced\)\nok$",
]


def parse_django(log: str) -> dict[str, str]:  # noqa: C901 - mirrors SWE-bench's parser
    status_map: dict[str, str] = {}
    prev_test = None
    for line in log.split("\n"):
        line = line.strip()
        if "--version is equivalent to version" in line:
            status_map["--version is equivalent to version"] = "PASSED"
        if " ... " in line:
            prev_test = line.split(" ... ")[0]
        for suffix in (" ... ok", " ... OK", " ...  OK"):
            if line.endswith(suffix):
                if line.strip().startswith("Applying sites.0002_alter_domain_unique...test_no_migrations"):
                    line = line.split("...", 1)[-1].strip()
                status_map[line.rsplit(suffix, 1)[0]] = "PASSED"
                break
        if " ... skipped" in line:
            status_map[line.split(" ... skipped")[0]] = "SKIPPED"
        if line.endswith(" ... FAIL"):
            status_map[line.split(" ... FAIL")[0]] = "FAILED"
        if line.startswith("FAIL:"):
            status_map[line.split()[1].strip()] = "FAILED"
        if line.endswith(" ... ERROR"):
            status_map[line.split(" ... ERROR")[0]] = "ERROR"
        if line.startswith("ERROR:"):
            status_map[line.split()[1].strip()] = "ERROR"
        if line.lstrip().startswith("ok") and prev_test is not None:
            status_map[prev_test] = "PASSED"
    for pattern in _DJANGO_MULTILINE:
        for match in re.finditer(pattern, log, re.MULTILINE):
            status_map[match.group(1)] = "PASSED"
    return status_map


def parse_seaborn(log: str) -> dict[str, str]:
    status_map = {}
    for line in log.split("\n"):
        parts = line.split()
        if len(parts) < 2:
            continue
        if line.startswith("FAILED"):
            status_map[parts[1]] = "FAILED"
        elif " PASSED " in line:
            if parts[1] == "PASSED":
                status_map[parts[0]] = "PASSED"
        elif line.startswith("PASSED"):
            status_map[parts[1]] = "PASSED"
    return status_map


def parse_sympy(log: str) -> dict[str, str]:
    status_map = {}
    for match in re.findall(r"(_*) (.*)\.py:(.*) (_*)", log):
        status_map[f"{match[1]}.py:{match[2]}"] = "FAILED"
    for line in log.split("\n"):
        line = line.strip()
        if line.startswith("test_"):
            if line.endswith(" E"):
                status_map[line.split()[0]] = "ERROR"
            if line.endswith(" F"):
                status_map[line.split()[0]] = "FAILED"
            if line.endswith(" ok"):
                status_map[line.split()[0]] = "PASSED"
    return status_map


def parse_matplotlib(log: str) -> dict[str, str]:
    return parse_pytest(log.replace("MouseButton.LEFT", "1").replace("MouseButton.RIGHT", "3"))


def parse_swe_smith(log: str) -> dict[str, str]:
    """SWE-smith's Python profile parser (swesmith 0.0.9 `profiles/python.py`,
    PythonProfile.log_parser, MIT licensed): pytest --verbose lines `ID STATUS ...`."""
    status_map = {}
    for line in log.split("\n"):
        for status in ("FAILED", "PASSED", "SKIPPED", "ERROR", "XFAIL"):  # its TestStatus order
            if m := re.match(rf"^(\S+)(\s+){status}", line):
                status_map[m.group(1)] = status
    return status_map


def parse_r2e_gym(log: str) -> dict[str, str]:
    """R2E-Gym's parser (`repo_analysis/execution_log_parser.py` parse_log_pytest, the one
    parse_log_fn gives every repository; Apache-2.0): the statuses of pytest's short test
    summary, each test named by its id after the file (`Class.test`)."""
    status_map: dict[str, str] = {}
    if "short test summary info" not in log:
        return status_map
    for line in log.split("short test summary info")[1].strip().split("\n"):
        if "PASSED" in line:
            status_map[".".join(line.split("::")[1:])] = "PASSED"
        elif "FAILED" in line:
            status_map[".".join(line.split("::")[1:]).split(" - ")[0]] = "FAILED"
        elif "ERROR" in line:
            status_map[".".join(line.split("::")[1:]).split(" - ")[0]] = "ERROR"
    return status_map


PARSERS: dict[str, Callable[[str], dict[str, str]]] = {
    "pytest": parse_pytest, "pytest_options": parse_pytest_options, "pytest_v2": parse_pytest_v2,
    "django": parse_django, "sympy": parse_sympy, "seaborn": parse_seaborn,
    "matplotlib": parse_matplotlib, "swe_smith": parse_swe_smith, "r2e_gym": parse_r2e_gym,
}  # fmt: skip
