"""Buffer throughput for long MoE episodes, side by side in one run: our buffer (a transaction
per turn, as workers write; then claim + load of whole groups), Parquet files (how file-based
RL transports move rollouts) and raw binary COPY into PostgreSQL (the ceiling). Writes and reads
as before (earlier paths, timed after today's in the same run) stand beside them.

Episodes: ~131k tokens over 300 turns, int32 ids, float32 logprobs for sampled tokens, routed
experts of a GLM-5-sized MoE (78 layers, top-8, uint8) for every token.

Every timed write or read starts after a CHECKPOINT: a run writes a few GB of WAL against
max_wal_size's 1 GB, and a checkpoint falling inside one path and not the other moved the
ceiling 1.8x between runs. With --rounds above 1, our buffer and COPY alternate which goes
first, and the ratios are given per round and as their median.

    .venv/bin/python bench/buffer.py [--episodes 4] [--turns 300] [--tokens-per-turn 437] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np
import sqlalchemy as sa

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from service.store import db  # noqa: E402
from service.store.records import TurnRecord  # noqa: E402
from service.store.buffer import Buffer  # noqa: E402
from service.store.tables import Episode, Group, Run, Suite, Task, utcnow  # noqa: E402

ADMIN = os.environ.get("SWERVE_TEST_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/postgres")
LAYERS, TOP_K = 78, 8


def make_turns(turns: int, per_turn: int, seed: int) -> list[TurnRecord]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(turns):
        n_in, n_out = per_turn * 3 // 4, per_turn - per_turn * 3 // 4
        out.append(TurnRecord(
            idx=i, segment=0, input_ids=rng.integers(0, 150_000, n_in, dtype=np.int32),
            output_ids=rng.integers(0, 150_000, n_out, dtype=np.int32),
            output_logprobs=rng.normal(-1, 0.5, n_out).astype(np.float32), policy_version=0,
            finish_reason="stop", text="", tool_call=None, observation=None, generation_s=0.0, tool_s=0.0,
            routed_experts=rng.integers(0, 256, (per_turn, LAYERS, TOP_K), dtype=np.uint8)))
    return out


async def setup(engine, episodes: int) -> list[uuid.UUID]:
    suite_id, run_id = uuid.uuid4(), uuid.uuid4()
    ids = []
    async with engine.begin() as conn:
        await conn.execute(sa.insert(Suite).values(id=suite_id, name=f"bench-{suite_id.hex[:8]}", task_count=episodes, created_at=utcnow()))
        await conn.execute(sa.insert(Run).values(id=run_id, suite_id=suite_id, status="running", config={},
                                                 config_hash="0" * 64, created_at=utcnow()))
        for g in range(episodes):
            task_id, group_id, episode_id = uuid.uuid4(), uuid.uuid4(), uuid.uuid4()
            await conn.execute(sa.insert(Task).values(
                id=task_id, suite_id=suite_id, position=g, instance_id=f"t{g}", repo="o/r", base_commit="a" * 40,
                problem_statement="p", test_patch="", fail_to_pass=["x"], pass_to_pass=[], log_parser="pytest"))
            await conn.execute(sa.insert(Group).values(id=group_id, run_id=run_id, task_id=task_id, seq=g, size=1,
                                                       status="pending", created_at=utcnow()))
            await conn.execute(sa.insert(Episode).values(
                id=episode_id, run_id=run_id, group_id=group_id, task_id=task_id, sample_index=0,
                status="running", policy_version_min=0, created_at=utcnow()))
            ids.append(episode_id)
    return ids


async def _write_all(buffer: Buffer, ids: list[uuid.UUID], episodes: list[list[TurnRecord]]) -> float:
    """Seconds to write every episode's turns, the episodes at the same time (as a worker's are)."""
    start = time.perf_counter()

    async def write(episode_id, turns):
        for turn in turns:
            await buffer.append_turn(episode_id, turn)
        await buffer.finish_episode(episode_id, status="submitted", reward=1.0)

    await asyncio.gather(*(write(e, t) for e, t in zip(ids, episodes)))
    return time.perf_counter() - start


def checkpoint(url: str) -> None:
    """Flush what earlier paths wrote, so that no path pays for another's checkpoint."""
    import psycopg

    with psycopg.connect(db.sync_url(url).replace("postgresql+psycopg", "postgresql"), autocommit=True) as conn:
        conn.execute("CHECKPOINT")


