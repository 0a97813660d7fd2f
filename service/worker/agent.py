"""The token-in/token-out agent loop.

The episode's token list only grows: each turn renders just the new messages with the model's
own tokenizer and chat template and appends them; the sampled ids are appended verbatim. So
the concatenated input_ids + output_ids of the turns is exactly what the policy saw and made,
and the trainer never re-tokenizes. A template that cannot extend its previous rendering
(one that rewrites history) starts a new segment, recorded on the episode.
"""

from __future__ import annotations

import time
from array import array
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field

from sandboxes.base import SandboxError
from service.store.buffer import StorageError
from service.store.records import TurnRecord
from service.store.status import EpisodeStatus
from service.fleet.client import Context, ContextExceeded, InferenceClient, ProviderError, SamplingParams, text_decoder, text_encoder

_DUMMY = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]
_TOOL_MARK = "\x00TOOL\x00"
_TOOL_PROBES = ("", "x", "  two spaces around  ", "\n\nlines\n\n", "a\tb\r\nc", "{{ x }} {% if y %}{# z #}",
                "<tool_response>\n</tool_response>", "<think>a</think>b", "<|im_end|>\n<|im_start|>user",
                "<tool_call>{}</tool_call>", "ü € 𝄞 \\ \" '")
"""Observations a template might treat apart (whitespace, its own markup, Jinja syntax): a
tool message's rendering is taken as text around its content only if these go in verbatim."""


class AgentConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    max_turns: int = Field(250, ge=1)
    """Model calls per episode."""
    wall_clock_s: float = Field(4 * 3600.0, gt=0)
    """Episode time budget (s), model and tool time together."""
    max_context_tokens: int | None = Field(None, ge=256)
    """Context budget; None: the server's. A turn that cannot fit ends the episode context_exhausted."""
    sampling: SamplingParams = SamplingParams()


class LimitsExceeded(Exception):
    def __init__(self, status: EpisodeStatus):
        self.status = status
        super().__init__(status)


EPISODE_FAILURES = (SandboxError, ProviderError, StorageError)
"""What ends an episode as a failure of the infrastructure rather than of the agent."""


def failure_status(error: Exception) -> EpisodeStatus:
    """The status of an episode that one of EPISODE_FAILURES ended: the one place they are classified."""
    if isinstance(error, SandboxError):
        return "sandbox_error"
    if isinstance(error, ProviderError):
        return "provider_error"
    if isinstance(error, StorageError):
        return "storage_error"
    raise TypeError(f"{type(error).__name__} is not an episode failure") from error


@dataclass
class EpisodeResult:
    status: EpisodeStatus | Literal["superseded"]
    """Final when the loop returns; "superseded" when a newer attempt took the episode over."""
    n_turns: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    segment_starts: list[int] = field(default_factory=lambda: [0])
    policy_version_min: int | None = None
    policy_version_max: int | None = None
    diff: str | None = None
    error_type: str | None = None
    error_message: str | None = None


class TurnSink(Protocol):
    async def append(self, turn: TurnRecord) -> None:
        """Persist one finished turn (called as each turn completes). Raises StorageError."""
        ...


class MemoryTurnSink:
    def __init__(self) -> None:
        self.turns: list[TurnRecord] = []

    async def append(self, turn: TurnRecord) -> None:
        self.turns.append(turn)


