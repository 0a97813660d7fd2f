"""Faults during a run, on real services started for the test (their own Redis server and
PostgreSQL cluster, so restarting them disturbs nothing else): Redis restarts, PostgreSQL
restarts, the orchestrator's process is killed. After each, every episode ends final, no turn
is lost or duplicated, no sandbox is left, and the API's counts match the database."""

from __future__ import annotations

import asyncio
import glob
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest
import sqlalchemy as sa

from service.store import db
from service.fleet.tiny_model import init_tiny
from tests.conftest import clean_env, TOKEN, auth, client_for, make_settings, missing_service
from tests.sandbox_fixtures import require_bwrap
from tests.servers import free_port
from tests.test_rollout_e2e import SUITE, wait_for_run
from tests.test_sandboxes import host_processes_with

pytestmark = pytest.mark.slow
MARK = "sleep 1.$((2+5))"  # runs as `sleep 1.7`: a marker to find sandbox processes by
CALLS = [{"name": "bash", "arguments": {"command": f"{MARK}; echo step"}}] * 3


class RedisServer:
    def __init__(self, root: Path):
        if shutil.which("redis-server") is None:
            missing_service("redis-server (apt-get install redis-server)")
        self.port, self.root, self.proc = free_port(), root, None
        self.url = f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.proc = subprocess.Popen(["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                                      "--appendonly", "no", "--dir", str(self.root)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for _ in range(100):
            if subprocess.run(["redis-cli", "-p", str(self.port), "ping"], capture_output=True).stdout.strip() == b"PONG":
                return
            time.sleep(0.05)
        raise RuntimeError("redis-server did not start")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


class PostgresCluster:
    """A throwaway PostgreSQL cluster owned by the postgres user, on its own port."""

    def __init__(self):
        bins = sorted(glob.glob("/usr/lib/postgresql/*/bin/pg_ctl"))
        if not bins or shutil.which("runuser") is None or os.geteuid() != 0:
            missing_service("PostgreSQL server binaries (pg_ctl) run as the postgres user")
        self.bin = Path(bins[-1]).parent
        self.root = Path(tempfile.mkdtemp(prefix="swerve-pg-"))
        self.port = free_port()
        self.url = f"postgresql://postgres@127.0.0.1:{self.port}/postgres"
        shutil.chown(self.root, "postgres")
        self._as_postgres(str(self.bin / "initdb"), "-D", str(self.root / "data"), "-A", "trust", "-U", "postgres")

    def _as_postgres(self, *cmd: str) -> None:
        subprocess.run(["runuser", "-u", "postgres", "--", *cmd], check=True, capture_output=True, timeout=120)

    def _ctl(self, action: str, *extra: str) -> None:
        self._as_postgres(str(self.bin / "pg_ctl"), action, "-D", str(self.root / "data"), "-w", "-t", "60",
                          "-l", str(self.root / "log"), *extra,
                          "-o", f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1")

    def start(self) -> None:
        self._ctl("start")

    def restart(self, down_s: float) -> None:
        self._as_postgres(str(self.bin / "pg_ctl"), "stop", "-D", str(self.root / "data"), "-m", "fast", "-w")
        time.sleep(down_s)
        self.start()

    def stop(self) -> None:
        subprocess.run(["runuser", "-u", "postgres", "--", str(self.bin / "pg_ctl"), "stop", "-D",
                        str(self.root / "data"), "-m", "immediate"], capture_output=True)
        shutil.rmtree(self.root, ignore_errors=True)


def start_worker(env: dict, log: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "service.cli", "worker", "--concurrency", "8"], env=env,
                            stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True)


def stop(proc: subprocess.Popen | None) -> None:
    if proc is not None and proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def service_env(db_url: str, broker_url: str, data_dir: Path) -> dict:
    require_bwrap()
    return clean_env() | {
        "SWERVE_DATABASE_URL": db_url, "SWERVE_BROKER_URL": broker_url, "SWERVE_DATA_DIR": str(data_dir),
        "SWERVE_SANDBOX_DIR": str(data_dir / "sandboxes"), "SWERVE_API_TOKEN": TOKEN,
        "SWERVE_ORCHESTRATOR_LEASE_S": "3"}


def run_body(suite_id: str, tokenizer: Path) -> dict:
    return {"suite_id": suite_id, "samples_per_task": 2, "concurrency": 2, "worker_timeout_s": 10,
            "queue_timeout_s": 5, "sampler": {"type": "replay", "tokenizer": str(tokenizer), "calls": CALLS}}


async def wait_for_marker(n: int = 1, timeout_s: float = 120) -> None:
    for _ in range(int(timeout_s * 4)):
        if len(host_processes_with("sleep 1.7")) >= n:
            return
        await asyncio.sleep(0.25)
    raise AssertionError("no episode reached its sandbox command")


async def assert_consistent(client, db_url: str, run_id: str, data_dir: Path, state: dict) -> None:
    """Every episode final with its 4 turns stored once each (0..3), groups ready, nothing left."""
    from service.store.tables import Episode, Group, Turn

    assert state["status"] == "finished", state
    assert state["episodes"] == {"submitted": 4}, state
    engine = db.make_engine(db_url)
    try:
        with engine.connect() as conn:
            episodes = conn.execute(sa.select(Episode.id, Episode.status, Episode.n_turns, Episode.reward)
                                    .where(Episode.run_id == run_id)).all()
            turns = conn.execute(sa.select(Turn.episode_id, Turn.idx)).all()
            groups = conn.execute(sa.select(Group.status).where(Group.run_id == run_id)).scalars().all()
    finally:
        engine.dispose()
    assert len(episodes) == 4 and all(e.status == "submitted" and e.n_turns == 4 for e in episodes), episodes
    by_episode = {}
    for episode_id, idx in turns:
        by_episode.setdefault(episode_id, []).append(idx)
    assert {e.id: sorted(by_episode.get(e.id, [])) for e in episodes} == {e.id: [0, 1, 2, 3] for e in episodes}
    assert groups == ["ready", "ready"]
    listed = (await client.get(f"/api/v1/runs/{run_id}/episodes")).json()
    assert listed["total"] == 4 and sorted(e["n_turns"] for e in listed["items"]) == [4] * 4
    assert host_processes_with("sleep 1.7") == []
    leftovers = [p.name for p in (data_dir / "sandboxes").iterdir() if p.name.startswith("swb-")] \
        if (data_dir / "sandboxes").exists() else []
    assert leftovers == []


async def upload(client) -> str:
    body = "\n".join(SUITE.read_text().splitlines()[:2]) + "\n"
    return (await client.post("/api/v1/suites", params={"name": "ex"}, content=body,
                              headers={"Content-Type": "application/x-ndjson", **auth()})).json()["id"]


@pytest.fixture
def redis_server(tmp_path):
    server = RedisServer(tmp_path)
    server.start()
    yield server
    server.stop()


@pytest.fixture
def pg_cluster():
    cluster = PostgresCluster()
    cluster.start()
    db.upgrade(cluster.url)
    yield cluster
    cluster.stop()


async def test_redis_restart_mid_run(redis_server, migrated_pg_url, tmp_path):
    from tests.conftest import _truncate_pg

    _truncate_pg(migrated_pg_url)
    env = service_env(migrated_pg_url, redis_server.url, tmp_path)
    worker = start_worker(env, tmp_path / "worker.log")
    try:
        async with client_for(make_settings(migrated_pg_url, broker_url=redis_server.url, data_dir=tmp_path,
                                            orchestrator_lease_s=3)) as client:
            run_id = (await client.post("/api/v1/runs", headers=auth(), json=run_body(
                await upload(client), init_tiny(tmp_path / "tiny")))).json()["id"]
            await wait_for_marker()
            redis_server.stop()  # queued messages and unacknowledged deliveries are gone with it
            await asyncio.sleep(3)
            redis_server.start()
            state = await wait_for_run(client, run_id, timeout_s=240, log=tmp_path / "worker.log")
            await assert_consistent(client, migrated_pg_url, run_id, tmp_path, state)
    finally:
        stop(worker)


async def test_postgres_restart_mid_run(pg_cluster, redis_server, tmp_path):
    env = service_env(pg_cluster.url, redis_server.url, tmp_path)
    worker = start_worker(env, tmp_path / "worker.log")
    try:
        async with client_for(make_settings(pg_cluster.url, broker_url=redis_server.url, data_dir=tmp_path,
                                            orchestrator_lease_s=3)) as client:
            run_id = (await client.post("/api/v1/runs", headers=auth(), json=run_body(
                await upload(client), init_tiny(tmp_path / "tiny")))).json()["id"]
            await wait_for_marker()
            # every connection of the API, orchestrator and worker is cut, and stays down for a while
            await asyncio.get_running_loop().run_in_executor(None, pg_cluster.restart, 5.0)
            state = await wait_for_run(client, run_id, timeout_s=240, log=tmp_path / "worker.log")
            await assert_consistent(client, pg_cluster.url, run_id, tmp_path, state)
        assert "database unavailable" in (tmp_path / "worker.log").read_text()  # the outage was felt
    finally:
        stop(worker)


async def test_killed_orchestrator_is_taken_over(redis_server, migrated_pg_url, tmp_path):
    """The API process that owns the run is SIGKILLed; another API process takes the run over
    once the lease lapses and drives it to the end."""
    from tests.conftest import _truncate_pg

    _truncate_pg(migrated_pg_url)
    env = service_env(migrated_pg_url, redis_server.url, tmp_path)
    worker = start_worker(env, tmp_path / "worker.log")
    apis: list[subprocess.Popen] = []

    def start_api(name: str) -> str:
        port = free_port()
        apis.append(subprocess.Popen([sys.executable, "-m", "service.cli", "serve", "--port", str(port)], env=env,
                                     stdout=open(tmp_path / f"{name}.log", "w"), stderr=subprocess.STDOUT,
                                     start_new_session=True))
        url = f"http://127.0.0.1:{port}"
        for _ in range(200):
            try:
                if httpx.get(f"{url}/api/v1/health", timeout=1).status_code == 200:
                    return url
            except httpx.TransportError:
                time.sleep(0.1)
        raise AssertionError((tmp_path / f"{name}.log").read_text())

    try:
        first = start_api("api1")
        async with httpx.AsyncClient(base_url=first, headers=auth(), timeout=30) as client:
            suite_id = await upload(client)
            run_id = (await client.post("/api/v1/runs", json=run_body(suite_id, init_tiny(tmp_path / "tiny")))).json()["id"]
            await wait_for_marker()
        os.killpg(apis[0].pid, signal.SIGKILL)
        apis[0].wait()
        second = start_api("api2")
        async with httpx.AsyncClient(base_url=second, headers=auth(), timeout=30) as client:
            state = await wait_for_run(client, run_id, timeout_s=240, log=tmp_path / "worker.log")
            await assert_consistent(client, migrated_pg_url, run_id, tmp_path, state)
    finally:
        for proc in [*apis, worker]:
            stop(proc)
