"""What makes the demo's small Qwen3 learn to copy: service.fleet.pretrain's first phase
(random-token repeats only) on the model as `swerve demo learn` makes it, and on the same model
with one of its three choices undone, side by side in one run. Each variant reports its accuracy
of predicting the repeats of a random span (1.0 copies, 0.0 does not) every 50 steps, and the
first step at which it reached 0.5 (a copying circuit, an induction head, has formed).

    .venv/bin/python bench/copy_probe.py [--steps 400] [--layers 4] [--seed 0]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main() -> None:
    from service.fleet.pretrain import PretrainSpec, pretrain
    from service.fleet.tiny_model import TinyModelSpec, init_tiny

    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    shipped = TinyModelSpec(layers=a.layers, seed=a.seed, tie_embeddings=True, qk_norm_init=0.3)
    phase = PretrainSpec(copy_steps=a.steps, mixed_steps=0, seed=a.seed)
    variants = {
        "shipped: tied, q/k norms at 0.3 and 10x lr": (shipped, phase),
        "q/k norms at 1.0 (Qwen3's init)": (replace(shipped, qk_norm_init=1.0), phase),
        "q/k norms at the model's lr": (shipped, replace(phase, norm_lr_mult=1.0)),
        "untied embeddings": (replace(shipped, tie_embeddings=False), phase),
    }
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, (name, (spec, pre)) in enumerate(variants.items()):
            base = init_tiny(Path(tmp) / f"init{i}", spec)
            figures = pretrain(base, Path(tmp) / f"pre{i}", pre, log=lambda m, name=name: print(f"{name}: {m}", flush=True))
            formed = next((h["step"] for h in figures["history"] if h["copy_accuracy"] >= 0.5), None)
            rows.append((name, formed, figures["copy_accuracy"], figures["copy_accuracy_1024"], figures["wall_s"]))
    print(f"\n{a.steps} steps of 32 x 128 random-token repeats, lr {phase.lr}, {a.layers} layers, seed {a.seed}\n")
    print("| variant | first step with copy accuracy >= 0.5 | accuracy at 256 tokens | at 1024 | wall |")
    print("|---|---|---|---|---|")
    for name, formed, acc, acc_long, wall in rows:
        print(f"| {name} | {'never' if formed is None else formed} | {acc:.3f} | {acc_long:.3f} | {wall:.0f} s |")


if __name__ == "__main__":
    main()
