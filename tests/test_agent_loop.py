"""The agent loop's token bookkeeping and stop rules, with the tiny model's real tokenizer and a
scripted sampler and environment (pure logic: no sandbox, no server)."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from envs.swe_env import StepResult
from envs.tools import TOOLS, parse_tool_call
from service.worker.agent import AgentConfig, MemoryTurnSink, TokenRenderer, repetition_start, run_episode
from service.fleet.client import ContextExceeded, Generation, SamplingParams
from service.worker.scripted import ScriptedSampler, tool_call_text
from service.fleet.tiny_model import init_tiny


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return AutoTokenizer.from_pretrained(init_tiny(tmp_path_factory.mktemp("tok") / "tiny"))


class ScriptedEnv:
    """Answers every tool call with the next scripted observation; submit ends it."""

    tools = TOOLS

    def __init__(self, observations: list[str]):
        self.observations = list(observations)
        self.steps = 0

    def first_messages(self) -> list[dict]:
        return [{"role": "system", "content": "Fix it."}, {"role": "user", "content": "The bug is in lib.py."}]

    async def step(self, text: str) -> StepResult:
        parsed = parse_tool_call(text)
        if parsed.call is not None and parsed.call.name == "submit":
            return StepResult("Submitted.", True, {"name": "submit", "arguments": {}})
        obs = self.observations[self.steps % len(self.observations)] if self.observations else ""
        self.steps += 1
        call = {"name": parsed.call.name, "arguments": parsed.call.arguments} if parsed.call else None
        return StepResult(obs if parsed.call else parsed.error, False, call, parsed.error, parsed.error_at)

    async def diff(self) -> str:
        return ""


def full_rendering(tokenizer, env, turns) -> list[int]:
    messages = env.first_messages()
    for turn in turns:
        messages.append({"role": "assistant", "content": turn.text})
        if turn.observation is not None:
            messages.append({"role": "tool", "content": turn.observation})
    ids = tokenizer.apply_chat_template(messages, tools=TOOLS, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


text = st.text(alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="<>\x00"), max_size=60)
action = st.one_of(
    st.builds(lambda c: tool_call_text("bash", {"command": c}), text),
    st.builds(lambda p, s: tool_call_text("str_replace_editor", {"command": "view", "path": p, "view_range": s}),
              text, st.lists(st.integers(-5, 500), max_size=2)),
    text.map(lambda t: "Thinking: " + t),  # no tool call at all
)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(actions=st.lists(action, min_size=300, max_size=340), observations=st.lists(text, min_size=1, max_size=20))
async def test_turn_tokens_concatenate_to_the_full_rendering(tokenizer, actions, observations):
    env = ScriptedEnv(observations)
    sink = MemoryTurnSink()
    sampler = ScriptedSampler(tokenizer, actions + [tool_call_text("submit", {})])
    result = await run_episode(sampler, env, TokenRenderer(tokenizer, TOOLS), AgentConfig(max_turns=400), sink)
    assert result.status == "submitted" and result.n_turns == len(actions) + 1
    ids = [i for turn in sink.turns for i in turn.input_ids + turn.output_ids]
    full = full_rendering(tokenizer, env, sink.turns)
    # the template closes the last assistant message with a newline the model never sampled
    assert ids == full[: len(ids)] and tokenizer.decode(full[len(ids):]) == "\n"
    assert result.segment_starts == [0]
    assert all(turn.output_logprobs == [0.0] * len(turn.output_ids) for turn in sink.turns)


@pytest.mark.parametrize(("cfg", "status"), [
    (AgentConfig(max_turns=3), "max_turns"),
    (AgentConfig(wall_clock_s=1e-9), "timeout"),
    (AgentConfig(max_context_tokens=2500), "context_exhausted"),
])
async def test_stop_rules(tokenizer, cfg, status):
    sampler = ScriptedSampler(tokenizer, [tool_call_text("bash", {"command": "ls " * 20})] * 50)
    sink = MemoryTurnSink()
    result = await run_episode(sampler, ScriptedEnv(["x" * 200]), TokenRenderer(tokenizer, TOOLS), cfg, sink)
    assert result.status == status
    assert result.n_turns == len(sink.turns)
    if status == "context_exhausted":  # still trainable data: every turn kept
        assert 0 < result.n_turns < 50


async def test_provider_failure_ends_the_episode_as_data(tokenizer):
    from service.fleet.client import ProviderError

    class DeadFleet:
        async def generate(self, *a, **k):
            raise ProviderError("no healthy inference server")

    result = await run_episode(DeadFleet(), ScriptedEnv(["x"]), TokenRenderer(tokenizer, TOOLS), AgentConfig(), MemoryTurnSink())
    assert (result.status, result.error_type) == ("provider_error", "ProviderError")


class HistoryRewritingTokenizer:
    """The tiny tokenizer with a template that drops earlier reasoning (as Qwen3's does)."""

    def __init__(self, tok):
        self.tok = tok
        self.unk_token_id, self.eos_token_id = tok.unk_token_id, tok.eos_token_id

    def __getattr__(self, name):
        return getattr(self.tok, name)

    def apply_chat_template(self, messages, **kw):
        last_user = max((i for i, m in enumerate(messages) if m["role"] in ("user", "tool")), default=-1)
        kept = [{**m, "content": m["content"].split("</think>")[-1]} if m["role"] == "assistant" and i < last_user else m
                for i, m in enumerate(messages)]
        return self.tok.apply_chat_template(kept, **kw)


class ToolTrimmingTokenizer(HistoryRewritingTokenizer):
    """A template that strips a tool message's content: not verbatim, so not framed."""

    def apply_chat_template(self, messages, **kw):
        kept = [{**m, "content": m["content"].strip()} if m["role"] == "tool" else m for m in messages]
        return self.tok.apply_chat_template(kept, **kw)


@pytest.mark.parametrize("trimming", [False, True])
def test_an_observation_is_framed_only_where_the_template_renders_it_verbatim(tokenizer, trimming):
    """The renderer puts an observation between the text the template writes around a tool
    message, where the template takes its content as it is (the tiny model's Qwen3 template); a
    template that changes it (strips it) is rendered each time. Either way the tokens are the
    template's own."""
    tok = ToolTrimmingTokenizer(tokenizer) if trimming else tokenizer
    renderer = TokenRenderer(tok, TOOLS)
    assert renderer.extends and (renderer._tool_frame is None) == trimming
    dummy = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]
    for observation in ["  out\n", "", "{{ not jinja }}", "<tool_response>\n</tool_response>\n"]:
        tool = {"role": "tool", "content": observation}
        base = tok.apply_chat_template(dummy, tokenize=False)
        full = tok.apply_chat_template(dummy + [tool], tokenize=False, add_generation_prompt=True)
        assert full.startswith(base)
        rest = renderer.after_assistant
        assert renderer.continuation([tool], ended_with_eos=False) == tokenizer.encode(
            rest + full[len(base):], add_special_tokens=False)


