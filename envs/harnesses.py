"""Datasets whose image holds the hidden tests (Task.harness), run as their own harnesses run
them, with what no sandbox of the agent's may hold kept out of it.

- **swe-smith** (swesmith 0.0.9, `harness/gather.py`, `harness/utils.py::run_patch_in_container`,
  `profiles/python.py`): the image's /testbed holds the mirror's clean code. The instance's branch
  is that code with the bug committed ("Bug Patch") and then the FAIL_TO_PASS test files deleted
  ("Remove F2P Tests"); the agent starts at its tip, grading restores those files (HEAD~1) over
  the agent's patch and runs the profile's test command, judged by the profile's parser: every
  F2P and P2P test passed. Where the image's repository lacks the branch (SWE-smith fetches it
  from GitHub, which no sandbox here reaches), the branch is made the way gather.py makes it:
  the row's bug patch applied with SWE-smith's GIT_APPLY_CMDS, then the F2P files removed.
  The history the agent sees is one commit (Task.history_mode): the branch's parents are the fix.
- **r2e-gym** (R2E-Gym `agenthub/runtime/docker.py`): the image holds /testbed (the upstream clone,
  its later commits included, and `.venv`), `run_tests.sh` in it and the hidden tests at
  /r2e_tests. The agent's container has neither (removed as root before its first command; the
  history is cut after the base commit); grading links /testbed/r2e_tests to them as setup_env
  does, runs `bash run_tests.sh` and rewards 1 only when the parsed statuses equal
  `expected_output_json` exactly (`_calculate_reward_r2e`).
- **r2e-swebench** (the same runtime on a row whose `docker_image` is a SWE-bench one:
  `setup_env_swebench`, `_calculate_reward_swebench`, `get_logs_eval`, with swebench 3.0.2): the
  image's /testbed at the base commit, its conda `testbed` environment first on PATH; the test run
  is the image's own /run_tests.sh (SWE-bench's eval script: the test patch applied, the test
  files run between the harness's markers). Its log counts for nothing when it holds one of the
  harness's failure markers; otherwise it is read from the test command on (R2E-Gym splits at the
  command; here at the start marker that precedes it, the row's `test_cmd` when it names it) by
  the repository's SWE-bench parser, and the reward is 1 when every FAIL_TO_PASS and
  PASS_TO_PASS test passed (PASSED or XFAIL), one missing, FAILED or ERROR failing it
  (swebench 3.0.2's `get_eval_tests_report`: a SKIPPED test counts neither way). R2E-Gym leaves
  /run_tests.sh in the agent's reach; it holds the hidden test patch, so here the agent's
  container has none.

A row's repository profile comes from the swesmith package (envs/swesmith_profiles.py, which
gives 0.0.9 the swebench 4 names it imports): its test command, and for a language other than
Python its own parser and test-file rule (Go: the `*_test.go` files defining an F2P test's
function, found in the sandbox instead of a clone from GitHub; 0.0.9's other languages remove
no file). The Python profile's parser and test-file rule are followed here line for line (a row
without a profile, e.g. a mirror made here, runs as a Python one).
"""

from __future__ import annotations

import functools
import re
import shlex
import time
from collections.abc import Callable
from dataclasses import asdict

from envs.grading import GradingReport, RewardError, patch_files, report_from_log
from envs import swesmith_profiles
from envs.integrity import Guard, file_of_test
from envs.log_parsers import PARSERS
from envs.task import Task
from sandboxes.base import SandboxError

# swesmith 0.0.9: PythonProfile.test_cmd (ENV_NAME "testbed") and constants.GIT_APPLY_CMDS.
SWE_SMITH_TEST_CMD = ("source /opt/miniconda3/bin/activate; conda activate testbed; "
                      "pytest --disable-warnings --color=no --tb=no --verbose")
SWE_SMITH_APPLY = ("git apply --verbose", "git apply --verbose --reject", "patch --batch --fuzz=5 -p1 -i")
SWE_SMITH_OUTPUT = (">>>>> Start Test Output", ">>>>> End Test Output")
BUG_FILE = "/tmp/.swerve-bug.patch"

