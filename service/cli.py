"""The `swerve` command line."""

from __future__ import annotations

import asyncio
import ipaddress
import json
import sys
from pathlib import Path
from typing import Annotated

import typer

from service.config import Settings, SettingsError, get_settings

app = typer.Typer(help="swerve: SWE environments and rollouts for RL of coding agents.",
                  no_args_is_help=True, pretty_exceptions_enable=False)
db_app = typer.Typer(help="Database migrations.", no_args_is_help=True)
suite_app = typer.Typer(help="Task suites.", no_args_is_help=True)
app.add_typer(db_app, name="db")
app.add_typer(suite_app, name="suite")


def _settings() -> Settings:
    try:
        return get_settings()
    except SettingsError as e:
        typer.secho(str(e), fg="red", err=True)
        raise typer.Exit(2) from e


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _require_migrated(settings: Settings) -> None:
    from alembic.script import ScriptDirectory

    from service import db

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

    from service.api.main import create_app
    from service.log import setup_logging

    settings = _settings()
    setup_logging(settings.log_format)
    if settings.local_mode and not _is_loopback(host):
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
def worker(
    concurrency: Annotated[int, typer.Option(min=1, help="Worker processes.")] = 2,
    loglevel: Annotated[str, typer.Option(help="Celery log level.")] = "INFO",
) -> None:
    """Run a Celery worker on SWERVE_BROKER_URL."""
    settings = _settings()
    if settings.broker_url.startswith("memory://"):
        typer.secho("SWERVE_BROKER_URL is memory:// (embedded): a separate worker cannot reach "
                    "it; set a redis:// broker URL", fg="red", err=True)
        raise typer.Exit(2)
    from service.celery_app import app as celery

    celery.worker_main(["worker", f"--concurrency={concurrency}", f"--loglevel={loglevel}",
                        "--queues=swerve", "--hostname=swerve@%h"])


@db_app.command("upgrade")
def db_upgrade(revision: str = "head") -> None:
    """Migrate the database up (to the latest revision by default)."""
    from service import db

    url = _settings().resolved_database_url
    db.upgrade(url, revision)
    typer.echo(f"database at revision {db.current_revision(url)}")


@db_app.command("downgrade")
def db_downgrade(revision: Annotated[str, typer.Argument(help="Target, e.g. base or -1.")]) -> None:
    """Migrate the database down."""
    from service import db

    url = _settings().resolved_database_url
    db.downgrade(url, revision)
    typer.echo(f"database at revision {db.current_revision(url)}")


@suite_app.command("import")
def suite_import(
    file: Annotated[Path, typer.Argument(exists=True, dir_okay=False, readable=True)],
    name: Annotated[str | None, typer.Option(help="Suite name (default: the file's stem).")] = None,
) -> None:
    """Import a SWE-bench suite (JSONL or a JSON array); a bad record imports nothing."""
    from service import suites
    from service.db import make_async_engine

    settings = _settings()

    async def run() -> suites.ImportResult:
        engine = make_async_engine(settings.resolved_database_url)
        try:
            parse = suites.parser_for_file(str(file))
            return await suites.import_suite(
                engine, name or file.stem, parse(suites.file_chunks(str(file))),
                max_listed_errors=settings.max_listed_errors,
            )
        finally:
            await engine.dispose()

    try:
        result = asyncio.run(run())
    except suites.SuiteRejected as e:
        for err in e.errors:
            where = f"line {err.line}" if err.line is not None else f"index {err.index}"
            typer.echo(f"{file}:{where}: {err.instance_id or '-'}: {err.field or '(record)'}: "
                       f"{err.message}", err=True)
        typer.secho(str(e), fg="red", err=True)
        raise typer.Exit(1) from e
    except suites.SuiteImportError as e:
        typer.secho(str(e), fg="red", err=True)
        raise typer.Exit(1) from e
    json.dump({"id": str(result.suite_id), "name": result.name,
               "task_count": result.task_count}, sys.stdout)
    sys.stdout.write("\n")


if __name__ == "__main__":
    app()
