"""The fleet client against real vLLM CPU servers serving tiny models made here."""

from __future__ import annotations

import asyncio

import httpx
import pytest
import torch

from service.fleet.client import ContextExceeded, FleetConfig, ProviderError, SamplingParams, VLLMClient
from tests.servers import TcpProxy

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

PROMPTS = [[1, 50, 60, 70, 80], [2, 300, 301, 302, 303, 304], list(range(100, 164))]


def client(*urls: str, **kw) -> VLLMClient:
    return VLLMClient(FleetConfig(endpoints=list(urls), max_retries=2, backoff_s=0.05, **kw))


def transformers_logprobs(model_dir, prompt: list[int], output: list[int]) -> list[float]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([prompt + output])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(output)[:, None])[:, 0].tolist()


@pytest.mark.parametrize("kind", ["dense", "moe"])
async def test_token_ids_in_and_logprobs_match_transformers(vllm_fleet, kind):
    async with client(vllm_fleet.url(f"{kind}-a")) as fleet:
        for prompt in PROMPTS:
            gen = await fleet.generate(prompt, SamplingParams(max_tokens=16, seed=7))
            assert len(gen.output_ids) == len(gen.output_logprobs) == 16
            assert gen.policy_version == 0 and gen.finish_reason == "length"
            expected = transformers_logprobs(vllm_fleet.models[kind], prompt, gen.output_ids)
            assert max(abs(a - b) for a, b in zip(gen.output_logprobs, expected)) < 1e-2


async def test_sessions_stick_to_their_server_and_spread_when_new(vllm_fleet):
    proxy = TcpProxy(vllm_fleet.servers["dense-a"].port).start()
    try:
        async with client(vllm_fleet.url("dense-a"), proxy.url) as fleet:
            seen: dict[str, set[str]] = {}
            for turn in range(4):
                gens = await asyncio.gather(*(
                    fleet.generate(PROMPTS[0] + [turn], SamplingParams(max_tokens=4), session=f"ep{i}")
                    for i in range(4)))
                for i, gen in enumerate(gens):
                    seen.setdefault(f"ep{i}", set()).add(gen.server)
            assert all(len(servers) == 1 for servers in seen.values())  # affinity
            assert {s for servers in seen.values() for s in servers} == {vllm_fleet.url("dense-a"), proxy.url}
    finally:
        proxy.stop()


async def test_episode_moves_only_when_its_server_dies(vllm_fleet):
    proxy = TcpProxy(vllm_fleet.servers["dense-a"].port).start()
    async with client(proxy.url, vllm_fleet.url("dense-a")) as fleet:
        first = await fleet.generate(PROMPTS[1], SamplingParams(max_tokens=4), session="ep")
        assert first.server == proxy.url
        proxy.stop()
        moved = await fleet.generate(PROMPTS[1], SamplingParams(max_tokens=4), session="ep")
        assert moved.server == vllm_fleet.url("dense-a")
        assert not fleet.endpoints[0].healthy


async def test_context_exceeded_is_raised_before_sending(vllm_fleet):
    async with client(vllm_fleet.url("dense-a")) as fleet:
        limit = fleet.endpoints[0].max_model_len
        with pytest.raises(ContextExceeded) as info:
            await fleet.generate([5] * (limit - 10), SamplingParams(max_tokens=64))
        assert info.value.max_model_len == limit


async def test_provider_error_when_no_server_answers(vllm_fleet):
    proxy = TcpProxy(vllm_fleet.servers["dense-a"].port).start()
    async with client(proxy.url) as fleet:
        proxy.stop()
        with pytest.raises(ProviderError):
            await fleet.generate(PROMPTS[0], SamplingParams(max_tokens=4))


