"""Scripted samplers for harness and pipeline checks: `oracle` (applies the gold patch through
the editor and bash tools, then submits), `demo` (the fix as a model would make it: view the
file, str_replace the lines the gold patch changes, submit; demonstrations for SFT) and
`replay` (replays recorded tool calls). They go
through the same loop and token path as a model, with the model's tokenizer, and are never
trainable: their "samples" are the tokenizer's own encoding with logprob 0.
"""

from __future__ import annotations

import asyncio
import json
import weakref
from functools import lru_cache

from envs.task import Task
from service.fleet.client import Generation, SamplingParams, text_encoder

GOLD_PATH = "/tmp/.swerve_gold.patch"

_ENCODERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _scripted_ids(tokenizer):
    """The ids of a scripted text in this tokenizer, as a tuple, encoded once per process and
    tokenizer (up to 4096 texts): a model hands back ids and encodes nothing, and a process's
    episodes replay the same calls (per sampler, the encodes and text_encoder's probe were 2% of
    the worker's py-spy samples at 11-turn episodes, bench/rollouts.py, 2026-12-07)."""
    try:
        return _ENCODERS[tokenizer]
    except KeyError:
        encode = text_encoder(tokenizer)
        ids = _ENCODERS[tokenizer] = lru_cache(maxsize=4096)(lambda text: tuple(encode(text)))
        return ids
    except TypeError:  # a tokenizer no weak reference can hold: encoded per sampler
        encode = text_encoder(tokenizer)
        return lambda text: tuple(encode(text))


def tool_call_text(name: str, arguments: dict) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


class ScriptedSampler:
    """Answers each call with the next scripted action, then keeps submitting."""

    def __init__(self, tokenizer, actions: list[str], name: str = "replay", latency_s: float = 0.0):
        self.tok, self.actions, self.name, self.latency_s = tokenizer, list(actions), name, latency_s
        self.eos_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
        self.ids = _scripted_ids(tokenizer)
        self.calls = 0

    async def generate(self, token_ids: list[int], sampling: SamplingParams, *,
                       session: str | None = None, keep_experts_from: int = 0) -> Generation:  # fmt: skip
        if self.latency_s:
            await asyncio.sleep(self.latency_s)
        text = self.actions[self.calls] if self.calls < len(self.actions) else tool_call_text("submit", {})
        self.calls += 1
        ids = [*self.ids(text), self.eos_id]  # a list of its own: the loop keeps what it is given
        return Generation(output_ids=ids, output_logprobs=[0.0] * len(ids), finish_reason="stop",
                          policy_version=-1, policy_version_end=-1, server=self.name,
                          prompt_tokens=len(token_ids))


def oracle_actions(task: Task) -> list[str]:
    if not task.patch:
        raise ValueError(f"{task.instance_id} has no gold patch; the oracle sampler needs one")
    return [
        tool_call_text("str_replace_editor", {"command": "create", "path": GOLD_PATH, "file_text": task.patch}),
        tool_call_text("bash", {"command": f"git apply --whitespace=nowarn {GOLD_PATH} && rm {GOLD_PATH} && git status --short"}),
        tool_call_text("submit", {}),
    ]


def oracle(tokenizer, task: Task) -> ScriptedSampler:
    return ScriptedSampler(tokenizer, oracle_actions(task), name="oracle")


def demonstration(tokenizer, task: Task) -> ScriptedSampler:
    """The `demo` sampler of one task (envs.families.demo_calls: its gold patch as an edit)."""
    from envs.families import demo_calls

    calls = demo_calls({"instance_id": task.instance_id, "patch": task.patch or "",
                        "problem_statement": task.problem_statement})
    return ScriptedSampler(tokenizer, _actions(calls), name="demo")


def replay(tokenizer, calls: list[dict], latency_s: float = 0.0) -> ScriptedSampler:
    """calls: [{"name": ..., "arguments": {...}}, ...] as recorded on turns."""
    return ScriptedSampler(tokenizer, _actions(calls), latency_s=latency_s)


def _actions(calls: list[dict]) -> list[str]:
    return [tool_call_text(c["name"], c.get("arguments", {})) for c in calls]
