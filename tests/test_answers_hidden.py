"""Answers need the token: with SWERVE_API_TOKEN set, no response of the API or the web UI to a
caller without it (no header, a wrong one) carries the gold patch, the hidden tests, a grading
log tail, a validation log or anything of an oracle episode (turns, tokens, diff). Every GET
route of the app is walked, so a route added later is covered without editing this file."""

from __future__ import annotations

import base64
import itertools
import json
import re
import uuid

import pytest
import sqlalchemy as sa
from fastapi.routing import APIRoute

from envs.grading import GradingReport
from envs.task import Task as TaskRecord
from envs.validate import ValidationResult
from service.store import db
from service.store.records import TurnRecord
from service.store.buffer import Buffer
from service.config import load_settings
from service.worker.scripted import oracle_actions
from service.control.runs import create_run
from service.worker.config import RunConfig
from service.store.tasks import task_from_row
from service.store.tables import Episode, Evaluation, EvaluationInstance, Group, Run, Suite, Task, Turn
from service.fleet.tiny_model import init_tiny
from service.ui import pages
from tests.conftest import TOKEN, auth, client_for, make_settings

GOLD = "GOLDFIX_3b9d1e"  # in the gold patch
HIDDEN = "HIDDENTEST_7c21aa"  # in the hidden tests: test_patch, grading log tails, validation logs
MODEL = "MODELSAID_54e0f2"  # a model's own text and diff: not an answer
REDACTED = "redacted: needs the API token"
SHOWN_REDACTED = f'class="redacted">{REDACTED}<'  # how a page says it withheld something
WITHOUT_TOKEN = [{}, {"Authorization": "Bearer wrong-token"}, {"Authorization": TOKEN}]


def record(i: int) -> dict:
    # the second also carries answers in fields of the datasets' own (SWE-smith's bug, R2E-Gym's commit)
    extra = {"bug_patch": f"-x = '{GOLD}'\n+x = 0\n", "parsed_commit_content": json.dumps({"fix": GOLD})} if i else {}
    return extra | {
        "instance_id": f"org__m-{i}", "repo": "org/m", "base_commit": "a" * 40,
        "problem_statement": "x must be right", "FAIL_TO_PASS": ["tests/test_m.py::test_x"],
        "PASS_TO_PASS": ["tests/test_m.py::test_keep"],
        "patch": f"diff --git a/m.py b/m.py\n--- a/m.py\n+++ b/m.py\n@@ -1 +1 @@\n-x = 0\n+x = '{GOLD}'\n",
        "test_patch": ("diff --git a/tests/test_m.py b/tests/test_m.py\n--- a/tests/test_m.py\n+++ b/tests/test_m.py\n"
                       f"@@ -1 +1,2 @@\n def test_keep(): pass\n+def test_x(): assert m.x == '{HIDDEN}'\n"),
    }  # fmt: skip


def report(resolution: str) -> dict:
    passed = resolution == "FULL"
    return GradingReport(
        resolution=resolution, test_exit_code=0 if passed else 1,
        log_tail=f"tests/test_m.py:2: in test_x\n    assert m.x == '{HIDDEN}'\nFAILED tests/test_m.py::test_x\n",
        fail_to_pass={"success": ["tests/test_m.py::test_x"] if passed else [],
                      "failure": [] if passed else ["tests/test_m.py::test_x"]},
        pass_to_pass={"success": ["tests/test_m.py::test_keep"], "failure": []},
        tests={"tests/test_m.py::test_x": "PASSED" if passed else "FAILED"},
    ).to_json()  # fmt: skip


async def add_turns(buffer: Buffer, tok, episode_id: uuid.UUID, texts: list[str], observation: str) -> None:
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    for idx, text in enumerate(texts):
        call = json.loads(text.split("\n")[1]) if text.startswith("<tool_call>") else None
        ids = tok.encode(text, add_special_tokens=False) + [eos]
        await buffer.append_turn(episode_id, TurnRecord(
            idx=idx, segment=0, input_ids=tok.encode(f"<|im_start|>user\n{observation}", add_special_tokens=False),
            output_ids=ids, output_logprobs=[0.0] * len(ids), policy_version=0, finish_reason="stop", text=text,
            tool_call=call, observation=observation, generation_s=0.1, tool_s=0.1))


