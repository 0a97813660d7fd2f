"""The `swerve` command as a user runs it: settings errors, migrations, import, a live server."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from service.config import SettingsError, load_settings
from tests.conftest import clean_env, TOKEN

SAMPLE = Path(__file__).parent / "data" / "swebench_sample.jsonl"
SWERVE = [sys.executable, "-m", "service.cli"]


def run_cli(args: list[str], env: dict, timeout: float = 60) -> subprocess.CompletedProcess:
    clean = clean_env()
    return subprocess.run(SWERVE + args, env=clean | env, capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture
def env(tmp_path: Path) -> dict:
    return {"SWERVE_DATA_DIR": str(tmp_path / "var")}


@pytest.mark.parametrize(("variable", "value"), [
    ("SWERVE_DATABASE_URL", "mysql://root@localhost/x"),
    ("SWERVE_MAX_UPLOAD_BYTES", "lots"),
    ("SWERVE_API_TOKEN", "short"),
    ("SWERVE_LOG_FORMAT", "xml"),
])
def test_bad_setting_names_its_variable(monkeypatch, variable, value):
    monkeypatch.setenv(variable, value)
    with pytest.raises(SettingsError, match=variable):
        load_settings()


def test_serve_refuses_bad_settings(env):
    result = run_cli(["serve"], env | {"SWERVE_MAX_UPLOAD_BYTES": "-1"})
    assert result.returncode == 2
    assert "SWERVE_MAX_UPLOAD_BYTES" in result.stderr


def test_serve_without_token_refuses_a_public_address(env):
    result = run_cli(["serve", "--host", "0.0.0.0"], env)
    assert result.returncode == 2
    assert "SWERVE_API_TOKEN" in result.stderr


def test_serve_refuses_an_unmigrated_database(env):
    result = run_cli(["serve"], env)
    assert result.returncode == 2
    assert "swerve db upgrade" in result.stderr


def test_db_upgrade_and_suite_import(env, tmp_path):
    assert run_cli(["db", "upgrade"], env).returncode == 0
    bad = tmp_path / "bad.jsonl"
    lines = SAMPLE.read_text().splitlines()
    bad.write_text("\n".join([lines[0], '{"instance_id": "x"}', lines[1]]) + "\n")
    refused = run_cli(["suite", "import", str(bad)], env)
    assert refused.returncode == 1
    assert "bad.jsonl:line 2: x: repo" in refused.stderr

    ok = run_cli(["suite", "import", str(SAMPLE), "--name", "sample"], env)
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["task_count"] == 3
    assert "importing swebench_sample.jsonl: 3 records" in ok.stderr  # progress, on stderr off a terminal
    again = run_cli(["suite", "import", str(SAMPLE), "--name", "sample"], env)
    assert again.returncode == 1 and "exists" in again.stderr
    skipped = run_cli(["suite", "import", str(SAMPLE), "--name", "sample", "--skip-existing"], env)
    assert skipped.returncode == 0 and "already imported" in skipped.stdout


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_answers_over_http(env):
    assert run_cli(["db", "upgrade"], env).returncode == 0
    port = _free_port()
    clean = clean_env()
    proc = subprocess.Popen(SWERVE + ["serve", "--host", "0.0.0.0", "--port", str(port)],
                            env=clean | env | {"SWERVE_API_TOKEN": TOKEN},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        while True:
            try:
                health = httpx.get(f"{base}/api/v1/health", timeout=1).json()
                break
            except httpx.TransportError:
                assert proc.poll() is None and time.monotonic() < deadline, "server did not start"
                time.sleep(0.2)
        assert health == {"status": "ok", "database": "sqlite", "local_mode": False}
        body = SAMPLE.read_bytes()
        denied = httpx.post(f"{base}/api/v1/suites?name=s", content=body,
                            headers={"Content-Type": "application/x-ndjson"})
        assert denied.status_code == 401
        created = httpx.post(f"{base}/api/v1/suites?name=s", content=body, headers={
            "Content-Type": "application/x-ndjson", "Authorization": f"Bearer {TOKEN}"})
        assert created.status_code == 201 and created.json()["task_count"] == 3
        assert httpx.get(f"{base}/docs").status_code == 200
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=20)
