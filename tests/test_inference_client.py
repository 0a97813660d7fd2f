"""Client paths a CPU vLLM cannot produce, against the HTTP stub: routed experts, retries."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest

from service.fleet.client import FleetConfig, NotVLLM, ProviderError, SamplingParams, VLLMClient, decode_routed_experts
from service.fleet.stub import create_stub
from tests.servers import ThreadServer


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
        with pytest.raises(ProviderError, match="no healthy inference server: .*probe failed"):  # one is down
            await VLLMClient(FleetConfig(endpoints=[stub.url, "http://127.0.0.1:9"], model="tiny")).start()


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
