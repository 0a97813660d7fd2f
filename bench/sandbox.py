"""Sandbox speed, side by side in one run: command round trip and sandbox start for our
bubblewrap and Docker backends, SWE-ReX's local runtime, and one fresh `subprocess.run` per
command (how mini-swe-agent executes actions); then 64 concurrent sandboxes per backend.
bubblewrap runs twice: launched by the compiled launcher (sandboxes/launch.c) and by the
shell script it replaced (SWERVE_SANDBOX_LAUNCHER=sh). Docker runs twice: containers created
at each start, and taken from the warm pool (SWERVE_DOCKER_POOL=--pool). Each sandbox is held
--hold seconds after its first command, as an episode holds it (not counted), which is when
the pool refills. Each row's first sandbox is not counted (a process's first, and a host's first
bubblewrap start also compiles the launcher).

    .venv/bin/python bench/sandbox.py [--commands 1000] [--starts 50] [--concurrent 64] [--hold 0.5] [--pool 4]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from sandboxes.base import SandboxLimits, open_sandbox  # noqa: E402
from sandboxes.config import BwrapSandboxConfig, DockerSandboxConfig  # noqa: E402

ENV_MB = 50


def pct(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1] if len(values) > 1 else values[0]


def make_repo(path: Path, mb: int) -> Path:
    """A git repository of about `mb` MB: the environment a sandbox starts from."""
    if (path / ".git").exists():
        return path
    path.mkdir(parents=True)
    for i in range(mb):
        sub = path / f"pkg{i % 10}"
        sub.mkdir(exist_ok=True)
        (sub / f"mod{i}.py").write_bytes(os.urandom(512 * 1024).hex().encode()[: 1 << 20])
    subprocess.run("git init -q && git add -A && git -c user.name=b -c user.email=b@b commit -qm env",
                   shell=True, cwd=path, check=True)
    return path


def docker_env_image(repo: Path) -> str:
    import docker

    from sandboxes.images import ensure_base_image

    client = docker.from_env()
    name = f"swerve-bench-env:{ENV_MB}mb"
    try:
        client.images.get(name)
        return name
    except docker.errors.ImageNotFound:
        pass
    ensure_base_image(client)
    box = client.containers.create("swerve-base:bookworm", ["true"])
    tar = subprocess.run(["tar", "-C", str(repo), "--owner=1000", "--group=1000", "-c", "."],
                         capture_output=True, check=True).stdout
    client.api.put_archive(box.id, "/", _wrap_in_work(tar))
    box.commit(repository=name.split(":")[0], tag=name.split(":")[1])
    box.remove()
    return name


def _wrap_in_work(tar: bytes) -> bytes:
    """Re-root a tar of the repo under work/ so it lands at /work."""
    import io
    import tarfile

    src, out = tarfile.open(fileobj=io.BytesIO(tar)), io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as dst:
        for member in src.getmembers():
            data = src.extractfile(member) if member.isfile() else None
            member.name = "work" if member.name in (".", "./") else "work/" + member.name.lstrip("./")
            dst.addfile(member, data)
    return out.getvalue()


async def ours(config, n_commands: int, n_starts: int, hold: float = 0.0) -> tuple[list[float], list[float]]:
    async with open_sandbox(config) as sb:  # not counted: a process's first sandbox (a host's first
        await sb.execute("true")             # also compiles the bubblewrap launcher, once)
    starts = []
    for _ in range(n_starts):
        t = time.perf_counter()
        async with open_sandbox(config) as sb:
            await sb.execute("true")
            starts.append(time.perf_counter() - t)
            await asyncio.sleep(hold)
    async with open_sandbox(config) as sb:
        rtts = []
        for _ in range(n_commands):
            t = time.perf_counter()
            await sb.execute("true")
            rtts.append(time.perf_counter() - t)
    return rtts, starts


async def swerex(n_commands: int, n_starts: int) -> tuple[list[float], list[float]]:
    from swerex.runtime.abstract import BashAction, CloseBashSessionRequest, CreateBashSessionRequest
    from swerex.runtime.local import LocalRuntime

    starts = []
    for _ in range(n_starts):
        t = time.perf_counter()
        rt = LocalRuntime()
        await rt.create_session(CreateBashSessionRequest(session="b"))
        await rt.run_in_session(BashAction(command="true", session="b", timeout=30))
        starts.append(time.perf_counter() - t)
        await rt.close_session(CloseBashSessionRequest(session="b"))
    rt = LocalRuntime()
    await rt.create_session(CreateBashSessionRequest(session="b"))
    rtts = []
    for _ in range(n_commands):
        t = time.perf_counter()
        await rt.run_in_session(BashAction(command="true", session="b", timeout=30))
        rtts.append(time.perf_counter() - t)
    await rt.close_session(CloseBashSessionRequest(session="b"))
    return rtts, starts


def fresh_subprocess(n_commands: int) -> list[float]:
    rtts = []
    for _ in range(n_commands):
        t = time.perf_counter()
        subprocess.run("true", shell=True, capture_output=True, text=True, timeout=30)
        rtts.append(time.perf_counter() - t)
    return rtts


async def concurrent(config, n: int) -> tuple[int, float]:
    async def one(i: int) -> bool:
        async with open_sandbox(config) as sb:
            r = await sb.execute(f"echo {i} > /tmp/x && cat /tmp/x && ls /work | wc -l")
            return r.exit_code == 0 and r.output.startswith(f"{i}\n")

    t = time.perf_counter()
    results = await asyncio.gather(*(one(i) for i in range(n)), return_exceptions=True)
    errors = [r for r in results if r is not True]
    for err in errors[:3]:
        print("  error:", repr(err)[:300])
    return len(errors), time.perf_counter() - t


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--commands", type=int, default=1000)
    parser.add_argument("--starts", type=int, default=50)
    parser.add_argument("--concurrent", type=int, default=64)
    parser.add_argument("--hold", type=float, default=0.5)
    parser.add_argument("--pool", type=int, default=4)
    args = parser.parse_args()
    from sandboxes.docker import POOL

    repo = make_repo(ROOT / "var" / "bench" / f"env-{ENV_MB}mb", ENV_MB)
    limits = SandboxLimits(memory_mb=512, pids=256)
    with tempfile.TemporaryDirectory() as state:
        bwrap = BwrapSandboxConfig(root=repo, limits=limits, state_dir=Path(state))
        docker = DockerSandboxConfig(image=docker_env_image(repo), limits=limits)
        rows = {}
        rows["swerve bwrap"] = await ours(bwrap, args.commands, args.starts, args.hold)
        os.environ["SWERVE_SANDBOX_LAUNCHER"] = "sh"  # the launcher before sandboxes/launch.c
        rows["swerve bwrap, sh launch"] = await ours(bwrap, args.commands, args.starts, args.hold)
        del os.environ["SWERVE_SANDBOX_LAUNCHER"]
        rows["swerve docker"] = await ours(docker, args.commands, args.starts, args.hold)
        os.environ["SWERVE_DOCKER_POOL"] = str(args.pool)
        await ours(docker, 0, 1, 5.0)  # the first start is made afresh; then the pool fills
        rows["swerve docker pool"] = await ours(docker, args.commands, args.starts, args.hold)
        pooled_conc = await concurrent(docker, args.concurrent)
        POOL.drain()
        del os.environ["SWERVE_DOCKER_POOL"]
        rows["SWE-ReX local"] = await swerex(args.commands, args.starts)
        rows["subprocess.run"] = (fresh_subprocess(args.commands), [])
        conc = {"swerve bwrap": await concurrent(bwrap, args.concurrent),
                "swerve docker": await concurrent(docker, args.concurrent),
                f"swerve docker pool {args.pool}": pooled_conc}

    base = statistics.median(rows["subprocess.run"][0])
    print(f"round trip of `true` over {args.commands} commands; start over {args.starts} "
          f"sandboxes with a {ENV_MB} MB repository environment, each held {args.hold} s")
    print(f"{'runtime':23} {'rtt p50 ms':>10} {'rtt p99 ms':>10} {'vs subprocess':>13} {'start p50 ms':>12} "
          f"{'start p99 ms':>12}")
    for name, (rtts, starts) in rows.items():
        p50 = statistics.median(rtts)
        start = (f"{statistics.median(starts) * 1e3:12.1f} {pct(starts, 99) * 1e3:12.1f}" if starts
                 else f"{'-':>12} {'-':>12}")
        print(f"{name:23} {p50 * 1e3:10.3f} {pct(rtts, 99) * 1e3:10.3f} {p50 / base:12.2f}x {start}")
    for name, (errors, seconds) in conc.items():
        print(f"{args.concurrent} concurrent {name}: {errors} errors, {seconds:.1f} s for all")


if __name__ == "__main__":
    asyncio.run(main())
