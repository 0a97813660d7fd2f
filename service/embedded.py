"""Embedded mode: the whole service in one process.

`run_embedded` is `swerve run`:
database, suite, tiny model, a local vLLM CPU server, the API with its orchestrators and an
in-process worker, a live progress bar, a summary table; then it keeps serving.
"""

from __future__ import annotations

import asyncio
import logging
from contextlib import asynccontextmanager
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine

from service.config import Settings

logger = logging.getLogger(__name__)
REPO = Path(__file__).resolve().parent.parent
EXAMPLE_SUITE = REPO / "envs" / "example_suite" / "suite.jsonl"


@dataclass
class EmbeddedOptions:
    suite: Path = EXAMPLE_SUITE
    sampler: str = "vllm"
    """vllm: the tiny model on a local vLLM CPU server; oracle: gold patches (no model)."""
    endpoints: tuple[str, ...] = ()
    """vLLM servers already running (serving `model`): no local server is started."""
    model: Path | None = None
    """Model folder; None: a tiny Qwen3 created under the models folder."""
    samples_per_task: int = 2
    concurrency: int = 8
    max_turns: int = 8
    max_tokens: int = 256
    host: str = "127.0.0.1"
    port: int = 8000
    vllm_port: int = 8100
    serve_after: bool = True
    instance_ids: tuple[str, ...] = ()
    """Only these tasks (empty: all)."""


async def progress_counts(engine: AsyncEngine, run_id: uuid.UUID) -> dict:
    """The API's progress of the run, with the token split and the turns for the summary."""
    from service.control.redaction import Answers
    from service.control.views import progress
    from service.store.db import session_factory
    from service.store.tables import Episode, Run

    async with session_factory(engine)() as session:
        state = await progress(session, await session.get(Run, run_id), Answers(shown=True))
        split = (await session.execute(sa.select(
            sa.func.coalesce(sa.func.sum(Episode.input_tokens), 0), sa.func.coalesce(sa.func.sum(Episode.output_tokens), 0),
            sa.func.coalesce(sa.func.sum(Episode.n_turns), 0)).where(Episode.run_id == run_id))).one()  # fmt: skip
    return state | {"input_tokens": split[0], "output_tokens": split[1], "turns": split[2]}


def summary_table(run_id: uuid.UUID, state: dict, elapsed_s: float):
    from rich.table import Table

    total, final = sum(state["episodes"].values()), state["final"]
    table = Table(title=f"run {run_id}: {state['status']}", show_header=False)
    table.add_column(style="bold", no_wrap=True)
    table.add_column()
    table.add_row("episodes", f"{final}/{total} final")
    if state.get("error"):
        table.add_row("error", state["error"])
    for status, n in sorted(state["episodes"].items()):
        table.add_row(f"  {status}", str(n))
    reward = state["reward_mean"]
    table.add_row("reward mean", "-" if reward is None else f"{reward:.3f} over {state['graded']} graded")
    if state["pass_at_1"] is not None:
        table.add_row("pass@1", f"{state['pass_at_1']:.3f}")
        table.add_row("pass@k", f"{state['pass_at_k']:.3f}")
    table.add_row("turns", f"{state['turns']} ({state['turns'] / max(final, 1):.1f} per episode)")
    table.add_row("tokens", f"{state['input_tokens']:,} in, {state['output_tokens']:,} sampled")
    table.add_row("time", f"{elapsed_s:.1f} s ({final / max(elapsed_s, 1e-9):.2f} episodes/s)")
    return table


async def run_embedded(settings: Settings, opts: EmbeddedOptions, console) -> str:
    """Returns the run's final status (after serving, when serve_after)."""
    from service.store import db

    url = settings.resolved_database_url
    db.upgrade(url)
    suite_id = await import_suite(settings, opts.suite, console)
    model = opts.model or tiny_model(settings, console)
    vllm = None
    endpoints = list(opts.endpoints)
    if opts.sampler == "vllm" and not endpoints:
        vllm = start_vllm(settings, model, opts.vllm_port, console)
        endpoints = [vllm.url]
    try:
        async with serve_app(settings, opts.host, opts.port) as (app, serving):
            return await _sample(app, serving, opts, suite_id, model, endpoints, console)
    finally:
        if vllm is not None:
            vllm.stop()


@asynccontextmanager
async def serve_app(settings: Settings, host: str, port: int):
    """The API and UI served in this process (with its orchestrators and, on the embedded broker,
    its worker), once it listens: yields the app and the serving task (await it to serve until
    Ctrl-C); stopped on the way out."""
    import uvicorn

    from service.app import create_app

    app = create_app(settings)
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_config=None, log_level="warning"))
    serving = asyncio.get_running_loop().create_task(server.serve())
    try:
        while not server.started:
            if serving.done():
                await serving
                raise RuntimeError(f"the API could not listen on {host}:{port}")
            await asyncio.sleep(0.05)
        yield app, serving
    finally:
        server.should_exit = True
        try:
            await asyncio.wait_for(serving, 60)
        except (asyncio.TimeoutError, asyncio.CancelledError, SystemExit):
            pass


