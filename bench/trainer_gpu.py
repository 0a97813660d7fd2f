"""The trainer on a GPU: what can only be checked or measured there, in one run.

    python bench/trainer_gpu.py --models DIR --out FILE [--device cuda] [--small]

DIR holds the tiny models `swerve model init-tiny` makes (DIR/dense, DIR/moe). Sections (each
one reports its own failure and the rest go on):
  env          torch, GPU
  tiny_*       the tiny models on the GPU: flex attention over a packed row vs each document
               alone (SDPA), GPU vs CPU logits, the golden step (tests/test_trainer.py) on the
               GPU, the chunked vocabulary projection vs whole-row logits (values and
               gradients), router replay of the model's own choices
  slice_*      real-width slices of the configs' models (trainer/configs: Qwen3-32B,
               Qwen3-235B-A22B; a few layers each, random weights, bf16, flex attention over
               packed documents, full activation checkpointing, chunked vocabulary
               projection): forward + backward of our loss on 32k- and 131k-token rows,
               tokens/s and peak memory; float8 linears (torchao) against bf16 when torchao
               imports.
--small runs every section at toy sizes (CPU smoke test of this script).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch
import torch.distributed.fsdp as _fsdp

if not hasattr(_fsdp, "DataParallelMeshDims"):  # torch < 2.12: torchtitan 0.3.0 imports it for typing only
    from typing import NamedTuple

    class DataParallelMeshDims(NamedTuple):
        shard: object = None
        replicate: object = None

    _fsdp.DataParallelMeshDims = DataParallelMeshDims

RESULTS: dict = {}


def _torch_compat() -> list[str]:
    """torchtitan 0.3.0 targets torch 2.13; the GPU machine has 2.11, whose create_block_mask
    has no `separate_full_blocks` (an optimisation switch): drop it there. Returns what it did."""
    import inspect

    from torch.nn.attention.flex_attention import create_block_mask

    if "separate_full_blocks" in inspect.signature(create_block_mask).parameters:
        return []
    from torchtitan.models.common import attention, decoder

    if os.environ.get("SWERVE_FLEX_AUTOTUNE", "0") != "1":  # minutes of autotuning per shape otherwise
        attention.FlexAttention._compiled_flex_attn = torch.compile(attention.flex_attention)
        attention.FlexAttention.inductor_configs = {"triton.cudagraphs": False}
    compiled = attention._compiled_create_block_mask

    def create_attention_mask(*args, **kwargs):
        kwargs.pop("separate_full_blocks", None)
        return compiled(*args, **kwargs)

    attention.create_attention_mask = decoder.create_attention_mask = create_attention_mask
    return ["create_block_mask without separate_full_blocks"]

QWEN3_32B = dict(model_type="qwen3", hidden_size=5120, intermediate_size=25600, num_attention_heads=64,
                 num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=131072,
                 rms_norm_eps=1e-6, rope_theta=1_000_000.0, tie_word_embeddings=False)
QWEN3_235B = dict(model_type="qwen3_moe", hidden_size=4096, moe_intermediate_size=1536, num_experts=128,
                  num_experts_per_tok=8, norm_topk_prob=True, num_attention_heads=64, num_key_value_heads=4,
                  head_dim=128, vocab_size=151936, max_position_embeddings=131072, rms_norm_eps=1e-6,
                  rope_theta=1_000_000.0, tie_word_embeddings=False)


def section(name):
    def wrap(fn):
        def run(*args, **kwargs):
            started = time.perf_counter()
            try:
                RESULTS[name] = fn(*args, **kwargs)
            except Exception as e:  # a report, not a crash: the other sections still run
                RESULTS[name] = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-3000:]}
            RESULTS[name]["section_s"] = round(time.perf_counter() - started, 2) if isinstance(RESULTS[name], dict) else None
            print(f"== {name}: {json.dumps(RESULTS[name], default=str)[:1500]}", flush=True)
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        return run
    return wrap


def packed_row(vocab: int, lengths: list[int], seq_len: int, device, seed: int = 0) -> dict:
    """A packed row as trainer.data builds it: documents back to back, positions restarting
    at 0 for each, padding (seq_id -1) after; the later half of each document sampled."""
    g = torch.Generator().manual_seed(seed)
    inputs, positions, seq_ids, mask = [], [], [], []
    for i, n in enumerate(lengths):
        inputs.append(torch.randint(0, vocab, (n,), generator=g))
        positions.append(torch.arange(n))
        seq_ids.append(torch.full((n,), i))
        mask.append(torch.arange(n) >= n // 2)
    pad = seq_len - sum(lengths)
    inputs.append(torch.zeros(pad, dtype=torch.long))
    positions.append(torch.arange(pad))
    seq_ids.append(torch.full((pad,), -1))
    mask.append(torch.zeros(pad, dtype=torch.bool))
    row = {"inputs": torch.cat(inputs), "positions": torch.cat(positions), "seq_ids": torch.cat(seq_ids),
           "loss_mask": torch.cat(mask)}
    row["targets"] = torch.roll(row["inputs"], -1)
    # sampler logprobs near a random-weight model's (about uniform), so ratios stay in the trust region
    inf = -torch.log(torch.tensor(float(vocab))) + 0.1 * torch.randn(seq_len, generator=g)
    row["inf_logprobs"] = torch.where(row["loss_mask"], inf, 0.0)
    row["advantages"] = torch.where(row["seq_ids"] % 2 == 0, 1.0, -0.5) * row["loss_mask"]
    return {k: v.to(device) for k, v in row.items()}


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


@section("env")
def env(device) -> dict:
    out = {"torch": torch.__version__, "python": sys.version.split()[0], "device": str(device)}
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        out |= {"gpu": p.name, "gpu_memory_gb": round(p.total_memory / 2**30, 1), "capability": list(torch.cuda.get_device_capability())}
    import torchtitan

    out["torchtitan"] = getattr(torchtitan, "__version__", "?")
    out["compat_shims"] = _torch_compat()
    try:
        import torchao

        out["torchao"] = torchao.__version__
    except Exception as e:  # noqa: BLE001
        out["torchao"] = f"absent ({type(e).__name__})"
    return out


@section("tiny_attention")
def tiny_attention(models: Path, device) -> dict:
    """Flex over a packed row == SDPA per document, on the GPU; and the GPU's SDPA == the CPU's."""
    from trainer.model import build_model, forward_logits

    out = {}
    for kind in ("dense", "moe"):
        torch.manual_seed(0)
        sdpa, cfg, _ = build_model(models / kind, "sdpa", torch.float32, device)
        flex, _, _ = build_model(models / kind, "flex", torch.float32, device)
        cpu, _, _ = build_model(models / kind, "sdpa", torch.float32, "cpu")
        row = packed_row(cfg.vocab_size, [100, 61, 37], 256, device)
        with torch.no_grad():
            a = forward_logits(sdpa, row["inputs"], row["positions"], row["seq_ids"])
            b = forward_logits(flex, row["inputs"], row["positions"], row["seq_ids"])
            c = forward_logits(cpu, row["inputs"].cpu(), row["positions"].cpu(), row["seq_ids"].cpu())
        real = row["seq_ids"] >= 0
        out[kind] = {"flex_vs_sdpa_max_abs": float((a - b)[real].abs().max()),
                     "gpu_vs_cpu_max_abs": float((a.cpu() - c)[real.cpu()].abs().max()),
                     "logit_scale": float(a[real].abs().max())}
    return out


@section("tiny_golden")
def tiny_golden(models: Path, device) -> dict:
    """The golden step (recorded on CPU: loss 1.5285574197769165, grad norm 3.958608865737915)
    on the GPU with SDPA and with flex attention."""
    from tests.golden import GOLDEN, GOLDEN_CONFIG, golden_group
    from trainer.config import TrainerConfig
    from trainer.train import Trainer

    out = {"cpu_loss": GOLDEN["loss"], "cpu_grad_norm": GOLDEN["grad_norm"]}
    for backend in ("sdpa", "flex") if device.type == "cuda" else ("sdpa",):  # flex has no CPU backward
        cfg = TrainerConfig(model=models / "dense", out_dir=Path("/nonexistent"), device=device.type,
                            attn_backend=backend, **GOLDEN_CONFIG)
        trainer = Trainer(cfg)
        m = trainer.train_batch(trainer.prepare([golden_group()]))
        out[backend] = {"loss": m["loss"], "grad_norm": m["grad_norm"], "sampled_tokens": m["sampled_tokens"]}
    return out


@section("tiny_chunked_logprobs")
def tiny_chunked(models: Path, device) -> dict:
    """The chunked vocabulary projection (checkpointed) against whole-row logits: values and
    every parameter's gradient."""
    from trainer.model import build_model, forward_logprobs

    torch.manual_seed(0)
    model, cfg, _ = build_model(models / "dense", "flex" if device.type == "cuda" else "sdpa", torch.float32, device)
    row = packed_row(cfg.vocab_size, [300, 150, 50], 512, device)
    grads, logps = [], []
    for chunk in (0, 96):
        model.zero_grad(set_to_none=True)
        logp, _ = forward_logprobs(model, row["inputs"], row["positions"], row["seq_ids"], row["targets"], chunk=chunk)
        (logp * row["loss_mask"]).sum().backward()
        logps.append(logp.detach())
        grads.append({n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None})
    worst = max(float((grads[0][n] - grads[1][n]).abs().max() / (grads[0][n].abs().max() + 1e-30)) for n in grads[0])
    return {"logp_max_abs": float((logps[0] - logps[1]).abs().max()), "grad_max_rel": worst}


