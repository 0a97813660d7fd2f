"""A persistent bash session over pipes, with a marker protocol output cannot forge.

stdin carries commands (length-prefixed, read with `read -N`, so no quoting or delimiter can
break out); stdout carries the command's output, then an end marker; stderr is the control
channel, where the shell writes `<nonce> <exit code>` after each command. The nonce is drawn by
the shell after the command has finished, so nothing the command printed can contain it, and
commands run with the control channel closed.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import subprocess
import time
from collections.abc import Awaitable, Callable

from sandboxes.base import ExecResult

# The sandbox's main process: restarts the command shell whenever it exits, so `exit` or
# `kill -9 $$` costs the shell's cwd and variables but never the sandbox's files.
# On a timeout the shell gets SIGUSR1 before the command's processes are killed: the trap
# returns from the command's function, so the rest of its list does not run.
_SHELL_INIT = ("exec 4>&1 5>&2; unset HISTFILE; "
               "__swerve_run() { eval \"$__swerve_cmd\"; }; trap 'return 124' USR1; ")
# The shell is a fork of the supervisor that says its pid, then becomes bash: one program
# started per shell, not two (a `bash -c` saying it, then the bash it execs).
SUPERVISOR = (
    "while :; do "
    "(printf 'ready %s\\n' \"$BASHPID\" >&2; exec bash --noprofile --norc); "
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
    """Keeps the first and last halves of a command's output and counts the rest, and past them
    `slack` bytes, where the end marker may be before its nonce is known."""

    def __init__(self, limit: int):
        self.half = limit // 2
        self.head, self.tail, self.total = bytearray(), bytearray(), 0
        self.slack = 4 * _CHUNK
        self._head_seen = 0

    def add(self, data: bytes) -> None:
        self.total += len(data)
        if len(self.head) < self.half:
            room = self.half - len(self.head)
            self.head += data[:room]
            data = data[room:]
        self.tail += data
        if len(self.tail) > self.half + self.slack:
            del self.tail[: len(self.tail) - self.half - self.slack]

    def cut_marker(self, marker: bytes) -> bytes | None:
        """Drop the end marker and return what followed it, or None if not seen yet."""
        at = self._find(marker)
        if at < 0:
            return None
        h, end = len(self.head), at + len(marker)
        after = bytes(self.tail[end - h:]) if end >= h else bytes(self.head[end:]) + bytes(self.tail)
        self._drop_end(h + len(self.tail) - at)
        return after

    def _find(self, marker: bytes) -> int:
        """Where `marker` starts in head + tail, or -1. The head is searched once per byte: a
        command's output may have filled it and gone on into the tail before its nonce came."""
        h, m = len(self.head), len(marker)
        at = self.tail.rfind(marker)
        if at >= 0:
            return h + at
        start = max(0, self._head_seen - m + 1)
        window = bytes(self.head[start:])
        if self.total == h + len(self.tail):  # nothing cut between them: the marker may straddle
            window += bytes(self.tail[: m - 1])
        self._head_seen = h
        at = window.find(marker)
        return start + at if at >= 0 else -1

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


