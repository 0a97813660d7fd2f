"""`swerve export` and GET /api/v1/runs/{id}/export: a run's episodes as a dataset that Hugging
Face `datasets` loads as it is, on PostgreSQL and SQLite. The rows carry the exact tokens the
sampler saw (one sequence per segment, the loss mask on the sampled tokens, their logprobs), the
messages with their tool calls, the reward and the grading report; filters keep what they say;
pages of any size give the same rows; without the API token an oracle's turns are withheld."""

from __future__ import annotations

import asyncio
import io
import json
import uuid

import numpy as np
import pyarrow.parquet as pq
import pytest
import sqlalchemy as sa

from service.control import export
from service.control.redaction import Answers
from service.control.runs import create_run
from service.store import db
from service.store.buffer import Buffer
from service.store.records import TurnRecord
from service.store.tables import Episode, Run, Suite, Task, utcnow
from service.worker.config import RunConfig
from tests.conftest import auth, client_for, make_settings
from tests.test_cli import run_cli

PROBLEM = "`f(2)` returns 3; it should return 4. 🐛 <b>bold</b>"


def turn(idx: int, segment: int, seed: int, final: bool = False) -> TurnRecord:
    rng = np.random.default_rng(seed)
    n_in, n_out = int(rng.integers(1, 9)), int(rng.integers(1, 6))
    call = {"name": "submit", "arguments": {}} if final else \
        {"name": "bash", "arguments": {"command": f"echo {seed} 'quoted \"x\"'"}}
    return TurnRecord(idx=idx, segment=segment, input_ids=rng.integers(0, 2000, n_in).tolist(),
                      output_ids=rng.integers(0, 2000, n_out).tolist(),
                      output_logprobs=(-rng.random(n_out)).astype(np.float32).tolist(), policy_version=seed % 3,
                      policy_version_end=seed % 3, finish_reason="stop", text=f"turn {idx} of {seed}",
                      tool_call=call, observation=None if final else f"out {idx}\n", generation_s=0.1, tool_s=0.1)


async def make_run(engine, sampler: dict, n_tasks: int = 3, samples: int = 2) -> tuple[uuid.UUID, dict]:
    """A finished run: episodes with 1-3 turns (the second sample of each task in two segments),
    rewards alternating 0/1, one harness failure. Returns (run id, {episode id: its turns})."""
    suite_id = uuid.uuid4()
    async with engine.begin() as conn:
        await conn.execute(sa.insert(Suite).values(id=suite_id, name=f"export-{suite_id.hex[:6]}",
                                                   task_count=n_tasks, created_at=utcnow()))
        await conn.execute(sa.insert(Task), [{
            "id": uuid.uuid4(), "suite_id": suite_id, "position": i, "instance_id": f"org__r-{i}", "repo": "org/r",
            "base_commit": "c" * 40, "problem_statement": PROBLEM, "patch": "GOLD", "test_patch": "HIDDEN",
            "fail_to_pass": ["t::a"], "pass_to_pass": [], "log_parser": "pytest"} for i in range(n_tasks)])
    run_id = await create_run(engine, RunConfig.model_validate(
        {"suite_id": suite_id, "name": f"export {suite_id.hex[:6]}", "samples_per_task": samples, "sampler": sampler}))
    buffer, turns = Buffer(engine), {}
    async with engine.connect() as conn:
        episodes = (await conn.execute(sa.select(Episode.id, Episode.sample_index).where(Episode.run_id == run_id)
                                       .order_by(Episode.created_at, Episode.sample_index, Episode.id))).all()
    for n, (episode_id, sample) in enumerate(episodes):
        k = 1 + n % 3
        records = [turn(i, int(sample == 1 and i > 0), 100 * n + i, final=i == k - 1) for i in range(k)]
        for r in records:
            await buffer.append_turn(episode_id, r)
        turns[episode_id] = records
        failed = n == len(episodes) - 1
        await buffer.finish_episode(
            episode_id, status="reward_error" if failed else "submitted", reward=None if failed else float(n % 2),
            n_turns=k, input_tokens=sum(len(r.input_ids) for r in records),
            output_tokens=sum(len(r.output_ids) for r in records), policy_version_min=0, policy_version_max=2,
            diff=f"diff --git a/f.py b/f.py\n+x = {n}\n", error_type="RewardError" if failed else None,
            error_message="grading log: HIDDEN" if failed else None,
            report=None if failed else {"resolution": "FULL" if n % 2 else "NO", "log_tail": "HIDDEN log",
                                        "fail_to_pass": {"success": [], "failure": []}})
    async with engine.begin() as conn:
        await conn.execute(sa.update(Run).where(Run.id == run_id).values(status="finished", finished_at=utcnow()))
    return run_id, turns


