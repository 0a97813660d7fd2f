"""What every shell-backed sandbox shares: locked command execution with shell-death
handling, and file access through the sandbox's own shell (so paths resolve inside the
sandbox only: a symlink an agent planted can never aim a host-side read or write at the host).
"""

from __future__ import annotations

import asyncio
import base64
import posixpath
import shlex
import time

from sandboxes.base import ExecResult, SandboxError, SandboxLimits
from sandboxes.shell import SessionDead, ShellDied, ShellSession

_MAX_FILE_BYTES = 256 * 1024 * 1024


class ShellSandbox:
    """Backends provide `_kill(include_shell)` and `_revive()`; this does the rest."""

    id: str
    workdir: str
    limits: SandboxLimits
    shell: ShellSession | None

    def __init__(self) -> None:
        self._lock = asyncio.Lock()
        self._closed = False

    async def _kill(self, include_shell: bool) -> None:
        """Kill the running command's processes (and the shell itself if asked)."""
        raise NotImplementedError

    async def _revive(self) -> bool:
        """Start a new supervisor after the old one died; False when the sandbox itself is gone."""
        return False

    async def execute(self, command: str, *, timeout_s: float | None = None) -> ExecResult:
        return await self._exec(command, timeout_s=timeout_s or self.limits.command_timeout_s)

    async def _exec(self, command: str, *, timeout_s: float,
                    output_limit: int | None = None) -> ExecResult:  # fmt: skip
        async with self._lock:
            if self._closed:
                raise SandboxError(f"sandbox {self.id} is closed")
            started = time.monotonic()
            try:
                return await self.shell.run(command, timeout_s, self._kill, output_limit)
            except ShellDied as e:
                died = e
            except SessionDead as e:
                if self._closed or not await self._revive():
                    reason = "was closed" if self._closed else f"died (status {e.returncode})"
                    raise SandboxError(f"sandbox {self.id} {reason}: {e.output[-500:]}") from e
                died = ShellDied(e.returncode, e.output)
            if self.limits.on_shell_exit == "error":
                raise SandboxError(f"the shell of sandbox {self.id} exited with status "
                                   f"{died.returncode}") from died
            return _shell_died_result(died, self.workdir, time.monotonic() - started)

    def _path(self, path: str) -> str:
        return posixpath.normpath(posixpath.join(self.workdir, path))

    async def read_file(self, path: str) -> bytes:
        target = shlex.quote(self._path(path))
        result = await self._exec(
            f"if [ -f {target} ]; then base64 -w0 -- {target}; else printf __swerve_missing__; fi",
            timeout_s=120, output_limit=_MAX_FILE_BYTES * 2)
        if result.output == "__swerve_missing__":
            raise FileNotFoundError(path)
        if result.exit_code != 0:
            raise SandboxError(f"cannot read {path}: {result.output[-500:]}")
        if result.output_bytes > len(result.output.encode()):
            raise SandboxError(f"{path} is too large to read whole; raise output_limit_bytes")
        return base64.b64decode(result.output)

    async def write_file(self, path: str, content: bytes | str) -> None:
        data = content.encode() if isinstance(content, str) else content
        if len(data) > _MAX_FILE_BYTES:
            raise SandboxError(f"refusing to write {len(data)} bytes to {path}")
        target = self._path(path)
        encoded = base64.b64encode(data).decode()
        result = await self._exec(
            f"mkdir -p -- {shlex.quote(posixpath.dirname(target))} && "
            f"base64 -d > {shlex.quote(target)} <<'__SWERVE_B64__'\n{encoded}\n__SWERVE_B64__",
            timeout_s=120, output_limit=64 * 1024)
        if result.exit_code != 0:
            raise SandboxError(f"cannot write {path}: {result.output[-500:]}")


def _shell_died_result(died: ShellDied, workdir: str, duration_s: float) -> ExecResult:
    if died.returncode is None:
        note = "[the command did not stop at its timeout: the shell was replaced]"
    else:
        note = f"[the shell exited with status {died.returncode}]"
    return ExecResult(
        output=f"{died.output}\n{note} A fresh shell started in {workdir}; variables and the "
               "working directory were reset, files were kept.",
        exit_code=died.returncode, timed_out=died.returncode is None, duration_s=duration_s,
        output_bytes=len(died.output), shell_restarted=True,
    )  # fmt: skip
