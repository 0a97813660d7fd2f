"""Docker's warm pool (SWERVE_DOCKER_POOL): a start takes a container made and prepared ahead,
each container goes to one sandbox only and never comes back, the pool refills in the
background, old ones are removed instead of handed out, and a dead owner's pool is reaped like
any sandbox."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import pytest

from sandboxes.base import SandboxError, SandboxLimits, open_sandbox
from sandboxes.config import DockerSandboxConfig
from sandboxes.docker import LABEL, POOL, reap_containers
from tests.sandbox_fixtures import require_docker

pytestmark = [pytest.mark.docker, pytest.mark.slow]


@pytest.fixture
def client(monkeypatch):
    client = require_docker()
    monkeypatch.setenv("SWERVE_DOCKER_POOL", "2")
    POOL.drain()
    yield client
    POOL.drain()


def _names(client, owner: int | None = None) -> set[str]:
    """The sandbox containers this process (or `owner`) made; other processes' are not ours to count."""
    return {c.name for c in _containers(client, owner)}


def _containers(client, owner: int | None = None) -> list:
    return client.containers.list(all=True, filters={"label": [LABEL, f"swerve.owner_pid={owner or os.getpid()}"]})


def _wait_ready(config, n: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while POOL.ready_count(config) < n:
        assert time.monotonic() < deadline, f"the pool holds {POOL.ready_count(config)} of {n} after {timeout:.0f} s"
        time.sleep(0.1)


async def test_starts_take_ready_containers_each_once(client):
    config = DockerSandboxConfig(limits=SandboxLimits(memory_mb=256, pids=64), episode="e-0")
    async with open_sandbox(config) as first:  # the pool is empty: made afresh, and the pool fills
        assert (await first.execute("id -u; pwd")).output.split() == ["1000", "/work"]
    assert first.id not in _names(client)  # a closed sandbox's container is removed, never pooled
    _wait_ready(config, 1)  # asked for once: one spare
    time.sleep(0.5)
    assert POOL.ready_count(config) == 1
    spare = _names(client)
    async with open_sandbox(config) as second:  # the spare; asked for twice, the pool fills to its size
        assert {second.id} == spare
    _wait_ready(config, 2)
    ready = set(_names(client))
    assert len(ready) == 2
    for container in _containers(client):  # the sandbox's limits, set at creation
        assert container.attrs["HostConfig"]["Memory"] == 256 * 2**20 and container.attrs["HostConfig"]["PidsLimit"] == 64

    async def episode(i: int) -> str:
        async with open_sandbox(config.model_copy(update={"episode": f"e-{i}"})) as sb:
            result = await sb.execute(f"echo {i} > /work/mine && cat /work/mine && id -u && ls /work")
            assert result.output.split() == [str(i), "1000", "mine"], result  # a fresh work tree each
            return sb.id

    taken = await asyncio.gather(*(episode(i) for i in range(1, 9)))
    assert len(set(taken)) == 8  # no container served two episodes
    assert ready <= set(taken)  # the two ready ones were handed out
    assert not set(taken) & _names(client)  # and every one removed at close
    _wait_ready(config, 2)  # refilled in the background
    other = config.model_copy(update={"limits": SandboxLimits(memory_mb=512)})
    assert POOL.ready_count(other) == 0  # another environment key has a pool of its own


async def test_the_pool_makes_containers_within_the_hosts_start_rate_and_hands_them_out_at_once(
        client, monkeypatch, tmp_path):
    """Filling the pool is creating containers, paced with every other start of the host
    (SWERVE_SANDBOX_STARTS_PER_S); handing a ready one out creates nothing and waits for no pace."""
    monkeypatch.setenv("SWERVE_SANDBOX_DIR", str(tmp_path / "sandboxes"))  # a start schedule of its own
    monkeypatch.setenv("SWERVE_SANDBOX_STARTS_PER_S", "1")
    config = DockerSandboxConfig()
    for _ in range(2):
        async with open_sandbox(config):
            pass
    _wait_ready(config, 2)
    made = sorted(float(c.labels["swerve.created_at"]) for c in _containers(client))
    assert len(made) == 2 and made[1] - made[0] >= 0.9, made
    for _ in range(2):
        started = time.monotonic()
        async with open_sandbox(config) as sb:
            assert (await sb.execute("echo ok")).output == "ok\n"
            assert time.monotonic() - started < 0.9  # no start instant waited for
    POOL.drain()


async def test_a_container_waiting_too_long_is_removed_not_handed_out(client, monkeypatch):
    monkeypatch.setenv("SWERVE_DOCKER_POOL_IDLE_S", "1")
    config = DockerSandboxConfig()
    async with open_sandbox(config):
        pass
    _wait_ready(config, 1)
    stale = _names(client)
    time.sleep(1.5)
    async with open_sandbox(config) as sb:
        assert sb.id not in stale
        assert (await sb.execute("echo ok")).output == "ok\n"
    deadline = time.monotonic() + 30
    while stale & _names(client):
        assert time.monotonic() < deadline, stale & _names(client)
        time.sleep(0.2)


async def test_a_pooled_container_keeps_the_whole_lifetime_for_its_sandbox(client, monkeypatch):
    monkeypatch.setenv("SWERVE_DOCKER_POOL_IDLE_S", "120")
    config = DockerSandboxConfig(limits=SandboxLimits(lifetime_s=600))
    async with open_sandbox(config):
        pass
    _wait_ready(config, 1)
    for container in _containers(client):
        assert float(container.labels["swerve.lifetime_s"]) == 720.0 and container.labels["swerve.pooled"] == "1"


async def test_a_container_made_under_other_settings_is_never_handed_out(client, monkeypatch):
    """Made where the operator accepted an unlimited work tree (tmp-only), a pooled container
    is not given to a sandbox that must have its disk limited: that start is refused as ever."""
    from sandboxes import docker as docker_sandbox

    monkeypatch.setenv("SWERVE_DOCKER_DISK_LIMIT", "tmp-only")
    config = DockerSandboxConfig(limits=SandboxLimits(disk_mb=32))
    async with open_sandbox(config):
        pass
    _wait_ready(config, 1)
    monkeypatch.setenv("SWERVE_DOCKER_DISK_LIMIT", "enforce")
    monkeypatch.setattr(docker_sandbox, "disk_limit_mode", lambda client, image: (None, "storage driver vfs on extfs"))
    with pytest.raises(SandboxError, match="cannot limit a container's disk"):
        async with open_sandbox(config):
            pass


OWNER = r"""
import asyncio, sys
from sandboxes.base import open_sandbox
from sandboxes.config import DockerSandboxConfig
from sandboxes.docker import POOL
import time

async def main():
    for _ in range(2):
        async with open_sandbox(DockerSandboxConfig()):
            pass
    while POOL.ready_count(DockerSandboxConfig()) < 2:
        time.sleep(0.1)
    print("ready", flush=True)
    if sys.argv[1] == "stay":
        await asyncio.sleep(3600)

asyncio.run(main())
"""


def test_a_dead_owners_pool_is_reaped(client):
    owner = subprocess.Popen([sys.executable, "-c", OWNER, "stay"], stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "SWERVE_DOCKER_POOL": "2"})
    try:
        assert owner.stdout.readline().strip() == "ready"
        pooled = _names(client, owner.pid)
        assert len(pooled) == 2
        assert not set(reap_containers(client)) & pooled  # alive: its pool stays
    finally:
        owner.send_signal(signal.SIGKILL)
        owner.wait()
    assert pooled <= set(reap_containers(client))
    assert not _names(client, owner.pid)


def test_a_process_that_exits_removes_its_pool(client):
    owner = subprocess.Popen([sys.executable, "-c", OWNER, "exit"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, env={**os.environ, "SWERVE_DOCKER_POOL": "2"})
    out, err = owner.communicate(timeout=120)
    assert owner.returncode == 0 and out == "ready\n", err
    assert not _names(client, owner.pid)  # removed at exit, before any reaper ran


@pytest.mark.parametrize("value", ["two", "-1", "100000"])
async def test_a_bad_pool_setting_is_named(client, monkeypatch, value):
    monkeypatch.setenv("SWERVE_DOCKER_POOL", value)
    before = _names(client)
    with pytest.raises(SandboxError, match=f"SWERVE_DOCKER_POOL={value!r}: give a number from 0 to 1024"):
        async with open_sandbox(DockerSandboxConfig()):
            pass
    assert _names(client) == before  # refused before any container was made