VLLM = {"type": "vllm", "endpoints": ["http://127.0.0.1:9"], "tokenizer": "/nonexistent"}
ORACLE = {"type": "oracle", "tokenizer": "/nonexistent"}


async def exported(engine, run_id, fmt, answers=Answers(shown=True), flt=export.ExportFilter(), page=export.PAGE,
                   page_tokens=export.PAGE_TOKENS):
    return b"".join([c async for c in export.stream(engine, run_id, fmt, answers, flt, page, page_tokens)])


def load(data: bytes, fmt: str, tmp_path) -> list[dict]:
    """The file as Hugging Face `datasets` loads it."""
    import datasets

    path = tmp_path / f"{uuid.uuid4().hex}.{fmt}"
    path.write_bytes(data)
    ds = datasets.load_dataset("json" if fmt == "jsonl" else "parquet", data_files=str(path), split="train",
                               cache_dir=str(tmp_path / "hf-cache"))
    return list(ds)


@pytest.fixture
async def engine(db_url):
    eng = db.make_async_engine(db_url)
    yield eng
    await eng.dispose()


@pytest.mark.parametrize("fmt", export.FORMATS)
async def test_rows_hold_the_exact_tokens_messages_and_grades(engine, fmt, tmp_path):
    run_id, turns = await make_run(engine, VLLM)
    rows = load(await exported(engine, run_id, fmt), fmt, tmp_path)
    assert [uuid.UUID(r["episode_id"]) for r in rows] == list(turns)
    for n, row in enumerate(rows):
        records = turns[uuid.UUID(row["episode_id"])]
        by_segment = {}
        for r in records:
            by_segment.setdefault(r.segment, []).append(r)
        assert [s["segment"] for s in row["segments"]] == sorted(by_segment)
        for seg in row["segments"]:
            rs = by_segment[seg["segment"]]
            assert seg["token_ids"] == [t for r in rs for t in r.input_ids + r.output_ids]
            assert seg["loss_mask"] == [m for r in rs for m in [False] * len(r.input_ids) + [True] * len(r.output_ids)]
            want = [lp for r in rs for lp in [0.0] * len(r.input_ids) + r.output_logprobs]
            assert np.array_equal(np.float32(seg["logprobs"]), np.float32(want))  # float32 both ways: exact
        roles = [m["role"] for m in row["messages"]]
        assert roles[:2] == ["system", "user"] and row["messages"][1]["content"] == PROBLEM
        assert roles[2:] == [role for r in records for role in (["assistant"] + (["tool"] if r.observation else []))]
        calls = [m["tool_calls"][0] for m in row["messages"] if m["role"] == "assistant"]
        assert [(c["name"], json.loads(c["arguments"])) for c in calls] == \
            [(r.tool_call["name"], r.tool_call["arguments"]) for r in records]
        assert [t["text"] for t in row["turns"]] == [r.text for r in records]
        assert [json.loads(t["tool_call"]) for t in row["turns"]] == [r.tool_call for r in records]
        assert [t["function"]["name"] for t in json.loads(row["tools"])] == ["bash", "str_replace_editor", "submit"]
        if n == len(rows) - 1:
            assert row["status"] == "reward_error" and row["reward"] is None and row["report"] is None
            assert row["error_message"] == "grading log: HIDDEN"  # the CLI's caller may see everything
        else:
            assert row["reward"] == float(n % 2) and row["resolution"] == ("FULL" if n % 2 else "NO")
            assert json.loads(row["report"])["log_tail"] == "HIDDEN log"
        assert row["diff"] == f"diff --git a/f.py b/f.py\n+x = {n}\n" and row["instance_id"].startswith("org__r-")


async def test_filters_keep_what_they_say_and_pages_change_nothing(engine, tmp_path):
    run_id, turns = await make_run(engine, VLLM, n_tasks=4)
    everything = load(await exported(engine, run_id, "jsonl"), "jsonl", tmp_path)
    assert len(everything) == len(turns) == 8
    parquet = load(await exported(engine, run_id, "parquet"), "parquet", tmp_path)
    for page, page_tokens in ((1, export.PAGE_TOKENS), (3, export.PAGE_TOKENS), (7, export.PAGE_TOKENS), (7, 1), (5, 20)):
        assert load(await exported(engine, run_id, "jsonl", page=page, page_tokens=page_tokens), "jsonl",
                    tmp_path) == everything
        assert load(await exported(engine, run_id, "parquet", page=page, page_tokens=page_tokens), "parquet",
                    tmp_path) == parquet
    solved = load(await exported(engine, run_id, "jsonl", flt=export.ExportFilter(min_reward=1.0)), "jsonl", tmp_path)
    assert solved and [r["episode_id"] for r in solved] == [r["episode_id"] for r in everything if r["reward"] == 1.0]
    failed = await exported(engine, run_id, "jsonl", flt=export.ExportFilter(statuses=("reward_error",)))
    assert [json.loads(line)["status"] for line in failed.splitlines()] == ["reward_error"]
    none = await exported(engine, run_id, "parquet", flt=export.ExportFilter(max_reward=-1.0))
    assert pq.read_table(io.BytesIO(none)).num_rows == 0  # an empty export is still a valid file
    with pytest.raises(export.ExportError, match="status: 'done' is not an episode status"):
        export.ExportFilter(statuses=("done",))
    with pytest.raises(export.ExportError, match="min_reward"):
        export.ExportFilter(min_reward=1.0, max_reward=0.0)
    with pytest.raises(export.ExportError, match="format: 'csv'"):
        export.check_format("csv")


