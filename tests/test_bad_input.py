"""Bad input is a 4xx that names the field, never a 500 (issue 19's list, on both databases):
NUL bytes in paths and filters, numbers that are not finite, integers past their column, filters
of any length."""

from __future__ import annotations

import json
import uuid

import pytest

from service.fleet.tiny_model import init_tiny
from tests.conftest import auth


@pytest.fixture(scope="module")
def sampler(tmp_path_factory) -> dict:
    return {"type": "oracle", "tokenizer": str(init_tiny(tmp_path_factory.mktemp("tiny") / "tiny"))}


async def suite(client) -> str:
    row = {"instance_id": "o__r-1", "repo": "o/r", "base_commit": "a" * 40, "problem_statement": "p",
           "test_patch": "", "FAIL_TO_PASS": ["t::a"], "PASS_TO_PASS": []}
    r = await client.post("/api/v1/suites", params={"name": f"s{uuid.uuid4().hex[:6]}"}, content=json.dumps(row),
                          headers=auth() | {"Content-Type": "application/x-ndjson"})
    assert r.status_code == 201, r.text
    return r.json()["id"]


@pytest.mark.parametrize("url", [
    "/api/v1/runs/{run}/episodes?task=%00", "/api/v1/runs/{run}/episodes?status=a%00b",
    "/api/v1/suites/{suite}/tasks?repo=%00", "/api/v1/evaluations/{run}/instances/a%00b",
    "/evaluations/{run}/instances/%00",
])  # fmt: skip
async def test_a_nul_byte_in_a_path_or_filter_is_named(app_client, url):
    suite_id = await suite(app_client)
    r = await app_client.get(url.format(run=uuid.uuid4(), suite=suite_id))
    assert r.status_code == 422 and "NUL byte" in r.json()["detail"][0]["msg"], r.text


@pytest.mark.parametrize(("patch", "field"), [
    ({"worker_timeout_s": float("inf")}, "worker_timeout_s"),
    ({"limits": {"command_timeout_s": float("nan")}}, "command_timeout_s"),
    ({"name": "a\x00b"}, "name"),
    ({"instance_ids": ["x"] * 100_001}, "instance_ids"),
])  # fmt: skip
async def test_a_run_config_that_could_never_end_is_refused_at_creation(app_client, sampler, patch, field):
    config = {"suite_id": await suite(app_client), "sampler": sampler} | patch
    ok = await app_client.post("/api/v1/runs", json={k: v for k, v in config.items() if k not in patch}, headers=auth())
    assert ok.status_code == 201, ok.text  # the same config without the bad field is a run
    body = json.dumps(config, allow_nan=True)  # Infinity and NaN as Python writes them; FastAPI reads them
    r = await app_client.post("/api/v1/runs", content=body, headers=auth() | {"Content-Type": "application/json"})
    assert r.status_code == 422 and field in r.text, r.text[:500]
    assert [e["loc"][-1] for e in r.json()["detail"]] in ([field], [field, 0]) or field in str(r.json()["detail"][0]["loc"])


async def test_integers_past_their_column_and_long_filters_are_4xx(app_client, sampler):
    suite_id = await suite(app_client)
    r = await app_client.get(f"/api/v1/runs/{uuid.uuid4()}/episodes", params={"policy_version": 2**40})
    assert r.status_code == 422 and "policy_version" in r.text
    r = await app_client.get(f"/api/v1/runs/{uuid.uuid4()}/episodes", params={"min_reward": "nan"})
    assert r.status_code == 422 and "min_reward" in r.text
    # 70,000 names: more than Postgres takes as bind parameters; the filter is applied without them
    config = {"suite_id": suite_id, "sampler": sampler, "instance_ids": ["o__r-1"] + [f"x{i}" for i in range(70_000)]}
    r = await app_client.post("/api/v1/runs", json=config, headers=auth())
    assert r.status_code == 422 and "instance_ids: not in the suite" in r.text, r.text[:300]


async def test_deeply_nested_json_is_refused_not_a_500(app_client):
    deep = "[" * 5000 + "]" * 5000
    r = await app_client.post("/api/v1/suites", params={"name": "deep"}, content=deep,
                              headers=auth() | {"Content-Type": "application/json"})
    assert r.status_code == 422, r.text[:300]
    suite_id = await suite(app_client)
    r = await app_client.post("/api/v1/evaluations", params={"suite_id": suite_id, "run_id": "deep"}, content=deep,
                              headers=auth() | {"Content-Type": "application/json"})
    assert r.status_code == 422 and "predictions" in r.text, r.text[:300]
    line = '{"instance_id": "o__r-1", "model_name_or_path": "m", "model_patch": ' + deep + "}"
    r = await app_client.post("/api/v1/evaluations", params={"suite_id": suite_id, "run_id": "deep2"}, content=line,
                              headers=auth() | {"Content-Type": "application/x-ndjson"})
    assert r.status_code == 422 and "predictions" in r.text, r.text[:300]


