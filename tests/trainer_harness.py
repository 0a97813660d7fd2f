"""The equivalence check of the trainer's sharding (trainer.parallel): one AdamW step on a fixed
batch with our `policy_loss`, writing the loss before and after the step and every parameter's
gradient norm, in one process or over torchrun's (tests/test_trainer_distributed.py):

    torchrun --nproc_per_node 2 -m tests.trainer_harness --model DIR --ep 1|2 --out FILE
    python -m tests.trainer_harness --model DIR --out FILE        # one process: the reference

Each rank takes its share of the batch as data parallelism would; the loss is normalised by the
whole batch's sampled tokens, so the ranks' losses (and gradients) sum to those of one process
on the whole batch, and the numbers must match the single-process run.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

from trainer.loss import LossConfig, policy_loss, token_logprobs
from trainer.parallel import parallelize


def fixed_batch(vocab: int, n_seqs: int = 2, seq_len: int = 64, prompt: int = 8,
                seed: int = 0) -> list[dict]:  # fmt: skip
    """`n_seqs` rows of one sequence each, as trainer.data packs them: random tokens, the first
    `prompt` positions unsampled, sampler logprobs near a uniform model's, one advantage each."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(n_seqs):
        tokens = torch.randint(0, vocab, (seq_len + 1,), generator=g)
        mask = torch.arange(seq_len) >= prompt
        inf = -torch.log(torch.tensor(float(vocab))) + 0.1 * torch.randn(seq_len, generator=g)
        rows.append({"inputs": tokens[:-1], "targets": tokens[1:],
                     "positions": torch.arange(seq_len), "seq_ids": torch.full((seq_len,), i),
                     "loss_mask": mask,
                     "inf_logprobs": torch.where(mask, inf, torch.zeros(seq_len)),
                     "advantages": torch.full((seq_len,), 1.0 if i % 2 == 0 else -0.5)})
    return rows


def _batch_loss(model, rows, cfg: LossConfig, n_tokens: int, backward: bool) -> torch.Tensor:
    """This rank's share of the batch loss (summed over its rows), backpropagated if asked."""
    from trainer.model import forward_logits

    total = torch.zeros(())
    for t in rows:
        logits = forward_logits(model, t["inputs"], t["positions"], t["seq_ids"])
        logp, _ = token_logprobs(logits, t["targets"])
        out = policy_loss(logp, t["inf_logprobs"], t["advantages"], t["loss_mask"], cfg,
                          t["seq_ids"], total_tokens=n_tokens)
        if backward:
            out.loss.backward()
        total += out.loss.detach()
    return total


def _full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor behind a (possibly sharded) DTensor; a collective on every rank."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _layout(model) -> dict[str, str]:
    """How each parameter is laid out: "mesh axes: placements" of its DTensor, "local" if none."""
    from torch.distributed.tensor import DTensor

    return {name: f"{list(p.device_mesh.mesh_dim_names)}: {list(p.placements)}"
            if isinstance(p, DTensor) else "local" for name, p in model.named_parameters()}


def run_step(hf_dir: Path, *, world_size: int = 1, fsdp: int = -1, ep: int = 1, lr: float = 1e-3,
             adam_eps: float = 1e-8, expert_dtype: str = "bfloat16") -> dict:  # fmt: skip
    """One AdamW step on fixed_batch: the global loss before and after, and the gradient norms.
    world_size 1 is the single-process reference; otherwise the process group must be up."""
    from trainer.model import build_model, set_expert_dtype

    torch.manual_seed(0)
    model, config, _ = build_model(hf_dir)
    set_expert_dtype(model, expert_dtype)
    rank = dist.get_rank() if world_size > 1 else 0
    if world_size > 1:
        parallelize(model, config, world_size=world_size, fsdp=fsdp, ep=ep)
    layout = _layout(model)  # before any forward: FSDP keeps the last layers unsharded after one
    rows = fixed_batch(config.vocab_size)
    n_tokens = int(sum(int(r["loss_mask"].sum()) for r in rows))
    mine = rows[rank::world_size]  # with FSDP and EP only, every rank is a data-parallel rank
    cfg = LossConfig(kl_coef=0.01)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, eps=adam_eps)

    def global_sum(x: torch.Tensor) -> float:
        if world_size > 1:
            dist.all_reduce(x, op=dist.ReduceOp.SUM)
        return float(x)

    started = time.perf_counter()
    loss_before = global_sum(_batch_loss(model, mine, cfg, n_tokens, backward=True))
    grads = {name: _full(p.grad) for name, p in model.named_parameters() if p.grad is not None}
    grad_norms = {name: float(g.norm()) for name, g in grads.items()}
    max_abs_grad = {name: float(g.abs().max()) for name, g in grads.items()}
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    with torch.no_grad():
        loss_after = global_sum(_batch_loss(model, mine, cfg, n_tokens, backward=False))
    return {"loss_before": loss_before, "loss_after": loss_after, "grad_norms": grad_norms,
            "max_abs_grad": max_abs_grad,
            "layout": layout, "world_size": world_size, "fsdp": fsdp, "ep": ep,
            "step_s": time.perf_counter() - started}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, required=True, help="the policy's HF folder")
    parser.add_argument("--fsdp", type=int, default=-1, help="FSDP2 degree (-1: the whole world)")
    parser.add_argument("--ep", type=int, default=1, help="expert-parallel degree (MoE models)")
    parser.add_argument("--out", type=Path, required=True, help="JSON file for rank 0's result")
    parser.add_argument("--adam-eps", type=float, default=1e-8, help="AdamW's eps")
    parser.add_argument("--expert-dtype", choices=("bfloat16", "float32"), default="bfloat16")
    args = parser.parse_args(argv)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size > 1:
        dist.init_process_group("gloo")
    try:
        result = run_step(args.model, world_size=world_size, fsdp=args.fsdp, ep=args.ep,
                          adam_eps=args.adam_eps, expert_dtype=args.expert_dtype)
        if world_size == 1 or dist.get_rank() == 0:
            args.out.write_text(json.dumps(result, indent=2))
    finally:
        if world_size > 1:
            # every rank leaves together: tearing gloo down while a peer still has collectives in
            # flight aborted a rank ("terminate called without an active exception") under load
            dist.barrier()
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
