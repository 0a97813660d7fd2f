"""SWE-smith and R2E-Gym rows as they ship (envs/harnesses.py), in images built here under the
datasets' names and layouts (no registry is reachable): a generated task's repository at /testbed,
SWE-smith's conda stand-in or R2E-Gym's `.venv`, `run_tests.sh` and /r2e_tests, or for R2E-Gym's
SWE-bench rows a conda stand-in and SWE-bench's eval script at /run_tests.sh. The agent starts
where the dataset's harness starts it, with the hidden tests and the fix out of its reach; gold is
FULL, empty NO, and the ways around the tests an agent could try are not a pass."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from envs import datasets
from envs.grading import patch_files
from envs.harnesses import drop_hidden, r2e_compare, reverse_patch
from envs.log_parsers import parse_r2e_gym, parse_swe_smith
from envs.swe_env import SWEEnvConfig, grade, task_sandbox
from envs.task import Task
from sandboxes.base import SandboxError
from tests.dataset_images import generated_task, git, image_with, pytest_files, pytest_id, touched_tests
from tests.sandbox_fixtures import require_docker

CONDA_ACTIVATE = ('conda() { [ "$1" = activate ] && export PATH="/opt/miniconda3/envs/$2/bin:$PATH" '
                  'PYTHONPATH="/opt/miniconda3/envs/$2/site"; }\n')


# -- without a sandbox ------------------------------------------------------------------------

def test_a_reversed_patch_undoes_the_patch(tmp_path):
    repo = tmp_path / "r"
    repo.mkdir()
    git(repo, "init", "-q")
    (repo / "a.py").write_text("one\n-- two\nthree\n")
    (repo / "gone.py").write_text("x = 1\n")
    (repo / "tail.txt").write_text("no newline")
    (repo / "run.sh").write_text("echo\n")
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", "base")
    (repo / "a.py").write_text("one\n--- two, changed\n+++ three\n")
    (repo / "gone.py").unlink()
    (repo / "new.py").write_text("y = 2\n")
    (repo / "tail.txt").write_text("still none, changed")
    (repo / "run.sh").chmod(0o755)
    git(repo, "add", "-A")
    forward = git(repo, "diff", "--cached")
    git(repo, "commit", "-qm", "changed")
    back = reverse_patch(forward)
    git(repo, "apply", "--check", "-", input=back)
    git(repo, "apply", "-", input=back)
    git(repo, "add", "-A")
    assert git(repo, "diff", "--cached", "HEAD~1") == ""
    assert reverse_patch(back) == forward
    with pytest.raises(ValueError, match="binary"):
        reverse_patch("diff --git a/x b/x\nGIT binary patch\nliteral 0\n")


def test_the_parsers_read_their_harnesses_logs():
    verbose = ("tests/test_a.py::T::test_x PASSED                [ 50%]\n"
               "tests/test_a.py::T::test_y FAILED                [100%]\n")
    assert parse_swe_smith(verbose) == {"tests/test_a.py::T::test_x": "PASSED", "tests/test_a.py::T::test_y": "FAILED"}
    summary = ("PASSED r2e_tests/test_1.py::not_summary\n=== short test summary info ===\n"
               "PASSED r2e_tests/test_1.py::TestA::test_x\nFAILED r2e_tests/test_2.py::test_y - AssertionError\n")
    assert parse_r2e_gym(summary) == {"TestA.test_x": "PASSED", "test_y": "FAILED"}
    assert r2e_compare({"\x1b[1mtest_y\x1b[0m": "FAILED", "TestA.test_x": "PASSED"},
                       {"TestA.test_x": "PASSED", "test_y": "FAILED"})
    assert not r2e_compare({"TestA.test_x": "PASSED"}, {"TestA.test_x": "PASSED", "test_y": "FAILED"})
    assert not r2e_compare({"TestA.test_x": "PASSED", "test_y": "PASSED"}, {"TestA.test_x": "PASSED", "test_y": "FAILED"})
    diff = ("diff --git a/r2e_tests/conftest.py b/r2e_tests/conftest.py\n+x\n"
            "diff --git a/src.py b/src.py\n+y\ndiff --git a/run_tests.sh b/run_tests.sh\n+z\n")
    kept, dropped = drop_hidden(diff, ("run_tests.sh", "r2e_tests"))
    assert kept == "diff --git a/src.py b/src.py\n+y\n" and dropped == ["r2e_tests/conftest.py", "run_tests.sh"]


def test_rows_name_what_they_lack():
    row = {"instance_id": "o__r.abcdef12.x", "repo": "swesmith/o__r.abcdef12", "patch": "", "FAIL_TO_PASS": ["t.py::a"],
           "PASS_TO_PASS": [], "image_name": "i", "problem_statement": "p"}
    with pytest.raises(datasets.DatasetRowError, match="patch: missing") as info:
        datasets.adapt(row, "swe-smith")
    assert info.value.field == "patch"
    with pytest.raises(datasets.DatasetRowError, match="test_cmd: missing"):
        datasets.adapt(row | {"patch": "diff --git a/x b/x\n", "FAIL_TO_PASS": ["TestFoo"]}, "swe-smith")
    r2e = {"repo_name": "aiohttp", "docker_image": "namanjain12/aiohttp_final:f0", "problem_statement": "x",
           "expected_output_json": "{}", "parsed_commit_content": "{}"}
    with pytest.raises(datasets.DatasetRowError, match="expected_output_json: empty"):
        datasets.adapt(r2e)
    with pytest.raises(datasets.DatasetRowError, match="parsed_commit_content: not JSON"):
        datasets.adapt(r2e | {"parsed_commit_content": "{"})


# -- rows in their images ---------------------------------------------------------------------

def parsed_commit(diff: str, old: str, new: str) -> dict:
    """A git diff in R2E-Gym's ParsedCommit shape (commit_models/diff_classes.py)."""
    files = []
    for part in re.split(r"(?m)^(?=diff --git )", diff):
        if not part.strip():
            continue
        lines = part.splitlines()
        path = lines[0].split(" b/", 1)[1]
        fd = {"old_file_content": "", "new_file_content": "", "header": {"file": {"path": path}, "misc_line": None},
              "hunks": []}
        for line in lines[1:]:
            if line.startswith("new file mode"):
                fd["header"]["misc_line"] = line
            elif line.startswith("index "):
                h, _, mode = line[6:].partition(" ")
                a, b = h.split("..")
                fd["index_line"] = {"old_commit_hash": a, "new_commit_hash": b, "mode": mode}
            elif line.startswith("--- "):
                fd["minus_file"] = {"path": line[4:]}
            elif line.startswith("+++ "):
                fd["plus_file"] = {"path": line[4:]}
            elif m := re.match(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@ ?(.*)$", line):
                rng = lambda s, n: {"start": int(s), "length": None if n is None else int(n)}  # noqa: E731
                fd["hunks"].append({"descriptor": {"old_range": rng(m[1], m[2]), "new_range": rng(m[3], m[4]),
                                                   "section": m[5]}, "line_group": {"all_lines": []}})
            else:
                kind = {" ": "context", "+": "added", "-": "deleted", "\\": "note"}[line[:1]]
                fd["hunks"][-1]["line_group"]["all_lines"].append({"content": line[2:] if kind == "note" else line[1:],
                                                                   "type": kind})
        files.append(fd)
    return {"file_diffs": files, "old_commit_hash": old, "new_commit_hash": new, "commit_message": "fix",
            "commit_date": "2024-01-01T00:00:00", "metadata": {}}


@pytest.fixture(scope="module")
def smith(tmp_path_factory):
    """A SWE-smith row and two images of its mirror: one whose clone has the instance's branch
    (origin/<id>, as SWE-smith's images clone it), one without (the branch then made here)."""
    client = require_docker()
    tmp = tmp_path_factory.mktemp("smith")
    row, repo = generated_task(tmp, 13)
    mirror = tmp / "mirror"
    mirror.mkdir()
    subprocess.run(f"git -C {repo} archive HEAD | tar -x -C {mirror}", shell=True, check=True)
    git(mirror, "init", "-q", "-b", "main")
    git(mirror, "apply", "-", input=row["patch"])
    git(mirror, "apply", "-", input=row["test_patch"])
    git(mirror, "add", "-A")
    git(mirror, "commit", "-qm", "Initial commit")
    git(mirror, "apply", "-R", "-", input=row["patch"])
    bug = git(mirror, "diff")
    git(mirror, "checkout", "--", ".")
    c8 = git(mirror, "rev-parse", "HEAD")[:8]
    owner, name = row["repo"].split("/")
    iid = f"{owner}__{name}.{c8}.func_pm_op_swap__k3x9q2"
    f2p, p2p = [pytest_id(t) for t in row["FAIL_TO_PASS"]], [pytest_id(t) for t in row["PASS_TO_PASS"]]
    with_branch = tmp / "with-branch"
    shutil.copytree(mirror, with_branch)
    git(with_branch, "checkout", "-q", "-b", iid)
    git(with_branch, "apply", "-", input=bug)
    git(with_branch, "add", "-A")
    git(with_branch, "commit", "-qm", "Bug Patch")
    for f in sorted({t.split("::")[0] for t in f2p}):
        (with_branch / f).unlink()
    git(with_branch, "add", "-A")
    git(with_branch, "commit", "-qm", "Remove F2P Tests")
    git(with_branch, "checkout", "-q", "main")
    images = {}
    for kind, source in (("branch", with_branch), ("no-branch", mirror)):
        testbed = tmp / f"testbed-{kind}"
        subprocess.run(["git", "clone", "-q", str(source), str(testbed)], check=True)
        images[kind] = image_with(
            client, datasets.swe_smith_image(f"swesmith/{owner}__{name}.{c8}") + f":{kind}",
            trees=[("/testbed", testbed)] + pytest_files("/opt/miniconda3/envs/testbed/site"),
            files={"/opt/miniconda3/bin/activate": CONDA_ACTIVATE,
                   "/opt/miniconda3/envs/testbed/bin/pytest": '#!/bin/sh\nexec python3 -m pytest "$@"\n'})
    shipped = {"instance_id": iid, "repo": f"swesmith/{owner}__{name}.{c8}", "patch": bug, "FAIL_TO_PASS": f2p,
               "PASS_TO_PASS": p2p, "image_name": images["no-branch"], "problem_statement": row["problem_statement"]}
    clean_blob = git(mirror, "rev-parse", f"HEAD:{[p for p in patch_files(bug)][0]}").strip()
    yield {"row": shipped, "images": images, "clean_blob": clean_blob, "bug": bug}
    for image in images.values():
        client.images.remove(image, force=True)


def config(tmp_path, **kw) -> SWEEnvConfig:
    return SWEEnvConfig(backend="docker", image_cache_dir=tmp_path / "images", **kw)


@pytest.mark.slow
@pytest.mark.docker
async def test_a_swe_smith_row_starts_at_its_branch_tip_with_nothing_of_the_answer(smith, tmp_path):
    trees = {}
    for kind, image in smith["images"].items():
        task = Task.model_validate(datasets.adapt(smith["row"] | {"image_name": image}))
        assert (task.harness, task.repo_dir(), task.log_parser, task.history_mode()) == ("swe-smith", "/testbed",
                                                                                          "swe_smith", "none")
        f2p_files = sorted({t.split("::")[0] for t in task.FAIL_TO_PASS})
        async with task_sandbox(task, config(tmp_path)) as sandbox:
            r = await sandbox.execute("git log --all --format=%s; git status --porcelain; ls /tmp/.swerve-bug.patch "
                                      f"{' '.join(f2p_files)} 2>&1 | grep -c 'No such'; "
                                      f"git cat-file -e {smith['clean_blob']} 2>/dev/null && echo CLEAN-FOUND; "
                                      "git rev-parse 'HEAD^{tree}'")
            lines = r.output.split()
            assert lines[:2] == ["base", str(1 + len(f2p_files))] and "CLEAN-FOUND" not in r.output, r.output
            trees[kind] = lines[-1]
            bug_line = next(line[1:] for line in smith["bug"].splitlines() if line.startswith("+") and
                            not line.startswith("+++"))
            assert (await sandbox.execute(f"git grep -qF {shlex.quote(bug_line.strip())} && echo BUG")).output.strip() == "BUG"
    assert trees["branch"] == trees["no-branch"], trees  # made here, the branch is SWE-smith's own


@pytest.mark.slow
@pytest.mark.docker
async def test_a_swe_smith_row_grades_by_its_profile_gold_full_empty_no(smith, tmp_path):
    for image in smith["images"].values():
        task = Task.model_validate(datasets.adapt(smith["row"] | {"image_name": image}))
        gold = await grade(task, task.patch, config(tmp_path))
        assert gold.resolution == "FULL", gold.log_tail
        assert sorted(gold.fail_to_pass["success"]) == sorted(task.FAIL_TO_PASS)
        assert set(task.PASS_TO_PASS) <= set(gold.tests)
        empty = await grade(task, "", config(tmp_path))
        assert empty.resolution == "NO" and sorted(empty.fail_to_pass["failure"]) == sorted(task.FAIL_TO_PASS)


@pytest.mark.slow
@pytest.mark.docker
async def test_writing_the_hidden_f2p_tests_earns_nothing(smith, tmp_path):
    task = Task.model_validate(datasets.adapt(smith["row"]))
    [f2p_file] = sorted({t.split("::")[0] for t in task.FAIL_TO_PASS})
    methods = sorted({t.rsplit("::", 1)[1] for t in task.FAIL_TO_PASS})
    cls = task.FAIL_TO_PASS[0].split("::")[1]
    body = "import unittest\n\n\nclass %s(unittest.TestCase):\n" % cls + "".join(
        f"    def {m}(self):\n        pass\n" for m in methods)
    lines = body.splitlines()
    forged = (f"diff --git a/{f2p_file} b/{f2p_file}\nnew file mode 100644\n--- /dev/null\n+++ b/{f2p_file}\n"
              f"@@ -0,0 +1,{len(lines)} @@\n" + "".join(f"+{line}\n" for line in lines))
    report = await grade(task, forged, config(tmp_path))
    assert report.resolution == "NO" and {"guard": "reverted", "detail": f2p_file} in report.guards, report.guards


def upstream_clone(tmp, seed: int) -> tuple[dict, Path, str, str]:
    """A generated task's repository as an upstream clone holds it: the fix (code and tests)
    committed after the base commit, checked out. Returns (row, repo, base commit, fix commit)."""
    row, repo = generated_task(tmp, seed)
    git(repo, "checkout", "-q", "-b", "upstream")
    git(repo, "apply", "-", input=row["patch"])
    git(repo, "apply", "-", input=row["test_patch"])
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", "fix the bug")
    return row, repo, row["base_commit"], git(repo, "rev-parse", "HEAD").strip()


@pytest.fixture(scope="module")
def r2e(tmp_path_factory):
    """An R2E-Gym row and its image: /testbed the upstream clone (the fix among its commits),
    checked out at the old commit, with `.venv` and run_tests.sh; the hidden tests at /r2e_tests,
    one of them failing before and after the fix, as expected_output_json records it."""
    client = require_docker()
    row, repo, old, new = upstream_clone(tmp_path_factory.mktemp("r2e"), 17)
    tests = {f"/r2e_tests/test_{i}.py": (repo / f).read_text()
             for i, f in enumerate(sorted({t.split("::")[0] for t in map(pytest_id, row["FAIL_TO_PASS"] + row["PASS_TO_PASS"])}), 1)}
    tests["/r2e_tests/test_9.py"] = "def test_known_failure():\n    assert 1 == 2\n"
    git(repo, "checkout", "-q", old)
    expected = {".".join(pytest_id(t).split("::")[1:]): "PASSED" for t in row["FAIL_TO_PASS"] + row["PASS_TO_PASS"]}
    forged = "short test summary info\\n" + "".join(f"{s} r2e_tests/test_1.py::{t.replace('.', '::')}\\n"
                                                    for t, s in (expected | {"test_known_failure": "FAILED"}).items())
    module = repo / patch_files(row["patch"])[0]
    text = module.read_text()
    module.write_text(f"import os\nos.write(os.open('/proc/%d/fd/1' % os.getppid(), os.O_WRONLY), b'{forged}')\n" + text)
    forge = git(repo, "diff")
    module.write_text(text)
    version = client.containers.run(require_base(client), ["python3", "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                                    remove=True).decode().strip()
    site = f"/testbed/.venv/lib/python{version}/site-packages"
    name = row["repo"].split("/")[1]
    image = image_with(client, f"namanjain12/{name}_final:{new[:12]}",
                       trees=[("/testbed", repo)] + pytest_files(site),
                       files={**tests, "/testbed/run_tests.sh": "#!/bin/bash\n.venv/bin/python -W ignore -m pytest -rA r2e_tests\n",
                              "/testbed/.venv/pyvenv.cfg": f"home = /usr/bin\ninclude-system-site-packages = false\nversion = {version}\n"},
                       links={"/testbed/.venv/bin/python": "/usr/bin/python3"})
    f2p = [".".join(pytest_id(t).split("::")[1:]) for t in row["FAIL_TO_PASS"]]
    p2p = [".".join(pytest_id(t).split("::")[1:]) for t in row["PASS_TO_PASS"]]

    def summary(statuses: dict[str, str]) -> str:
        return "=== short test summary info ===\n" + "".join(f"{s} r2e_tests/test_x.py::{t.replace('.', '::')}\n"
                                                            for t, s in statuses.items())

    known = {"test_known_failure": "FAILED"}
    shipped = {"repo_name": name, "docker_image": image, "commit_hash": new, "problem_statement":
               f"[ISSUE]{row['problem_statement']}[/ISSUE]", "modified_files": patch_files(row["patch"]),
               "parsed_commit_content": json.dumps(parsed_commit(row["patch"] + row["test_patch"], old, new)),
               "execution_result_content": json.dumps({
                   "old_commit_res_stdout": summary({t: "FAILED" for t in f2p} | {t: "PASSED" for t in p2p} | known),
                   "new_commit_res_stdout": summary({t: "PASSED" for t in f2p + p2p} | known)}),
               "expected_output_json": json.dumps({t: "PASSED" for t in f2p + p2p} | known)}
    yield {"row": shipped, "new": new, "old": old, "f2p": f2p, "p2p": p2p, "gold": row["patch"], "forge": forge}
    client.images.remove(image, force=True)


def require_base(client) -> str:
    from sandboxes.images import BASE_IMAGE, ensure_base_image

    return ensure_base_image(client, BASE_IMAGE)


@pytest.mark.slow
@pytest.mark.docker
async def test_an_r2e_row_starts_without_its_hidden_tests_or_later_commits(r2e, tmp_path):
    task = Task.model_validate(datasets.adapt(r2e["row"]))
    assert (task.base_commit, task.harness, task.image) == (r2e["old"], "r2e-gym", r2e["row"]["docker_image"])
    assert sorted(task.FAIL_TO_PASS) == sorted(r2e["f2p"]) and sorted(task.PASS_TO_PASS) == sorted(r2e["p2p"])
    assert task.patch == r2e["gold"] and "[ISSUE]" not in task.problem_statement
    async with task_sandbox(task, config(tmp_path)) as sandbox:
        r = await sandbox.execute(f"pwd; ls -a / . | grep -c -e r2e_tests -e run_tests; git cat-file -e {r2e['new']} "
                                  "2>/dev/null && echo FIX-FOUND; git status --porcelain; "
                                  ".venv/bin/python -c 'import pytest; print(\"venv-ok\")'")
        assert r.output.split() == ["/testbed", "0", "venv-ok"], r.output
    with pytest.raises(SandboxError, match="docker backend"):
        async with task_sandbox(task, SWEEnvConfig(backend="bwrap", image_cache_dir=tmp_path / "images")):
            pass


@pytest.mark.slow
@pytest.mark.docker
async def test_an_r2e_row_is_rewarded_by_exact_match(r2e, tmp_path):
    task = Task.model_validate(datasets.adapt(r2e["row"]))
    gold = await grade(task, task.patch, config(tmp_path))
    assert gold.resolution == "FULL" and gold.tests.get("test_known_failure") == "FAILED", gold.log_tail
    empty = await grade(task, "", config(tmp_path))
    assert empty.resolution == "NO" and sorted(empty.fail_to_pass["failure"]) == sorted(task.FAIL_TO_PASS)
    wrong = task.model_copy(update={"expected_output": task.expected_output | {"test_known_failure": "PASSED"}})
    assert (await grade(wrong, task.patch, config(tmp_path))).resolution == "NO"  # exact: a status off is 0


@pytest.mark.slow
@pytest.mark.docker
async def test_an_r2e_agent_cannot_reach_the_hidden_tests_or_forge_their_summary(r2e, tmp_path):
    task = Task.model_validate(datasets.adapt(r2e["row"]))
    passing = ("import pytest\n\n\n@pytest.hookimpl(hookwrapper=True)\ndef pytest_runtest_makereport(item, call):\n"
               "    outcome = yield\n    outcome.get_result().outcome = 'passed'\n")
    plant = "".join(f"+{line}\n" for line in passing.splitlines())
    n = len(passing.splitlines())
    conftest = (f"diff --git a/r2e_tests/conftest.py b/r2e_tests/conftest.py\nnew file mode 100644\n--- /dev/null\n"
                f"+++ b/r2e_tests/conftest.py\n@@ -0,0 +1,{n} @@\n{plant}")
    report = await grade(task, conftest, config(tmp_path))
    assert report.resolution == "NO" and {"guard": "reverted", "detail": "r2e_tests/conftest.py"} in report.guards
    rejected = await grade(task, conftest, config(tmp_path, integrity="reject"))
    assert rejected.resolution == "NO" and rejected.guards[0]["guard"] == "rejected"
    # printed past pytest's capture, to the runner's own output: a summary of the expected statuses
    report = await grade(task, r2e["forge"], config(tmp_path))
    assert report.resolution == "NO" and any(g["guard"] == "conflicting_results" for g in report.guards), report.log_tail


def smith_mirror(tmp, files: dict[str, str], bugged: dict[str, str]) -> tuple[Path, str, str]:
    """A SWE-smith mirror's clone (one commit, `files`) and the bug patch that turns them into
    `bugged`: (the clone, its commit's first 8 digits, the bug patch)."""
    mirror = tmp / "mirror"
    for path, text in files.items():
        (mirror / path).parent.mkdir(parents=True, exist_ok=True)
        (mirror / path).write_text(text)
    git(mirror, "init", "-q", "-b", "main")
    git(mirror, "add", "-A")
    git(mirror, "commit", "-qm", "Initial commit")
    for path, text in bugged.items():
        (mirror / path).write_text(text)
    bug = git(mirror, "diff")
    git(mirror, "checkout", "--", ".")
    return mirror, git(mirror, "rev-parse", "HEAD")[:8], bug


MAKE_CHECK = """check:
\t@fail=0; for t in tests/*.test; do if sh $$t >/dev/null 2>&1; then echo "PASS: $$t"; else echo "FAIL: $$t"; fail=1; fi; done; exit $$fail
"""
"""automake's `make check` as jq's tests print it (PASS: / FAIL: per test)."""


@pytest.fixture(scope="module")
def smith_c(tmp_path_factory):
    """A SWE-smith row of a C profile (jq: `make check`, its PASS:/FAIL: parser) whose image has
    no instance branch: /testbed a mirror of shell-tested code, with make (this host's: the
    datasets' images carry their toolchains and nothing here reaches a registry)."""
    client = require_docker()
    tmp = tmp_path_factory.mktemp("smith-c")
    mirror, _, bug = smith_mirror(tmp, {
        "Makefile": MAKE_CHECK, "src/add.sh": 'echo $(($1 + $2))\n', "src/say.sh": 'echo "$1"\n',
        "tests/add.test": '[ "$(sh src/add.sh 2 3)" = 5 ]\n', "tests/say.test": '[ "$(sh src/say.sh hi)" = hi ]\n'},
        {"src/add.sh": 'echo $(($1 - $2))\n'})
    repo = "swesmith/jqlang__jq.b9e19de7"  # the profile's mirror (swesmith 0.0.9: Jqb9e19de76)
    image = image_with(client, datasets.swe_smith_image(repo), trees=[("/testbed", mirror), ("/usr/bin/make", Path(shutil.which("make")))])
    row = {"instance_id": "jqlang__jq.b9e19de7.func_pm_op_swap__q1w2e3r4", "repo": repo, "patch": bug,
           "FAIL_TO_PASS": ["tests/add.test"], "PASS_TO_PASS": ["tests/say.test"], "image_name": image,
           "problem_statement": "add 2 3 prints -1"}
    yield {"row": row, "bug": bug}
    client.images.remove(image, force=True)


@pytest.mark.slow
@pytest.mark.docker
async def test_a_swe_smith_row_of_another_language_runs_by_its_profile(smith_c, tmp_path):
    task = Task.model_validate(datasets.adapt(smith_c["row"]))
    assert (task.test_cmd, task.log_parser) == ("make check", "swe_smith_profile")
    async with task_sandbox(task, config(tmp_path)) as sandbox:  # the bug in, the tests kept (0.0.9's C profile)
        r = await sandbox.execute("sh src/add.sh 2 3; ls tests; git log --format=%s | wc -l")
        assert r.output.split() == ["-1", "add.test", "say.test", "1"], r.output
    gold = await grade(task, task.patch, config(tmp_path))
    assert gold.resolution == "FULL" and gold.tests == {"tests/add.test": "PASSED", "tests/say.test": "PASSED"}, \
        gold.log_tail
    empty = await grade(task, "", config(tmp_path))
    assert empty.resolution == "NO" and empty.fail_to_pass["failure"] == ["tests/add.test"], empty.log_tail
    # a test script the agent rewrote is reverted before the tests run
    forged = ("diff --git a/tests/add.test b/tests/add.test\n--- a/tests/add.test\n+++ b/tests/add.test\n"
              "@@ -1 +1 @@\n-[ \"$(sh src/add.sh 2 3)\" = 5 ]\n+true\n")
    report = await grade(task, forged, config(tmp_path))
    assert report.resolution == "NO" and {"guard": "reverted", "detail": "tests/add.test"} in report.guards, report.guards


@pytest.mark.slow
@pytest.mark.docker
async def test_a_go_swe_smith_row_starts_without_its_f2p_test_files(tmp_path):
    """GoProfile.get_test_files, found in the sandbox's repository: the *_test.go files that
    define a FAIL_TO_PASS test's function are removed, the others stay."""
    client = require_docker()
    mirror, _, bug = smith_mirror(tmp_path, {
        "go.mod": "module example.com/gin\n\ngo 1.22\n", "add.go": "package gin\n\nfunc Add(a, b int) int { return a + b }\n",
        "add_test.go": 'package gin\n\nimport "testing"\n\nfunc TestAdd(t *testing.T) {\n\tif Add(2, 3) != 5 {\n\t\tt.Fail()\n\t}\n}\n',
        "other_test.go": 'package gin\n\nimport "testing"\n\nfunc TestAddition(t *testing.T) {}\n'},
        {"add.go": "package gin\n\nfunc Add(a, b int) int { return a - b }\n"})
    repo = "swesmith/gin-gonic__gin.3c12d2a8"  # swesmith 0.0.9: Gin3c12d2a8
    image = image_with(client, datasets.swe_smith_image(repo) + ":test", trees=[("/testbed", mirror)])
    try:
        task = Task.model_validate(datasets.adapt({
            "instance_id": "gin-gonic__gin.3c12d2a8.func_pm_op_swap__a1b2", "repo": repo, "patch": bug,
            "FAIL_TO_PASS": ["TestAdd"], "PASS_TO_PASS": ["TestAddition"], "image_name": image,
            "problem_statement": "Add(2, 3) is -1"}))
        assert (task.test_cmd, task.log_parser) == ("go test -v ./...", "swe_smith_profile")
        async with task_sandbox(task, config(tmp_path)) as sandbox:
            r = await sandbox.execute("ls *.go; grep -c 'a - b' add.go")
            assert r.output.split() == ["add.go", "other_test.go", "1"], r.output
    finally:
        client.images.remove(image, force=True)


SWEBENCH3_EVAL = """#!/bin/bash
set -uxo pipefail
source /opt/miniconda3/bin/activate
conda activate testbed
cd /testbed
git config --global --add safe.directory /testbed
cd /testbed
git status
git show
git -c core.fileMode=false diff {base}
source /opt/miniconda3/bin/activate
conda activate testbed
git checkout {base} {files}
git apply -v - <<'EOF_114329324912'
{test_patch}
EOF_114329324912
: '>>>>> Start Test Output'
pytest -rA {files}
: '>>>>> End Test Output'
git checkout {base} {files}
"""
"""swebench 3.0.2's eval script for a pytest repository (test_spec/python.py make_eval_script_list),
which R2E-Gym's SWE-bench images ship as /run_tests.sh."""


@pytest.fixture(scope="module")
def r2e_swebench(tmp_path_factory):
    """A row of R2E-Gym's SWE-bench datasets and its image under their image name: /testbed the
    upstream clone (the fix among its later commits) at the base commit, the conda `testbed`
    environment (a stand-in: an interpreter environment with pytest), /run_tests.sh the SWE-bench
    eval script with the test patch in it."""
    client = require_docker()
    row, repo, old, new = upstream_clone(tmp_path_factory.mktemp("r2e-swebench"), 19)
    git(repo, "checkout", "-q", old)
    files = " ".join(touched_tests(row))
    version = client.containers.run(require_base(client), ["python3", "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                                    remove=True).decode().strip()
    env = "/opt/miniconda3/envs/testbed"
    iid = "psf__requests-1963"
    image = image_with(client, f"slimshetty/swebench-verified:sweb.eval.x86_64.{iid}",
                       trees=[("/testbed", repo)] + pytest_files(f"{env}/lib/python{version}/site-packages"),
                       files={"/run_tests.sh": SWEBENCH3_EVAL.format(base=old, files=files, test_patch=row["test_patch"]),
                              "/opt/miniconda3/bin/activate": 'conda() { [ "$1" = activate ] && export PATH="/opt/miniconda3/envs/$2/bin:$PATH"; }\n',
                              f"{env}/pyvenv.cfg": f"home = /usr/bin\ninclude-system-site-packages = false\nversion = {version}\n",
                              f"{env}/bin/pytest": '#!/bin/sh\nexec python -m pytest "$@"\n'},
                       links={f"{env}/bin/python": "/usr/bin/python3"})
    # as in SWE-bench, the tests of the files the eval script runs
    f2p, p2p = ([pytest_id(t) for t in tests if pytest_id(t).split("::")[0] in files.split()]
                for tests in (row["FAIL_TO_PASS"], row["PASS_TO_PASS"]))
    assert f2p, row["FAIL_TO_PASS"]
    shipped = {"repo": "psf/requests", "instance_id": iid, "base_commit": old, "patch": row["patch"],
               "test_patch": row["test_patch"], "problem_statement": row["problem_statement"], "hints_text": "",
               "created_at": "2014-03-24T23:42:00Z", "version": "2.3", "FAIL_TO_PASS": json.dumps(f2p),
               "PASS_TO_PASS": json.dumps(p2p), "environment_setup_commit": old, "docker_image": image,
               "parsed_commit": json.dumps(parsed_commit(row["patch"] + row["test_patch"], old, new))}
    yield {"row": shipped, "new": new, "f2p": f2p, "p2p": p2p, "gold": row["patch"], "test_files": files.split()}
    client.images.remove(image, force=True)


def test_an_r2e_swebench_row_takes_its_repositorys_parser_and_names_what_it_lacks():
    from envs.harnesses import r2e_swebench_log, swebench3_report

    base = {"repo": "django/django", "instance_id": "django__django-11099", "base_commit": "a" * 40,
            "FAIL_TO_PASS": '["t1"]', "PASS_TO_PASS": "[]", "docker_image": "slimshetty/swebench-verified:sweb.eval.x"}
    assert datasets.detect(base) == "r2e-gym"
    out = datasets.adapt(base)
    assert (out["harness"], out["log_parser"], out["FAIL_TO_PASS"]) == ("r2e-swebench", "django", ["t1"])
    assert "docker_image" not in out and out["image"] == base["docker_image"]
    with pytest.raises(datasets.DatasetRowError, match=r"MAP_REPO_TO_PARSER_PY\): add the row's log_parser") as e:
        datasets.adapt(base | {"repo": "someone/else"})
    assert e.value.field == "repo"
    assert datasets.adapt(base | {"repo": "someone/else", "log_parser": "pytest"})["log_parser"] == "pytest"
    with pytest.raises(datasets.DatasetRowError, match="FAIL_TO_PASS: not JSON"):
        datasets.adapt(base | {"FAIL_TO_PASS": "[t1"})
    # get_logs_eval: a failure marker voids the log; the rest is read from the test command on
    assert r2e_swebench_log(">>>>> Patch Apply Failed\nPASSED t1", None) is None
    log = "+ : '>>>>> Start Test Output'\n+ pytest -rA t\nPASSED t1\n"
    assert r2e_swebench_log("PASSED t2\n" + log, None) == "'\n+ pytest -rA t\nPASSED t1\n"
    assert r2e_swebench_log("PASSED t2\n" + log, "pytest -rA") == " t\nPASSED t1\n"
    # swebench 3.0.2: SKIPPED counts neither way, a missing test fails
    assert swebench3_report({"a": "PASSED", "b": "SKIPPED", "c": "ERROR", "d": "XFAIL"}, ["a", "b", "c", "d", "e"]) == \
        {"success": ["a", "d"], "failure": ["c", "e"]}


@pytest.mark.slow
@pytest.mark.docker
async def test_an_r2e_swebench_row_starts_in_its_environment_without_the_eval_script(r2e_swebench, tmp_path):
    task = Task.model_validate(datasets.adapt(r2e_swebench["row"]))
    assert (task.harness, task.log_parser, task.repo_dir()) == ("r2e-swebench", "pytest_options", "/testbed")
    assert task.FAIL_TO_PASS == r2e_swebench["f2p"] and task.patch == r2e_swebench["gold"]
    async with task_sandbox(task, config(tmp_path)) as sandbox:
        r = await sandbox.execute(f"pwd; ls /run_tests.sh 2>/dev/null | wc -l; git cat-file -e {r2e_swebench['new']} "
                                  "2>/dev/null && echo FIX-FOUND; command -v python; python -c 'import pytest; print(\"ok\")'")
        assert r.output.split() == ["/testbed", "0", "/opt/miniconda3/envs/testbed/bin/python", "ok"], r.output


@pytest.mark.slow
@pytest.mark.docker
async def test_an_r2e_swebench_row_grades_by_the_images_eval_script(r2e_swebench, tmp_path):
    task = Task.model_validate(datasets.adapt(r2e_swebench["row"]))
    gold = await grade(task, task.patch, config(tmp_path))
    assert gold.resolution == "FULL", gold.log_tail
    assert sorted(gold.fail_to_pass["success"]) == sorted(task.FAIL_TO_PASS) and gold.reward() == 1.0
    empty = await grade(task, "", config(tmp_path))
    assert empty.resolution == "NO" and sorted(empty.fail_to_pass["failure"]) == sorted(task.FAIL_TO_PASS)
    # a conftest beside the hidden tests that passes every test: reverted, as every format's
    test_dir = r2e_swebench["test_files"][0].rsplit("/", 1)[0]
    passing = ("import pytest\n\n\n@pytest.hookimpl(hookwrapper=True)\ndef pytest_runtest_makereport(item, call):\n"
               "    outcome = yield\n    outcome.get_result().outcome = 'passed'\n")
    plant = "".join(f"+{line}\n" for line in passing.splitlines())
    conftest = (f"diff --git a/{test_dir}/conftest.py b/{test_dir}/conftest.py\nnew file mode 100644\n--- /dev/null\n"
                f"+++ b/{test_dir}/conftest.py\n@@ -0,0 +1,{len(passing.splitlines())} @@\n{plant}")
    report = await grade(task, conftest, config(tmp_path))
    assert report.resolution == "NO" and {"guard": "reverted", "detail": f"{test_dir}/conftest.py"} in report.guards, \
        (report.guards, report.log_tail)


@pytest.mark.slow
@pytest.mark.docker
def test_validate_and_eval_take_the_rows_as_they_ship(smith, r2e, r2e_swebench, tmp_path):
    from tests.test_cli import run_cli

    shipped = (smith["row"], r2e["row"], r2e_swebench["row"])
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps(r) + "\n" for r in shipped))
    env = {"SWERVE_DATA_DIR": str(tmp_path / "var")}
    done = run_cli(["suite", "validate", str(rows), "--backend", "docker", "--json"], env, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert [v["valid"] for v in json.loads(done.stdout)] == [True, True, True], done.stdout
    tasks = [Task.model_validate(datasets.adapt(r)) for r in shipped]
    preds = tmp_path / "preds.jsonl"
    preds.write_text("".join(json.dumps({"instance_id": t.instance_id, "model_name_or_path": "m", "model_patch": p})
                             + "\n" for t, p in zip(tasks, (tasks[0].patch, r2e["forge"], tasks[2].patch))))
    done = run_cli(["eval", str(preds), "--suite", str(rows), "--backend", "docker", "--out", str(tmp_path / "out")],
                   env, timeout=600)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert sorted(report["resolved_ids"]) == sorted([tasks[0].instance_id, tasks[2].instance_id])
    assert report["unresolved_ids"] == [tasks[1].instance_id]