async def episodes_of(engine, run_id: uuid.UUID) -> list:
    """A run's episodes in task order: rows of the task's columns plus `episode_id`."""
    async with engine.connect() as conn:
        return (await conn.execute(sa.select(Episode.id.label("episode_id"), *Task.__table__.columns)
                                   .join(Task, Task.id == Episode.task_id).where(Episode.run_id == run_id)
                                   .order_by(Task.position))).all()


async def oracle_run(engine, suite_id: uuid.UUID, tok, tokenizer_dir) -> uuid.UUID:
    run_id = await create_run(engine, RunConfig.model_validate({
        "suite_id": suite_id, "name": "oracle", "sampler": {"type": "oracle", "tokenizer": str(tokenizer_dir)}}))
    buffer = Buffer(engine)
    for row in await episodes_of(engine, run_id):
        gold = task_from_row(row)
        # what the oracle sends (the gold patch in its first call); its bash shows what it applied
        await add_turns(buffer, tok, row.episode_id, oracle_actions(gold), observation=f"M m.py\n{gold.patch}")
        await buffer.finish_episode(row.episode_id, status="submitted", reward=1.0, n_turns=3, diff=gold.patch,
                                    report=report("FULL"), policy_version_min=0, policy_version_max=0)
    return run_id


async def model_run(engine, suite_id: uuid.UUID, tok, tokenizer_dir) -> uuid.UUID:
    run_id = await create_run(engine, RunConfig.model_validate({
        "suite_id": suite_id, "name": "model",
        "sampler": {"type": "vllm", "endpoints": ["http://127.0.0.1:9"], "tokenizer": str(tokenizer_dir)}}))
    buffer = Buffer(engine)
    diff = f"diff --git a/m.py b/m.py\n--- a/m.py\n+++ b/m.py\n@@ -1 +1 @@\n-x = 0\n+x = '{MODEL}'\n"
    for n, episode_id in enumerate(row.episode_id for row in await episodes_of(engine, run_id)):
        await add_turns(buffer, tok, episode_id, [f"I think x should be {MODEL}"], observation="ok")
        if n == 0:
            await buffer.finish_episode(episode_id, status="submitted", reward=0.0, n_turns=1, diff=diff,
                                        report=report("NO"), policy_version_min=0, policy_version_max=0)
        else:  # the harness failed: its message carries the grading sandbox's output
            error = f"the test patch does not apply: error: {HIDDEN}"
            await buffer.finish_episode(episode_id, status="reward_error", n_turns=1, diff=diff,
                                        report={"error": error, "log_tail": f"... {HIDDEN}"},
                                        error_type="RewardError", error_message=error)
    return run_id


async def validations(engine, suite_id: uuid.UUID) -> None:
    """One valid task (its reports carry the hidden tests' log) and one whose harness failed."""
    async with engine.begin() as conn:
        tasks = (await conn.execute(sa.select(Task.id, Task.instance_id).where(Task.suite_id == suite_id)
                                    .order_by(Task.position))).all()
        valid = ValidationResult(tasks[0].instance_id, True, report("FULL"), report("NO"), 1.0, 1.0)
        broken = ValidationResult(tasks[1].instance_id, False, None, None, 0.0, 0.0,
                                  f"RewardError: the test patch does not apply: {HIDDEN}")
        for task, result in zip(tasks, (valid, broken)):
            await conn.execute(sa.update(Task).where(Task.id == task.id).values(validation=result.to_json()))
        await conn.execute(sa.update(Suite).where(Suite.id == suite_id).values(validation_status="done"))


