"""Client paths a CPU vLLM cannot produce, against the HTTP stub: routed experts, retries."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest

import orjson
from fastapi.responses import PlainTextResponse

from service.fleet.client import (Context, FleetConfig, _drop_prompt_echo, NotVLLM, ProviderError, SamplingParams, VLLMClient,
                                  decode_routed_experts)
from service.fleet.stub import create_stub
from tests.servers import TcpProxy, ThreadServer


async def test_routed_experts_are_aligned_to_the_prompt_delta_and_output():
    with ThreadServer(create_stub(layers=3, top_k=2, tokens=5)) as stub:
        async with VLLMClient(FleetConfig(endpoints=[stub.url])) as fleet:
            prompt = list(range(10))
            gen = await fleet.generate(prompt, SamplingParams(max_tokens=5), keep_experts_from=7)
    assert gen.routed_experts.dtype == np.uint8
    assert gen.routed_experts.shape == (3 + 5, 3, 2)  # 3 new prompt tokens + 5 sampled
    full = (np.arange(15 * 3 * 2) % 97).reshape(15, 3, 2)
    assert np.array_equal(gen.routed_experts, full[7:])


@pytest.mark.parametrize(("n_experts", "dtype"), [(8, np.uint8), (384, np.uint16)])
def test_routed_experts_dtype_follows_the_expert_count(n_experts, dtype):
    arr = np.random.default_rng(0).integers(0, n_experts, size=(4, 2, 8)).astype(np.int32)
    arr[0, 0, 0] = n_experts - 1
    buf = io.BytesIO()
    np.save(buf, arr)
    out = decode_routed_experts(base64.b64encode(buf.getvalue()).decode())
    assert out.dtype == dtype and np.array_equal(out, arr)


def test_routed_experts_of_the_wrong_rank_are_refused():
    buf = io.BytesIO()
    np.save(buf, np.zeros((4, 2), dtype=np.int32))
    with pytest.raises(ProviderError, match="layers, top_k"):
        decode_routed_experts(base64.b64encode(buf.getvalue()).decode())


async def test_unknown_model_makes_the_server_unhealthy():
    with ThreadServer(create_stub(model="other")) as stub:
        with pytest.raises(NotVLLM, match=r"serves \['other'\], not tiny"):  # answers: waiting will not help
            await VLLMClient(FleetConfig(endpoints=[stub.url], model="tiny")).start()
        client = VLLMClient(FleetConfig(endpoints=[stub.url, "http://127.0.0.1:9"], model="tiny"))
        with pytest.raises(ProviderError, match="no healthy inference server: .*probe failed"):  # one is down
            await client.start()
        assert client._http.is_closed  # a start that fails leaves no connections behind (a poller retries it)
        assert client._completions is None or client._completions.closed


def test_fleet_config_refuses_an_empty_fleet():
    with pytest.raises(ValueError, match="endpoints"):
        FleetConfig(endpoints=[])


def test_a_tokenizer_load_waits_its_turn_only_as_long_as_asked_and_never_asks_a_hub(tmp_path):
    """The viewer's load gives up (a 409 it tries again) instead of queueing behind another load
    without end; a name that is no folder fails at once, never looked up on a hub (no network)."""
    import time

    from service.fleet import client as fleet_client

    with fleet_client._TOKENIZER_LOAD:
        started = time.monotonic()
        with pytest.raises(TimeoutError, match="still loading"):
            fleet_client.load_tokenizer(str(tmp_path / "x"), wait_s=0.2)
        assert 0.2 <= time.monotonic() - started < 5
    started = time.monotonic()
    with pytest.raises(OSError):
        fleet_client.load_tokenizer("some-org/some-model-that-is-not-a-folder")
    assert time.monotonic() - started < 10


class DroppingProxy(TcpProxy):
    """A proxy that closes the connection of the first `drops` completion requests without an
    answer (what a server closing a pooled keep-alive connection as it is reused looks like),
    and forwards everything else."""

    def __init__(self, target_port: int, drops: int):
        super().__init__(target_port)
        self.drops = drops

    def drop(self, request: bytes) -> bool:
        if request.startswith(b"POST /v1/completions") and self.drops > 0:
            self.drops -= 1
            return True
        return False


async def test_a_dropped_connection_to_a_live_server_is_retried_and_keeps_it_in_the_fleet():
    """With one server, marking it down at the first dropped connection failed every episode in
    flight within seconds (the RL job of `swerve demo learn` ended failed so): a server that
    answers a probe stays in, and the request is sent again."""
    with ThreadServer(create_stub(tokens=3)) as stub:
        proxy = DroppingProxy(stub.port, drops=2).start()
        try:
            async with VLLMClient(FleetConfig(endpoints=[proxy.url], max_retries=3, backoff_s=0.05)) as fleet:
                gen = await fleet.generate([1, 2, 3], SamplingParams(max_tokens=3), session="s")
                assert len(gen.output_ids) == 3 and proxy.drops == 0
                assert fleet.endpoints[0].healthy  # both drops were retried on it, still in the fleet
        finally:
            proxy.stop()


async def test_a_fleet_whose_servers_are_all_down_waits_for_one_within_its_retries():
    with ThreadServer(create_stub(tokens=2)) as stub:
        async with VLLMClient(FleetConfig(endpoints=[stub.url], max_retries=4, backoff_s=0.05)) as fleet:
            fleet._mark_down(fleet.endpoints[0], "as if a request had failed")
            gen = await fleet.generate([1, 2], SamplingParams(max_tokens=2))  # probed back in
            assert len(gen.output_ids) == 2 and fleet.endpoints[0].healthy


async def test_an_episodes_prompt_reaches_the_server_whole_as_it_grows():
    """A Context keeps the JSON of the ids it has sent: each request must still carry every id,
    in order, whatever was added between turns (one id, many, none), and a plain list as ever."""
    app = create_stub(tokens=3, max_model_len=1 << 20)
    with ThreadServer(app) as stub:
        async with VLLMClient(FleetConfig(endpoints=[stub.url])) as fleet:
            context = Context([7, 0, 150_000])
            for added in ([], [5], list(range(1000, 1700)), [], [2**31 - 1, 0, 3]):
                context.extend(added)
                gen = await fleet.generate(context, SamplingParams(max_tokens=3), session="s")
                assert app.state.stub["prompt"] == list(context)
                context += gen.output_ids
            await fleet.generate([4, 5, 6], SamplingParams(max_tokens=3))
            assert app.state.stub["prompt"] == [4, 5, 6]


def test_a_context_only_grows():
    context = Context([1, 2, 3])
    context.append(4)
    context.extend([5])
    context += [6]
    assert context == [1, 2, 3, 4, 5, 6] and isinstance(context, list)
    assert orjson.loads(b"[" + context.json_items() + b"]") == list(context)
    for change in (lambda: context.__setitem__(0, 9), lambda: context.__delitem__(slice(0, 2)), context.pop,
                   context.clear, lambda: context.insert(0, 1), lambda: context.remove(1), context.sort,
                   context.reverse, lambda: context.__imul__(0)):
        with pytest.raises(TypeError, match="only grows"):
            change()
    assert context == [1, 2, 3, 4, 5, 6]
    context.append(7)  # what was encoded stays, the rest is added
    assert orjson.loads(b"[" + context.json_items() + b"]") == [1, 2, 3, 4, 5, 6, 7]


async def test_a_refused_completion_is_a_provider_error_with_the_servers_answer_and_a_busy_one_is_retried():
    with ThreadServer(create_stub(tokens=2, refuse=(503, 429))) as stub:
        async with VLLMClient(FleetConfig(endpoints=[stub.url], max_retries=2, backoff_s=0.01)) as fleet:
            gen = await fleet.generate([1, 2], SamplingParams(max_tokens=2))
            assert len(gen.output_ids) == 2 and fleet.endpoints[0].failures == 2
    app = create_stub(tokens=2, refuse=(400,))
    with ThreadServer(app) as stub:
        async with VLLMClient(FleetConfig(endpoints=[stub.url], max_retries=2, backoff_s=0.01)) as fleet:
            with pytest.raises(ProviderError, match="refused the request: 400 .*refused as asked"):
                await fleet.generate([1, 2], SamplingParams(max_tokens=2))
            assert app.state.stub["calls"] == 1  # not sent again
    app = create_stub(tokens=2, refuse=(307,))
    with ThreadServer(app) as stub:
        async with VLLMClient(FleetConfig(endpoints=[stub.url], max_retries=2, backoff_s=0.01)) as fleet:
            with pytest.raises(ProviderError, match="refused the request: 307"):
                await fleet.generate([1, 2], SamplingParams(max_tokens=2))
            assert app.state.stub["calls"] == 1


async def test_a_completion_answered_with_no_json_choice_is_a_provider_error():
    app = create_stub()
    app.router.routes = [r for r in app.router.routes if getattr(r, "path", None) != "/v1/completions"]
    app.add_api_route("/v1/completions", lambda: PlainTextResponse("<html>proxy error</html>"), methods=["POST"])
    with ThreadServer(app) as stub:
        async with VLLMClient(FleetConfig(endpoints=[stub.url])) as fleet:
            with pytest.raises(ProviderError, match="no choice in JSON.*proxy error"):
                await fleet.generate([1, 2], SamplingParams(max_tokens=2))


def test_the_prompt_echo_is_cut_exactly_and_nothing_else_is():
    """vLLM echoes the prompt's ids with return_token_ids; the client cuts them before parsing.
    A text that spells the key (escaped inside its JSON string) and every other field stay."""
    text = 'tricky "prompt_token_ids":[1,2] ] \\"prompt_token_ids":['
    choice = {"index": 0, "text": text, "token_ids": [5, 6], "prompt_token_ids": list(range(3000)),
              "logprobs": {"token_logprobs": [-0.5, -0.25]}, "finish_reason": "stop"}
    answer = orjson.dumps({"id": "x", "choices": [choice], "usage": {"prompt_tokens": 3000}})
    cut = orjson.loads(_drop_prompt_echo(answer))
    assert cut["choices"][0] == choice | {"prompt_token_ids": None}
    assert cut["usage"] == {"prompt_tokens": 3000} and len(_drop_prompt_echo(answer)) < len(answer) / 5
    for same in ({"choices": [choice | {"prompt_token_ids": None}]}, {"choices": [{"text": text}]}):
        assert _drop_prompt_echo(orjson.dumps(same)) == orjson.dumps(same)


async def test_completions_go_through_the_proxy_the_environment_names_as_the_control_calls_do(monkeypatch):
    """HTTP_PROXY (and NO_PROXY) hold for every call to the fleet: the server's name here
    resolves nowhere, so only a request sent through the proxy (a byte pipe to the stub, which
    takes the absolute-form target a proxy is sent) can reach it."""

    class Counting(TcpProxy):
        requests = 0

        def drop(self, request: bytes) -> bool:
            Counting.requests += request.startswith(b"POST http://swerve-fleet.invalid:8000/v1/completions")
            return False

    for name in ("NO_PROXY", "no_proxy", "ALL_PROXY", "all_proxy", "http_proxy"):
        monkeypatch.delenv(name, raising=False)
    with ThreadServer(create_stub(tokens=2)) as stub:
        proxy = Counting(stub.port).start()
        try:
            monkeypatch.setenv("HTTP_PROXY", proxy.url)
            async with VLLMClient(FleetConfig(endpoints=["http://swerve-fleet.invalid:8000"])) as fleet:
                gen = await fleet.generate([1, 2], SamplingParams(max_tokens=2))
                assert len(gen.output_ids) == 2 and Counting.requests == 1
            monkeypatch.setenv("NO_PROXY", "swerve-fleet.invalid")
            with pytest.raises(ProviderError, match="no healthy inference server"):
                await VLLMClient(FleetConfig(endpoints=["http://swerve-fleet.invalid:8000"], max_retries=0)).start()
        finally:
            proxy.stop()


async def test_a_new_session_and_the_poll_read_the_version_the_server_serves_now():
    """A trainer elsewhere reloads the servers: an episode's first turn reads the version before
    it is sent, and the poll keeps every server's up to date; a /weight_info that is not one
    takes the server out, naming what it answered."""
    import httpx

    app = create_stub(tokens=2)
    with ThreadServer(app) as stub:
        async with VLLMClient(FleetConfig(endpoints=[stub.url], version_poll_s=3600)) as fleet:
            assert (await fleet.generate([1], SamplingParams(max_tokens=2), session="a")).policy_version == 0
            httpx.post(f"{stub.url}/update_weight_version", json={"new_version": "3"}).raise_for_status()
            assert (await fleet.generate([1], SamplingParams(max_tokens=2), session="b")).policy_version == 3
            httpx.post(f"{stub.url}/update_weight_version", json={"new_version": "4"}).raise_for_status()
            assert await fleet.refresh_versions() == 4
    broken = create_stub(tokens=2)
    with ThreadServer(broken) as stub:
        async with VLLMClient(FleetConfig(endpoints=[stub.url], version_poll_s=3600)) as fleet:
            broken.router.routes = [r for r in broken.router.routes if getattr(r, "path", None) != "/weight_info"]
            broken.add_api_route("/weight_info", lambda: PlainTextResponse("<html>not vLLM</html>"))
            await fleet.refresh_versions()
            assert not fleet.endpoints[0].healthy and "not vLLM" in fleet.endpoints[0].error
