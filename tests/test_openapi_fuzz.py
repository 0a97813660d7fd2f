"""Schemathesis against our OpenAPI schema: no input, however odd, makes the API answer 500.

Runs against a real PostgreSQL database made for this module.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import tempfile
import uuid
from collections import Counter
from pathlib import Path

import pytest
import sqlalchemy as sa
import schemathesis
from hypothesis import HealthCheck, settings
from hypothesis.stateful import Bundle, initialize, multiple
from schemathesis.checks import not_a_server_error
from schemathesis.generation.stateful.state_machine import StepInput
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from service.fleet.tiny_model import init_tiny
from service.store import db
from service.store.tables import Episode
from service.app import create_app
from tests.conftest import PG_ADMIN_URL, TOKEN, drop_pg_database, make_settings
from tests.test_export import VLLM, make_run

# The schema is read when the module is collected, and the app's start-up reads the database,
# so the database is made here; the fixture below drops it (or reports PostgreSQL missing).
try:
    DB_URL = db.create_database(PG_ADMIN_URL, f"swerve_test_fuzz_{uuid.uuid4().hex[:8]}")
    db.upgrade(DB_URL)
    DB_ERROR = None
except sa.exc.OperationalError as e:
    DB_URL, DB_ERROR = "postgresql://unavailable/none", e
# the seeded run's tokenizer lives under a model folder of this app, filled by the fixture below
MODELS = Path(tempfile.mkdtemp(prefix="swerve-fuzz-models-"))
schema = schemathesis.openapi.from_asgi("/openapi.json", create_app(make_settings(DB_URL, model_roots=str(MODELS))))


@schemathesis.serializer("application/x-ndjson")
def _ndjson(ctx, value):
    if isinstance(value, str):
        return value.encode()
    if isinstance(value, list):
        return "".join(json.dumps(v) + "\n" for v in value).encode()
    return json.dumps(value).encode()


SUITE = Path(__file__).resolve().parent.parent / "envs" / "example_suite" / "suite.jsonl"
SEEDED: dict[str, str] = {}  # a finished run with graded episodes, made before the stateful test


async def _seed_finished_run(tokenizer: str) -> dict[str, str]:
    engine = db.make_async_engine(DB_URL)
    try:
        run_id, _ = await make_run(engine, {**VLLM, "tokenizer": tokenizer})
        async with engine.connect() as conn:
            group_id = (await conn.execute(sa.select(Episode.group_id).where(Episode.run_id == run_id).limit(1))).scalar()
    finally:
        await engine.dispose()
    return {"run_id": str(run_id), "group_id": str(group_id), "tokenizer": tokenizer}


@pytest.fixture(scope="module", autouse=True)
def fuzz_database(pg_admin_url):
    if DB_ERROR is not None:
        pytest.fail(f"could not create the fuzzing database: {DB_ERROR}")
    SEEDED.update(asyncio.run(_seed_finished_run(str(init_tiny(MODELS / "tiny")))))
    yield
    drop_pg_database(pg_admin_url, DB_URL)
    shutil.rmtree(MODELS, ignore_errors=True)


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


ANSWERED: Counter = Counter()  # (operation, status) of every call the stateful test made


class Workflows(schema.as_state_machine()):
    """Stateful: sequences of calls chained through the links schemathesis infers (a suite's
    id from its upload to its tasks, its validation and its deletion; a run's id to its
    episodes, cancel and export; a group's episodes to their tokens...), so the fuzzer reaches
    objects that exist, in any order. Each sequence starts from real objects (a valid suite of
    two example tasks and its task list, a run on it, that run cancelled, a finished run's group), which random
    bodies alone almost never make: the generated NDJSON is no valid suite, so no link from a
    suite or a run would ever fire."""

    @initialize(target=Bundle("catch_all"))
    def seed(self):
        def call(path: str, method: str, **parts) -> object:
            step = StepInput.initial(schema[path][method].Case(**parts))
            self.recorder.record_case(case=step.case)  # as schemathesis' own root steps do, so
            self.control.record_step(step, self.recorder)  # links from this call find their parent
            output = self.step(step)
            assert output.response.status_code < 300, (path, output.response.status_code, output.response.text)
            return output

        body = "\n".join(SUITE.read_text().splitlines()[:2]) + "\n"
        suite = call("/api/v1/suites", "POST", query={"name": f"seed-{uuid.uuid4().hex[:6]}"}, body=body,
                     media_type="application/x-ndjson")
        run = call("/api/v1/runs", "POST", media_type="application/json",
                   body={"suite_id": suite.response.json()["id"],
                         "sampler": {"type": "oracle", "tokenizer": SEEDED["tokenizer"]}})
        tasks = call("/api/v1/suites/{suite_id}/tasks", "GET", path_parameters={"suite_id": suite.response.json()["id"]})
        group = call("/api/v1/groups/{group_id}", "GET", path_parameters={"group_id": SEEDED["group_id"]})
        cancelled = call("/api/v1/runs/{run_id}/cancel", "POST", path_parameters={"run_id": run.response.json()["id"]})
        return multiple(suite, tasks, run, cancelled, group)

    def get_call_kwargs(self, case):
        return {"headers": {"Authorization": f"Bearer {TOKEN}"}}

    def validate_response(self, response, case, additional_checks=(), **kwargs):
        ANSWERED[(f"{case.operation.method.upper()} {case.operation.path}", response.status_code)] += 1
        case.validate_response(response, checks=(not_a_server_error, status_code_conformance,
                                                 content_type_conformance, response_schema_conformance))


# operations only a link from a real object reaches with an id that exists
LINKED = ["GET /api/v1/suites/{suite_id}", "GET /api/v1/suites/{suite_id}/tasks", "GET /api/v1/tasks/{task_id}",
          "GET /api/v1/runs/{run_id}", "GET /api/v1/runs/{run_id}/episodes", "GET /api/v1/runs/{run_id}/export",
          "GET /api/v1/episodes/{episode_id}", "GET /api/v1/episodes/{episode_id}/tokens"]


def test_api_never_answers_500_in_call_sequences():
    ANSWERED.clear()
    # derandomized: the sequences are the same on every machine, so whether each linked
    # operation is reached does not depend on the draw (the per-operation test stays random)
    Workflows.run(settings=settings(max_examples=60, stateful_step_count=6, deadline=None, derandomize=True,
                                    database=None, suppress_health_check=list(HealthCheck)))
    reached = {op for (op, status), _ in ANSWERED.items() if status == 200}
    assert not [op for op in LINKED if op not in reached], (sorted(ANSWERED.items()))
