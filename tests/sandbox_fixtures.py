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
