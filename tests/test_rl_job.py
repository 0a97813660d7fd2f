"""`swerve rl` as a user runs it: bad configs stop before anything starts, naming the field;
the job end to end with the tiny model on real vLLM (PostgreSQL, Redis and a worker process;
and on embedded defaults: SQLite, the in-process worker), SIGKILLed mid-job and run again to
its last step with no group lost or trained twice; and its trackers."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest
import sqlalchemy as sa

from tests.servers import free_port
from tests.test_cli import run_cli
from tests.conftest import clean_env

ROOT = Path(__file__).resolve().parent.parent
SUITE = ROOT / "envs" / "example_suite" / "suite.jsonl"
TRAIN = ["swerve-examples__textkit-truncate-off-by-one", "swerve-examples__numkit-median-even"]
HELD_OUT = ["swerve-examples__cachekit-lru-get-refresh"]


def write_config(folder: Path, **sections) -> Path:
    """A small job: 3 steps of 1 group over 2 tasks, evaluation of 1 held-out task every 2 versions."""
    base = {
        "job": {"name": "ci", "steps": 3},
        "suite": {"path": str(SUITE), "instance_ids": TRAIN, "groups_per_step": 1, "epochs": 8},
        "eval": {"enabled": True, "instance_ids": HELD_OUT, "every": 2, "samples_per_task": 2,
                 "sampling": {"max_tokens": 16}},
        "rollouts": {"samples_per_task": 2, "concurrency": 4, "max_off_policy_steps": 1, "worker_timeout_s": 8,
                     "agent": {"max_turns": 2, "sampling": {"max_tokens": 16}}},
        "trainer": {"fill_useful": False, "checkpoint_every": 1, "optim": {"lr": 1e-3}, "wait_s": 600,
                    "data": {"seq_len": 2048}},
        "serve": {"port": free_port(), "after": False},
    }
    for name, values in sections.items():
        base[name] = base.get(name, {}) | values
    lines = []
    for name, values in base.items():
        lines.append(f"[{name}]")
        lines += [f"{k} = {json.dumps(v) if not isinstance(v, dict) else _inline(v)}" for k, v in values.items()]
    path = folder / "rl.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def _inline(table: dict) -> str:
    return "{ " + ", ".join(f"{k} = {_inline(v) if isinstance(v, dict) else json.dumps(v)}"
                            for k, v in table.items()) + " }"


# ---- bad configs: refused before anything starts ----------------------------------------------


@pytest.mark.parametrize(("override", "message"), [
    ("--trainer.optim.lrr=1", "trainer.optim.lrr: unknown key"),
    ("--rollouts.sample_per_task=2", "rollouts.sample_per_task: unknown key"),
    ("--jobs.steps=2", "jobs: unknown key"),
    ("--eval.path=missing.jsonl", "eval.path: no such file"),
    ("--trainer.parallelism.world_size=2", "trainer.parallelism.world_size: 2, but trainer.nproc = 1"),
    ("--rollouts.sampler={}", "rollouts.sampler: set by the job"),
    ("--trainer.run_id=x", "trainer.run_id: set by the job"),
    ("--eval.every=9", "eval.every: 9 is more than job.steps = 3"),
])  # fmt: skip
def test_a_bad_config_names_the_field(tmp_path, override, message):
    done = run_cli(["rl", "--config", str(write_config(tmp_path)), "--check", override],
                   {"SWERVE_DATA_DIR": str(tmp_path / "var")})
    assert done.returncode == 2 and message in done.stderr, done.stderr
    assert not (tmp_path / "var").exists()  # nothing was made


@pytest.mark.parametrize(("override", "message"), [
    ("--eval.name=nope", "eval.name: no suite named 'nope'"),
    ("--suite.groups_per_step=5", "suite.groups_per_step: 3 steps x 5 groups need 15 groups, but suite.epochs = 2"),
    ('--eval.instance_ids=["absent"]', "eval.instance_ids/eval.repos: no task of the suite matches"),
])  # fmt: skip
def test_a_config_the_database_contradicts_stops_before_any_server(tmp_path, override, message):
    config = write_config(tmp_path, suite={"epochs": 2}, inference={"endpoints": ["http://127.0.0.1:9"],
                                                                     "model": str(tmp_path)})
    (tmp_path / "config.json").write_text("{}")  # a model folder as far as the check goes
    done = run_cli(["rl", "--config", str(config), override], {"SWERVE_DATA_DIR": str(tmp_path / "var")})
    assert done.returncode == 2 and message in done.stderr, done.stderr
    url = f"sqlite:///{tmp_path / 'var' / 'swerve.db'}"
    with sa.create_engine(url).connect() as conn:
        assert conn.execute(sa.text("SELECT count(*) FROM runs")).scalar() == 0
    assert "trainer:" not in done.stdout  # no trainer was started


# ---- the job end to end -------------------------------------------------------------------------


def _versions(db_url: str) -> list[int]:
    """The published versions; none while the job has not made its database yet."""
    if db_url.startswith("sqlite:///") and not Path(db_url.removeprefix("sqlite:///")).exists():
        return []
    try:
        return _state(db_url)["versions"]
    except sa.exc.OperationalError:  # not migrated yet
        return []


def _state(db_url: str) -> dict:
    engine = sa.create_engine(db_url.replace("postgresql://", "postgresql+psycopg://"))
    try:
        with engine.connect() as conn:
            q = lambda sql: conn.execute(sa.text(sql)).all()  # noqa: E731
            return {
                "versions": [r[0] for r in q("SELECT version FROM policies ORDER BY version")],
                "runs": q("SELECT id, kind, status, policy_version FROM runs ORDER BY created_at"),
                "groups": q("SELECT g.id, g.status, g.trainer_step, g.min_policy_version, r.kind FROM groups g "
                            "JOIN runs r ON r.id = g.run_id"),
                "turns": q("SELECT r.kind, r.policy_version, t.policy_version, r.id, e.id, t.idx, t.started_at "
                           "FROM turns t JOIN episodes e ON e.id = t.episode_id JOIN runs r ON r.id = e.run_id"),
            }
    finally:
        engine.dispose()


def _trainers(config_name: str) -> list[psutil.Process]:
    out = []
    for p in psutil.process_iter(["cmdline"]):
        cmd = p.info["cmdline"] or []
        if "trainer" in cmd and any(config_name in c for c in cmd):
            out.append(p)
    return out


def _start(config: Path, env: dict, log: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "service.cli", "rl", "--config", str(config)], env=env,
                            stdout=open(log, "ab"), stderr=subprocess.STDOUT)


def _run_killed_and_resumed(tmp_path: Path, env: dict, db_url: str, model: Path, url: str) -> None:
    config = write_config(tmp_path, inference={"endpoints": [url], "model": str(model), "served_model": "tiny"})
    log = tmp_path / "rl.log"
    job = _start(config, env, log)
    try:
        deadline = time.monotonic() + 600
        while not any(v >= 1 for v in _versions(db_url)):  # mid-job: version 1 out, 3 not yet
            assert job.poll() is None, log.read_text()[-4000:]
            assert time.monotonic() < deadline, log.read_text()[-4000:]
            time.sleep(0.5)
        job.send_signal(signal.SIGKILL)
        job.wait()
        for _ in range(60):  # the trainer dies with the job (no orphan keeps training)
            if not _trainers("ci.trainer.json"):
                break
            time.sleep(0.5)
        assert not _trainers("ci.trainer.json")
        before = _state(db_url)
        assert max(before["versions"]) < 3, "killed too late to test a resume"
        job = _start(config, env, log)
        assert job.wait(timeout=900) == 0, log.read_text()[-6000:]
    finally:
        if job.poll() is None:
            job.kill()
    text = log.read_text()
    assert "resuming job 'ci'" in text
    state = _state(db_url)
    assert state["versions"] == [0, 1, 2, 3]
    assert httpx.get(f"{url}/weight_info").json()["weight_version"] == "3"  # the fleet reloaded the last
    train = [r for r in state["runs"] if r.kind == "train"]
    assert len(train) == 1 and train[0].status == "finished"
    trained = [g for g in state["groups"] if g.kind == "train" and g.status == "consumed"]
    # every step consumed its group exactly once: one group per step (groups_per_step = 1), none left claimed
    assert sorted(g.trainer_step for g in trained) == [1, 2, 3]
    assert not [g for g in state["groups"] if g.status == "claimed"]
    for g in trained:  # staleness within the bound: sampled at most max_off_policy_steps behind
        assert (g.trainer_step - 1) - g.min_policy_version <= 1, g
    # every turn is tagged with the version that sampled it
    assert state["turns"] and all(t[2] is not None and 0 <= t[2] <= 3 for t in state["turns"])
    evals = {r.policy_version: r for r in state["runs"] if r.kind == "eval" and r.status == "finished"}
    assert set(evals) == {0, 2, 3}
    # evaluations are never trained on, and (the trainer waits for them) sampled by their version only
    assert {g.status for g in state["groups"] if g.kind == "eval"} <= {"evaluated"}
    mixed = [tuple(t) for t in state["turns"] if t[0] == "eval" and t[1] in evals and t[2] != t[1]]
    assert not mixed, (mixed, state["runs"], state["versions"], text[-3000:])




@pytest.mark.vllm
@pytest.mark.slow
def test_rl_job_on_postgres_redis_and_a_worker_process_survives_sigkill(vllm_fleet, migrated_pg_url, tmp_path):
    from tests.conftest import require_torchtitan
    from tests.test_rollout_e2e import BROKER, running_worker, worker_env

    require_torchtitan()
    url = vllm_fleet.url("dense-a")
    env = worker_env(migrated_pg_url, tmp_path) | {"SWERVE_ORCHESTRATOR_LEASE_S": "3"}
    try:
        with running_worker(migrated_pg_url, tmp_path):
            _run_killed_and_resumed(tmp_path, env, migrated_pg_url, vllm_fleet.models["dense"], url)
            assert env["SWERVE_BROKER_URL"] == BROKER
    finally:
        _back_to_initial_weights(vllm_fleet)


@pytest.mark.vllm
@pytest.mark.slow
def test_rl_job_on_embedded_defaults_survives_sigkill(vllm_fleet, tmp_path):
    from tests.conftest import require_torchtitan
    from tests.sandbox_fixtures import require_bwrap

    require_torchtitan()
    require_bwrap()
    url = vllm_fleet.url("dense-a")
    env = clean_env() | {
        "SWERVE_DATA_DIR": str(tmp_path / "var"), "SWERVE_ORCHESTRATOR_LEASE_S": "3"}
    try:
        _run_killed_and_resumed(tmp_path, env, f"sqlite:///{tmp_path / 'var' / 'swerve.db'}",
                                vllm_fleet.models["dense"], url)
    finally:
        _back_to_initial_weights(vllm_fleet)


@pytest.mark.vllm
@pytest.mark.slow
def test_a_job_time_limit_ends_it_after_the_step_in_progress_and_evaluates_that_version(vllm_fleet, tmp_path):
    """[job] time_limit_s: the trainer stops after its first step, whose version becomes the job's
    last: the run finishes there (not at job.steps = 3) and that version is evaluated as the last."""
    from tests.conftest import require_torchtitan
    from tests.sandbox_fixtures import require_bwrap

    require_torchtitan()
    require_bwrap()
    url = vllm_fleet.url("dense-a")
    env = clean_env() | {"SWERVE_DATA_DIR": str(tmp_path / "var")}
    config = write_config(tmp_path, job={"name": "ci", "steps": 3, "time_limit_s": 0.001},
                          inference={"endpoints": [url], "model": str(vllm_fleet.models["dense"]), "served_model": "tiny"})
    log = tmp_path / "rl.log"
    try:
        job = _start(config, env, log)
        assert job.wait(timeout=900) == 0, log.read_text()[-6000:]
    finally:
        if job.poll() is None:
            job.kill()
        _back_to_initial_weights(vllm_fleet)
    text = log.read_text()
    assert "stopped at version 1 by the time limit" in text, text[-3000:]
    state = _state(f"sqlite:///{tmp_path / 'var' / 'swerve.db'}")
    assert state["versions"] == [0, 1]
    train = [r for r in state["runs"] if r.kind == "train"]
    assert len(train) == 1 and train[0].status == "finished"
    evals = {r.policy_version: r.status for r in state["runs"] if r.kind == "eval"}
    assert evals == {0: "finished", 1: "finished"}  # the last version evaluated, though 1 % every != 0
    trained = [g.trainer_step for g in state["groups"] if g.kind == "train" and g.status == "consumed"]
    assert trained == [1] and not [g for g in state["groups"] if g.status == "claimed"]


def _back_to_initial_weights(vllm_fleet) -> None:
    """The fleet is shared by the session: back to the initial weights, version 0."""
    import asyncio

    from service.fleet.client import FleetConfig, VLLMClient

    async def reload() -> list[str]:
        async with VLLMClient(FleetConfig(endpoints=[vllm_fleet.url("dense-a")], probe_timeout_s=60)) as fleet:
            return await fleet.reload(str(vllm_fleet.models["dense"]), version=0)

    assert asyncio.run(reload()) == [vllm_fleet.url("dense-a")]
