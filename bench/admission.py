"""Sandbox admission at scale on the Docker backend: N episodes in flight at once, spread over
worker processes on this host, each opening a Docker sandbox, running a few commands as an
agent would for `--hold` seconds, and closing it. Run once with admission (this host's
defaults, or --max-live/--starts-per-s) and once with it off (no cap, no pacing), side by side:
errors, start latency (asked -> first command answered) p50/p99, wall time, most containers
alive at once.

    .venv/bin/python bench/admission.py [--episodes 256] [--processes 4] [--hold 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

WORKER = """
import asyncio, json, sys, time
from sandboxes.base import SandboxLimits, open_sandbox
from sandboxes.config import DockerSandboxConfig

async def episode(hold):
    asked = time.time()
    try:
        async with open_sandbox(DockerSandboxConfig(limits=SandboxLimits(memory_mb=256, disk_mb=256))) as sb:
            out = await sb.execute("echo ready")
            first = time.time()
            assert out.output == "ready\\n", out.output
            for cmd in ("ls / > /dev/null", "python3 -c 'print(1)'", "git --version"):
                await sb.execute(cmd)
                await asyncio.sleep(hold / 3)
        return {"ok": True, "start_s": first - asked}
    except Exception as e:
        return {"ok": False, "error": f"{type(e).__name__}: {str(e)[:200]}"}

async def main(n, hold):
    for r in await asyncio.gather(*(episode(hold) for _ in range(n))):
        print(json.dumps(r), flush=True)

asyncio.run(main(int(sys.argv[1]), float(sys.argv[2])))
"""


def live_containers() -> int:
    out = subprocess.run(["docker", "ps", "-q", "--filter", "label=swerve.sandbox"], capture_output=True, text=True)
    return len(out.stdout.split())


def run(episodes: int, processes: int, hold: float, env: dict) -> dict:
    state = tempfile.mkdtemp(prefix="swerve-bench-admission-")
    environ = os.environ | {"PYTHONPATH": str(ROOT), "SWERVE_SANDBOX_DIR": state} | env
    peak, done = 0, threading.Event()

    def watch():
        nonlocal peak
        while not done.is_set():
            peak = max(peak, live_containers())
            time.sleep(0.5)

    watcher = threading.Thread(target=watch)
    watcher.start()
    start = time.perf_counter()
    share = [episodes // processes + (1 if i < episodes % processes else 0) for i in range(processes)]
    procs = [subprocess.Popen([sys.executable, "-c", WORKER, str(n), str(hold)], env=environ, stdout=subprocess.PIPE,
                              text=True) for n in share]
    results = []
    for p in procs:
        out, _ = p.communicate()
        results += [json.loads(line) for line in out.splitlines()]
    wall = time.perf_counter() - start
    done.set()
    watcher.join()
    starts = sorted(r["start_s"] for r in results if r["ok"])
    errors = [r["error"] for r in results if not r["ok"]]
    return {"episodes": len(results), "errors": len(errors), "first_errors": errors[:3], "wall_s": wall,
            "p50_s": statistics.median(starts) if starts else None,
            "p99_s": starts[min(len(starts) - 1, int(0.99 * len(starts)))] if starts else None, "peak_live": peak}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=256)
    parser.add_argument("--processes", type=int, default=4)
    parser.add_argument("--hold", type=float, default=5.0)
    parser.add_argument("--max-live", type=int, default=None)
    parser.add_argument("--starts-per-s", type=float, default=None)
    parser.add_argument("--modes", nargs="+", default=["admission", "off"], choices=["admission", "off"])
    args = parser.parse_args()
    from sandboxes import admission

    on = {k: str(v) for k, v in (("SWERVE_SANDBOX_MAX_LIVE", args.max_live),
                                 ("SWERVE_SANDBOX_STARTS_PER_S", args.starts_per_s)) if v is not None}
    modes = {"admission": on, "off": {"SWERVE_SANDBOX_MAX_LIVE": "1000000", "SWERVE_SANDBOX_STARTS_PER_S": "1000000"}}
    limits = (f"max_live={args.max_live or admission.max_live()}, "
              f"starts_per_s={args.starts_per_s or admission.starts_per_s()}")
    print(f"{args.episodes} episodes over {args.processes} processes, {args.hold:g} s each; admission: {limits}")
    print(f"{'mode':10} {'episodes':>8} {'errors':>6} {'wall s':>7} {'start p50 s':>11} {'start p99 s':>11} {'peak live':>9}")
    for mode in args.modes:
        r = run(args.episodes, args.processes, args.hold, modes[mode])
        p50 = f"{r['p50_s']:.2f}" if r["p50_s"] is not None else "-"
        p99 = f"{r['p99_s']:.2f}" if r["p99_s"] is not None else "-"
        print(f"{mode:10} {r['episodes']:8d} {r['errors']:6d} {r['wall_s']:7.1f} {p50:>11} {p99:>11} {r['peak_live']:9d}")
        for e in r["first_errors"]:
            print(f"           error: {e}")


if __name__ == "__main__":
    main()
