"""`swerve export`'s memory and speed, side by side in one run with the usual way to write a
dataset: every row in memory, then `datasets.Dataset.from_list(rows).to_parquet(...)`. Both read
the same SQLite run (N episodes of T turns, ~`--tokens` tokens an episode); each export runs in
its own process, whose peak RSS it reports. Flat memory means the peak does not grow with N.

    .venv/bin/python bench/export.py [--episodes 64 256] [--turns 16] [--tokens 32768]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


async def make_db(url: str, episodes: int, turns: int, tokens: int) -> uuid.UUID:
    import numpy as np
    import sqlalchemy as sa

    from service.control.runs import create_run
    from service.store import db
    from service.store.buffer import Buffer
    from service.store.records import TurnRecord
    from service.store.tables import Episode, Suite, Task, utcnow
    from service.worker.config import RunConfig

    db.upgrade(url)
    engine = db.make_async_engine(url)
    suite_id = uuid.uuid4()
    async with engine.begin() as conn:
        await conn.execute(sa.insert(Suite).values(id=suite_id, name="bench-export", task_count=episodes,
                                                   created_at=utcnow()))
        await conn.execute(sa.insert(Task), [{
            "id": uuid.uuid4(), "suite_id": suite_id, "position": i, "instance_id": f"org__r-{i}", "repo": "org/r",
            "base_commit": "c" * 40, "problem_statement": "fix it " * 50, "patch": "", "test_patch": "",
            "fail_to_pass": [], "pass_to_pass": [], "log_parser": "pytest"} for i in range(episodes)])
    run_id = await create_run(engine, RunConfig.model_validate({
        "suite_id": suite_id, "samples_per_task": 1,
        "sampler": {"type": "vllm", "endpoints": ["http://127.0.0.1:9"], "tokenizer": "/nonexistent"}}))
    buffer, rng = Buffer(engine), np.random.default_rng(0)
    per_turn = tokens // turns
    async with engine.connect() as conn:
        ids = (await conn.execute(sa.select(Episode.id).where(Episode.run_id == run_id))).scalars().all()
    for episode_id in ids:
        for i in range(turns):
            n_in, n_out = per_turn * 3 // 4, per_turn // 4
            await buffer.append_turn(episode_id, TurnRecord(
                idx=i, segment=0, input_ids=rng.integers(0, 150000, n_in).tolist(),
                output_ids=rng.integers(0, 150000, n_out).tolist(), output_logprobs=(-rng.random(n_out)).tolist(),
                policy_version=0, policy_version_end=0, finish_reason="stop", text="x" * (n_out * 4),
                tool_call={"name": "bash", "arguments": {"command": "ls"}}, observation="y" * (n_in * 4),
                generation_s=0.1, tool_s=0.1))
        await buffer.finish_episode(episode_id, status="submitted", reward=1.0, n_turns=turns,
                                    input_tokens=turns * per_turn * 3 // 4, output_tokens=turns * per_turn // 4,
                                    policy_version_min=0, policy_version_max=0, diff="d", report={"resolution": "FULL"})
    await engine.dispose()
    return run_id


def child(way: str, url: str, run_id: str, out: str) -> None:
    from service.control import export
    from service.control.redaction import Answers
    from service.store import db

    async def ours() -> None:
        engine = db.make_async_engine(url)
        with open(out, "wb") as f:
            async for chunk in export.stream(engine, uuid.UUID(run_id), "parquet", Answers(shown=True)):
                f.write(chunk)
        await engine.dispose()

    async def all_in_memory() -> None:
        import datasets

        engine = db.make_async_engine(url)
        rows = [r async for page in export.rows(engine, uuid.UUID(run_id), Answers(shown=True)) for r in page]
        await engine.dispose()
        datasets.Dataset.from_list(rows).to_parquet(out)

    started = time.perf_counter()
    asyncio.run(ours() if way == "swerve" else all_in_memory())
    wall = time.perf_counter() - started
    print(json.dumps({"wall_s": wall, "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--episodes", type=int, nargs="+", default=[64, 256])
    p.add_argument("--turns", type=int, default=16)
    p.add_argument("--tokens", type=int, default=32768)
    p.add_argument("--child", nargs=4)
    a = p.parse_args()
    if a.child:
        return child(*a.child)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in a.episodes:
            url = f"sqlite:///{tmp}/run-{n}.db"
            run_id = asyncio.run(make_db(url, n, a.turns, a.tokens))
            for way in ("swerve", "in-memory + datasets"):
                out = f"{tmp}/out-{n}.parquet"
                done = subprocess.run([sys.executable, __file__, "--child", way.split()[0], url, str(run_id), out],
                                      capture_output=True, text=True, check=True)
                r = json.loads(done.stdout.strip().splitlines()[-1])
                rows.append({"episodes": n, "way": way, **r, "file_mb": Path(out).stat().st_size / 2**20})
                print(rows[-1], flush=True)
    print("\n| episodes | tokens | export | wall | peak RSS | file |\n|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['episodes']} | {r['episodes'] * a.tokens / 1e6:.1f}M | {r['way']} | {r['wall_s']:.1f} s "
              f"| {r['peak_rss_mb']:.0f} MB | {r['file_mb']:.0f} MB |")


if __name__ == "__main__":
    main()
