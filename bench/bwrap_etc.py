"""bubblewrap start with /etc as one bound copy (sandboxes/etc.py) against a bind of each /etc
entry (the code before it), starts alternating in one process so that the machine's drift, which
moves a whole bench/sandbox.py run by more than the difference, falls on both alike.

The "binds" arm is today's sandbox with bwrap's argv rebuilt as it was: its /etc bind replaced by
an --ro-bind-try of each entry of ETC_FILES. Its launcher still binds the copy where bwrap would
find it (one mount more than the code before made, outside bwrap), so the arm is a little slower
than that code was. Each sandbox runs `true` and is held --hold seconds (not counted), with the
50 MB environment of bench/sandbox.py; each arm's first start is not counted.

    .venv/bin/python bench/bwrap_etc.py [--pairs 100] [--hold 0.2]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.sandbox import ENV_MB, make_repo  # noqa: E402
from sandboxes import bwrap, etc  # noqa: E402
from sandboxes.base import SandboxLimits, open_sandbox  # noqa: E402
from sandboxes.config import BwrapSandboxConfig  # noqa: E402

ONE_COPY = bwrap.BwrapSandbox._bwrap_argv


def binds_argv(self, net_fds):
    argv = ONE_COPY(self, net_fds)
    at = argv.index(bwrap.ETC_VIEW) - 1  # "--ro-bind", ETC_VIEW, "/etc"
    per_entry = [arg for name in etc.ETC_FILES for arg in ("--ro-bind-try", f"/etc/{name}", f"/etc/{name}")]
    return argv[:at] + per_entry + argv[at + 3:]


ARMS = {"one copy of /etc": ONE_COPY, "a bind per /etc entry": binds_argv}


async def start(config, argv, hold: float) -> tuple[float, int]:
    bwrap.BwrapSandbox._bwrap_argv = argv
    t = time.perf_counter()
    async with open_sandbox(config) as sb:
        await sb.execute("true")
        took = time.perf_counter() - t
        mounts = len((await sb.execute("cat /proc/self/mountinfo")).output.splitlines())
        await asyncio.sleep(hold)
    return took, mounts


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=100)
    parser.add_argument("--hold", type=float, default=0.2)
    args = parser.parse_args()
    repo = make_repo(ROOT / "var" / "bench" / f"env-{ENV_MB}mb", ENV_MB)
    with tempfile.TemporaryDirectory() as state:
        config = BwrapSandboxConfig(root=repo, limits=SandboxLimits(memory_mb=512, pids=256), state_dir=Path(state))
        mounts = {}
        for name, argv in ARMS.items():  # not counted: the process's first (and the copy's making)
            _, mounts[name] = await start(config, argv, 0)
        times: dict[str, list[float]] = {name: [] for name in ARMS}
        for i in range(args.pairs):
            for name in list(ARMS)[:: 1 if i % 2 else -1]:  # which goes first alternates too
                took, _ = await start(config, ARMS[name], args.hold)
                times[name].append(took)
    print(f"bubblewrap start ({ENV_MB} MB environment, `true`), {args.pairs} pairs alternating, each held {args.hold} s")
    print(f"{'arm':24} {'mounts':>6} {'p50 ms':>7} {'p90 ms':>7} {'mean ms':>7}")
    for name, values in times.items():
        ms = sorted(v * 1e3 for v in values)
        print(f"{name:24} {mounts[name]:6d} {statistics.median(ms):7.1f} {ms[int(len(ms) * 0.9)]:7.1f} "
              f"{statistics.mean(ms):7.1f}")
    a, b = (times[name] for name in ARMS)
    diffs = sorted((y - x) * 1e3 for x, y in zip(a, b, strict=True))
    print(f"paired, binds minus copy: median {statistics.median(diffs):.1f} ms, "
          f"middle half {diffs[len(diffs) // 4]:.1f} to {diffs[3 * len(diffs) // 4]:.1f} ms, "
          f"copy faster in {sum(d > 0 for d in diffs)} of {len(diffs)} pairs")


if __name__ == "__main__":
    asyncio.run(main())