@section("tiny_router_replay")
def tiny_replay(models: Path, device) -> dict:
    from trainer.model import build_model, forward_logits
    from trainer.replay import enable, recording

    out = {}
    for backend in ("sdpa", "flex") if device.type == "cuda" else ("sdpa",):
        torch.manual_seed(0)
        model, cfg, _ = build_model(models / "moe", backend, torch.float32, device)
        enable(model)
        row = packed_row(cfg.vocab_size, [80], 80, device)
        with torch.no_grad(), recording(model) as rec:
            own = forward_logits(model, row["inputs"], row["positions"], row["seq_ids"])
        with torch.no_grad():
            replayed = forward_logits(model, row["inputs"], row["positions"], row["seq_ids"], rec[0])
        out[backend] = {"equal": bool(torch.equal(own, replayed)), "max_abs": float((own - replayed).abs().max())}
    return out


def slice_model(hf: dict, n_layers: int, device, small: bool, tmp: Path, float8: bool = False, ac: str = "full"):
    """A real-width model with n_layers, random weights, bf16, flex attention, activation
    checkpointing: the trainer's model as a config would build it, minus depth."""
    from trainer.model import apply_activation_checkpointing, apply_float8, empty_model, titan_config

    hf = dict(hf, num_hidden_layers=n_layers)
    if small:  # toy widths for the CPU smoke run
        hf |= {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
               "vocab_size": 512, "intermediate_size": 128, "moe_intermediate_size": 32,
               "num_experts": min(hf.get("num_experts", 8), 8), "num_experts_per_tok": 2}
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "config.json").write_text(json.dumps(hf))
    backend = "flex" if device.type == "cuda" else "sdpa"
    config = titan_config(tmp, backend)
    model = empty_model(config, device).to(torch.bfloat16 if device.type == "cuda" else torch.float32)
    converted = apply_float8(model) if float8 else 0
    apply_activation_checkpointing(model, ac)
    model.train()
    params = sum(p.numel() for p in model.parameters())
    return model, config, params, converted


