"""`swerve run`: the whole job in one process (SQLite, in-memory broker, in-process worker,
bubblewrap), as a user starts it."""

from __future__ import annotations

import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import clean_env, client_for, make_settings
from tests.sandbox_fixtures import require_bwrap
from tests.servers import free_port

pytestmark = pytest.mark.slow
TASKS = ["swerve-examples__textkit-camel-acronym", "swerve-examples__numkit-median-even"]


def swerve_run(data_dir: Path, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    require_bwrap()
    env = clean_env() | {
        "SWERVE_DATA_DIR": str(data_dir), "COLUMNS": "120"}
    return subprocess.run([sys.executable, "-m", "service.cli", "run", "--no-serve", "--port", str(free_port()),
                           *[a for t in TASKS for a in ("--task", t)], *args],
                          env=env, capture_output=True, text=True, timeout=timeout)


def episodes(data_dir: Path) -> list[tuple]:
    with sqlite3.connect(data_dir / "swerve.db") as conn:
        return conn.execute("SELECT status, reward, n_turns, trainable FROM episodes").fetchall()


def test_embedded_oracle_run(tmp_path):
    done = swerve_run(tmp_path, "--sampler", "oracle", "--samples", "2")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "4/4 final" in done.stdout and "1.000 over 4 graded" in done.stdout, done.stdout
    assert sorted(episodes(tmp_path)) == [("submitted", 1.0, 3, 0)] * 4
    again = swerve_run(tmp_path, "--sampler", "oracle", "--samples", "1")  # same database: suite reused
    assert again.returncode == 0 and "imported suite" not in again.stdout, again.stdout + again.stderr
    assert len(episodes(tmp_path)) == 6


@pytest.mark.vllm
async def test_embedded_tiny_model_run(tmp_path, vllm_fleet):
    from service.fleet.server import VLLMServer
    from tests.test_rollout_e2e import check_run_trajectories

    model_dir = vllm_fleet.models["dense"]
    done = swerve_run(tmp_path, "--model", str(model_dir), "--endpoint", vllm_fleet.url("dense-a"),
                      "--samples", "2", "--max-turns", "3", "--max-tokens", "48")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "4/4 final" in done.stdout, done.stdout
    version = int(VLLMServer.served_version(vllm_fleet.servers["dense-a"]) or 0)
    async with client_for(make_settings(f"sqlite:///{tmp_path / 'swerve.db'}")) as client:
        runs = (await client.get("/api/v1/runs")).json()["items"]
        assert [r["status"] for r in runs] == ["finished"]
        assert len(await check_run_trajectories(client, runs[0]["id"], model_dir, version)) == 4


def test_run_names_a_bad_task_filter(tmp_path):
    done = swerve_run(tmp_path, "--sampler", "oracle", "--task", "nope")
    assert done.returncode == 1 and "instance_ids" in done.stderr and "nope" in done.stderr, done.stderr
