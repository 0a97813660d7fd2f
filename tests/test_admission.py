"""What a token holder may ask for (issue 19's bounded inputs), through the API on both
databases: limits under the operator's ceilings, inference endpoints over http(s) to allowed
hosts only, tokenizers from model folders only, task sources under allowed roots only, bundle
names without folders, host paths withheld from errors shown without the token, and the Host
header checked in local mode."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest

from service.control.redaction import Answers, without_host_paths
from service.fleet.tiny_model import init_tiny
from tests.conftest import auth, client_for, make_settings
from tests.servers import free_port


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> Path:
    """A models folder holding the tiny model (its tokenizer)."""
    root = tmp_path_factory.mktemp("models")
    init_tiny(root / "tiny")
    return root


ROW = {"instance_id": "o__r-1", "repo": "o/r", "base_commit": "a" * 40, "problem_statement": "p",
       "test_patch": "", "FAIL_TO_PASS": ["t::a"], "PASS_TO_PASS": []}


async def upload(client, *rows: dict, token: bool = True):
    return await client.post("/api/v1/suites", params={"name": f"s{uuid.uuid4().hex[:6]}"},
                             content="\n".join(json.dumps(r) for r in rows),
                             headers=(auth() if token else {}) | {"Content-Type": "application/x-ndjson"})


async def suite_id(client) -> str:
    r = await upload(client, ROW)
    assert r.status_code == 201, r.text
    return r.json()["id"]


def vllm(tokenizer: Path, *endpoints: str) -> dict:
    return {"type": "vllm", "endpoints": list(endpoints), "tokenizer": str(tokenizer)}


@pytest.fixture
async def client(db_url, models):
    """Token mode, as a cluster runs: the models folder is the only model root, one inference
    host is allowed."""
    settings = make_settings(db_url, models_dir=models, model_roots="", endpoint_hosts="vllm.internal")
    async with client_for(settings) as c:
        yield c


@pytest.mark.parametrize(("limits", "field", "setting"), [
    ({"memory_mb": 10**12}, "limits.memory_mb", "SWERVE_MAX_MEMORY_MB"),
    ({"pids": 10**9}, "limits.pids", "SWERVE_MAX_PIDS"),
    ({"command_timeout_s": 1e300}, "limits.command_timeout_s", "SWERVE_MAX_COMMAND_TIMEOUT_S"),
    ({"disk_mb": 10**9}, "limits.disk_mb", "SWERVE_MAX_DISK_MB"),
    ({"lifetime_s": 1e12}, "limits.lifetime_s", "SWERVE_MAX_SANDBOX_LIFETIME_S"),
])  # fmt: skip
async def test_limits_above_the_operators_ceilings_are_refused(client, models, limits, field, setting):
    config = {"suite_id": await suite_id(client), "sampler": vllm(models / "tiny", "http://vllm.internal:8100")}
    ok = await client.post("/api/v1/runs", json=config, headers=auth())
    assert ok.status_code == 201, ok.text  # the same run within the ceilings starts
    r = await client.post("/api/v1/runs", json=config | {"limits": limits}, headers=auth())
    assert r.status_code == 422 and field in r.json()["detail"] and setting in r.json()["detail"], r.text


async def test_a_ceiling_is_the_operators_to_set(db_url, models):
    settings = make_settings(db_url, models_dir=models, endpoint_hosts="*", max_memory_mb=1024)
    async with client_for(settings) as c:
        config = {"suite_id": await suite_id(c), "sampler": vllm(models / "tiny", "http://x:1"),
                  "limits": {"memory_mb": 2048}}
        r = await c.post("/api/v1/runs", json=config, headers=auth())
        assert r.status_code == 422 and "1024" in r.json()["detail"], r.text
        config["limits"]["memory_mb"] = 1024
        assert (await c.post("/api/v1/runs", json=config, headers=auth())).status_code == 201


@pytest.mark.parametrize(("endpoint", "why"), [
    ("file:///etc/passwd", "http:// or https://"),
    ("gopher://vllm.internal:70/", "http:// or https://"),
    ("http://169.254.169.254/latest/meta-data", "not an allowed inference host"),
    ("http://127.0.0.1:8000", "not an allowed inference host"),  # the API itself: loopback only in local mode
    ("http://user:secret@vllm.internal:8100", "credentials"),
    ("http://[::1", "not a URL"),
])  # fmt: skip
async def test_endpoints_must_be_http_to_an_allowed_host(client, models, endpoint, why):
    config = {"suite_id": await suite_id(client), "sampler": vllm(models / "tiny", "http://vllm.internal:1", endpoint)}
    r = await client.post("/api/v1/runs", json=config, headers=auth())
    assert r.status_code == 422, r.text
    assert "sampler.endpoints[1]" in r.json()["detail"] and why in r.json()["detail"], r.text


async def test_loopback_endpoints_in_local_mode(db_url, models):
    async with client_for(make_settings(db_url, api_token=None, models_dir=models, endpoint_hosts="")) as c:
        config = {"suite_id": await suite_id(c), "sampler": vllm(models / "tiny", "http://127.0.0.1:8100")}
        assert (await c.post("/api/v1/runs", json=config)).status_code == 201
        config["sampler"]["endpoints"] = ["http://10.1.2.3:8100"]
        r = await c.post("/api/v1/runs", json=config)
        assert r.status_code == 422 and "SWERVE_ENDPOINT_HOSTS" in r.json()["detail"], r.text


@pytest.mark.parametrize("token", [None, "token"])
async def test_a_tokenizer_outside_the_model_folders_only_as_the_model_the_endpoints_serve(db_url, models, tmp_path,
                                                                                             token):
    """Outside the models folder and SWERVE_MODEL_ROOTS (local mode as with a token), a
    tokenizer is taken only as the policy's own model: the folder a run's endpoint says it
    loaded (vLLM's `root` in /v1/models). Another folder, or an endpoint that does not answer,
    is refused, naming both."""
    from service.fleet.stub import create_stub
    from tests.conftest import TOKEN
    from tests.servers import ThreadServer

    mine, other = init_tiny(tmp_path / "mine"), init_tiny(tmp_path / "other")
    settings = make_settings(db_url, api_token=token and TOKEN, models_dir=models, model_roots="",
                             endpoint_hosts="127.0.0.1")
    headers = auth() if token else {}
    async with client_for(settings) as c:
        sid = await suite_id(c)
        with ThreadServer(create_stub(model="policy", root=str(mine))) as server:
            ok = await c.post("/api/v1/runs", headers=headers, json={"suite_id": sid, "sampler": vllm(mine, server.url)})
            assert ok.status_code == 201, ok.text
            r = await c.post("/api/v1/runs", headers=headers, json={"suite_id": sid, "sampler": vllm(other, server.url)})
            assert r.status_code == 422, r.text
            assert "not under a model folder" in r.json()["detail"] and str(mine) in r.json()["detail"], r.text
        r = await c.post("/api/v1/runs", headers=headers,
                         json={"suite_id": sid, "sampler": vllm(mine, f"http://127.0.0.1:{free_port()}")})
        assert r.status_code == 422 and "did not answer /v1/models" in r.json()["detail"], r.text
        r = await c.post("/api/v1/runs", headers=headers, json={"suite_id": sid, "sampler": {
            "type": "demo", "tokenizer": str(mine)}})  # no endpoint to serve it: only the model folders
        assert r.status_code == 422 and "not under a model folder" in r.json()["detail"], r.text


async def test_model_roots_bind_local_mode_too(db_url, models, tmp_path):
    """The model folders bind in local mode as with a token: a folder the operator added with
    SWERVE_MODEL_ROOTS, or the models folder, is taken; another is not."""
    outside, inside = init_tiny(tmp_path / "outside"), init_tiny(tmp_path / "roots" / "mine")
    settings = make_settings(db_url, api_token=None, models_dir=models, endpoint_hosts="",
                             model_roots=str(tmp_path / "roots"))
    async with client_for(settings) as c:
        sid = await suite_id(c)
        for tokenizer, code in [(inside, 201), (models / "tiny", 201), (outside, 422)]:
            r = await c.post("/api/v1/runs", json={"suite_id": sid, "sampler": vllm(tokenizer, "http://127.0.0.1:1")})
            assert r.status_code == code, (tokenizer, r.text)
        assert "not under a model folder" in r.json()["detail"] and "SWERVE_MODEL_ROOTS" in r.json()["detail"], r.text


async def test_tokenizers_only_from_model_folders(client, models, tmp_path):
    sid = await suite_id(client)
    outside = init_tiny(tmp_path / "outside")
    empty = models / "empty"
    empty.mkdir(exist_ok=True)
    for tokenizer, why in [(Path("/nonexistent/tok"), "is not a folder"), (empty, "holds no tokenizer"),
                           (outside, "not under a model folder"), (Path("/etc"), "holds no tokenizer"),
                           (Path("x" * 300), "cannot be read (File name too long)")]:
        r = await client.post("/api/v1/runs", headers=auth(),
                              json={"suite_id": sid, "sampler": vllm(tokenizer, "http://vllm.internal:1")})
        assert r.status_code == 422 and "sampler.tokenizer" in r.json()["detail"] and why in r.json()["detail"], r.text
    # a link inside the models folder to a folder outside is outside
    (models / "link").unlink(missing_ok=True)
    (models / "link").symlink_to(outside)
    r = await client.post("/api/v1/runs", headers=auth(),
                          json={"suite_id": sid, "sampler": vllm(models / "link", "http://vllm.internal:1")})
    assert r.status_code == 422 and "not under a model folder" in r.json()["detail"], r.text
    r = await client.post("/api/v1/runs", headers=auth(),
                          json={"suite_id": sid, "sampler": {"type": "oracle", "tokenizer": str(models / "tiny")}})
    assert r.status_code == 201, r.text


@pytest.mark.parametrize(("source", "why"), [
    ("bundle:../../etc/x", "without folders"),
    ("bundle:.hidden", "without folders"),
    ("ext::sh -c touch% /tmp/pwned", "transport::address"),
    ("--upload-pack=touch /tmp/pwned", "options are refused"),
    ("gopher://host/repo", "not a git transport"),
])  # fmt: skip
async def test_task_sources_git_cannot_be_tricked_with(client, source, why):
    r = await upload(client, ROW | {"source": source})
    assert r.status_code == 422, r.text
    errors = r.json()["errors"]
    assert errors[0]["field"] == "source" and why in errors[0]["message"], errors


async def test_host_paths_as_sources_only_under_the_source_roots(db_url, tmp_path):
    repo = tmp_path / "repos" / "r"
    repo.mkdir(parents=True)
    async with client_for(make_settings(db_url)) as c:  # a token and no SWERVE_SOURCE_ROOTS: no host paths
        for source in (str(repo), f"file://{repo}", "/etc"):
            r = await upload(c, ROW | {"source": source})
            assert r.status_code == 422 and r.json()["errors"][0]["field"] == "source", r.text
            assert "SWERVE_SOURCE_ROOTS" in r.json()["errors"][0]["message"]
        for source in ("https://github.com/o/r.git", "git@github.com:o/r.git", "bundle:r"):
            assert (await upload(c, ROW | {"source": source})).status_code == 201, source
    async with client_for(make_settings(db_url, source_roots=str(tmp_path / "repos"))) as c:
        assert (await upload(c, ROW | {"source": str(repo)})).status_code == 201
        (tmp_path / "repos" / "escape").symlink_to("/etc")
        r = await upload(c, ROW | {"source": str(tmp_path / "repos" / "escape")})
        assert r.status_code == 422 and r.json()["errors"][0]["field"] == "source", r.text


def test_errors_shown_without_the_token_carry_no_host_paths(tmp_path):
    here = tmp_path / "models" / "tiny"
    here.mkdir(parents=True)
    text = (f"sampler.tokenizer: {here} cannot be loaded; {tmp_path}/models/missing too; the agent's "
            "/testbed/src/app.py and http://vllm:8100/v1/models are not the host's")
    shown = without_host_paths(text)
    assert str(tmp_path) not in shown and shown.count("<host path>") == 2, shown
    assert "/testbed/src/app.py" in shown and "http://vllm:8100/v1/models" in shown
    episode = {"error_type": "ConfigError", "error_message": text}
    assert Answers(shown=True).episode(episode, oracle=False)["error_message"] == text
    assert str(tmp_path) not in Answers(shown=False).episode(episode, oracle=False)["error_message"]
    assert Answers(shown=False).error(text) == shown and Answers(shown=True).error(text) == text


async def test_the_host_header_is_checked_in_local_mode(db_url):
    async with client_for(make_settings(db_url, api_token=None)) as c:
        for host in ("localhost", "localhost:8000", "127.0.0.1:8000", "[::1]:8000"):
            assert (await c.get("/api/v1/suites", headers={"Host": host})).status_code == 200, host
        for host in ("evil.example", "evil.example:8000", "localhost.evil.example", ""):
            r = await c.get("/api/v1/suites", headers={"Host": host})
            assert r.status_code == 400 and "SWERVE_ALLOWED_HOSTS" in r.json()["detail"], host
            r = await c.post("/api/v1/suites", params={"name": "x"}, content=json.dumps(ROW),
                             headers={"Host": host, "Content-Type": "application/x-ndjson"})
            assert r.status_code == 400, host  # nothing written either
        assert (await c.get("/api/v1/suites")).json()["total"] == 0
    async with client_for(make_settings(db_url, api_token=None, allowed_hosts="swerve.lan")) as c:
        assert (await c.get("/api/v1/suites", headers={"Host": "swerve.lan:8000"})).status_code == 200
    async with client_for(make_settings(db_url)) as c:  # with a token the token guards it
        assert (await c.get("/api/v1/suites", headers={"Host": "swerve.example.com"})).status_code == 200
