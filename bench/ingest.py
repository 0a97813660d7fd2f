"""Suite ingest over HTTP into PostgreSQL: tasks/s and the server's peak memory per suite size.

Each upload goes to a fresh `swerve serve` process (so its peak RSS belongs to that upload),
streamed from a generated SWE-bench-shaped file with realistic patch sizes.

    .venv/bin/python bench/ingest.py [--sizes 1000 5000 10000] [--formats jsonl json]
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


def start_server(db_url: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = os.environ | {"SWERVE_DATABASE_URL": db_url, "SWERVE_API_TOKEN": TOKEN,
                        "SWERVE_MAX_UPLOAD_BYTES": str(4 << 30)}
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1000, 5000, 10000])
    parser.add_argument("--formats", nargs="+", default=["jsonl", "json"], choices=["jsonl", "json"])
    parser.add_argument("--cache", type=Path, default=ROOT / "var" / "bench")
    args = parser.parse_args()

    url = make_database()
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
