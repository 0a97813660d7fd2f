"""The `swerve` command line."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Annotated

import typer

from service.config import Settings, SettingsError, get_settings, is_loopback

app = typer.Typer(help="swerve: SWE environments and rollouts for RL of coding agents.",
                  no_args_is_help=True, pretty_exceptions_enable=False)
db_app = typer.Typer(help="Database migrations.", no_args_is_help=True)
suite_app = typer.Typer(help="Task suites.", no_args_is_help=True)
model_app = typer.Typer(help="Local models.", no_args_is_help=True)
inference_app = typer.Typer(help="Inference servers.", no_args_is_help=True)
demo_app = typer.Typer(help="Demonstrations of the whole system.", no_args_is_help=True)
app.add_typer(db_app, name="db")
app.add_typer(suite_app, name="suite")
app.add_typer(model_app, name="model")
app.add_typer(inference_app, name="inference")
app.add_typer(demo_app, name="demo")


def _settings() -> Settings:
    try:
        return get_settings()
    except SettingsError as e:
        typer.secho(str(e), fg="red", err=True)
        raise typer.Exit(2) from e


def _require_migrated(settings: Settings) -> None:
    from alembic.script import ScriptDirectory

    from service.store import db

    head = ScriptDirectory.from_config(db.alembic_config(settings.resolved_database_url))
    current = db.current_revision(settings.resolved_database_url)
    if current != head.get_current_head():
        typer.secho(f"database is at revision {current}, code expects "
                    f"{head.get_current_head()}: run `swerve db upgrade`", fg="red", err=True)
        raise typer.Exit(2)


@app.command()
def serve(
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on.")] = 8000,
) -> None:
    """Run the API and web UI."""
    import uvicorn

    from service.app import create_app
    from service.log import setup_logging

    settings = _settings()
    setup_logging(settings.log_format)
    if settings.local_mode and not is_loopback(host):
        typer.secho(f"SWERVE_API_TOKEN is unset: refusing to listen on {host}. Set a token "
                    "(16+ characters) or listen on 127.0.0.1.", fg="red", err=True)
        raise typer.Exit(2)
    _require_migrated(settings)
    if settings.local_mode:
        typer.echo("local mode: SWERVE_API_TOKEN is unset, so every caller is trusted and "
                   f"the service listens on {host} only")
    typer.echo(f"swerve API on http://{host}:{port}  (OpenAPI: http://{host}:{port}/docs)")
    uvicorn.run(create_app(settings), host=host, port=port, log_config=None)


@app.command()
def run(
    suite: Annotated[Path, typer.Option(exists=True, dir_okay=False, help="SWE-bench suite (JSONL or JSON).")] = None,
    sampler: Annotated[str, typer.Option(help="vllm: the tiny model on a local vLLM CPU server; oracle: gold patches; demo: gold patches as a model would edit (SFT demonstrations).")] = "vllm",
    model: Annotated[Path | None, typer.Option(exists=True, file_okay=False, help="Model folder (default: a tiny Qwen3).")] = None,
    endpoint: Annotated[list[str] | None, typer.Option(help="A vLLM server already serving --model (repeatable); none: start one.")] = None,
    samples: Annotated[int, typer.Option(min=1, help="Episodes per task (group size).")] = 2,
    concurrency: Annotated[int, typer.Option(min=1, help="Episodes in flight.")] = 8,
    max_turns: Annotated[int, typer.Option(min=1, help="Model calls per episode.")] = 8,
    max_tokens: Annotated[int, typer.Option(min=1, help="Tokens sampled per turn at most.")] = 256,
    task: Annotated[list[str] | None, typer.Option(help="Only these instance ids (repeatable).")] = None,
    host: Annotated[str, typer.Option(help="Address of the API and UI.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port of the API and UI.")] = 8000,
    vllm_port: Annotated[int, typer.Option(help="Port of the local vLLM server.")] = 8100,
    serve: Annotated[bool, typer.Option(help="Keep serving the API and UI after the run.")] = True,
) -> None:
    """Do the whole job in one process: database, suite, model, vLLM, API, worker; run the
    suite with a live progress bar, print a summary, then keep serving."""
    from rich.console import Console

    from service.embedded import EXAMPLE_SUITE, EmbeddedOptions, run_embedded
    from service.log import setup_logging

    settings = _settings()
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    log_path = settings.data_dir / "swerve-run.log"
    setup_logging(settings.log_format, level="INFO", path=log_path)
    typer.echo(f"log: {log_path}")
    if sampler not in ("vllm", "oracle", "demo"):
        typer.secho(f"--sampler: must be vllm, oracle or demo, got {sampler!r}", fg="red", err=True)
        raise typer.Exit(2)
    if settings.local_mode and not is_loopback(host):
        typer.secho(f"SWERVE_API_TOKEN is unset: refusing to listen on {host}.", fg="red", err=True)
        raise typer.Exit(2)
    if endpoint and model is None:
        typer.secho("--endpoint: give --model too (the folder with the tokenizer the servers use)", fg="red", err=True)
        raise typer.Exit(2)
    opts = EmbeddedOptions(suite=suite or EXAMPLE_SUITE, sampler=sampler, model=model, samples_per_task=samples,
                           endpoints=tuple(endpoint or ()),
                           concurrency=concurrency, max_turns=max_turns, max_tokens=max_tokens, host=host,
                           port=port, vllm_port=vllm_port, serve_after=serve, instance_ids=tuple(task or ()))
    from service.control.runs import RunError

    try:
        status = asyncio.run(run_embedded(settings, opts, Console()))
    except KeyboardInterrupt:
        return
    except (RuntimeError, TimeoutError, RunError) as e:
        typer.secho(str(e), fg="red", err=True)
        raise typer.Exit(1) from e
    if status != "finished":
        raise typer.Exit(1)


@demo_app.command("learn")
def demo_learn(
    seed: Annotated[int, typer.Option(help="Seed of the tasks, the model, the demonstrations and the RL job.")] = 0,
    quick: Annotated[bool, typer.Option(help="Every stage on a few tasks for a few steps: the pipeline, not "
                                             "the learning (minutes).")] = False,
    results: Annotated[Path | None, typer.Option(help="Where the \"demo learn\" section goes, before the "
                                                      "file's first (default: bench/RESULTS.md; none with --quick); a "
                                                      "resumed demo replaces its own section.")] = None,
    port: Annotated[int, typer.Option(help="Port of the API and UI while the demo runs.")] = 8030,
    vllm_port: Annotated[int, typer.Option(help="Port of the local vLLM server.")] = 8130,
) -> None:
    """Proof that it learns: generate a task family, SFT a small Qwen3 on a few demonstrations,
    RL it through `swerve rl`, and evaluate before SFT, after SFT, after RL and after as much
    more SFT as RL took, on held-out tasks. Its folder is $SWERVE_DATA_DIR/demo-learn."""
    from rich.console import Console

    from service import demo
    from service.log import setup_logging

    base = _settings()
    root = base.data_dir / "demo-learn"
    root.mkdir(parents=True, exist_ok=True)
    settings = base.model_copy(update={"data_dir": root, "models_dir": root / "models"})
    setup_logging(settings.log_format, level="INFO", path=root / "demo-learn.log")
    typer.echo(f"log: {root / 'demo-learn.log'}")
    plan = demo.LearnPlan.quick(seed) if quick else demo.LearnPlan(seed=seed)
    target = results if results is not None else (None if quick else Path(__file__).resolve().parent.parent / "bench" / "RESULTS.md")
    try:
        out = asyncio.run(demo.learn(settings, plan, Console(width=None if sys.stdout.isatty() else 160), port=port,
                                     vllm_port=vllm_port, results=target))
    except KeyboardInterrupt:
        raise typer.Exit(130) from None
    except (demo.DemoError, RuntimeError, TimeoutError) as e:
        typer.secho(str(e), fg="red", err=True)
        raise typer.Exit(1) from e
    typer.echo(demo.results_section(out, demo.command(plan)))


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def rl(
    ctx: typer.Context,
    config: Annotated[Path | None, typer.Option(help="The job's config (TOML); default: the example suite's, "
                                                     "envs/example_suite/rl.toml.")] = None,
    check_only: Annotated[bool, typer.Option("--check", help="Check the config and exit.")] = False,
) -> None:
    """Asynchronous RL over a suite as one job: rollouts, evaluation and the trainer, resumed
    by running the same command again. Extra `--section.key=value` arguments override the
    config (e.g. --job.steps=8 --trainer.optim.lr=3e-5)."""
    from rich.console import Console

    from service import rl as job
    from service.log import setup_logging

    settings = _settings()
    path = config or job.EXAMPLE_CONFIG
    if not path.is_file():
        typer.secho(f"--config {path}: no such file", fg="red", err=True)
        raise typer.Exit(2)
    try:
        cfg = job.load(path, ctx.args)
        job.check(cfg)
    except job.ConfigError as e:
        typer.secho(f"{path}: {e}", fg="red", err=True)
        raise typer.Exit(2) from e
    if check_only:
        typer.echo(f"{path}: ok")
        return
    if settings.local_mode and not is_loopback(cfg.serve.host):
        typer.secho(f"SWERVE_API_TOKEN is unset: refusing to listen on {cfg.serve.host}.", fg="red", err=True)
        raise typer.Exit(2)
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    log_path = settings.data_dir / "swerve-rl.log"
    setup_logging(settings.log_format, level="INFO", path=log_path)
    typer.echo(f"log: {log_path}")
    try:
        status = asyncio.run(job.run_job(settings, cfg, Console(width=None if sys.stdout.isatty() else 160)))
    except KeyboardInterrupt:
        typer.echo("stopped (a job that had not finished resumes with the same command)")
        raise typer.Exit(130) from None
    except job.ConfigError as e:
        typer.secho(f"{path}: {e}", fg="red", err=True)
        raise typer.Exit(2) from e
    except (RuntimeError, TimeoutError) as e:
        typer.secho(str(e), fg="red", err=True)
        raise typer.Exit(1) from e
    if status != "finished":
        raise typer.Exit(1)


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def train(
    ctx: typer.Context,
    config: Annotated[Path, typer.Option(exists=True, dir_okay=False, help="Trainer config (TOML).")],
    nproc: Annotated[int, typer.Option(min=1, help="Processes on this machine (torchrun); the config's "
                                                   "parallelism.world_size must match the whole job's.")] = 1,
) -> None:
    """Train on the buffer's ready groups, publish each new policy and reload the fleet: the
    trainer's own process, `python -m trainer`, takes this process's place. Extra
    `--section.key=value` arguments override the config; `--check` checks the layout only.
    Several processes (FSDP2, expert parallel): `--nproc N`, or
    `torchrun --nproc_per_node N -m trainer ...`."""
    import os
    import sys

    os.execv(sys.executable, [sys.executable, "-m", "trainer", f"--config={config}", f"--nproc={nproc}", *ctx.args])


@app.command("eval")
def eval_predictions(
    predictions: Annotated[Path, typer.Argument(exists=True, dir_okay=False, readable=True,
                                                help="SWE-bench predictions: instance_id, model_name_or_path, "
                                                     "model_patch (JSON Lines, or JSON).")],
    suite: Annotated[str, typer.Option(help="The suite the predictions are for: a suite file (JSON Lines, JSON or "
                                            "Parquet), or the name or id of an imported suite.")],
    run_id: Annotated[str, typer.Option(help="Names this evaluation; rerun with it to resume.")] = "swerve-eval",
    out: Annotated[Path, typer.Option(help="Where reports go (SWE-bench's layout).")] = Path("evaluation_results"),
    backend: Annotated[str, typer.Option(help="Sandbox backend: bwrap or docker.")] = "bwrap",
    concurrency: Annotated[int, typer.Option(min=1, help="Predictions graded at once.")] = 4,
    format: Annotated[str, typer.Option("--format", help="The suite rows' dataset (auto: told from each row).")] = "auto",  # noqa: A002
) -> None:
    """Grade predictions as the SWE-bench harness does; print its run report (resolved_ids, ...)."""
    from envs.datasets import DatasetRowError, load_tasks
    from envs.predictions import PredictionsError, evaluate, load_predictions
    from envs.swe_env import EXAMPLE_BUNDLES, SWEEnvConfig

    settings = _settings()
    try:
        preds = load_predictions(predictions)
        if Path(suite).is_file():
            tasks, bundles = load_tasks(Path(suite), format), (Path(suite).parent / "bundles",)
        else:
            tasks, bundles = _imported_suite(settings, suite), ()
        cfg = SWEEnvConfig(backend=backend, image_cache_dir=settings.data_dir / "images",
                           bundle_dirs=(*bundles, settings.data_dir / "bundles", EXAMPLE_BUNDLES))
        report = asyncio.run(evaluate(preds, tasks, cfg, out, run_id, concurrency,
                                      progress=lambda iid, verdict: typer.echo(f"{iid}: {verdict}", err=True)))
    except (PredictionsError, DatasetRowError) as e:
        typer.secho(str(e), fg="red", err=True)
        raise typer.Exit(2) from e
    json.dump(report, sys.stdout, indent=1)
    sys.stdout.write("\n")


def _imported_suite(settings, name_or_id: str) -> list:
    """The tasks of a live imported suite named (or with the id) `name_or_id`; exits 2 if none."""
    import uuid

    import sqlalchemy as sa

    from service.store import db
    from service.store.tables import Suite, Task
    from service.store.tasks import task_from_row

    try:
        key = Suite.id == uuid.UUID(name_or_id)
    except ValueError:
        key = Suite.name == name_or_id
    engine = db.make_engine(settings.resolved_database_url)
    try:
        with engine.connect() as conn:
            suite_id = conn.execute(sa.select(Suite.id).where(key, Suite.deleted_at.is_(None))).scalar()
            rows = conn.execute(sa.select(Task).where(Task.suite_id == suite_id).order_by(Task.position)).all()
    finally:
        engine.dispose()
    if suite_id is None:
        typer.secho(f"--suite: {name_or_id!r} is neither a file nor an imported suite's name or id "
                    "(GET /api/v1/suites lists them)", fg="red", err=True)
        raise typer.Exit(2)
    return [task_from_row(r) for r in rows]


@app.command("export")
def export_run(
    run: Annotated[str, typer.Argument(help="The run's id, or its name when one run has it.")],
    format: Annotated[str, typer.Option("--format", "-f", help="jsonl or parquet.")] = "jsonl",  # noqa: A002
    out: Annotated[Path | None, typer.Option(help="The file to write (default: run-<id>.<format>).")] = None,
    min_reward: Annotated[float | None, typer.Option(help="Keep episodes with at least this reward.")] = None,
    max_reward: Annotated[float | None, typer.Option(help="Keep episodes with at most this reward.")] = None,
    status: Annotated[list[str] | None, typer.Option(help="Keep episodes of this status (repeatable).")] = None,
) -> None:
    """Write a run's episodes as a dataset (one row per episode: messages, tool calls, token ids,
    logprobs, reward, grading report) that Hugging Face `datasets` loads as it is."""
    import uuid as uuid_

    import sqlalchemy as sa

    from service.control import export
    from service.control.redaction import Answers
    from service.control.views import NotFound
    from service.store.db import make_async_engine
    from service.store.tables import Run

    settings = _settings()
    try:
        fmt = export.check_format(format)
        flt = export.ExportFilter(min_reward=min_reward, max_reward=max_reward, statuses=tuple(status or ()))
    except export.ExportError as e:
        typer.secho(str(e), fg="red", err=True)
        raise typer.Exit(2) from e

    async def main() -> dict:
        engine = make_async_engine(settings.resolved_database_url)
        try:
            try:
                run_id = uuid_.UUID(run)
            except ValueError:
                async with engine.connect() as conn:
                    ids = (await conn.execute(sa.select(Run.id).where(Run.name == run))).scalars().all()
                if len(ids) != 1:
                    raise NotFound(f"run: {len(ids)} runs are named {run!r}; give the run's id "
                                   "(GET /api/v1/runs lists them)") from None
                run_id = ids[0]
            path = out or Path(f"run-{run_id}.{fmt}")
            tmp = path.with_name(f".{path.name}.partial")
            counts = {"rows": 0}
            try:
                with open(tmp, "wb") as f:
                    async for chunk in export.stream(engine, run_id, fmt, Answers(shown=True), flt, counts=counts):
                        f.write(chunk)
                tmp.replace(path)
            finally:
                tmp.unlink(missing_ok=True)
            return {"run_id": str(run_id), "path": str(path), "format": fmt, "rows": counts["rows"],
                    "bytes": path.stat().st_size}
        finally:
            await engine.dispose()

    try:
        result = asyncio.run(main())
    except NotFound as e:
        typer.secho(str(e), fg="red", err=True)
        raise typer.Exit(1) from e
    json.dump(result, sys.stdout)
    sys.stdout.write("\n")


@app.command()
def worker(
    concurrency: Annotated[int, typer.Option(min=1, help="Episodes in flight in this process (they share one event loop).")] = 64,
    loglevel: Annotated[str, typer.Option(help="Celery log level.")] = "INFO",
) -> None:
    """Run a Celery worker on SWERVE_BROKER_URL."""
    settings = _settings()
    if settings.broker_url.startswith("memory://"):
        typer.secho("SWERVE_BROKER_URL is memory:// (embedded): a separate worker cannot reach "
                    "it; set a redis:// broker URL", fg="red", err=True)
        raise typer.Exit(2)
    from service.worker.app import QUEUE, app as celery

    from service.worker.runtime import runtime

    runtime(settings)  # the loop every episode of this process runs on
    celery.worker_main(["worker", "--pool=threads", f"--concurrency={concurrency}", f"--loglevel={loglevel}",
                        f"--queues={QUEUE}", "--hostname=swerve@%h"])


@db_app.command("upgrade")
def db_upgrade(revision: str = "head") -> None:
    """Migrate the database up (to the latest revision by default)."""
    from service.store import db

    url = _settings().resolved_database_url
    db.upgrade(url, revision)
    typer.echo(f"database at revision {db.current_revision(url)}")


@db_app.command("downgrade")
def db_downgrade(revision: Annotated[str, typer.Argument(help="Target, e.g. base or -1.")]) -> None:
    """Migrate the database down."""
    from service.store import db

    url = _settings().resolved_database_url
    db.downgrade(url, revision)
    typer.echo(f"database at revision {db.current_revision(url)}")


class _progress:
    """A live progress line on stderr (rich, as `swerve run` shows its own) while a long
    command works: `with _progress("importing x", total=n) as advance: advance(done)`. Off
    the terminal it prints a plain line every few seconds, so logs show it too."""

    def __init__(self, what: str, total: int | None = None, unit: str = ""):
        self.what, self.total, self.unit = what, total, unit

    def __enter__(self):
        import time

        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        console = Console(stderr=True)
        if console.is_terminal:
            columns = [TextColumn("{task.description}"), BarColumn() if self.total else TextColumn(""),
                       MofNCompleteColumn() if self.total else TextColumn("{task.completed} " + self.unit),
                       TimeElapsedColumn()]
            self.bar = Progress(*columns, console=console, transient=True)
            self.bar.start()
            task = self.bar.add_task(self.what, total=self.total)
            return lambda done: self.bar.update(task, completed=done)
        self.bar, self.done, last = None, None, [0.0]

        def line(done):
            self.done = done
            if time.monotonic() - last[0] >= 5:
                last[0] = time.monotonic()
                self._echo(done)
        return line

    def _echo(self, done) -> None:
        typer.echo(f"{self.what}: {done}{f'/{self.total}' if self.total else ''} {self.unit}".rstrip(), err=True)

    def __exit__(self, *exc):
        if self.bar is not None:
            self.bar.stop()
        elif self.done is not None:
            self._echo(self.done)  # where it ended


@suite_app.command("import")
def suite_import(
    file: Annotated[Path, typer.Argument(exists=True, dir_okay=False, readable=True)],
    name: Annotated[str | None, typer.Option(help="Suite name (default: the file's stem).")] = None,
    skip_existing: Annotated[bool, typer.Option(help="Do nothing if a suite of that name exists.")] = False,
    format: Annotated[str, typer.Option("--format", help="The rows' dataset: auto, swe-bench, swe-gym, "  # noqa: A002
                                        "swe-smith, swe-rebench or r2e-gym.")] = "auto",
) -> None:
    """Import a suite (JSON Lines, a JSON array or Parquet, rows as the dataset ships them); a
    bad record imports nothing."""
    from service.control import suites
    from service.store.db import make_async_engine

    settings = _settings()

    async def run(advance) -> suites.ImportResult:
        async def counted(records):
            n = 0
            async for record in records:
                n += 1
                if n % 100 == 0:
                    advance(n)
                yield record
            advance(n)

        engine = make_async_engine(settings.resolved_database_url)
        try:
            return await suites.import_suite(
                engine, name or file.stem, counted(suites.records_of_file(str(file))),
                max_listed_errors=settings.max_listed_errors, fmt=format,
            )
        finally:
            await engine.dispose()

    try:
        with _progress(f"importing {file.name}", unit="records") as advance:
            result = asyncio.run(run(advance))
    except suites.SuiteRejected as e:
        for err in e.errors:
            where = f"line {err.line}" if err.line is not None else f"index {err.index}"
            typer.echo(f"{file}:{where}: {err.instance_id or '-'}: {err.field or '(record)'}: "
                       f"{err.message}", err=True)
        typer.secho(str(e), fg="red", err=True)
        raise typer.Exit(1) from e
    except suites.SuiteNameTaken as e:
        if skip_existing:
            typer.echo(f"suite {name or file.stem!r} already imported")
            return
        typer.secho(str(e), fg="red", err=True)
        raise typer.Exit(1) from e
    except suites.SuiteImportError as e:
        typer.secho(str(e), fg="red", err=True)
        raise typer.Exit(1) from e
    json.dump({"id": str(result.suite_id), "name": result.name,
               "task_count": result.task_count}, sys.stdout)
    sys.stdout.write("\n")


@suite_app.command("validate")
def suite_validate(
    file: Annotated[Path, typer.Argument(exists=True, dir_okay=False, readable=True)],
    only: Annotated[list[str] | None, typer.Option(help="Validate only these instance ids.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print a JSON list instead of a table.")] = False,
    backend: Annotated[str, typer.Option(help="Sandbox backend: bwrap or docker.")] = "bwrap",
    concurrency: Annotated[int, typer.Option(min=1)] = 4,
    format: Annotated[str, typer.Option("--format", help="The rows' dataset (auto: told from each row).")] = "auto",  # noqa: A002
) -> None:
    """Check every task: the gold patch must be FULL, the empty patch must fail every FAIL_TO_PASS."""
    from rich.console import Console
    from rich.table import Table

    from envs.datasets import DatasetRowError, load_tasks
    from envs.swe_env import SWEEnvConfig
    from envs.validate import validate_suite

    settings = _settings()
    try:
        tasks = load_tasks(file, format)
    except DatasetRowError as e:
        typer.secho(str(e), fg="red", err=True)
        raise typer.Exit(2) from e
    if only:
        missing = set(only) - {t.instance_id for t in tasks}
        if missing:
            typer.secho(f"not in {file}: {', '.join(sorted(missing))}", fg="red", err=True)
            raise typer.Exit(2)
        tasks = [t for t in tasks if t.instance_id in only]
    cfg = SWEEnvConfig(backend=backend, image_cache_dir=settings.data_dir / "images",
                       bundle_dirs=(file.parent / "bundles", settings.data_dir / "bundles"))
    def said(r, done: int, total: int) -> None:
        verdict = "valid" if r.valid else f"NOT valid: {r.error}"
        typer.echo(f"[{done}/{total}] {r.instance_id}: {verdict} (gold {r.gold_s:.1f} s, empty {r.empty_s:.1f} s)",
                   err=True)

    typer.echo(f"validating {len(tasks)} task(s), {concurrency} at once: each environment is built first "
               "(minutes for a large install), then the gold and the empty patch are graded", err=True)
    results = asyncio.run(validate_suite(tasks, cfg, concurrency, progress=said))
    if as_json:
        json.dump([r.to_json() for r in results], sys.stdout, indent=1)
        sys.stdout.write("\n")
    else:
        table = Table(title=f"{file.name}: {sum(r.valid for r in results)}/{len(results)} valid")
        for column in ("instance", "valid", "gold", "empty", "gold s", "empty s", "problem"):
            table.add_column(column, no_wrap=column == "instance", overflow="fold")
        for r in results:
            table.add_row(r.instance_id, "yes" if r.valid else "NO", (r.gold or {}).get("resolution", "-"),
                          (r.empty or {}).get("resolution", "-"), f"{r.gold_s:.2f}", f"{r.empty_s:.2f}", r.error or "")
        console = Console()
        widest = max((len(r.instance_id) for r in results), default=8) + 60  # an instance id is never cut
        (console if console.width >= widest else Console(width=widest)).print(table)
    if not all(r.valid for r in results):
        raise typer.Exit(1)


@suite_app.command("generate")
def suite_generate(
    family: Annotated[str, typer.Option(help="Task family (envs/families.py), e.g. pyfix.")],
    n: Annotated[int, typer.Option(min=1, help="Tasks to generate.")],
    seed: Annotated[int, typer.Option(min=0, help="Seed; the same arguments give the same bytes.")],
    split: Annotated[str, typer.Option(help="train, heldout (names and constants train never uses) "
                                            "or heldout-templates (bug templates train never uses).")],
    out: Annotated[Path, typer.Option(dir_okay=False, help="The suite file to write (JSONL).")],
    bundles_dir: Annotated[Path | None, typer.Option(file_okay=False, help="Where the tasks' git bundles go "
                                                     "(default: $SWERVE_DATA_DIR/bundles, where workers look).")] = None,
    distractors: Annotated[int | None, typer.Option(min=0, help="Other functions beside the buggy one "
                                                    "(difficulty; default: the family's).")] = None,
    names: Annotated[str, typer.Option(help="pools: the split's name pools; generated (train only): every "
                                            "name made up, so a policy must copy names, not recall them; "
                                            "words (train only): names from a list of 3000 words, none held "
                                            "out.")] = "pools",
) -> None:
    """Generate a suite of small SWE tasks, one git bundle per task, tests measured on this host."""
    from envs.families import GenerationError, generate

    bundles = bundles_dir or _settings().data_dir / "bundles"
    try:
        with _progress(f"generating {family} tasks", total=n) as advance:
            rows = generate(family, n, seed, split, out, bundles_dir=bundles, distractors=distractors,
                            progress=lambda done, _: advance(done), names=names)
    except ValueError as e:
        typer.secho(str(e), fg="red", err=True)
        raise typer.Exit(2) from e
    except GenerationError as e:
        typer.secho(str(e), fg="red", err=True)
        raise typer.Exit(1) from e
    typer.echo(f"{len(rows)} {family} tasks ({split}, seed {seed}) -> {out}; bundles in {bundles}")


@model_app.command("init-tiny")
def model_init_tiny(
    out: Annotated[Path, typer.Argument(help="Folder to write the model into.")],
    moe: Annotated[bool, typer.Option(help="Qwen3-MoE (8 experts, top-2) instead of dense Qwen3.")] = False,
    seed: Annotated[int, typer.Option(help="Seed of the random weights.")] = 0,
) -> None:
    """Write a tiny random Qwen3 model with a locally trained tokenizer and chat template."""
    from service.fleet.tiny_model import TinyModelSpec, init_tiny

    init_tiny(out, TinyModelSpec(moe=moe, seed=seed))
    typer.echo(f"wrote {'Qwen3-MoE' if moe else 'Qwen3'} tiny model to {out}")


@inference_app.command("serve")
def inference_serve(
    model: Annotated[Path, typer.Option(exists=True, file_okay=False, help="Model folder.")],
    port: Annotated[int, typer.Option(help="Port to listen on.")] = 8100,
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    version: Annotated[int, typer.Option(min=0, help="Policy version these weights are.")] = 0,
    max_model_len: Annotated[int, typer.Option(min=256, help="Context length (tokens).")] = 32768,
) -> None:
    """Start a vLLM server (SWERVE_VLLM_PYTHON), wait until healthy, report its version."""
    import signal as signals

    from service.fleet.server import VLLMServer, set_version

    server = VLLMServer(model, port, host=host, max_model_len=max_model_len,
                        log_path=_settings().data_dir / f"vllm-{port}.log")
    server.log_path.parent.mkdir(parents=True, exist_ok=True)
    typer.echo(" ".join(server.command()))
    server.start()
    try:
        server.wait_ready()
        set_version(server.url, version)
        typer.echo(f"vLLM ready on {server.url}, serving policy version {server.served_version()} "
                   f"(log: {server.log_path})")
        signals.signal(signals.SIGTERM, lambda *_: server.stop())
        server.proc.wait()
    except KeyboardInterrupt:
        pass
    except (RuntimeError, TimeoutError) as e:
        typer.secho(str(e), fg="red", err=True)
        raise typer.Exit(1) from e
    finally:
        server.stop()


@inference_app.command("plan")
def inference_plan(
    model: Annotated[str, typer.Option(help="Model path or name on the nodes.")],
    nodes: Annotated[int, typer.Option(min=1, help="Nodes in the deployment.")],
    gpus_per_node: Annotated[int, typer.Option(min=1)] = 8,
    preset: Annotated[str, typer.Option(help="wide-ep, pd-disagg or dense.")] = "wide-ep",
    output: Annotated[str, typer.Option(help="shell, compose or k8s.")] = "shell",
) -> None:
    """Print the vLLM server commands (and a compose or Kubernetes snippet) for a deployment."""
    from service.fleet.plan import DeploymentConfig, render

    try:
        cfg = DeploymentConfig.preset(preset, model=model, nodes=nodes, gpus_per_node=gpus_per_node)
    except ValueError as e:
        typer.secho(str(e), fg="red", err=True)
        raise typer.Exit(2) from e
    typer.echo(render(cfg, output))


if __name__ == "__main__":
    app()
