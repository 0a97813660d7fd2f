"""Fleet-client overhead, side by side with direct httpx calls in one run:
per-call latency against an instant stub server (p50/p99), this process's CPU a call as an
episode's prompt grows (1k to 128k tokens), and tokens/s against a real vLLM CPU server with the
tiny model (8 concurrent sessions).

The CPU a call, alternating the three paths over --rounds: direct httpx with its json= and
.json() (what the fleet client did before 2026-12-07 evening), and the fleet client given the
prompt as a plain list or as the agent's Context (its JSON text kept as it grows). Each call
adds 400 tokens to its path's prompt, as a turn does; the stub echoes the prompt's ids as vLLM
does with return_token_ids. The stub runs in its own process: its CPU is not counted.

    .venv/bin/python bench/inference.py [--calls 2000] [--rounds 3] [--growth-calls 10]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from service.fleet import stub  # noqa: E402
from service.fleet.client import Context, FleetConfig, SamplingParams, VLLMClient  # noqa: E402
from service.fleet.tiny_model import init_tiny  # noqa: E402
from service.fleet.server import VLLMServer, set_version  # noqa: E402
from tests.servers import free_port  # noqa: E402

PROMPT = list(range(1, 200))


def q(values: list[float], p: int) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[p - 1]


def body(model: str, max_tokens: int) -> dict:
    return {"model": model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 1.0,
            "top_p": 1.0, "top_k": -1, "logprobs": 0, "return_token_ids": True,
            "skip_special_tokens": False, "include_stop_str_in_output": True,
            "spaces_between_special_tokens": False}


async def direct_calls(url: str, model: str, n: int, max_tokens: int) -> list[float]:
    out = []
    async with httpx.AsyncClient(timeout=600) as http:
        for _ in range(n):
            t = time.perf_counter()
            r = (await http.post(f"{url}/v1/completions", json=body(model, max_tokens))).raise_for_status()
            c = r.json()["choices"][0]
            _ = (c["token_ids"], c["logprobs"]["token_logprobs"])
            out.append(time.perf_counter() - t)
    return out


async def client_calls(url: str, n: int, max_tokens: int) -> list[float]:
    out = []
    async with VLLMClient(FleetConfig(endpoints=[url])) as fleet:
        for _ in range(n):
            t = time.perf_counter()
            await fleet.generate(PROMPT, SamplingParams(max_tokens=max_tokens), session="s")
            out.append(time.perf_counter() - t)
    return out


LENGTHS = (1_000, 8_000, 32_000, 128_000)
GROWTH = 400


async def cpu_per_call(url: str, length: int, calls: int, rounds: int) -> dict[str, tuple[float, float]]:
    """ms of this process's CPU a call, and the mean prompt length, for each path (see the module)."""
    rng = random.Random(length)
    base = [rng.randrange(150_000) for _ in range(length)]
    turns = [[rng.randrange(150_000) for _ in range(GROWTH)] for _ in range(calls)]
    sampling = SamplingParams(max_tokens=8)
    spent: dict[str, list[float]] = {"direct httpx (json=)": [], "client, list": [], "client, Context": []}
    sizes: dict[str, list[int]] = {name: [] for name in spent}
    async with VLLMClient(FleetConfig(endpoints=[url])) as fleet, httpx.AsyncClient(timeout=600) as http:
        async def direct(prompt):
            b = body("stub", 8) | {"prompt": prompt}
            r = (await http.post(f"{url}/v1/completions", json=b)).raise_for_status()
            c = r.json()["choices"][0]
            _ = (c["token_ids"], c["logprobs"]["token_logprobs"])

        async def client(prompt):
            await fleet.generate(prompt, sampling, session="s")

        paths = {"direct httpx (json=)": (direct, list), "client, list": (client, list),
                 "client, Context": (client, Context)}
        for r in range(rounds):
            for name in (list(paths) if r % 2 == 0 else list(paths)[::-1]):
                call, kind = paths[name]
                prompt = kind(base)
                await call(prompt)  # a first call apart: connections made, a Context's prompt encoded
                cpu = 0.0
                for turn in turns:
                    prompt.extend(turn)
                    sizes[name].append(len(prompt))
                    t = time.thread_time()
                    await call(prompt)
                    cpu += time.thread_time() - t
                spent[name].append(cpu / calls)
    return {name: (statistics.median(v) * 1e3, statistics.mean(sizes[name])) for name, v in spent.items()}