R2E_TESTS = "/r2e_tests"
R2E_HIDDEN = ("run_tests.sh", "r2e_tests")
"""What R2E-Gym moves out of the agent's reach (agenthub SKIP_FILES_NEW), relative to /testbed."""
R2E_SWEBENCH_TESTS = "/run_tests.sh"
R2E_SWEBENCH_PATH = ("/opt/miniconda3/envs/testbed/bin",)
"""setup_env_swebench links /root/.venv to the conda environment, first on R2E-Gym's PATH."""
SWEBENCH_FAILURES = (">>>>> Patch Apply Failed", ">>>>> Reset Failed", ">>>>> Tests Errored", ">>>>> Tests Timed Out")
SWEBENCH_START = ">>>>> Start Test Output"
SUMMARY = "short test summary info"
_ANSI = re.compile(r"\x1b\[[0-9;]*m|\r")
_COLOR = re.compile(r"\u001b\[\d+m")


def swe_smith_test_files(tests: list[str]) -> list[str]:
    """PythonProfile.get_test_files: the files of the test ids."""
    return sorted({file_of_test(t) for t in tests})


def remove_paths(task: Task, grading: bool) -> tuple[str, ...]:
    """Paths of the image removed as root before the agent's first command."""
    if task.harness == "r2e-gym" and not grading:
        return (R2E_TESTS,) + tuple(f"{task.repo_dir()}/{p}" for p in R2E_HIDDEN)
    if task.harness == "r2e-swebench" and not grading:
        return (R2E_SWEBENCH_TESTS,)
    return ()


_SMITH_START = r"""
set -e
export GIT_AUTHOR_NAME=swesmith GIT_AUTHOR_EMAIL=swesmith@swesmith.ai GIT_AUTHOR_DATE=2000-01-01T00:00:00Z
export GIT_COMMITTER_NAME=swesmith GIT_COMMITTER_EMAIL=swesmith@swesmith.ai GIT_COMMITTER_DATE=2000-01-01T00:00:00Z
tip=""
for ref in "refs/heads/$ID" "refs/remotes/origin/$ID"; do
  if git rev-parse -q --verify "$ref^{commit}" >/dev/null; then tip=$(git rev-parse "$ref^{commit}"); break; fi
done
if [ -n "$tip" ]; then
  git -c advice.detachedHead=false checkout -q -f "$tip"
  if [ "$(git log -1 --format=%s)" = "Remove F2P Tests" ]; then bug=$(git rev-parse HEAD~1); else bug=$tip; fi
  rm -f "$BUG"
else
  [ -s "$BUG" ] || { echo "the image's repository has no branch $ID and the row no bug patch"; exit 3; }
  git checkout -q -f HEAD && git clean -fdq
  applied=""
  while IFS= read -r cmd; do
    if $cmd "$BUG" >/dev/null 2>&1; then applied=1; break; fi
    git reset -q --hard && git clean -fdq
  done <<EOF
$APPLY
EOF
  rm -f "$BUG"
  [ -n "$applied" ] || { echo "the bug patch does not apply to the image's repository"; exit 4; }
  find . -name '*.orig' -newer .git/HEAD -not -path './.git/*' -delete
  git add -A && git commit -q --no-gpg-sign -m 'Bug Patch'
  bug=$(git rev-parse HEAD)
  for f in $FILES; do rm -f -- "$f"; done
  git add -A
  git diff --cached --quiet || git commit -q --no-gpg-sign -m 'Remove F2P Tests'
  tip=$(git rev-parse HEAD)
fi
echo "$tip $bug"
"""


def swe_smith_parser(task: Task) -> str | Callable[[str], dict[str, str]]:
    """The parser a SWE-smith row's log is read with: the Python profile's (ours, line for line)
    or the row's profile's own."""
    if task.log_parser == swesmith_profiles.PROFILE_PARSER:
        try:
            swesmith_profiles.profile(task.repo)
        except swesmith_profiles.ProfileUnavailable as e:
            raise RewardError(f"{task.instance_id}: {e}") from e
        return functools.partial(swesmith_profiles.parse, task.repo)
    return task.log_parser


