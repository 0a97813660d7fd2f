"""The worker's shared episode loop: what its pool threads see when it stops."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time

from service.config import Settings
from service.worker.runtime import EpisodeRuntime


def test_a_pool_thread_waiting_on_the_loop_is_released_when_the_loop_stops_under_it(tmp_path):
    """A coroutine that outlives its cancellation (here it swallows it) keeps the loop's shutdown
    past its timeout; the loop then stops with it still pending. The pool thread waiting on it
    must get CancelledError, not wait forever: Celery's pool shutdown joins that thread, and a
    demo's worker hung there."""
    runtime = EpisodeRuntime(Settings(data_dir=tmp_path))
    started = threading.Event()

    async def stubborn(engine, settings):
        started.set()
        while True:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                continue

    outcome: list[str] = []

    def pool_thread() -> None:
        try:
            runtime.call(stubborn)
            outcome.append("returned")
        except concurrent.futures.CancelledError:
            outcome.append("cancelled")

    waiter = threading.Thread(target=pool_thread, daemon=True)
    waiter.start()
    assert started.wait(10)
    begun = time.monotonic()
    runtime.close(timeout_s=0.5)
    waiter.join(10)
    assert not waiter.is_alive() and outcome == ["cancelled"]
    assert time.monotonic() - begun < 5


def test_an_episode_that_ends_is_not_cancelled_by_the_close(tmp_path):
    runtime = EpisodeRuntime(Settings(data_dir=tmp_path))

    async def quick(engine, settings):
        return 42

    assert runtime.call(quick) == 42
    runtime.close(timeout_s=5)
    assert runtime._waited == set()
