"""Schemathesis against our OpenAPI schema: no input, however odd, makes the API answer 500.

Runs against a real PostgreSQL database made for this module.
"""

from __future__ import annotations

import json
import uuid

import pytest
import sqlalchemy as sa
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from service.store import db
from service.app import create_app
from tests.conftest import PG_ADMIN_URL, TOKEN, drop_pg_database, make_settings

# The schema is read when the module is collected, and the app's start-up reads the database,
# so the database is made here; the fixture below drops it (or reports PostgreSQL missing).
try:
    DB_URL = db.create_database(PG_ADMIN_URL, f"swerve_test_fuzz_{uuid.uuid4().hex[:8]}")
    db.upgrade(DB_URL)
    DB_ERROR = None
except sa.exc.OperationalError as e:
    DB_URL, DB_ERROR = "postgresql://unavailable/none", e
schema = schemathesis.openapi.from_asgi("/openapi.json", create_app(make_settings(DB_URL)))


@schemathesis.serializer("application/x-ndjson")
def _ndjson(ctx, value):
    if isinstance(value, str):
        return value.encode()
    if isinstance(value, list):
        return "".join(json.dumps(v) + "\n" for v in value).encode()
    return json.dumps(value).encode()


@pytest.fixture(scope="module", autouse=True)
def fuzz_database(pg_admin_url):
    if DB_ERROR is not None:
        pytest.fail(f"could not create the fuzzing database: {DB_ERROR}")
    yield
    drop_pg_database(pg_admin_url, DB_URL)


@schema.parametrize()
@settings(max_examples=100, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                 HealthCheck.filter_too_much])
def test_api_never_answers_500(case):
    case.call_and_validate(
        headers={"Authorization": f"Bearer {TOKEN}"},
        checks=[not_a_server_error, status_code_conformance, content_type_conformance,
                response_schema_conformance],
    )


class Workflows(schema.as_state_machine()):
    """Stateful: sequences of calls chained through the links schemathesis infers (a suite's
    id from its upload to its tasks, its validation and its deletion; a run's id to its
    episodes, cancel and export...), so the fuzzer reaches objects that exist, in any order."""

    def get_call_kwargs(self, case):
        return {"headers": {"Authorization": f"Bearer {TOKEN}"}}

    def validate_response(self, response, case, additional_checks=(), **kwargs):
        case.validate_response(response, checks=(not_a_server_error, status_code_conformance,
                                                 content_type_conformance, response_schema_conformance))


def test_api_never_answers_500_in_call_sequences():
    Workflows.run(settings=settings(max_examples=60, stateful_step_count=6, deadline=None,
                                    suppress_health_check=list(HealthCheck)))
