"""The worker's database work alone, its CPU per phase: N episodes started (read with their run
and task, then claimed), T turns appended each with a random gap between an episode's turns (the
episodes at once, as a worker's are, so the turn writer batches what arrives together), then
ended; this process's CPU (time.process_time) per start, per turn and per end, on uvloop as the
worker runs them. The gaps' own cost (their timers and wake-ups) is in the turn figure: with
--no-append the same run without the appends gives it.

    .venv/bin/python bench/episode_db.py [--episodes 128] [--turns 11] [--gap 0.3] [--no-append]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import numpy as np  # noqa: E402
import sqlalchemy as sa  # noqa: E402
import uvloop  # noqa: E402

from buffer import drop_database, make_database, setup  # noqa: E402
from service.store import db  # noqa: E402
from service.store.buffer import Buffer  # noqa: E402
from service.store.records import TurnRecord  # noqa: E402


def turns(seed: int, n: int) -> list[TurnRecord]:
    """Turns of an 11-turn episode's size: a growing observation's tokens in, 60 sampled out."""
    rng = np.random.default_rng(seed)
    return [TurnRecord(idx=i, segment=0, input_ids=rng.integers(0, 150_000, 300 + 60 * i, dtype=np.int32).tolist(),
                       output_ids=rng.integers(0, 150_000, 60, dtype=np.int32).tolist(),
                       output_logprobs=rng.normal(-1, 0.5, 60).astype(np.float32).tolist(), policy_version=0,
                       finish_reason="stop", text="x" * 200, tool_call={"name": "bash", "arguments": {"command": "ls"}},
                       observation="y" * 700, generation_s=1.0, tool_s=0.01, routed_experts=None) for i in range(n)]


async def phase(name: str, work: list, n: int) -> list:
    c0, w0 = time.process_time(), time.perf_counter()
    out = await asyncio.gather(*work)
    c1, w1 = time.process_time(), time.perf_counter()
    print(f"  {name:6s} {1e3 * (c1 - c0) / n:.3f} ms of CPU each ({n}), {w1 - w0:.1f} s")
    return out


async def main(args) -> None:
    url = make_database()
    engine = db.make_async_engine(url, pool_size=8)
    try:
        ids = await setup(engine, args.episodes + 1)
        async with engine.begin() as conn:
            await conn.execute(sa.text("UPDATE episodes SET status = 'pending'"))
        data = [turns(seed, args.turns) for seed in range(args.episodes + 1)]
        buffer, gap = Buffer(engine), args.gap

        async def start(k: int, episode):
            await asyncio.sleep(k * gap / args.episodes)
            row = (await buffer.episode_to_start(episode))[0]
            return await buffer.claim_attempt(episode, seen_status=row.status, seen_attempt=row.attempt)

        async def write(attempt, episode, its_turns, append: bool = True):
            for turn in its_turns:
                await asyncio.sleep(gap * random.random() * 2)
                if append:
                    await buffer.append_turn(episode, turn, attempt=attempt)

        async def end(k: int, attempt, episode):
            await asyncio.sleep(k * gap / args.episodes)
            assert await buffer.finish_episode(episode, attempt=attempt, status="submitted", n_turns=args.turns)

        first = await start(0, ids[-1])  # the links' connections open, their statements are compiled
        await write(first, ids[-1], data[-1])
        await end(0, first, ids[-1])
        print(f"{args.episodes} episodes x {args.turns} turns, {gap} s between an episode's turns on average"
              + (", no appends" if args.no_append else ""))
        attempts = await phase("start", [start(k, e) for k, e in enumerate(ids[:-1])], args.episodes)
        await phase("turn", [write(a, e, d, not args.no_append) for a, e, d in zip(attempts, ids, data)],
                    args.episodes * args.turns)
        if not args.no_append:
            await phase("end", [end(k, a, e) for k, (a, e) in enumerate(zip(attempts, ids))], args.episodes)
    finally:
        await engine.dispose()
        drop_database(url)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=128)
    parser.add_argument("--turns", type=int, default=11)
    parser.add_argument("--gap", type=float, default=0.3)
    parser.add_argument("--no-append", action="store_true")
    uvloop.run(main(parser.parse_args()))
