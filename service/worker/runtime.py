"""Many episodes per worker process: one asyncio loop, in a daemon thread, runs every episode
of the process; Celery's thread pool hands episodes to it and waits on their futures.

Episodes spend their time waiting on inference and sandboxes, so one loop keeps hundreds in
flight on a core. The loop owns one database engine (one connection pool) and the caches
(tokenizers, environments) that all episodes of the process share.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import uuid
from concurrent.futures import Future

from service.config import Settings

logger = logging.getLogger(__name__)


def new_loop(kind: str) -> asyncio.AbstractEventLoop:
    """An event loop of `kind` (Settings.worker_event_loop)."""
    if kind == "uvloop":
        import uvloop

        return uvloop.new_event_loop()
    return asyncio.new_event_loop()


class EpisodeRuntime:
    def __init__(self, settings: Settings, pool_size: int = 16):
        self.settings = settings
        self.pool_size = pool_size
        self.loop = new_loop(settings.worker_event_loop)
        self._ready = threading.Event()
        self._waited: set[Future] = set()
        """Futures that pool threads wait on: cancelled if the loop stops before they end."""
        self._thread = threading.Thread(target=self._main, name="swerve-episodes", daemon=True)
        self._thread.start()
        self._ready.wait()

    def _main(self) -> None:
        from service.store.db import make_async_engine
        from service.worker.executor import freeze_heap

        asyncio.set_event_loop(self.loop)
        url = self.settings.resolved_database_url
        pool = {} if url.startswith("sqlite") else {"pool_size": self.pool_size, "max_overflow": self.pool_size}
        self.engine = make_async_engine(url, **pool)
        freeze_heap()
        self._ready.set()
        self.loop.run_forever()

    def submit(self, episode_id: uuid.UUID) -> Future:
        from service.worker.executor import execute_episode

        return self._track(asyncio.run_coroutine_threadsafe(execute_episode(self.engine, self.settings, episode_id),
                                                            self.loop))

    def _track(self, future: Future) -> Future:
        self._waited.add(future)
        future.add_done_callback(self._waited.discard)
        return future

    def call(self, fn, *args):
        """Run fn(engine, settings, *args) on the shared loop; blocks the calling thread."""
        return self._track(asyncio.run_coroutine_threadsafe(fn(self.engine, self.settings, *args), self.loop)).result()

    def run(self, episode_id: uuid.UUID) -> str | None:
        """Run one episode on the shared loop; blocks the calling (pool) thread until it ends."""
        return self.submit(episode_id).result()

    def close(self, timeout_s: float = 45.0) -> None:
        """Cancel the episodes, close the fleet clients and the engine, within timeout_s; then stop
        the loop whatever is left. Longer than SQLite's busy timeout (30 s, service/store/db.py): a
        statement that waits for the database's lock when the close begins ends, and its rollback
        runs, before the loop stops. Stopped under it, a write that gets the lock late holds it for
        good: the likely cause of the "database is locked" that failed the next INSERT of a process
        after its RL job's end (2026-12-06)."""

        async def shutdown() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            from service.worker.executor import close_fleets

            await close_fleets()
            await self.engine.dispose()

        if self.loop.is_running():
            try:
                asyncio.run_coroutine_threadsafe(shutdown(), self.loop).result(timeout_s)
            except TimeoutError:
                logger.error("episodes still stopping after %.0f s; their loop is stopped with them", timeout_s)
            self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout_s)
        # A coroutine that outlived its cancellation never resolves its future once the loop is
        # stopped: the pool thread waiting on it (and Celery's pool shutdown, which joins that
        # thread) would wait forever. A demo's worker hung so for 13 minutes (2026-12-05).
        for future in list(self._waited):
            future.cancel()


_runtime: EpisodeRuntime | None = None
_lock = threading.Lock()


def runtime(settings: Settings | None = None) -> EpisodeRuntime:
    """This process's runtime, started on first use."""
    global _runtime
    with _lock:
        if _runtime is None:
            from service.config import get_settings

            _runtime = EpisodeRuntime(settings or get_settings())
        return _runtime


def close_runtime() -> None:
    global _runtime
    with _lock:
        if _runtime is not None:
            _runtime.close()
            _runtime = None
