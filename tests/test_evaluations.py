"""Predictions graded like the SWE-bench harness over the API (`POST /api/v1/evaluations`): the
workers grade each prediction of an imported suite in a bubblewrap sandbox; the run report has
SWE-bench's fields and ids (resolved, unresolved, empty patch, error, incomplete), each instance
its report.json and whole test log (withheld without the token); an evaluation whose owner died
is finished by another process, and a lost grading's late write is fenced out; the UI shows it."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from datetime import timedelta

import pytest
import sqlalchemy as sa

from envs.families import generate
from envs.predictions import Prediction
from service.control.evaluations import EvaluationConfig, create_evaluation
from service.worker.grading import grade_prediction
from service.store import db
from service.store.tables import Evaluation, EvaluationInstance, utcnow
from tests.conftest import auth, client_for, make_settings

pytestmark = pytest.mark.slow
MODEL = "org/model<script>alert(1)</script>"
NOT_A_PATCH = "diff --git a/nope.py b/nope.py\n--- a/nope.py\n+++ b/nope.py\n@@ -1 +1 @@\n-a\n+b\n"


@pytest.fixture
def suite_rows(tmp_path):
    rows = generate("pyfix", 5, 23, "train", tmp_path / "var" / "gen.jsonl", bundles_dir=tmp_path / "var" / "bundles")
    return rows


def settings_for(db_url, tmp_path, **kw):
    return make_settings(db_url, **({"data_dir": tmp_path / "var", "embedded_worker": True,
                                     "embedded_worker_concurrency": 4, "orchestrator_lease_s": 2.0} | kw))


async def import_suite(client, rows) -> str:
    r = await client.post("/api/v1/suites", params={"name": f"eval-{uuid.uuid4().hex[:6]}"},
                          content="".join(json.dumps(r) + "\n" for r in rows),
                          headers=auth() | {"Content-Type": "application/x-ndjson"})
    assert r.status_code == 201, r.text
    return r.json()["id"]


async def wait_done(client, evaluation_id: str, timeout_s: float = 300) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        e = (await client.get(f"/api/v1/evaluations/{evaluation_id}")).json()
        if e["status"] != "running":
            return e
        await asyncio.sleep(0.5)
    raise AssertionError(f"evaluation {evaluation_id} still running: {e}")


def not_the_fix(gold: str) -> str:
    """The gold patch with each added line the removed one again, commented: it applies, and the
    bug stays."""
    lines = gold.splitlines()
    removed = iter([line[1:] for line in lines if line.startswith("-") and not line.startswith("---")])
    return "\n".join(f"+{next(removed)}  # not the fix" if line.startswith("+") and not line.startswith("+++") else line
                     for line in lines) + "\n"


async def test_predictions_are_graded_like_the_harness(db_url, tmp_path, suite_rows):
    gold, empty, broken, _absent, wrong = suite_rows
    async with client_for(settings_for(db_url, tmp_path)) as client:
        suite_id = await import_suite(client, suite_rows)
        lines = [{"instance_id": gold["instance_id"], "model_name_or_path": MODEL, "model_patch": gold["patch"]},
                 {"instance_id": empty["instance_id"], "model_name_or_path": MODEL, "model_patch": ""},
                 {"instance_id": broken["instance_id"], "model_name_or_path": MODEL, "model_patch": NOT_A_PATCH},
                 {"instance_id": wrong["instance_id"], "model_name_or_path": MODEL,
                  "model_patch": not_the_fix(wrong["patch"])}]
        body = "".join(json.dumps(x) + "\n" for x in lines)
        headers = auth() | {"Content-Type": "application/x-ndjson"}
        params = {"suite_id": suite_id, "run_id": "r1", "concurrency": 2}
        assert (await client.post("/api/v1/evaluations", params=params, content=body,
                                  headers={"Content-Type": "application/x-ndjson"})).status_code == 401
        r = await client.post("/api/v1/evaluations", params=params, content=body, headers=headers)
        assert r.status_code == 201 and r.json()["status"] == "running", r.text
        evaluation_id = r.json()["id"]
        e = await wait_done(client, evaluation_id)
        report = e["report"]
        assert e["status"] == "done", e
        assert report["resolved_ids"] == [gold["instance_id"]] and report["unresolved_ids"] == [wrong["instance_id"]]
        assert report["empty_patch_ids"] == [empty["instance_id"]] and report["error_ids"] == [broken["instance_id"]]
        assert report["incomplete_ids"] == [suite_rows[3]["instance_id"]]
        assert (report["total_instances"], report["submitted_instances"], report["completed_instances"]) == (5, 4, 2)
        assert e["counts"] == {"resolved": 1, "unresolved": 1, "empty_patch": 1, "error": 1}

        one = (await client.get(f"/api/v1/evaluations/{evaluation_id}/instances/{gold['instance_id']}",
                                headers=auth())).json()
        status = one["report"][gold["instance_id"]]
        assert status["resolved"] and status["patch_successfully_applied"] and status["patch_exists"]
        assert sorted(status["tests_status"]["FAIL_TO_PASS"]["success"]) == sorted(gold["FAIL_TO_PASS"])
        assert all(t.split(" ")[0] in one["test_output"] for t in gold["FAIL_TO_PASS"]), one["test_output"]
        public = (await client.get(f"/api/v1/evaluations/{evaluation_id}/instances/{gold['instance_id']}")).json()
        assert public["test_output"] is None and public["redacted"] == ["test_output"]
        assert public["report"] == one["report"]  # the verdict and the tests' outcomes are public
        failed = (await client.get(f"/api/v1/evaluations/{evaluation_id}/instances/{broken['instance_id']}")).json()
        assert failed["status"] == "error" and failed["error"] is None and "error" in failed["redacted"]
        failed = (await client.get(f"/api/v1/evaluations/{evaluation_id}/instances/{broken['instance_id']}",
                                   headers=auth())).json()
        assert "Patch" in failed["error"] or "does not apply" in failed["error"], failed["error"]
        listed = (await client.get(f"/api/v1/evaluations/{evaluation_id}/instances", params={"status": "error"})).json()
        assert [i["instance_id"] for i in listed["items"]] == [broken["instance_id"]] and listed["total"] == 1

        again = await client.post("/api/v1/evaluations", params=params, content=body, headers=headers)
        assert again.status_code == 409 and "run_id" in again.json()["detail"]
        unknown = json.dumps({"instance_id": "nope__nope-1", "model_name_or_path": MODEL, "model_patch": "x"})
        r = await client.post("/api/v1/evaluations", params=params | {"run_id": "r2"}, content=unknown, headers=headers)
        assert r.status_code == 422 and "instance_id: nope__nope-1 not in the suite" in r.json()["detail"]
        two = body + json.dumps({"instance_id": _absent["instance_id"], "model_name_or_path": "other", "model_patch": ""})
        r = await client.post("/api/v1/evaluations", params=params | {"run_id": "r3"}, content=two, headers=headers)
        assert r.status_code == 422 and "model_name_or_path" in r.json()["detail"]
        r = await client.post("/api/v1/evaluations", params=params | {"run_id": "r4"}, content="{not json\n",
                              headers=headers)
        assert r.status_code == 422 and "predictions:1: not JSON" in r.json()["detail"]
        r = await client.post("/api/v1/evaluations", params=params | {"run_id": "r5"}, content=body,
                              headers=auth() | {"Content-Type": "text/csv"})
        assert r.status_code == 415
        as_object = json.dumps({x["instance_id"]: x for x in lines[:1]})
        r = await client.post("/api/v1/evaluations", params=params | {"run_id": "r6"}, content=as_object,
                              headers=auth() | {"Content-Type": "application/json"})
        assert r.status_code == 201 and (await wait_done(client, r.json()["id"]))["report"]["resolved_instances"] == 1

        page = await client.get(f"/evaluations/{evaluation_id}")
        assert page.status_code == 200 and "&lt;script&gt;alert(1)&lt;/script&gt;" in page.text
        assert "<script>alert(1)</script>" not in page.text and gold["instance_id"] in page.text
        assert "r1" in (await client.get("/evaluations")).text
        inst = await client.get(f"/evaluations/{evaluation_id}/instances/{gold['instance_id']}")
        assert inst.status_code == 200 and "needs the API token" in inst.text


async def test_an_evaluation_whose_owner_died_is_finished_and_a_lost_grading_fenced(db_url, tmp_path, suite_rows):
    async with client_for(settings_for(db_url, tmp_path, embedded_worker=False)) as client:
        suite_id = await import_suite(client, suite_rows[:2])
    engine = db.make_async_engine(db_url)
    try:
        predictions = [Prediction(r["instance_id"], "m", r["patch"]) for r in suite_rows[:2]]
        evaluation_id = await create_evaluation(engine, uuid.UUID(suite_id), "crash", predictions,
                                                EvaluationConfig(concurrency=2))
        long_ago = utcnow() - timedelta(hours=1)
        async with engine.begin() as conn:  # a dead process owned it; its worker was grading the first one
            await conn.execute(sa.update(Evaluation).where(Evaluation.id == evaluation_id)
                               .values(owner="dead:1:x", owner_heartbeat_at=long_ago))
            await conn.execute(sa.update(EvaluationInstance).where(
                EvaluationInstance.instance_id == suite_rows[0]["instance_id"])
                .values(status="grading", attempt=1, heartbeat_at=long_ago))
        async with client_for(settings_for(db_url, tmp_path)) as client:
            e = await wait_done(client, str(evaluation_id))
        assert e["status"] == "done" and e["report"]["resolved_instances"] == 2, e
        async with engine.connect() as conn:
            attempts = dict((await conn.execute(sa.select(EvaluationInstance.instance_id, EvaluationInstance.attempt)
                                                .where(EvaluationInstance.evaluation_id == evaluation_id))).all())
        assert attempts == {suite_rows[0]["instance_id"]: 2, suite_rows[1]["instance_id"]: 1}
        late = await grade_prediction(engine, settings_for(db_url, tmp_path), evaluation_id,
                                      suite_rows[0]["instance_id"], 1)
        assert late is None  # the lost attempt's worker comes back: nothing it writes counts
    finally:
        await engine.dispose()


async def test_cancel_ends_an_evaluation_and_its_suite_is_kept_while_it_runs(db_url, tmp_path, suite_rows):
    async with client_for(settings_for(db_url, tmp_path, embedded_worker=False)) as client:  # no worker: it stays running
        suite_id = await import_suite(client, suite_rows[:1])
        body = json.dumps({"instance_id": suite_rows[0]["instance_id"], "model_name_or_path": "m",
                           "model_patch": suite_rows[0]["patch"]})
        r = await client.post("/api/v1/evaluations", params={"suite_id": suite_id, "run_id": "c"}, content=body,
                              headers=auth() | {"Content-Type": "application/x-ndjson"})
        evaluation_id = r.json()["id"]
        assert (await client.delete(f"/api/v1/suites/{suite_id}", headers=auth())).status_code == 409
        r = await client.post(f"/api/v1/evaluations/{evaluation_id}/cancel", headers=auth())
        assert r.status_code == 200 and r.json()["status"] == "cancelled", r.text
        assert (await client.delete(f"/api/v1/suites/{suite_id}", headers=auth())).status_code == 204
        assert (await client.get(f"/api/v1/evaluations/{evaluation_id}")).json()["status"] == "cancelled"
