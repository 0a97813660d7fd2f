"""torchtitan models for the policies we serve: built from the inference model's Hugging Face
folder (config.json + safetensors), converted both ways with torchtitan's state-dict adapters,
so the trainer starts from exactly the weights vLLM serves and publishes weights vLLM loads.

Attention: torchtitan's language-model builders offer flex/varlen (packed documents, GPUs).
On CPU, FlexAttention has no backward, so the CPU path uses SDPA (causal) and runs each packed
document as its own sequence (`forward_logits`), which keeps document boundaries exact.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import torch
import torch.nn.functional as F

SUPPORTED = ("qwen3", "qwen3_moe")


class ModelError(ValueError):
    """The Hugging Face model cannot be mapped onto a torchtitan model; says which field."""


def _hf_config(hf_dir: Path) -> dict:
    path = Path(hf_dir) / "config.json"
    if not path.exists():
        raise ModelError(f"{path}: no config.json (give the folder of a Hugging Face model)")
    return json.loads(path.read_text())


def titan_config(hf_dir: Path, attn_backend: str = "sdpa"):
    """A torchtitan Qwen3Model.Config with the same shapes as the Hugging Face model."""
    from torchtitan.models.common import CosSinRoPE, Embedding, Linear
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.qwen3 import (
        Qwen3Model,
        _build_qwen3_layers,
        _build_qwen3_moe_layers,
        _qwen3_norm,
    )

    hf = _hf_config(hf_dir)
    kind = hf.get("model_type")
    if kind not in SUPPORTED:
        raise ModelError(f"config.json model_type: {kind!r} is not one of {SUPPORTED}")
    eps = hf.get("rms_norm_eps", 1e-6)
    if abs(eps - 1e-6) > 1e-12:
        raise ModelError(f"config.json rms_norm_eps: torchtitan's Qwen3 uses 1e-6, the model {eps}")
    rope = hf.get("rope_parameters") or {}
    theta = rope.get("rope_theta", hf.get("rope_theta", 1_000_000.0))
    if rope.get("rope_type", "default") not in ("default", None):
        raise ModelError(f"config.json rope_parameters.rope_type: {rope.get('rope_type')!r} is not supported")
    head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
    common = dict(n_layers=hf["num_hidden_layers"], dim=hf["hidden_size"], n_heads=hf["num_attention_heads"],
                  n_kv_heads=hf.get("num_key_value_heads", hf["num_attention_heads"]), head_dim=head_dim,
                  attn_backend="flex" if attn_backend == "sdpa" else attn_backend,
                  rope=CosSinRoPE.Config(dim=head_dim, max_seq_len=hf.get("max_position_embeddings", 40960),
                                         theta=theta))
    if kind == "qwen3_moe":
        if not hf.get("norm_topk_prob", True):
            raise ModelError("config.json norm_topk_prob: torchtitan's Qwen3-MoE router normalises top-k")
        layers = _build_qwen3_moe_layers(**common, moe_hidden_dim=hf["moe_intermediate_size"],
                                         num_experts=hf["num_experts"], top_k=hf["num_experts_per_tok"],
                                         moe_comm_backend="standard")
    else:
        layers = _build_qwen3_layers(**common, hidden_dim=hf["intermediate_size"])
    if attn_backend == "sdpa":
        for layer in layers:
            layer.attention.inner_attention = ScaledDotProductAttention.Config()
    vocab = hf["vocab_size"]
    return Qwen3Model.Config(
        vocab_size=vocab, dim=hf["hidden_size"], norm=_qwen3_norm(hf["hidden_size"]),
        enable_weight_tying=bool(hf.get("tie_word_embeddings", False)),
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=hf["hidden_size"]),
        lm_head=Linear.Config(in_features=hf["hidden_size"], out_features=vocab), layers=layers)


def load_hf_weights(hf_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(Path(hf_dir).glob("*.safetensors"))
    if not files:
        raise ModelError(f"{hf_dir}: no *.safetensors weights")
    out: dict[str, torch.Tensor] = {}
    for f in files:
        out.update(load_file(str(f)))
    return out


def empty_model(config, device: str | torch.device = "cpu"):
    """The model of a torchtitan config on `device` with torchtitan's initial states (random
    weights, rotary caches): built on the meta device first, so nothing is allocated twice."""
    with torch.device("meta"):
        model = config.build()
    model.to_empty(device=device)
    with torch.no_grad():
        model.init_states(buffer_device=torch.device(device))
    return model


def build_model(hf_dir: Path, attn_backend: str = "sdpa", dtype: torch.dtype = torch.float32,
                device: str | torch.device = "cpu"):  # fmt: skip
    """(model, config, adapter): a torchtitan model holding the Hugging Face weights."""
    from torchtitan.models.qwen3 import Qwen3StateDictAdapter

    config = titan_config(hf_dir, attn_backend)
    model = empty_model(config, device)
    adapter = Qwen3StateDictAdapter(config, str(hf_dir))
    state = adapter.from_hf(load_hf_weights(hf_dir))
    missing, unexpected = model.load_state_dict(state, strict=False)
    # rotary caches and the MoE load-balancing state (expert bias, token counts) start from init_states
    missing = [k for k in missing if not k.endswith(("freqs_cis", "cos", "sin", "cache", "expert_bias_E", "tokens_per_expert"))]
    if missing or unexpected:
        raise ModelError(f"weights do not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}")
    return model.to(dtype), config, adapter


class _Float32ExpertsForward:
    """torchtitan's GroupedExperts.forward with the grouped matmuls in float32, not bfloat16."""

    def forward(self, x_RD: torch.Tensor, num_tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
        from torch.distributed.tensor import DTensor

        w1, w2, w3 = (w.to_local() if isinstance(w, DTensor) else w
                      for w in (self.w1_EFD, self.w2_EDF, self.w3_EFD))
        offsets_E = torch.cumsum(num_tokens_per_expert_E, dim=0, dtype=torch.int32)
        x = x_RD.float()
        h = F.silu(torch._grouped_mm(x, w1.float().transpose(-2, -1), offs=offsets_E))
        h = h * torch._grouped_mm(x, w3.float().transpose(-2, -1), offs=offsets_E)
        return torch._grouped_mm(h, w2.float().transpose(-2, -1), offs=offsets_E).type_as(x_RD)


def set_expert_dtype(model, dtype: str) -> int:
    """Run the routed experts' matmuls in `dtype`: "bfloat16" is torchtitan's (and leaves the
    model alone), "float32" keeps every op of the model in float32, whose results depend on the
    CPU's instruction set only through summation order. Returns how many expert modules changed."""
    from torchtitan.models.common.moe import GroupedExperts

    if dtype == "bfloat16":
        return 0
    if dtype != "float32":
        raise ModelError(f"expert_dtype: {dtype!r} is not one of ('bfloat16', 'float32')")
    changed = 0
    for module in model.modules():
        if type(module) is GroupedExperts:
            module.__class__ = _float32_experts_class()
            changed += 1
    return changed


@functools.cache
def _float32_experts_class() -> type:
    from torchtitan.models.common.moe import GroupedExperts

    return type("Float32GroupedExperts", (_Float32ExpertsForward, GroupedExperts), {})


def apply_activation_checkpointing(model, mode: str) -> None:
    """torchtitan's activation checkpointing on every transformer block: "full" recomputes each
    block in backward, "selective" saves the matmuls' outputs and recomputes the rest (torchtitan's
    default save list); "none" leaves the model alone. Must come before FSDP wrapping."""
    if mode == "none":
        return
    from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC

    ac = FullAC.Config() if mode == "full" else SelectiveAC.Config()
    ac.build().apply(model)


def apply_float8(model) -> int:
    """float8 training (torchao's Float8Linear, dynamic tensorwise scaling) for the attention and
    dense MLP linears of the transformer blocks; the embeddings, the vocabulary projection, the
    router gates and linears whose dimensions are not multiples of 16 stay in high precision.
    Returns the number of linears converted. Needs torchao and a GPU with float8 matmuls."""
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError as e:
        raise ValueError("parallelism.float8: torchao is not installed (pip install torchao); "
                         "or set it false") from e
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
        raise ValueError("parallelism.float8: float8 matmuls need a GPU of compute capability 8.9 or "
                         "later (H100, H200, L40S); set it false here")
    converted: list[str] = []

    def keep(module: torch.nn.Module, fqn: str) -> bool:
        ok = (isinstance(module, torch.nn.Linear) and fqn.startswith("layers.") and ".router" not in fqn
              and module.in_features % 16 == 0 and module.out_features % 16 == 0)
        if ok:
            converted.append(fqn)
        return ok

    convert_to_float8_training(model, config=Float8LinearConfig(), module_filter_fn=keep)
    return len(converted)


def packs_documents(model) -> bool:
    """Whether the model's attention takes packed-document masks (flex / varlen), so a packed
    row runs as one sequence; SDPA models run each document separately."""
    from torchtitan.models.common.attention import FlexAttention, VarlenAttention

    cached = getattr(model, "_swerve_packs_documents", None)
    if cached is None:
        cached = any(isinstance(m, (FlexAttention, VarlenAttention)) for m in model.modules())
        model._swerve_packs_documents = cached
    return cached


def forward_logits(model, inputs: torch.Tensor, positions: torch.Tensor, seq_ids: torch.Tensor,
                   routed_experts=None, *, head: bool = True) -> torch.Tensor:  # fmt: skip
    """Logits [L, vocab] for one packed row, each document attending only to itself: one pass
    with a document mask on flex/varlen models, documents as separate sequences on SDPA ones.
    With routed_experts [L, layers, top_k], MoE layers replay those expert choices
    (trainer/replay.py). head=False: the final hidden states [L, dim] instead of logits."""
    skip = model._skip_lm_head
    model._skip_lm_head = not head
    try:
        return _forward(model, inputs, positions, seq_ids, routed_experts)
    finally:
        model._skip_lm_head = skip


def _forward(model, inputs, positions, seq_ids, routed_experts):
    from trainer.replay import replaying

    if packs_documents(model):  # one pass; the document mask comes from positions restarting at 0
        pos = positions.unsqueeze(0)
        masks = model.get_attention_masks(pos)
        if routed_experts is not None:
            with replaying(model, routed_experts):
                return model(inputs.unsqueeze(0), pos, attention_masks=masks)[0]
        return model(inputs.unsqueeze(0), pos, attention_masks=masks)[0]
    # SDPA: each document on its own up to the final norm, then one vocabulary projection for the
    # row (per-document logits concatenated cost a copy of [L, vocab] each way). Documents of the
    # same length run as one batch (a row of four 2048-token documents: one [4, 2048] forward, as
    # plain torchtitan runs its batch), their routed experts replayed as a batch too.
    head = not model._skip_lm_head
    model._skip_lm_head = True
    try:
        spans = document_spans(positions, seq_ids)
        firsts = seq_ids[[start for start, _ in spans]].tolist()
        out: list[torch.Tensor | None] = [None] * len(spans)
        same_length: dict[int, list[int]] = {}
        for k, ((start, end), first) in enumerate(zip(spans, firsts)):
            if first < 0:  # padding: no loss there, no need to run it
                out[k] = torch.zeros(end - start, model.config.dim, device=inputs.device)
            else:
                same_length.setdefault(end - start, []).append(k)
        for ks in same_length.values():
            rows = [slice(*spans[k]) for k in ks]
            batch = (torch.stack([inputs[r] for r in rows]), torch.stack([positions[r] for r in rows]))
            if routed_experts is None:
                hidden = model(*batch)
            else:
                with replaying(model, torch.stack([torch.as_tensor(routed_experts[r]) for r in rows])):
                    hidden = model(*batch)
            for k, h in zip(ks, hidden.unbind(0)):
                out[k] = h
    finally:
        model._skip_lm_head = not head
    hidden = torch.cat(out) if len(out) > 1 else out[0]
    return model.lm_head(hidden) if head else hidden


def document_spans(positions: torch.Tensor, seq_ids: torch.Tensor) -> list[tuple[int, int]]:
    """[start, end) of each document of a packed row: a document starts where positions restart
    at 0 or the sequence id changes (padding, id -1, is a document of its own)."""
    n = len(positions)
    if n == 0:
        return []
    starts = positions == 0
    starts[0] = True
    starts[1:] |= seq_ids[1:] != seq_ids[:-1]
    bounds = starts.nonzero().flatten().tolist() + [n]
    return list(zip(bounds[:-1], bounds[1:]))


def forward_logprobs(model, inputs: torch.Tensor, positions: torch.Tensor, seq_ids: torch.Tensor,
                     targets: torch.Tensor, routed_experts=None, *, chunk: int = 0,
                     pieces: int | None = None, entropy_at: torch.Tensor | None = None):  # fmt: skip
    """(log p(target) [L] with gradient, entropy [L] without) for one packed row; the entropy only
    where `entropy_at` [L] (bool) is true, 0 elsewhere (None: everywhere).

    chunk > 0: the vocabulary projection and log-softmax run `chunk` positions at a time under
    activation checkpointing, so a 131k-token row never holds [L, vocab] logits (40 GB in bf16
    for a 152k vocabulary): each chunk's logits are made in forward, dropped, and made again in
    backward. chunk = 0: logits for the whole row at once.

    pieces: split the row into exactly this many parts instead (some may be empty), always
    projecting outside the model's forward. Under FSDP each call of the projection is a
    collective in backward, so every rank must make the same number of calls in a micro-batch:
    the trainer gives all ranks the same `pieces` (see Trainer.train_batch)."""
    from torch.utils.checkpoint import checkpoint

    from trainer.loss import token_logprobs

    if pieces is None and (chunk <= 0 or len(inputs) <= chunk):
        return token_logprobs(forward_logits(model, inputs, positions, seq_ids, routed_experts), targets, entropy_at)
    hidden = forward_logits(model, inputs, positions, seq_ids, routed_experts, head=False)
    wanted = torch.ones_like(targets, dtype=torch.bool) if entropy_at is None else entropy_at.bool()

    def piece(h: torch.Tensor, t: torch.Tensor, w: torch.Tensor):
        return token_logprobs(model.lm_head(h), t, w)

    bounds = range(0, len(inputs), chunk) if pieces is None else \
        [len(inputs) * k // pieces for k in range(pieces)]
    ends = [*bounds[1:], len(inputs)]
    logps, entropies = [], []
    for s, e in zip(bounds, ends):
        logp, entropy = checkpoint(piece, hidden[s:e], targets[s:e], wanted[s:e], use_reentrant=False)
        logps.append(logp)
        entropies.append(entropy)
    return torch.cat(logps), torch.cat(entropies)


def projection_pieces(length: int, chunk: int) -> int:
    """How many vocabulary projections forward_logprobs makes for a row of `length` at `chunk`."""
    return 1 if chunk <= 0 else max(1, -(-length // chunk))