async def _f2p_files(sandbox, task: Task, timeout_s: float) -> list[str]:
    """The profile's get_test_files for the F2P tests: the files gather.py removes ("Remove F2P
    Tests"). Python: the files of the test ids; Go: the *_test.go files defining a test's
    function, found in the sandbox's repository (SWE-smith clones the mirror from GitHub);
    swesmith 0.0.9's other profiles remove none."""
    if task.log_parser != swesmith_profiles.PROFILE_PARSER:
        return swe_smith_test_files(task.FAIL_TO_PASS)
    try:
        prof = swesmith_profiles.profile(task.repo)
    except swesmith_profiles.ProfileUnavailable as e:
        raise SandboxError(f"{task.instance_id}: {e}") from e
    if not swesmith_profiles.is_go(prof) or not (script := swesmith_profiles.go_test_files_script(task.FAIL_TO_PASS)):
        return []
    found = await sandbox.execute(script, timeout_s=timeout_s)
    return found.output.split() if found.exit_code in (0, 1) else []


async def swe_smith_start(sandbox, task: Task, grading: bool, timeout_s: float) -> tuple[str, str]:
    """The instance's branch in the sandbox's repository (found, or made as gather.py makes it):
    its tip, where the agent starts, and, for grading, the patch that restores the F2P test
    files (the tip to its parent). Raises RewardError (grading) or SandboxError."""
    if task.bug_patch:
        await sandbox.write_file(BUG_FILE, task.bug_patch if task.bug_patch.endswith("\n") else task.bug_patch + "\n")
    files = " ".join(shlex.quote(f) for f in await _f2p_files(sandbox, task, timeout_s))
    env = (f"ID={shlex.quote(task.instance_id)} BUG={BUG_FILE} FILES={shlex.quote(files)} "
           f"APPLY={shlex.quote(chr(10).join(SWE_SMITH_APPLY))}")
    result = await sandbox.execute(f"{env} bash -c {shlex.quote(_SMITH_START)}", timeout_s=timeout_s)
    if result.exit_code != 0 or len(result.output.split()) < 2:
        raise SandboxError(f"{task.instance_id}: cannot make the SWE-smith starting state: {result.output[-1500:]}")
    tip, bug = result.output.split()[-2:]
    if not grading:
        return tip, ""
    r = await sandbox.execute(f"git diff --binary {tip} {bug}", timeout_s=timeout_s)
    if r.exit_code != 0:
        raise RewardError(f"cannot take the F2P test files of {task.instance_id}: {r.output[-1500:]}", log=r.output)
    return tip, r.output


def swe_smith_test_cmd(task: Task) -> str:
    """run_patch_in_container's eval.sh: the profile's command between SWE-smith's markers."""
    start, end = SWE_SMITH_OUTPUT
    script = (f"set -uxo pipefail\ncd {task.repo_dir()}\n: '{start}'\n{task.test_cmd or SWE_SMITH_TEST_CMD}\n"
              f": '{end}'\n")
    return f"bash -c {shlex.quote(script)} 2>&1"


def swe_smith_log(output: str) -> str:
    """grading.read_test_output: the log between the markers (all of it when they are absent)."""
    start, end = (f"+ : '{m}'" for m in SWE_SMITH_OUTPUT)
    i, j = output.find(start), output.find(end)
    return output[i + len(start):j] if 0 <= i < j else output


def drop_hidden(diff: str, hidden: tuple[str, ...]) -> tuple[str, list[str]]:
    """`diff` without its files at or under `hidden` (paths in the repository), and those files."""
    kept, dropped = [], []
    for part in re.split(r"(?m)^(?=diff --git )", diff):
        files = patch_files(part)
        if files and any(f == h or f.startswith(h + "/") for f in files for h in hidden):
            dropped.extend(files)
        else:
            kept.append(part)
    return "".join(kept), sorted(set(dropped))


def r2e_compare(parsed: dict[str, str], expected: dict[str, str]) -> bool:
    """_calculate_reward_r2e's rule: the same tests (keys decolored and cut at ' - '), each with
    the same status."""
    def norm(statuses: dict[str, str]) -> dict[str, str]:
        plain = {_COLOR.sub("", k): v for k, v in statuses.items()}
        return {k.split(" - ")[0]: plain[k] for k in sorted(plain)}

    got, want = norm(parsed), norm(expected)
    return len(got) == len(want) and all(want.get(k) == v for k, v in got.items())


def _one_summary(report: GradingReport, log: str) -> None:
    """No pass for a log with more than one pytest "short test summary info"."""
    if (summaries := log.count(SUMMARY)) > 1:
        report.guards.append(asdict(Guard("conflicting_results", f"{summaries} test summaries in one log")))
        report.resolution = "NO"


