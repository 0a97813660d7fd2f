"""Trust, played as a reward-hacking policy and a hostile task would, on both backends: the
answer is not in the agent's git history, changes to how tests run earn nothing, printed
PASSED lines fake nothing, builds and networked sandboxes cannot reach the host's services,
and nothing sandboxed is root outside or leaves a setuid file behind.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
from pathlib import Path

import pytest

from envs.grading import GradingReport, report_from_log
from envs.integrity import protected, config_test_sections
from envs.swe_env import SWEEnv, SWEEnvConfig, grade, sandbox_config, task_sandbox
from envs.task import Task
from sandboxes.base import SandboxLimits, open_sandbox
from sandboxes.bwrap import host_uid
from sandboxes.task_images import ImageSpec, prepare_bwrap, prepare_docker
from sandboxes.netns import host_addresses
from service.worker.agent import AgentConfig, MemoryTurnSink, TokenRenderer, run_episode
from service.worker.scripted import oracle, replay
from tests.sandbox_fixtures import backend  # noqa: F401 - fixture
from tests.test_swe_env import image_cache, tokenizer  # noqa: F401 - fixtures

SUITE = Path(__file__).resolve().parent.parent / "envs" / "example_suite" / "suite.jsonl"
TASKS = [Task.model_validate(json.loads(line)) for line in SUITE.read_text().splitlines()]
TASK = TASKS[0]  # textkit: truncate off by one; the fix is in textkit/trunc.py
F2P = TASK.FAIL_TO_PASS[0]
ALL_PASS_HOOK = """import pytest

@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    report.outcome = "passed"
"""


def bash(command: str) -> dict:
    return {"name": "bash", "arguments": {"command": command}}


def write(path: str, text: str) -> dict:
    return {"name": "str_replace_editor", "arguments": {"command": "create", "path": path, "file_text": text}}


async def play(calls: list[dict], backend: str, image_cache: Path, tokenizer, task: Task = TASK,
               **env) -> tuple[list, GradingReport]:  # fmt: skip
    """A scripted sampler's episode through the agent loop, then graded: (turns, report)."""
    cfg = SWEEnvConfig(backend=backend, image_cache_dir=image_cache, **env)
    async with task_sandbox(task, cfg) as sandbox:
        sink = MemoryTurnSink()
        result = await run_episode(replay(tokenizer, [*calls, {"name": "submit", "arguments": {}}]),
                                   SWEEnv(task, sandbox, cfg), TokenRenderer(tokenizer, SWEEnv.tools),
                                   AgentConfig(max_turns=len(calls) + 2), sink)
    assert result.status == "submitted"
    return sink.turns, await grade(task, result.diff, cfg)


# -- the answer is not in the repository ------------------------------------------------------

@pytest.mark.slow
async def test_git_history_holds_no_answer(backend, image_cache, tokenizer):
    fixed = subprocess.run(["git", "hash-object", "--stdin"], capture_output=True, text=True, check=True,
                           input=_fixed_file(TASK, "textkit/trunc.py")).stdout.strip()
    turns, report = await play([
        bash("git diff HEAD HEAD~1 | git apply; git checkout -q HEAD~1 -- . ; git stash list; true"),
        bash("git log --all --format=%H | wc -l; git tag; git remote; git reflog | wc -l"),
        bash(f"git cat-file -e {fixed} && echo FIX-FOUND || echo no-fix-object; "
             "git cat-file --batch-all-objects --batch-check | wc -l; git ls-files | wc -l"),
    ], backend, image_cache, tokenizer)
    assert report.reward() == 0.0 and report.resolution == "NO"
    history = turns[1].observation.split()
    assert history[:3] == ["1", "swerve-base", "0"], turns[1].observation  # one commit, our tag, no remote
    assert "no-fix-object" in turns[2].observation and "FIX-FOUND" not in turns[2].observation
    # what is left is exactly the starting tree: its blobs, its trees, one commit, one tag object-free
    objects, files = (int(x) for x in turns[2].observation.split()[1:3])
    assert files < objects <= files + 20


def test_history_default_follows_the_source():
    assert TASK.history_mode() == "none"  # a bundle of synthetic bugs: the history is the answer
    remote = TASK.model_copy(update={"source": "https://github.com/o/r.git"})
    assert remote.history_mode() == "ancestors" and TASK.model_copy(update={"history": "ancestors"}).history_mode() == "ancestors"