class TokenRenderer:
    """Renders messages to token ids incrementally with a Hugging Face tokenizer's template."""

    PROMPTS = 64
    """First prompts kept encoded (by their text): a group's samples of a task, started together,
    begin from the same prompt, which is encoded once."""

    def __init__(self, tokenizer, tools: list[dict] | None = None):
        self.tok, self.tools = tokenizer, tools
        self.encode = text_encoder(tokenizer)
        self.decode = text_decoder(tokenizer)
        self._prompt = lru_cache(maxsize=self.PROMPTS)(lambda text: array("i", self.encode(text)))
        self.eos_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
        if self.eos_id is None or self.eos_id == tokenizer.unk_token_id:
            self.eos_id = tokenizer.eos_token_id
        self.eos_text = self.decode([self.eos_id])
        marked = self._text([*_DUMMY[:1], {"role": "assistant", "content": "\x00MARK\x00"}])
        self.after_assistant = marked[marked.index("\x00MARK\x00") + len("\x00MARK\x00"):]
        self._dummy_text = self._text(_DUMMY)
        self.extends = self._probe()
        self._tool_frame = self._frame_tool() if self.extends else None

    def _text(self, messages: list[dict], generation: bool = False, tools: list[dict] | None = None) -> str:
        return self.tok.apply_chat_template(messages, tools=tools, tokenize=False,
                                            add_generation_prompt=generation)

    def _probe(self) -> bool:
        """Does rendering more messages only append? (False for templates that rewrite history.)"""
        convo = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"},
                 {"role": "assistant", "content": "<think>r</think>a"}, {"role": "user", "content": "v"}]
        shorter = self._text(convo[:3], tools=self.tools)
        return self._text(convo, tools=self.tools).startswith(shorter)

    def _after_assistant(self, messages: list[dict]) -> str:
        return self._text(_DUMMY + messages, generation=True)[len(self._dummy_text):]

    def _frame_tool(self) -> tuple[str, str] | None:
        """The template's text before and after one tool message's content (after an assistant
        turn, to the next generation prompt) when it renders the content verbatim: an
        observation's rendering is then two concatenations, not a template render (a tenth of
        the agent loop's CPU). None: the template is rendered each time."""
        text = self._after_assistant([{"role": "tool", "content": _TOOL_MARK}])
        if text.count(_TOOL_MARK) != 1:
            return None
        before, after = text.split(_TOOL_MARK)
        if any(self._after_assistant([{"role": "tool", "content": probe}]) != before + probe + after
               for probe in _TOOL_PROBES):
            return None
        return before, after

    def initial(self, messages: list[dict]) -> list[int]:
        return self._prompt(self._text(messages, generation=True, tools=self.tools)).tolist()

    def continuation(self, new_messages: list[dict], ended_with_eos: bool) -> list[int]:
        """Tokens the template adds after a sampled assistant turn and these new messages."""
        rest = self.after_assistant
        if ended_with_eos and rest.startswith(self.eos_text):
            rest = rest[len(self.eos_text):]
        if (self._tool_frame is not None and len(new_messages) == 1 and new_messages[0].keys() == {"role", "content"}
                and new_messages[0]["role"] == "tool" and isinstance(new_messages[0]["content"], str)):
            before, after = self._tool_frame
            return self.encode(rest + before + new_messages[0]["content"] + after)
        return self.encode(rest + self._after_assistant(new_messages))

    def full(self, messages: list[dict]) -> list[int]:
        return self.encode(self._text(messages, generation=True, tools=self.tools))

    def token_at(self, ids: list[int], offset: int) -> int:
        """The index in `ids` (a turn's sampled tokens) of the token that holds character `offset`
        of their text (decoded as the loop decodes a turn, end-of-turn tokens left out); the last
        token when `offset` is at or past the text's end (the turn ended where the text needed more)."""
        lo, hi = 0, len(ids) - 1  # the first k whose prefix ids[:k + 1] decodes past `offset`
        while lo < hi:
            mid = (lo + hi) // 2
            if len(self.decode([t for t in ids[:mid + 1] if t != self.eos_id])) > offset:
                hi = mid
            else:
                lo = mid + 1
        return lo