async def evaluation(engine, suite_id: uuid.UUID) -> tuple[uuid.UUID, list[str]]:
    """A finished evaluation: one prediction graded (its test log names the hidden test), one
    whose grading failed with the harness's output."""
    from envs.predictions import Prediction
    from service.control.evaluations import EvaluationConfig, create_evaluation

    async with engine.connect() as conn:
        ids = (await conn.execute(sa.select(Task.instance_id).where(Task.suite_id == suite_id)
                                  .order_by(Task.position))).scalars().all()
    patch = f"diff --git a/m.py b/m.py\n--- a/m.py\n+++ b/m.py\n@@ -1 +1 @@\n-x = 0\n+x = '{MODEL}'\n"
    evaluation_id = await create_evaluation(engine, suite_id, "r", [Prediction(i, "m", patch) for i in ids],
                                            EvaluationConfig())
    async with engine.begin() as conn:
        for n, instance_id in enumerate(ids):
            values = ({"status": "unresolved", "report": {instance_id: {"resolved": False}},
                       "test_output": f"FAILED tests/test_m.py::test_x - assert m.x == '{HIDDEN}'"} if n == 0 else
                      {"status": "error", "error": f"RewardError: the test patch does not apply: {HIDDEN}",
                       "test_output": f"error: {HIDDEN}"})
            await conn.execute(sa.update(EvaluationInstance).where(EvaluationInstance.instance_id == instance_id,
                                                                   EvaluationInstance.evaluation_id == evaluation_id)
                               .values(**values))
        await conn.execute(sa.update(Evaluation).where(Evaluation.id == evaluation_id).values(status="done"))
    return evaluation_id, list(ids)


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    return init_tiny(tmp_path_factory.mktemp("tiny") / "tiny")


@pytest.fixture
async def answers(db_url, tokenizer_dir):
    """The app with a token, a suite whose two tasks have answers, a finished oracle run and a
    finished model run over it, and the suite's validation results."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    served = client_for(make_settings(db_url))
    async with served as client:
        body = "".join(json.dumps(record(i)) + "\n" for i in range(2))
        created = await client.post("/api/v1/suites", params={"name": "answers"}, content=body,
                                    headers={"Content-Type": "application/x-ndjson", **auth()})
        assert created.status_code == 201, created.text
        suite_id = uuid.UUID(created.json()["id"])
        engine = db.make_async_engine(db_url)
        try:
            runs = [await oracle_run(engine, suite_id, tok, tokenizer_dir),
                    await model_run(engine, suite_id, tok, tokenizer_dir)]
            await validations(engine, suite_id)
            evaluation_id, evaluated = await evaluation(engine, suite_id)
            async with engine.begin() as conn:
                await conn.execute(sa.update(Run).values(status="finished"))
            episodes = [[row.episode_id for row in await episodes_of(engine, r)] for r in runs]
            tasks = [row.id for row in await episodes_of(engine, runs[0])]
            async with engine.connect() as conn:
                groups = (await conn.execute(sa.select(Group.id).where(Group.run_id.in_(runs)))).scalars().all()
                blobs = (await conn.execute(sa.select(Turn.input_ids, Turn.output_ids)
                                            .where(Turn.episode_id.in_(episodes[0])))).all()
        finally:
            await engine.dispose()
        first_call = tok.encode(oracle_actions(TaskRecord.model_validate(record(0)))[0], add_special_tokens=False)
        yield {
            "client": client, "app": served.app, "suite_id": [suite_id], "task_id": tasks,
            "run_id": runs, "run": runs, "episode_id": episodes[0] + episodes[1], "turn": [0, 1], "group_id": groups,
            "oracle_run": runs[0], "model_run": runs[1], "oracle_episodes": episodes[0],
            "model_episodes": episodes[1], "evaluation_id": [evaluation_id], "instance_id": evaluated,
            # an oracle turn's tokens as a JSON list and as stored bytes (arrays=base64)
            "secrets": sorted({GOLD, HIDDEN, ",".join(map(str, first_call[:40]))}
                              | {base64.b64encode(b).decode() for row in blobs for b in row}),
        }  # fmt: skip


def get_routes(app) -> list[tuple[str, list[dict]]]:
    """Every GET route: the OpenAPI document's (with their parameters) and the UI's pages."""
    routes = [(path, ops["get"].get("parameters", [])) for path, ops in app.openapi()["paths"].items()
              if "get" in ops]
    for route in pages.router.routes:
        if isinstance(route, APIRoute) and "GET" in route.methods:
            routes.append((route.path, [{"name": n, "in": "path", "required": True} for n in route.param_convertors]))
    return routes


def requests_for(path: str, parameters: list[dict], values: dict) -> list[tuple[str, dict]]:
    """(url, query) for every combination of the known ids and of each enum's values."""
    choices = {}
    for p in parameters:
        enum = (p.get("schema") or {}).get("enum")
        if p.get("required"):
            if p["name"] not in values:
                pytest.fail(f"GET {path}: no value for its required parameter {p['name']!r}; add one to the fixture")
            choices[(p["in"], p["name"])] = values[p["name"]]
        elif enum:
            choices[(p["in"], p["name"])] = enum
    out = []
    for combo in itertools.product(*choices.values()):
        chosen = dict(zip(choices, combo))
        url = re.sub(r"\{(\w+):\w+\}", r"{\1}", path).format(  # a Starlette converter ({id:path}) names the id
            **{name: v for (where, name), v in chosen.items() if where == "path"})
        out.append((url, {name: str(v) for (where, name), v in chosen.items() if where == "query"}))
    return out