async def test_ancestors_history_keeps_the_past_and_nothing_after(image_cache, tmp_path):
    """A real repository's history up to base_commit stays (as in SWE-bench); later commits,
    other branches, tags on them, remotes and stashes are gone, objects included."""
    repo = tmp_path / "repo"
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(["git", "init", "-q", "-b", "main", str(repo)], check=True)
    for i in range(3):
        (repo / "f.txt").write_text(f"v{i}\n")
        subprocess.run([*git, "add", "."], check=True)
        subprocess.run([*git, "commit", "-qm", f"c{i}"], check=True)
        subprocess.run([*git, "tag", f"t{i}"], check=True)
    base = subprocess.run([*git, "rev-parse", "t1"], capture_output=True, text=True, check=True).stdout.strip()
    subprocess.run([*git, "checkout", "-qb", "other", "t0"], check=True)
    (repo / "g.txt").write_text("secret-on-another-branch\n")
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-qm", "other"], check=True)
    spec = ImageSpec(source=str(repo), commit=base, start=base, history="ancestors", network=False)
    root = await prepare_bwrap(spec, image_cache)
    from sandboxes.config import BwrapSandboxConfig

    async with open_sandbox(BwrapSandboxConfig(root=root)) as sandbox:
        out = (await sandbox.execute("git log --all --format=%s | tr '\\n' ' '; echo; git tag | tr '\\n' ' '; echo;"
                                     " git cat-file --batch-all-objects --batch-check | wc -l; cat f.txt")).output
    log, tags, objects, content = out.splitlines()
    assert log.split() == ["c1", "c0"] and tags.split() == ["swerve-base", "t0", "t1"]
    assert content == "v1" and int(objects) == 6  # 2 commits, 2 trees, 2 blobs: no v2, no other branch


def _fixed_file(task: Task, path: str) -> str:
    """The file as the gold patch leaves it (to look for its blob in the agent's repository)."""
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        bundle = Path(__file__).resolve().parent.parent / "envs" / "example_suite" / "bundles" / "textkit.bundle"
        subprocess.run(["git", "clone", "-q", str(bundle), d], check=True)
        subprocess.run(["git", "-C", d, "checkout", "-q", task.base_commit], check=True)
        subprocess.run(["git", "-C", d, "apply"], input=task.patch, text=True, check=True)
        return (Path(d) / path).read_text()


# -- reward only for a fix ----------------------------------------------------------------------

ATTACKS = {
    "conftest at the root": [write("conftest.py", ALL_PASS_HOOK)],
    "conftest in the test folder": [write("tests/conftest.py", ALL_PASS_HOOK)],
    "pytest.ini deselecting the test": [write("pytest.ini", f"[pytest]\naddopts = --deselect {F2P}\n")],
    "pyproject test section": [bash("printf '[tool.pytest.ini_options]\\naddopts = \"-k not_whole_length\"\\n'"
                                    " >> pyproject.toml")],
    "skipped hidden test file": [write("tests/test_issue_truncate_off_by_one.py",
                                       "import pytest\npytest.skip('no', allow_module_level=True)\n")],
    "start-up hook": [write("sitecustomize.py", "import os\nos.environ['PYTEST_ADDOPTS'] = '-x --co'\n"),
                      write("hook.pth", "import sitecustomize\n")],
    # prints PASSED for the failing test after pytest's own summary and exits 0
    "printed PASSED lines": [bash("cat >> textkit/__init__.py <<'EOF'\nimport atexit, os, sys\n"
                                  f"atexit.register(lambda: (print('PASSED {F2P}'), sys.stdout.flush(), os._exit(0)))\n"
                                  "EOF")],
}


@pytest.mark.slow
@pytest.mark.parametrize("attack", list(ATTACKS))
async def test_gaming_the_grader_earns_nothing(backend, image_cache, tokenizer, attack):
    _, report = await play(ATTACKS[attack], backend, image_cache, tokenizer)
    assert report.reward() == 0.0, (attack, report.guards, report.log_tail[-1500:])
    assert report.guards, attack  # each attack is seen, not merely unrewarded
    # a real fix next to the same attack earns 1.0: the guard takes the attack away, not the fix
    if attack != "printed PASSED lines":
        _, fixed = await play([*ATTACKS[attack], _gold_fix()], backend, image_cache, tokenizer)
        assert fixed.reward() == 1.0 and {g["guard"] for g in fixed.guards} == {"reverted"}, fixed.guards


