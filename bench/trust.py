"""What the sandbox protections cost: sandbox start and command round trip, network off and on,
for the sandboxes of this tree and of an earlier commit (before the protections), one after the
other in one run.

    .venv/bin/python bench/trust.py --before 6552d19 [--commands 500] [--starts 30]

Before: bwrap as root (uid 1000 inside = root outside), network on = the host's namespace,
Docker's default bridge. After: an unprivileged host uid, nested user namespaces refused,
network on = its own namespace with slirp4netns and filtering rules, the swerve-egress bridge.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Runs inside a fresh interpreter with one tree first on sys.path: its sandboxes, and its
# bench/sandbox.py's `ours` (starts, then round trips).
PROBE = r"""
import asyncio, json, statistics, sys, tempfile
from pathlib import Path
sys.path[:0] = [sys.argv[1], sys.argv[1] + "/bench"]
from sandboxes.base import SandboxLimits
from sandboxes.config import BwrapSandboxConfig, DockerSandboxConfig
from sandbox import ours
n_commands, n_starts, repo, image = int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4]), sys.argv[5]

async def measure(config):
    rtts, starts = await ours(config, n_commands, n_starts)
    return {"start_ms": statistics.median(starts) * 1e3, "rtt_ms": statistics.median(rtts) * 1e3}

async def main():
    out = {}
    with tempfile.TemporaryDirectory() as state:
        for net in (False, True):
            limits = SandboxLimits(memory_mb=512, pids=256, network=net)
            tag = " +net" if net else ""
            out["bwrap" + tag] = await measure(BwrapSandboxConfig(root=repo, limits=limits, state_dir=Path(state)))
            out["docker" + tag] = await measure(DockerSandboxConfig(image=image, limits=limits))
    print(json.dumps(out))

asyncio.run(main())
"""


def run(tree: Path, args, repo: Path, image: str) -> dict:
    done = subprocess.run([sys.executable, "-c", PROBE, str(tree), str(args.commands), str(args.starts),
                           str(repo), image], capture_output=True, text=True, cwd=tree)
    if done.returncode != 0:
        raise SystemExit(f"{tree}: {done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", required=True, help="commit whose sandboxes had no protections")
    parser.add_argument("--commands", type=int, default=500)
    parser.add_argument("--starts", type=int, default=30)
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "bench"))
    from sandbox import ENV_MB, docker_env_image, make_repo

    repo = make_repo(ROOT / "var" / "bench" / f"env-{ENV_MB}mb", ENV_MB)
    subprocess.run(["chown", "-R", "61000:61000", str(repo)], check=True)  # the sandboxes' uid owns it, as a build leaves it
    image = docker_env_image(repo)
    with tempfile.TemporaryDirectory() as tmp:
        old = Path(tmp) / "before"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "-q", "--detach", str(old), args.before], check=True)
        try:
            results = {"before": run(old, args, repo, image), "after": run(ROOT, args, repo, image)}
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(old)], check=True)
    print(f"median over {args.starts} starts and {args.commands} round trips of `true`, {ENV_MB} MB environment")
    print(f"{'sandbox':14} {'start before':>12} {'start after':>12} {'ratio':>6} {'rtt before':>11} {'rtt after':>10} {'ratio':>6}")
    for name in results["after"]:
        b, a = results["before"][name], results["after"][name]
        print(f"{name:14} {b['start_ms']:10.1f}ms {a['start_ms']:10.1f}ms {a['start_ms'] / b['start_ms']:5.2f}x "
              f"{b['rtt_ms']:9.3f}ms {a['rtt_ms']:8.3f}ms {a['rtt_ms'] / b['rtt_ms']:5.2f}x")


if __name__ == "__main__":
    main()
