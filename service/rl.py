"""`swerve rl`: asynchronous RL over a suite as one job, from one config.

    swerve rl --config envs/example_suite/rl.toml [--trainer.optim.lr=3e-5 --job.steps=8 ...]

The TOML has a section per part: [job] (name, steps, time limit), [suite] (what to train on, epochs),
[eval] (the held-out suite, how often, n samples), [filter] (online difficulty filtering),
[rollouts] (the run config: group size, agent, sandbox, staleness bounds), [trainer] (the
trainer config) and [inference] (the model and the vLLM servers). Everything is checked before
anything starts. Then the job: the database migrated, the suites imported, the model made (the
tiny Qwen3 by default), a local vLLM CPU server started unless [inference] names endpoints, the
API with its orchestrators (and, on the embedded broker, an in-process worker), the training
run found (same job name: resumed) or created, and the trainer started in its own process
(under torchrun with nproc > 1). Progress is printed until the run ends; Ctrl-C stops it all and
the same command resumes the job from the trainer's last checkpoint.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
import tomllib
import uuid
from pathlib import Path
from typing import Any, Literal

import sqlalchemy as sa
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from service.config import Settings
from service.fleet.server import die_with_parent
from service.trackers import Trackers, TrackersConfig, TrackerUnavailable
from service.worker.config import FilterConfig

logger = logging.getLogger(__name__)
REPO = Path(__file__).resolve().parent.parent
EXAMPLE_CONFIG = REPO / "envs" / "example_suite" / "rl.toml"
ROLLOUTS_WIRED = ("suite_id", "sampler", "training", "instance_ids", "repos", "name", "groups_per_step")
TRAINER_WIRED = ("name", "model", "out_dir", "database_url", "endpoints", "served_model", "run_id", "steps",
                 "until_step", "evaluate_every", "max_off_policy_steps", "groups_per_step", "time_limit_s")


class ConfigError(ValueError):
    """The job's config is wrong; the message names the field (section.key) and what to do."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class JobSection(_Section):
    name: str = Field("rl", pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")
    """The job's name: running the same name again resumes it (its folder, its training run)."""
    steps: int = Field(ge=1)
    """Trainer steps: the job ends once version `steps` is published (and evaluated)."""
    time_limit_s: float | None = Field(None, gt=0)
    """Wall time for training: the trainer stops after the first step that ends this long after
    it started (a resumed job gets it again), and that version is the job's last, evaluated as the
    last; None: `steps` alone ends the job."""
    seed: int = 0


class SuiteSection(_Section):
    path: Path | None = None
    """A suite file (JSONL or JSON), imported on first use under its name; relative to the config."""
    name: str | None = None
    """Or a suite already imported (swerve suite import)."""
    instance_ids: list[str] | None = None
    repos: list[str] | None = None
    epochs: int | None = Field(None, ge=1)
    """Passes over the suite (None: as many as the steps need)."""
    max_groups: int | None = Field(None, ge=1)
    groups_per_step: int = Field(4, ge=1)
    """Groups (tasks) per trainer step; each has rollouts.samples_per_task samples."""


class EvalSection(_Section):
    enabled: bool = True
    path: Path | None = None
    """The held-out suite; none of path and name: the training suite (with other instance_ids)."""
    name: str | None = None
    instance_ids: list[str] | None = None
    repos: list[str] | None = None
    every: int = Field(1, ge=1)
    samples_per_task: int = Field(4, ge=1, le=1024)
    max_turns: int | None = Field(None, ge=1)
    sampling: dict[str, Any] | None = None
    concurrency: int | None = Field(None, ge=1)
    hold_trainer: bool = True


class InferenceSection(_Section):
    model: Path | None = None
    """Hugging Face folder of the policy at version 0; None: the tiny Qwen3 (made on first use)."""
    endpoints: list[str] = []
    """vLLM servers already serving `model`; none: a local vLLM CPU server is started."""
    served_model: str | None = None
    port: int = Field(8100, ge=1, le=65535)
    max_model_len: int = Field(8192, ge=256)


class TrainerSection(_Section):
    model_config = ConfigDict(extra="allow")
    nproc: int = Field(1, ge=1)
    """Trainer processes on this machine (torchrun underneath when more than one)."""
    launch: Literal["local", "external"] = "local"
    """local: started by swerve rl; external: launched by the cluster (swerve rl prints the command)."""


class ServeSection(_Section):
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=1, le=65535)
    after: bool = True
    """Keep serving the API and UI after the job ends."""


