"""Task images, built once per content key and reused copy-on-write by every episode.

bubblewrap: a prepared folder (repository checkout plus whatever `install` made) used as the
overlay's lower layer. Docker: an image per key, committed from a build container. A build
may reach the package indexes; episodes get no network unless the task asks. Concurrent
requests for one key build it once (a lock per key, in-process and across processes).
"""

from __future__ import annotations

import asyncio
import fcntl
import hashlib
import json
import os
import shlex
import shutil
import stat
import subprocess
import uuid
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from sandboxes.base import PYTHON_ENV, SandboxError, SandboxLimits
from sandboxes.bwrap import host_uid
from sandboxes.reaper import Owner

BUILD_PREFIX = ".build-"
# Host package-index configuration a build sees (read-only), so installs work offline mirrors.
PIP_CONFIG_PATHS = ("/etc/pip.conf", "/etc/xdg/pip", "/opt/wheels", "/opt/pypi", "/opt/pypi-more")


class ImageBuildError(SandboxError):
    """A build step failed; the message names the step and ends with its log."""

    def __init__(self, step: str, log: str):
        self.step, self.log = step, log
        super().__init__(f"image build failed at {step}:\n{log[-3000:]}")


@dataclass(frozen=True)
class ImageSpec:
    source: str
    """Where the repository comes from: a git URL, a local path or a git bundle file."""
    commit: str
    """What to check out (the task's environment_setup_commit, else its base_commit)."""
    install: tuple[str, ...] = ()
    """Shell commands run in order in the checkout, as the sandbox user."""
    network: bool = True
    """Whether install commands may reach the network (package indexes)."""
    build_timeout_s: float = 1800.0
    start: str | None = None
    """The commit the agent starts from, checked out after `install` (None: `commit`)."""
    history: Literal["ancestors", "none"] = "ancestors"
    """What git history the prepared repository keeps (see `HISTORY_SCRIPT`)."""
    python: str | None = None
    """The interpreter of the environment's Python environment ("3.11": `python3.11`; None: the
    base system's `python3`)."""

    def python_env(self) -> bool:
        """Whether the environment gets its own Python environment (`PYTHON_ENV`): when it
        installs anything or names its Python. A task with neither runs on the system's Python
        and its image costs no venv."""
        return bool(self.install) or self.python is not None

    def key(self, backend: str, base: str = "") -> str:
        payload = json.dumps([LAYOUT, backend, base, self.source, self.commit, list(self.install),
                              self.start, self.history, self.python if self.python_env() else False])
        return hashlib.sha256(payload.encode()).hexdigest()[:32]

    def env_key(self, backend: str, base: str = "") -> str:
        """What the environment alone depends on (not where the agent starts): tasks of one
        repository that share their setup commit, install and Python share it."""
        payload = json.dumps([LAYOUT, "env", backend, base, self.source, self.commit, list(self.install),
                              self.python if self.python_env() else False])
        return "env-" + hashlib.sha256(payload.encode()).hexdigest()[:32]


PYTHON_ENV_SCRIPT = r"""
set -e
if ! command -v "$PY" >/dev/null 2>&1; then
  echo "the base system has no $PY; it has: $(cd /usr/bin && ls python3* 2>/dev/null | grep -E '^python3(\.[0-9]+)?$' | tr '\n' ' ')"
  exit 127
fi
[ -x "$ENV/bin/python" ] || "$PY" -m venv "$ENV"
mkdir -p .git/info
grep -qxF "/$ENV/" .git/info/exclude 2>/dev/null || printf '/%s/\n' "$ENV" >> .git/info/exclude
"""


# What install left in the work tree (egg-info, build folders, compiled extensions) is part of the
# environment, not of any change: git is told to ignore it (.git/info/exclude), so an agent's
# diff never carries it and a patch made in one sandbox applies in another built the same way.
INSTALLED_SCRIPT = r"""
set -e
mkdir -p .git/info
git ls-files -z --others --exclude-standard --directory | python3 -c '
import re, sys
names = [n for n in sys.stdin.buffer.read().decode("utf-8", "surrogateescape").split("\0") if n]
with open(".git/info/exclude", "a", encoding="utf-8", errors="surrogateescape") as f:
    f.writelines("/" + re.sub(r"([*?\[\\!# ])", r"\\\1", n) + "\n" for n in names)
'
"""


