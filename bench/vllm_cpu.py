"""vLLM on CPU: the engine's executor, "uni" (the model in the engine's process, what
service.fleet.server starts: VLLM_ENABLE_V1_MULTIPROCESSING=0) against "mp" (a worker process
beside the engine, vLLM's default on CPU), side by side in one run, alternating which goes first.

Each round serves the same requests (a 400-token prompt, 128 sampled tokens, so many at a time)
to a fresh server of each kind, while a competitor process beside it (standing in for the RL
job's trainer, sandboxes and grading) does fixed units of CPU work. Per server: wall time,
tokens/s, the CPU seconds of the server's processes, and the competitor's units per second
against its rate alone (the CPU the server leaves to the rest of the machine).

    .venv/bin/python bench/vllm_cpu.py [--model DIR] [--requests 128] [--concurrency 16 64] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import httpx
import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from service.fleet.server import VLLMServer  # noqa: E402
from service.fleet.tiny_model import TinyModelSpec, init_tiny  # noqa: E402
from tests.servers import free_port  # noqa: E402

PROMPT = [(i * 7) % 1900 + 20 for i in range(400)]


def _work_unit() -> None:
    x = 0
    for i in range(200_000):
        x += i * i


def competitor(stop, done) -> None:
    """CPU-bound units until stop is set; their count in done."""
    while not stop.is_set():
        _work_unit()
        with done.get_lock():
            done.value += 1


@contextmanager
def competing():
    """A competitor process running for the block; its count of units so far."""
    stop, done = mp.Event(), mp.Value("l", 0)
    rival = mp.Process(target=competitor, args=(stop, done))
    rival.start()
    try:
        yield done
    finally:
        stop.set()
        rival.join()


def competitor_alone(seconds: float = 5.0) -> float:
    with competing() as done:
        time.sleep(seconds)
    return done.value / seconds


def server_cpu(proc: psutil.Process) -> float:
    return sum(sum(q.cpu_times()[:2]) for q in [proc, *proc.children(recursive=True)])


async def serve(url: str, model: str, requests: int, concurrency: int) -> int:
    sem = asyncio.Semaphore(concurrency)

    async def one(client: httpx.AsyncClient) -> int:
        async with sem:
            r = await client.post(f"{url}/v1/completions", timeout=900, json={
                "model": model, "prompt": PROMPT, "max_tokens": 128, "temperature": 0.7, "ignore_eos": True,
                "logprobs": 0, "return_token_ids": True})
            r.raise_for_status()
            return r.json()["usage"]["completion_tokens"]

    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=concurrency + 8)) as client:
        return sum(await asyncio.gather(*[one(client) for _ in range(requests)]))


def measure(kind: str, model: Path, log: Path, requests: int, concurrency: list[int]) -> list[dict]:
    before = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if kind == "uni" else "1"
    server = VLLMServer(model=model, port=free_port(), max_model_len=4096, log_path=log).start()
    rows = []
    try:
        server.wait_ready()
        asyncio.run(serve(server.url, model.name, 8, 8))  # warm
        proc = psutil.Process(server.proc.pid)
        for n in concurrency:
            with competing() as done:
                cpu0, t0 = server_cpu(proc), time.monotonic()
                tokens = asyncio.run(serve(server.url, model.name, requests, n))
                wall, cpu = time.monotonic() - t0, server_cpu(proc) - cpu0
            rows.append({"kind": kind, "concurrency": n, "tokens": tokens, "wall_s": wall, "tok_s": tokens / wall,
                         "cpu_s": cpu, "rival_units_s": done.value / wall})
    finally:
        server.stop()
        if before is None:
            os.environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
        else:
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = before
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=None, help="a model folder (default: a tiny Qwen3 made here, "
                        "the size of swerve demo learn's policy)")
    parser.add_argument("--requests", type=int, default=128)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--logs", type=Path, default=None, help="keep the servers' logs here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or init_tiny(Path(tmp) / "tiny", TinyModelSpec(layers=4, tie_embeddings=True))
        alone = competitor_alone()
        print(f"{psutil.cpu_count()} CPUs; competitor alone: {alone:.1f} units/s; {args.requests} requests of "
              f"128 tokens a row", flush=True)
        rows = []
        for r in range(args.rounds):
            for kind in (("uni", "mp") if r % 2 == 0 else ("mp", "uni")):
                log = (args.logs or Path(tmp)) / f"vllm-{kind}-{r}.log"
                log.parent.mkdir(parents=True, exist_ok=True)
                for row in measure(kind, model, log, args.requests, args.concurrency):
                    rows.append(row | {"round": r})
                    print(f"round {r} {kind:3s} at {row['concurrency']:3d}: {row['tok_s']:6.0f} tok/s, "
                          f"{row['cpu_s']:6.1f} CPU-s ({row['cpu_s'] / row['tokens'] * 1e3:.2f} per 1k tokens), "
                          f"competitor {row['rival_units_s'] / alone:.2f} of alone", flush=True)
    print("\n| executor | in flight | tokens/s (rounds) | median | server CPU-s per 1k tokens, median | "
          "competitor's share of its rate alone, median |")
    print("|---|---|---|---|---|---|")
    for n in args.concurrency:
        for kind in ("uni", "mp"):
            sel = [r for r in rows if r["kind"] == kind and r["concurrency"] == n]
            rates = ", ".join(f"{r['tok_s']:.0f}" for r in sel)
            print(f"| {kind} | {n} | {rates} | "
                  f"{statistics.median(r['tok_s'] for r in sel):.0f} | "
                  f"{statistics.median(r['cpu_s'] / r['tokens'] * 1e3 for r in sel):.2f} | "
                  f"{statistics.median(r['rival_units_s'] / alone for r in sel):.2f} |")


if __name__ == "__main__":
    main()
