"""The worker's own CPU per bubblewrap sandbox, user and system apart: N lifecycles (start, one
command, close) one after another on an event loop in a thread, as the worker's episodes run
(service/worker/runtime.py), timed by this process's rusage (every thread here, not the
sandbox's processes). Side by side in one run, alternating, on the same sandboxes:

- the sandbox's shell on pipes the event loop reads itself, its exit seen through a pidfd on the
  loop (sandboxes/shell.PipeProcess): what the worker runs;
- the shell through asyncio's subprocess transport with Python 3.11's default child watcher (a
  thread per child, blocked in waitpid): sandboxes/shell.TransportProcess, PipeProcess's fallback
  where the kernel has no pidfd, and what the worker ran before 2026-12-06.

And per command (`echo hi`) on one sandbox, for both. Then the two launchers of a sandbox
(sandboxes/launch.c, compiled, and the shell script it replaced, SWERVE_SANDBOX_LAUNCHER=sh),
alternating, each with this process's CPU and that of the sandbox's own processes it reaped
(RUSAGE_CHILDREN: the launch, bwrap, the shell and the command). An episode of
bench/rollouts.py holds two sandboxes (the agent's and the grading one), so twice the lifecycle
figure is what sandboxes cost an episode before its commands. (uvloop and asyncio's own pidfd child watcher were measured on
2026-12-05, bench/RESULTS.md: neither was taken.)

    .venv/bin/python bench/sandbox_cpu.py [--lifecycles 100] [--rounds 3] [--commands 2000]
    .venv/bin/python bench/sandbox_cpu.py --profile 200   # where the worker's part goes, by cProfile
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import statistics
import sys
import tempfile
import threading
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from sandboxes import shell  # noqa: E402
from sandboxes.base import open_sandbox  # noqa: E402
from sandboxes.config import BwrapSandboxConfig  # noqa: E402

PIDFD = shell._HAS_PIDFD


def rusage_ms(who: int = resource.RUSAGE_SELF) -> tuple[float, float]:
    r = resource.getrusage(who)
    return r.ru_utime * 1e3, r.ru_stime * 1e3


async def echo(sb) -> None:
    r = await sb.execute("echo hi")
    if r.exit_code != 0 or "hi" not in r.output:
        raise SystemExit(f"command failed: {r}")


async def lifecycles(config, n: int) -> tuple[float, float]:
    """User and system ms of this process per lifecycle."""
    u0, s0 = rusage_ms()
    for _ in range(n):
        async with open_sandbox(config) as sb:
            await echo(sb)
    u1, s1 = rusage_ms()
    return (u1 - u0) / n, (s1 - s0) / n


async def launches(config, n: int, how: str) -> tuple[float, float]:
    """This process's ms and its reaped children's ms per lifecycle, launched as `how` says."""
    os.environ["SWERVE_SANDBOX_LAUNCHER"] = how
    try:
        c0 = sum(rusage_ms(resource.RUSAGE_CHILDREN))
        user, system = await lifecycles(config, n)
        c1 = sum(rusage_ms(resource.RUSAGE_CHILDREN))
    finally:
        del os.environ["SWERVE_SANDBOX_LAUNCHER"]
    return user + system, (c1 - c0) / n


async def commands(config, n: int) -> tuple[float, float]:
    """User and system us of this process per command, on one warm sandbox."""
    async with open_sandbox(config) as sb:
        for _ in range(20):
            await echo(sb)
        u0, s0 = rusage_ms()
        for _ in range(n):
            await echo(sb)
        u1, s1 = rusage_ms()
    return (u1 - u0) / n * 1e3, (s1 - s0) / n * 1e3


KINDS = {"pipes and a pidfd (PipeProcess)": True, "asyncio transport (TransportProcess)": False}


def on_loop(kind: str, make):
    """Run make() on a new asyncio loop in a thread of its own, the sandboxes' shells run as
    `kind` says; its result."""
    out: list = []

    def main() -> None:
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        try:
            if not KINDS[kind]:
                with warnings.catch_warnings():  # Python 3.11's default watcher, attached to this loop
                    warnings.simplefilter("ignore", DeprecationWarning)
                    watcher = asyncio.ThreadedChildWatcher()
                    asyncio.set_child_watcher(watcher)
                    watcher.attach_loop(loop)
            shell._HAS_PIDFD = KINDS[kind] and PIDFD
            out.append(loop.run_until_complete(make()))
        finally:  # the sandboxes' reaper task ends with its loop
            shell._HAS_PIDFD = PIDFD
            pending = asyncio.all_tasks(loop)
            for task in pending:
                task.cancel()
            loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()

    thread = threading.Thread(target=main)
    thread.start()
    thread.join()
    return out[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lifecycles", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--commands", type=int, default=2000)
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="instead: N lifecycles on the worker's loop under cProfile, its largest parts")
    args = ap.parse_args()
    repo = Path(tempfile.mkdtemp(prefix="swerve-bench-")) / "repo"
    repo.mkdir()
    (repo / "a.py").write_text("x = 1\n")
    config = BwrapSandboxConfig(root=repo)
    if not PIDFD:
        raise SystemExit("this kernel has no pidfd_open: PipeProcess falls back to TransportProcess here")
    kinds = list(KINDS)
    if args.profile:
        return profile(config, kinds[0], args.profile)
    for kind in kinds:  # warm: the page cache, the imports
        on_loop(kind, lambda: lifecycles(config, 5))
    per_life = {k: [] for k in kinds}
    for _ in range(args.rounds):
        for kind in kinds:
            per_life[kind].append(on_loop(kind, lambda: lifecycles(config, args.lifecycles)))
    per_command = {k: [] for k in kinds}
    for _ in range(args.rounds):
        for kind in per_command:
            per_command[kind].append(on_loop(kind, lambda: commands(config, args.commands)))

    hows = {"compiled (sandboxes/launch.c)": "compiled", "shell script (SWERVE_SANDBOX_LAUNCHER=sh)": "sh"}
    per_launch = {k: [] for k in hows}
    for _ in range(args.rounds):
        for name, how in hows.items():
            per_launch[name].append(on_loop(kinds[0], lambda: launches(config, args.lifecycles, how)))

    print(f"{args.lifecycles} lifecycles (start, `echo hi`, close) a round, {args.rounds} rounds, alternating")
    table(per_life, "ms", 2)
    print(f"\nper command, {args.commands} on one sandbox (us)")
    table(per_command, "us", 0)
    print(f"\nper lifecycle by launcher, {args.lifecycles} a round (ms, user + system)")
    print("| launcher | this process | its sandbox's processes | rounds (this + sandbox's) |")
    print("|---|---|---|---|")
    for name, rounds in per_launch.items():
        own, kids = statistics.median(r[0] for r in rounds), statistics.median(r[1] for r in rounds)
        spread = ", ".join(f"{a:.2f}+{b:.2f}" for a, b in rounds)
        print(f"| {name} | {own:.2f} | {kids:.2f} | {spread} |")


def profile(config, kind: str, n: int) -> None:
    """Where this process's time per lifecycle goes, by cProfile (its overhead inflates the
    Python side; the event loop's wait, mostly the admission's pacing, is left out)."""
    import cProfile
    import pstats

    on_loop(kind, lambda: lifecycles(config, 5))
    profiler = cProfile.Profile()
    user, system = on_loop(kind, lambda: _profiled(profiler, config, n))
    stats = pstats.Stats(profiler)
    wait = sum(tt for (_, _, name), (_, _, tt, _, _) in stats.stats.items() if name == "<method 'poll' of 'select.epoll' objects>")
    print(f"{n} lifecycles under cProfile: {user:.2f} user + {system:.2f} system ms each (with the profiler), "
          f"{stats.total_calls / n:.0f} calls each, {(stats.total_tt - wait) / n * 1e3:.2f} ms each outside the loop's wait")
    stats.sort_stats("tottime").print_stats(25)
    stats.sort_stats("cumulative").print_stats(40)


async def _profiled(profiler, config, n: int) -> tuple[float, float]:
    profiler.enable()
    try:
        return await lifecycles(config, n)
    finally:
        profiler.disable()


def table(by_kind: dict[str, list[tuple[float, float]]], unit: str, digits: int) -> None:
    """A row per loop: medians of user, system and their sum over the rounds (the kernel splits a
    process's time between user and system by ticks, so the split is noisier than the sum)."""
    print(f"| shell process | user {unit} | system {unit} | all {unit} | rounds (user+system) |")
    print("|---|---|---|---|---|")
    for kind, values in by_kind.items():
        med = [statistics.median(x) for x in ([u for u, _ in values], [s for _, s in values],
                                               [u + s for u, s in values])]
        rounds = ", ".join(f"{u:.{digits}f}+{s:.{digits}f}" for u, s in values)
        print(f"| {kind} | " + " | ".join(f"{m:.{digits}f}" for m in med) + f" | {rounds} |")

if __name__ == "__main__":
    main()
