"""Suite ingest over HTTP into PostgreSQL: tasks/s and the server's peak memory per suite size.

Each upload goes to a fresh `swerve serve` process (so its peak RSS belongs to that upload),
streamed from a generated SWE-bench-shaped file with realistic patch sizes.

    .venv/bin/python bench/ingest.py [--sizes 1000 5000 10000] [--formats jsonl json]
    .venv/bin/python bench/ingest.py --line-mb 1 8 64

`--line-mb`: one task whose problem statement is that many MB, for each format: the parser
alone (this tree's, and the one before the fix that joined a line's pieces chunk by chunk, in
64 KiB chunks as uvicorn delivers them), then the upload over HTTP with /health polled beside it
(the longest /health answer shows whether the upload starves the event loop).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from envs.synthetic import synthetic_suite  # noqa: E402
from service.store import db  # noqa: E402

TOKEN = "bench-token-0123456789abcdef"
ADMIN_URL = os.environ.get("SWERVE_TEST_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/postgres")


def write_suite(path: Path, n: int, fmt: str) -> None:
    if path.exists():
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        if fmt == "jsonl":
            for task in synthetic_suite(n):
                f.write(json.dumps(task) + "\n")
        else:
            f.write("[\n")
            for i, task in enumerate(synthetic_suite(n)):
                f.write(("," if i else "") + json.dumps(task) + "\n")
            f.write("]\n")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def peak_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM")


def start_server(db_url: str, extra_env: dict | None = None) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = os.environ | {"SWERVE_DATABASE_URL": db_url, "SWERVE_API_TOKEN": TOKEN,
                        "SWERVE_MAX_UPLOAD_BYTES": str(4 << 30)} | (extra_env or {})
    proc = subprocess.Popen([sys.executable, "-m", "service.cli", "serve", "--port", str(port)],
                            env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    for _ in range(150):
        try:
            httpx.get(f"{base}/api/v1/health", timeout=1).raise_for_status()
            return proc, base
        except httpx.TransportError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError("server did not start")


def upload(base: str, path: Path, fmt: str) -> tuple[float, dict]:
    ctype = "application/x-ndjson" if fmt == "jsonl" else "application/json"

    def chunks():
        with path.open("rb") as f:
            while chunk := f.read(1 << 20):
                yield chunk

    start = time.perf_counter()
    r = httpx.post(f"{base}/api/v1/suites", params={"name": f"{path.stem}-{uuid.uuid4().hex[:6]}"},
                   content=chunks(), timeout=600,
                   headers={"Content-Type": ctype, "Authorization": f"Bearer {TOKEN}"})
    elapsed = time.perf_counter() - start
    r.raise_for_status()
    return elapsed, r.json()


def make_database() -> str:
    url = db.create_database(ADMIN_URL, f"swerve_bench_{uuid.uuid4().hex[:8]}")
    db.upgrade(url)
    return url


def drop_database(url: str) -> None:
    db.drop_database(ADMIN_URL, url)


def long_task(mb: int) -> dict:
    return {"instance_id": "o__r-1", "repo": "o/r", "base_commit": "a" * 40, "problem_statement": "x" * (mb << 20),
            "test_patch": "", "FAIL_TO_PASS": ["t::a"], "PASS_TO_PASS": []}


async def _chunks(data: bytes, size: int = 1 << 16):
    for i in range(0, len(data), size):
        yield data[i:i + size]


async def _before_parse_jsonl(chunks):
    """parse_jsonl before the fix (commit 3289124): a line's pieces joined at every chunk."""
    import orjson

    pending = b""
    async for chunk in chunks:
        lines = (pending + chunk).split(b"\n")
        pending = lines.pop()
        for raw in lines:
            if raw.strip():
                yield orjson.loads(raw)
    if pending.strip():
        yield orjson.loads(pending)


async def _before_parse_json_array(chunks):
    """parse_json_array before the fix: ijson fed the 64 KiB chunks as they came."""
    import ijson

    class Reader:
        def __init__(self):
            self.it = aiter(chunks)

        async def read(self, n=-1):
            if n == 0:
                return b""
            try:
                return await anext(self.it)
            except StopAsyncIteration:
                return b""

    async for obj in ijson.items(Reader(), "item", use_float=True):
        yield obj