class Channel:
    """A supervisor's stdout and stderr as they arrive, for the one command reading them: each
    wake-up is one future, resolved by whichever stream moved. (asyncio's two StreamReaders
    cost a read task per stream and an `asyncio.wait` with its timer at every wake-up: the
    shell's part of a command's CPU.) Past twice `limit` bytes unread a stream pauses
    (`pause(fd, True)`, set by the process that feeds it) until its reader takes it below
    `limit`, as a StreamReader's transport does: a process left flooding its output between
    commands waits on its pipe instead of filling the worker's memory.

    A waiter wakes for what it can use: a whole line of stderr (or its end, or more than `limit`
    without a newline, as take_line gives them), and on stdout as many bytes as it asked for
    (any by default) or its end. A command's reader asks for a chunk's worth of stdout until its
    control line has come, so a command wakes it once, not once per write of its output, end
    marker and control line (each wake-up a step of its task and a timer, 2026-12-07)."""

    def __init__(self, limit: int = 1 << 20):
        self.out, self.err = bytearray(), bytearray()
        self.out_eof = self.err_eof = False
        self.limit = limit
        self.pause: Callable[[int, bool], None] | None = None
        self._paused: set[int] = set()
        self._waiter: asyncio.Future | None = None
        self._wake_out = 1  # stdout bytes that wake the waiter (Channel.wait's out_bytes)

    def feed(self, fd: int, data: bytes) -> None:
        """Data of stdout (1) or stderr (2)."""
        buf = self.err if fd == 2 else self.out
        buf.extend(data)
        if len(buf) > 2 * self.limit and fd not in self._paused and self.pause is not None:
            self._paused.add(fd)
            self.pause(fd, True)
        if fd == 2:  # a reader takes every whole line before it waits: a new one is in `data`
            if b"\n" in data or len(buf) > self.limit:
                self._wake(True)
        elif len(buf) >= self._wake_out or fd in self._paused:
            self._wake(True)

    def feed_eof(self, fd: int) -> None:
        if fd == 2:
            self.err_eof = True
        else:
            self.out_eof = True
        self._wake(True)

    @property
    def paused(self) -> bool:
        """Some stream is paused (set before `pause` is called)."""
        return bool(self._paused)

    def _wake(self, moved: bool) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(moved)

    def _taken(self, fd: int) -> None:
        if fd in self._paused and len(self.err if fd == 2 else self.out) <= self.limit:
            self._paused.discard(fd)
            self.pause(fd, False)

    def take_out(self, n: int | None = None) -> bytes:
        """The first `n` bytes of stdout (all by default)."""
        data = bytes(self.out[:n])
        del self.out[:n]
        self._taken(1)
        return data

    def take_line(self) -> bytes | None:
        """The next line of stderr; at its end, or past `limit` without a newline, what is left."""
        at = self.err.find(b"\n")
        if at < 0 and not (self.err and (self.err_eof or len(self.err) > self.limit)):
            return None
        end = at + 1 if at >= 0 else len(self.err)
        line = bytes(self.err[:end])
        del self.err[:end]
        self._taken(2)
        return line

    async def wait(self, deadline: float | None = None, out_bytes: int = 1) -> bool:
        """Until stderr has a new line (or more than `limit` bytes, or its end), stdout holds
        `out_bytes` or more (or ends) (True), or the event loop's clock reaches `deadline`
        (False). A caller takes every whole line of stderr before it waits."""
        loop = asyncio.get_running_loop()
        self._waiter = waiter = loop.create_future()
        self._wake_out = out_bytes
        timer = None if deadline is None else loop.call_at(deadline, self._wake, False)
        try:
            return await waiter
        finally:
            self._waiter, self._wake_out = None, 1
            if timer is not None:
                timer.cancel()


class _Stdin:
    """A subprocess's stdin as ShellSession writes it (asyncio's pipe transport): write and drain."""

    def __init__(self, transport: asyncio.WriteTransport):
        self.transport = transport
        self.lost = False
        self._drained: asyncio.Future | None = None

    def write(self, data: bytes) -> None:
        if self.lost or self.transport.is_closing():
            raise BrokenPipeError("the shell's stdin is closed")
        self.transport.write(data)

    async def drain(self) -> None:
        if self.lost:
            raise ConnectionResetError("the shell's stdin is closed")
        if self._drained is not None:
            await asyncio.shield(self._drained)
            if self.lost:
                raise ConnectionResetError("the shell's stdin is closed")

    def paused(self, on: bool) -> None:
        if on and self._drained is None:
            self._drained = asyncio.get_running_loop().create_future()
        elif not on and self._drained is not None:
            if not self._drained.done():
                self._drained.set_result(None)
            self._drained = None


