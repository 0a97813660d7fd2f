"""Backends as fixtures: each test that takes `backend` runs on bubblewrap and on Docker."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from sandboxes.base import SandboxLimits
from sandboxes.cgroups import Cgroups, CgroupError
from sandboxes.config import BwrapSandboxConfig, DockerSandboxConfig
from tests.conftest import missing_service


def require_bwrap() -> None:
    if shutil.which("bwrap") is None or shutil.which("unshare") is None:
        missing_service("bubblewrap (apt-get install bubblewrap)")
    try:
        Cgroups.create(f"swerve-probe-{os.getpid()}", memory_mb=64, pids=64, cpus=1).destroy()
    except CgroupError as e:
        missing_service(f"cgroups for bubblewrap sandboxes ({e})")


def require_docker():
    import docker

    try:
        client = docker.from_env(timeout=30)
        client.ping()
    except docker.errors.DockerException as e:
        missing_service(f"a Docker engine ({e})")
    from sandboxes.images import ensure_base_image

    ensure_base_image(client)
    return client


def make_config(backend: str, tmp_path: Path, **limits):
    lim = SandboxLimits(**limits)
    if backend == "bwrap":
        return BwrapSandboxConfig(limits=lim, state_dir=tmp_path / "sandboxes")
    return DockerSandboxConfig(limits=lim)


@pytest.fixture(params=["bwrap", pytest.param("docker", marks=pytest.mark.docker)])
def backend(request) -> str:
    if request.param == "bwrap":
        require_bwrap()
    else:
        require_docker()
    return request.param


@pytest.fixture(scope="session")
def btrfs_docker():
    """A second Docker engine whose data is on btrfs (a sparse loop file), where the engine
    limits what a container writes (--storage-opt size); the base image copied in from the
    main engine. Yields its DOCKER_HOST. Needs root, btrfs-progs and loop devices."""
    import subprocess
    import tempfile
    import time

    from sandboxes.images import BASE_IMAGE

    require_docker()
    if os.geteuid() != 0 or shutil.which("mkfs.btrfs") is None or shutil.which("dockerd") is None:
        missing_service("a btrfs Docker engine (root, dockerd, apt-get install btrfs-progs)")
    root = Path(tempfile.mkdtemp(prefix="swerve-btrfs-"))
    data, host = root / "data", f"unix://{root}/docker.sock"
    data.mkdir()
    subprocess.run(["truncate", "-s", "16G", str(root / "fs.img")], check=True)
    subprocess.run(["mkfs.btrfs", "-q", str(root / "fs.img")], check=True, capture_output=True)
    mounted = subprocess.run(["mount", "-o", "loop", str(root / "fs.img"), str(data)], capture_output=True, text=True)
    if mounted.returncode != 0:
        shutil.rmtree(root, ignore_errors=True)
        missing_service(f"a loop-mounted btrfs for a second Docker engine ({mounted.stderr.strip()})")
    log = open(root / "dockerd.log", "w")
    # in a network namespace of its own: an engine without a bridge deletes the host's docker0
    engine = subprocess.Popen(["unshare", "--net", "dockerd", "--data-root", str(data), "--storage-driver", "btrfs", "-H", host,
                               "--pidfile", str(root / "docker.pid"), "--exec-root", str(root / "exec"),
                               "--bridge", "none", "--iptables=false"], stdout=log, stderr=subprocess.STDOUT)
    try:
        env = os.environ | {"DOCKER_HOST": host}
        for _ in range(60):
            if subprocess.run(["docker", "info"], env=env, capture_output=True).returncode == 0:
                break
            time.sleep(0.5)
        else:
            missing_service(f"a btrfs Docker engine: dockerd did not start ({(root / 'dockerd.log').read_text()[-500:]})")
        subprocess.run(f"docker save {BASE_IMAGE} | DOCKER_HOST={host} docker load -q", shell=True, check=True,
                       capture_output=True)
        yield host
    finally:
        engine.terminate()
        try:
            engine.wait(timeout=30)
        except subprocess.TimeoutExpired:
            engine.kill()
        log.close()
        subprocess.run(["umount", "-l", str(data)], capture_output=True)
        shutil.rmtree(root, ignore_errors=True)
