"""Migrations run up and back down on PostgreSQL and SQLite, and match the tables in code."""

from __future__ import annotations

import pytest
import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext

from service.store import db


@pytest.fixture(params=["postgresql", "sqlite"])
def empty_url(request: pytest.FixtureRequest, tmp_path) -> str:
    if request.param == "postgresql":
        return request.getfixturevalue("empty_pg_url")
    return f"sqlite:///{tmp_path / 'empty.db'}"


def _tables(url: str) -> set[str]:
    engine = db.make_engine(url)
    try:
        return set(sa.inspect(engine).get_table_names()) - {"alembic_version"}
    finally:
        engine.dispose()


def test_upgrade_then_downgrade_then_upgrade(empty_url: str):
    db.upgrade(empty_url)
    assert _tables(empty_url) == set(db.metadata.tables)
    assert db.current_revision(empty_url) is not None

    db.downgrade(empty_url, "base")
    assert _tables(empty_url) == set()
    assert db.current_revision(empty_url) is None

    db.upgrade(empty_url)
    assert _tables(empty_url) == set(db.metadata.tables)


def test_migrations_match_the_tables_in_code(empty_url: str):
    db.upgrade(empty_url)
    engine = db.make_engine(empty_url)
    with engine.connect() as conn:
        diff = compare_metadata(MigrationContext.configure(conn), db.metadata)
    engine.dispose()
    assert diff == [], "tables changed without a migration: run alembic revision --autogenerate"
