"""Streaming suite import: parse JSONL, a JSON array or Parquet chunk by chunk, validate, insert in batches.

A suite is all-or-nothing: one bad record rolls the whole import back, and the error list
names every bad record's line (JSONL) or index (JSON array), instance_id and field path.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterable, AsyncIterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import ijson
import orjson
import sqlalchemy as sa
from pydantic import ValidationError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from envs import datasets
from envs.swe_env import source_problem
from envs.task import Task
from service.store.tables import Suite, utcnow
from service.store.tables import Task as TaskRow
from service.store.tasks import task_row

INSERT_BATCH = 500
JSONL_TYPES = ("application/x-ndjson", "application/jsonl", "application/x-jsonlines")
JSON_TYPES = ("application/json",)
PARQUET_TYPES = ("application/vnd.apache.parquet", "application/x-parquet", "application/parquet")


@dataclass(frozen=True, slots=True)
class RecordError:
    line: int | None
    """1-based line of a JSONL upload (None for a JSON array)."""
    index: int | None
    """0-based position in a JSON array (None for JSONL)."""
    instance_id: str | None
    field: str | None
    """Dotted path of the bad field, e.g. `FAIL_TO_PASS.2`; None when the whole record is bad."""
    message: str


class SuiteImportError(Exception):
    """Base of the errors an import raises; nothing has been written when one is raised."""


class SuiteRejected(SuiteImportError):
    def __init__(self, errors: list[RecordError], error_count: int):
        self.errors, self.error_count = errors, error_count
        super().__init__(f"{error_count} invalid record(s); nothing was imported")

    def to_json(self) -> dict[str, Any]:
        return {"detail": str(self), "error_count": self.error_count,
                "errors": [asdict(e) for e in self.errors]}


class UploadTooLarge(SuiteImportError):
    def __init__(self, limit: int):
        super().__init__(f"upload exceeds {limit} bytes (SWERVE_MAX_UPLOAD_BYTES); split the "
                         "suite or raise the limit")


class SuiteNameTaken(SuiteImportError):
    def __init__(self, name: str):
        super().__init__(f"a suite named {name!r} exists; delete it or choose another name")


@dataclass(frozen=True, slots=True)
class ImportResult:
    suite_id: uuid.UUID
    name: str
    task_count: int


@dataclass(frozen=True, slots=True)
class _Parsed:
    """One record out of the parser: the decoded object, or why it could not be decoded."""

    line: int | None
    index: int | None
    obj: Any = None
    error: str | None = None


async def limit_size(chunks: AsyncIterable[bytes], limit: int) -> AsyncIterator[bytes]:
    seen = 0
    async for chunk in chunks:
        seen += len(chunk)
        if seen > limit:
            raise UploadTooLarge(limit)
        yield chunk


DEFAULT_MAX_RECORD_BYTES = 64 * 1024 * 1024
"""Largest single record a parser holds (SWERVE_MAX_RECORD_BYTES sets the service's)."""


def _too_large(limit: int) -> str:
    return (f"record is larger than {limit} bytes (SWERVE_MAX_RECORD_BYTES); shorten it or raise the limit "
            "(the rest of the upload is still checked, nothing is imported)")


async def parse_jsonl(chunks: AsyncIterable[bytes], max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES,
                      ) -> AsyncIterator[_Parsed]:  # fmt: skip
    """One record per line, in time linear in the upload whatever the line lengths (a line's
    pieces are joined once, at its end) and memory bounded by `max_record_bytes`: a longer
    line is an error record and its bytes are dropped as they arrive."""
    line_no, parts, size = 0, [], 0
    async for chunk in chunks:
        start = 0
        while (end := chunk.find(b"\n", start)) >= 0:
            line_no += 1
            size += end - start
            if size > max_record_bytes:
                yield _Parsed(line=line_no, index=None, error=_too_large(max_record_bytes))
            else:
                raw = b"".join((*parts, chunk[start:end])) if parts else chunk[start:end]
                if raw.strip():
                    yield _decode_line(raw, line_no)
            parts, size, start = [], 0, end + 1
        size += len(chunk) - start
        if size <= max_record_bytes:
            parts.append(chunk[start:])
        else:
            parts = []  # too long already: keep counting, hold nothing
    if size > max_record_bytes:
        yield _Parsed(line=line_no + 1, index=None, error=_too_large(max_record_bytes))
    elif parts and (raw := b"".join(parts)).strip():
        yield _decode_line(raw, line_no + 1)


def _decode_line(raw: bytes, line_no: int) -> _Parsed:
    try:
        return _Parsed(line=line_no, index=None, obj=orjson.loads(raw))
    except orjson.JSONDecodeError as e:
        return _Parsed(line=line_no, index=None, error=f"malformed JSON: {e}")


class _AsyncReader:
    """The file-like object ijson's async API reads from. It hands ijson reads of up to
    READ_BYTES (a long string split over many small reads costs ijson time quadratic in their
    number) and stops a record that grew past the limit and a read (ijson reads ahead, so the
    bytes read since the last record ended are the record's within a read); the parser then
    measures each record it gets exactly."""

    READ_BYTES = 4 * 1024 * 1024

    def __init__(self, chunks: AsyncIterable[bytes], max_record_bytes: int):
        self._it, self._first, self._done = aiter(chunks), True, False
        self.max_record_bytes, self.since_record = max_record_bytes, 0
        self.read_bytes = min(self.READ_BYTES, max(1 << 16, max_record_bytes))

    async def read(self, n: int = -1) -> bytes:
        if n == 0:  # ijson probes the type of what read() returns
            return b""
        parts, size = [], 0
        while not self._done and size < self.read_bytes:
            try:
                chunk = await anext(self._it)
            except StopAsyncIteration:
                self._done = True
                break
            parts.append(chunk)
            size += len(chunk)
        data = b"".join(parts)
        if self._first and data.strip():
            self._first = False
            if not data.lstrip().startswith(b"["):
                raise _NotAnArray
        if self.since_record > self.max_record_bytes + self.read_bytes:  # before this read: ijson holds them
            raise _RecordTooLarge
        self.since_record += len(data)
        return data or (b"" if self._done else b" ")


class _NotAnArray(Exception):
    pass


class _RecordTooLarge(Exception):
    pass


async def parse_json_array(chunks: AsyncIterable[bytes], max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES,
                           ) -> AsyncIterator[_Parsed]:  # fmt: skip
    index = 0
    reader = _AsyncReader(chunks, max_record_bytes)
    try:
        async for obj in ijson.items(reader, "item", use_float=True, buf_size=reader.read_bytes):
            if _size(obj) > max_record_bytes:  # held, but never more than the limit and two reads
                yield _Parsed(line=None, index=index, error=_too_large(max_record_bytes))
            else:
                yield _Parsed(line=None, index=index, obj=obj)
            reader.since_record = 0
            index += 1
    except _NotAnArray:
        yield _Parsed(line=None, index=None, error="a JSON suite must be an array of task "
                      "objects; send JSONL as application/x-ndjson")
    except _RecordTooLarge:  # an array cannot be resynchronised past a record: the upload stops here
        yield _Parsed(line=None, index=index, error=_too_large(max_record_bytes))
    except ijson.JSONError as e:
        yield _Parsed(line=None, index=index, error=f"malformed JSON after record {index}: {e}")


def _nul_path(value: Any, path: str = "") -> str | None:
    """The field path of the first string holding a NUL character, if any."""
    if isinstance(value, str):
        return path or None if "\x00" in value else None
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        key_path = f"{path}.{key}" if path else str(key)
        if isinstance(key, str) and "\x00" in key:
            return key_path.replace("\x00", "\\u0000")
        if found := _nul_path(item, key_path):
            return found
    return None


def _validate(parsed: _Parsed, fmt: str = "auto", source_roots: tuple[Path, ...] | None = None,
              ) -> Task | list[RecordError]:  # fmt: skip
    def error(field: str | None, message: str, instance_id: str | None = None) -> RecordError:
        return RecordError(parsed.line, parsed.index, instance_id, field, message)

    if parsed.error is not None:
        return [error(None, parsed.error)]
    if not isinstance(parsed.obj, dict):
        return [error(None, f"a task must be a JSON object, got {type(parsed.obj).__name__}")]
    instance_id = parsed.obj.get("instance_id")
    instance_id = instance_id if isinstance(instance_id, str) else None
    if nul := _nul_path(parsed.obj):
        return [error(nul, "holds a NUL character (\\u0000), which no database text column stores; "
                           "remove it (patches and tests cannot contain one either)", instance_id)]
    try:
        task = Task.model_validate(datasets.adapt(parsed.obj, fmt))
    except datasets.DatasetRowError as e:
        return [error(e.field, str(e), instance_id)]
    except ValidationError as e:
        return [
            error(".".join(str(p) for p in err["loc"]) or None, err["msg"], instance_id)
            for err in e.errors(include_url=False)
        ]
    if problem := source_problem(task.source, source_roots):
        return [error("source", problem, instance_id)]
    return task


async def _name_taken(conn: AsyncConnection, name: str) -> bool:
    query = sa.select(Suite.id).where(Suite.name == name, Suite.deleted_at.is_(None))
    return (await conn.execute(query)).first() is not None


async def import_suite(
    engine: AsyncEngine, name: str, records: AsyncIterable[_Parsed], *, max_listed_errors: int,
    fmt: str = "auto", source_roots: tuple[Path, ...] | None = None,
) -> ImportResult:
    """Validate and insert every record in one transaction. Raises SuiteImportError. A task
    whose `source` is a host path outside `source_roots` (None: any) is refused."""
    suite_id, errors, error_count = uuid.uuid4(), [], 0
    seen: dict[str, int | None] = {}
    batch: list[dict[str, Any]] = []
    try:
        async with engine.begin() as conn:
            if await _name_taken(conn, name):
                raise SuiteNameTaken(name)
            await conn.execute(sa.insert(Suite).values(
                id=suite_id, name=name, task_count=0, created_at=utcnow()))
            async for parsed in records:
                result = _validate(parsed, fmt, source_roots)
                if isinstance(result, Task) and result.instance_id in seen:
                    first = seen[result.instance_id]
                    result = [RecordError(parsed.line, parsed.index, result.instance_id,
                                          "instance_id", f"duplicate instance_id (first at "
                                          f"{'line' if parsed.line else 'index'} {first})")]
                if isinstance(result, list):
                    error_count += len(result)
                    errors.extend(result[: max(0, max_listed_errors - len(errors))])
                    continue
                seen[result.instance_id] = parsed.line or parsed.index
                if error_count:
                    continue  # keep validating to report every error, but stop writing
                batch.append(task_row(result, suite_id, len(seen) - 1))
                if len(batch) >= INSERT_BATCH:
                    await conn.execute(sa.insert(TaskRow), batch)
                    batch = []
            if not error_count and not seen:
                errors, error_count = [RecordError(None, None, None, None, "no tasks")], 1
            if error_count:
                raise SuiteRejected(errors, error_count)
            if batch:
                await conn.execute(sa.insert(TaskRow), batch)
            await conn.execute(
                sa.update(Suite).where(Suite.id == suite_id).values(task_count=len(seen)))
    except sa.exc.IntegrityError as e:
        if "name" in str(e.orig):
            raise SuiteNameTaken(name) from e
        raise
    return ImportResult(suite_id=suite_id, name=name, task_count=len(seen))


async def file_chunks(path: str, size: int = 1 << 20) -> AsyncIterator[bytes]:
    with open(path, "rb") as f:
        while chunk := f.read(size):
            yield chunk


def parser_for(content_type: str) -> Any:
    """The record parser for a media type, or None when the type is not a suite format."""
    media = content_type.split(";")[0].strip().lower()
    if media in JSONL_TYPES:
        return parse_jsonl
    if media in JSON_TYPES:
        return parse_json_array
    if media in PARQUET_TYPES:
        return parse_parquet_upload
    return None


async def parse_parquet_upload(chunks: AsyncIterable[bytes], max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES,
                               ) -> AsyncIterator[_Parsed]:  # fmt: skip
    """An uploaded Parquet file's rows: the body is spooled to a temporary file first (Parquet's
    index is at its end), the rows then read one row group at a time."""
    import tempfile

    with tempfile.NamedTemporaryFile(prefix="swerve-upload-", suffix=".parquet") as spool:
        async for chunk in chunks:
            await asyncio.to_thread(spool.write, chunk)
        await asyncio.to_thread(spool.flush)
        async for parsed in parse_parquet(spool.name, max_record_bytes):
            yield parsed


async def parse_parquet(path: str, max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES) -> AsyncIterator[_Parsed]:
    """A Parquet file's rows (as the Hugging Face datasets ship them), one row group at a time."""
    import pyarrow.parquet as pq

    try:
        file = pq.ParquetFile(path)
    except Exception as e:  # noqa: BLE001 - pyarrow raises several kinds for a bad file
        yield _Parsed(line=None, index=0, error=f"not a Parquet file: {e}")
        return
    index = 0
    for group in range(file.num_row_groups):
        for obj in file.read_row_group(group).to_pylist():
            if _size(obj) > max_record_bytes:
                yield _Parsed(line=None, index=index, error=_too_large(max_record_bytes))
            else:
                yield _Parsed(line=None, index=index, obj=obj)
            index += 1


def _size(value: Any) -> int:
    """About the bytes a record's JSON would take (its strings' lengths); iterative, so a
    record nested thousands deep is measured, not a RecursionError."""
    total, stack = 0, [value]
    while stack:
        item = stack.pop()
        if isinstance(item, (str, bytes)):
            total += len(item)
        elif isinstance(item, dict):
            total += sum(len(str(k)) for k in item)
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            total += len(item)
            stack.extend(item)
        else:
            total += 8
    return total


def records_of_file(path: str) -> AsyncIterator[_Parsed]:
    """The records of a suite file: JSON Lines, a JSON array or Parquet."""
    if path.endswith(".parquet"):
        return parse_parquet(path)
    return parser_for_file(path)(file_chunks(path))


def parser_for_file(path: str) -> Any:
    if path.endswith(".json"):
        return parse_json_array
    with open(path, "rb") as f:
        head = f.read(4096).lstrip()
    return parse_json_array if head.startswith(b"[") else parse_jsonl
