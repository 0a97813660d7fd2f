"""Pretraining the tiny model to copy (service.fleet.pretrain): its data copies only what it
showed and carries no task or tool-call markup; a run writes a model folder that Hugging Face
and the trainer load, with its figures; a model with tied embeddings and soft query/key norms
goes through the trainer and its publication as an untied one does."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import pytest
import torch

from service.fleet.pretrain import PretrainSpec, code_doc, copy_row, doc_rows, mutate, pretrain
from service.fleet.tiny_model import TinyModelSpec, init_tiny
from tests.conftest import require_torchtitan

RECORD = re.compile(r"^\{.*\}$", re.M)


def test_a_document_copies_only_what_it_showed_before():
    edits = diffs = 0
    for seed in range(300):
        doc = code_doc(random.Random(seed))
        assert doc == code_doc(random.Random(seed))  # the same seed, the same bytes
        assert "<tool_call>" not in doc and "<|im_" not in doc and "<tool_response>" not in doc
        for m in RECORD.finditer(doc):
            record = json.loads(m.group(0))
            record = record.get("arguments", record)
            path, old, new = record.values()
            before = doc[:m.start()]
            assert path in before and old in before and new != old, (seed, record)
            edits += 1
        for m in re.finditer(r"^--- a/(\S+)\n\+\+\+ b/\1\n@@ [^\n]*\n((?:[ +-][^\n]*\n?)+)", doc, re.M):
            removed = [line[1:] for line in m.group(2).splitlines() if line.startswith("-")]
            assert len(removed) == 1 and removed[0] in doc[:m.start()], seed
            diffs += 1
    assert edits > 100 and diffs > 50  # both kinds are common, not a corner


def test_a_mutation_changes_one_thing_of_a_bug_kind():
    r = random.Random(0)
    assert mutate(r, "    return a <= b") == "    return a < b"
    assert mutate(r, "    return min(x, 3)") in ("    return max(x, 3)", "    return min(x, 4)")
    assert mutate(r, "def f(x):") is None


def test_copy_rows_mask_all_but_the_predictable_repeats():
    r = random.Random(1)
    for _ in range(50):
        row, mask = copy_row(r, list(range(100, 200)), 128)
        assert len(row) == len(mask) == 128
        first = mask.index(1)
        period = next(p for p in range(8, 61) if all(row[i] == row[i - p] for i in range(first, 128)))
        assert first - period >= 0 and all(row[i] == row[i - period] for i in range(first, 128))


def test_document_rows_are_packed_to_length():
    def encode(s: str) -> list[int]:
        return [ord(c) % 50 for c in s]

    rows = doc_rows(random.Random(0), encode, 99, 300)
    got = [next(rows) for _ in range(40)]
    assert all(len(r) == 300 for r in got)
    r, stream = random.Random(0), []
    while len(stream) < 40 * 300:
        stream += encode(code_doc(r)) + [99]
    assert sum(got, []) == stream[:40 * 300]  # documents in order, end-of-text between, nothing lost


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory) -> tuple[Path, Path, dict]:
    root = tmp_path_factory.mktemp("pretrain")
    base = init_tiny(root / "init", TinyModelSpec(tie_embeddings=True, qk_norm_init=0.3))
    spec = PretrainSpec(copy_steps=3, mixed_steps=2, copy_rows=4, doc_rows=1, doc_len=256, mixed_copy_rows=2, warmup=1)
    return base, root / "pre", pretrain(base, root / "pre", spec, log=lambda _: None)


def test_pretraining_writes_a_model_folder_with_its_figures(pretrained):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base, out, figures = pretrained
    assert json.loads((out / "pretrain.json").read_text())["copy_accuracy"] == figures["copy_accuracy"]
    assert [h["step"] for h in figures["history"]] == [0, 4]
    assert figures["tokens"] == 3 * 4 * 128 + 2 * (2 * 256 + 1 * 256)
    assert 0.0 <= figures["copy_accuracy"] <= 1.0
    weights = load_file(str(out / "model.safetensors"))
    assert "lm_head.weight" not in weights  # still tied
    before = load_file(str(base / "model.safetensors"))
    assert any(not torch.equal(weights[k], before[k]) for k in before)  # it trained
    assert (out / "tokenizer.json").read_bytes() == (base / "tokenizer.json").read_bytes()
    assert AutoTokenizer.from_pretrained(out).chat_template
    norms = [v for k, v in weights.items() if k.endswith("q_norm.weight")]
    assert norms and all(abs(v.mean().item() - 0.3) < 0.2 for v in norms)
    AutoModelForCausalLM.from_pretrained(out)


def test_a_tied_model_trains_and_publishes_what_it_computes(pretrained, tmp_path):
    require_torchtitan()
    from transformers import AutoModelForCausalLM

    from tests.golden import GOLDEN_CONFIG, golden_group
    from trainer.config import TrainerConfig
    from trainer.publish import write_weights
    from trainer.train import Trainer

    _, model_dir, _ = pretrained
    trainer = Trainer(TrainerConfig(model=model_dir, out_dir=tmp_path, device="cpu", optim={"lr": 1e-3}, **GOLDEN_CONFIG))
    assert trainer.model.lm_head.weight is trainer.model.tok_embeddings.weight
    ids = torch.randint(0, 2000, (1, 48), generator=torch.Generator().manual_seed(0))
    served = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(trainer.model(ids, torch.arange(48)[None]).float(), served(ids).logits,
                                   atol=1e-5, rtol=0)
    trainer.train_batch(trainer.prepare([golden_group()]))
    trainer.optimizer.step()
    out = write_weights(trainer.model, trainer.adapter, trainer.cfg, tmp_path / "v1", rank=0)
    published = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        mine = trainer.model(ids, torch.arange(48)[None]).float()
        torch.testing.assert_close(published(ids).logits, mine, atol=1e-5, rtol=0)
        assert (mine - served(ids).logits).abs().max() > 1e-3  # the step moved it