async def test_template_that_rewrites_history_starts_new_segments(tokenizer):
    tok = HistoryRewritingTokenizer(tokenizer)
    renderer = TokenRenderer(tok, TOOLS)
    assert renderer.extends is False
    actions = ["<think>look</think>" + tool_call_text("bash", {"command": "ls"})] * 3 + [tool_call_text("submit", {})]
    sink = MemoryTurnSink()
    result = await run_episode(ScriptedSampler(tokenizer, actions), ScriptedEnv(["a"]), renderer, AgentConfig(), sink)
    assert result.status == "submitted"
    assert result.segment_starts == [0, 1, 2, 3]
    assert [t.segment for t in sink.turns] == [0, 1, 2, 3]


def test_a_tool_call_holding_a_lone_surrogate_gets_an_observation():
    """JSON may escape a lone surrogate, which no tokenizer, shell or file can take: the call is
    answered, not run (it would fail the episode)."""
    parsed = parse_tool_call('<tool_call>{"name": "bash", "arguments": {"command": "echo \\udcff"}}</tool_call>')
    assert parsed.call is None and "lone surrogate" in parsed.error
    assert parse_tool_call('<tool_call>{"name": "bash", "arguments": {"command": "echo \\ud83d\\ude00"}}</tool_call>').call


def test_the_parser_says_where_a_call_broke():
    """error_at: the JSON's first bad character; the text's end for a call never closed; None for
    no call at all or a well-formed one."""
    text = 'I will fix it. <tool_call>{"name": "str_replace_editor", "arguments": {"old_str": "f("x")"}}</tool_call>'
    parsed = parse_tool_call(text)
    assert parsed.call is None and text[parsed.error_at - 1:parsed.error_at + 2] == '"x"'  # the string closed at f(
    unclosed = '<tool_call>{"name": "bash", "arguments": {"command": "ls'
    assert parse_tool_call(unclosed).error_at == len(unclosed)
    assert parse_tool_call("Thinking about it.").error_at is None
    assert parse_tool_call(tool_call_text("submit", {})).error_at is None


