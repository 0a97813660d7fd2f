"""The task-suite API as a client uses it, on PostgreSQL and SQLite."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import orjson
import pytest
import sqlalchemy as sa

from envs.synthetic import synthetic_task
from service.store import db
from service.store.tables import Run, utcnow
from tests.conftest import auth, client_for, count_rows, make_settings

SAMPLE = Path(__file__).parent / "data" / "swebench_sample.jsonl"
NDJSON = {"Content-Type": "application/x-ndjson"}


def jsonl(records: list) -> bytes:
    return b"".join(orjson.dumps(r) + b"\n" for r in records)


async def upload(client, body: bytes, name: str = "s", ctype: str = "application/x-ndjson",
                 headers: dict | None = None):
    return await client.post("/api/v1/suites", params={"name": name}, content=body,
                             headers={"Content-Type": ctype, **(auth() if headers is None else headers)})


async def test_import_list_page_and_fetch_a_swebench_suite(app_client):
    r = await upload(app_client, SAMPLE.read_bytes(), name="swe-sample")
    assert r.status_code == 201, r.text
    created = r.json()
    assert (created["name"], created["task_count"]) == ("swe-sample", 3)

    suites = (await app_client.get("/api/v1/suites")).json()
    assert suites["total"] == 1
    assert {k: suites["items"][0][k] for k in ("id", "name", "task_count")} == created
    assert "created_at" in suites["items"][0]
    shown = (await app_client.get(f"/api/v1/suites/{created['id']}")).json()
    assert shown["task_count"] == 3

    tasks_url = f"/api/v1/suites/{created['id']}/tasks"
    page1 = (await app_client.get(tasks_url, params={"limit": 2})).json()
    page2 = (await app_client.get(tasks_url, params={"limit": 2, "offset": 2})).json()
    assert page1["total"] == page2["total"] == 3
    ids = [t["instance_id"] for t in page1["items"] + page2["items"]]
    assert ids == ["psf__requests-2317", "pytest-dev__pytest-5227", "django__django-11099"]
    django = (await app_client.get(tasks_url, params={"repo": "django/django"})).json()
    assert [t["instance_id"] for t in django["items"]] == ["django__django-11099"]
    assert django["items"][0]["n_fail_to_pass"] == 2

    task_id = page1["items"][0]["id"]
    task = (await app_client.get(f"/api/v1/tasks/{task_id}", headers=auth())).json()
    assert task["FAIL_TO_PASS"][0] == "test_requests.py::RequestsTestCase::test_HTTP_302_ALLOW_REDIRECT_GET"
    assert task["answers_included"] is True
    assert task["patch"].startswith("diff --git a/requests/sessions.py")
    assert "test_encoded_methods" in task["test_patch"]
    assert task["created_at"].startswith("2014-11-01T02:20:16")
    assert task["log_parser"] == "pytest"

    public = (await app_client.get(f"/api/v1/tasks/{task_id}")).json()
    assert (public["answers_included"], public["patch"], public["test_patch"]) == (False, None, None)
    assert public["problem_statement"] == task["problem_statement"]


async def test_json_array_upload_keeps_unknown_fields(app_client):
    records = [synthetic_task(i) for i in range(3)]
    records[1]["image_name"] = "sweb.eval.x86_64.org1__project1-1"
    r = await upload(app_client, json.dumps(records).encode(), ctype="application/json")
    assert r.status_code == 201, r.text
    tasks = (await app_client.get(f"/api/v1/suites/{r.json()['id']}/tasks")).json()["items"]
    second = (await app_client.get(f"/api/v1/tasks/{tasks[1]['id']}")).json()
    assert second["extra"] == {"image_name": "sweb.eval.x86_64.org1__project1-1"}
    assert second["FAIL_TO_PASS"] == json.loads(records[1]["FAIL_TO_PASS"])


def _without(field: str) -> dict:
    task = synthetic_task(1)
    del task[field]
    return task


def _with(**fields) -> dict:
    return synthetic_task(1) | fields


BAD_UPLOADS = {
    "missing field": (jsonl([synthetic_task(0), _without("base_commit")]), NDJSON, 422,
                      {"line": 2, "instance_id": "org1__project1-1", "field": "base_commit"}),
    "wrong type": (jsonl([_with(FAIL_TO_PASS=42)]), NDJSON, 422,
                   {"line": 1, "field": "FAIL_TO_PASS"}),
    "list of non-strings": (jsonl([_with(PASS_TO_PASS=["ok", 3])]), NDJSON, 422,
                            {"line": 1, "field": "PASS_TO_PASS.1"}),
    "JSON-encoded list that is not JSON": (jsonl([_with(FAIL_TO_PASS="[oops")]), NDJSON, 422,
                                           {"line": 1, "field": "FAIL_TO_PASS"}),
    "bad commit": (jsonl([_with(base_commit="main")]), NDJSON, 422,
                   {"line": 1, "field": "base_commit"}),
    "NUL in a text field": (jsonl([synthetic_task(0), _with(problem_statement="a\x00b")]), NDJSON, 422,
                            {"line": 2, "field": "problem_statement"}),
    "NUL in a test name": (jsonl([_with(PASS_TO_PASS=["ok", "t\x00"])]), NDJSON, 422,
                           {"line": 1, "field": "PASS_TO_PASS.1"}),
    "unknown log parser": (jsonl([_with(log_parser="junit")]), NDJSON, 422,
                           {"line": 1, "field": "log_parser"}),
    "malformed JSON line": (jsonl([synthetic_task(0)]) + b'{"instance_id": "x",\n', NDJSON, 422,
                            {"line": 2, "field": None, "instance_id": None}),
    "record not an object": (b"[1, 2]\n", NDJSON, 422, {"line": 1, "field": None}),
    "duplicate instance_id": (jsonl([synthetic_task(0), synthetic_task(1), synthetic_task(0)]),
                              NDJSON, 422,
                              {"line": 3, "field": "instance_id", "instance_id": "org0__project0-0"}),
    "JSON array with a bad record": (json.dumps([synthetic_task(0), _without("repo")]).encode(),
                                     {"Content-Type": "application/json"}, 422,
                                     {"index": 1, "line": None, "field": "repo"}),
    "JSON object instead of array": (b'{"instance_id": "a"}', {"Content-Type": "application/json"},
                                     422, {"index": None, "field": None}),
    "truncated JSON array": (json.dumps([synthetic_task(0)]).encode()[:-40],
                             {"Content-Type": "application/json"}, 422, {"field": None}),
    "empty suite": (b"\n\n", NDJSON, 422, {"field": None}),
    "unsupported media type": (jsonl([synthetic_task(0)]), {"Content-Type": "text/csv"}, 415, None),
    "no token": (jsonl([synthetic_task(0)]), NDJSON | {"Authorization": ""}, 401, None),
    "wrong token": (jsonl([synthetic_task(0)]), NDJSON | {"Authorization": "Bearer nope"}, 401, None),
}


@pytest.mark.parametrize(("body", "headers", "status", "error"), BAD_UPLOADS.values(),
                         ids=BAD_UPLOADS.keys())
async def test_bad_upload_is_refused_and_writes_nothing(app_client, db_url, body, headers,
                                                       status, error):
    before = count_rows(db_url)
    sent = {"Authorization": auth()["Authorization"]} | headers
    if not sent["Authorization"]:
        del sent["Authorization"]
    r = await app_client.post("/api/v1/suites", params={"name": "bad"}, content=body, headers=sent)
    assert r.status_code == status, r.text
    payload = r.json()
    assert isinstance(payload["detail"], str) and payload["detail"]
    if error is not None:
        assert payload["error_count"] >= 1
        assert any(all(e.get(k) == v for k, v in error.items()) for e in payload["errors"]), payload
        assert all(e["message"] for e in payload["errors"])
    assert count_rows(db_url) == before
    assert (await app_client.get("/api/v1/suites")).json()["total"] == 0


async def test_every_bad_record_is_reported(app_client):
    records = [synthetic_task(i) for i in range(10)]
    records[2] = _without("problem_statement") | {"instance_id": "a__b-2"}
    records[5]["FAIL_TO_PASS"] = []
    records[7]["repo"] = "no-slash"
    r = await upload(app_client, jsonl(records))
    assert r.status_code == 422
    found = {(e["line"], e["field"]) for e in r.json()["errors"]}
    assert found == {(3, "problem_statement"), (6, "FAIL_TO_PASS"), (8, "repo")}
    assert r.json()["error_count"] == 3


async def test_error_list_is_capped_but_counted(db_url):
    records = [_without("repo") | {"instance_id": f"x-{i}"} for i in range(30)]
    async with client_for(make_settings(db_url, max_listed_errors=5)) as client:
        r = await upload(client, jsonl(records))
    assert r.status_code == 422
    assert (len(r.json()["errors"]), r.json()["error_count"]) == (5, 30)


@pytest.mark.parametrize("declare_length", [True, False])
async def test_oversize_upload_answers_413_and_writes_nothing(db_url, declare_length):
    body = jsonl([synthetic_task(i) for i in range(20)])
    before = count_rows(db_url)

    async def chunks():
        for i in range(0, len(body), 4096):
            yield body[i : i + 4096]

    async with client_for(make_settings(db_url, max_upload_bytes=len(body) // 2)) as client:
        content = body if declare_length else chunks()
        r = await client.post("/api/v1/suites", params={"name": "big"}, content=content,
                              headers=NDJSON | auth())
    assert r.status_code == 413, r.text
    assert "SWERVE_MAX_UPLOAD_BYTES" in r.json()["detail"]
    assert count_rows(db_url) == before


async def test_duplicate_suite_name_is_a_conflict(app_client):
    assert (await upload(app_client, jsonl([synthetic_task(0)]), name="dup")).status_code == 201
    r = await upload(app_client, jsonl([synthetic_task(1)]), name="dup")
    assert r.status_code == 409
    assert "dup" in r.json()["detail"]


@pytest.mark.parametrize("path", ["/api/v1/suites/{id}", "/api/v1/suites/{id}/tasks",
                                  "/api/v1/tasks/{id}"])
async def test_unknown_ids_answer_404_with_a_json_body(app_client, path):
    r = await app_client.get(path.format(id=uuid.uuid4()))
    assert r.status_code == 404
    assert "not found" in r.json()["detail"]


async def test_malformed_id_and_bad_paging_answer_422(app_client):
    assert (await app_client.get("/api/v1/suites/not-a-uuid")).status_code == 422
    r = await app_client.get("/api/v1/suites", params={"limit": 0})
    assert r.status_code == 422
    assert r.json()["detail"][0]["loc"] == ["query", "limit"]


async def _add_run(url: str, suite_id: str, status: str) -> None:
    engine = db.make_async_engine(url)
    async with engine.begin() as conn:
        await conn.execute(sa.insert(Run).values(
            id=uuid.uuid4(), suite_id=uuid.UUID(suite_id), status=status, config={},
            config_hash="0" * 64, created_at=utcnow()))
    await engine.dispose()


async def test_delete_suite(app_client, db_url):
    suite = (await upload(app_client, jsonl([synthetic_task(0)]), name="gone")).json()
    assert (await app_client.delete(f"/api/v1/suites/{suite['id']}")).status_code == 401
    r = await app_client.delete(f"/api/v1/suites/{suite['id']}", headers=auth())
    assert r.status_code == 204
    assert (await app_client.get(f"/api/v1/suites/{suite['id']}")).status_code == 404
    assert count_rows(db_url)["tasks"] == 0


async def test_delete_is_refused_while_a_run_uses_the_suite(app_client, db_url):
    suite = (await upload(app_client, jsonl([synthetic_task(0)]), name="busy")).json()
    await _add_run(db_url, suite["id"], "running")
    r = await app_client.delete(f"/api/v1/suites/{suite['id']}", headers=auth())
    assert r.status_code == 409
    assert "cancel" in r.json()["detail"]
    assert (await app_client.get(f"/api/v1/suites/{suite['id']}")).status_code == 200


async def test_delete_keeps_tasks_that_finished_runs_refer_to(app_client, db_url):
    suite = (await upload(app_client, jsonl([synthetic_task(0)]), name="old")).json()
    task = (await app_client.get(f"/api/v1/suites/{suite['id']}/tasks")).json()["items"][0]
    await _add_run(db_url, suite["id"], "finished")
    assert (await app_client.delete(f"/api/v1/suites/{suite['id']}", headers=auth())).status_code == 204
    assert (await app_client.get(f"/api/v1/suites/{suite['id']}")).status_code == 404
    assert (await app_client.get("/api/v1/suites")).json()["total"] == 0
    assert (await app_client.get(f"/api/v1/tasks/{task['id']}")).status_code == 200
    again = await upload(app_client, jsonl([synthetic_task(0)]), name="old")
    assert again.status_code == 201


async def test_local_mode_needs_no_token(db_url):
    from service.config import load_settings

    async with client_for(load_settings(database_url=db_url, api_token=None)) as client:
        r = await upload(client, jsonl([synthetic_task(0)]), headers={})
        assert r.status_code == 201
        task = (await client.get(f"/api/v1/suites/{r.json()['id']}/tasks")).json()["items"][0]
        assert (await client.get(f"/api/v1/tasks/{task['id']}")).json()["answers_included"]