class RLConfig(_Section):
    job: JobSection
    suite: SuiteSection = SuiteSection()
    eval: EvalSection = EvalSection(enabled=False)
    filter: FilterConfig = FilterConfig()
    rollouts: dict[str, Any] = {}
    """service.worker.config.RunConfig's fields, but those the job wires (ROLLOUTS_WIRED)."""
    trainer: TrainerSection = TrainerSection()
    """trainer.config.TrainerConfig's fields, but those the job wires (TRAINER_WIRED)."""
    inference: InferenceSection = InferenceSection()
    serve: ServeSection = ServeSection()
    trackers: TrackersConfig = TrackersConfig()
    """Weights & Biases and TensorBoard, off by default."""


def _set(raw: dict, key: str, value: Any) -> None:
    node = raw
    parts = key.split(".")
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"--{key}: {part} is not a section")
    node[parts[-1]] = value


def load(path: Path, overrides: list[str] = ()) -> RLConfig:
    """The TOML file with `--section.key=value` overrides (values parsed as JSON when they parse);
    relative paths are relative to the file's folder."""
    try:
        raw = tomllib.loads(Path(path).read_text())
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML: {e}") from e
    for item in overrides:
        key, sep, value = item.removeprefix("--").partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r}: write --section.key=value")
        try:
            parsed = json.loads(value)
        except json.JSONDecodeError:
            parsed = value
        _set(raw, key, parsed)
    try:
        cfg = RLConfig.model_validate(raw)
    except ValidationError as e:
        raise ConfigError(_explain(e)) from e
    base = Path(path).resolve().parent
    for section in (cfg.suite, cfg.eval, cfg.inference):
        for name in ("path", "model"):
            value = getattr(section, name, None)
            if value is not None and not value.is_absolute():
                setattr(section, name, base / value)
    return cfg


def _explain(e: ValidationError, prefix: str = "") -> str:
    lines = []
    for err in e.errors():
        where = prefix + ".".join(str(p) for p in err["loc"])
        what = "unknown key (check its spelling and section)" if err["type"] == "extra_forbidden" else err["msg"]
        lines.append(f"{where}: {what}")
    return "; ".join(lines)


def check(cfg: RLConfig) -> None:
    """What can be checked without a database: each section against the config it feeds, the
    suites' files, the trainer's layout against its processes."""
    if cfg.suite.path is None and cfg.suite.name is None:
        raise ConfigError("suite.path: give the training suite's file (or suite.name of an imported suite)")
    for section, s in (("suite", cfg.suite), ("eval", cfg.eval)):
        if s.path is not None and not s.path.is_file():
            raise ConfigError(f"{section}.path: no such file: {s.path}")
        if s.path is not None and s.name is not None:
            raise ConfigError(f"{section}.path, {section}.name: give one of them")
    if cfg.inference.model is not None and not (cfg.inference.model / "config.json").is_file():
        raise ConfigError(f"inference.model: {cfg.inference.model} is not a model folder (no config.json)")
    for key in ROLLOUTS_WIRED:
        if key in cfg.rollouts:
            raise ConfigError(f"rollouts.{key}: set by the job (see [suite], [inference]); remove it")
    for key in TRAINER_WIRED:
        if key in (cfg.trainer.model_extra or {}):
            raise ConfigError(f"trainer.{key}: set by the job ([job], [suite], [inference], "
                              "rollouts.max_off_policy_steps); remove it")
    run_config(cfg, uuid.UUID(int=0), uuid.UUID(int=0), Path("."), ["http://127.0.0.1:1"])
    trainer = trainer_config(cfg, Path("."), Path("."), ["http://127.0.0.1:1"], uuid.UUID(int=0))
    world = trainer["parallelism"]["world_size"]
    if cfg.trainer.launch == "local" and world != cfg.trainer.nproc:
        raise ConfigError(f"trainer.parallelism.world_size: {world}, but trainer.nproc = {cfg.trainer.nproc} "
                          "processes are started here; make them equal (or trainer.launch = \"external\")")
    if cfg.eval.enabled and cfg.eval.every > cfg.job.steps:
        raise ConfigError(f"eval.every: {cfg.eval.every} is more than job.steps = {cfg.job.steps} "
                          "(the job would evaluate only the first and last versions); lower it")


