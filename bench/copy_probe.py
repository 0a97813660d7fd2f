"""Can the demo's small Qwen3 learn to copy? Issue 17's held-out tasks need the policy to copy
names it never saw in training (the path in the issue, the buggy line in the viewed file); SFT
on a few hundred demonstrations taught the call format but no copying. This probe pretrains the
model made here (TinyModelSpec, as `swerve demo learn` makes it) as a language model on a mix of
the repository's text and synthetic copy sequences (a random span, random tokens, the span
again: an induction-head task), and reports every `--every` steps the accuracy of predicting a
repeated 8-token span at a position the training never fixes. A model that can copy scores near
1; one that cannot, near 0.

    .venv/bin/python bench/copy_probe.py [--steps 3000] [--seq-len 256] [--batch 16] [--lr 1e-3] [--layers 4]
"""

from __future__ import annotations

import argparse
import math
import random
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main() -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from service.fleet.tiny_model import CORPUS, TinyModelSpec, init_tiny

    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--corpus-frac", type=float, default=0.1)
    p.add_argument("--every", type=int, default=200)
    a = p.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    with tempfile.TemporaryDirectory() as tmp:
        folder = init_tiny(Path(tmp) / "m", TinyModelSpec(layers=a.layers))
        tok = AutoTokenizer.from_pretrained(folder)
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    corpus = tok(CORPUS.read_text())["input_ids"]
    vocab = list(range(3, len(tok)))
    rng, L = random.Random(0), a.seq_len

    def copy_row() -> tuple[list[int], list[int]]:
        span = rng.randint(6, min(40, L // 2 - 2))
        pre = [rng.choice(vocab) for _ in range(rng.randint(0, L - 2 * span))]
        body = [rng.choice(vocab) for _ in range(span)]
        gap = [rng.choice(vocab) for _ in range(L - 2 * span - len(pre))]
        return pre + body + gap + body, [0] * (len(pre) + span + len(gap) + 1) + [1] * (span - 1)

    def corpus_row() -> tuple[list[int], list[int]]:
        s = rng.randrange(0, len(corpus) - L)
        return corpus[s:s + L], [1] * L

    @torch.no_grad()
    def copy_accuracy() -> float:
        g = random.Random(123)
        rows = []
        for _ in range(32):
            r, span = [g.choice(vocab) for _ in range(L)], [g.choice(vocab) for _ in range(8)]
            r[20:28], r[L - 20:L - 12] = span, span
            rows.append(r)
        x = torch.tensor(rows)
        pred = model(input_ids=x).logits.argmax(-1)
        return (pred[:, L - 20:L - 13] == x[:, L - 19:L - 12]).float().mean().item()

    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=0.0, betas=(0.9, 0.95))
    started = time.perf_counter()
    print(f"params {sum(q.numel() for q in model.parameters())}, corpus {len(corpus)} tokens")
    for step in range(a.steps + 1):
        if step % a.every == 0:
            print(f"step {step}: copy accuracy {copy_accuracy():.3f} ({time.perf_counter() - started:.0f} s)", flush=True)
        if step == a.steps:
            break
        batch = [corpus_row() if rng.random() < a.corpus_frac else copy_row() for _ in range(a.batch)]
        ids, mask = torch.tensor([b[0] for b in batch]), torch.tensor([b[1] for b in batch], dtype=torch.float32)
        lr = a.lr * min(1.0, (step + 1) / 50) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / a.steps)))
        for group in opt.param_groups:
            group["lr"] = lr
        logits = model(input_ids=ids).logits[:, :-1]
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1),
                                                 reduction="none").view(ids.shape[0], -1)
        loss = (loss * mask[:, 1:]).sum() / mask[:, 1:].sum()
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()


if __name__ == "__main__":
    main()