# A prebuilt image's repository as it ships: whatever is untracked there (SWE-bench's egg-info,
# R2E-Gym's /testbed/.venv) is the environment, told to git as INSTALLED_SCRIPT tells it of
# what install made. Shell and git only: a prebuilt image need not have python3 on PATH.
UNTRACKED_SCRIPT = r"""
set -e
mkdir -p .git/info
git ls-files -z --others --exclude-standard --directory | while IFS= read -r -d '' n; do
  case "$n" in *$'\n'*) continue ;; esac
  printf '/%s\n' "$n" | sed 's/[*?[\!# ]/\\&/g'
done >> .git/info/exclude
"""


async def exclude_untracked(sandbox, timeout_s: float = 600.0) -> None:
    """Run UNTRACKED_SCRIPT in the sandbox's repository. Raises ImageBuildError."""
    result = await sandbox.execute(f"bash -c {shlex.quote(UNTRACKED_SCRIPT)}", timeout_s=timeout_s)
    if result.exit_code != 0:
        raise ImageBuildError("listing what the image left untracked", result.output)


LAYOUT = 2  # bump when what a build makes changes: old caches are then rebuilt, never reused
BASE_TAG = "swerve-base"
# The repository at the starting commit with nothing after it: every ref but ancestor tags
# deleted, remotes, reflogs, stashes and unreachable objects gone; `none` keeps a single
# parentless commit of the starting tree (fixed author and date: the same tree, the same id).
# The tag BASE_TAG marks where the agent starts. Install products in the work tree stay.
HISTORY_SCRIPT = r"""
set -e
export GIT_AUTHOR_NAME=swerve GIT_AUTHOR_EMAIL=swerve@localhost GIT_AUTHOR_DATE=2000-01-01T00:00:00Z
export GIT_COMMITTER_NAME=swerve GIT_COMMITTER_EMAIL=swerve@localhost GIT_COMMITTER_DATE=2000-01-01T00:00:00Z
git -c advice.detachedHead=false checkout -q -f "$START"
base=$(git rev-parse HEAD)
if [ "$MODE" = none ]; then base=$(git commit-tree "$(git rev-parse 'HEAD^{tree}')" -m base); fi
[ -f .git/objects/info/alternates ] && git repack -a -d -q && rm -f .git/objects/info/alternates
git for-each-ref --format='%(refname)' | while read -r ref; do
  case "$ref" in refs/tags/*)
    if [ "$MODE" = ancestors ] && git merge-base --is-ancestor "$ref" "$base" 2>/dev/null; then continue; fi ;;
  esac
  git update-ref -d "$ref"
done
for remote in $(git remote); do git remote remove "$remote"; done
git update-ref refs/heads/main "$base"
git symbolic-ref HEAD refs/heads/main
git reset -q
git tag -f "$BASE" "$base" >/dev/null
rm -rf .git/logs .git/refs/original .git/ORIG_HEAD .git/FETCH_HEAD .git/MERGE_HEAD .git/rebase-merge .git/rebase-apply
git reflog expire --expire=now --all
git -c gc.cruftPacks=false gc -q --prune=now
"""


# an asyncio lock is bound to the first event loop that waits on it: one set per loop (a
# worker may run one loop after another), while the flock also serves threads of this process
_locks: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[str, asyncio.Lock]] = weakref.WeakKeyDictionary()


class _KeyLock:
    """An asyncio lock per key within the event loop, and an flock across loops and processes."""

    def __init__(self, folder: Path, key: str):
        self.path, self.key, self._fd = folder / f".lock-{key}", key, None
        self._lock: asyncio.Lock | None = None

    async def __aenter__(self):
        self._lock = _locks.setdefault(asyncio.get_running_loop(), {}).setdefault(self.key, asyncio.Lock())
        await self._lock.acquire()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(self.path, os.O_CREAT | os.O_RDWR)
        await asyncio.to_thread(fcntl.flock, self._fd, fcntl.LOCK_EX)
        return self

    async def __aexit__(self, *exc):
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)
        self._lock.release()


def checkout(spec: ImageSpec, dest: Path) -> None:
    """Clone the source into dest and check out the commit. Raises ImageBuildError."""
    steps = [("clone", ["git", "clone", "--quiet", "--no-checkout", spec.source, str(dest)]),
             ("checkout", ["git", "-C", str(dest), "-c", "advice.detachedHead=false",
                           "checkout", "--quiet", spec.commit])]
    for step, cmd in steps:
        done = subprocess.run(cmd, capture_output=True, text=True,
                              env=os.environ | {"GIT_TERMINAL_PROMPT": "0"})
        if done.returncode != 0:
            raise ImageBuildError(f"{step} of {spec.source} at {spec.commit}",
                                        done.stdout + done.stderr)


