"""The tiny model: deterministic, small, loads in transformers, and its chat template renders
Hermes tool calls and extends (a conversation's rendering prefixes its continuation's)."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys

import pytest
import torch

from service.fleet.tiny_model import TinyModelSpec, init_tiny

pytestmark = pytest.mark.slow

CONVERSATION = [
    {"role": "system", "content": "You fix bugs."},
    {"role": "user", "content": "Fix the off-by-one in lib.py"},
    {"role": "assistant", "content": "Let me look.", "tool_calls": [
        {"type": "function", "function": {"name": "bash", "arguments": {"command": "cat lib.py"}}}]},
    {"role": "tool", "content": "def f(xs):\n    return xs[1:]"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "submit", "arguments": "{}"}}]},
]
TOOLS = [{"type": "function", "function": {"name": "bash", "description": "run a command",
                                           "parameters": {"type": "object", "properties": {"command": {"type": "string"}}}}}]


def digest(folder) -> str:
    return hashlib.sha256((folder / "model.safetensors").read_bytes() + (folder / "tokenizer.json").read_bytes()).hexdigest()


@pytest.mark.parametrize("moe", [False, True])
def test_same_seed_same_model_small_and_loadable(tmp_path, moe):
    a = init_tiny(tmp_path / "a", TinyModelSpec(moe=moe))
    b = init_tiny(tmp_path / "b", TinyModelSpec(moe=moe))
    c = init_tiny(tmp_path / "c", TinyModelSpec(moe=moe, seed=1))
    assert digest(a) == digest(b) != digest(c)
    assert sum(p.stat().st_size for p in a.iterdir()) < 8 * 1024 * 1024
    # every user may read it: a cluster's trainer and servers are not the user that made it
    assert not [p.name for p in a.iterdir() if p.stat().st_mode & 0o444 != 0o444]

    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(a, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(a)
    assert model.config.model_type == ("qwen3_moe" if moe else "qwen3")
    ids = tok("def add(a, b):\n    return a + b")["input_ids"]
    assert tok.decode(ids) == "def add(a, b):\n    return a + b"
    assert model(torch.tensor([ids])).logits.shape == (1, len(ids), model.config.vocab_size)


def test_chat_template_renders_tool_calls_and_extends(tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(init_tiny(tmp_path / "m"))
    full = tok.apply_chat_template(CONVERSATION, tools=TOOLS, tokenize=False)
    assert '<tool_call>\n{"name": "bash", "arguments": {"command": "cat lib.py"}}\n</tool_call>' in full
    assert "<tool_response>\ndef f(xs):" in full and '"name": "submit", "arguments": {}' in full
    for k in range(1, len(CONVERSATION)):
        prefix = tok.apply_chat_template(CONVERSATION[:k], tools=TOOLS, tokenize=False)
        assert full.startswith(prefix)
    ids = tok.apply_chat_template(CONVERSATION, tools=TOOLS, tokenize=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    assert tok.decode(ids) == full
    assert tok.convert_tokens_to_ids("<tool_call>") != tok.unk_token_id


def test_cli_writes_a_model(tmp_path):
    out = subprocess.run([sys.executable, "-m", "service.cli", "model", "init-tiny", str(tmp_path / "m"), "--moe"],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert json.loads((tmp_path / "m" / "config.json").read_text())["num_experts"] == 8