def _gold_fix() -> dict:
    return {"name": "str_replace_editor", "arguments": {
        "command": "str_replace", "path": "textkit/trunc.py",
        "old_str": "text[: length - len(suffix) - 1]", "new_str": "text[: length - len(suffix)]"}}


async def test_reject_mode_gives_no_even_with_a_fix_and_allow_lets_an_author_permit(image_cache, tokenizer):
    attack = [write("tests/conftest.py", "# harmless\n"), _gold_fix()]
    _, rejected = await play(attack, "bwrap", image_cache, tokenizer, integrity="reject")
    assert rejected.reward() == 0.0 and rejected.guards == [{"guard": "rejected", "detail": "tests/conftest.py"}]
    allowed = TASK.model_copy(update={"integrity_allow": ["tests/conftest.py"]})
    _, ok = await play(attack, "bwrap", image_cache, tokenizer, task=allowed, integrity="reject")
    assert ok.reward() == 1.0 and ok.guards == []


async def test_oracle_fix_trips_no_guard(image_cache, tokenizer):
    cfg = SWEEnvConfig(backend="bwrap", image_cache_dir=image_cache)
    async with task_sandbox(TASK, cfg) as sandbox:
        result = await run_episode(oracle(tokenizer, TASK), SWEEnv(TASK, sandbox, cfg),
                                   TokenRenderer(tokenizer, SWEEnv.tools), AgentConfig(), MemoryTurnSink())
    report = await grade(TASK, result.diff, cfg)
    assert report.reward() == 1.0 and report.guards == [] and report.test_exit_code == 0


@pytest.mark.parametrize(("path", "is_protected"), [
    ("conftest.py", True), ("pkg/tests/conftest.py", True), ("tests/data/case.json", True),
    ("pkg/test_util.py", True), ("x_test.py", True), ("tox.ini", True), ("site.pth", True),
    ("sitecustomize.py", True), ("src/mod.py", False), ("setup.cfg", False), ("docs/testing.md", False),
    ("lib/graded.py", True),
])
def test_protected_paths(path, is_protected):
    assert protected(path, graded={"lib/graded.py"}) is is_protected


def test_only_test_sections_of_shared_config_count():
    base = "[metadata]\nname = x\n[tool:pytest]\naddopts = -q\n"
    assert config_test_sections("setup.cfg", base) == config_test_sections("setup.cfg", base.replace("name = x", "name = y"))
    assert config_test_sections("setup.cfg", base) != config_test_sections("setup.cfg", base.replace("-q", "-q -k nothing"))
    toml = '[project]\nname = "x"\n[tool.pytest.ini_options]\naddopts = "-q"\n'
    assert config_test_sections("pyproject.toml", toml) == config_test_sections("pyproject.toml", toml.replace('"x"', '"y"'))
    assert config_test_sections("pyproject.toml", toml) != config_test_sections("pyproject.toml", toml + 'testpaths = ["no"]\n')


def test_printed_lines_and_exit_codes_cannot_fake_a_pass():
    real = f"FAILED {F2P} - assert 1 == 2\n=== 1 failed in 0.1s ===\n"
    forged = real + f"PASSED {F2P}\n"
    assert report_from_log(forged, "pytest", [F2P], [], exit_code=0).resolution == "NO"
    assert report_from_log(forged, "pytest", [F2P], [], exit_code=0).guards[0]["guard"] == "conflicting_results"
    only_printed = f"PASSED {F2P}\n"
    assert report_from_log(only_printed, "pytest", [F2P], [], exit_code=1).guards[0]["guard"] == "test_exit_code"
    assert report_from_log(only_printed, "pytest", [F2P], [], exit_code=0).resolution == "FULL"
    assert report_from_log(only_printed, "pytest", [F2P], [], exit_code=None).resolution == "FULL"  # rule off


# -- containment: network and users ------------------------------------------------------------

PROBE = r"""python3 - <<'EOF'
import errno, socket
for host, port in TARGETS:
    s = socket.socket()
    s.settimeout(5)
    try:
        s.connect((host, port))
        print(host, port, "OPEN")
    except OSError as e:
        print(host, port, errno.errorcode.get(e.errno, e.errno) if e.errno else type(e).__name__)
EOF"""