def strings(value) -> str:
    """Every string in a JSON value, concatenated (token texts split a marker across items)."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict):
        return "".join(strings(v) for v in value.values())
    if isinstance(value, list):
        return "".join(strings(v) for v in value)
    return ""


async def test_no_route_shows_answers_without_the_token(answers):
    client, walked, leaks = answers["client"], 0, []
    for path, parameters in get_routes(answers["app"]):
        for url, query in requests_for(path, parameters, answers):
            for headers in WITHOUT_TOKEN:
                response = await client.get(url, params=query, headers=headers)
                walked += 1
                where = f"GET {url} {query} {headers}"
                assert response.status_code < 500, where
                if not url.startswith("/api/"):
                    assert response.status_code == 200, where  # a redacted page, never an error page
                body = response.text
                if response.headers.get("content-type", "").startswith("application/json"):
                    body += strings(response.json())
                leaks += [f"{where}: {s[:20]}" for s in answers["secrets"] if s in body]
    assert walked > 100
    assert not leaks, "\n".join(leaks)


async def test_with_the_token_everything_is_shown(answers):
    client, headers = answers["client"], auth()
    for task_id in answers["task_id"]:
        task = (await client.get(f"/api/v1/tasks/{task_id}", headers=headers)).json()
        assert GOLD in task["patch"] and HIDDEN in task["test_patch"] and task["redacted"] == []
    assert any(GOLD in (t["extra"] or {}).get("bug_patch", "") for t in
               [(await client.get(f"/api/v1/tasks/{i}", headers=headers)).json() for i in answers["task_id"]])
    oracle = answers["oracle_episodes"][0]
    detail = (await client.get(f"/api/v1/episodes/{oracle}", params={"arrays": "json"}, headers=headers)).json()
    assert GOLD in detail["turns"][0]["text"] and GOLD in detail["turns"][0]["tool_call"]["arguments"]["file_text"]
    assert GOLD in detail["turns"][1]["observation"] and detail["turns"][0]["output_ids"]
    assert GOLD in detail["diff"] and HIDDEN in detail["report"]["log_tail"] and detail["redacted"] == []
    tokens = (await client.get(f"/api/v1/episodes/{oracle}/tokens", params={"turn": 0}, headers=headers)).json()
    assert GOLD in "".join(t["text"] for t in tokens["tokens"])
    validation = (await client.get(f"/api/v1/suites/{answers['suite_id'][0]}/validation", headers=headers)).json()
    assert HIDDEN in validation["results"][1]["error"]
    broken = answers["model_episodes"][1]
    listed = (await client.get(f"/api/v1/runs/{answers['model_run']}/episodes", headers=headers)).json()["items"]
    assert HIDDEN in next(e for e in listed if e["id"] == str(broken))["error_message"]
    for path in (f"/episodes/{oracle}", f"/tasks/{answers['task_id'][0]}"):
        html = (await client.get(path, headers=headers)).text
        assert HIDDEN in html and SHOWN_REDACTED not in html
    assert GOLD in (await client.get(f"/episodes/{oracle}", headers=headers)).text


async def test_without_the_token_what_is_withheld_says_so_and_the_rest_stays(answers):
    client = answers["client"]
    oracle, model = answers["oracle_episodes"][0], answers["model_episodes"][0]
    detail = (await client.get(f"/api/v1/episodes/{oracle}", params={"arrays": "json"})).json()
    assert set(detail["redacted"]) == {"turns", "diff"} and set(detail["report"]["redacted"]) == {"log_tail", "tests"}
    assert detail["diff"] is None and detail["report"]["resolution"] == "FULL"
    assert detail["report"]["fail_to_pass"]["success"] == ["tests/test_m.py::test_x"]
    assert detail["report"]["test_exit_code"] == 0 and detail["report"]["log_tail"] is None
    turn = detail["turns"][0]
    assert (turn["text"], turn["tool_call"], turn["observation"], turn["output_ids"]) == (None, None, None, None)
    assert turn["redacted"] and turn["n_output_tokens"] > 0
    tokens = (await client.get(f"/api/v1/episodes/{oracle}/tokens", params={"turn": 0})).json()
    assert (tokens["tokens"], tokens["redacted"]) == ([], ["tokens"])
    # a model's own turns and diff are not answers
    detail = (await client.get(f"/api/v1/episodes/{model}", params={"arrays": "json"})).json()
    assert MODEL in detail["turns"][0]["text"] and MODEL in detail["diff"] and detail["turns"][0]["output_ids"]
    assert detail["redacted"] == [] and set(detail["report"]["redacted"]) == {"log_tail", "tests"}
    tokens = (await client.get(f"/api/v1/episodes/{model}/tokens", params={"turn": 0})).json()
    assert MODEL in "".join(t["text"] for t in tokens["tokens"])
    html = (await client.get(f"/episodes/{model}")).text
    assert MODEL in html and "resolution: <b>NO</b>" in html and html.count(SHOWN_REDACTED) == 1  # the log tail
    html = (await client.get(f"/episodes/{oracle}")).text
    assert html.count(SHOWN_REDACTED) == 5 and 'id="turn-2"' in html and "resolution: <b>FULL</b>" in html
    broken = (await client.get(f"/episodes/{answers['model_episodes'][1]}")).text
    assert "RewardError" in broken and broken.count(SHOWN_REDACTED) == 3  # message, harness error, log tail
    validation = (await client.get(f"/api/v1/suites/{answers['suite_id'][0]}/validation")).json()
    assert [(r["valid"], r["gold"], r["error"]) for r in validation["results"]] == [(True, "FULL", None), (False, None, None)]
    assert [r["redacted"] for r in validation["results"]] == [[], ["error"]]
    html = (await client.get(f"/tasks/{answers['task_id'][0]}")).text
    assert SHOWN_REDACTED in html and "FULL" in html


async def test_the_ui_learns_the_token_from_a_cookie_that_cannot_act(answers):
    client, oracle = answers["client"], answers["oracle_episodes"][0]
    page = f"/episodes/{oracle}"
    wrong = await client.post("/ui/token", data={"token": "wrong", "next": page})
    assert wrong.status_code == 303 and "swerve_answers" not in client.cookies
    right = await client.post("/ui/token", data={"token": TOKEN, "next": "//evil.example/x"})
    assert right.status_code == 303 and right.headers["location"] == "/"  # only this site's paths
    cookie = right.headers["set-cookie"].lower()
    assert "httponly" in cookie and "samesite=strict" in cookie and TOKEN not in cookie
    html = (await client.get(page)).text
    assert GOLD in html and HIDDEN in html and SHOWN_REDACTED not in html
    detail = (await client.get(f"/api/v1/episodes/{oracle}")).json()  # the page's own fetches
    assert GOLD in detail["turns"][0]["text"]
    # the cookie shows answers; changing anything still needs the Authorization header
    assert (await client.post(f"/api/v1/runs/{answers['oracle_run']}/cancel")).status_code == 401
    await client.post("/ui/token", data={"token": "", "next": page})  # forget it
    assert GOLD not in (await client.get(page)).text


async def test_local_mode_shows_everything(answers, db_url):
    oracle = answers["oracle_episodes"][0]
    async with client_for(load_settings(database_url=db_url, embedded_worker=False)) as client:
        detail = (await client.get(f"/api/v1/episodes/{oracle}")).json()
        assert GOLD in detail["diff"] and detail["redacted"] == []
        assert GOLD in (await client.get(f"/episodes/{oracle}")).text
