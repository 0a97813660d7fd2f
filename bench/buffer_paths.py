"""Where the buffer's writes lose to COPY: the same turn bytes (bench/buffer.py's 4 episodes x 300 turns)
written into a bare table of uuid, int and four bytea columns by binary COPY and by INSERTs executemany'd
in a pipeline, four rows at a time, each with and without a unique index on (episode, idx) and ON CONFLICT;
a CHECKPOINT before each, two rounds. Sync psycopg, one connection, one transaction per path; then
the same batches on an async psycopg connection (as the buffer's writer sends them).

    .venv/bin/python bench/buffer_paths.py
"""

from __future__ import annotations

import asyncio
import time
import uuid
from pathlib import Path
import sys

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import psycopg  # noqa: E402

import buffer as bb  # noqa: E402


def main() -> None:
    episodes = [bb.make_turns(300, 437, s) for s in range(4)]
    url = bb.make_database()
    conninfo = bb.db.sync_url(url).replace("postgresql+psycopg", "postgresql")
    rows = [(uuid.uuid4(), i, t.input_ids.tobytes(), t.output_ids.tobytes(), t.output_logprobs.tobytes(),
             t.routed_experts.tobytes()) for e in episodes for i, t in enumerate(e)]
    tokens = sum(len(t.input_ids) + len(t.output_ids) for e in episodes for t in e)

    def run(name, ddl, write):
        with psycopg.connect(conninfo) as conn:
            conn.execute("DROP TABLE IF EXISTS p; " + ddl)
            conn.commit()
            bb.checkpoint(url)
            start = time.perf_counter()
            write(conn)
            conn.commit()
            took = time.perf_counter() - start
        print(f"{name:48} {tokens / took:10.0f} tok/s")

    plain = "CREATE TABLE p (e uuid, idx int, a bytea, b bytea, c bytea, d bytea)"
    indexed = plain + "; CREATE UNIQUE INDEX ON p (e, idx)"

    def copy(conn):
        with conn.cursor().copy("COPY p FROM STDIN (FORMAT BINARY)") as cp:
            cp.set_types(["uuid", "int4", "bytea", "bytea", "bytea", "bytea"])
            for r in rows:
                cp.write_row(r)

    def insert(conn, extra=""):
        with conn.pipeline(), conn.cursor() as cur:
            for k in range(0, len(rows), 4):
                cur.executemany("INSERT INTO p VALUES (%s, %s, %s, %s, %s, %s)" + extra, rows[k:k + 4])

    async def insert_async(ddl):
        async with await psycopg.AsyncConnection.connect(conninfo) as conn:
            await conn.execute("DROP TABLE IF EXISTS p; " + ddl)
            await conn.commit()
            bb.checkpoint(url)
            start = time.perf_counter()
            async with conn.pipeline(), conn.cursor() as cur:
                for k in range(0, len(rows), 4):
                    await cur.executemany("INSERT INTO p VALUES (%s, %s, %s, %s, %s, %s)", rows[k:k + 4])
            await conn.commit()
            return time.perf_counter() - start

    try:
        for _ in range(2):
            print(f"{'INSERT, batches of 4, async connection':48} {tokens / asyncio.run(insert_async(plain)):10.0f} tok/s")
            run("COPY", plain, copy)
            run("COPY, unique index", indexed, copy)
            run("INSERT, batches of 4", plain, insert)
            run("INSERT, batches of 4, unique index, ON CONFLICT", indexed,
                lambda c: insert(c, " ON CONFLICT (e, idx) DO NOTHING"))
    finally:
        bb.drop_database(url)


if __name__ == "__main__":
    main()