async def _sample(app, serving, opts: EmbeddedOptions, suite_id: uuid.UUID, model: Path, endpoints: list[str],
                  console) -> str:  # fmt: skip
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from service.control.runs import create_run
    from service.store.status import RUN_ACTIVE
    from service.worker.config import RunConfig

    sampler = ({"type": "vllm", "endpoints": endpoints, "tokenizer": str(model)} if opts.sampler == "vllm"
               else {"type": opts.sampler, "tokenizer": str(model)})  # fmt: skip
    cfg = RunConfig.model_validate({
        "suite_id": suite_id, "name": f"embedded {opts.suite.name}", "sampler": sampler,
        "samples_per_task": opts.samples_per_task, "concurrency": opts.concurrency,
        "agent": {"max_turns": opts.max_turns, "sampling": {"max_tokens": opts.max_tokens}},
    } | ({"instance_ids": list(opts.instance_ids)} if opts.instance_ids else {}))  # fmt: skip
    engine: AsyncEngine = app.state.engine
    run_id = await create_run(engine, cfg)
    app.state.supervisor.start(run_id)
    console.print(f"run {run_id}: {opts.suite.name}, sampler {opts.sampler}, "
                  f"{opts.samples_per_task} samples per task, {opts.concurrency} in flight")
    started = time.monotonic()
    columns = (TextColumn("[bold]episodes"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
               TextColumn("{task.fields[detail]}"))
    with Progress(*columns, console=console) as bar:
        job = bar.add_task("episodes", total=None, detail="")
        while True:
            state = await progress_counts(engine, run_id)
            total = sum(state["episodes"].values())
            final = state["final"]
            reward = "-" if state["reward_mean"] is None else f"{state['reward_mean']:.2f}"
            detail = (f"running {state['episodes'].get('running', 0)}  reward {reward}  "
                      f"tokens {state['input_tokens'] + state['output_tokens']:,}")
            bar.update(job, total=total, completed=final, detail=detail)
            if state["status"] not in RUN_ACTIVE:
                break
            await asyncio.sleep(0.5)
    console.print(summary_table(run_id, state, time.monotonic() - started))
    if opts.serve_after:
        console.print(f"the service stays up: http://{opts.host}:{opts.port}/  "
                      f"(API docs: http://{opts.host}:{opts.port}/docs); Ctrl-C stops it")
        await serving
    return state["status"]


async def import_suite(settings: Settings, path: Path, console) -> uuid.UUID:
    """The suite named after the file (its folder for a plain suite.jsonl), imported on first use."""
    from service.control import suites
    from service.store.db import make_async_engine
    from service.store.tables import Suite

    name = path.parent.name if path.stem == "suite" else path.stem
    engine = make_async_engine(settings.resolved_database_url)
    try:
        async with engine.connect() as conn:
            existing = await conn.scalar(sa.select(Suite.id).where(Suite.name == name, Suite.deleted_at.is_(None)))
        if existing is not None:
            return existing
        parse = suites.parser_for_file(str(path))
        result = await suites.import_suite(engine, name, parse(suites.file_chunks(str(path))),
                                           max_listed_errors=settings.max_listed_errors)
        console.print(f"imported suite {result.name!r}: {result.task_count} tasks")
        return result.suite_id
    finally:
        await engine.dispose()


def tiny_model(settings: Settings, console) -> Path:
    from service.fleet.tiny_model import init_tiny

    folder = (settings.resolved_models_dir / "tiny-qwen3").resolve()
    if not (folder / "config.json").exists():
        init_tiny(folder)
        console.print(f"created the tiny Qwen3 model in {folder}")
    return folder


def start_vllm(settings: Settings, model: Path, port: int, console, *, max_model_len: int = 8192,
               die_with_parent: bool = False):  # fmt: skip
    """A local vLLM CPU server with `model`, ready."""
    from service.fleet.server import VLLMServer, vllm_python

    if not Path(vllm_python()).exists():
        raise RuntimeError(f"vLLM's Python is not at {vllm_python()}: run `make vllm` (or set "
                           "SWERVE_VLLM_PYTHON), or use `swerve run --sampler oracle`")
    log = (settings.data_dir / f"vllm-{port}.log").resolve()
    log.parent.mkdir(parents=True, exist_ok=True)
    server = VLLMServer(model, port, max_model_len=max_model_len, log_path=log, die_with_parent=die_with_parent).start()
    with console.status(f"starting vLLM (CPU) on {server.url} with {model.name} (about a minute; log: {log})"):
        try:
            server.wait_ready()
        except BaseException:
            server.stop()
            raise
    console.print(f"vLLM ready on {server.url}")
    return server