async def side_by_side(url: str, model: str, sessions: int, calls: int) -> tuple[float, float]:
    """Half the sessions through the client, half direct, at the same time (same server load)."""
    sampling = SamplingParams(max_tokens=64)

    async def via_client(fleet: VLLMClient, s: int) -> int:
        n = 0
        for _ in range(calls):
            n += len((await fleet.generate(PROMPT, sampling, session=f"s{s}")).output_ids)
        return n

    async def direct(http: httpx.AsyncClient) -> int:
        n = 0
        for _ in range(calls):
            r = (await http.post(f"{url}/v1/completions", json=body(model, 64))).raise_for_status()
            n += len(r.json()["choices"][0]["token_ids"])
        return n

    async def timed(coros) -> float:
        t = time.perf_counter()
        tokens = sum(await asyncio.gather(*coros))
        return tokens / (time.perf_counter() - t)

    async with VLLMClient(FleetConfig(endpoints=[url])) as fleet, httpx.AsyncClient(timeout=600) as http:
        half = sessions // 2
        return await asyncio.gather(timed([direct(http) for _ in range(half)]),
                                    timed([via_client(fleet, s) for s in range(half)]))


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--growth-calls", type=int, default=10, help="calls per prompt length and path")
    args = parser.parse_args()

    with stub.in_process(free_port(), max_model_len=1 << 20) as url:
        await direct_calls(url, "stub", 200, 8)  # warm up both paths
        await client_calls(url, 200, 8)
        direct = await direct_calls(url, "stub", args.calls, 8)
        ours = await client_calls(url, args.calls, 8)
        growing = {n: await cpu_per_call(url, n, args.growth_calls, args.rounds) for n in LENGTHS}

    with tempfile.TemporaryDirectory() as tmp:
        model = init_tiny(Path(tmp) / "tiny")
        server = VLLMServer(model, free_port(), served_name="tiny", log_path=Path(tmp) / "vllm.log").start()
        try:
            server.wait_ready()
            set_version(server.url, 0)
            await side_by_side(server.url, "tiny", 8, 2)  # warm up
            rounds = [await side_by_side(server.url, "tiny", 8, 6) for _ in range(args.rounds)]
        finally:
            server.stop()

    print(f"per call against an instant stub ({args.calls} calls, 199-token prompt, 8 tokens out)")
    print(f"{'path':14} {'p50 ms':>8} {'p99 ms':>8}")
    for name, lat in (("direct httpx", direct), ("swerve client", ours)):
        print(f"{name:14} {statistics.median(lat) * 1e3:8.3f} {q(lat, 99) * 1e3:8.3f}")
    overhead = statistics.median(ours) - statistics.median(direct)
    print(f"client overhead p50: {overhead * 1e3:.3f} ms")
    print(f"\nthis process's CPU a call as a prompt grows ({GROWTH} tokens a call, {args.growth_calls} calls, "
          f"median of {args.rounds} rounds), ms:")
    names = list(growing[LENGTHS[0]])
    print(f"{'prompt tokens':>14} " + " ".join(f"{n:>22}" for n in names) + "  direct / Context")
    for n, row in growing.items():
        print(f"{row[names[0]][1]:14.0f} " + " ".join(f"{row[k][0]:22.3f}" for k in names)
              + f"  {row[names[0]][0] / row[names[-1]][0]:10.1f}x")
    ratios = [c / d for d, c in rounds]
    print(f"tokens/s against vLLM CPU (tiny dense model), 4 sessions direct and 4 through the client "
          f"at the same time, 6 calls x 64 tokens each, {args.rounds} rounds:")
    for i, (d, c) in enumerate(rounds):
        print(f"  round {i}: direct {d:6.0f}  client {c:6.0f}  ({c / d:.3f}x)")
    print(f"median client/direct: {statistics.median(ratios):.3f}x")


if __name__ == "__main__":
    asyncio.run(main())