def run_config(cfg: RLConfig, suite_id: uuid.UUID, eval_suite_id: uuid.UUID | None, model: Path,
               endpoints: list[str]):  # fmt: skip
    """The training run's config."""
    from service.worker.config import RunConfig

    ev = None
    if cfg.eval.enabled:
        ev = {"suite_id": eval_suite_id or suite_id, "every": cfg.eval.every,
              "samples_per_task": cfg.eval.samples_per_task, "instance_ids": cfg.eval.instance_ids,
              "repos": cfg.eval.repos, "max_turns": cfg.eval.max_turns, "sampling": cfg.eval.sampling,
              "concurrency": cfg.eval.concurrency, "hold_trainer": cfg.eval.hold_trainer}
    raw = {**cfg.rollouts, "suite_id": suite_id, "name": cfg.job.name,
           "sampler": {"type": "vllm", "endpoints": endpoints, "model": cfg.inference.served_model,
                       "tokenizer": str(model)},
           "groups_per_step": cfg.suite.groups_per_step, "instance_ids": cfg.suite.instance_ids,
           "repos": cfg.suite.repos,
           "training": {"steps": cfg.job.steps, "epochs": cfg.suite.epochs, "max_groups": cfg.suite.max_groups,
                        "seed": cfg.job.seed, "filter": cfg.filter.model_dump(), "eval": ev}}
    try:
        return RunConfig.model_validate(raw)
    except ValidationError as e:
        raise ConfigError(_explain(e, "rollouts.").replace("rollouts.training.eval.", "eval.")
                          .replace("rollouts.training.filter.", "filter.")) from e


def trainer_config(cfg: RLConfig, model: Path, job_dir: Path, endpoints: list[str], run_id: uuid.UUID) -> dict:
    """The trainer's config: the [trainer] section with what the job wires, checked by the
    trainer's own process (the service never imports the trainer)."""
    raw = {k: v for k, v in (cfg.trainer.model_extra or {}).items()}
    raw |= {"name": cfg.job.name, "model": str(model), "out_dir": str(job_dir), "endpoints": endpoints,
            "served_model": cfg.inference.served_model, "run_id": str(run_id), "steps": 0,
            "until_step": cfg.job.steps, "groups_per_step": cfg.suite.groups_per_step,
            "max_off_policy_steps": int(cfg.rollouts.get("max_off_policy_steps", 4)),
            "evaluate_every": cfg.eval.every if cfg.eval.enabled and cfg.eval.hold_trainer else None,
            "seed": cfg.job.seed, "time_limit_s": cfg.job.time_limit_s}
    with tempfile.NamedTemporaryFile("w", suffix=".json") as f:
        json.dump(raw, f)
        f.flush()
        done = subprocess.run([sys.executable, "-m", "trainer", f"--config={f.name}", "--validate"],
                              capture_output=True, text=True)
    if done.returncode != 0:
        errors = [line for line in done.stderr.splitlines() if line.strip()]
        raise ConfigError("; ".join(f"trainer.{line}" for line in errors[-10:]) or "trainer: invalid config")
    return json.loads(done.stdout)


# ---- the job ------------------------------------------------------------------------------------


def trainer_command(cfg: RLConfig, config_path: Path) -> list[str]:
    return [sys.executable, "-m", "trainer", f"--config={config_path}", f"--nproc={cfg.trainer.nproc}"]