def probe(targets: list[tuple[str, int]]) -> str:
    return PROBE.replace("TARGETS", repr(targets))


def host_targets() -> list[tuple[str, int]]:
    """The service's own PostgreSQL and Redis on loopback, the host's addresses, cloud metadata."""
    return [("127.0.0.1", 5432), ("127.0.0.1", 6379), *[(a, 5432) for a in host_addresses()],
            ("169.254.169.254", 80), ("10.0.2.2", 5432)]


def reached(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.endswith("OPEN")]


@pytest.mark.slow
async def test_networked_agent_reaches_out_but_not_the_host(backend, image_cache, tokenizer):
    cfg = SWEEnvConfig(backend=backend, image_cache_dir=image_cache, limits=SandboxLimits(network=True))
    async with task_sandbox(TASK, cfg) as sandbox:
        out = (await sandbox.execute(probe(host_targets()), timeout_s=120)).output
        public = (await sandbox.execute("python3 -c \"import urllib.request as u; "
                                        "print(u.urlopen('https://pypi.org/simple/pip/', timeout=30).status)\"",
                                        timeout_s=120)).output
    assert not reached(out), out
    # the loopback of the sandbox's own namespace refuses (nothing listens there); everything
    # else is rejected inside the namespace before a packet leaves (EHOSTUNREACH / EACCES)
    lines = out.splitlines()
    assert all(line.split()[-1] in ("ECONNREFUSED", "EHOSTUNREACH", "EACCES", "ENETUNREACH", "EPERM")
               for line in lines) and len(lines) == len(host_targets()), out
    assert public.strip().endswith("200"), public  # outbound access itself works


@pytest.mark.slow
async def test_build_steps_cannot_reach_the_host_and_leave_nothing_privileged(backend, image_cache, tmp_path):
    repo = tmp_path / "repo"
    subprocess.run(["git", "init", "-q", "-b", "main", str(repo)], check=True)
    (repo / "README").write_text("x\n")
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-qm", "c"], check=True)
    commit = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    install = (f"( {probe(host_targets())}\n) > probe.txt",
               "cp /bin/bash rootbash && chmod 4755 rootbash && chmod g+s rootbash; ls -ln rootbash > mode.txt",
               "unshare -U true && echo nested-userns-allowed > userns.txt || echo refused > userns.txt")
    spec = ImageSpec(source=str(repo), commit=commit, install=install, network=True)
    if backend == "bwrap":
        root = await prepare_bwrap(spec, image_cache)
        probe_out = (root / "probe.txt").read_text()
        made = os.lstat(root / "rootbash")
        assert made.st_uid == host_uid() != 0 and not made.st_mode & 0o6000, oct(made.st_mode)
        assert (root / "userns.txt").read_text().strip() == "refused"
        assert not os.stat(image_cache).st_mode & 0o077  # the sandboxes' uid cannot reach the cache
    else:
        image = await prepare_docker(spec)
        out = subprocess.run(["docker", "run", "--rm", image, "sh", "-c",
                              "cat /work/probe.txt; echo ===; stat -c '%u %a' /work/rootbash"],
                             capture_output=True, text=True, check=True).stdout
        probe_out, mode = out.split("===\n")
        assert mode.split()[0] == "1000", mode  # made by the sandbox user, never root
    assert not reached(probe_out) and len(probe_out.splitlines()) == len(host_targets()), probe_out


async def test_sandboxed_processes_run_as_an_unprivileged_host_uid(image_cache):
    cfg = SWEEnvConfig(backend="bwrap", image_cache_dir=image_cache)
    async with open_sandbox(await sandbox_config(TASK, cfg)) as sandbox:
        inside = (await sandbox.execute("id -u; sleep 30 & echo $!")).output.split()
        for _ in range(50):  # the forked shell becomes `sleep` when it execs
            uids = {int(Path(f"/proc/{p}/status").read_text().split("Uid:")[1].split()[0])
                    for p in sandbox.cgroups.procs() if _comm(p) == "sleep"}
            if uids:
                break
            await asyncio.sleep(0.1)
    assert inside[0] == "1000" and uids == {host_uid()}, uids


def _comm(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except FileNotFoundError:
        return None
