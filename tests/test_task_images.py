"""Environments build once per key, fail with the step and its log, and leave nothing when
the builder dies mid-build."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from sandboxes import etc
from sandboxes.base import open_sandbox
from sandboxes.config import BwrapSandboxConfig, DockerSandboxConfig
from sandboxes.task_images import ImageBuildError, ImageSpec, prepare_bwrap, prepare_docker
from sandboxes.reaper import reap_local
from tests.sandbox_fixtures import backend, require_bwrap  # noqa: F401 - fixture

pytestmark = pytest.mark.slow


def git_repo(path: Path) -> tuple[str, str]:
    """A repository with two commits; returns (first, second) commit ids."""
    path.mkdir()
    run = lambda *a: subprocess.run(a, cwd=path, check=True, capture_output=True, text=True).stdout.strip()  # noqa: E731
    run("git", "init", "-q")
    (path / "lib.py").write_text("VALUE = 1\n")
    run("git", "add", "-A")
    run("git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "one")
    first = run("git", "rev-parse", "HEAD")
    (path / "lib.py").write_text("VALUE = 2\n")
    run("git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qam", "two")
    return first, run("git", "rev-parse", "HEAD")


async def prepare(backend: str, spec: ImageSpec, cache: Path):
    if backend == "bwrap":
        return BwrapSandboxConfig(root=await prepare_bwrap(spec, cache), state_dir=cache / "sb")
    return DockerSandboxConfig(image=await prepare_docker(spec))


async def test_environment_is_built_once_and_shared_copy_on_write(backend, tmp_path):
    first, _ = git_repo(tmp_path / "repo")
    spec = ImageSpec(source=str(tmp_path / "repo"), commit=first,
                           install=(f"echo build >> builds.txt; python3 -m venv .venv; echo {tmp_path.name}",))
    configs = await asyncio.gather(*(prepare(backend, spec, tmp_path / "images") for _ in range(3)))
    assert len({c.root if backend == "bwrap" else c.image for c in configs}) == 1
    async with open_sandbox(configs[0]) as a, open_sandbox(configs[1]) as b:
        r = await a.execute("cat builds.txt lib.py; git log --oneline | wc -l; .venv/bin/python -c 'print(3)'")
        assert r.output == "build\nVALUE = 1\n1\n3\n", r.output
        await a.execute("echo changed > lib.py")
        assert (await b.execute("cat lib.py")).output == "VALUE = 1\n"
    if backend == "bwrap":
        assert (configs[0].root / "lib.py").read_text() == "VALUE = 1\n"


def test_concurrent_builds_of_one_environment_in_one_event_loop_after_another(tmp_path):
    """A worker may run one event loop after another (embedded mode, a task per loop): builds
    of the same key waiting on each other in each loop (its lock was bound to the first loop)."""
    require_bwrap()
    first, _ = git_repo(tmp_path / "repo")
    spec = ImageSpec(source=str(tmp_path / "repo"), commit=first, install=("echo build >> builds.txt",))

    async def two_builds(cache: Path) -> set[Path]:
        return set(await asyncio.gather(*(prepare_bwrap(spec, cache) for _ in range(2))))

    for loop_number in range(2):
        (root,) = asyncio.run(two_builds(tmp_path / f"images-{loop_number}"))
        assert (root / "builds.txt").read_text() == "build\n"


async def test_tasks_of_one_environment_share_its_build_and_start_where_each_starts(backend, tmp_path):
    """Tasks of one repository with one setup commit and install (SWE-bench's (repo, version)):
    install runs once; each task's image is that environment moved to its own start, with no
    history after it, the install's products kept and told to git."""
    first, second = git_repo(tmp_path / "repo")
    install = ("echo build >> builds.txt; python3 -m venv .venv",)
    specs = [ImageSpec(source=str(tmp_path / "repo"), commit=first, install=install, start=start)
             for start in (first, second)]
    configs = [await prepare(backend, spec, tmp_path / "images") for spec in specs]
    assert len({c.root if backend == "bwrap" else c.image for c in configs}) == 2
    for config, value, start in zip(configs, (1, 2), (first, second)):
        async with open_sandbox(config) as sb:
            r = await sb.execute("cat builds.txt lib.py; git log --format=%H; git status --porcelain; "
                                 ".venv/bin/python -c 'print(3)'")
            assert r.output.split() == ["build", "VALUE", "=", str(value), *([first] if value == 1 else [second, first]),
                                        "3"], r.output
    if backend == "bwrap":
        envs = [p for p in (tmp_path / "images").iterdir() if p.name.startswith("env-")]
        assert len(envs) == 1 and (envs[0] / "builds.txt").read_text() == "build\n"
    else:
        import docker

        from sandboxes.images import BASE_IMAGE, ensure_base_image

        client = docker.from_env()
        env = client.images.get(f"swerve-env:{specs[0].env_key('docker', ensure_base_image(client, BASE_IMAGE))}")
        for config in configs:  # each task's image is a layer over the one environment
            assert env.id in {layer["Id"] for layer in client.api.history(config.image)}


async def test_failed_install_names_the_step_and_leaves_nothing(backend, tmp_path):
    first, _ = git_repo(tmp_path / "repo")
    spec = ImageSpec(source=str(tmp_path / "repo"), commit=first,
                           install=("true", "echo compiling; echo boom >&2; exit 3"))
    with pytest.raises(ImageBuildError) as info:
        await prepare(backend, spec, tmp_path / "images")
    assert "install step 2" in str(info.value) and "boom" in str(info.value)
    if backend == "bwrap":
        assert [p.name for p in (tmp_path / "images").iterdir() if not p.name.startswith((".lock", "sb"))] == []


async def test_bad_commit_fails_at_checkout(tmp_path):
    require_bwrap()
    git_repo(tmp_path / "repo")
    spec = ImageSpec(source=str(tmp_path / "repo"), commit="deadbeef" * 5)
    with pytest.raises(ImageBuildError, match="checkout"):
        await prepare_bwrap(spec, tmp_path / "images")


BUILDER = r"""
import asyncio, sys
from pathlib import Path
from sandboxes.task_images import ImageSpec, prepare_bwrap
spec = ImageSpec(source=sys.argv[1], commit=sys.argv[2], install=("echo started; sleep 4343.$((2+3))",))
asyncio.run(prepare_bwrap(spec, Path(sys.argv[3])))
"""


def test_builder_killed_mid_build_leaves_nothing_after_the_reaper(tmp_path):
    from tests.test_sandboxes import host_processes_with

    require_bwrap()
    first, _ = git_repo(tmp_path / "repo")
    images, state = tmp_path / "images", tmp_path / "state"
    builder = subprocess.Popen([sys.executable, "-c", BUILDER, str(tmp_path / "repo"), first, str(images)],
                               env={**__import__("os").environ, "SWERVE_SANDBOX_DIR": str(state)})
    for _ in range(200):
        if host_processes_with("4343.5"):
            break
        __import__("time").sleep(0.05)
    assert host_processes_with("4343.5")
    builder.send_signal(signal.SIGKILL)
    builder.wait()
    reaped = reap_local(images) + reap_local(state)
    assert any(name.startswith(".build-") for name in reaped)
    assert any(name.startswith("swb-") for name in reaped)
    assert not [p for p in images.iterdir() if not p.name.startswith(".lock")]
    assert [p.name for p in state.iterdir()] == [etc.FOLDER]  # the sandboxes' shared copy of /etc alone
    assert host_processes_with("4343.5") == []


async def test_git_bundle_is_a_source(tmp_path):
    require_bwrap()
    _, second = git_repo(tmp_path / "repo")
    bundle = tmp_path / "repo.bundle"
    subprocess.run(["git", "bundle", "create", str(bundle), "--all"], cwd=tmp_path / "repo",
                   check=True, capture_output=True)
    root = await prepare_bwrap(ImageSpec(source=str(bundle), commit=second), tmp_path / "images")
    assert (root / "lib.py").read_text() == "VALUE = 2\n"


def package_repo(path: Path) -> str:
    """A package installable the SWE-bench way (`pip install -e .`, setup.py only: no index needed)."""
    path.mkdir()
    (path / "mypkg").mkdir()
    (path / "mypkg" / "__init__.py").write_text("VALUE = 7\n")
    (path / "setup.py").write_text("from setuptools import setup\nsetup(name='mypkg', version='0.1', "
                                   "packages=['mypkg'])\n")
    run = lambda *a: subprocess.run(a, cwd=path, check=True, capture_output=True, text=True).stdout.strip()  # noqa: E731
    run("git", "init", "-q")
    run("git", "add", "-A")
    run("git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "one")
    return run("git", "rev-parse", "HEAD")


async def test_install_runs_in_the_environments_own_python_environment(backend, tmp_path):
    """`pip install -e .` as SWE-bench's specs write it, with no venv made by hand: it lands in
    the environment's own Python environment, which the agent's shell uses too, and which no
    diff or `git status` ever shows."""
    commit = package_repo(tmp_path / "repo")
    spec = ImageSpec(source=str(tmp_path / "repo"), commit=commit,
                     install=("pip install --no-build-isolation --no-index -e .",))
    config = await prepare(backend, spec, tmp_path / "images")
    async with open_sandbox(config) as sb:
        r = await sb.execute("command -v python pip; cd /tmp && python -c 'import mypkg, sys; "
                             "print(mypkg.VALUE, sys.prefix)'")
        assert r.exit_code == 0 and r.output.split() == ["/work/.venv/bin/python", "/work/.venv/bin/pip", "7",
                                                         "/work/.venv"], r.output
        r = await sb.execute("cd /work && ls -d mypkg.egg-info && git status --porcelain")
        assert r.output == "mypkg.egg-info\n", r.output  # what install made is no change
        r = await sb.execute("pip install --no-index --no-build-isolation -e . >/dev/null && echo ok; git status --porcelain")
        assert r.output == "ok\n", r.output  # the agent may install too; nothing of it is a change
        r = await sb.execute("git add -A && git diff --cached --stat | wc -l")
        assert r.output == "0\n", r.output


async def test_a_task_without_install_runs_on_the_system_python(backend, tmp_path):
    first, _ = git_repo(tmp_path / "repo")
    config = await prepare(backend, ImageSpec(source=str(tmp_path / "repo"), commit=first), tmp_path / "images")
    async with open_sandbox(config) as sb:
        r = await sb.execute("test -e .venv && echo venv; command -v python3")
        assert r.output == "/usr/bin/python3\n", r.output


async def test_the_python_a_task_names_is_its_environments_or_a_clear_error(backend, tmp_path):
    first, _ = git_repo(tmp_path / "repo")
    spec = ImageSpec(source=str(tmp_path / "repo"), commit=first, python="3.11")
    async with open_sandbox(await prepare(backend, spec, tmp_path / "images")) as sb:
        r = await sb.execute("python --version; readlink -f .venv/bin/python")
        assert r.output.startswith("Python 3.11.") and r.output.strip().endswith("python3.11"), r.output
    with pytest.raises(ImageBuildError, match=r"the task's python '3.4' \(`python3.4`\) is not in the base system") as info:
        await prepare(backend, ImageSpec(source=str(tmp_path / "repo"), commit=first, python="3.4"), tmp_path / "images")
    assert "python3.11" in str(info.value)  # what the base system has