def test_a_loop_is_found_where_it_began_repeating():
    assert repetition_start([1, 2, 3, 4, 5, 6, 4, 5, 6, 4, 5, 6, 4, 5]) == 6  # the second copy of 4 5 6
    assert repetition_start([9, 8] + [7] * 10) == 3
    assert repetition_start([1, 2, 3, 4, 5, 6, 4, 5, 6]) is None  # two copies: not yet a loop
    assert repetition_start(list(range(50))) is None and repetition_start([]) is None


class FixedSampler:
    """Hands back the given turns' ids with their finish reasons, then a submit."""

    def __init__(self, tokenizer, turns: list[tuple[list[int], str]]):
        self.turns = list(turns) + [(tokenizer.encode(tool_call_text("submit", {})), "stop")]

    async def generate(self, token_ids, sampling, *, session=None, keep_experts_from=0) -> Generation:
        ids, reason = self.turns.pop(0)
        return Generation(output_ids=list(ids), output_logprobs=[0.0] * len(ids), finish_reason=reason,
                          policy_version=0, policy_version_end=0, server="fixed", prompt_tokens=len(token_ids))


async def test_a_malformed_turn_records_the_token_where_it_broke(tokenizer):
    """TurnRecord.malformed_at: for a garbled call, the sampled token holding the parser's first
    bad character; for a loop cut at max_tokens, the token where it began repeating; None for a
    well-formed call and for a turn without any call."""
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    garbled = '<tool_call>{"name": "str_replace_editor", "arguments": {"command": "view", "path" "a.py"}}</tool_call>'
    bad_at = parse_tool_call(garbled).error_at
    loop = tokenizer.encode('<tool_call>{"name": "bash", "arguments": {"command": "echo') + tokenizer.encode(" ab") * 12
    well = tool_call_text("bash", {"command": "ls"})
    turns = [(tokenizer.encode(garbled) + [eos], "stop"), (loop, "length"), (tokenizer.encode(well) + [eos], "stop"),
             (tokenizer.encode("No idea.") + [eos], "stop")]
    sink = MemoryTurnSink()
    result = await run_episode(FixedSampler(tokenizer, turns), ScriptedEnv(["ok"]), TokenRenderer(tokenizer, TOOLS),
                               AgentConfig(), sink)
    assert result.status == "submitted" and len(sink.turns) == 5
    broken = sink.turns[0]
    k = broken.malformed_at
    assert len(tokenizer.decode(broken.output_ids[:k])) <= bad_at < len(tokenizer.decode(broken.output_ids[:k + 1]))
    assert sink.turns[1].malformed_at == len(loop) - 12 * len(tokenizer.encode(" ab")) + len(tokenizer.encode(" ab"))
    assert [t.malformed_at for t in sink.turns[2:]] == [None, None, None]


def test_token_at_finds_the_token_holding_a_character(tokenizer):
    renderer = TokenRenderer(tokenizer, TOOLS)
    text = 'print("héllo")  # ü € 𝄞\n' * 3
    ids = tokenizer.encode(text)
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    for offset in range(len(text)):
        k = renderer.token_at(ids + [eos], offset)
        assert len(tokenizer.decode(ids[:k])) <= offset < len(tokenizer.decode(ids[:k + 1])), offset
    assert renderer.token_at(ids + [eos], len(text)) == len(ids)  # past the text: the end-of-turn token


_SPECIAL = st.sampled_from(["<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>", "<|endoftext|>",
                            "<think>", "\n", " ", "  ", "\t", "\r\n"])


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(parts=st.lists(st.one_of(st.text(st.characters(blacklist_categories=("Cs",)), max_size=40), _SPECIAL),
                      max_size=8))
def test_the_fast_encoder_gives_the_tokenizers_own_ids(tokenizer, parts):
    """text_encoder goes straight to the Rust tokenizer (no transformers wrapping per call): the
    same ids as tokenizer.encode(text, add_special_tokens=False) on any text, special tokens
    included, or the loop's tokens would not be the ones the model sees."""
    from service.fleet.client import text_encoder

    encode = text_encoder(tokenizer)
    assert encode.__name__ == "fast"  # the tiny model's tokenizer is a fast one: the direct path is taken
    text = "".join(parts)
    assert encode(text) == tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.backend_tokenizer.truncation is None  # the copy's setting stayed the copy's


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_the_fast_decoder_gives_the_tokenizers_own_text(tokenizer, data):
    """text_decoder goes straight to the Rust tokenizer (no transformers conversion per call): the
    same text as tokenizer.decode(ids, skip_special_tokens=False) for any ids, special tokens and
    tokens that split a character included, or the loop would parse a tool call the model did
    not write."""
    from service.fleet.client import text_decoder

    decode = text_decoder(tokenizer)
    assert decode.__name__ == "fast"  # the tiny model's tokenizer is a fast one: the direct path is taken
    ids = data.draw(st.lists(st.integers(0, len(tokenizer) - 1), max_size=24))
    assert decode(ids) == tokenizer.decode(ids, skip_special_tokens=False)