async def r2e_grade(sandbox, task: Task, timeout_s: float) -> GradingReport:
    """The hidden tests linked in as setup_env links them, run_tests.sh run, the statuses
    compared with expected_output exactly."""
    repo = task.repo_dir()
    link = await sandbox.execute(f"[ -e r2e_tests ] || ln -s {R2E_TESTS} r2e_tests", timeout_s=60)
    if link.exit_code != 0:
        raise RewardError(f"cannot link the hidden tests into {repo}: {link.output[-500:]}", log=link.output)
    started = time.monotonic()
    result = await sandbox.execute("bash run_tests.sh 2>&1", timeout_s=timeout_s)
    if result.timed_out:
        raise RewardError(f"tests did not finish within {timeout_s} s", kind="test_timeout", log=result.output)
    log = _ANSI.sub("", result.output)
    report = report_from_log(log, "r2e_gym", task.FAIL_TO_PASS, task.PASS_TO_PASS)
    match = r2e_compare(report.tests, task.expected_output or {})
    report.resolution = "FULL" if match and task.expected_output else "NO"
    _one_summary(report, log)  # the parser reads the first: a printed one would win
    report.test_exit_code, report.duration_s = result.exit_code, time.monotonic() - started
    return report


def swebench3_report(statuses: dict[str, str], tests: list[str]) -> dict[str, list[str]]:
    """swebench 3.0.2's test_passed / test_failed over `tests`: passed when PASSED or XFAIL,
    failed when missing, FAILED or ERROR (a SKIPPED test is neither)."""
    return {"success": [t for t in tests if statuses.get(t) in ("PASSED", "XFAIL")],
            "failure": [t for t in tests if t not in statuses or statuses[t] in ("FAILED", "ERROR")]}


def r2e_swebench_log(output: str, test_cmd: str | None) -> str | None:
    """get_logs_eval of R2E-Gym: None when the log holds a failure marker, else the log from the
    test command on (its last mention; the start marker's when the command is not known)."""
    if any(marker in output for marker in SWEBENCH_FAILURES):
        return None
    cut = test_cmd if test_cmd and test_cmd in output else SWEBENCH_START
    return output.split(cut)[-1]


async def r2e_swebench_grade(sandbox, task: Task, timeout_s: float) -> GradingReport:
    """The image's /run_tests.sh run, its log read by the repository's parser, FULL when every
    FAIL_TO_PASS and PASS_TO_PASS test passed."""
    started = time.monotonic()
    result = await sandbox.execute(f"bash {R2E_SWEBENCH_TESTS} 2>&1", timeout_s=timeout_s)
    if result.timed_out:
        raise RewardError(f"tests did not finish within {timeout_s} s", kind="test_timeout", log=result.output)
    output = _ANSI.sub("", result.output)
    log = r2e_swebench_log(output, task.test_cmd)
    statuses = PARSERS[task.log_parser](log) if log is not None else {}
    f2p, p2p = swebench3_report(statuses, task.FAIL_TO_PASS), swebench3_report(statuses, task.PASS_TO_PASS)
    full = log is not None and not f2p["failure"] and not p2p["failure"]
    report = GradingReport(resolution="FULL" if full else "NO", fail_to_pass=f2p, pass_to_pass=p2p, tests=statuses,
                           test_exit_code=result.exit_code, log_tail=output[-4000:], log=output,
                           duration_s=time.monotonic() - started)
    if log is not None:
        _one_summary(report, log)  # a second one printed by the code under test
    return report


_HUNK = re.compile(r"^@@ -(\d+(?:,\d+)?) \+(\d+(?:,\d+)?) @@(.*)$")
_SWAPPED = (("--- ", "+++ "), ("new file mode ", "deleted file mode "), ("rename from ", "rename to "),
            ("copy from ", "copy to "), ("old mode ", "new mode "))


