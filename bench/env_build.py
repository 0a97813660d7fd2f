"""Environment builds over many tasks of few repositories, side by side in one run: 50 tasks of 5
repositories (10 base commits each, one setup commit and one install per repository, as SWE-bench's
(repo, version)), built by swerve's task images with the environment shared per env_key (the
install once per repository, each task's image made from it) and one build per task (the install
again for every task: swerve before sharing). Then sandbox starts from the task images
(copy-on-write, per episode).

    .venv/bin/python bench/env_build.py [--backend bwrap|docker] [--repos 5] [--tasks-per-repo 10] [--starts 50]
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from sandboxes.base import open_sandbox  # noqa: E402
from sandboxes.config import BwrapSandboxConfig, DockerSandboxConfig  # noqa: E402
from sandboxes.task_images import ImageSpec, prepare_bwrap, prepare_docker  # noqa: E402

INSTALL = ("pip install -q pytest", "pip install -q --no-build-isolation -e .")


def make_repo(path: Path, n: int, commits: int) -> list[str]:
    """A small installable package with `commits` commits; their ids, oldest first."""
    path.mkdir(parents=True)
    run = lambda *a: subprocess.run(a, cwd=path, check=True, capture_output=True, text=True).stdout.strip()  # noqa: E731
    run("git", "init", "-q")
    (path / "setup.py").write_text(f"from setuptools import setup\nsetup(name='pkg{n}', version='0.1', py_modules=['lib'])\n")
    ids = []
    for c in range(commits):
        (path / "lib.py").write_text("".join(f"def f{i}(x):\n    return x + {i + c}\n" for i in range(200)))
        run("git", "add", "-A")
        run("git", "-c", "user.name=b", "-c", "user.email=b@b", "commit", "-qm", f"c{c}")
        ids.append(run("git", "rev-parse", "HEAD"))
    return ids


def cpu() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


async def build_all(specs: list[ImageSpec], backend: str, cache: Path, share: bool) -> tuple[float, list]:
    started = time.perf_counter()
    out = []
    for spec in specs:
        if backend == "bwrap":
            out.append(BwrapSandboxConfig(root=await prepare_bwrap(spec, cache, share_env=share),
                                          state_dir=cache / "sb"))
        else:
            out.append(DockerSandboxConfig(image=await prepare_docker(spec, share_env=share)))
    return time.perf_counter() - started, out


async def starts(configs: list, n: int) -> list[float]:
    times = []
    for i in range(n):
        t = time.perf_counter()
        async with open_sandbox(configs[i % len(configs)]) as sb:
            r = await sb.execute("python -c 'import lib, pytest; print(lib.f1(1))'")
            times.append(time.perf_counter() - t)
            assert r.output.strip().isdigit(), r.output
    return times


def base_image() -> str:
    import docker

    from sandboxes.images import BASE_IMAGE, ensure_base_image

    return ensure_base_image(docker.from_env(), BASE_IMAGE)


def drop_docker_images(tags: list[str]) -> None:
    import docker

    client = docker.from_env()
    for tag in dict.fromkeys(tags):
        try:
            client.images.remove(tag, force=True)
        except docker.errors.ImageNotFound:
            pass


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", default="bwrap", choices=("bwrap", "docker"))
    ap.add_argument("--repos", type=int, default=5)
    ap.add_argument("--tasks-per-repo", type=int, default=10)
    ap.add_argument("--starts", type=int, default=50)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="swerve-envbench-"))
    try:
        specs = []
        for n in range(args.repos):
            ids = make_repo(tmp / f"repo{n}", n, args.tasks_per_repo)
            specs += [ImageSpec(source=str(tmp / f"repo{n}"), commit=ids[0], install=INSTALL, start=start, history="none")
                      for start in ids]
        shared_s, configs = await build_all(specs, args.backend, tmp / "shared", share=True)
        again_s, _ = await build_all(specs, args.backend, tmp / "shared", share=True)  # every image exists
        if args.backend == "docker":  # task images are named by their key either way: drop them first
            drop_docker_images([c.image for c in configs])
        per_task_s, again = await build_all(specs, args.backend, tmp / "per-task", share=False)
        if args.backend == "bwrap":  # the folders that ran an install: the environments, or every task's
            envs = [p for p in (tmp / "shared").iterdir() if p.name.startswith("env-")]
            installs = len([p for p in (tmp / "per-task").iterdir() if p.is_dir() and p.name[:1] not in ".s"])
        else:
            envs, installs = {s.env_key("docker") for s in specs}, len(specs)
        start_times = await starts(again if args.backend == "docker" else configs, args.starts)
        p50 = statistics.median(start_times)
        print(f"## Environment builds (`bench/env_build.py --backend {args.backend}`)\n")
        print(f"{len(specs)} tasks of {args.repos} repositories ({args.tasks_per_repo} base commits each, one setup "
              f"commit and install per repository: `{'; '.join(INSTALL)}`), {cpu()}, {args.backend}.\n")
        print("| | wall time | installs run | per task |")
        print("|---|---|---|---|")
        print(f"| swerve, environment shared per env_key | {shared_s:.1f} s | {len(envs)} | {shared_s / len(specs):.2f} s |")
        print(f"| swerve, one build per task (before) | {per_task_s:.1f} s | {installs} | {per_task_s / len(specs):.2f} s |")
        print(f"| all {len(specs)} again, built | {again_s:.2f} s | 0 | {again_s / len(specs) * 1000:.1f} ms |")
        print(f"\nShared / per task: {shared_s / per_task_s:.2f}x the wall time ({per_task_s / shared_s:.1f}x faster). "
              f"Sandbox start from a task image (copy-on-write, with a command that imports the installed package): "
              f"p50 {p50 * 1000:.0f} ms over {len(start_times)} starts.")
    finally:
        if args.backend == "docker":
            drop_docker_images([f"swerve-env:{s.key('docker', base_image())}" for s in specs]
                               + [f"swerve-env:{s.env_key('docker', base_image())}" for s in specs])
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    asyncio.run(main())
