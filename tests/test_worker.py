"""A real Celery worker process on the real Redis broker answers and runs tasks; apps on the
in-process broker keep their tasks to themselves."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import redis

from service.worker.app import QUEUE, episode_sender, make_celery, prediction_sender
from service.config import load_settings
from tests.conftest import clean_env, missing_service

BROKER = os.environ.get("SWERVE_TEST_REDIS_URL", "redis://127.0.0.1:6379/15")


@pytest.fixture
def broker_url() -> str:
    try:
        redis.Redis.from_url(BROKER).ping()
    except redis.ConnectionError as e:
        missing_service(f"Redis at {BROKER} ({e})")
    return BROKER


def test_worker_answers_ping_and_runs_tasks(broker_url, tmp_path):
    env = clean_env()
    env |= {"SWERVE_BROKER_URL": broker_url, "SWERVE_DATA_DIR": str(tmp_path)}
    proc = subprocess.Popen([sys.executable, "-m", "service.cli", "worker", "--concurrency", "1"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    celery = make_celery(load_settings(broker_url=broker_url))
    try:
        deadline = time.monotonic() + 60
        replies = []
        while not replies:
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() < deadline, "worker did not answer within 60 s"
            replies = celery.control.ping(timeout=1.0)
        assert any(name.startswith("swerve@") for reply in replies for name in reply)
        registered = celery.control.inspect(timeout=2.0).registered() or {}
        assert any("swerve.ping" in tasks for tasks in registered.values())
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_apps_on_the_memory_broker_each_have_their_own_queue():
    # kombu's memory transport keeps one set of queues per process: with one queue for all, a
    # worker an earlier app left running took a later app's episodes and looked them up in its
    # own database ("no such table: episodes"), and they stayed queued
    first, second = (make_celery(load_settings(broker_url="memory://")) for _ in range(2))
    assert first.conf.task_default_queue != second.conf.task_default_queue
    episode_sender(second)("an episode id")
    prediction_sender(second)("an evaluation id", "an instance", 0)
    with second.connection_for_read() as conn:
        assert conn.SimpleQueue(first.conf.task_default_queue).qsize() == 0
        assert conn.SimpleQueue(second.conf.task_default_queue).qsize() == 2
    # workers on a shared broker take the one queue `swerve worker` consumes
    assert make_celery(load_settings(broker_url=BROKER)).conf.task_default_queue == QUEUE


async def test_a_database_without_our_tables_fails_an_episode_at_once_a_locked_one_is_waited_for(tmp_path):
    """An episode message for a database without swerve's tables (another service's, or one not
    migrated: SQLite calls it an OperationalError, as it does a lock) ends at once instead of
    retrying for db_retry's 300 s; a locked database is still waited for."""
    import sqlite3
    import uuid

    from sqlalchemy.exc import OperationalError

    from service.store.db import make_async_engine
    from service.worker.executor import _start, db_retry

    engine = make_async_engine(f"sqlite:///{tmp_path / 'empty.db'}")
    try:
        started = time.monotonic()
        with pytest.raises(OperationalError, match="no such table"):
            await db_retry(lambda: _start(engine, uuid.uuid4()), "the start of an episode")
        assert time.monotonic() - started < 5
    finally:
        await engine.dispose()

    tries = []

    async def locked_twice():
        tries.append(1)
        if len(tries) < 3:
            raise OperationalError("INSERT INTO turns", {}, sqlite3.OperationalError("database is locked"))
        return "stored"

    assert await db_retry(locked_twice, "a turn") == "stored" and len(tries) == 3