def time_step(model, row, chunk: int, repeats: int) -> dict:
    from trainer.loss import LossConfig, policy_loss
    from trainer.model import forward_logprobs

    cfg = LossConfig(kl_coef=0.001)
    n = int(row["loss_mask"].sum())
    times = []
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    for i in range(repeats + 1):
        sync()
        t0 = time.perf_counter()
        logp, _ = forward_logprobs(model, row["inputs"], row["positions"], row["seq_ids"], row["targets"], chunk=chunk)
        out = policy_loss(logp, row["inf_logprobs"], row["advantages"], row["loss_mask"], cfg, row["seq_ids"],
                          total_tokens=n)
        out.loss.backward()
        model.zero_grad(set_to_none=True)
        sync()
        if i:  # the first pass compiles flex attention's kernels
            times.append(time.perf_counter() - t0)
    step = sorted(times)[len(times) // 2]
    res = {"tokens": len(row["inputs"]), "step_s": round(step, 4), "tokens_per_s": round(len(row["inputs"]) / step),
           "loss": float(out.loss)}
    if torch.cuda.is_available():
        res["peak_gb"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    return res


def doc_lengths(total: int, seed: int, small: bool) -> list[int]:
    """Episode-like documents filling most of a row: 2k..24k tokens (toy: 20..120)."""
    g = torch.Generator().manual_seed(seed)
    lo, hi = (20, 120) if small else (2048, 24576)
    out, used = [], 0
    while True:
        n = int(torch.randint(lo, hi, (1,), generator=g))
        if used + n > total - 16:
            out.append(total - 16 - used)
            return [n for n in out if n > 1]
        out.append(n)
        used += n


def run_slice(name: str, hf: dict, n_layers: int, lengths: list[int], device, small: bool, tmp: Path,
              float8: bool = False) -> dict:  # fmt: skip
    model, config, params, converted = slice_model(hf, n_layers, device, small, tmp / name, float8=float8)
    out = {"layers": n_layers, "params": params, "float8_linears": converted}
    for total in lengths:
        row = packed_row(config.vocab_size, doc_lengths(total, total, small), total, device)
        out[f"row_{total}"] = time_step(model, row, chunk=64 if small else 8192, repeats=1 if small else 2)
        out[f"row_{total}"]["documents"] = int(row["seq_ids"].max()) + 1
    del model
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--small", action="store_true")
    parser.add_argument("--only", default="", help="comma-separated section prefixes (default: all)")
    parser.add_argument("--tmp", type=Path, default=Path("/tmp/swerve-gpu-bench"))
    args = parser.parse_args()
    device = torch.device(args.device)
    started = time.perf_counter()
    only = [p for p in args.only.split(",") if p]

    def wanted(name: str) -> bool:
        return not only or any(name.startswith(p) for p in only)

    env(device)
    for name, fn in (("tiny_attention", tiny_attention), ("tiny_golden", tiny_golden),
                     ("tiny_chunked", tiny_chunked), ("tiny_router_replay", tiny_replay)):
        if wanted(name):
            fn(args.models, device)
    lengths = [512, 2048] if args.small else [32768, 131072]
    if wanted("slice_qwen3_32b"):
        section("slice_qwen3_32b_4layers_bf16")(run_slice)("qwen3_32b", QWEN3_32B, 4, lengths, device, args.small,
                                                          args.tmp)
    if wanted("slice_qwen3_235b"):
        section("slice_qwen3_235b_a22b_2layers_bf16")(run_slice)("qwen3_235b", QWEN3_235B, 2, lengths[:1], device,
                                                                args.small, args.tmp)
    if device.type == "cuda" and wanted("slice_float8"):
        section("slice_qwen3_32b_4layers_float8")(run_slice)("qwen3_32b_fp8", QWEN3_32B, 4, lengths[:1], device,
                                                            args.small, args.tmp, float8=True)
    RESULTS["total_s"] = round(time.perf_counter() - started, 1)
    args.out.write_text(json.dumps(RESULTS, indent=2, default=str))
    print(f"== done in {RESULTS['total_s']} s", flush=True)


if __name__ == "__main__":
    main()