class _Protocol(asyncio.SubprocessProtocol):
    def __init__(self, proc: TransportProcess):
        self.proc = proc

    def pipe_data_received(self, fd: int, data: bytes) -> None:
        self.proc.channel.feed(fd, data)

    def pipe_connection_lost(self, fd: int, exc: Exception | None) -> None:
        if fd == 0:
            if self.proc.stdin is not None:
                self.proc.stdin.lost = True
                self.proc.stdin.paused(False)
        else:
            self.proc.channel.feed_eof(fd)

    def pause_writing(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.paused(True)

    def resume_writing(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.paused(False)

    def process_exited(self) -> None:
        if not self.proc.exited.done():
            self.proc.exited.set_result(None)


class TransportProcess:
    """A subprocess through asyncio's subprocess transport, whose stdout and stderr feed a
    Channel: what ShellSession drives (stdin, channel, pid, returncode, wait, kill), as
    PipeProcess and sandboxes/docker_exec.ExecProcess have it too. PipeProcess's fallback where
    the kernel has no pidfd (before Linux 5.3), and its before in bench/sandbox_cpu.py."""

    def __init__(self, limit: int):
        self.channel = Channel(limit)
        self.stdin: _Stdin | None = None
        self.exited: asyncio.Future = asyncio.get_running_loop().create_future()
        self._transport: asyncio.SubprocessTransport | None = None

    @classmethod
    async def spawn(cls, argv: list[str], *, limit: int, env: dict | None = None,
                    pass_fds: tuple[int, ...] = ()) -> TransportProcess:  # fmt: skip
        proc = cls(limit)
        PIPE = asyncio.subprocess.PIPE
        transport, _ = await asyncio.get_running_loop().subprocess_exec(
            lambda: _Protocol(proc), *argv, stdin=PIPE, stdout=PIPE, stderr=PIPE, env=env, pass_fds=pass_fds)
        proc._transport = transport
        proc.stdin = _Stdin(transport.get_pipe_transport(0))
        proc.channel.pause = proc._pause_reading
        return proc

    def _pause_reading(self, fd: int, on: bool) -> None:
        pipe = self._transport.get_pipe_transport(fd)
        if pipe is not None and not pipe.is_closing():
            pipe.pause_reading() if on else pipe.resume_reading()

    @property
    def pid(self) -> int:
        return self._transport.get_pid()

    @property
    def returncode(self) -> int | None:
        return self._transport.get_returncode()

    async def wait(self) -> int:
        await asyncio.shield(self.exited)
        return self.returncode

    def kill(self) -> None:
        if self.returncode is None:
            self._transport.kill()

    def close(self) -> None:
        """Once it has exited: its pipes closed now, not when what else held them lets go."""
        self._transport.close()


_READ = 1 << 18  # as asyncio's pipe transport reads


class _PipeWriter:
    """A non-blocking pipe written straight from the event loop: what fits goes at once, the rest
    when the pipe has room (drain waits for it)."""

    def __init__(self, fd: int, loop: asyncio.AbstractEventLoop):
        self.fd, self.lost, self._loop = fd, False, loop
        self._pending = bytearray()
        self._drained: asyncio.Future | None = None

    def write(self, data: bytes) -> None:
        if self.lost:
            raise BrokenPipeError("the shell's stdin is closed")
        if not self._pending:
            try:
                data = data[os.write(self.fd, data):]
            except BlockingIOError:
                pass
            except OSError:  # EPIPE: the shell is gone
                self._lose()
                raise BrokenPipeError("the shell's stdin is closed") from None
            if not data:
                return
            self._loop.add_writer(self.fd, self._flush)
        self._pending += data

    def _flush(self) -> None:
        try:
            del self._pending[:os.write(self.fd, self._pending)]
        except BlockingIOError:
            return
        except OSError:
            self._lose()
            return
        if not self._pending:
            self._loop.remove_writer(self.fd)
            self._wake()

    def _wake(self) -> None:
        if self._drained is not None and not self._drained.done():
            self._drained.set_result(None)
        self._drained = None

    def _lose(self) -> None:
        self.lost = True
        self._pending.clear()
        self._loop.remove_writer(self.fd)
        self._wake()

    async def drain(self) -> None:
        if self._pending and not self.lost:
            if self._drained is None:
                self._drained = self._loop.create_future()
            await asyncio.shield(self._drained)
        if self.lost:
            raise ConnectionResetError("the shell's stdin is closed")

    def close(self) -> None:
        if self.fd >= 0:
            self._lose()
            os.close(self.fd)
            self.fd = -1


class PipeProcess:
    """A subprocess on three pipes the event loop watches itself, and a pidfd for its exit; its
    stdout and stderr feed a Channel: what ShellSession drives (stdin, channel, pid, returncode,
    wait, kill, close), as sandboxes/docker_exec.ExecProcess has it too. Against asyncio's
    subprocess transport (TransportProcess) it has no thread blocked in waitpid per child (the
    default child watcher of Python 3.11) and no transport, protocol and pipe-connecting task
    per stream: bench/sandbox_cpu.py. Where the kernel has no pidfd, `spawn` returns a
    TransportProcess."""

    def __init__(self, limit: int, popen: subprocess.Popen, stdin: int, out: int, err: int, pidfd: int):
        self._loop = loop = asyncio.get_running_loop()
        self.channel = Channel(limit)
        self.channel.pause = self._pause_reading
        self.stdin = _PipeWriter(stdin, loop)
        self.exited: asyncio.Future = loop.create_future()
        self._popen, self._pidfd = popen, pidfd
        self._reading = {1: out, 2: err}  # fd number in the child -> our end, until its EOF
        for fd, end in self._reading.items():
            loop.add_reader(end, self._read, fd)
        loop.add_reader(pidfd, self._reap)

    @classmethod
    async def spawn(cls, argv: list[str], *, limit: int, env: dict | None = None,
                    pass_fds: tuple[int, ...] = ()) -> PipeProcess | TransportProcess:  # fmt: skip
        if not _HAS_PIDFD:
            return await TransportProcess.spawn(argv, limit=limit, env=env, pass_fds=pass_fds)
        ours, theirs = [], []  # stdin, stdout, stderr: the child reads the first, writes the others
        try:
            for stream in range(3):
                r, w = os.pipe2(os.O_CLOEXEC)
                ours.append(w if stream == 0 else r)
                theirs.append(r if stream == 0 else w)
            popen = subprocess.Popen(argv, stdin=theirs[0], stdout=theirs[1], stderr=theirs[2], env=env,
                                     pass_fds=pass_fds)
        except BaseException:
            for fd in ours:
                os.close(fd)
            raise
        finally:
            for fd in theirs:
                os.close(fd)
        try:
            pidfd = os.pidfd_open(popen.pid)
        except OSError:  # it was reaped already: impossible but for a waitpid(-1) elsewhere
            popen.kill()
            popen.wait()
            for fd in ours:
                os.close(fd)
            raise
        for fd in ours:
            os.set_blocking(fd, False)
        return cls(limit, popen, *ours, pidfd)

    def _read(self, fd: int) -> None:
        end = self._reading[fd]
        try:
            data = os.read(end, _READ)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if data:
            self.channel.feed(fd, data)
            return
        self._stop_reading(fd)
        self.channel.feed_eof(fd)

    def _stop_reading(self, fd: int) -> None:
        end = self._reading.pop(fd, None)
        if end is not None:
            self._loop.remove_reader(end)
            os.close(end)

    def _pause_reading(self, fd: int, on: bool) -> None:
        end = self._reading.get(fd)
        if end is not None:
            self._loop.remove_reader(end) if on else self._loop.add_reader(end, self._read, fd)

    def _reap(self) -> None:
        if self._popen.poll() is None:
            return
        self._loop.remove_reader(self._pidfd)
        os.close(self._pidfd)
        self._pidfd = -1
        if not self.exited.done():
            self.exited.set_result(None)

    @property
    def pid(self) -> int:
        return self._popen.pid

    @property
    def returncode(self) -> int | None:
        return self._popen.returncode

    async def wait(self) -> int:
        await asyncio.shield(self.exited)
        return self.returncode

    def kill(self) -> None:
        if self._pidfd >= 0:  # not reaped: the pid is still this process's
            with contextlib.suppress(ProcessLookupError):  # exited, not yet reaped
                signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)

    def close(self) -> None:
        """Once it has exited: its pipes closed now (what is left unread in them is dropped)."""
        self.stdin.close()
        for fd in list(self._reading):
            self._stop_reading(fd)


def _pidfd_works() -> bool:
    try:
        os.close(os.pidfd_open(os.getpid()))
    except (AttributeError, OSError):
        return False
    return hasattr(signal, "pidfd_send_signal")


_HAS_PIDFD = _pidfd_works()


class ShellSession:
    """A supervisor process and its current shell. `run` is not re-entrant: callers lock."""

    def __init__(self, proc, shell_pid: int, output_limit: int):
        self.proc, self.shell_pid, self.output_limit = proc, shell_pid, output_limit
        self.channel: Channel = proc.channel
        self._leftover = b""

    @classmethod
    async def start(cls, argv: list[str], *, output_limit: int, env: dict | None = None,
                    timeout_s: float = 30.0, pass_fds: tuple[int, ...] = (),
                    spawned: Callable[[], Awaitable[None]] | None = None) -> ShellSession:  # fmt: skip
        """Start `argv` (which must end by running SUPERVISOR) and wait for its first shell.
        `spawned` runs once the process exists, before the wait (it may raise: all is killed)."""
        proc = await PipeProcess.spawn(argv, limit=1 << 20, env=env, pass_fds=pass_fds)
        return await cls.attach(proc, output_limit=output_limit, timeout_s=timeout_s, spawned=spawned)

    @classmethod
    async def attach(cls, proc, *, output_limit: int, timeout_s: float = 30.0,
                     spawned: Callable[[], Awaitable[None]] | None = None) -> ShellSession:  # fmt: skip
        """The session of a process already running SUPERVISOR (a PipeProcess, or anything with
        its shape: sandboxes/docker_exec.ExecProcess), once its first shell is ready."""
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
        lines, ch = [], self.channel
        while True:
            line = ch.take_line()
            if len(ch.out) > ch.limit:  # a flood from the last shell's processes: its start waits
                # for the next command, and the stream moves on (on Docker both share one socket)
                self._leftover = (self._leftover + ch.take_out())[: ch.limit]
            if line is None:
                if not ch.err_eof:
                    await ch.wait()
                    continue
                while not ch.out_eof:
                    await ch.wait()
                raise SessionDead(await self.proc.wait(), (b"".join(lines) + self._leftover + ch.take_out())
                                  .decode(errors="replace"))  # fmt: skip
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
        """Output until the end marker of the nonce the control channel gave. `deadline` is on
        time.monotonic(), the event loop's clock."""
        ch = self.channel
        nonce, exit_code, timed_out, stage = None, 0, False, 0
        while True:
            while nonce is None and (line := ch.take_line()) is not None:
                if match := _CONTROL.match(line.strip()):
                    nonce, exit_code = match.group(1), int(match.group(2))
                elif match := _EXITED.match(line.strip()):
                    status = int(match.group(1))
                    while ch.out:
                        capture.add(ch.take_out(_CHUNK))
                    self.shell_pid = await self._await_ready()
                    raise ShellDied(None if timed_out else status, capture.text())
            if nonce is not None:
                after = capture.cut_marker(b"\n\x1f" + nonce + b"\x1f")
                if after is not None:
                    self._leftover = after  # and what is still in the channel, after it
                    return exit_code, timed_out
            # a chunk at a time, letting the control line in between: until it has come the
            # capture keeps 16 chunks past a marker (a process left printing after the command
            # can follow it with any amount), then 4
            capture.slack = 4 * _CHUNK if nonce is not None else 16 * _CHUNK
            if ch.out:
                if time.monotonic() < deadline:
                    capture.add(ch.take_out(_CHUNK))
                    if nonce is None and ch.out:
                        await asyncio.sleep(0)
                    continue
            elif ch.out_eof:
                raise SessionDead(await self.proc.wait(), capture.text())
            elif await ch.wait(deadline, 1 if nonce is not None else _CHUNK):  # the marker, or a chunk
                continue
            if stage == 2:
                await self.kill()
                raise SessionDead(None, capture.text() + "\n[the sandbox stopped answering]")
            timed_out, deadline = True, time.monotonic() + GRACE_S
            await kill(stage == 1)  # first the command's processes, then the shell too
            stage += 1

    async def kill(self) -> None:
        if self.proc.returncode is None:
            self.proc.kill()
        await self.proc.wait()
        self.proc.close()
