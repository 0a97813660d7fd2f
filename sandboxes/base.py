"""The Sandbox protocol, its result record and error, and the limits every backend enforces.

A failing or timed-out command is an ExecResult (an observation for the model); only a sandbox
that cannot serve at all raises SandboxError.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field


@dataclass(frozen=True, slots=True)
class ExecResult:
    output: str
    """stdout and stderr interleaved, cut in the middle when over the output cap."""
    exit_code: int | None
    """None when the command timed out or the shell died under it."""
    timed_out: bool
    duration_s: float
    output_bytes: int = 0
    """How many bytes the command printed in all (more than len(output) when cut)."""
    shell_restarted: bool = False
    """True when the shell had to be replaced: cwd and exported variables were reset."""


class SandboxError(Exception):
    """The sandbox cannot serve: it failed to start, died, or its task image failed to build."""


class Sandbox(Protocol):
    id: str

    async def execute(self, command: str, *, timeout_s: float | None = None) -> ExecResult:
        """Run a command in the persistent shell. Raises SandboxError if the sandbox is dead."""
        ...

    async def read_file(self, path: str) -> bytes:
        """Read a file inside the sandbox. Raises FileNotFoundError or SandboxError."""
        ...

    async def write_file(self, path: str, content: bytes | str) -> None:
        """Write a file inside the sandbox, creating parent folders. Raises SandboxError."""
        ...

    async def close(self) -> None:
        """Stop every process and remove everything the sandbox made; safe to call twice."""
        ...


class SandboxLimits(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    memory_mb: int = Field(4096, ge=16)
    """Memory for all processes together (MiB); exceeding it kills the offender (exit 137)."""
    cpus: float = Field(2.0, gt=0)
    """CPU time share, in cores."""
    pids: int = Field(512, ge=8)
    """Most processes and threads alive at once (stops fork bombs)."""
    disk_mb: int = Field(8192, ge=16)
    """Writable space for changes to the task image and /tmp (MiB), where the backend can."""
    network: bool = False
    """Whether commands may open network connections. Off unless the task asks."""
    command_timeout_s: float = Field(600.0, gt=0)
    """Default per-command timeout (s); execute() may pass its own."""
    lifetime_s: float = Field(6 * 3600.0, gt=0)
    """Wall-clock life of the sandbox (s), separate from command timeouts; the reaper ends it."""
    output_limit_bytes: int = Field(64 * 1024, ge=256)
    """Most output kept per command; the middle is cut with a marker saying how much."""
    on_shell_exit: Literal["restart", "error"] = "restart"
    """When a command ends the shell (`exit`, `kill -9 $$`): start a fresh one, or raise."""


@asynccontextmanager
async def open_sandbox(config, urgent: bool = False) -> AsyncIterator[Sandbox]:
    """Start a sandbox from a config with a build() method once the host admits it (a live
    slot and a start instant, sandboxes/admission.py; `urgent`: before this process's other
    waiting sandboxes); close it whatever happens."""
    from sandboxes.admission import admitted

    # a sandbox handed out ready-made (Docker's warm pool) took its start instant when it was made
    ready = getattr(config, "ready_made", None)
    async with admitted(getattr(config, "type", "sandbox"), pace=not (ready is not None and ready()), urgent=urgent):
        sandbox = await config.build()
        try:
            yield sandbox
        finally:
            await sandbox.close()


PYTHON_ENV = ".venv"
"""The environment's own Python environment, in the repository's folder (as SWE-bench's
activated `testbed`): first on PATH for the install commands, the agent's shell and grading
alike, so `pip install -e .` works as SWE-bench's specs write it; git ignores it (through
.git/info/exclude, which is no part of the repository), so no diff ever holds it."""


def path_with_env(workdir: str, rest: str) -> str:
    """PATH with the environment's Python environment first (PYTHON_ENV under `workdir`)."""
    return f"{workdir.rstrip('/')}/{PYTHON_ENV}/bin:{rest}"
