"""The RL job's pace: steps per hour and where a step's time goes, asynchronous against
synchronous, on this machine, through the whole job (`swerve rl`: orchestrator, in-process
worker, bubblewrap sandboxes, one vLLM CPU server, the trainer process, weight reloads).

One vLLM server is started for the benchmark and shared by the jobs (each job's trainer loads
its initial weights into it first); each job gets its own data folder (database, trainer). For
each `max_off_policy_steps` (0: synchronous, sampling waits for the trainer's newest version;
1 and 2: sampling runs ahead) the same job runs `--steps` steps, evaluation off. The random
policy earns no reward, so the trainer trains on every sample (sft = true): a step costs what a
step with rewards would (the loss differs, not the work). Reported, over
the warm steps (step 2 on): steps per hour, and the trainer's time split into waiting for
rollouts, training and publishing (weights written, version recorded, fleet reloaded).

With `--pin`, the vLLM server runs on CPU 0 and the job (worker, sandboxes, trainer) on CPU 1,
as inference and training have their own devices in a real deployment; without it they share
both cores, and each slows the other down when they overlap.

    .venv/bin/python bench/rl.py [--steps 8] [--modes 0 1 2] [--hidden 512 --layers 4] [--pin]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import sqlalchemy as sa  # noqa: E402

from service.fleet.server import VLLMServer  # noqa: E402
from service.fleet.tiny_model import TinyModelSpec, init_tiny  # noqa: E402
from tests.servers import free_port  # noqa: E402

CONFIG = """
[job]
name = "bench"
steps = {steps}
[suite]
path = "{suite}"
epochs = 20
groups_per_step = {groups}
[eval]
enabled = false
[rollouts]
samples_per_task = {samples}
concurrency = {concurrency}
max_off_policy_steps = {mode}
agent = {{ max_turns = {turns}, sampling = {{ max_tokens = {tokens} }} }}
[trainer]
fill_useful = false
sft = true                    # the random policy earns no reward: train on every sample, so a step costs what it would
checkpoint_every = 1000
optim = {{ lr = 1e-4 }}
data = {{ seq_len = 8192 }}
[inference]
endpoints = ["{url}"]
model = "{model}"
served_model = "policy"
[serve]
port = {port}
after = false
"""


class PinnedServer(VLLMServer):
    """The vLLM server on CPU 0 only."""

    def command(self) -> list[str]:
        return ["taskset", "-c", "0", *super().command()]


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def run_job(mode: int, args, model: Path, url: str, root: Path) -> dict:
    folder = root / f"mode-{mode}"
    folder.mkdir()
    config = folder / "rl.toml"
    config.write_text(CONFIG.format(steps=args.steps, suite=ROOT / "envs/example_suite/suite.jsonl",
                                    groups=args.groups, samples=args.samples, concurrency=args.concurrency,
                                    mode=mode, turns=args.turns, tokens=args.tokens, url=url, model=model,
                                    port=free_port()))
    env = {k: v for k, v in os.environ.items() if not k.startswith("SWERVE_")} | {"SWERVE_DATA_DIR": str(folder)}
    started = time.monotonic()
    pin = ["taskset", "-c", "1"] if args.pin else []
    done = subprocess.run([*pin, sys.executable, "-m", "service.cli", "rl", "--config", str(config)], env=env,
                          capture_output=True, text=True)
    wall = time.monotonic() - started
    if done.returncode != 0:
        raise SystemExit(f"mode {mode}: swerve rl exited {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    engine = sa.create_engine(f"sqlite:///{folder / 'swerve.db'}")
    with engine.connect() as conn:
        rows = conn.execute(sa.text("SELECT version, created_at, info FROM policies WHERE version > 0 "
                                    "ORDER BY version")).all()
    engine.dispose()
    steps = [(v, _time(c), json.loads(i) if isinstance(i, str) else i) for v, c, i in rows]
    warm = steps[1:]  # from step 2: the trainer process is up and the first batch is behind it
    span = warm[-1][1] - steps[0][1]
    parts = {k: sum(s[2].get(k) or 0.0 for s in warm) for k in ("wait_s", "step_s", "publish_s")}
    total = sum(parts.values())
    staleness = [s[2].get("staleness_mean") for s in steps if s[2].get("staleness_mean") is not None]
    return {"mode": mode, "steps": len(steps), "wall_s": wall, "steps_per_hour": 3600 * len(warm) / span,
            "idle": parts["wait_s"] / total, "train": parts["step_s"] / total, "publish": parts["publish_s"] / total,
            "step_s": span / len(warm), "staleness": sum(staleness) / len(staleness) if staleness else 0.0}


def _time(value) -> float:
    from datetime import datetime

    return (value if isinstance(value, datetime) else datetime.fromisoformat(str(value))).timestamp()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--modes", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--groups", type=int, default=2, help="groups per step")
    parser.add_argument("--samples", type=int, default=4, help="samples per task")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--hidden", type=int, default=512, help="the policy's hidden size (training must cost time)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--pin", action="store_true", help="vLLM on CPU 0, the job on CPU 1")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-rl-") as tmp:
        root = Path(tmp)
        model = init_tiny(root / "policy", TinyModelSpec(hidden_size=args.hidden, layers=args.layers,
                                                         intermediate_size=3 * args.hidden, heads=8, kv_heads=4,
                                                         head_dim=args.hidden // 8))
        server = (PinnedServer if args.pin else VLLMServer)(
            model, free_port(), served_name="policy", max_model_len=8192, log_path=root / "vllm.log",
            die_with_parent=True).start()
        try:
            server.wait_ready()
            results = [run_job(mode, args, model, server.url, root) for mode in args.modes]
        finally:
            server.stop()
    sync = next((r for r in results if r["mode"] == 0), None)
    print(f"machine: {os.cpu_count()} cores, {cpu_name()}")
    print(f"policy: Qwen3 hidden {args.hidden}, {args.layers} layers; {args.groups} groups x {args.samples} samples "
          f"per step, {args.turns} turns x {args.tokens} tokens, {args.steps} steps; "
          + ("vLLM on CPU 0, the job on CPU 1" if args.pin else "vLLM and the job share the CPUs"))
    print("| max_off_policy_steps | steps/h (warm) | vs sync | s/step | trainer waiting | training | publishing |"
          " staleness |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        ratio = f"{r['steps_per_hour'] / sync['steps_per_hour']:.2f}x" if sync else "-"
        print(f"| {r['mode']} | {r['steps_per_hour']:.0f} | {ratio} | {r['step_s']:.1f} | {r['idle']:.0%} | "
              f"{r['train']:.0%} | {r['publish']:.0%} | {r['staleness']:.2f} |")


if __name__ == "__main__":
    main()