async def ours(url: str, episodes: list[list[TurnRecord]], before: bool = True) -> tuple[float, float]:
    engine = db.make_async_engine(url, pool_size=8)
    try:
        ids = await setup(engine, len(episodes))
        buffer = Buffer(engine)
        checkpoint(url)
        written = await _write_all(buffer, ids, episodes)
        checkpoint(url)
        start = time.perf_counter()
        claim = await buffer.claim(len(ids), trainer_step=0, max_staleness=1)
        groups = await buffer.load(claim)
        read = time.perf_counter() - start
        assert sum(len(e.turns) for g in groups for e in g.episodes) == sum(len(t) for t in episodes)
        if before:
            n_turns = sum(len(t) for t in episodes)
            BEFORE["read"] = await _read_as_before(buffer, claim.group_ids, n_turns, _per_episode)
            BEFORE["copy rows"] = await _read_as_before(buffer, claim.group_ids, n_turns, _copy_rows)
            checkpoint(url)
            BEFORE["write"] = await _write_as_before(engine, buffer, episodes)
        return written, read
    finally:
        await engine.dispose()


def _statements_before() -> tuple[str, str]:
    """A turn's INSERT as it was before 2026-12-04 evening (one statement per turn), fenced and not."""
    from service.store.buffer import _PG_COLUMNS

    names = ", ".join(_PG_COLUMNS)
    values = ", ".join(f"%({c})b::{t}" if t == "bytea" else f"%({c})s::{t}" for c, t in _PG_COLUMNS.items())
    unfenced = f"INSERT INTO turns ({names}) VALUES ({values}) ON CONFLICT (episode_id, idx) DO NOTHING"
    fenced = (f"INSERT INTO turns ({names}) SELECT {values} WHERE EXISTS (SELECT 1 FROM episodes WHERE "
              "id = %(episode_id)s::uuid AND attempt = %(attempt)s::integer AND status = 'running' FOR SHARE) "
              "ON CONFLICT (episode_id, idx) DO NOTHING")
    return fenced, unfenced


_APPEND_BEFORE, _APPEND_UNFENCED_BEFORE = _statements_before()


async def _write_as_before(engine, buffer: Buffer, episodes: list[list[TurnRecord]]) -> float:
    """The same turns written as before 2026-12-04 (a transaction and a round trip per turn,
    no batching across episodes), into episodes of their own, after today's writes and reads."""
    from service.store import buffer as module

    class OneByOne:
        def __init__(self, engine):
            self.engine = engine

        async def append(self, row, attempt):
            from psycopg.types.json import Jsonb

            async with self.engine.begin() as conn:
                raw = (await conn.get_raw_connection()).driver_connection
                params = {**row, "tool_call": None if row["tool_call"] is None else Jsonb(row["tool_call"]),
                          "attempt": attempt}
                statement = _APPEND_BEFORE if attempt is not None else _APPEND_UNFENCED_BEFORE
                async with raw.pipeline(), raw.cursor() as cur:
                    await cur.execute("SET LOCAL synchronous_commit TO OFF")
                    await cur.execute(statement, params, prepare=True)
                    await raw.commit()
                    return cur.rowcount > 0

    ids = await setup(engine, len(episodes))
    today, module._TurnWriter.of = module._TurnWriter.of, classmethod(lambda cls, engine: OneByOne(engine))
    try:
        return await _write_all(buffer, ids, episodes)
    finally:
        module._TurnWriter.of = today


BEFORE: dict[str, float] = {}
KEPT: dict[str, float] = {}


async def _per_episode(conn, episode_ids):
    """Reads as before 2026-12-02: a prepared binary SELECT per episode."""
    from service.store import buffer as module

    raw = (await conn.get_raw_connection()).driver_connection
    columns = ", ".join(c.name for c in module._TURN_COLUMNS) + f", {module._PG_CALLED}"
    out = []
    async with raw.cursor(binary=True) as cur:
        for episode_id in episode_ids:
            await cur.execute(f"SELECT {columns} FROM turns WHERE episode_id = %s ORDER BY idx", (episode_id,),
                              prepare=True)
            out += await cur.fetchall()
    return out


