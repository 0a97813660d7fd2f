"""The SWE environment end to end on real sandboxes: the oracle sampler earns 1.0 and the empty
patch 0.0 on every example task, on both backends; tools answer bad calls with observations."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from envs.grading import RewardError
from envs.swe_env import SWEEnv, SWEEnvConfig, grade, task_sandbox
from envs.task import Task
from service.worker.agent import AgentConfig, MemoryTurnSink, TokenRenderer, run_episode
from service.worker.scripted import oracle, replay
from service.fleet.tiny_model import init_tiny
from tests.sandbox_fixtures import backend  # noqa: F401 - fixture
from tests.conftest import clean_env

pytestmark = pytest.mark.slow
SUITE = Path(__file__).resolve().parent.parent / "envs" / "example_suite" / "suite.jsonl"
TASKS = [Task.model_validate(json.loads(line)) for line in SUITE.read_text().splitlines()]


@pytest.fixture(scope="session")
def tokenizer(tmp_path_factory):
    return AutoTokenizer.from_pretrained(init_tiny(tmp_path_factory.mktemp("tok") / "tiny"))


@pytest.fixture(scope="session")
def image_cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("images")


def config(backend: str, image_cache: Path) -> SWEEnvConfig:
    return SWEEnvConfig(backend=backend, image_cache_dir=image_cache)


def test_example_suite_has_twenty_tasks_over_several_repositories():
    assert len(TASKS) >= 20 and len({t.repo for t in TASKS}) >= 4
    assert all(t.patch and t.test_patch and t.FAIL_TO_PASS for t in TASKS)


async def test_oracle_earns_one_and_empty_patch_zero_on_every_task(backend, image_cache, tokenizer):
    cfg = config(backend, image_cache)
    renderer = TokenRenderer(tokenizer, SWEEnv.tools)
    for task in TASKS:
        async with task_sandbox(task, cfg) as sandbox:
            sink = MemoryTurnSink()
            result = await run_episode(oracle(tokenizer, task), SWEEnv(task, sandbox, cfg), renderer,
                                       AgentConfig(max_turns=10), sink)
        assert (result.status, result.n_turns) == ("submitted", 3), task.instance_id
        assert (await grade(task, result.diff, cfg)).reward() == 1.0, task.instance_id
        empty = await grade(task, "", cfg)
        assert empty.reward() == 0.0 and empty.fail_to_pass["success"] == [], task.instance_id


async def test_agent_cannot_see_the_hidden_tests(image_cache):
    task = TASKS[0]
    cfg = config("bwrap", image_cache)
    async with task_sandbox(task, cfg) as sandbox:
        listing = await sandbox.execute("ls tests; git log --all --oneline | wc -l; grep -r test_truncate_uses . || true")
    assert "test_issue" not in listing.output
    assert "test_truncate_uses_the_whole_length" not in listing.output


async def test_patch_that_does_not_apply_is_a_reward_error_not_zero(image_cache):
    task = TASKS[0]
    bad = "diff --git a/nothing.py b/nothing.py\n--- a/nothing.py\n+++ b/nothing.py\n@@ -1 +1 @@\n-x\n+y\n"
    with pytest.raises(RewardError, match="does not apply"):
        await grade(task, bad, config("bwrap", image_cache))


async def test_hidden_tests_past_their_limit_are_a_test_timeout_not_the_agents_timeout(image_cache):
    task = TASKS[0].model_copy(update={"test_cmd": "sleep 30"})
    cfg = config("bwrap", image_cache).model_copy(update={"test_timeout_s": 1.0})
    with pytest.raises(RewardError, match="did not finish within 1.0 s") as caught:
        await grade(task, "", cfg)
    assert caught.value.kind == "test_timeout"


async def test_new_and_binary_files_are_in_the_diff(image_cache, tokenizer):
    task = TASKS[0]
    cfg = config("bwrap", image_cache)
    async with task_sandbox(task, cfg) as sandbox:
        env = SWEEnv(task, sandbox, cfg)
        await sandbox.execute("echo 'new' > added.txt && printf '\\x00\\x01\\x02' > blob.bin")
        diff = await env.diff()
    assert "added.txt" in diff and "GIT binary patch" in diff


BAD_CALLS = {
    "no tool call": ("I think the bug is in trunc.py", "No tool call found"),
    "broken JSON": ('<tool_call>\n{"name": "bash", "arguments": {"command": "ls"\n</tool_call>', "not valid JSON"),
    "unknown tool": ('<tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call>', "Unknown tool"),
    "bash without command": ('<tool_call>\n{"name": "bash", "arguments": {}}\n</tool_call>', 'needs a non-empty "command"'),
    "editor bad command": ('<tool_call>\n{"name": "str_replace_editor", "arguments": {"command": "delete", "path": "a"}}\n</tool_call>', "Unknown command"),
    "zero matches": ('<tool_call>\n{"name": "str_replace_editor", "arguments": {"command": "str_replace", "path": "textkit/trunc.py", "old_str": "NOT THERE", "new_str": "x"}}\n</tool_call>', "occurs 0 times"),
    "several matches": ('<tool_call>\n{"name": "str_replace_editor", "arguments": {"command": "str_replace", "path": "textkit/trunc.py", "old_str": "text", "new_str": "x"}}\n</tool_call>', "must occur exactly once"),
    "create existing": ('<tool_call>\n{"name": "str_replace_editor", "arguments": {"command": "create", "path": "textkit/trunc.py", "file_text": "x"}}\n</tool_call>', "already exists"),
    "missing file": ('<tool_call>\n{"name": "str_replace_editor", "arguments": {"command": "view", "path": "nope.py"}}\n</tool_call>', "does not exist"),
    "binary output": ('<tool_call>\n{"name": "bash", "arguments": {"command": "head -c 3000 /dev/urandom"}}\n</tool_call>', "exit code 0"),
    "binary view": ('<tool_call>\n{"name": "str_replace_editor", "arguments": {"command": "view", "path": "/tmp/b.bin"}}\n</tool_call>', "binary file"),
    "10 MB view": ('<tool_call>\n{"name": "str_replace_editor", "arguments": {"command": "view", "path": "/tmp/big.txt"}}\n</tool_call>', "too large to view whole"),
    "huge output": ('<tool_call>\n{"name": "bash", "arguments": {"command": "seq 1 200000"}}\n</tool_call>', "cut from the middle"),
}


async def test_bad_tool_calls_get_clear_observations(image_cache):
    task = TASKS[0]
    cfg = config("bwrap", image_cache)
    async with task_sandbox(task, cfg) as sandbox:
        await sandbox.execute("printf '\\x00\\x01binary' > /tmp/b.bin && head -c 10000000 /dev/zero | tr '\\0' x > /tmp/big.txt")
        env = SWEEnv(task, sandbox, cfg)
        for name, (text, expected) in BAD_CALLS.items():
            step = await env.step(text)
            assert expected in step.observation and not step.done, (name, step.observation[:300])
            assert len(step.observation) <= cfg.max_observation_chars + 100, name


async def test_editor_edits_and_undo(image_cache):
    task = TASKS[0]
    cfg = config("bwrap", image_cache)

    def call(**arguments) -> str:
        return "<tool_call>\n" + json.dumps({"name": "str_replace_editor", "arguments": arguments}) + "\n</tool_call>"

    async with task_sandbox(task, cfg) as sandbox:
        env = SWEEnv(task, sandbox, cfg)
        view = await env.step(call(command="view", path="textkit/trunc.py", view_range=[1, 2]))
        assert view.observation.startswith("     1\tdef truncate")
        await env.step(call(command="str_replace", path="textkit/trunc.py", old_str="length - len(suffix) - 1", new_str="length - len(suffix)"))
        await env.step(call(command="insert", path="textkit/trunc.py", insert_line=0, new_str="# fixed"))
        assert (await sandbox.read_file("textkit/trunc.py")).startswith(b"# fixed\n")
        await env.step(call(command="undo_edit", path="textkit/trunc.py"))
        await env.step(call(command="undo_edit", path="textkit/trunc.py"))
        assert b"length - len(suffix) - 1" in await sandbox.read_file("textkit/trunc.py")
        listing = await env.step(call(command="view", path="."))
        assert "textkit/trunc.py" in listing.observation


async def test_replay_policy_runs_recorded_calls(image_cache, tokenizer):
    task = TASKS[0]
    cfg = config("bwrap", image_cache)
    calls = [{"name": "bash", "arguments": {"command": "cd textkit && pwd"}},
             {"name": "bash", "arguments": {"command": "pwd"}}, {"name": "submit", "arguments": {}}]
    async with task_sandbox(task, cfg) as sandbox:
        sink = MemoryTurnSink()
        result = await run_episode(replay(tokenizer, calls), SWEEnv(task, sandbox, cfg),
                                   TokenRenderer(tokenizer, SWEEnv.tools), AgentConfig(), sink)
    assert result.status == "submitted" and [t.tool_call["name"] for t in sink.turns] == ["bash", "bash", "submit"]
    assert sink.turns[1].observation.startswith("/work/textkit")
    assert result.diff == ""


def run_validate(args: list[str], data_dir: Path):
    import os
    import subprocess
    import sys

    env = clean_env() | {"SWERVE_DATA_DIR": str(data_dir)}
    return subprocess.run([sys.executable, "-m", "service.cli", "suite", "validate", *args],
                          capture_output=True, text=True, env=env, timeout=600)


def test_validate_cli_json_cache_and_invalid_tasks(tmp_path):
    import shutil
    import time

    ids = [TASKS[0].instance_id, TASKS[5].instance_id]
    first = run_validate([str(SUITE), "--json", *sum((["--only", i] for i in ids), [])], tmp_path)
    assert first.returncode == 0, first.stderr
    results = json.loads(first.stdout)
    assert [r["instance_id"] for r in results] == ids and all(r["valid"] for r in results)
    assert results[0]["gold"]["resolution"] == "FULL" and results[0]["empty"]["resolution"] == "NO"
    started = time.monotonic()
    assert run_validate([str(SUITE), "--only", ids[0]], tmp_path).returncode == 0
    assert time.monotonic() - started < 15  # environments are cached

    broken = tmp_path / "broken" / "suite.jsonl"
    broken.parent.mkdir()
    shutil.copytree(SUITE.parent / "bundles", broken.parent / "bundles")
    task = json.loads(SUITE.read_text().splitlines()[0])
    task["patch"] = ""  # no fix: the gold patch cannot resolve it
    broken.write_text(json.dumps(task) + "\n")
    refused = run_validate([str(broken)], tmp_path)
    assert refused.returncode == 1 and "NO" in refused.stdout


async def test_api_validates_a_suite_in_the_background(db_url, tmp_path):
    import asyncio

    from tests.conftest import auth, client_for, make_settings

    body = "\n".join(SUITE.read_text().splitlines()[:2]) + "\n"
    async with client_for(make_settings(db_url, data_dir=tmp_path)) as client:
        suite = (await client.post("/api/v1/suites", params={"name": "ex"}, content=body,
                                   headers={"Content-Type": "application/x-ndjson", **auth()})).json()
        url = f"/api/v1/suites/{suite['id']}"
        assert (await client.get(f"{url}/validation")).json() == {"status": "never", "validated_at": None, "results": []}
        assert (await client.post(f"{url}/validate")).status_code == 401
        started = await client.post(f"{url}/validate", headers=auth())
        assert started.status_code == 202
        assert (await client.post(f"{url}/validate", headers=auth())).status_code == 409
        for _ in range(600):
            state = (await client.get(f"{url}/validation")).json()
            if state["status"] != "running":
                break
            await asyncio.sleep(0.2)
    assert state["status"] == "done"
    assert [(r["valid"], r["gold"], r["empty"]) for r in state["results"]] == [(True, "FULL", "NO")] * 2


async def test_a_validation_whose_process_died_is_taken_over_and_ends(db_url, tmp_path):
    import asyncio
    import uuid
    from datetime import timedelta

    import sqlalchemy as sa

    from service.store import db
    from service.store.tables import Suite, utcnow
    from tests.conftest import auth, client_for, make_settings

    body = "\n".join(SUITE.read_text().splitlines()[:1]) + "\n"
    settings = make_settings(db_url, data_dir=tmp_path, orchestrator_lease_s=2.0)
    async with client_for(settings) as client:
        suite = (await client.post("/api/v1/suites", params={"name": "ex"}, content=body,
                                   headers={"Content-Type": "application/x-ndjson", **auth()})).json()
    engine = db.make_async_engine(db_url)
    try:  # a process started validating it and died: its status says running, its heartbeat is old
        async with engine.begin() as conn:
            await conn.execute(sa.update(Suite).where(Suite.id == uuid.UUID(suite["id"])).values(
                validation_status="running", validation_owner="dead:1:x",
                validation_heartbeat_at=utcnow() - timedelta(hours=1)))
    finally:
        await engine.dispose()
    async with client_for(settings) as client:
        url = f"/api/v1/suites/{suite['id']}"
        for _ in range(600):
            state = (await client.get(f"{url}/validation")).json()
            if state["status"] != "running":
                break
            await asyncio.sleep(0.2)
        assert state["status"] == "done" and [r["valid"] for r in state["results"]] == [True], state
        assert (await client.post(f"{url}/validate", headers=auth())).status_code == 202  # and again, at will
