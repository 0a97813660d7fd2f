"""A real Celery worker process on the real Redis broker answers and runs tasks."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import redis

from service.worker.app import make_celery
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
