"""The worker's shared episode loop: what its pool threads see when it stops."""

from __future__ import annotations

import asyncio
import concurrent.futures
import gc
import threading
import time
import weakref

import pytest

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


@pytest.mark.parametrize("kind", ["uvloop", "asyncio"])
def test_an_episode_that_ends_is_not_cancelled_by_the_close(tmp_path, kind):
    """On either event loop the setting names (uvloop's by default)."""
    runtime = EpisodeRuntime(Settings(data_dir=tmp_path, worker_event_loop=kind))

    async def quick(engine, settings):
        return type(asyncio.get_running_loop()).__module__.split(".")[0]

    assert runtime.call(quick) == kind
    runtime.close(timeout_s=5)
    assert runtime._waited == set()


class _Box:
    pass


def _frozen(obj, tracked: set[int]) -> bool:
    """Tracked by the collector but in none of its generations: frozen."""
    return gc.is_tracked(obj) and id(obj) not in tracked


def test_what_a_worker_holds_once_started_and_once_a_tokenizer_is_loaded_leaves_the_collectors_passes(tmp_path):
    """A full collection walks every tracked object, and a worker's modules and tokenizers are about
    340k of them (0.1 s a collection while its heap grows). What is alive when the runtime has
    started, and again when a tokenizer's renderer is built, is frozen; what is made after is not,
    and a frozen object is still freed when its last reference goes."""
    from service.fleet.client import load_tokenizer
    from service.fleet.tiny_model import init_tiny
    from service.worker import executor

    gc.unfreeze()
    thresholds = gc.get_threshold()
    try:
        held, dropped = [_Box() for _ in range(100)], _Box()
        gone = weakref.ref(dropped)
        runtime = EpisodeRuntime(Settings(data_dir=tmp_path))
        try:
            later = _Box()
            tracked = {id(o) for o in gc.get_objects()}
            assert all(_frozen(b, tracked) for b in held) and _frozen(dropped, tracked)
            assert not _frozen(later, tracked)
            # what is not frozen (the episodes' token lists) is walked by every full collection: rarer ones
            assert gc.get_threshold() == (executor.YOUNG_COLLECTION_EVERY, *thresholds[1:])
            del dropped
            assert gone() is None  # reference counting still frees it
        finally:
            runtime.close()

        tokenizer = load_tokenizer(str(init_tiny(tmp_path / "tiny")))
        gc.unfreeze()
        before_renderer = _Box()
        executor._renderer(tokenizer)
        after_renderer = _Box()
        tracked = {id(o) for o in gc.get_objects()}
        assert _frozen(before_renderer, tracked) and not _frozen(after_renderer, tracked)
    finally:
        gc.unfreeze()
        gc.set_threshold(*thresholds)
