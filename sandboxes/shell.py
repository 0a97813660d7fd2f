"""A persistent bash session over pipes, with a marker protocol output cannot forge.

stdin carries commands (length-prefixed, read with `read -N`, so no quoting or delimiter can
break out); stdout carries the command's output, then an end marker; stderr is the control
channel, where the shell writes `<nonce> <exit code>` after each command. The nonce is drawn by
the shell after the command has finished, so nothing the command printed can contain it, and
commands run with the control channel closed.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Awaitable, Callable

from sandboxes.base import ExecResult

# The sandbox's main process: restarts the command shell whenever it exits, so `exit` or
# `kill -9 $$` costs the shell's cwd and variables but never the sandbox's files.
# On a timeout the shell gets SIGUSR1 before the command's processes are killed: the trap
# returns from the command's function, so the rest of its list does not run.
_SHELL_INIT = ("exec 4>&1 5>&2; unset HISTFILE; "
               "__swerve_run() { eval \"$__swerve_cmd\"; }; trap 'return 124' USR1; ")
SUPERVISOR = (
    "while :; do "
    "bash --noprofile --norc -c 'printf \"ready %s\\n\" $$ >&2; exec bash --noprofile --norc'; "
    "printf 'exited %s\\n' \"$?\" >&2; done"
)
# One line, so nothing of it is left unread in the pipe if the command ends the shell; the
# command's bytes follow it and are consumed by `read -N`.
_WRAP = (
    "IFS= LC_ALL=C read -r -d '' -N {n} __swerve_cmd; "
    "{{ __swerve_run; }} </dev/null 2>&1 4>&- 5>&-; "
    "__swerve_ec=$?; printf -v __swerve_m '%08x%08x%08x%08x' $SRANDOM $SRANDOM $SRANDOM $SRANDOM; "
    "printf '\\n\\037%s\\037' \"$__swerve_m\" >&4; printf '%s %d\\n' \"$__swerve_m\" $__swerve_ec >&5\n"
)
_CONTROL = re.compile(rb"^([0-9a-f]{32}) (-?\d+)$")
_READY = re.compile(rb"^ready (\d+)$")
_EXITED = re.compile(rb"^exited (\d+)$")
_CHUNK = 1 << 16
GRACE_S = 5.0


class ShellDied(Exception):
    """The command shell exited under a command; the supervisor has started a fresh one."""

    def __init__(self, returncode: int | None, output: str):
        self.returncode, self.output = returncode, output
        super().__init__(f"the shell exited with status {returncode}")


class SessionDead(Exception):
    """The whole sandbox process tree is gone: no shell will come back."""

    def __init__(self, returncode: int | None, output: str):
        self.returncode, self.output = returncode, output
        super().__init__(f"the sandbox exited with status {returncode}")


class _Capture:
    """Keeps the first and last halves of a command's output and counts the rest."""

    def __init__(self, limit: int):
        self.half = limit // 2
        self.head, self.tail, self.total = bytearray(), bytearray(), 0

    def add(self, data: bytes) -> None:
        self.total += len(data)
        if len(self.head) < self.half:
            room = self.half - len(self.head)
            self.head += data[:room]
            data = data[room:]
        self.tail += data
        if len(self.tail) > self.half + 4 * _CHUNK:
            del self.tail[: len(self.tail) - self.half - 4 * _CHUNK]

    def cut_marker(self, marker: bytes) -> bytes | None:
        """Drop the end marker and return what followed it, or None if not seen yet."""
        stream = self.tail if len(self.tail) >= 4096 else self.head + self.tail
        at = stream.rfind(marker)
        if at < 0:
            return None
        after = bytes(stream[at + len(marker) :])
        self._drop_end(len(stream) - at)
        return after

    def _drop_end(self, n: int) -> None:
        self.total -= n
        from_tail = min(n, len(self.tail))
        del self.tail[len(self.tail) - from_tail :]
        if n > from_tail:
            del self.head[len(self.head) - (n - from_tail) :]

    def text(self) -> str:
        kept = len(self.head) + len(self.tail)
        if self.total <= kept:
            return (bytes(self.head) + bytes(self.tail)).decode(errors="replace")
        tail = bytes(self.tail[len(self.tail) - self.half :]) if self.half else b""
        cut = self.total - len(self.head) - len(tail)
        return (bytes(self.head).decode(errors="replace") + f"\n[... {cut} bytes cut ...]\n"
                + tail.decode(errors="replace"))  # fmt: skip


