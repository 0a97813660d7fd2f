"""UI first-render times in headless Chromium against a running service: the episode viewer
of a 500-turn, 131k-token episode, and the runs page with 1,000 runs in the database.
Targets: under 1 s each.

    .venv/bin/python bench/ui.py
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import sqlalchemy as sa  # noqa: E402

from service.store import db  # noqa: E402
from service.store.records import TurnRecord  # noqa: E402
from service.store.buffer import Buffer  # noqa: E402
from service.config import load_settings  # noqa: E402
from service.store.tables import Episode, Group, Run, Suite, Task, utcnow  # noqa: E402


async def populate(url: str, runs: int, turns: int, tokens: int) -> uuid.UUID:
    engine = db.make_async_engine(url)
    suite_id, task_id = uuid.uuid4(), uuid.uuid4()
    async with engine.begin() as conn:
        await conn.execute(sa.insert(Suite).values(id=suite_id, name="bench", task_count=1, created_at=utcnow()))
        await conn.execute(sa.insert(Task).values(id=task_id, suite_id=suite_id, position=0, instance_id="bench__1",
                                                  repo="o/r", base_commit="0" * 40, problem_statement="p",
                                                  test_patch="", fail_to_pass=[], pass_to_pass=[], log_parser="pytest"))
        run_rows, group_rows, episode_rows = [], [], []
        for i in range(runs):
            rid, gid = uuid.uuid4(), uuid.uuid4()
            run_rows.append({"id": rid, "suite_id": suite_id, "name": f"run {i}", "status": "finished", "config": {},
                             "config_hash": "0" * 64, "created_at": utcnow()})
            group_rows.append({"id": gid, "run_id": rid, "task_id": task_id, "seq": 0, "size": 4, "status": "ready",
                               "created_at": utcnow()})
            episode_rows += [{"id": uuid.uuid4(), "run_id": rid, "group_id": gid, "task_id": task_id, "sample_index": k,
                              "status": "submitted", "reward": float(k % 2), "n_turns": 10, "input_tokens": 9000,
                              "output_tokens": 1000, "started_at": utcnow(), "finished_at": utcnow(),
                              "created_at": utcnow()} for k in range(4)]
        await conn.execute(sa.insert(Run), run_rows)
        await conn.execute(sa.insert(Group), group_rows)
        await conn.execute(sa.insert(Episode), episode_rows)
        long_id = episode_rows[0]["id"]
        await conn.execute(sa.update(Episode).where(Episode.id == long_id).values(status="running", n_turns=turns))
    buffer = Buffer(engine)
    per_turn = tokens // turns
    for idx in range(turns):
        await buffer.append_turn(long_id, TurnRecord(
            idx=idx, segment=0, input_ids=list(range(per_turn - 60)), output_ids=list(range(60)),
            output_logprobs=[-0.5] * 60, policy_version=0, policy_version_end=0, finish_reason="stop",
            text=f"I will look at the file now ({idx}). " * 4,
            tool_call={"name": "bash", "arguments": {"command": f"sed -n {idx},{idx + 40}p src/module.py"}},
            observation="\n".join(f"{n:5d}  def function_{n}(x): return x * {n}" for n in range(40)),
            generation_s=1.5, tool_s=0.05))
    await buffer.finish_episode(long_id, status="submitted", reward=1.0, n_turns=turns,
                                diff="diff --git a/x b/x\n--- a/x\n+++ b/x\n@@ -1 +1 @@\n-a\n+b\n")
    await engine.dispose()
    return long_id


def main() -> None:
    import shutil

    from playwright.sync_api import sync_playwright

    from service.app import create_app
    from tests.servers import ThreadServer

    tmp = Path(tempfile.mkdtemp())
    url = f"sqlite:///{tmp / 'ui.db'}"
    db.upgrade(url)
    started = time.perf_counter()
    episode = asyncio.run(populate(url, runs=1000, turns=500, tokens=131_072))
    print(f"database: 1000 runs, 4000 episodes, one of 500 turns / 131k tokens ({time.perf_counter() - started:.1f} s)")
    settings = load_settings(database_url=url, broker_url="memory://", embedded_worker=False, data_dir=tmp)
    chromium = shutil.which("chromium") or "/usr/bin/chromium"
    with ThreadServer(create_app(settings)) as server, sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=["--headless", "--no-sandbox", "--disable-gpu"])
        results = {}
        for name, path in (("episode viewer (500 turns, 131k tokens)", f"/episodes/{episode}"),
                           ("runs page (1,000 runs)", "/?limit=1000")):
            times = []
            for _ in range(5):
                page = browser.new_page()
                t0 = time.perf_counter()
                page.goto(server.url + path)
                page.wait_for_selector("body[data-ready=yes]")
                times.append(time.perf_counter() - t0)
                fcp = page.evaluate("performance.getEntriesByName('first-contentful-paint')[0]?.startTime")
                page.close()
            results[name] = (statistics.median(times), fcp)
        browser.close()
    print("| page | median time to interactive (s) | first contentful paint (ms) | target |")
    print("|---|---|---|---|")
    for name, (t, fcp) in results.items():
        print(f"| {name} | {t:.3f} | {fcp:.0f} | < 1 s |")


if __name__ == "__main__":
    main()