def greedy(url: str, prompts: list[list[int]] = PROMPTS) -> list[tuple[list[int], list[float]]]:
    out = []
    for prompt in prompts:
        choice = httpx.post(f"{url}/v1/completions", timeout=120, json={
            "model": "tiny", "prompt": prompt, "max_tokens": 12, "temperature": 0, "logprobs": 0,
            "return_token_ids": True}).json()["choices"][0]
        out.append((choice["token_ids"], choice["logprobs"]["token_logprobs"]))
    return out


async def test_a_reloaded_tied_head_serves_the_new_embedding(vllm_fleet):
    """The checkpoint of a tied model has no head weight: vLLM's in-place reload skips the head,
    and on CPU its prepacked GEMM kept the old embedding (the served next-token logits were the
    old policy's while everything else was the new one's)."""
    url, new = vllm_fleet.url("tied-a"), vllm_fleet.models["tied-v1"]
    async with client(url) as fleet:
        try:
            assert await fleet.reload(str(new), version=1) == [url]
            for prompt in PROMPTS:
                [(ids, logprobs)] = greedy(url, [prompt])
                expected = transformers_logprobs(new, prompt, ids)
                assert max(abs(a - b) for a, b in zip(logprobs, expected)) < 1e-3, (prompt, logprobs, expected)
        finally:
            assert await fleet.reload(str(vllm_fleet.models["tied"]), version=0)


@pytest.mark.parametrize("kind", ["dense", "moe"])
async def test_reload_matches_a_fresh_start(vllm_fleet, kind):
    fresh = greedy(vllm_fleet.url(f"{kind}-b"))
    async with client(vllm_fleet.url(f"{kind}-a")) as fleet:
        assert greedy(vllm_fleet.url(f"{kind}-a")) != fresh
        assert await fleet.reload(str(vllm_fleet.models[f"{kind}-v1"]), version=1) == [vllm_fleet.url(f"{kind}-a")]
        reloaded = greedy(vllm_fleet.url(f"{kind}-a"))
        assert [ids for ids, _ in reloaded] == [ids for ids, _ in fresh]
        assert max(abs(a - b) for (_, x), (_, y) in zip(reloaded, fresh) for a, b in zip(x, y)) < 1e-4
        gen = await fleet.generate(PROMPTS[0], SamplingParams(max_tokens=2))
        assert (gen.policy_version, fleet.version) == (1, 1)
        # back to the initial weights for the other tests
        assert await fleet.reload(str(vllm_fleet.models[kind]), version=0)


@pytest.mark.parametrize("failure", ["fail", "stale"])
async def test_failed_reload_takes_the_server_out(vllm_fleet, failure):
    from service.fleet.stub import create_stub
    from tests.servers import ThreadServer

    with ThreadServer(create_stub(model="tiny", reload=failure)) as broken:
        async with client(vllm_fleet.url("dense-a"), broken.url) as fleet:
            ok = await fleet.reload(str(vllm_fleet.models["dense"]), version=3)
            assert ok == [vllm_fleet.url("dense-a")]
            assert [ep.healthy for ep in fleet.endpoints] == [True, False]
            for i in range(4):  # nothing is sent to the server left on old weights
                gen = await fleet.generate(PROMPTS[0], SamplingParams(max_tokens=2), session=f"s{i}")
                assert (gen.server, gen.policy_version) == (vllm_fleet.url("dense-a"), 3)
            assert await fleet.reload(str(vllm_fleet.models["dense"]), version=0)


async def test_a_cpu_server_runs_its_model_in_the_engine_process(vllm_fleet):
    """No worker process beside the engine: the mp executor's engine and worker spin on shared
    memory between messages, a core each under load (service.fleet.server.VLLMServer.env)."""
    import psutil

    server = vllm_fleet.servers["dense-a"]
    async with client(server.url) as fleet:
        gen = await fleet.generate(PROMPTS[0], SamplingParams(max_tokens=4, temperature=0.0), session="engine")
    assert len(gen.output_ids) == 4
    names = [p.name() for p in psutil.Process(server.proc.pid).children(recursive=True)]
    assert any("EngineCore" in n for n in names), names
    assert not any("Worker" in n for n in names), names
