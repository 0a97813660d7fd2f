"""A run's trajectories as a dataset: one row per episode, in JSON Lines or Parquet, that
Hugging Face `datasets` loads as it is (`load_dataset("json" | "parquet", data_files=...)`), for
SFT, distillation or offline RL.

A row holds the episode as chat messages (system, user, then each assistant turn with its tool
call and the tool's answer), its exact token sequences (one per segment: the tokens the sampler
saw, a loss mask over the sampled ones and their logprobs beside them), its turns, reward,
grading report and diff. Rows stream page by page (`PAGE` episodes, with their turns, at a
time), so memory stays flat whatever the run's size. What a caller may see is decided by
`Answers`, as everywhere: without the API token an oracle's or a demonstration's turns,
tokens and diff, and a report's logs, are withheld and named in `redacted`.

    swerve export RUN --format parquet --out run.parquet --min-reward 1
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Literal, get_args

import numpy as np
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession

from envs.swe_env import SYSTEM_PROMPT
from envs.tools import TOOLS
from service.control.redaction import Answers, is_oracle
from service.store.records import decode_array
from service.store.status import EpisodeStatus
from service.store.tables import Episode, Run, Task, Turn

Format = Literal["jsonl", "parquet"]
FORMATS: tuple[str, ...] = ("jsonl", "parquet")
PAGE = 64
"""Episodes read per query."""
PAGE_TOKENS = 2**18
"""Tokens (of episodes' turns) loaded and converted at once; a Parquet row group holds one page."""
EPISODE_STATUSES: tuple[str, ...] = get_args(EpisodeStatus)
MEDIA_TYPES = {"jsonl": "application/x-ndjson", "parquet": "application/vnd.apache.parquet"}


class ExportError(ValueError):
    """A bad export request; the message names the field and what to do."""


@dataclass(frozen=True)
class ExportFilter:
    min_reward: float | None = None
    max_reward: float | None = None
    statuses: tuple[str, ...] = ()
    """Episode statuses to keep (none given: every status)."""

    def __post_init__(self) -> None:
        unknown = [s for s in self.statuses if s not in EPISODE_STATUSES]
        if unknown:
            raise ExportError(f"status: {', '.join(map(repr, unknown))} is not an episode status; "
                              f"use one of {', '.join(EPISODE_STATUSES)}")
        if self.min_reward is not None and self.max_reward is not None and self.min_reward > self.max_reward:
            raise ExportError(f"min_reward ({self.min_reward}) is above max_reward ({self.max_reward}): "
                              "swap them or drop one")

    def where(self) -> list:
        out = []
        if self.min_reward is not None:
            out.append(Episode.reward >= self.min_reward)
        if self.max_reward is not None:
            out.append(Episode.reward <= self.max_reward)
        if self.statuses:
            out.append(Episode.status.in_(self.statuses))
        return out


def check_format(fmt: str) -> Format:
    if fmt not in FORMATS:
        raise ExportError(f"format: {fmt!r} is not an export format; use one of {', '.join(FORMATS)}")
    return fmt  # type: ignore[return-value]


def _iso(t) -> str | None:
    return t.isoformat() if t is not None else None


def _messages(problem: str, turns: list[Turn]) -> list[dict]:
    """The conversation as the agent loop built it (service.worker.agent.run_episode)."""
    out = [{"role": "system", "content": SYSTEM_PROMPT, "tool_calls": None},
           {"role": "user", "content": problem, "tool_calls": None}]
    for t in turns:
        calls = [{"name": t.tool_call["name"], "arguments": json.dumps(t.tool_call.get("arguments", {}))}] \
            if t.tool_call else None
        out.append({"role": "assistant", "content": t.text or "", "tool_calls": calls})
        if t.observation is not None:
            out.append({"role": "tool", "content": t.observation, "tool_calls": None})
    return out


def _segments(turns: list[Turn]) -> list[dict]:
    """One token sequence per segment: input_ids + output_ids of its turns, the loss mask on the
    sampled tokens, their logprobs (0.0 elsewhere), as trainer.data.episode_sequences builds it."""
    by_segment: dict[int, list[Turn]] = {}
    for t in turns:
        by_segment.setdefault(t.segment, []).append(t)
    out = []
    for segment, seg_turns in by_segment.items():
        ids, mask, logprobs = [], [], []
        for t in seg_turns:
            inp, outp = decode_array(t.input_ids), decode_array(t.output_ids)
            lp = decode_array(t.output_logprobs) if t.output_logprobs else np.zeros(len(outp), dtype=np.float32)
            ids += [inp, outp]
            mask += [np.zeros(len(inp), dtype=bool), np.ones(len(outp), dtype=bool)]
            logprobs += [np.zeros(len(inp), dtype=np.float32), lp.astype(np.float32)]
        out.append({"segment": segment, "token_ids": np.concatenate(ids).astype(np.int64).tolist(),
                    "loss_mask": np.concatenate(mask).tolist(),
                    "logprobs": np.concatenate(logprobs).astype(np.float32).tolist()})
    return out


def _turn(t: Turn) -> dict:
    return {"idx": t.idx, "segment": t.segment, "policy_version": t.policy_version,
            "finish_reason": t.finish_reason, "text": t.text,
            "tool_call": json.dumps(t.tool_call) if t.tool_call is not None else None,
            "observation": t.observation, "n_input_tokens": t.n_input_tokens,
            "n_output_tokens": t.n_output_tokens}


def _row(run: Run, e: Episode, task: Task, turns: list[Turn], answers: Answers, oracle: bool) -> dict:
    hide = answers.hides_turns(oracle)
    report = answers.report(e.report)
    redacted = list((report or {}).get("redacted", []))
    if report is not None:
        report = {k: v for k, v in report.items() if k != "redacted"}
    if hide:
        redacted += ["messages", "segments", "turns", "diff"]
    error_message = e.error_message
    if not answers.shown and e.error_type == "RewardError":  # carries the grading sandbox's output
        error_message, redacted = None, [*redacted, "error_message"]
    return {
        "run_id": str(run.id), "run_name": run.name, "episode_id": str(e.id), "group_id": str(e.group_id),
        "instance_id": task.instance_id, "repo": task.repo, "base_commit": task.base_commit,
        "problem_statement": task.problem_statement, "sample_index": e.sample_index, "status": e.status,
        "trainable": e.trainable, "reward": e.reward,
        "resolution": (e.report or {}).get("resolution"),
        "policy_version_min": e.policy_version_min, "policy_version_max": e.policy_version_max,
        "n_turns": e.n_turns, "input_tokens": e.input_tokens, "output_tokens": e.output_tokens,
        "error_type": e.error_type, "error_message": error_message,
        "started_at": _iso(e.started_at), "finished_at": _iso(e.finished_at),
        "tools": json.dumps(TOOLS),
        "messages": None if hide else _messages(task.problem_statement, turns),
        "segments": None if hide else _segments(turns),
        "turns": None if hide else [_turn(t) for t in turns],
        "diff": None if hide else e.diff,
        "report": json.dumps(report) if report is not None else None,
        "guards": json.dumps(e.guards) if e.guards is not None else None,
        "redacted": redacted,
    }


async def get_run(engine: AsyncEngine, run_id: uuid.UUID) -> Run:
    from service.control.views import NotFound

    async with AsyncSession(engine) as session:
        run = await session.get(Run, run_id)
    if run is None:
        raise NotFound(f"run {run_id} not found")
    return run


async def rows(engine: AsyncEngine, run_id: uuid.UUID, answers: Answers, flt: ExportFilter = ExportFilter(),
               page: int = PAGE, page_tokens: int = PAGE_TOKENS) -> AsyncIterator[list[dict]]:  # fmt: skip
    """The run's episodes that pass `flt`, as export rows, in a fixed order (creation, then sample
    index): pages of at most `page` episodes and, but for a longer episode alone, `page_tokens`
    tokens (what bounds the memory: a 131k-token episode's row is ~10 MB in Python); raises
    NotFound for an unknown run."""
    run = await get_run(engine, run_id)
    oracle = is_oracle(run.config)
    after: tuple | None = None
    while True:
        query = (sa.select(Episode, Task).join(Task, Task.id == Episode.task_id)
                 .where(Episode.run_id == run_id, *flt.where()))
        if after is not None:  # keyset pagination: no offset scans on a large run
            query = query.where(sa.tuple_(Episode.created_at, Episode.sample_index, Episode.id) > sa.tuple_(*after))
        query = query.order_by(Episode.created_at, Episode.sample_index, Episode.id).limit(page)
        async with AsyncSession(engine) as session:
            found = (await session.execute(query)).all()
        if not found:
            return
        for chunk in _by_tokens(found, page_tokens):
            ids = [e.id for e, _ in chunk]
            turns: dict[uuid.UUID, list[Turn]] = {i: [] for i in ids}
            if not answers.hides_turns(oracle):
                async with AsyncSession(engine) as session:
                    for t in (await session.scalars(sa.select(Turn).where(Turn.episode_id.in_(ids))
                                                    .order_by(Turn.episode_id, Turn.idx))).all():
                        turns[t.episode_id].append(t)
            yield [_row(run, e, task, turns[e.id], answers, oracle) for e, task in chunk]
        last = found[-1][0]
        after = (last.created_at, last.sample_index, last.id)


def _by_tokens(found: list, limit: int) -> list[list]:
    """Consecutive runs of episodes of at most `limit` tokens together (one at least)."""
    out, size = [[]], 0
    for row in found:
        n = (row[0].input_tokens or 0) + (row[0].output_tokens or 0)
        if out[-1] and size + n > limit:
            out.append([])
            size = 0
        out[-1].append(row)
        size += n
    return out


def _schema():
    import pyarrow as pa

    message = pa.struct([("role", pa.string()), ("content", pa.string()), ("tool_calls", pa.list_(
        pa.struct([("name", pa.string()), ("arguments", pa.string())])))])
    segment = pa.struct([("segment", pa.int32()), ("token_ids", pa.list_(pa.int64())),
                         ("loss_mask", pa.list_(pa.bool_())), ("logprobs", pa.list_(pa.float32()))])
    turn = pa.struct([("idx", pa.int32()), ("segment", pa.int32()), ("policy_version", pa.int64()),
                      ("finish_reason", pa.string()), ("text", pa.string()), ("tool_call", pa.string()),
                      ("observation", pa.string()), ("n_input_tokens", pa.int64()), ("n_output_tokens", pa.int64())])
    s, i = pa.string(), pa.int64()
    return pa.schema([
        ("run_id", s), ("run_name", s), ("episode_id", s), ("group_id", s), ("instance_id", s), ("repo", s),
        ("base_commit", s), ("problem_statement", s), ("sample_index", i), ("status", s), ("trainable", pa.bool_()),
        ("reward", pa.float64()), ("resolution", s), ("policy_version_min", i), ("policy_version_max", i),
        ("n_turns", i), ("input_tokens", i), ("output_tokens", i), ("error_type", s), ("error_message", s),
        ("started_at", s), ("finished_at", s), ("tools", s), ("messages", pa.list_(message)),
        ("segments", pa.list_(segment)), ("turns", pa.list_(turn)), ("diff", s), ("report", s), ("guards", s),
        ("redacted", pa.list_(s)),
    ])  # fmt: skip


class _Chunks:
    """A write-only file for pyarrow that hands out what was written since the last take()."""

    def __init__(self):
        self.parts: list[bytes] = []
        self.closed = False
        self.pos = 0

    def write(self, data) -> int:
        b = bytes(data)
        self.parts.append(b)
        self.pos += len(b)
        return len(b)

    def tell(self) -> int:
        return self.pos

    def flush(self) -> None:
        pass

    def close(self) -> None:
        self.closed = True

    def writable(self) -> bool:
        return True

    def take(self) -> bytes:
        out, self.parts = b"".join(self.parts), []
        return out


class Encoder:
    """Pages of rows in, bytes of the file out (`feed` then `finish`): JSON Lines or Parquet."""

    def __init__(self, fmt: Format):
        self.fmt = check_format(fmt)
        self._sink: _Chunks | None = None
        self._writer = None
        if fmt == "parquet":
            import pyarrow.parquet as pq

            self._sink = _Chunks()
            self._writer = pq.ParquetWriter(self._sink, _schema(), compression="zstd")

    def feed(self, page: list[dict]) -> bytes:
        if self.fmt == "jsonl":
            return "".join(json.dumps(r, ensure_ascii=False, separators=(",", ":")) + "\n" for r in page).encode()
        import pyarrow as pa

        self._writer.write_table(pa.Table.from_pylist(page, schema=_schema()))
        return self._sink.take()

    def finish(self) -> bytes:
        if self._writer is None:
            return b""
        self._writer.close()
        return self._sink.take()


async def stream(engine: AsyncEngine, run_id: uuid.UUID, fmt: Format, answers: Answers,
                 flt: ExportFilter = ExportFilter(), page: int = PAGE, page_tokens: int = PAGE_TOKENS,
                 counts: dict | None = None) -> AsyncIterator[bytes]:  # fmt: skip
    """The export file's bytes, page by page (raises NotFound for an unknown run on the first);
    `counts["rows"]`, when given, counts the rows written."""
    encoder = Encoder(fmt)
    async for p in rows(engine, run_id, answers, flt, page, page_tokens):
        if counts is not None:
            counts["rows"] = counts.get("rows", 0) + len(p)
        if chunk := encoder.feed(p):
            yield chunk
    if chunk := encoder.finish():
        yield chunk