async def _copy_rows(conn, episode_ids):
    """Reads as before 2026-12-04: the same binary COPY, its rows built by psycopg (a bytes
    object per field, a UUID per row)."""
    from service.store import buffer as module

    raw = (await conn.get_raw_connection()).driver_connection
    out = []
    async with raw.cursor() as cur:
        async with cur.copy(module._PG_FETCH, (list(episode_ids),)) as copy:
            copy.set_types(["uuid", "int4", "int4", "bytea", "bytea", "bytea", "bytea", "int4", "int4", "bool"])
            async for row in copy.rows():
                out.append(row)
    return out


async def _read_as_before(buffer: Buffer, group_ids, n_turns: int, fetch) -> float:
    """The same groups loaded with an earlier read path (the figure beside today's, same run)."""
    from service.store import buffer as module

    async def decoded(conn, episode_ids):  # as load_groups decoded them before 2026-12-05
        return [module._turn_of(*row) for row in await fetch(conn, episode_ids)]

    today, module._fetch_turns = module._fetch_turns, decoded
    try:
        start = time.perf_counter()
        groups = await buffer.load_groups(group_ids)
        took = time.perf_counter() - start
    finally:
        module._fetch_turns = today
    assert sum(len(e.turns) for g in groups for e in g.episodes) == n_turns
    return took


def parquet(tmp: Path, episodes: list[list[TurnRecord]]) -> tuple[float, float]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    start = time.perf_counter()
    for i, turns in enumerate(episodes):
        table = pa.table({
            "input_ids": [t.input_ids.tobytes() for t in turns], "output_ids": [t.output_ids.tobytes() for t in turns],
            "logprobs": [t.output_logprobs.tobytes() for t in turns],
            "routed_experts": [t.routed_experts.tobytes() for t in turns]})
        pq.write_table(table, tmp / f"episode-{i}.parquet", compression="none")
    written = time.perf_counter() - start
    start = time.perf_counter()
    for i in range(len(episodes)):
        table = pq.read_table(tmp / f"episode-{i}.parquet")
        experts = [np.frombuffer(b, dtype=np.uint8) for b in table.column("routed_experts").to_pylist()]
        assert len(experts) == len(episodes[i])
    return written, time.perf_counter() - start


def copy_ceiling(url: str, episodes: list[list[TurnRecord]], temp: bool = False) -> tuple[float, float]:
    """Binary COPY of the same bytes into a table and back: a logged table, as the buffer's own
    (every byte also goes to the WAL), or a temporary one (no WAL: the engine's raw speed)."""
    import psycopg

    with psycopg.connect(db.sync_url(url).replace("postgresql+psycopg", "postgresql")) as conn:
        conn.execute(f"CREATE {'TEMP ' if temp else ''}TABLE raw_turns "
                     "(input_ids bytea, output_ids bytea, logprobs bytea, experts bytea)")
        conn.commit()
        checkpoint(url)
        start = time.perf_counter()
        with conn.cursor().copy("COPY raw_turns FROM STDIN (FORMAT BINARY)") as copy:
            copy.set_types(["bytea"] * 4)
            for turns in episodes:
                for t in turns:
                    copy.write_row((t.input_ids.tobytes(), t.output_ids.tobytes(), t.output_logprobs.tobytes(),
                                    t.routed_experts.tobytes()))
        conn.commit()
        written = time.perf_counter() - start
        checkpoint(url)
        start = time.perf_counter()
        rows = 0
        with conn.cursor().copy("COPY raw_turns TO STDOUT (FORMAT BINARY)") as copy:
            copy.set_types(["bytea"] * 4)
            for _ in copy.rows():
                rows += 1
        assert rows == sum(len(t) for t in episodes)
        read = time.perf_counter() - start
        if not temp:  # the same COPY by a reader that keeps what it reads, as a trainer must
            start = time.perf_counter()
            with conn.cursor().copy("COPY raw_turns TO STDOUT (FORMAT BINARY)") as copy:
                copy.set_types(["bytea"] * 4)
                kept = list(copy.rows())
            KEPT.setdefault("read", time.perf_counter() - start)  # the first round's, as the table's rows
            assert len(kept) == rows
            del kept
        conn.execute("DROP TABLE raw_turns")
        conn.commit()
        return written, read