def parse_seconds(parser, data: bytes) -> float:
    import asyncio

    async def run():
        start = time.perf_counter()
        async for _ in parser(_chunks(data)):
            pass
        return time.perf_counter() - start

    return asyncio.run(run())


def long_lines(sizes: list[int], url: str) -> None:
    import threading

    from service.control.suites import parse_json_array, parse_jsonl

    print(f"{'format':7} {'MB':>4} {'parse s':>8} {'before s':>9} {'ratio':>6} {'upload s':>9} {'max /health s':>14}")
    for fmt in ("jsonl", "json"):
        for mb in sizes:
            line = json.dumps(long_task(mb)).encode()
            data = line + b"\n" if fmt == "jsonl" else b"[" + line + b"]"
            ours = parse_seconds(parse_jsonl if fmt == "jsonl" else parse_json_array, data)
            before = parse_seconds(_before_parse_jsonl if fmt == "jsonl" else _before_parse_json_array, data)
            proc, base = start_server(url, {"SWERVE_MAX_RECORD_BYTES": str(1 << 30)})
            worst, done = 0.0, threading.Event()

            def poll():
                nonlocal worst
                while not done.is_set():
                    t = time.perf_counter()
                    httpx.get(f"{base}/api/v1/health", timeout=120)
                    worst = max(worst, time.perf_counter() - t)
                    time.sleep(0.05)

            poller = threading.Thread(target=poll)
            poller.start()
            start = time.perf_counter()
            r = httpx.post(f"{base}/api/v1/suites", params={"name": f"long-{fmt}-{mb}-{uuid.uuid4().hex[:6]}"},
                           content=_sync_chunks(data), timeout=600,
                           headers={"Content-Type": "application/x-ndjson" if fmt == "jsonl" else "application/json",
                                    "Authorization": f"Bearer {TOKEN}"})
            upload_s = time.perf_counter() - start
            done.set()
            poller.join()
            proc.terminate()
            proc.wait(timeout=30)
            r.raise_for_status()
            print(f"{fmt:7} {mb:4d} {ours:8.2f} {before:9.2f} {before / ours:6.0f} {upload_s:9.2f} {worst:14.2f}")


def _sync_chunks(data: bytes, size: int = 1 << 20):
    for i in range(0, len(data), size):
        yield data[i:i + size]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1000, 5000, 10000])
    parser.add_argument("--formats", nargs="+", default=["jsonl", "json"], choices=["jsonl", "json"])
    parser.add_argument("--cache", type=Path, default=ROOT / "var" / "bench")
    parser.add_argument("--line-mb", type=int, nargs="+", help="time single records of these sizes instead")
    args = parser.parse_args()

    url = make_database()
    if args.line_mb:
        try:
            long_lines(args.line_mb, url)
        finally:
            drop_database(url)
        return
    rows = []
    try:
        for fmt in args.formats:
            for n in args.sizes:
                path = args.cache / f"suite-{n}.{fmt}"
                write_suite(path, n, fmt)
                proc, base = start_server(url)
                idle = peak_rss_mb(proc.pid)
                elapsed, result = upload(base, path, fmt)
                peak = peak_rss_mb(proc.pid)
                proc.terminate()
                proc.wait(timeout=30)
                assert result["task_count"] == n, result
                size_mb = path.stat().st_size / 1e6
                rows.append((fmt, n, size_mb, elapsed, n / elapsed, size_mb / elapsed, idle, peak))
    finally:
        drop_database(url)

    print(f"{'format':7} {'tasks':>6} {'MB':>7} {'s':>6} {'tasks/s':>8} {'MB/s':>6} "
          f"{'idle RSS':>9} {'peak RSS':>9} {'growth':>7}")
    for fmt, n, mb, s, tps, mbps, idle, peak in rows:
        print(f"{fmt:7} {n:6d} {mb:7.1f} {s:6.2f} {tps:8.0f} {mbps:6.1f} "
              f"{idle:8.0f}M {peak:8.0f}M {peak - idle:6.0f}M")


if __name__ == "__main__":
    main()
