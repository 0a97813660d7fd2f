"""Nothing of a sandbox survives close, its owner's SIGKILL, or a crash: no container, process,
mount, cgroup or folder once the reaper has run."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sandboxes import etc
from sandboxes.base import open_sandbox
from sandboxes.reaper import reap_local
from tests.sandbox_fixtures import backend, make_config  # noqa: F401 - fixture
from tests.test_sandboxes import host_processes_with

pytestmark = pytest.mark.slow

OWNER = r"""
import asyncio, json, sys
from pathlib import Path
from sandboxes.base import SandboxLimits
from sandboxes.config import BwrapSandboxConfig, DockerSandboxConfig

async def main(kind, state, n):
    boxes = []
    for i in range(n):
        # bubblewrap with network on: its slirp4netns must not outlive the owner either
        cfg = (BwrapSandboxConfig(state_dir=Path(state), limits=SandboxLimits(network=True)) if kind == "bwrap"
               else DockerSandboxConfig())
        box = await cfg.build()
        await box.execute("sleep 4242.5 & setsid sleep 4242.5 & (nohup sleep 4242.5 &) ; echo x > /work/f")
        boxes.append(box.id)
    print(json.dumps(boxes), flush=True)
    await asyncio.sleep(3600)

asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3])))
"""


def leftovers(backend: str, state: Path, ids: list[str]) -> list[str]:
    found = [f"process {p}" for p in host_processes_with("4242.5")]
    found += [f"slirp4netns {p}" for p in host_processes_with("slirp4netns")]
    cgroup_roots = [Path("/sys/fs/cgroup") / c for c in ("pids", "memory", "cpu", "freezer")]
    for sandbox_id in ids:
        found += [str(p) for root in cgroup_roots for p in root.rglob(sandbox_id)]
        if (state / sandbox_id).exists():
            found.append(str(state / sandbox_id))
    mounts = Path("/proc/mounts").read_text()
    found += [f"mount {i}" for i in ids if i in mounts]
    if backend == "docker":
        import docker

        names = {c.name for c in docker.from_env().containers.list(all=True)}
        found += [f"container {i}" for i in ids if i in names]
    return found


async def test_close_leaves_nothing(backend, tmp_path):
    async with open_sandbox(make_config(backend, tmp_path)) as sb:
        await sb.execute("sleep 4242.5 & setsid sleep 4242.5 & (nohup sleep 4242.5 &)")
        assert host_processes_with("4242.5")
        sandbox_id = sb.id
    assert leftovers(backend, tmp_path / "sandboxes", [sandbox_id]) == []


async def test_close_leaves_nothing_when_the_processes_do_not_go_by_themselves(tmp_path, monkeypatch):
    """bubblewrap's close waits a little for the namespace's processes to die with its init,
    then kills what is left on a thread (freezing the cgroup): that path, with no wait at all."""
    from sandboxes import bwrap
    from tests.sandbox_fixtures import require_bwrap

    require_bwrap()
    monkeypatch.setattr(bwrap, "_SETTLE_S", ())
    async with open_sandbox(make_config("bwrap", tmp_path)) as sb:
        await sb.execute("sleep 4242.5 & setsid sleep 4242.5 & (nohup sleep 4242.5 &)")
        for _ in range(100):  # a background command may not have executed sleep yet
            if len(host_processes_with("4242.5")) == 3:
                break
            await asyncio.sleep(0.02)
        assert len(host_processes_with("4242.5")) == 3
        sandbox_id = sb.id
    assert leftovers("bwrap", tmp_path / "sandboxes", [sandbox_id]) == []


async def test_a_network_that_cannot_come_up_fails_the_start_and_leaves_nothing(tmp_path, monkeypatch):
    """slirp4netns failing (a container without /dev/net/tun, as a Compose worker had) is an error
    naming it, at once: before, the sandbox's init waited on its block fd holding the shell's
    pipes, and the start waited for those pipes forever."""
    from sandboxes.base import SandboxError, SandboxLimits
    from sandboxes.config import BwrapSandboxConfig
    from tests.sandbox_fixtures import require_bwrap

    require_bwrap()
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "slirp4netns").write_text('#!/bin/sh\necho "open(\\"/dev/net/tun\\"): No such file" >&2\nexit 1\n')
    (fake / "slirp4netns").chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake}:{os.environ['PATH']}")
    state = tmp_path / "sandboxes"
    config = BwrapSandboxConfig(state_dir=state, limits=SandboxLimits(network=True))
    started = time.monotonic()
    with pytest.raises(SandboxError, match="slirp4netns did not come up: open.*/dev/net/tun"):
        await asyncio.wait_for(config.build(), 60)
    assert time.monotonic() - started < 30
    assert [p.name for p in state.iterdir()] == [etc.FOLDER]  # the sandboxes' shared copy of /etc alone
    assert leftovers("bwrap", state, [p.name for p in state.iterdir() if p.name != etc.FOLDER]) == []


def test_sigkilled_owner_leaves_nothing_after_the_reaper(backend, tmp_path):
    state = tmp_path / "sandboxes"
    owner = subprocess.Popen([sys.executable, "-c", OWNER, backend, str(state), "3"],
                             stdout=subprocess.PIPE, text=True, env=os.environ | {"SWERVE_SANDBOX_DIR": str(state)})
    ids = json.loads(owner.stdout.readline())
    assert len(ids) == 3 and host_processes_with("4242.5")
    owner.send_signal(signal.SIGKILL)
    owner.wait()

    assert leftovers(backend, state, ids)  # the owner's death alone does not clean up
    if backend == "bwrap":
        reap_local(state)
    else:
        from sandboxes.docker import reap_containers

        reap_containers()  # (a periodic reaper in this process may have been first)
    deadline = time.monotonic() + 10
    while leftovers(backend, state, ids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert leftovers(backend, state, ids) == []


def test_reaper_spares_live_owners(tmp_path):
    from tests.sandbox_fixtures import require_bwrap

    require_bwrap()
    state = tmp_path / "sandboxes"
    owner = subprocess.Popen([sys.executable, "-c", OWNER, "bwrap", str(state), "1"],
                             stdout=subprocess.PIPE, text=True)
    try:
        ids = json.loads(owner.stdout.readline())
        assert reap_local(state) == []
        assert (state / ids[0]).is_dir()
    finally:
        owner.kill()
        owner.wait()
    assert reap_local(state) == ids