def make_database() -> str:
    url = db.create_database(ADMIN, f"swerve_bench_{uuid.uuid4().hex[:8]}")
    db.upgrade(url)
    return url


def drop_database(url: str) -> None:
    db.drop_database(ADMIN, url)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=4)
    parser.add_argument("--turns", type=int, default=300)
    parser.add_argument("--tokens-per-turn", type=int, default=437)
    parser.add_argument("--rounds", type=int, default=1,
                        help="times our buffer and COPY are timed, alternating which goes first")
    args = parser.parse_args()
    episodes = [make_turns(args.turns, args.tokens_per_turn, seed) for seed in range(args.episodes)]
    tokens = args.episodes * args.turns * args.tokens_per_turn
    mb = sum(t.routed_experts.nbytes + t.input_ids.nbytes + t.output_ids.nbytes + t.output_logprobs.nbytes
             for turns in episodes for t in turns) / 1e6
    url = make_database()
    rounds = []
    try:
        for r in range(args.rounds):
            timed = {}
            for name in (("swerve buffer", "COPY (ceiling)") if r % 2 == 0 else ("COPY (ceiling)", "swerve buffer")):
                timed[name] = (await ours(url, episodes, before=r == 0) if name == "swerve buffer"
                               else copy_ceiling(url, episodes))
            rounds.append(timed)
        rows = dict(rounds[0])
        rows["COPY temp table"] = copy_ceiling(url, episodes, temp=True)
        with tempfile.TemporaryDirectory() as tmp:
            rows["Parquet files"] = parquet(Path(tmp), episodes)
    finally:
        drop_database(url)
    print(f"{args.episodes} episodes x {args.turns} turns = {tokens} tokens, {mb:.0f} MB "
          f"(routed experts {LAYERS} layers x top-{TOP_K} uint8)")
    print(f"{'path':15} {'in tok/s':>10} {'out tok/s':>10} {'in MB/s':>8} {'out MB/s':>9}")
    for name, (w, r) in rows.items():
        print(f"{name:15} {tokens / w:10.0f} {tokens / r:10.0f} {mb / w:8.0f} {mb / r:9.0f}")
    ours_w, ours_r = rows["swerve buffer"]
    copy_w, copy_r = rows["COPY (ceiling)"]
    print(f"swerve vs COPY: in {copy_w / ours_w:.2f}x, out {copy_r / ours_r:.2f}x of the ceiling")
    print(f"COPY out, its rows kept in memory (as a reader must): {tokens / KEPT['read']:.0f} tok/s; "
          f"swerve out {KEPT['read'] / ours_r:.2f}x of it")
    print(f"writes as before (a transaction per turn): {tokens / BEFORE['write']:.0f} tok/s, "
          f"{copy_w / BEFORE['write']:.2f}x of the ceiling")
    print(f"reads as before (a SELECT per episode): {tokens / BEFORE['read']:.0f} tok/s, "
          f"{copy_r / BEFORE['read']:.2f}x of the ceiling")
    print(f"reads as before (psycopg's rows of the COPY): {tokens / BEFORE['copy rows']:.0f} tok/s, "
          f"{copy_r / BEFORE['copy rows']:.2f}x of the ceiling")
    if len(rounds) > 1:
        print("round  first           swerve in  COPY in  swerve out  COPY out  in ratio  out ratio")
        ratios = []
        for i, t in enumerate(rounds):
            (sw, sr), (cw, cr) = t["swerve buffer"], t["COPY (ceiling)"]
            ratios.append((cw / sw, cr / sr))
            print(f"{i:5}  {next(iter(t)):15} {tokens / sw:9.0f} {tokens / cw:8.0f} {tokens / sr:11.0f} "
                  f"{tokens / cr:9.0f} {cw / sw:9.2f} {cr / sr:10.2f}")
        print(f"median over {len(rounds)} rounds: in {np.median([a for a, _ in ratios]):.2f}x, "
              f"out {np.median([b for _, b in ratios]):.2f}x of the ceiling")


if __name__ == "__main__":
    asyncio.run(main())