async def find_job(engine, name: str):
    """The newest training run of the job, or None."""
    from service.store.tables import Run

    async with engine.connect() as conn:
        return (await conn.execute(sa.select(Run.id, Run.status, Run.config_hash, Run.config).where(
            Run.kind == "train", Run.name == name).order_by(Run.created_at.desc()).limit(1))).first()


async def _suite_tasks(engine, suite_id: uuid.UUID, section: str, instance_ids, repos) -> int:
    from service.control.runs import RunError, select_tasks

    async with engine.connect() as conn:
        try:
            return len(await select_tasks(conn, suite_id, instance_ids, repos, f"{section}."))
        except RunError as e:
            raise ConfigError(str(e)) from e


async def run_job(settings: Settings, cfg: RLConfig, console) -> str:
    """The job to its end (then serving, with serve.after); returns the training run's status.
    `cfg` has passed `check` (the command line checks it before anything starts); what needs the
    database is checked here, still before any server or trainer starts."""
    from service.control.runs import create_run
    from service.embedded import serve_app, start_vllm, tiny_model
    from service.store import db
    from service.store.db import make_async_engine
    from service.store.status import RUN_ACTIVE

    url = settings.resolved_database_url
    db.upgrade(url)
    engine = make_async_engine(url)
    try:
        suite_id = await _suite(engine, settings, cfg.suite, "suite", console)
        eval_id = None
        if cfg.eval.enabled:
            eval_id = (await _suite(engine, settings, cfg.eval, "eval", console)
                       if cfg.eval.path or cfg.eval.name else suite_id)
            await _suite_tasks(engine, eval_id, "eval", cfg.eval.instance_ids, cfg.eval.repos)
        n_tasks = await _suite_tasks(engine, suite_id, "suite", cfg.suite.instance_ids, cfg.suite.repos)
        if cfg.suite.epochs is not None and cfg.suite.epochs * n_tasks < cfg.job.steps * cfg.suite.groups_per_step:
            raise ConfigError(
                f"suite.groups_per_step: {cfg.job.steps} steps x {cfg.suite.groups_per_step} groups need "
                f"{cfg.job.steps * cfg.suite.groups_per_step} groups, but suite.epochs = {cfg.suite.epochs} over "
                f"{n_tasks} task(s) makes {cfg.suite.epochs * n_tasks}: raise suite.epochs or lower the others")
        existing = await find_job(engine, cfg.job.name)
    finally:
        await engine.dispose()
    job_dir = (settings.data_dir / "rl").resolve()
    job_dir.mkdir(parents=True, exist_ok=True)
    model = (cfg.inference.model or tiny_model(settings, console)).resolve()
    if existing is not None and existing.status not in RUN_ACTIVE:
        console.print(f"job {cfg.job.name!r} already {existing.status} (run {existing.id}); "
                      "give [job] name a new value to start another")
    vllm, endpoints = None, list(cfg.inference.endpoints)
    resuming = existing is not None and existing.status in RUN_ACTIVE
    if not endpoints and (existing is None or resuming):
        vllm = start_vllm(settings, model, cfg.inference.port, console, max_model_len=cfg.inference.max_model_len,
                          die_with_parent=True)
        endpoints = [vllm.url]
    if resuming:  # before any orchestrator reads the run: its servers may listen elsewhere now
        await _update_endpoints(url, existing.id, endpoints)
    trainer: subprocess.Popen | None = None
    try:
        async with serve_app(settings, cfg.serve.host, cfg.serve.port) as (app, serving):
            try:
                status = existing.status if existing is not None else None
                if existing is None or resuming:
                    run_id = existing.id if resuming else await create_run(
                        app.state.engine, run_config(cfg, suite_id, eval_id, model, endpoints))
                    console.print(f"resuming job {cfg.job.name!r}: run {run_id}" if resuming else
                                  f"job {cfg.job.name!r}: training run {run_id}, {cfg.job.steps} steps of "
                                  f"{cfg.suite.groups_per_step} groups over {n_tasks} tasks")
                    app.state.supervisor.start(run_id)
                    trainer = _launch_trainer(cfg, url, model, job_dir, endpoints, run_id, console)
                    status = await _follow_with_trackers(app.state.engine, cfg, job_dir, run_id, trainer, console)
                if cfg.serve.after:
                    console.print(f"the service stays up: http://{cfg.serve.host}:{cfg.serve.port}/  "
                                  f"(API docs: http://{cfg.serve.host}:{cfg.serve.port}/docs); Ctrl-C stops it")
                    await serving
                return status
            finally:
                _stop(trainer)
    finally:
        if vllm is not None:
            vllm.stop()