def repetition_start(ids: list[int], repeats: int = 3, max_period: int = 64) -> int | None:
    """Where a turn's tail began repeating itself: the first token of the second of at least
    `repeats` copies of a span of up to `max_period` tokens running to its end (a sampled loop
    that max_tokens cut), the earliest over the spans; None when its tail does not repeat."""
    n, start = len(ids), None
    for period in range(1, min(max_period, n // repeats) + 1):
        i = n - period - 1
        while i >= 0 and ids[i] == ids[i + period]:
            i -= 1
        if n - i - 1 >= repeats * period:  # ids[i + 1:] repeats with this period
            start = i + 1 + period if start is None else min(start, i + 1 + period)
    return start


def break_of(renderer: TokenRenderer, output_ids: list[int], finish_reason: str | None,
             error_at: int | None) -> int | None:
    """TurnRecord.malformed_at of a turn without a well-formed tool call: for one cut at
    max_tokens, where its loop began (repetition_start); else the token holding the parser's
    `error_at` (StepResult.error_at). None when neither is known: the whole turn is to blame."""
    if not output_ids:
        return None
    if finish_reason == "length":
        return repetition_start(output_ids)
    return None if error_at is None else renderer.token_at(output_ids, error_at)


async def run_episode(sampler: InferenceClient, env, renderer: TokenRenderer, cfg: AgentConfig,
                      sink: TurnSink, *, session: str | None = None) -> EpisodeResult:
    """Run one episode to a final status. Failures of the sandbox, fleet or store end it as data."""
    messages = env.first_messages()
    pending = renderer.initial(messages)  # the first turn's input: the whole prompt
    context = Context(pending)  # a copy that grows by extends only: the fleet client keeps its JSON
    result = EpisodeResult(status="running")
    deadline = time.monotonic() + cfg.wall_clock_s
    try:
        while result.status == "running":
            try:
                if result.n_turns >= cfg.max_turns:
                    raise LimitsExceeded("max_turns")
                if time.monotonic() > deadline:
                    raise LimitsExceeded("timeout")
                sampling = _fit(cfg, len(context))
                started = time.monotonic()
                gen = await sampler.generate(context, sampling, session=session)
                generated = time.monotonic()
                text = renderer.decode([t for t in gen.output_ids if t != renderer.eos_id])
                step = await env.step(text)
                malformed_at = None if step.tool_call is not None else break_of(
                    renderer, gen.output_ids, gen.finish_reason, step.error_at)
                turn = TurnRecord(
                    idx=result.n_turns, segment=len(result.segment_starts) - 1, input_ids=pending,
                    output_ids=gen.output_ids, output_logprobs=gen.output_logprobs,
                    policy_version=gen.policy_version, policy_version_end=gen.policy_version_end,
                    finish_reason=gen.finish_reason, text=text, tool_call=step.tool_call,
                    observation=None if step.done else step.observation,
                    generation_s=generated - started, tool_s=time.monotonic() - generated,
                    routed_experts=gen.routed_experts, malformed_at=malformed_at,
                )  # fmt: skip
                await sink.append(turn)
                _account(result, turn)  # once stored: n_turns counts the turns the store holds
                context.extend(gen.output_ids)
                messages.append({"role": "assistant", "content": text})
                if step.done:
                    result.status = "submitted"
                    break
                tool_message = {"role": "tool", "content": step.observation}
                messages.append(tool_message)
                ended = bool(gen.output_ids) and gen.output_ids[-1] == renderer.eos_id
                if renderer.extends:
                    pending = renderer.continuation([tool_message], ended)
                    context.extend(pending)
                else:  # the template rewrites history: start a new segment from a full render
                    pending = renderer.full(messages)
                    context = Context(pending)
                    result.segment_starts.append(result.n_turns)
            except ContextExceeded:
                result.status = "context_exhausted"
            except LimitsExceeded as stop:
                result.status = stop.status
        result.diff = await env.diff()
    except EPISODE_FAILURES as e:
        _failed(result, failure_status(e), e)
    return result


def _fit(cfg: AgentConfig, context_len: int) -> SamplingParams:
    if cfg.max_context_tokens is None:
        return cfg.sampling
    room = cfg.max_context_tokens - context_len
    if room < 1:
        raise ContextExceeded(context_len, cfg.sampling.max_tokens, cfg.max_context_tokens)
    return cfg.sampling.model_copy(update={"max_tokens": min(room, cfg.sampling.max_tokens)})


def _account(result: EpisodeResult, turn: TurnRecord) -> None:
    result.n_turns += 1
    result.input_tokens += len(turn.input_ids)
    result.output_tokens += len(turn.output_ids)
    versions = [v for v in (turn.policy_version, turn.policy_version_end) if v is not None]
    result.policy_version_min = min([result.policy_version_min, *versions], key=_none_high)
    result.policy_version_max = max([result.policy_version_max, *versions], key=_none_low)


def _none_high(v: int | None) -> float:
    return float("inf") if v is None else v


def _none_low(v: int | None) -> float:
    return float("-inf") if v is None else v


def _failed(result: EpisodeResult, status: EpisodeStatus, error: Exception) -> None:
    result.status, result.error_type, result.error_message = status, type(error).__name__, str(error)