def task_row(i: int, statement_bytes: int = 1) -> dict:
    return {"instance_id": f"o__r-{i}", "repo": "o/r", "base_commit": "a" * 40, "problem_statement": "p" * statement_bytes,
            "test_patch": "", "FAIL_TO_PASS": ["t::a"], "PASS_TO_PASS": []}


async def chunked(data: bytes, size: int):
    for i in range(0, len(data), size):
        yield data[i:i + size]


@pytest.mark.parametrize(("chunk", "statement"), [(1, 50), (7, 500), (4096, 300_000), (1 << 20, 3_000_000)])
async def test_lines_split_anywhere_parse_the_same(chunk, statement):
    """However the body arrives (a line over many chunks, many lines in one), the records are
    the same, long lines included (byte-sized chunks only on a short body: a step per byte)."""
    from service.control.suites import parse_json_array, parse_jsonl

    rows = [task_row(0, statement), task_row(1), task_row(2, statement // 3)]
    body = ("\n".join(json.dumps(r) for r in rows[:2]) + "\n\n" + json.dumps(rows[2])).encode()
    got = [p async for p in parse_jsonl(chunked(body, chunk))]
    assert [p.obj for p in got] == rows and [p.line for p in got] == [1, 2, 4]
    array = ("[" + ",".join(json.dumps(r) for r in rows) + "]").encode()
    assert [p.obj async for p in parse_json_array(chunked(array, chunk))] == rows


async def test_a_record_over_the_limit_is_named_and_never_held(db_url):
    from tests.conftest import client_for, make_settings

    limit = 100_000
    big, small, bad = task_row(0, 3 * limit), task_row(1), task_row(2) | {"FAIL_TO_PASS": "not a list"}
    async with client_for(make_settings(db_url, max_record_bytes=limit)) as client:
        body = "\n".join(json.dumps(r) for r in (big, small, bad))
        r = await client.post("/api/v1/suites", params={"name": "big"}, content=body,
                              headers=auth() | {"Content-Type": "application/x-ndjson"})
        assert r.status_code == 422, r.text[:300]
        errors = r.json()["errors"]
        assert errors[0]["line"] == 1 and "SWERVE_MAX_RECORD_BYTES" in errors[0]["message"]
        assert [e["line"] for e in errors] == [1, 3]  # the lines after it are still checked
        r = await client.post("/api/v1/suites", params={"name": "big"}, content=json.dumps([small, big]),
                              headers=auth() | {"Content-Type": "application/json"})
        assert r.status_code == 422 and r.json()["errors"][0]["index"] == 1, r.text[:300]
        assert "SWERVE_MAX_RECORD_BYTES" in r.json()["errors"][0]["message"]
        assert (await client.get("/api/v1/suites")).json()["total"] == 0  # nothing imported
        ok = await client.post("/api/v1/suites", params={"name": "ok"}, content=json.dumps(small),
                               headers=auth() | {"Content-Type": "application/x-ndjson"})
        assert ok.status_code == 201, ok.text
        line = json.dumps({"instance_id": "o__r-1", "model_name_or_path": "m", "model_patch": "x" * (2 * limit)})
        r = await client.post("/api/v1/evaluations", params={"suite_id": ok.json()["id"], "run_id": "big"},
                              content=line, headers=auth() | {"Content-Type": "application/x-ndjson"})
        assert r.status_code == 422 and "SWERVE_MAX_RECORD_BYTES" in r.json()["detail"], r.text[:300]


async def test_a_parquet_row_over_the_limit_is_named(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from service.control.suites import parse_parquet

    rows = [task_row(0), task_row(1, 50_000)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "s.parquet")
    got = [p async for p in parse_parquet(str(tmp_path / "s.parquet"), max_record_bytes=10_000)]
    assert got[0].obj == rows[0] and got[1].obj is None and "SWERVE_MAX_RECORD_BYTES" in got[1].error


async def test_a_json_array_stops_reading_a_record_past_the_limit():
    """The parser stops taking a record's bytes once it is past the limit and a read, instead
    of holding all of it (the limit bounds a parser's memory, not only what it accepts)."""
    from service.control.suites import parse_json_array

    taken = 0

    async def body():
        nonlocal taken
        async for chunk in chunked(("[" + json.dumps(task_row(0, 20_000_000)) + "]").encode(), 1 << 16):
            taken += len(chunk)
            yield chunk

    got = [p async for p in parse_json_array(body(), max_record_bytes=100_000)]
    assert len(got) == 1 and got[0].index == 0 and "SWERVE_MAX_RECORD_BYTES" in got[0].error
    assert taken < 1_000_000  # of 20 MB
