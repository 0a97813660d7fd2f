"""The checkpoints of a finished `swerve demo learn`, evaluated again on its held-out split at
other sampling temperatures (the demo evaluates at its plan's eval_temperature): how much of
the held-out failure is the sampling noise of a 1M-parameter policy over ~60-token tool calls.

    .venv/bin/python bench/demo_temperature.py --temperatures 0.5 --models "after SFT" "after RL"

The runs go to the demo's database (named "temperature probe ..."); a table to stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path

from rich.console import Console

from service import demo
from service.cli import _settings
from service.embedded import start_vllm

FOLDERS = {"after SFT": "sft", "after RL": "rl", "SFT continued": "sft-continued"}


async def main(args) -> None:
    base = _settings()
    root = base.data_dir / "demo-learn"
    settings = base.model_copy(update={"data_dir": root, "models_dir": root / "models"})
    saved = json.loads((root / "results.json").read_text())
    plan = demo.LearnPlan(seed=saved["plan"]["seed"])
    console = Console(width=160)
    heldout = root / "suites" / f"{demo.FAMILY}-heldout-s{plan.seed}.jsonl"
    first = root / "models" / FOLDERS[args.models[0]]
    vllm = start_vllm(settings, first, args.vllm_port, console, max_model_len=plan.max_model_len, die_with_parent=True)
    rows = []
    try:
        for name in args.models:
            model = root / "models" / FOLDERS[name]
            await demo.serve_weights(vllm.url, model, 0)
            for temperature in args.temperatures:
                sampler = {"type": "vllm", "endpoints": [vllm.url], "tokenizer": str(first)}
                _, result = await demo.one_pass(settings, heldout, f"temperature probe: {name} at T={temperature}",
                                                sampler, plan.eval_samples, plan, args.port, console,
                                                temperature=temperature)
                rows.append((name, temperature, result))
                print(f"{name} T={temperature}: pass@1 {result['pass_at_1']:.3f}", flush=True)
    finally:
        vllm.stop()
    print("\n| policy | temperature | held-out pass@1 (95% CI) | pass@k | format errors | mean turns |")
    print("|---|---|---|---|---|---|")
    evaluated_at = saved["plan"].get("eval_temperature", 1.0)
    for name, temperature, r in [(n, evaluated_at, saved["evals"][n]["heldout"]) for n in args.models] + rows:
        lo, hi = r["pass_at_1_ci"]
        print(f"| {name} | {temperature} | {r['pass_at_1']:.3f} ({lo:.3f}-{hi:.3f}) | {r['pass_at_k']:.3f} | "
              f"{r['format_error_rate']:.3f} | {r['mean_turns']:.2f} |")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.5])
    parser.add_argument("--models", nargs="+", default=["after SFT", "after RL"], choices=sorted(FOLDERS))
    parser.add_argument("--port", type=int, default=8031)
    parser.add_argument("--vllm-port", type=int, default=8131)
    asyncio.run(main(parser.parse_args()))