def _launch_trainer(cfg: RLConfig, url: str, model: Path, job_dir: Path, endpoints: list[str],
                    run_id: uuid.UUID, console) -> subprocess.Popen | None:  # fmt: skip
    """The trainer's config written in the job's folder, and its process started (launch =
    "local", dying with the job) or its command printed for the cluster's launcher."""
    config_path = job_dir / f"{cfg.job.name}.trainer.json"
    config_path.write_text(json.dumps(trainer_config(cfg, model, job_dir, endpoints, run_id), indent=2))
    command = trainer_command(cfg, config_path)
    if cfg.trainer.launch != "local":
        console.print("start the trainer on the cluster with SWERVE_DATABASE_URL set to this job's "
                      f"database:\n  {' '.join(command)}")
        return None
    log = job_dir / f"{cfg.job.name}.trainer.log"
    console.print(f"trainer: {' '.join(command)}  (log: {log})")
    return subprocess.Popen(command, env=os.environ | {"SWERVE_DATABASE_URL": url}, stdout=open(log, "ab"),
                            stderr=subprocess.STDOUT, preexec_fn=die_with_parent)


def _stop(trainer: subprocess.Popen | None) -> None:
    """The trainer interrupted as Ctrl-C would (it resumes from its last checkpoint), killed if it
    does not stop within 30 s."""
    if trainer is None or trainer.poll() is not None:
        return
    trainer.send_signal(signal.SIGINT)
    try:
        trainer.wait(30)
    except subprocess.TimeoutExpired:
        trainer.kill()
        trainer.wait()


async def _follow_with_trackers(engine, cfg: RLConfig, job_dir: Path, run_id: uuid.UUID,
                                trainer: subprocess.Popen | None, console) -> str:  # fmt: skip
    trackers = None
    if cfg.trackers.enabled:
        try:
            trackers = Trackers(cfg.trackers, job_dir / f"{cfg.job.name}.trackers", cfg.job.name, str(run_id),
                                cfg.model_dump(mode="json"))
        except TrackerUnavailable as e:
            raise ConfigError(str(e)) from e
    try:
        return await _follow(engine, run_id, trainer, console, trackers)
    finally:
        if trackers is not None:
            trackers.close()

async def _suite(engine, settings: Settings, section, name: str, console) -> uuid.UUID:
    from service.embedded import import_suite
    from service.store.tables import Suite

    if section.path is not None:
        return await import_suite(settings, section.path, console)
    async with engine.connect() as conn:
        found = await conn.scalar(sa.select(Suite.id).where(Suite.name == section.name, Suite.deleted_at.is_(None)))
    if found is None:
        raise ConfigError(f"{name}.name: no suite named {section.name!r} (import it with swerve suite import)")
    return found


async def _update_endpoints(url: str, run_id: uuid.UUID, endpoints: list[str]) -> None:
    """A resumed job's servers may listen elsewhere now: the run's sampler (and its active
    evaluations') follows them."""
    from service.store.buffer import Buffer
    from service.store.db import make_async_engine

    engine = make_async_engine(url)
    try:
        await Buffer(engine).set_endpoints(run_id, endpoints)
    finally:
        await engine.dispose()


