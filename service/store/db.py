"""Engines, sessions and migrations for PostgreSQL (psycopg 3) and SQLite (aiosqlite)."""

from __future__ import annotations

from pathlib import Path

import sqlalchemy as sa
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker, create_async_engine

from service.store.tables import Base

MIGRATIONS_DIR = Path(__file__).resolve().parent / "migrations"
metadata = Base.metadata


def sync_url(url: str) -> str:
    """The URL with the synchronous driver we use: psycopg 3 or the builtin sqlite3."""
    u = make_url(url)
    if u.get_backend_name() == "postgresql":
        return u.set(drivername="postgresql+psycopg").render_as_string(hide_password=False)
    return u.set(drivername="sqlite").render_as_string(hide_password=False)


def async_url(url: str) -> str:
    u = make_url(url)
    driver = "postgresql+psycopg" if u.get_backend_name() == "postgresql" else "sqlite+aiosqlite"
    return u.set(drivername=driver).render_as_string(hide_password=False)


def libpq_url(url) -> str:
    """A PostgreSQL URL (str or sqlalchemy URL) as libpq takes it, for psycopg used directly."""
    return make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)


def _prepare_sqlite_file(url: str) -> None:
    database = make_url(url).database
    if database and database != ":memory:":
        Path(database).parent.mkdir(parents=True, exist_ok=True)


def _sqlite_pragmas(dbapi_conn, _record) -> None:
    cur = dbapi_conn.cursor()
    cur.execute("PRAGMA foreign_keys=ON")
    cur.execute("PRAGMA journal_mode=WAL")
    cur.execute("PRAGMA busy_timeout=30000")
    cur.close()


def make_engine(url: str, **kwargs) -> sa.Engine:
    url = sync_url(url)
    if url.startswith("sqlite"):
        _prepare_sqlite_file(url)
        engine = sa.create_engine(url, **kwargs)
        sa.event.listen(engine, "connect", _sqlite_pragmas)
        return engine
    return sa.create_engine(url, pool_pre_ping=True, **kwargs)


def make_async_engine(url: str, **kwargs) -> AsyncEngine:
    url = async_url(url)
    if url.startswith("sqlite"):
        _prepare_sqlite_file(url)
        engine = create_async_engine(url, **kwargs)
        sa.event.listen(engine.sync_engine, "connect", _sqlite_pragmas)
        return engine
    return create_async_engine(url, pool_pre_ping=True, **kwargs)


def session_factory(engine: AsyncEngine) -> async_sessionmaker[AsyncSession]:
    return async_sessionmaker(engine, expire_on_commit=False)


def create_database(admin_url: str, name: str) -> str:
    """Create an empty PostgreSQL database next to admin_url's; return its URL."""
    engine = make_engine(admin_url, isolation_level="AUTOCOMMIT")
    try:
        with engine.connect() as conn:
            conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
    finally:
        engine.dispose()
    return make_url(sync_url(admin_url)).set(database=name).render_as_string(hide_password=False)


def drop_database(admin_url: str, url: str) -> None:
    engine = make_engine(admin_url, isolation_level="AUTOCOMMIT")
    try:
        with engine.connect() as conn:
            conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{make_url(url).database}" WITH (FORCE)'))
    finally:
        engine.dispose()


def alembic_config(url: str):
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    cfg.set_main_option("sqlalchemy.url", sync_url(url).replace("%", "%%"))
    return cfg


def upgrade(url: str, revision: str = "head") -> None:
    from alembic import command

    if sync_url(url).startswith("sqlite"):
        _prepare_sqlite_file(sync_url(url))
    command.upgrade(alembic_config(url), revision)


def downgrade(url: str, revision: str = "base") -> None:
    from alembic import command

    command.downgrade(alembic_config(url), revision)


def current_revision(url: str) -> str | None:
    from alembic.runtime.migration import MigrationContext

    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            return MigrationContext.configure(conn).get_current_revision()
    finally:
        engine.dispose()
