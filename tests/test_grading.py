"""Grading equals SWE-bench's: the same logs through its parsers and resolution logic and
through ours give identical statuses and resolutions (differential test), plus the pure rules."""

from __future__ import annotations

import random

import pytest
from swebench.harness import grading as sb_grading
from swebench.harness.constants import FAIL_TO_PASS, PASS_TO_PASS
from swebench.harness.log_parsers import python as sb

from envs.grading import report_from_log, resolution
from envs.grading import tests_report as eval_tests_report
from envs.log_parsers import PARSERS

SB_PARSERS = {"pytest": sb.parse_log_pytest, "pytest_options": sb.parse_log_pytest_options,
              "pytest_v2": sb.parse_log_pytest_v2, "django": sb.parse_log_django,
              "sympy": sb.parse_log_sympy, "seaborn": sb.parse_log_seaborn,
              "matplotlib": sb.parse_log_matplotlib}
STATUSES = ["PASSED", "FAILED", "SKIPPED", "ERROR", "XFAIL"]
PARAMS = ["1", "a b", "x-[y]", "/tmp/data/file.txt", "//net", "unicodé", "*glob*", "MouseButton.LEFT",
          "log(photon", "a - b", "1.5e-3", ""]


def pytest_id(rng: random.Random) -> str:
    name = f"tests/test_{rng.choice(['io', 'core', 'utils'])}.py::{rng.choice(['', 'TestThing::'])}test_{rng.randint(0, 40)}"
    if rng.random() < 0.5:
        name += f"[{rng.choice(PARAMS)}]"
    return name


def pytest_log(rng: random.Random) -> tuple[str, list[str]]:
    ids, lines = [], ["============================= test session starts ==============================",
                      "collected 42 items", "tests/test_io.py ..F.s                                   [ 40%]"]
    for _ in range(rng.randint(1, 40)):
        tid, status = pytest_id(rng), rng.choice(STATUSES)
        ids.append(tid)
        line = f"{status} {tid}"
        if status == "FAILED" and rng.random() < 0.6:
            line += f" - AssertionError: assert {rng.randint(0, 9)} == {rng.randint(0, 9)} - extra"
        if rng.random() < 0.1:
            line = f"\x1b[32m{line}\x1b[0m"
        if rng.random() < 0.1:
            line = f"{tid} {status}"
        lines.append(line)
    if rng.random() < 0.3:
        lines.append("SKIPPED [2] tests/test_io.py:12: needs network")
    if rng.random() < 0.2:
        lines.append("PASSED [100%]")
    lines.append(f"=========== {rng.randint(0, 9)} failed, {rng.randint(0, 9)} passed in 0.12s ===========")
    return "\n".join(lines), ids


def django_log(rng: random.Random) -> tuple[str, list[str]]:
    ids, lines = [], []
    for i in range(rng.randint(1, 30)):
        tid = f"test_{i} (app.tests.{rng.choice(['Model', 'View'])}Tests)"
        ids.append(tid)
        kind = rng.random()
        if kind < 0.4:
            lines.append(f"{tid} ... ok")
        elif kind < 0.5:
            lines += [f"{tid} ... Testing against Django installed in '/x' with up to 8 processes", "ok"]
        elif kind < 0.6:
            lines.append(f"{tid} ... skipped 'no db'")
        elif kind < 0.8:
            lines += [f"{tid} ... FAIL", "", f"FAIL: {tid}"]
        else:
            lines += [f"{tid} ... ERROR", f"ERROR: {tid}"]
    return "\n".join(lines), ids


def sympy_log(rng: random.Random) -> tuple[str, list[str]]:
    ids, lines = [], []
    for i in range(rng.randint(1, 30)):
        tid = f"test_thing_{i}"
        ids.append(tid)
        lines.append(f"{tid} {rng.choice(['ok', 'F', 'E', 'f'])}")
    if rng.random() < 0.3:
        lines.append("________________ sympy/core/tests/test_basic.py:test_thing_3 ________________")
        ids.append("sympy/core/tests/test_basic.py:test_thing_3")
    return "\n".join(lines), ids


def corpus(n: int = 300):
    rng = random.Random(1234)
    for i in range(n):
        make = [pytest_log, django_log, sympy_log][i % 3]
        log, ids = make(rng)
        parsers = {"pytest_log": ["pytest", "pytest_options", "pytest_v2", "seaborn", "matplotlib"],
                   "django_log": ["django"], "sympy_log": ["sympy"]}[make.__name__]
        yield i, log, ids, parsers, rng


def lists(rng: random.Random, ids: list[str]) -> tuple[list[str], list[str]]:
    pool = list(dict.fromkeys(ids)) + ["tests/test_missing.py::test_gone", "tests/test_io.py::test_1[log(photon"]
    rng.shuffle(pool)
    k = rng.randint(1, max(1, len(pool) // 2))
    return pool[:k], pool[k : k + rng.randint(0, len(pool) - k)]


def test_parsers_and_resolution_match_swebench_on_every_log():
    checked = 0
    for i, log, ids, parsers, rng in corpus():
        for parser in parsers:
            ours, theirs = PARSERS[parser](log), SB_PARSERS[parser](log, None)
            assert ours == theirs, (i, parser)
            f2p, p2p = lists(rng, ids)
            our_f2p, our_p2p = eval_tests_report(ours, f2p, p2p)
            sb_report = sb_grading.get_eval_tests_report(theirs, {FAIL_TO_PASS: f2p, PASS_TO_PASS: p2p})
            assert (our_f2p, our_p2p) == (sb_report[FAIL_TO_PASS], sb_report[PASS_TO_PASS]), (i, parser)
            assert "RESOLVED_" + resolution(our_f2p, our_p2p) == sb_grading.get_resolution_status(sb_report), (i, parser)
            checked += 1
    assert checked > 600


PASS_LOG = "PASSED tests/test_a.py::test_fix\nPASSED tests/test_a.py::test_keep[a b]\n"


@pytest.mark.parametrize(("log", "parser", "expected", "reward"), [
    (PASS_LOG, "pytest_v2", "FULL", 1.0),
    ("FAILED tests/test_a.py::test_fix - boom\nPASSED tests/test_a.py::test_keep[a b]\n", "pytest_v2", "NO", 0.0),
    ("PASSED tests/test_a.py::test_fix\nFAILED tests/test_a.py::test_keep[a b]\n", "pytest_v2", "NO", 0.0),
    ("PASSED tests/test_a.py::test_keep[a b]\n", "pytest_v2", "NO", 0.0),  # F2P absent from the log
    ("SKIPPED tests/test_a.py::test_fix\nPASSED tests/test_a.py::test_keep[a b]\n", "pytest_v2", "NO", 0.0),
])
def test_reward_from_log(log, parser, expected, reward):
    report = report_from_log(log, parser, ["tests/test_a.py::test_fix"], ["tests/test_a.py::test_keep[a b]"])
    assert (report.resolution, report.reward()) == (expected, reward)


def test_partial_resolution_and_partial_credit():
    log = "PASSED t::a\nFAILED t::b\nPASSED t::keep\n"
    report = report_from_log(log, "pytest", ["t::a", "t::b"], ["t::keep"])
    assert report.resolution == "PARTIAL"
    assert (report.reward(), report.reward(partial_credit=True)) == (0.0, 0.5)
