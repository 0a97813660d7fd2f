"""Sandbox configs: a discriminated union on `type`, each building its backend lazily."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from sandboxes.base import Sandbox, SandboxLimits


class BwrapSandboxConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    type: Literal["bwrap"] = "bwrap"
    root: Path | None = None
    """Task image folder, seen copy-on-write at `workdir`. None: an empty workdir."""
    writable_root: bool = False
    """Bind `root` itself read-write (image builds) instead of a copy-on-write view."""
    workdir: str = "/work"
    limits: SandboxLimits = SandboxLimits()
    ro_binds: tuple[str, ...] = ()
    """Extra host paths exposed read-only at the same place (e.g. a Python install); one under /etc
    is copied into the sandbox's copy of /etc (sandboxes/etc.py), checked against the host as it is."""
    state_dir: Path | None = None
    """Where sandboxes keep their state. None: $SWERVE_SANDBOX_DIR or /tmp/swerve-sandboxes."""
    episode: str | None = None
    """Label: the episode this sandbox serves (for logs and reaping)."""

    async def build(self) -> Sandbox:
        from sandboxes.bwrap import BwrapSandbox

        return await BwrapSandbox.start(self)


class DockerSandboxConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    type: Literal["docker"] = "docker"
    image: str | None = None
    """Image reference (pin by digest for training runs). None: the locally built base image."""
    workdir: str = "/work"
    limits: SandboxLimits = SandboxLimits()
    episode: str | None = None
    remove_paths: tuple[Annotated[str, Field(pattern=r"^/[A-Za-z0-9._-][A-Za-z0-9._/-]*$")], ...] = ()
    """Paths of the image removed, as root, before the sandbox's first command: what a prebuilt
    image ships that the agent must not reach (R2E-Gym's hidden tests, /r2e_tests)."""
    path_first: tuple[Annotated[str, Field(pattern=r"^/[A-Za-z0-9._/-]+$")], ...] = ()
    """Folders put first on a prebuilt image's PATH, as its harness runs every command (R2E-Gym:
    a SWE-bench image's conda `testbed` environment)."""

    @field_validator("remove_paths")
    @classmethod
    def _no_parent(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        if any(".." in p.split("/") for p in v):
            raise ValueError("remove_paths may not climb with '..'")
        return v

    def ready_made(self) -> bool:
        """Whether this process's warm pool holds a container for this config now."""
        from sandboxes.docker import POOL

        return POOL.size() > 0 and POOL.ready_count(self) > 0

    async def build(self) -> Sandbox:
        from sandboxes.docker import DockerSandbox

        return await DockerSandbox.start(self)


SandboxConfig = Annotated[BwrapSandboxConfig | DockerSandboxConfig, Field(discriminator="type")]