class ShellSession:
    """A supervisor process and its current shell. `run` is not re-entrant: callers lock."""

    def __init__(self, proc, shell_pid: int, output_limit: int):
        self.proc, self.shell_pid, self.output_limit = proc, shell_pid, output_limit
        self._out: asyncio.Future | None = None
        self._ctl: asyncio.Future | None = None
        self._leftover = b""

    @classmethod
    async def start(cls, argv: list[str], *, output_limit: int, env: dict | None = None,
                    timeout_s: float = 30.0, pass_fds: tuple[int, ...] = (),
                    spawned: Callable[[], Awaitable[None]] | None = None) -> ShellSession:  # fmt: skip
        """Start `argv` (which must end by running SUPERVISOR) and wait for its first shell.
        `spawned` runs once the process exists, before the wait (it may raise: all is killed)."""
        proc = await asyncio.create_subprocess_exec(
            *argv, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE, env=env, limit=1 << 20, pass_fds=pass_fds,
        )  # fmt: skip
        return await cls.attach(proc, output_limit=output_limit, timeout_s=timeout_s, spawned=spawned)

    @classmethod
    async def attach(cls, proc, *, output_limit: int, timeout_s: float = 30.0,
                     spawned: Callable[[], Awaitable[None]] | None = None) -> ShellSession:  # fmt: skip
        """The session of a process already running SUPERVISOR (a subprocess, or anything with
        its streams: sandboxes/docker_exec.ExecProcess), once its first shell is ready."""
        session = cls(proc, 0, output_limit)
        try:
            async with asyncio.timeout(timeout_s):
                if spawned is not None:
                    await spawned()
                session.shell_pid = await session._await_ready()
        except TimeoutError:
            await session.kill()
            raise SessionDead(None, f"the shell did not start within {timeout_s} s") from None
        except BaseException:
            await session.kill()
            raise
        return session

    async def _await_ready(self) -> int:
        """Read control lines until the supervisor's shell says it is ready."""
        lines = []
        while True:
            if self._ctl is None:
                self._ctl = asyncio.ensure_future(self.proc.stderr.readline())
            line = await self._ctl
            self._ctl = None
            if not line:
                out = await self.proc.stdout.read()
                raise SessionDead(await self.proc.wait(),
                                  (b"".join(lines) + out).decode(errors="replace"))
            if match := _READY.match(line.strip()):
                self.proc.stdin.write(_SHELL_INIT.encode() + b"\n")
                await self.proc.stdin.drain()
                return int(match.group(1))
            lines.append(line)

    @property
    def alive(self) -> bool:
        return self.proc.returncode is None

    async def run(
        self, command: str, timeout_s: float, kill: Callable[[bool], Awaitable[None]],
        output_limit: int | None = None,
    ) -> ExecResult:
        """Run one command; on timeout call kill(False) (the command) then kill(True) (the shell).

        Raises ShellDied when the shell ends under the command, SessionDead when everything did.
        """
        started = time.monotonic()
        data = command.encode()
        capture = _Capture(output_limit or self.output_limit)
        if self._leftover:
            capture.add(self._leftover)
            self._leftover = b""
        try:
            self.proc.stdin.write(_WRAP.format(n=len(data)).encode() + data)
            await self.proc.stdin.drain()
        except (BrokenPipeError, ConnectionResetError):
            raise SessionDead(await self.proc.wait(), "") from None
        exit_code, timed_out = await self._collect(capture, started + timeout_s, kill)
        return ExecResult(
            output=capture.text(), exit_code=None if timed_out else exit_code,
            timed_out=timed_out, duration_s=time.monotonic() - started,
            output_bytes=capture.total,
        )  # fmt: skip

    async def _collect(self, capture: _Capture, deadline: float, kill) -> tuple[int, bool]:
        nonce, exit_code, timed_out, stage = None, 0, False, 0
        while True:
            if self._out is None:
                self._out = asyncio.ensure_future(self.proc.stdout.read(_CHUNK))
            if self._ctl is None and nonce is None:
                self._ctl = asyncio.ensure_future(self.proc.stderr.readline())
            waiting = [f for f in (self._out, self._ctl if nonce is None else None) if f]
            done, _ = await asyncio.wait(waiting, timeout=max(0.0, deadline - time.monotonic()),
                                         return_when=asyncio.FIRST_COMPLETED)
            if not done:
                if stage == 2:
                    await self.kill()
                    raise SessionDead(None, capture.text() + "\n[the sandbox stopped answering]")
                timed_out, deadline = True, time.monotonic() + GRACE_S
                await kill(stage == 1)  # first the command's processes, then the shell too
                stage += 1
                continue
            if self._ctl in done:
                line, self._ctl = self._ctl.result(), None
                if match := _CONTROL.match(line.strip()):
                    nonce, exit_code = match.group(1), int(match.group(2))
                elif match := _EXITED.match(line.strip()):
                    status = int(match.group(1))
                    self.shell_pid = await self._await_ready()
                    raise ShellDied(None if timed_out else status, capture.text())
            if self._out in done:
                chunk, self._out = self._out.result(), None
                if not chunk:
                    raise SessionDead(await self.proc.wait(), capture.text())
                capture.add(chunk)
            if nonce is not None:
                after = capture.cut_marker(b"\n\x1f" + nonce + b"\x1f")
                if after is not None:
                    self._leftover = after
                    return exit_code, timed_out

    async def kill(self) -> None:
        for fut in (self._out, self._ctl):
            if fut is not None:
                fut.cancel()
        self._out = self._ctl = None
        if self.proc.returncode is None:
            self.proc.kill()
        await self.proc.wait()