def progress_line(state: dict, elapsed_s: float) -> str:
    """One line of the job's progress: step, reward, eval pass@1, staleness, pace, groups."""
    t = state["training"] or {}
    steps = t.get("steps") or []
    evals = [e for e in (t.get("evals") or []) if e["pass_at_1"] is not None and e["status"] == "finished"]
    last = steps[-1] if steps else {}
    reward = last.get("reward_mean")
    ev = evals[-1] if evals else None

    def f(value, digits: int) -> str:
        return "-" if value is None else f"{value:.{digits}f}"

    parts = [f"step {t.get('step', 0)}/{t.get('last_step')}", f"reward {f(reward, 3)}",
             "eval pass@1 -" if ev is None else f"eval pass@1 {ev['pass_at_1']:.3f} (v{ev['policy_version']})",
             f"staleness {f(last.get('staleness_mean'), 1)}", f"{f(t.get('steps_per_hour'), 0)} steps/h",
             f"episodes {state['final']}/{sum(state['episodes'].values())}",
             f"epoch {t.get('epoch') if t.get('epoch') is not None else '-'}",
             f"filtered {t.get('filtered', 0)}", f"{elapsed_s:.0f}s"]
    return "  ".join(parts)


async def job_state(engine, run_id: uuid.UUID) -> dict:
    from service.control import views
    from service.control.redaction import Answers
    from service.store.db import session_factory

    async with session_factory(engine)() as session:
        run = await views.get_run(session, run_id)
        return await views.progress(session, run, Answers(shown=True)) | {"training": await views.training(session, run)}


async def _follow(engine, run_id: uuid.UUID, trainer: subprocess.Popen | None, console,
                  trackers: Trackers | None = None) -> str:  # fmt: skip
    """Print progress (and log it to the trackers) until the run ends; a trainer that dies
    stops the job (resumable)."""
    from service.store.status import RUN_ACTIVE
    from service.store.tables import Suite

    async with engine.connect() as conn:
        suites = {str(i): name for i, name in (await conn.execute(sa.select(Suite.id, Suite.name))).all()}
    started, last_line, last_print = time.monotonic(), None, 0.0
    while True:
        state = await job_state(engine, run_id)
        if trackers is not None:
            trackers.log(state["training"] or {}, suites)
        line = progress_line(state, time.monotonic() - started)
        key = line.rsplit("  ", 1)[0]
        if key != last_line or time.monotonic() - last_print > 30:
            console.print(line, highlight=False, soft_wrap=True)
            last_line, last_print = key, time.monotonic()
        if state["status"] not in RUN_ACTIVE:
            console.print(summary(state))
            return state["status"]
        if trainer is not None and trainer.poll() not in (None, 0):
            raise RuntimeError(f"the trainer exited with code {trainer.returncode} (see its log); "
                               "run the same command again to resume the job")
        await asyncio.sleep(1.0)


def summary(state: dict):
    from rich.table import Table

    t = state["training"] or {}
    early = f", stopped at version {t['last_step']} by the time limit" if t.get("stopped_early") else ""
    table = Table(title=f"run {state['id']}: {state['status']}{early}")
    for column in ("version", "reward", "useful", "mismatch KL", "staleness", "wait s", "train s", "publish s",
                   "eval pass@1 [95% CI]", "pass@k", "format err"):
        table.add_column(column, no_wrap=column == "version")  # the key column is never cut
    evals = {e["policy_version"]: e for e in t.get("evals") or []}
    rows = {0: {}} | {s["version"]: s for s in t.get("steps") or []}

    def f(value, digits=3):
        return "-" if value is None else f"{value:.{digits}f}"

    for version, s in sorted(rows.items()):
        e = evals.get(version) or {}
        ci = e.get("pass_at_1_ci")
        table.add_row(f"v{version}", f(s.get("reward_mean")), f(s.get("useful_fraction"), 2),
                      f(s.get("mismatch_kl"), 4), f(s.get("staleness_mean"), 1), f(s.get("wait_s"), 1),
                      f(s.get("step_s"), 1), f(s.get("publish_s"), 1),
                      "-" if not e else f"{f(e.get('pass_at_1'))} [{f(ci[0] if ci else None)}, {f(ci[1] if ci else None)}]",
                      f(e.get("pass_at_k")), f(e.get("format_error_rate"), 2))
    return table
