"""Tiny Qwen3 / Qwen3-MoE models made here: random weights, a byte-level BPE trained on text
that ships with this repository, and a Hermes-style tool-calling chat template.

Deterministic for a seed; a few MB; loads in transformers, vLLM and the trainer.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

CORPUS = Path(__file__).resolve().parent / "assets" / "tokenizer_corpus.txt"
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Added tokens that appear in decoded text (the tool-call parser needs to see them).
MARKUP = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"]

# Renders each message on its own, so a conversation's rendering is a prefix of any
# continuation's: the agent loop appends tokens instead of re-rendering history.
CHAT_TEMPLATE = r"""{%- if tools %}<|im_start|>system
{%- if messages[0].role == 'system' %}
{{ messages[0].content }}
{%- endif %}

# Tools

You may call one or more functions. Function signatures are within <tools></tools>:
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>

For each call, return a JSON object with the function name and arguments within <tool_call></tool_call> tags:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'system' %}
{%- elif message.role == 'user' %}<|im_start|>user
{{ message.content }}<|im_end|>
{% elif message.role == 'assistant' %}<|im_start|>assistant
{{ message.content or '' }}
{%- for call in message.tool_calls or [] %}
{%- set fn = call.function if call.function is defined else call %}
<tool_call>
{"name": {{ fn.name | tojson }}, "arguments": {{ (fn.arguments if fn.arguments is string else fn.arguments | tojson) }}}
</tool_call>
{%- endfor %}<|im_end|>
{% elif message.role == 'tool' %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


@dataclass(frozen=True)
class TinyModelSpec:
    moe: bool = False
    seed: int = 0
    vocab_size: int = 2048
    hidden_size: int = 128
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 32
    intermediate_size: int = 384
    experts: int = 8
    experts_per_token: int = 2
    moe_intermediate_size: int = 64
    max_position_embeddings: int = 131072
    tie_embeddings: bool = False
    """The vocabulary projection is the embedding (as Qwen3-0.6B): a head that attends to a token
    writes that token's own logit, so a copying circuit needs no learned token-to-token map."""
    qk_norm_init: float = 1.0
    """Initial weight of the query and key RMSNorms. Below 1, attention starts near uniform: a
    copying circuit then forms in a few hundred steps (at 1, none formed in thousands)."""


def train_tokenizer(spec: TinyModelSpec):
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab_size, min_frequency=2, special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )  # fmt: skip
    tok.train([str(CORPUS)], trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in MARKUP])
    return tok


def _config(spec: TinyModelSpec, tok):
    from transformers import Qwen3Config, Qwen3MoeConfig

    common = dict(
        vocab_size=-(-tok.get_vocab_size() // 64) * 64, hidden_size=spec.hidden_size,
        num_hidden_layers=spec.layers, num_attention_heads=spec.heads,
        num_key_value_heads=spec.kv_heads, head_dim=spec.head_dim,
        max_position_embeddings=spec.max_position_embeddings, tie_word_embeddings=spec.tie_embeddings,
        bos_token_id=tok.token_to_id("<|endoftext|>"), eos_token_id=tok.token_to_id("<|im_end|>"),
        pad_token_id=tok.token_to_id("<|endoftext|>"), rms_norm_eps=1e-6,
    )  # fmt: skip
    if spec.moe:
        return Qwen3MoeConfig(**common, intermediate_size=spec.intermediate_size,
                              num_local_experts=spec.experts, num_experts_per_tok=spec.experts_per_token,
                              moe_intermediate_size=spec.moe_intermediate_size, norm_topk_prob=True,
                              decoder_sparse_step=1, mlp_only_layers=[])  # fmt: skip
    return Qwen3Config(**common, intermediate_size=spec.intermediate_size)


def _portable_config(path: Path, spec: TinyModelSpec) -> None:
    """Write the keys older readers (vLLM's transformers, torchtitan) look for as well."""
    cfg = json.loads(path.read_text())
    cfg["head_dim"] = spec.head_dim
    cfg.setdefault("rope_theta", cfg.get("rope_parameters", {}).get("rope_theta", 10000.0))
    cfg["torch_dtype"] = "float32"
    if spec.moe:
        cfg["num_experts"] = spec.experts
    path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def init_tiny(out: Path, spec: TinyModelSpec = TinyModelSpec()) -> Path:
    """Create the model folder (config, safetensors weights, tokenizer, chat template)."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig, PreTrainedTokenizerFast

    out.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer(spec)
    config = _config(spec, tok)
    torch.manual_seed(spec.seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if spec.qk_norm_init != 1.0:
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.q_norm.weight.fill_(spec.qk_norm_init)
                layer.self_attn.k_norm.weight.fill_(spec.qk_norm_init)
    model.save_pretrained(out, safe_serialization=True)
    _portable_config(out / "config.json", spec)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|im_end|>",
        pad_token="<|endoftext|>", unk_token=None, model_max_length=spec.max_position_embeddings,
    )  # fmt: skip
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    GenerationConfig(eos_token_id=config.eos_token_id, bos_token_id=config.bos_token_id,
                     pad_token_id=config.pad_token_id).save_pretrained(out)
    (out / "swerve_model.json").write_text(json.dumps({"kind": "tiny", **spec.__dict__}) + "\n")
    # readable by every user that loads it (transformers writes the weights 0600): a cluster's
    # trainer and servers run as users other than the one that made the model
    for f in out.iterdir():
        f.chmod(f.stat().st_mode | 0o444)
    return out


def perturb(src: Path, dst: Path, scale: float = 0.05, seed: int = 1) -> Path:
    """Copy a model folder with every weight moved by scale * N(0, 1): "the next policy"."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst, dirs_exist_ok=True)
    weights = load_file(src / "model.safetensors")
    gen = torch.Generator().manual_seed(seed)
    moved = {k: (v + scale * torch.randn(v.shape, generator=gen, dtype=v.dtype)).contiguous()
             for k, v in weights.items()}
    save_file(moved, dst / "model.safetensors", metadata={"format": "pt"})
    return dst