async def test_over_the_api_streamed_and_redacted_without_the_token(db_url, engine, tmp_path):
    model_run, _ = await make_run(engine, VLLM)
    oracle_run, _ = await make_run(engine, ORACLE)
    async with client_for(make_settings(db_url)) as client:
        for fmt in export.FORMATS:
            r = await client.get(f"/api/v1/runs/{model_run}/export", params={"format": fmt, "min_reward": 1},
                                 headers=auth())
            assert r.status_code == 200 and r.headers["content-type"].startswith(export.MEDIA_TYPES[fmt])
            assert f"run-{model_run}.{fmt}" in r.headers["content-disposition"]
            rows = load(r.content, fmt, tmp_path)
            assert rows and all(row["reward"] == 1.0 and row["segments"] for row in rows)
            hidden = load((await client.get(f"/api/v1/runs/{oracle_run}/export", params={"format": fmt})).content,
                          fmt, tmp_path)
            assert hidden and all(row["messages"] is None and row["segments"] is None and row["turns"] is None
                                  and row["diff"] is None for row in hidden)
            assert all({"messages", "segments", "turns", "diff", "log_tail"} <= set(row["redacted"])
                       for row in hidden if row["report"] is not None)
            assert all("HIDDEN" not in json.dumps(row) for row in hidden)
            shown = load((await client.get(f"/api/v1/runs/{oracle_run}/export", params={"format": fmt},
                                           headers=auth())).content, fmt, tmp_path)
            assert all(row["segments"] and row["redacted"] == [] for row in shown)
        r = await client.get(f"/api/v1/runs/{model_run}/export", params={"format": "csv"})
        assert r.status_code == 422
        r = await client.get(f"/api/v1/runs/{model_run}/export", params={"status": "done"})
        assert r.status_code == 422 and "status: 'done'" in r.json()["detail"]
        r = await client.get(f"/api/v1/runs/{uuid.uuid4()}/export")
        assert r.status_code == 404


async def test_the_cli_writes_the_file_whole_by_id_or_name(db_url, engine, tmp_path):
    run_id, turns = await make_run(engine, VLLM)
    async with engine.connect() as conn:
        name = await conn.scalar(sa.select(Run.name).where(Run.id == run_id))
    env = {"SWERVE_DATABASE_URL": db_url, "SWERVE_DATA_DIR": str(tmp_path / "var")}

    def swerve(*args):
        return asyncio.to_thread(run_cli, ["export", *args], env)

    out = tmp_path / "run.parquet"
    for ref in (str(run_id), name):
        done = await swerve(ref, "--format", "parquet", "--out", str(out))
        assert done.returncode == 0, done.stderr
        summary = json.loads(done.stdout)
        assert summary["rows"] == len(turns) and summary["path"] == str(out)
        assert pq.read_table(out).num_rows == len(turns)
        assert not list(tmp_path.glob(".*.partial"))
    done = await swerve("no-such-run", "--out", str(tmp_path / "x.jsonl"))
    assert done.returncode == 1 and "0 runs are named 'no-such-run'" in done.stderr
    assert not (tmp_path / "x.jsonl").exists()
    done = await swerve(str(run_id), "--format", "csv")
    assert done.returncode == 2 and "format: 'csv'" in done.stderr


async def test_the_run_page_links_to_its_export(db_url, engine, tmp_path):
    import re

    run_id, turns = await make_run(engine, VLLM)
    async with client_for(make_settings(db_url)) as client:
        page = (await client.get(f"/runs/{run_id}", headers=auth())).text
        links = dict(re.findall(r'id="export-(\w+)" href="([^"]+)"', page))
        assert set(links) == set(export.FORMATS)
        for fmt, href in links.items():
            r = await client.get(href.replace("&amp;", "&"), headers=auth())
            assert r.status_code == 200 and len(load(r.content, fmt, tmp_path)) == len(turns)
