"""Admission of new sandboxes on a host: at most SWERVE_SANDBOX_MAX_LIVE alive at once and
SWERVE_SANDBOX_STARTS_PER_S started per second, counted across every process of the host
(workers, the API's validations, builds). A sandbox over either limit waits its turn (back-
pressure) instead of failing: 16-96 agents started at once overload a Docker daemon (SkyRL #9,
rllm #269), and its errors would end episodes that only had to wait.

Both limits live in files beside the sandboxes' state folder, so they need no service:
- a live sandbox holds an exclusive flock on one of MAX_LIVE slot files; the kernel releases it
  when the sandbox closes or its process dies, so a crash never leaks a slot;
- starts are paced by one file holding the time the next start may begin, read and moved on
  under an flock: each start takes the next free instant, at least 1/STARTS_PER_S apart.

Within a process the files are not polled for what the process knows (_Local): the slots it
holds are not tried (each an open and a failing flock), and a slot it gives back wakes its
first waiter at once. Slots other processes give back are found by polling, with backoff. At 128
episodes in flight over 64 slots the polling took 18% of a worker's CPU (2026-12-04).
"""

from __future__ import annotations

import asyncio
import fcntl
import logging
import os
import random
import threading
import time
from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from sandboxes.reaper import state_root

logger = logging.getLogger(__name__)
MAX_LIVE_ENV, STARTS_ENV = "SWERVE_SANDBOX_MAX_LIVE", "SWERVE_SANDBOX_STARTS_PER_S"


def _setting(name: str, default: float, kind=int):
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = kind(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r}: must be a {'whole ' if kind is int else ''}number above 0") from None
    if not value > 0 or value != value or value == float("inf"):
        raise ValueError(f"{name}={raw!r}: must be a finite number above 0")
    return value


def max_live() -> int:
    """Sandboxes alive at once on this host (default: 32 per core, at least 64)."""
    return _setting(MAX_LIVE_ENV, max(64, 32 * (os.cpu_count() or 1)))


def starts_per_s() -> float:
    """Sandbox starts per second on this host (default 10)."""
    return _setting(STARTS_ENV, 10.0, float)


def _folder() -> Path:
    """Beside the sandboxes' state folder, not in it: the reaper owns that one's contents."""
    root = state_root()
    folder = root.with_name(f"{root.name}.admission")
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    return folder