async def _make_python_env(sandbox, spec: ImageSpec) -> None:
    py = f"python{spec.python}" if spec.python else "python3"
    script = f"PY={shlex.quote(py)} ENV={PYTHON_ENV} bash -c {shlex.quote(PYTHON_ENV_SCRIPT)}"
    result = await sandbox.execute(script, timeout_s=spec.build_timeout_s)
    if result.exit_code == 127:
        raise ImageBuildError(f"python environment: the task's python {spec.python!r} (`{py}`) is not in "
                              "the base system; name one it has, or give the task a prebuilt `image`",
                              result.output)
    if result.exit_code != 0:
        raise ImageBuildError(f"python environment ({py} -m venv {PYTHON_ENV})", result.output)


async def _run_install(sandbox, spec: ImageSpec) -> None:
    await _install(sandbox, spec)
    await cut_history(sandbox, spec.start or spec.commit, spec.history, spec.build_timeout_s)


async def _install(sandbox, spec: ImageSpec) -> None:
    """The environment: its Python environment, `install`, what install made told to git."""
    if spec.python_env():
        await _make_python_env(sandbox, spec)
    for i, command in enumerate(spec.install, 1):
        result = await sandbox.execute(command, timeout_s=spec.build_timeout_s)
        if result.exit_code != 0:
            reason = "timed out" if result.timed_out else f"exit {result.exit_code}"
            raise ImageBuildError(f"install step {i} ({command!r}, {reason})", result.output)
    if spec.install:
        result = await sandbox.execute(INSTALLED_SCRIPT, timeout_s=spec.build_timeout_s)
        if result.exit_code != 0:
            raise ImageBuildError("listing what install made", result.output)


async def cut_history(sandbox, start: str, history: str, timeout_s: float = 1800.0) -> None:
    """Run HISTORY_SCRIPT in the sandbox's repository. Raises ImageBuildError."""
    script = f"START={shlex.quote(start)} MODE={history} BASE={BASE_TAG} bash -c {shlex.quote(HISTORY_SCRIPT)}"
    result = await sandbox.execute(script, timeout_s=timeout_s)
    if result.exit_code != 0:
        raise ImageBuildError(f"history ({history}) at {start}", result.output)


def shares_env(spec: ImageSpec) -> bool:
    """Whether the task image is made from a shared environment (built once per env_key): when
    there is an environment to build. A checkout alone is as cheap to make as to copy."""
    return spec.python_env()


async def prepare_bwrap(spec: ImageSpec, cache_dir: Path, share_env: bool = True) -> Path:
    """The prepared folder for spec, building it if needed; use it as BwrapSandboxConfig.root.
    With an environment to build, it is built once per env_key and each task's folder copied
    from it (reflinked where the filesystem can), then moved to the task's start."""
    key = spec.key("bwrap")
    final = cache_dir / key
    if final.is_dir():
        return final
    env = await _bwrap_folder(spec, cache_dir, spec.env_key("bwrap"), env_only=True) \
        if share_env and shares_env(spec) else None
    return await _bwrap_folder(spec, cache_dir, key, from_env=env)


async def _bwrap_folder(spec: ImageSpec, cache_dir: Path, key: str, env_only: bool = False,
                        from_env: Path | None = None) -> Path:  # fmt: skip
    from sandboxes.config import BwrapSandboxConfig

    final = cache_dir / key
    if final.is_dir():
        return final
    async with _KeyLock(cache_dir, key):
        if final.is_dir():
            return final
        build = cache_dir / f"{BUILD_PREFIX}{key}-{uuid.uuid4().hex[:8]}"
        build.mkdir(parents=True)
        cache_dir.chmod(0o700)  # the sandboxes' host uid can never reach a task image
        Owner.me(spec.build_timeout_s + 600, kind="build").write(build)
        try:
            if from_env is None:
                await asyncio.to_thread(checkout, spec, build / "work")
                await asyncio.to_thread(_own, build / "work", host_uid())
            else:
                await asyncio.to_thread(subprocess.run, ["cp", "-a", "--reflink=auto", str(from_env), str(build / "work")],
                                        check=True, capture_output=True)
            limits = SandboxLimits(network=spec.network, disk_mb=64, memory_mb=8192,
                                   pids=4096, command_timeout_s=spec.build_timeout_s)
            config = BwrapSandboxConfig(root=build / "work", writable_root=True, limits=limits,
                                        ro_binds=tuple(p for p in PIP_CONFIG_PATHS if os.path.exists(p)))
            async with _open(config) as sandbox:
                if from_env is None:
                    await _install(sandbox, spec)
                if not env_only:
                    await cut_history(sandbox, spec.start or spec.commit, spec.history, spec.build_timeout_s)
            await asyncio.to_thread(_drop_privileged_bits, build / "work")
            (build / "work").rename(final)
        finally:
            shutil.rmtree(build, ignore_errors=True)
    return final