def test_the_fast_decoder_steps_aside_when_the_tokenizer_cleans_up_spaces(tokenizer):
    """A tokenizer that joins " ." and " 's" after decoding (clean_up_tokenization_spaces):
    the Rust tokenizer does not, so the decoder falls back to the tokenizer's own decode."""
    import copy

    from service.fleet.client import text_decoder

    cleaning = copy.deepcopy(tokenizer)
    cleaning.clean_up_tokenization_spaces = True  # transformers 5 ignores it for BPE unless also told:
    cleaning.clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output = True
    decode = text_decoder(cleaning)
    ids = tokenizer.encode("it 's done .", add_special_tokens=False)
    assert decode.__name__ == "slow" and decode(ids) == cleaning.decode(ids, skip_special_tokens=False)
    assert decode(ids) != tokenizer.decode(ids, skip_special_tokens=False)  # the clean-up did change it


def test_the_fast_encoder_steps_aside_when_the_rust_tokenizer_truncates(tokenizer):
    """A tokenizer.json with truncation set: transformers' encode turns it off per call, so the
    direct path would cut long texts; the encoder falls back to the tokenizer's own encode."""
    import copy

    from service.fleet.client import text_encoder

    truncating = copy.deepcopy(tokenizer)
    truncating.backend_tokenizer.enable_truncation(max_length=4)
    encode = text_encoder(truncating)
    text = "a long text " * 20
    assert encode.__name__ == "slow" and len(encode(text)) > 4
    assert encode(text) == tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.backend_tokenizer.truncation is None  # the copy's setting stayed the copy's


def test_a_first_prompt_is_encoded_once_and_given_out_as_a_fresh_list(tokenizer):
    """A group's samples start from the same prompt: the renderer encodes it once, gives each
    episode its own list (one episode's changes are not the next one's prompt), and a prompt
    of other text is encoded anew."""
    renderer = TokenRenderer(tokenizer, TOOLS)
    calls = []
    encode = renderer.encode
    renderer.encode = lambda text: calls.append(text) or encode(text)
    first = [{"role": "system", "content": "You fix bugs."}, {"role": "user", "content": "f(2) gives 3, not 4"}]

    def want(messages):
        text = tokenizer.apply_chat_template(messages, tools=TOOLS, tokenize=False, add_generation_prompt=True)
        return tokenizer.encode(text, add_special_tokens=False)

    a = renderer.initial(first)
    a.append(-1)
    b = renderer.initial(first)
    assert b == want(first) and len(calls) == 1
    other = [first[0], {"role": "user", "content": "g(2) gives 3, not 4"}]
    assert renderer.initial(other) == want(other)
    assert len(calls) == 2


async def test_scripted_samplers_of_a_tokenizer_encode_each_text_once_and_hand_out_lists_of_their_own(tokenizer, monkeypatch):
    """A model hands back ids; a process's scripted episodes (load tests, oracle runs) replay the
    same calls: each text is encoded once per tokenizer, and each turn still gets a list of its
    own (the loop extends what it is given)."""
    from service.worker import scripted

    encoded = []
    monkeypatch.setattr(scripted, "_ENCODERS", scripted.weakref.WeakKeyDictionary())
    encoder = scripted.text_encoder
    monkeypatch.setattr(scripted, "text_encoder", lambda tok: (lambda text, e=encoder(tok): encoded.append(text) or e(text)))
    call = tool_call_text("bash", {"command": "ls"})
    outs = []
    for _ in range(3):
        sampler = ScriptedSampler(tokenizer, [call])
        outs += [(await sampler.generate([1], None)).output_ids for _ in range(2)]  # the call, then a submit
    assert encoded == [call, tool_call_text("submit", {})]
    assert outs[0] == outs[2] == outs[4] and outs[0] is not outs[2] and outs[0][-1] == sampler.eos_id
    outs[0].append(7)
    assert outs[2][-1] == sampler.eos_id