def _take_slot(folder: Path, limit: int, skip: frozenset[int] = frozenset()) -> tuple[int, int] | None:
    """(the slot, an open fd holding its flock) of a free slot not in `skip`, or None. The slots
    are tried from a random one on, so processes spread over them (a random permutation of all of
    them per try took 10 us against 1 us at 64 slots with 63 held, and grows with the slots)."""
    start = random.randrange(limit)
    for k in range(limit):
        i = (start + k) % limit
        if i in skip:
            continue
        fd = os.open(folder / f"live-{i}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return i, fd
        except BlockingIOError:
            os.close(fd)
    return None


class _Local:
    """What this process knows of the slots: the ones it holds (per folder), and its sandboxes
    waiting for one (FIFO per folder, across its event loops). The flocks stay the truth: this
    only spares tries that must fail and waits that need not last."""

    def __init__(self):
        self.lock = threading.Lock()
        self.held: dict[Path, set[int]] = {}
        self.waiters: dict[Path, deque[tuple[asyncio.AbstractEventLoop, asyncio.Future, bool]]] = {}
        """FIFO, but urgent waiters (loop, future, True) go before the others."""
        self.given_back = 0
        """Slots this process gave back so far: a waiter that read it before its try and finds it
        moved tries again at once (the slot came back between its try and its wait)."""

    def holding(self, folder: Path) -> tuple[frozenset[int], int]:
        """The slots held here, and the count of slots given back (for `wait`)."""
        with self.lock:
            return frozenset(self.held.get(folder, ())), self.given_back

    def took(self, folder: Path, slot: int) -> None:
        with self.lock:
            self.held.setdefault(folder, set()).add(slot)

    def give_back(self, folder: Path, slot: int, fd: int) -> None:
        with self.lock:
            self.held.get(folder, set()).discard(slot)
            os.close(fd)  # releases the flock: the slot is free for the next sandbox
            self.given_back += 1
        self._wake_next(folder)

    def _wake_next(self, folder: Path) -> None:
        with self.lock:
            queue = self.waiters.get(folder)
            while queue:
                loop, woken, _ = queue.popleft()
                try:
                    loop.call_soon_threadsafe(self._deliver, folder, woken)
                    return
                except RuntimeError:  # its loop is closed
                    continue

    def _deliver(self, folder: Path, woken: asyncio.Future) -> None:
        if woken.done():  # its waiter left meanwhile (a timeout, a cancel): the next one is woken
            self._wake_next(folder)
        else:
            woken.set_result(None)

    async def wait(self, folder: Path, timeout: float | None, seen: int, urgent: bool = False) -> None:
        """Until this process gives a slot of `folder` back, or at once if one came back since
        the caller read `seen` (holding()); polling finds the other processes'. TimeoutError
        after `timeout` (None: no limit). An `urgent` waiter is woken before the others."""
        loop = asyncio.get_running_loop()
        entry = (loop, loop.create_future(), urgent)
        with self.lock:
            if self.given_back != seen:
                return
            queue = self.waiters.setdefault(folder, deque())
            if urgent:  # behind the urgent ones already waiting, before every other
                queue.insert(next((i for i, waiting in enumerate(queue) if not waiting[2]), len(queue)), entry)
            else:
                queue.append(entry)
        try:
            async with asyncio.timeout(timeout):  # not wait_for: on 3.11 it can swallow a cancel once woken
                await entry[1]
        except BaseException:
            if entry[1].done() and not entry[1].cancelled():  # woken, yet leaving: the wake goes on
                self._wake_next(folder)
            raise
        finally:
            with self.lock:
                queue = self.waiters.get(folder)
                if queue and entry in queue:
                    queue.remove(entry)


_local = _Local()


def _forget() -> None:
    global _local
    _local = _Local()  # a forked child holds no slot of its own and waits for none


os.register_at_fork(after_in_child=_forget)


_RECORD = 32  # bytes of the schedule's record: a time.time() with 6 decimals, padded with spaces


def _next_start(folder: Path, rate: float, block: bool = True) -> float | None:
    """Reserve the next start instant (time.time()); every process shares the schedule. None
    when not `block` and another process holds the schedule's lock this instant."""
    fd = os.open(folder / "starts", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX if block else fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return None
        raw = os.pread(fd, _RECORD, 0).decode(errors="replace").strip()
        try:
            earliest = float(raw)
        except ValueError:
            earliest = 0.0
        now = time.time()
        mine = max(now, earliest if earliest < now + 3600 else now)  # a clock moved back an hour: start over
        # one record of a fixed width, written over the last: no truncate (ext4 journals it,
        # 0.2 ms of a worker's CPU a start); what lies past the record is never read
        os.pwrite(fd, f"{mine + 1.0 / rate:.6f}".ljust(_RECORD).encode(), 0)
        return mine
    finally:
        os.close(fd)


def paced_creation() -> None:
    """Wait (blocking) for a start instant: for sandboxes made ahead of their start (Docker's
    warm pool), which count against the host's starts per second when they are made."""
    if (wait := _next_start(_folder(), starts_per_s()) - time.time()) > 0:
        time.sleep(wait)


@asynccontextmanager
async def admitted(what: str = "sandbox", pace: bool = True, urgent: bool = False) -> AsyncIterator[None]:
    """Wait for a live slot and a start instant (`pace`: False for a sandbox already made, whose
    making took its instant), hold the slot until the block ends. An `urgent` sandbox (an
    episode's grading: the episode is done but for it) takes the first slot this process gives
    back, before the sandboxes of episodes not yet started."""
    folder, limit, rate = _folder(), max_live(), starts_per_s()
    asked, delay, warned = time.monotonic(), 0.02, False
    while True:
        skip, seen = _local.holding(folder)
        # on the loop, not a thread: an open of a local file and a flock that never blocks, a few
        # microseconds each, where the hop to a thread and back cost the worker more (2026-12-04)
        if len(skip) < limit and (got := _take_slot(folder, limit, skip)) is not None:
            break
        if not warned and time.monotonic() - asked > 5:
            logger.info("%s waits: %d sandboxes are alive on this host (%s)", what, limit, MAX_LIVE_ENV)
            warned = True
        # every slot this process's: only its own give back frees one, and that wakes the first
        # waiter; no polling meanwhile (at 256 episodes over 64 slots the polls' timeouts were 3%
        # of a worker's CPU, 2026-12-07)
        try:
            await _local.wait(folder, None if len(skip) >= limit else delay * (0.5 + random.random()), seen, urgent)
        except TimeoutError:
            delay = min(delay * 2, 1.0)
    slot, fd = got
    _local.took(folder, slot)
    try:
        if pace:  # on the loop while no other process holds the schedule (it holds it a few
            # microseconds), on a thread when one does: the hop cost the worker more than the reservation
            start_at = _next_start(folder, rate, block=False)
            if start_at is None:
                start_at = await asyncio.to_thread(_next_start, folder, rate)
            if (wait := start_at - time.time()) > 0:
                await asyncio.sleep(wait)
        yield
    finally:
        _local.give_back(folder, slot, fd)
