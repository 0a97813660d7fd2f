"""`docker exec -i` over the engine's API socket, without the `docker` CLI: the exec is created
and started with stdin attached on a raw connection (the HTTP upgrade Docker's own clients use),
and its multiplexed stdout/stderr frames are split into a shell.Channel. `ExecProcess` has the
shape of shell.PipeProcess, the subprocess that sandboxes/shell.ShellSession drives.

Two things come of it: no CLI process per shell (the CLI's own start-up is most of a shell's
attach), and a connection is a plain socket, so it can be opened in one thread and adopted by
any event loop later: the warm pool (sandboxes/docker.py) starts a container's shell ahead and
a sandbox only adopts it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket

from sandboxes.base import SandboxError
from sandboxes.shell import Channel

_STDOUT, _STDERR = 1, 2
_HEADER = 8  # stream type, 3 zero bytes, big-endian 32-bit length


def socket_path(client) -> str | None:
    """The engine's unix socket, or None where the client reaches it otherwise (TCP, TLS, ssh)."""
    return getattr(getattr(client.api, "_custom_adapter", None), "socket_path", None)


class Exec:
    """A started exec: its id, the raw connection, and what came after the upgrade's headers."""

    __slots__ = ("exec_id", "sock", "rest")

    def __init__(self, exec_id: str, sock: socket.socket, rest: bytes):
        self.exec_id, self.sock, self.rest = exec_id, sock, rest

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()


def start_exec(client, container: str, argv: list[str], *, user: str, workdir: str, timeout_s: float = 30.0) -> Exec:
    """Create and start an exec with stdin attached (blocking; run it in a thread). Raises
    SandboxError when the engine refuses."""
    import docker

    path = socket_path(client)
    if path is None:
        raise SandboxError("the engine is not reached over a unix socket")
    try:
        exec_id = client.api.exec_create(container, argv, stdin=True, stdout=True, stderr=True, user=user,
                                         workdir=workdir)["Id"]
    except docker.errors.DockerException as e:
        raise SandboxError(f"cannot exec in {container}: {e}") from e
    body = json.dumps({"Detach": False, "Tty": False}).encode()
    request = (f"POST /v{client.api._version}/exec/{exec_id}/start HTTP/1.1\r\nHost: docker\r\n"
               f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
               "Connection: Upgrade\r\nUpgrade: tcp\r\n\r\n").encode() + body
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        return Exec(exec_id, sock, _upgrade(sock, path, request, container, timeout_s))
    except OSError as e:
        sock.close()
        raise SandboxError(f"cannot reach the engine at {path}: {e}") from e
    except BaseException:
        sock.close()
        raise


def _upgrade(sock: socket.socket, path: str, request: bytes, container: str, timeout_s: float) -> bytes:
    """Send the start request and read the answer's headers; returns what came after them."""
    sock.settimeout(timeout_s)
    sock.connect(path)
    sock.sendall(request)
    head = b""
    while b"\r\n\r\n" not in head:  # the headers only: what follows is the exec's output
        chunk = sock.recv(65536)
        if not chunk:
            raise SandboxError(f"the engine closed the exec's connection in {container}: {head[:300]!r}")
        head += chunk
    header, rest = head.split(b"\r\n\r\n", 1)
    status = header.split(b" ", 2)[1] if b" " in header else b"?"
    if status not in (b"101", b"200"):
        raise SandboxError(f"the engine refused the exec in {container}: {header.decode(errors='replace')[:300]}")
    sock.settimeout(None)
    return rest


class _Pipe:
    """stdin: write and drain, as asyncio's StreamWriter of a subprocess."""

    def __init__(self, writer: asyncio.StreamWriter):
        self._writer = writer

    def write(self, data: bytes) -> None:
        self._writer.write(data)

    async def drain(self) -> None:
        await self._writer.drain()

    def close(self) -> None:
        self._writer.close()


class ExecProcess:
    """An exec's streams as shell.PipeProcess has them (stdin, channel, returncode, wait, kill,
    close). kill closes the connection, as killing a `docker exec` client does: what runs in
    the container is the sandbox's to stop."""

    def __init__(self, client, started: Exec, limit: int = 1 << 20):
        self._client, self._exec = client, started
        self.channel = Channel(limit)
        self.channel.pause = self._pause
        self._reading = asyncio.Event()  # cleared while the channel has a stream paused
        self._reading.set()
        self.stdin: _Pipe | None = None
        self.returncode: int | None = None
        self._pump: asyncio.Task | None = None

    @classmethod
    async def adopt(cls, client, started: Exec) -> ExecProcess:
        """Take over a started exec in the running event loop."""
        proc = cls(client, started)
        started.sock.setblocking(False)
        reader, writer = await asyncio.open_connection(sock=started.sock, limit=1 << 20)
        proc.stdin = _Pipe(writer)
        proc._pump = asyncio.ensure_future(proc._split(reader, writer))
        return proc

    async def _split(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        buf = bytearray(self._exec.rest)
        try:
            while True:
                while len(buf) >= _HEADER:
                    size = int.from_bytes(buf[4:8], "big")
                    if len(buf) < _HEADER + size:
                        break
                    stream, data = buf[0], bytes(buf[_HEADER:_HEADER + size])
                    del buf[:_HEADER + size]
                    self.channel.feed(2 if stream == _STDERR else 1, data)
                await self._reading.wait()  # the session paused reading: output waits on the socket
                chunk = await reader.read(1 << 16)
                if not chunk:
                    break
                buf += chunk
        except (ConnectionError, OSError):
            pass
        finally:
            self.channel.feed_eof(1)
            self.channel.feed_eof(2)
            writer.close()
            self.returncode = await asyncio.to_thread(self._exit_code)

    def _pause(self, fd: int, on: bool) -> None:
        """Both streams share the socket: it is read while neither is paused."""
        self._reading.clear() if self.channel.paused else self._reading.set()

    def _exit_code(self) -> int:
        try:
            state = self._client.api.exec_inspect(self._exec.exec_id)
        except Exception:  # noqa: BLE001 - the container is gone: so is what ran in it
            return -9
        return -9 if state.get("Running") or state.get("ExitCode") is None else int(state["ExitCode"])

    async def wait(self) -> int:
        if self._pump is not None:
            await asyncio.shield(self._pump)
        return self.returncode

    def kill(self) -> None:
        self.channel.pause = lambda fd, on: None  # the split reads on to the connection's end
        self._reading.set()
        if self.stdin is not None:
            self.stdin.close()  # the transport's socket: the split sees its end
        else:
            self._exec.close()

    def close(self) -> None:
        """After wait: the connection, the exec's only resource here, is closed by then."""
