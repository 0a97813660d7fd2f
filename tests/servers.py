"""Helpers that run real servers in-process for tests: an ASGI app under uvicorn in a thread,
and a TCP forwarder (a second 'server' in front of a real one, which a test can kill)."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import uvicorn


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ThreadServer:
    def __init__(self, app):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning",
                                access_log=False)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> ThreadServer:
        self.thread.start()
        while not self.server.started:
            time.sleep(0.01)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


class TcpProxy:
    """Forwards 127.0.0.1:<port> to a target port until stop() (which drops live connections)."""

    def __init__(self, target_port: int):
        self.target, self.port = target_port, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._server = None
        self._writers: set = set()

    def start(self) -> TcpProxy:
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(10)
        return self

    async def _start(self) -> None:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", self.port)

    async def _handle(self, reader, writer) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target)
        self._writers |= {writer, up_writer}

        async def pipe(src, dst, upstream: bool):
            try:
                while data := await src.read(65536):
                    if upstream and self.drop(data):  # the connection closes without an answer
                        writer.close()
                        break
                    dst.write(data)
                    await dst.drain()
            except (ConnectionError, asyncio.CancelledError):
                pass
            finally:
                dst.close()

        await asyncio.gather(pipe(reader, up_writer, True), pipe(up_reader, writer, False))

    def drop(self, request: bytes) -> bool:
        """Whether to close the connection instead of forwarding this chunk of a request."""
        return False

    def stop(self) -> None:
        async def _stop():
            self._server.close()
            for w in self._writers:
                w.close()
        asyncio.run_coroutine_threadsafe(_stop(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