def reverse_patch(diff: str) -> str:
    """The inverse of a text git diff (what `git apply --reverse` applies): SWE-smith's gold fix
    from its bug patch. Raises ValueError on a binary patch."""
    out: list[str] = []
    lines = diff.splitlines(keepends=True)
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("GIT binary patch") or line.startswith("Binary files "):
            raise ValueError("a binary patch cannot be reversed as text")
        if line.startswith("diff --git "):
            m = re.match(r"^diff --git a/(\S+) b/(\S+)(\r?\n?)$", line)
            out.append(f"diff --git a/{m.group(2)} b/{m.group(1)}{m.group(3)}" if m else line)
        elif line.startswith("index ") and ".." in line:
            head, _, rest = line[6:].partition(" ")
            old, new = head.rstrip("\n").split("..", 1)
            out.append(f"index {new}..{old}" + (f" {rest}" if rest else "\n"))
        elif any(line.startswith(a) or line.startswith(b) for a, b in _SWAPPED):
            # a pair swaps whole: `--- a` with `+++ b`, `old mode` with `new mode`
            pair = next((a, b) for a, b in _SWAPPED if line.startswith(a) or line.startswith(b))
            if line.startswith(pair[0]) and i + 1 < len(lines) and lines[i + 1].startswith(pair[1]):
                first, second = lines[i][len(pair[0]):], lines[i + 1][len(pair[1]):]
                if pair[0] == "--- ":
                    first, second = _swap_prefix(first, "a/", "b/"), _swap_prefix(second, "b/", "a/")
                out += [pair[0] + second, pair[1] + first]
                i += 2
                continue
            a, b = pair
            out.append(b + line[len(a):] if line.startswith(a) else a + line[len(b):])
        elif m := _HUNK.match(line.rstrip("\r\n")):
            out.append(f"@@ -{m.group(2)} +{m.group(1)} @@{m.group(3)}" + line[len(line.rstrip("\r\n")):])
            old_left, new_left = (int(r.split(",")[1]) if "," in r else 1 for r in (m.group(1), m.group(2)))
            i += 1
            while i < len(lines) and (old_left > 0 or new_left > 0 or lines[i].startswith("\\")):
                body = lines[i]
                kind = body[:1]
                if kind == "-":
                    old_left -= 1
                    body = "+" + body[1:]
                elif kind == "+":
                    new_left -= 1
                    body = "-" + body[1:]
                elif kind in (" ", "\n", "\r"):
                    old_left, new_left = old_left - 1, new_left - 1
                elif kind != "\\":
                    raise ValueError(f"a hunk line starts with {kind!r}, not ' ', '+', '-' or '\\'")
                out.append(body)
                i += 1
            continue
        else:
            out.append(line)
        i += 1
    return "".join(out)


def _swap_prefix(path: str, old: str, new: str) -> str:
    return new + path[len(old):] if path.startswith(old) else path


def r2e_gold_patch(parsed_commit: dict) -> str:
    """ParsedCommit.get_patch(test_file=False, non_test_file=True) of R2E-Gym
    (`commit_models/diff_classes.py`): the commit's diff of its non-test files."""
    patch = ""
    for fd in parsed_commit.get("file_diffs", []):
        path = fd["header"]["file"]["path"]
        parts = path.split("/")
        if (path.endswith("_test.py") or path.startswith("test_") or parts[-1].startswith("test_")
                or {"tests", "Tests", "test", "Test"} & set(parts)):
            continue  # FileDiff.is_test_file
        patch += f"diff --git a/{path} b/{path}\n"
        if fd["header"].get("misc_line"):
            patch += fd["header"]["misc_line"] + "\n"
        if index := fd.get("index_line"):
            mode = index.get("mode") or ""
            patch += f"index {index['old_commit_hash']}..{index['new_commit_hash']}{' ' if mode else ''}{mode}\n"
        if fd.get("is_binary_file"):
            patch += (fd.get("binary_line") or "") + "\n"
        if fd.get("minus_file") and fd.get("plus_file"):
            patch += f"--- {fd['minus_file']['path']}\n+++ {fd['plus_file']['path']}\n"
        for hunk in fd.get("hunks", []):
            d = hunk["descriptor"]

            def rng(r: dict) -> str:
                return f"{r['start']}" if r.get("length") is None else f"{r['start']},{r['length']}"

            patch += f"@@ -{rng(d['old_range'])} +{rng(d['new_range'])} @@" + (f" {d['section']}" if d.get("section") else "") + "\n"
            for line in hunk["line_group"]["all_lines"]:
                prefix = {"context": " ", "added": "+", "deleted": "-", "note": "\\ "}[line["type"]]
                patch += f"{prefix}{line['content']}\n"
    return patch
