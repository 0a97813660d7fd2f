"""The worker's own CPU per sandbox command: N commands, one after another, through one
bubblewrap and one Docker sandbox, timed with this process's CPU clock (user + system of every
thread here, not the sandbox's): what the shell session costs the worker per tool call, beside
the command's wall round trip. Three kinds of command alternate: `true`, a few lines of output,
and 200 KB of output (a file printed).

    .venv/bin/python bench/shell.py [--commands 3000] [--rounds 3] [--backends bwrap docker]

Compare two codes by running the script from each checkout (it imports the sandboxes beside it):
    .venv/bin/python /path/to/other/worktree/bench/shell.py
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from sandboxes.base import open_sandbox  # noqa: E402
from sandboxes.config import BwrapSandboxConfig, DockerSandboxConfig  # noqa: E402

COMMANDS = ("true", "echo hello; echo world; printf '%s\\n' $((6 * 7))", "head -c 200000 /dev/zero | tr '\\0' a")


async def one_round(config, n: int) -> tuple[float, float, int]:
    """CPU and wall seconds per command over n commands, and the output bytes seen."""
    async with open_sandbox(config) as sb:
        for command in COMMANDS * 10:  # warm: the shell, the page cache, the event loop
            await sb.execute(command)
        seen = 0
        cpu, wall = time.process_time(), time.perf_counter()
        for i in range(n):
            r = await sb.execute(COMMANDS[i % len(COMMANDS)])
            if r.exit_code != 0:
                raise SystemExit(f"command {i} failed: {r}")
            seen += r.output_bytes
        return (time.process_time() - cpu) / n, (time.perf_counter() - wall) / n, seen


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--commands", type=int, default=3000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--backends", nargs="+", default=["bwrap", "docker"], choices=["bwrap", "docker"])
    args = ap.parse_args()
    rev = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                         text=True).stdout.strip() or "?"
    dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "sandboxes"], capture_output=True,
                           text=True).stdout.strip()
    print(f"code: {ROOT} at {rev}{' with changes to sandboxes/' if dirty else ''}; {args.commands} commands a round")
    print("| backend | CPU us/command (rounds) | median | wall us/command (median) |")
    print("|---|---|---|---|")
    for backend in args.backends:
        config = BwrapSandboxConfig() if backend == "bwrap" else DockerSandboxConfig()
        rounds = [await one_round(config, args.commands) for _ in range(args.rounds)]
        cpus = [c * 1e6 for c, _, _ in rounds]
        wall = statistics.median(w for _, w, _ in rounds) * 1e6
        print(f"| {backend} | {', '.join(f'{c:.0f}' for c in cpus)} | {statistics.median(cpus):.0f} | {wall:.0f} |")


if __name__ == "__main__":
    asyncio.run(main())
