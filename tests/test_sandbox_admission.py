"""Sandbox admission on a host (sandboxes/admission.py): the live cap and the start rate hold
across processes, a waiting sandbox is admitted once a slot frees (back-pressure, no error), a
killed process gives its slot back, and real sandboxes go through it."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections import deque
from pathlib import Path

import pytest

from sandboxes import admission
from sandboxes.base import open_sandbox
from tests.sandbox_fixtures import make_config, require_bwrap

ROOT = Path(__file__).resolve().parents[1]
HOLDER = """
import asyncio, json, sys, time
from sandboxes.admission import admitted

async def hold(i):
    asked = time.time()
    async with admitted():
        entered = time.time()
        await asyncio.sleep(float(sys.argv[2]))
        left = time.time()
    print(json.dumps([asked, entered, left]), flush=True)

async def main():
    await asyncio.sleep(max(0.0, float(sys.argv[3]) - time.time()))  # every process asks at the same instant
    await asyncio.gather(*(hold(i) for i in range(int(sys.argv[1]))))

asyncio.run(main())
"""


def holders(tmp_path: Path, processes: int, each: int, hold_s: float, **env) -> list[list[float]]:
    environ = os.environ | {"SWERVE_SANDBOX_DIR": str(tmp_path), "PYTHONPATH": str(ROOT)} | env
    start = time.time() + 3.0  # after every process has started, even on a busy machine
    procs = [subprocess.Popen([sys.executable, "-c", HOLDER, str(each), str(hold_s), str(start)], env=environ,
                              stdout=subprocess.PIPE, text=True) for _ in range(processes)]
    spans = []
    for p in procs:
        out, _ = p.communicate(timeout=120)
        assert p.returncode == 0
        spans += [json.loads(line) for line in out.splitlines()]
    return spans


def most_at_once(spans: list[list[float]]) -> int:
    events = sorted([(s[1], 1) for s in spans] + [(s[2], -1) for s in spans])
    live = peak = 0
    for _, step in events:
        live += step
        peak = max(peak, live)
    return peak


def test_the_live_cap_holds_across_processes(tmp_path):
    spans = holders(tmp_path, processes=3, each=4, hold_s=0.3,
                    SWERVE_SANDBOX_MAX_LIVE="5", SWERVE_SANDBOX_STARTS_PER_S="1000")
    assert len(spans) == 12  # every one admitted in the end: they waited, none failed
    assert most_at_once(spans) == 5
    # the ones that waited entered only as others left
    assert sum(1 for s in spans if s[1] - s[0] > 0.25) >= 7 - 1


def test_starts_are_paced_across_processes(tmp_path):
    rate, n = 20.0, 10
    spans = holders(tmp_path, processes=2, each=n // 2, hold_s=0.0,
                    SWERVE_SANDBOX_MAX_LIVE="100", SWERVE_SANDBOX_STARTS_PER_S=str(rate))
    first_asked, last_entered = min(s[0] for s in spans), max(s[1] for s in spans)
    assert last_entered - first_asked >= (n - 1) / rate  # each start reserves its own instant, 1/rate apart


def test_a_start_is_reserved_on_the_loop_unless_another_holds_the_schedule(tmp_path):
    """The reservation without blocking (what `admitted` tries on the event loop) steps aside while
    another process holds the schedule's lock (a lock on another open of the file, as another
    process's is); the next instant is still the blocking reservation's, 1/rate after the last."""
    import fcntl
    import threading

    first = admission._next_start(tmp_path, 1.0, block=False)
    assert first is not None and abs(first - time.time()) < 1
    other = os.open(tmp_path / "starts", os.O_RDWR)
    fcntl.flock(other, fcntl.LOCK_EX)
    try:
        assert admission._next_start(tmp_path, 1.0, block=False) is None
        threading.Timer(0.2, fcntl.flock, (other, fcntl.LOCK_UN)).start()
        asked = time.monotonic()
        second = admission._next_start(tmp_path, 1.0)  # waits for the lock
        assert time.monotonic() - asked >= 0.15
    finally:
        os.close(other)
    assert second == pytest.approx(first + 1.0, abs=1e-5)  # the instant after the first: none was lost


def test_the_schedule_is_read_from_its_record_whatever_lies_past_it(tmp_path):
    """The schedule is one fixed-width record written over the last, never truncated: a longer
    leftover (an older writer's, a torn file) past it changes nothing, and an unreadable record
    starts the schedule over at now."""
    (tmp_path / "starts").write_bytes(b"x" * 100)
    first = admission._next_start(tmp_path, 2.0)
    assert abs(first - time.time()) < 1  # unreadable: start over
    second = admission._next_start(tmp_path, 2.0)
    assert second == pytest.approx(first + 0.5, abs=1e-5)  # the garbage past the record is never read
    (tmp_path / "starts").write_bytes(f"{second + 0.5:.6f}".ljust(admission._RECORD).encode() + b"9" * 60)
    assert admission._next_start(tmp_path, 2.0) == pytest.approx(second + 0.5, abs=1e-5)


def test_a_killed_process_gives_its_slot_back(tmp_path, monkeypatch):
    env = os.environ | {"SWERVE_SANDBOX_DIR": str(tmp_path), "PYTHONPATH": str(ROOT), "SWERVE_SANDBOX_MAX_LIVE": "1"}
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, "1", "600", "0"], env=env)
    monkeypatch.setenv("SWERVE_SANDBOX_DIR", str(tmp_path))  # where _folder() looks, as the child does
    try:
        folder = admission._folder()
        deadline = time.monotonic() + 30
        while (got := admission._take_slot(folder, 1)) is not None and time.monotonic() < deadline:
            os.close(got[1])  # free still: give it back and look again once the child has started
            time.sleep(0.05)
        assert got is None  # the child holds the only slot
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    got = admission._take_slot(folder, 1)
    assert got is not None
    os.close(got[1])


@pytest.mark.parametrize(("name", "value"), [("SWERVE_SANDBOX_MAX_LIVE", "0"), ("SWERVE_SANDBOX_MAX_LIVE", "many"),
                                             ("SWERVE_SANDBOX_STARTS_PER_S", "inf"), ("SWERVE_SANDBOX_STARTS_PER_S", "-1")])
def test_bad_settings_are_named(monkeypatch, name, value):
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=name):
        admission.max_live() if "LIVE" in name else admission.starts_per_s()


async def test_real_sandboxes_wait_for_a_slot(tmp_path, monkeypatch):
    require_bwrap()
    monkeypatch.setenv("SWERVE_SANDBOX_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("SWERVE_SANDBOX_MAX_LIVE", "2")
    live, peak = 0, 0

    async def episode(i: int) -> str:
        nonlocal live, peak
        async with open_sandbox(make_config("bwrap", tmp_path / f"s{i}")) as sb:
            live += 1
            peak = max(peak, live)
            out = (await sb.execute(f"sleep 0.3; echo {i}")).output
            live -= 1
            return out

    assert await asyncio.gather(*(episode(i) for i in range(5))) == [f"{i}\n" for i in range(5)]
    assert peak == 2


async def test_a_slot_given_back_in_the_process_wakes_its_waiter_without_polling(tmp_path, monkeypatch):
    """A process does not try the slots it holds itself (an open and a failing flock each, polled
    while it waits), and the slot one of its sandboxes gives back goes to its first waiter at once."""
    monkeypatch.setenv("SWERVE_SANDBOX_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("SWERVE_SANDBOX_MAX_LIVE", "2")
    monkeypatch.setenv("SWERVE_SANDBOX_STARTS_PER_S", "1000")
    tries, take = [], admission._take_slot
    monkeypatch.setattr(admission, "_take_slot", lambda *a: tries.append(a) or take(*a))
    monkeypatch.setattr(admission.random, "random", lambda: 1.0)  # polls 0.03, 0.09, ... 1.89, 3.39 s into a wait
    release, inside, released, entered = asyncio.Event(), [], [], []

    async def holder() -> None:
        async with admission.admitted():
            inside.append(True)
            await release.wait()
            released.append(time.monotonic())

    async def waiter() -> None:
        async with admission.admitted():
            entered.append(time.monotonic())

    holders = [asyncio.create_task(holder()) for _ in range(2)]
    while len(inside) < 2:
        await asyncio.sleep(0.01)
    waiting = asyncio.create_task(waiter())
    await asyncio.sleep(2.0)  # its backoff has grown to about a second by now
    assert len(tries) == 2 and not entered  # both slots are this process's: nothing tried while it waits
    release.set()
    await asyncio.wait_for(asyncio.gather(*holders, waiting), 10)
    assert len(tries) == 3  # woken by the first slot given back, it took a slot with one try
    assert entered[0] - released[0] < 0.5  # not at its next poll, 1.4 s after the release


async def test_a_waiter_cancelled_as_it_is_woken_stays_cancelled_and_passes_the_slot_on(tmp_path):
    """A sandbox start cancelled (its run cancelled) just as a given-back slot wakes it: it ends
    cancelled, not admitted, and the next waiter is woken in its place instead of polling."""
    local, folder = admission._Local(), tmp_path
    first = asyncio.create_task(local.wait(folder, 30, seen=0))
    second = asyncio.create_task(local.wait(folder, 30, seen=0))
    await asyncio.sleep(0)  # both wait
    local.took(folder, 0)
    local.give_back(folder, 0, os.open(tmp_path / "live-0.lock", os.O_RDWR | os.O_CREAT, 0o600))
    await asyncio.sleep(0)  # the wake is delivered to the first waiter, which has not resumed yet
    first.cancel()
    with pytest.raises(asyncio.CancelledError):
        await first
    await asyncio.wait_for(second, 2)  # woken, not at its 30 s timeout
    assert local.waiters[folder] == deque()


async def test_a_slot_given_back_between_a_try_and_a_wait_is_not_missed(tmp_path):
    local, folder = admission._Local(), tmp_path
    _, seen = local.holding(folder)
    local.took(folder, 0)
    local.give_back(folder, 0, os.open(tmp_path / "live-0.lock", os.O_RDWR | os.O_CREAT, 0o600))
    await asyncio.wait_for(local.wait(folder, 30, seen), 2)  # returns at once: look again


async def test_a_waiter_for_slots_all_held_in_the_process_does_not_poll(tmp_path, monkeypatch):
    """While every slot is this process's only its own give back can free one, and that wakes the
    waiter: it waits once, with no timeout to poll at (at 256 episodes over 64 slots the polls'
    timeouts were 3% of a worker's CPU)."""
    monkeypatch.setenv("SWERVE_SANDBOX_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("SWERVE_SANDBOX_MAX_LIVE", "1")
    monkeypatch.setenv("SWERVE_SANDBOX_STARTS_PER_S", "1000")
    waits, wait = [], admission._local.wait

    async def counted(folder, timeout, seen, urgent=False):
        waits.append(timeout)
        return await wait(folder, timeout, seen, urgent)

    monkeypatch.setattr(admission._local, "wait", counted)
    release, entered = asyncio.Event(), asyncio.Event()

    async def holder() -> None:
        async with admission.admitted():
            entered.set()
            await release.wait()

    holding = asyncio.create_task(holder())
    await entered.wait()
    second = admission.admitted()
    waiting = asyncio.create_task(second.__aenter__())
    await asyncio.sleep(0.5)  # a polling waiter would have timed out a few times by now (0.01-0.03 s, doubling)
    assert waits == [None] and not waiting.done()
    release.set()
    await asyncio.wait_for(holding, 5)
    await asyncio.wait_for(waiting, 5)
    await second.__aexit__(None, None, None)
    assert waits == [None]


async def test_an_urgent_waiter_takes_the_next_slot_before_those_that_waited_longer(tmp_path):
    """An episode's grading sandbox (urgent: its episode is done but for it) goes before this
    process's sandboxes of episodes not yet started, first come first served among each kind:
    in strict arrival order a grading waited behind every new episode (64 slots, 128 episodes in
    flight: a sixth of the throughput lost, 2026-12-07)."""
    local, folder, woken = admission._Local(), tmp_path, []

    async def waiter(name: str, urgent: bool) -> None:
        await local.wait(folder, None, seen=0, urgent=urgent)
        woken.append(name)

    order = [("new-1", False), ("new-2", False), ("grade-1", True), ("new-3", False), ("grade-2", True)]
    tasks = []
    for name, urgent in order:
        tasks.append(asyncio.create_task(waiter(name, urgent)))
        await asyncio.sleep(0)  # each queued in turn
    for k in range(len(order)):
        local.took(folder, k)
        local.give_back(folder, k, os.open(tmp_path / f"live-{k}.lock", os.O_RDWR | os.O_CREAT, 0o600))
        await asyncio.sleep(0.05)
        assert len(woken) == k + 1
    assert woken == ["grade-1", "grade-2", "new-1", "new-2", "new-3"]
    await asyncio.gather(*tasks)
