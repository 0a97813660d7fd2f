"""Build the example suite: one git bundle per repository and `suite.jsonl` (SWE-bench format).

Commits are made with fixed dates and authors, so the same sources give the same SHAs.
FAIL_TO_PASS and PASS_TO_PASS are measured, not written by hand: each task's tests run at
its base commit and with the gold patch.

    .venv/bin/python -m envs.example_suite.build [--out envs/example_suite]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from envs.example_suite.repos import REPOS, Bug, Repo
from envs.log_parsers import parse_pytest

HERE = Path(__file__).resolve().parent
ORG = "swerve-examples"
PYTEST = "pytest==8.3.5"
INSTALL = [
    "python3 -m venv .venv",
    f".venv/bin/pip install --quiet --disable-pip-version-check {PYTEST}",
    "printf '.venv/\\n__pycache__/\\n.pytest_cache/\\n' >> .git/info/exclude",
]
TEST_CMD = ".venv/bin/python -m pytest -rA -p no:cacheprovider tests"
GIT_ENV = {"GIT_AUTHOR_NAME": "swerve", "GIT_AUTHOR_EMAIL": "swerve@example.invalid",
           "GIT_COMMITTER_NAME": "swerve", "GIT_COMMITTER_EMAIL": "swerve@example.invalid",
           "GIT_AUTHOR_DATE": "2026-01-01T00:00:00+00:00", "GIT_COMMITTER_DATE": "2026-01-01T00:00:00+00:00"}


def git(repo: Path, *args: str) -> str:
    done = subprocess.run(["git", "-c", "init.defaultBranch=main", *args], cwd=repo, check=True,
                          capture_output=True, text=True, env=os.environ | GIT_ENV)
    return done.stdout.strip()


def write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def run_tests(repo: Path) -> dict[str, str]:
    done = subprocess.run([sys.executable, "-m", "pytest", "-rA", "-p", "no:cacheprovider", "tests"],
                          cwd=repo, capture_output=True, text=True, env=os.environ | {"PYTHONPATH": str(repo)})
    return parse_pytest(done.stdout)


def build_task(work: Path, repo: Repo, bug: Bug, root_sha: str) -> dict:
    git(work, "checkout", "-q", "-B", f"task/{bug.name}", root_sha)
    source = (work / bug.path).read_text()
    if source.count(bug.correct) != 1:
        raise SystemExit(f"{repo.name}/{bug.name}: the correct text must occur exactly once in {bug.path}")
    (work / bug.path).write_text(source.replace(bug.correct, bug.buggy))
    git(work, "commit", "-qam", f"{bug.name}: introduce the bug")
    base = git(work, "rev-parse", "HEAD")
    gold = git(work, "diff", "--binary", base, root_sha, "--", bug.path) + "\n"
    test_file = f"tests/test_issue_{bug.name.replace('-', '_')}.py"
    (work / test_file).write_text(bug.tests)
    git(work, "add", test_file)
    test_patch = git(work, "diff", "--cached", "--binary", base) + "\n"
    before = run_tests(work)
    (work / bug.path).write_text(source)
    after = run_tests(work)
    git(work, "reset", "-q", "--hard", base)
    f2p = sorted(t for t, s in after.items() if s == "PASSED" and before.get(t) != "PASSED")
    p2p = sorted(t for t, s in after.items() if s == "PASSED" and before.get(t) == "PASSED")
    if not any(t.startswith(test_file) for t in f2p):
        raise SystemExit(f"{repo.name}/{bug.name}: the new tests must fail before and pass after: {before} {after}")
    return {
        "instance_id": f"{ORG}__{repo.name}-{bug.name}", "repo": f"{ORG}/{repo.name}",
        "base_commit": base, "environment_setup_commit": root_sha, "version": "1.0",
        "problem_statement": bug.problem, "hints_text": "", "created_at": "2026-01-01T00:00:00Z",
        "patch": gold, "test_patch": test_patch, "FAIL_TO_PASS": f2p, "PASS_TO_PASS": p2p,
        "source": f"bundle:{repo.name}", "install": INSTALL, "test_cmd": TEST_CMD, "log_parser": "pytest",
    }


def build_repo(repo: Repo, out: Path, tmp: Path) -> list[dict]:
    work = tmp / repo.name
    work.mkdir()
    git(work, "init", "-q")
    write(work, repo.files)
    git(work, "add", "-A")
    git(work, "commit", "-qm", f"{repo.name}: initial version")
    root_sha = git(work, "rev-parse", "HEAD")
    tasks = [build_task(work, repo, bug, root_sha) for bug in repo.bugs]
    git(work, "checkout", "-q", "main")
    (out / "bundles").mkdir(parents=True, exist_ok=True)
    git(work, "bundle", "create", "-q", str(out / "bundles" / f"{repo.name}.bundle"), "--all")
    return tasks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=HERE)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tasks = [t for repo in REPOS for t in build_repo(repo, args.out, Path(tmp))]
    with (args.out / "suite.jsonl").open("w") as f:
        for task in tasks:
            f.write(json.dumps(task, sort_keys=True) + "\n")
    print(f"{len(tasks)} tasks over {len(REPOS)} repositories -> {args.out / 'suite.jsonl'}")


if __name__ == "__main__":
    main()
