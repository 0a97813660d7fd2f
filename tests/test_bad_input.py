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
