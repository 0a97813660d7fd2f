"""Per-turn overhead of the agent loop itself (excluding model and command time), side by side
in one run with mini-swe-agent driven by an equivalent scripted model over the same number of
steps. Ours: scripted sampler, tiny model's tokenizer and chat template, bubblewrap sandbox, an
episode that reaches ~131k tokens by turn 300. mini: DeterministicModel + LocalEnvironment.

    .venv/bin/python bench/agent_loop.py [--turns 300] [--obs-chars 750]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("MSWEA_SILENT_STARTUP", "1")

from transformers import AutoTokenizer  # noqa: E402

from envs.swe_env import SWEEnv, SWEEnvConfig, task_sandbox  # noqa: E402
from envs.task import Task  # noqa: E402
from service.worker.agent import AgentConfig, TokenRenderer, run_episode  # noqa: E402
from service.worker.scripted import replay  # noqa: E402
from service.fleet.tiny_model import init_tiny  # noqa: E402

SUITE = ROOT / "envs" / "example_suite" / "suite.jsonl"


class TimedSink:
    def __init__(self):
        self.turns, self.stamps = [], []

    async def append(self, turn) -> None:
        self.turns.append(turn)
        self.stamps.append(time.perf_counter())


async def ours(turns: int, obs_chars: int, tmp: Path) -> tuple[list[float], int]:
    tok = AutoTokenizer.from_pretrained(init_tiny(tmp / "tiny"))
    task = Task.model_validate(json.loads(SUITE.read_text().splitlines()[0]))
    cfg = SWEEnvConfig(image_cache_dir=ROOT / "var" / "bench" / "images")
    words = " ".join(f"word{i % 97}" for i in range(obs_chars // 7))[:obs_chars]
    calls = [{"name": "bash", "arguments": {"command": "cat /tmp/obs.txt"}}] * turns + [{"name": "submit", "arguments": {}}]
    async with task_sandbox(task, cfg) as sandbox:
        await sandbox.write_file("/tmp/obs.txt", words)
        sink = TimedSink()
        started = time.perf_counter()
        await run_episode(replay(tok, calls), SWEEnv(task, sandbox, cfg), TokenRenderer(tok, SWEEnv.tools),
                          AgentConfig(max_turns=turns + 5), sink)
    stamps = [started, *sink.stamps]
    overhead = [(stamps[i + 1] - stamps[i]) - t.generation_s - t.tool_s for i, t in enumerate(sink.turns)]
    tokens = sum(len(t.input_ids) + len(t.output_ids) for t in sink.turns)
    return overhead[:turns], tokens


def mini(turns: int, obs_chars: int, tmp: Path) -> list[float]:
    from minisweagent.agents.default import DefaultAgent
    from minisweagent.environments.local import LocalEnvironment
    from minisweagent.exceptions import Submitted
    from minisweagent.models.test_models import DeterministicModel, make_output

    (tmp / "obs.txt").write_text(" ".join(f"word{i % 97}" for i in range(obs_chars // 7))[:obs_chars])
    timings: dict[str, list[float]] = {"model": [], "env": [], "step": []}

    class TimedModel(DeterministicModel):
        def query(self, messages, **kwargs):
            t = time.perf_counter()
            out = super().query(messages, **kwargs)
            timings["model"].append(time.perf_counter() - t)
            return out

    class TimedEnv(LocalEnvironment):
        def execute(self, action, cwd="", *, timeout=None):
            t = time.perf_counter()
            try:
                return super().execute(action, cwd, timeout=timeout)
            finally:
                timings["env"].append(time.perf_counter() - t)

    class TimedAgent(DefaultAgent):
        def step(self):
            t = time.perf_counter()
            try:
                return super().step()
            finally:
                timings["step"].append(time.perf_counter() - t)

    outputs = [make_output("Look again.\n```mswea_bash_command\ncat obs.txt\n```", [{"command": "cat obs.txt"}])] * turns
    outputs.append(make_output("Done.", [{"command": "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"}]))
    agent = TimedAgent(TimedModel(outputs=outputs), TimedEnv(cwd=str(tmp)), system_template="Fix it.",
                       instance_template="{{task}}", step_limit=0, cost_limit=0)
    try:
        agent.run("The bug is in lib.py.")
    except Submitted:
        pass
    return [s - m - e for s, m, e in zip(timings["step"], timings["model"], timings["env"])][:turns]


def describe(name: str, overhead: list[float]) -> str:
    last = overhead[-10:]
    return (f"{name:14} mean {statistics.mean(overhead) * 1e3:7.3f} ms  median {statistics.median(overhead) * 1e3:7.3f} ms"
            f"  first 10 {statistics.mean(overhead[:10]) * 1e3:7.3f} ms  last 10 {statistics.mean(last) * 1e3:7.3f} ms")


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=300)
    parser.add_argument("--obs-chars", type=int, default=750)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        our_overhead, tokens = await ours(args.turns, args.obs_chars, Path(tmp))
        (Path(tmp) / "mini").mkdir()
        mini_overhead = mini(args.turns, args.obs_chars, Path(tmp) / "mini")
    print(f"per-turn loop overhead, model and command time excluded, {args.turns} turns; "
          f"our episode reached {tokens} tokens")
    print(describe("swerve", our_overhead))
    print(describe("mini-swe-agent", mini_overhead))
    print(f"last-10 ratio swerve/mini: {statistics.mean(our_overhead[-10:]) / statistics.mean(mini_overhead[-10:]):.2f}x")


if __name__ == "__main__":
    asyncio.run(main())