async def prepare_docker(spec: ImageSpec, client=None, share_env: bool = True) -> str:
    """The image for spec (`swerve-env:<key>`), built from the base image if needed. With an
    environment to build, it is built once per env_key (`swerve-env:env-<key>`) and each task's
    image is a layer over it that moves the repository to the task's start."""
    from sandboxes.docker import docker_client
    from sandboxes.images import BASE_IMAGE, ensure_base_image

    client = client or await asyncio.to_thread(docker_client)
    base = await asyncio.to_thread(ensure_base_image, client, BASE_IMAGE)
    key = spec.key("docker", base)
    if await asyncio.to_thread(_has_image, client, f"swerve-env:{key}"):
        return f"swerve-env:{key}"
    env = await _docker_image(spec, client, spec.env_key("docker", base), env_only=True) \
        if share_env and shares_env(spec) else None
    return await _docker_image(spec, client, key, from_env=env)


async def _docker_image(spec: ImageSpec, client, key: str, env_only: bool = False,
                        from_env: str | None = None) -> str:  # fmt: skip
    from sandboxes.config import DockerSandboxConfig
    from sandboxes.reaper import state_root

    tag = f"swerve-env:{key}"
    if await asyncio.to_thread(_has_image, client, tag):
        return tag
    async with _KeyLock(state_root(), key):
        if await asyncio.to_thread(_has_image, client, tag):
            return tag
        tmp = state_root() / f"{BUILD_PREFIX}{key}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir(parents=True)
        Owner.me(spec.build_timeout_s + 600, kind="build").write(tmp)
        try:
            limits = SandboxLimits(network=spec.network, memory_mb=8192, pids=4096,
                                   command_timeout_s=spec.build_timeout_s, lifetime_s=spec.build_timeout_s + 600)
            async with _open(DockerSandboxConfig(image=from_env, limits=limits, episode=f"build:{key}")) as sandbox:
                if from_env is None:
                    await asyncio.to_thread(checkout, spec, tmp / "work")
                    await asyncio.to_thread(_copy_in, sandbox.container, tmp / "work")
                    await asyncio.to_thread(_copy_host_index_config, sandbox.container)
                    await _install(sandbox, spec)
                if not env_only:
                    await cut_history(sandbox, spec.start or spec.commit, spec.history, spec.build_timeout_s)
                await asyncio.to_thread(sandbox.container.commit, repository="swerve-env", tag=key,
                                        changes=[f"LABEL swerve.env={key}"])
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return tag


def _own(folder: Path, uid: int) -> None:
    """Give a checkout to the sandboxes' host uid, which the build then runs as."""
    os.chown(folder, uid, uid)
    for root, dirs, files in os.walk(folder):
        for name in dirs + files:
            os.chown(os.path.join(root, name), uid, uid, follow_symlinks=False)


def _drop_privileged_bits(folder: Path) -> None:
    """No setuid or setgid file survives a build (the sandboxes mount everything nosuid too)."""
    for root, _dirs, files in os.walk(folder):
        for name in files:
            path = os.path.join(root, name)
            mode = os.lstat(path).st_mode
            if not stat.S_ISLNK(mode) and mode & (stat.S_ISUID | stat.S_ISGID):
                os.chmod(path, stat.S_IMODE(mode) & ~(stat.S_ISUID | stat.S_ISGID))


def _has_image(client, tag: str) -> bool:
    import docker

    try:
        client.images.get(tag)
        return True
    except docker.errors.ImageNotFound:
        return False


def _copy_in(container, folder: Path) -> None:
    tar = subprocess.run(["tar", "-C", str(folder), "--owner=1000", "--group=1000",
                          "--transform", "s,^\\.,work,", "-c", "."],
                         capture_output=True, check=True).stdout
    container.put_archive("/", tar)


HOST_INDEX_FILES = ("/etc/pip.conf", "/etc/ssl/certs/ca-certificates.crt")


def _copy_host_index_config(container) -> None:
    """Give a Docker build the host's pip configuration and CA bundle (package-index proxies)."""
    import io
    import tarfile

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for path in HOST_INDEX_FILES:
            if os.path.isfile(path):
                tar.add(os.path.realpath(path), arcname=path.lstrip("/"))
    if buf.tell():
        container.put_archive("/", buf.getvalue())


def _open(config):
    from sandboxes.base import open_sandbox

    return open_sandbox(config)
