"""Shared fixtures: real PostgreSQL and SQLite databases, the app over ASGI, task factories.

A missing service skips its tests on a laptop and fails them under SWERVE_REQUIRE_SERVICES=1.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest
import sqlalchemy as sa

from service.store import db
from service.app import create_app
from service.config import load_settings

TOKEN = "test-token-0123456789abcdef"
PG_ADMIN_URL = os.environ.get(
    "SWERVE_TEST_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/postgres"
)
# The operator's allowances of a test deployment (service.control.admission): the fleets under
# test listen on loopback and the tiny models live in pytest's temporary folders. Set before any
# settings are read, so servers started as subprocesses have them too.
os.environ.setdefault("SWERVE_ENDPOINT_HOSTS", "127.0.0.1,localhost")
os.environ.setdefault("SWERVE_MODEL_ROOTS", tempfile.gettempdir())
# The engine tests run on is overlay2 on ext4, which cannot limit a container's disk: accepted
# here, as an operator may; tests/test_sandboxes.py proves the limit on a btrfs engine.
os.environ.setdefault("SWERVE_DOCKER_DISK_LIMIT", "tmp-only")
# The bubblewrap launcher (sandboxes/launcher.py) is a per-host cache, built once for the whole
# session rather than into each test's own sandbox state folder, which tests expect to find empty
# once their sandboxes are gone. Its folder's parent must be private to this user: mkdtemp's is.
if "SWERVE_LAUNCHER_DIR" not in os.environ:
    _launcher_parent = tempfile.mkdtemp(prefix="swerve-test-launcher-")
    atexit.register(shutil.rmtree, _launcher_parent, True)
    os.environ["SWERVE_LAUNCHER_DIR"] = os.path.join(_launcher_parent, "bin")
DEPLOYMENT = {k: os.environ[k] for k in ("SWERVE_ENDPOINT_HOSTS", "SWERVE_MODEL_ROOTS", "SWERVE_DOCKER_DISK_LIMIT",
                                         "SWERVE_LAUNCHER_DIR")}


def clean_env() -> dict[str, str]:
    """The environment for a `swerve` process under test: none of this shell's SWERVE_
    settings but the test deployment's allowances above."""
    return {k: v for k, v in os.environ.items() if not k.startswith("SWERVE_")} | DEPLOYMENT
TABLES = ("evaluation_instances", "evaluations", "turns", "episodes", "groups", "runs", "tasks", "suites", "policies")


def services_required() -> bool:
    return os.environ.get("SWERVE_REQUIRE_SERVICES") == "1"


def missing_service(what: str) -> None:
    """Skip on a laptop; fail in CI (SWERVE_REQUIRE_SERVICES=1)."""
    if services_required():
        pytest.fail(f"{what} is required (SWERVE_REQUIRE_SERVICES=1) but not available")
    pytest.skip(f"{what} not available")


def require_torchtitan() -> None:
    """At the top of a trainer test module: skip on a laptop without torchtitan, fail in CI."""
    try:
        import torchtitan  # noqa: F401
    except ImportError:
        if services_required():
            raise
        pytest.skip("torchtitan is not installed (make install)", allow_module_level=True)


@pytest.fixture(scope="session")
def pg_admin_url() -> str:
    engine = db.make_engine(PG_ADMIN_URL)
    try:
        with engine.connect() as conn:
            conn.execute(sa.text("SELECT 1"))
    except sa.exc.OperationalError as e:
        missing_service(f"PostgreSQL at {PG_ADMIN_URL} ({e.orig})")
    finally:
        engine.dispose()
    return PG_ADMIN_URL


def create_pg_database(admin_url: str) -> str:
    return db.create_database(admin_url, f"swerve_test_{uuid.uuid4().hex[:12]}")


def drop_pg_database(admin_url: str, url: str) -> None:
    db.drop_database(admin_url, url)


@pytest.fixture
def empty_pg_url(pg_admin_url: str) -> Iterator[str]:
    """A new, empty PostgreSQL database (not migrated), dropped after the test."""
    url = create_pg_database(pg_admin_url)
    yield url
    drop_pg_database(pg_admin_url, url)


@pytest.fixture(scope="session")
def migrated_pg_url(pg_admin_url: str) -> Iterator[str]:
    url = create_pg_database(pg_admin_url)
    db.upgrade(url)
    yield url
    drop_pg_database(pg_admin_url, url)


@pytest.fixture(scope="session")
def sqlite_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("sqlite") / "template.db"
    db.upgrade(f"sqlite:///{path}")
    return path


def _truncate_pg(url: str) -> None:
    engine = db.make_engine(url)
    with engine.begin() as conn:
        conn.execute(sa.text(f"TRUNCATE {', '.join(TABLES)} CASCADE"))
    engine.dispose()


@pytest.fixture(params=["postgresql", "sqlite"])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A migrated, empty database of each kind (fresh per test)."""
    if request.param == "postgresql":
        url = request.getfixturevalue("migrated_pg_url")
        _truncate_pg(url)
        return url
    path = tmp_path / "swerve.db"
    shutil.copy(request.getfixturevalue("sqlite_template"), path)
    return f"sqlite:///{path}"


def make_settings(database_url: str, **overrides):
    """Settings for an app under test; no in-process worker unless a test asks for one."""
    return load_settings(database_url=database_url, **({"api_token": TOKEN, "embedded_worker": False} | overrides))


@pytest.fixture
async def app_client(db_url: str) -> AsyncIterator[httpx.AsyncClient]:
    """An httpx client over ASGI against the app with an API token configured."""
    async with client_for(make_settings(db_url)) as client:
        yield client


class client_for:
    """Async context manager: the app's lifespan plus an httpx client bound to it."""

    def __init__(self, settings):
        self.app = create_app(settings)

    async def __aenter__(self) -> httpx.AsyncClient:
        self._lifespan = self.app.router.lifespan_context(self.app)
        await self._lifespan.__aenter__()
        transport = httpx.ASGITransport(app=self.app)
        self.client = httpx.AsyncClient(transport=transport, base_url="http://localhost")
        return self.client

    async def __aexit__(self, *exc) -> None:
        await self.client.aclose()
        await self._lifespan.__aexit__(*exc)


def auth() -> dict[str, str]:
    return {"Authorization": f"Bearer {TOKEN}"}


def count_rows(url: str) -> dict[str, int]:
    engine = db.make_engine(url)
    with engine.connect() as conn:
        counts = {t: conn.execute(sa.text(f"SELECT count(*) FROM {t}")).scalar() for t in TABLES}
    engine.dispose()
    return counts


from tests.vllm_fixtures import vllm_fleet  # noqa: E402, F401 - one fleet per session, for every module


COMPOSE_TESTS = "tests/test_compose_up.py::"


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    """The compose stack's tests run last, so the images they build for minutes (pip downloads and
    unpacking more than CPU) are built meanwhile (tests/test_compose_up.Prebuild)."""
    compose = [item for item in items if item.nodeid.startswith(COMPOSE_TESTS)]
    if compose:
        items[:] = [item for item in items if not item.nodeid.startswith(COMPOSE_TESTS)] + compose


def pytest_collection_finish(session: pytest.Session) -> None:
    items = session.items
    if session.config.option.collectonly:
        return
    if any(item.nodeid.startswith(COMPOSE_TESTS) for item in items) and not items[0].nodeid.startswith(COMPOSE_TESTS):
        from tests.test_compose_up import prebuild

        prebuild.start()
