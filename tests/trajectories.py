"""Checks that a recorded trajectory is the context the model saw, token for token."""

from __future__ import annotations

import math
from functools import lru_cache
from pathlib import Path

import numpy as np


@lru_cache(maxsize=4)
def _model(model_dir: str):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return (AutoTokenizer.from_pretrained(model_dir),
            AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval())


def check_trajectory(episode: dict, problem_statement: str, model_dir: Path) -> None:
    """`episode`: GET /api/v1/episodes/{id}?arrays=json. Re-renders every turn's input from the
    stored messages with the chat template (turn 0: the whole prompt; then the template's
    continuation after each tool observation), and recomputes every sampled token's logprob
    with transformers over the concatenated turns: equal to what vLLM reported."""
    import torch

    from envs.swe_env import SYSTEM_PROMPT
    from envs.tools import TOOLS
    from service.worker.agent import TokenRenderer

    tok, model = _model(str(model_dir))
    renderer = TokenRenderer(tok, TOOLS)
    turns = episode["turns"]
    assert turns and [t["idx"] for t in turns] == list(range(len(turns)))
    first = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": problem_statement}]
    assert turns[0]["input_ids"] == renderer.initial(first)
    for prev, turn in zip(turns, turns[1:]):
        ended = bool(prev["output_ids"]) and prev["output_ids"][-1] == renderer.eos_id
        assert turn["input_ids"] == renderer.continuation([{"role": "tool", "content": prev["observation"]}], ended)
    sequence, sampled, recorded = [], [], []
    for t in turns:
        assert len(t["output_ids"]) == len(t["output_logprobs"]) == t["n_output_tokens"] > 0
        assert all(math.isfinite(x) and x <= 0 for x in t["output_logprobs"])
        sequence += t["input_ids"]
        sampled += range(len(sequence), len(sequence) + len(t["output_ids"]))
        sequence += t["output_ids"]
        recorded += t["output_logprobs"]
    assert episode["input_tokens"] + episode["output_tokens"] == len(sequence)
    with torch.no_grad():
        logits = model(torch.tensor([sequence])).logits[0].float()
    logprobs = torch.log_softmax(logits, -1)
    positions = torch.tensor(sampled)
    ours = logprobs[positions - 1].gather(-1, torch.tensor(sequence)[positions][:, None])[:, 0].numpy()
    assert np.max(np.abs(ours - np.array(recorded))) < 2e-3, np.max(np.abs(ours - np.array(recorded)))
