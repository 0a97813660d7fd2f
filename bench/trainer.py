"""Trainer throughput on CPU, side by side in one run: our training step (sequences from
turns, packing, per-document forward, importance-sampled policy loss, backward) against a
plain torchtitan forward/backward (cross-entropy) of the same tiny Qwen3-MoE on the same
tokens; packing efficiency of realistic episode lengths; peak memory at 8k and 32k tokens.
Each measurement runs in its own process (peak RSS is per process), one thread (PLATFORM.md).

    .venv/bin/python bench/trainer.py [--tokens 8192 32768] [--doc 2048] [--before REV]

--before REV adds our step as the trainer package of commit REV runs it (a git worktree), in
the same run: before and after side by side on the same machine and load.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, os.environ.get("SWERVE_BENCH_CODE", str(ROOT)))  # --before: that commit's trainer


def groups_for(tokens: int, doc: int, seed: int = 0):
    import numpy as np

    from service.store.buffer import EpisodeData, GroupData
    from service.store.records import TurnRecord

    rng = np.random.default_rng(seed)
    n_docs = tokens // doc
    per_turn = doc // 4
    episodes = []
    for i in range(n_docs):
        turns = [TurnRecord(idx=k, segment=0, input_ids=rng.integers(0, 2000, per_turn // 2),
                            output_ids=rng.integers(0, 2000, per_turn - per_turn // 2),
                            output_logprobs=-rng.uniform(0.5, 8, per_turn - per_turn // 2).astype("float32"),
                            policy_version=0) for k in range(4)]
        episodes.append(EpisodeData(uuid.uuid4(), i, "submitted", float(i % 2), 0, turns))
    return [GroupData(uuid.uuid4(), uuid.uuid4(), uuid.uuid4(), episodes[j:j + 2]) for j in range(0, n_docs, 2)]


def measure(mode: str, model_dir: str, tokens: int, doc: int, repeats: int) -> dict:
    import torch

    torch.set_num_threads(1)
    from trainer.model import build_model

    if mode in ("ours", "before"):
        from trainer.config import TrainerConfig
        from trainer.train import Trainer

        trainer = Trainer(TrainerConfig(model=Path(model_dir), out_dir=Path(tempfile.mkdtemp()),
                                        data={"seq_len": 8192}, device="cpu"))
        groups = groups_for(tokens, doc)
        trainer.train_batch(trainer.prepare(groups))  # warm-up

        def step():
            trainer.train_batch(trainer.prepare(groups))
    else:
        model, _, _ = build_model(Path(model_dir))
        batch = torch.randint(0, 2000, (tokens // doc, doc + 1), generator=torch.Generator().manual_seed(0))
        inputs, targets = batch[:, :-1], batch[:, 1:]
        positions = torch.arange(doc).expand(len(batch), doc)

        def step():
            logits = model(inputs, positions)
            loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
            loss.backward()
            model.zero_grad(set_to_none=True)

        step()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        step()
        times.append(time.perf_counter() - started)
    best = min(times)  # the step's own speed: the least disturbed by whatever else runs
    return {"mode": mode, "tokens": tokens, "s_per_step": best, "tokens_per_s": tokens / best,
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def packing(seq_len: int = 8192) -> float:
    import numpy as np

    from service.store.records import TurnRecord
    from trainer.data import episode_sequences, pack, packing_efficiency

    rng = np.random.default_rng(0)  # agent episodes: lognormal lengths, a few hundred to many thousand tokens
    lengths = np.clip(rng.lognormal(7.3, 0.8, 512).astype(int), 200, seq_len)
    seqs = [s for n in lengths for s in episode_sequences(
        [TurnRecord(idx=0, segment=0, input_ids=np.zeros(n // 2, dtype=np.int64),
                    output_ids=np.zeros(n - n // 2, dtype=np.int64),
                    output_logprobs=np.zeros(n - n // 2, dtype=np.float32), policy_version=0)], 1.0)]
    rows, _ = pack(seqs, seq_len)
    return packing_efficiency(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[8192, 32768])
    parser.add_argument("--doc", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=2, help="timed steps per process")
    parser.add_argument("--rounds", type=int, default=3, help="processes per mode, interleaved")
    parser.add_argument("--before", metavar="REV", help="also run our step as commit REV's trainer runs it")
    parser.add_argument("--child", nargs=3, metavar=("MODE", "MODEL", "TOKENS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        mode, model_dir, tokens = args.child
        print(json.dumps(measure(mode, model_dir, int(tokens), args.doc, args.repeats)))
        return
    from service.fleet.tiny_model import TinyModelSpec, init_tiny

    model_dir = init_tiny(Path(tempfile.mkdtemp()) / "moe", TinyModelSpec(moe=True))
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    modes = ("plain", "ours")
    if args.before:
        worktree = Path(tempfile.mkdtemp()) / "before"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(worktree), args.before],
                       check=True, capture_output=True)
        modes += ("before",)
    rows = []
    try:
        for _ in range(args.rounds):  # modes interleaved, so a change of load hits them all
            for tokens in args.tokens:
                for mode in modes:
                    code = {"SWERVE_BENCH_CODE": str(worktree)} if mode == "before" else {}
                    out = subprocess.run([sys.executable, __file__, "--child", mode, str(model_dir), str(tokens),
                                          "--doc", str(args.doc), "--repeats", str(args.repeats)],
                                         env=env | code, capture_output=True, text=True, check=True)
                    rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
                    print(rows[-1], flush=True)
    finally:
        if args.before:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(worktree)], check=False)
    print(f"\ntiny Qwen3-MoE (8 experts, top-2), documents of {args.doc} tokens, 1 thread, "
          f"forward+backward per step (ours: + packing, per-document forward, policy loss); "
          f"the fastest step of {args.rounds} x {args.repeats} per mode")
    before = f" | before ({args.before}) tok/s | before / plain" if args.before else ""
    print(f"| tokens | plain torchtitan tok/s | ours tok/s | ours / plain{before} | plain peak MB | ours peak MB |")
    print("|---" * (6 + 2 * bool(args.before)) + "|")
    for tokens in args.tokens:
        best = {m: max((r for r in rows if r["tokens"] == tokens and r["mode"] == m), key=lambda r: r["tokens_per_s"])
                for m in modes}
        p, o, b = best["plain"], best["ours"], best.get("before")
        was = f" | {b['tokens_per_s']:.0f} | {b['tokens_per_s'] / p['tokens_per_s']:.2f}" if b else ""
        print(f"| {tokens} | {p['tokens_per_s']:.0f} | {o['tokens_per_s']:.0f} | {o['tokens_per_s'] / p['tokens_per_s']:.2f}"
              f"{was} | {p['peak_rss_mb']:.0f} | {o['peak_rss_mb']:.0f} |")
    print(f"\npacking efficiency (512 episodes, lognormal lengths, rows of 8192): {packing():.4f}")


if __name__ == "__main__":
    main()
