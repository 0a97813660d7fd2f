"""The trajectory buffer in the database: turns are appended as they complete, a group becomes
ready when all its episodes are final, and the trainer claims ready groups under a lease.

A claim is committed when the training step that used it commits; a lease that expires
returns its groups, so a crashed trainer loses nothing and trains on nothing twice. On
PostgreSQL claims use `FOR UPDATE SKIP LOCKED`; SQLite (embedded, one process) serialises
writers instead. Text that agents and tasks wrote goes through `storable` on its way in, so
no bytes can fail a write. Light module: no FastAPI, no Celery.
"""

from __future__ import annotations

import asyncio
import json
import re
import struct
import uuid
from collections import namedtuple
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from functools import lru_cache

import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from service.store.db import libpq_url
from service.store.records import TurnRecord, decode_array, encode_ids, encode_logprobs, encode_routed_experts
from service.store.tables import Episode, Group, Policy, Run, Task, Turn, utcnow
from service.store.status import EPISODE_FINAL, RUN_ACTIVE, EpisodeStatus, RunKind, RunStatus


class Superseded(Exception):
    """A newer attempt of the episode took over (its worker was presumed dead): this attempt
    may write nothing more."""


class TurnsLost(Exception):
    """Fewer turns are stored than the episode produced (turns are committed asynchronously
    and the database crashed before they reached its disk): the attempt must start over."""


class ClaimLost(Exception):
    """The claim's lease expired and its groups went back to the buffer (or to another trainer)."""


class StorageError(Exception):
    """The database refused a write for good (a value or a constraint it rejects, not a lost
    connection): the same write would fail again, so the episode ends storage_error."""


# C0 controls but tab and line breaks, DEL, lone surrogates: PostgreSQL takes no NUL in text or
# jsonb, neither database takes a lone surrogate, and escape sequences would drive the terminal
# of whoever reads the row.
_UNSTORABLE = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f\ud800-\udfff]")


def _picture(match: re.Match) -> str:
    code = ord(match.group())
    return "\u2421" if code == 0x7F else chr(0x2400 + code) if code < 0x20 else "\ufffd"


def storable(value):
    """A text or JSON value as the database keeps it: in every string (keys too) NUL, ESC and
    the other controls but tab and line breaks become their Unicode control pictures (U+2400 +
    code: NUL ␀, ESC ␛, DEL ␡) and lone surrogates U+FFFD; all else is unchanged. Display text
    only: token ids, what the model saw and what training reads, are stored apart, untouched."""
    if isinstance(value, str):
        return _UNSTORABLE.sub(_picture, value)
    if isinstance(value, dict):
        return {storable(k): storable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [storable(v) for v in value]
    return value


@contextmanager
def _refusals(what: str) -> Iterator[None]:
    """Raise StorageError for a write the database refuses; a lost connection, a pool timeout
    or a conflict between transactions passes unchanged, for the caller to retry."""
    try:
        yield
    except sa.exc.DBAPIError as e:
        sqlstate = getattr(e.orig, "sqlstate", None) or ""
        # psycopg files PostgreSQL's class 54 (program limit exceeded) as operational, yet it is final
        if isinstance(e, (sa.exc.OperationalError, sa.exc.InterfaceError)) and not sqlstate.startswith("54"):
            raise
        reason = str(e.orig).splitlines()[0] if str(e.orig) else ""
        raise StorageError(f"the database refused {what}: {type(e.orig).__name__}: {reason}") from e


LEFT_AT_END = "the training run {}"
"""The reason of a group dropped because its training run ended (finished, cancelled, failed)."""
GIVEN_BACK = {"status": "ready", "claim_id": None, "claim_expires_at": None, "claimed_by": None}
"""A group given back to the buffer (released, its owner gone, or un-consumed by a rewind)."""


@dataclass(frozen=True)
class PlannedGroup:
    """A group a run's schedule adds: its place, epoch and task; `skipped` (why) when the
    difficulty filter passes the task over; `version`: the fleet's policy version then."""

    seq: int
    epoch: int
    task_id: uuid.UUID
    skipped: str | None = None
    version: int | None = None


@dataclass(frozen=True)
class Claim:
    id: uuid.UUID
    group_ids: list[uuid.UUID]
    dropped: int
    """Groups found too stale while queued: marked dropped, not handed out."""


@dataclass
class EpisodeData:
    id: uuid.UUID
    sample_index: int
    status: EpisodeStatus
    reward: float | None
    policy_version_min: int | None
    turns: list[TurnRecord] = field(default_factory=list)
    """Token arrays as numpy arrays; the display fields are not loaded."""


@dataclass
class GroupData:
    id: uuid.UUID
    run_id: uuid.UUID
    task_id: uuid.UUID
    episodes: list[EpisodeData]


def _insert(conn: AsyncConnection):
    return pg_insert if conn.dialect.name == "postgresql" else sqlite_insert


_PG_COLUMNS = {  # column: type
    "episode_id": "uuid", "idx": "integer", "segment": "integer", "input_ids": "bytea", "output_ids": "bytea",
    "output_logprobs": "bytea", "routed_experts": "bytea", "n_input_tokens": "integer",
    "n_output_tokens": "integer", "policy_version": "integer", "finish_reason": "varchar", "text": "text",
    "tool_call": "jsonb", "observation": "text", "started_at": "timestamptz", "generation_s": "float8",
    "tool_s": "float8", "malformed_at": "integer"}
_PG_APPEND_NAME = b"swerve_append_turn"
# a turn with an attempt share-locks its episode's row: a restart (which moves the attempt, then
# deletes the turns) waits for this turn, and the turn is refused once the attempt moved; a turn
# without one (not the worker's) goes in unfenced. One statement for both kinds, prepared once on
# the turn writer's connection: $1.. are the columns in _PG_COLUMNS' order, then the attempt
_ATTEMPT = f"${len(_PG_COLUMNS) + 1}"
_PG_APPEND = (f"INSERT INTO turns ({', '.join(_PG_COLUMNS)}) "
              f"SELECT {', '.join(f'${i}' for i in range(1, len(_PG_COLUMNS) + 1))} "
              f"WHERE {_ATTEMPT}::integer IS NULL OR EXISTS (SELECT 1 FROM episodes e WHERE e.id = $1 "
              f"AND e.attempt = {_ATTEMPT} AND e.status = 'running' FOR SHARE) "
              "ON CONFLICT (episode_id, idx) DO NOTHING RETURNING 1")
"""A row back when the turn was stored: none for a repeat (of a stored turn, or of one earlier in
the batch) or a fenced-off turn."""
_PG_PREPARE = (f"PREPARE {_PG_APPEND_NAME.decode()} ({', '.join([*_PG_COLUMNS.values(), 'integer'])}) "
               f"AS {_PG_APPEND}")
_FLOAT8 = struct.Struct(">d")


def _uuid_bytes(value) -> bytes:
    return (value if isinstance(value, uuid.UUID) else uuid.UUID(str(value))).bytes


def _text(value) -> bytes:
    return value.encode()


def _integer(value) -> bytes:
    return b"%d" % value  # as text: a value out of an integer's range is the server's to refuse, as any other


_PG_ENCODE = {"uuid": (_uuid_bytes, 1), "integer": (_integer, 0), "bytea": (bytes, 1), "varchar": (_text, 0),
              "text": (_text, 0), "jsonb": (lambda v: json.dumps(v).encode(), 0),
              "timestamptz": (lambda v: v.isoformat().encode(), 0), "float8": (_FLOAT8.pack, 1)}
"""How each column's value goes to the server: its bytes, and their format (1 binary, 0 text)."""
_PG_ENCODERS = tuple((name, _PG_ENCODE[kind][0]) for name, kind in _PG_COLUMNS.items())
_PG_FORMATS = [*(_PG_ENCODE[kind][1] for kind in _PG_COLUMNS.values()), 0]


def _append_params(row: dict, attempt: int | None) -> list[bytes | None]:
    """A turn's row as _PG_APPEND's parameters (None is NULL)."""
    params = [None if (value := row[name]) is None else encode(value) for name, encode in _PG_ENCODERS]
    params.append(None if attempt is None else b"%d" % attempt)
    return params

_TURN_COLUMNS = (Turn.episode_id, Turn.idx, Turn.segment, Turn.input_ids, Turn.output_ids,
                 Turn.output_logprobs, Turn.routed_experts, Turn.policy_version, Turn.malformed_at)
_CALLED = sa.func.coalesce(sa.cast(Turn.tool_call, sa.Text), "null") != "null"
"""Whether the turn made a well-formed tool call: its tool_call is stored (SQLAlchemy's JSON
stores None as JSON null on SQLite; psycopg's hot path as SQL NULL)."""


# one binary COPY for all the episodes asked for: the rows stream at COPY's speed, with no
# statement per episode, and bytea stays bytes (as text it would double)
_PG_CALLED = "coalesce(tool_call::text, 'null') <> 'null'"
"""_CALLED in PostgreSQL's words, for the COPY (a jsonb null counts as no call, as on SQLite)."""
_PG_FETCH = (f"COPY (SELECT {', '.join(c.name for c in _TURN_COLUMNS)}, {_PG_CALLED} FROM turns "
             "WHERE episode_id = ANY(%s::uuid[]) ORDER BY episode_id, idx) TO STDOUT (FORMAT BINARY)")
_PG_COPY_SIGNATURE = b"PGCOPY\n\xff\r\n\x00"
_INT16, _INT32 = struct.Struct(">h"), struct.Struct(">i")
_ROW_HEAD = struct.Struct(">i16siiii")
"""A turns' COPY row's fixed-size start: the episode id, the turn's index and segment, each after its length."""


def _turn_of(episode_id, idx, segment, input_ids, output_ids, logprobs, experts, version, malformed_at,
             called) -> tuple[uuid.UUID, TurnRecord]:
    """A row of _TURN_COLUMNS and _CALLED as the episode's id and its decoded turn."""
    return episode_id, TurnRecord(
        idx=idx, segment=segment, input_ids=decode_array(input_ids), output_ids=decode_array(output_ids),
        output_logprobs=decode_array(logprobs) if logprobs else None,
        routed_experts=decode_array(experts) if experts else None, policy_version=version, called=bool(called),
        malformed_at=malformed_at)


class _CopyRows:
    """Turns of a binary COPY of _PG_FETCH, parsed and decoded from the stream as it comes (on
    the reading thread, while the server sends the next rows): each raw array is read in place
    from the chunk that carried it (no bytes object per field, as psycopg's row loader makes),
    each episode id is looked up by its 16 bytes (no UUID per row). Rows are
    (episode id, TurnRecord)."""

    def __init__(self, episode_ids: list[uuid.UUID]):
        self.ids = {e.bytes: e for e in episode_ids}
        self.rows: list[tuple] = []
        self.pending = b""
        self.header = True
        self.ended = False

    def feed(self, chunk) -> None:
        data = memoryview(self.pending + bytes(chunk)) if self.pending else memoryview(chunk)
        pos = 0
        if self.header:
            if len(data) < 19:
                self.pending = data.tobytes()
                return
            if data[:11] != _PG_COPY_SIGNATURE:
                raise StorageError("the turns' COPY stream does not start with PostgreSQL's binary signature")
            pos = 19 + _INT32.unpack_from(data, 15)[0]
            self.header = False
        while pos + 2 <= len(data):
            (fields,) = _INT16.unpack_from(data, pos)
            if fields == -1:
                self.ended, pos = True, pos + 2
                break
            row, at = self._row(data, pos + 2, fields)
            if row is None:
                break
            self.rows.append(row)
            pos = at
        self.pending = data[pos:].tobytes() if pos < len(data) else b""

    def _row(self, data: memoryview, at: int, fields: int):
        if fields != len(_TURN_COLUMNS) + 1:
            raise StorageError(f"a row of the turns' COPY has {fields} fields, not {len(_TURN_COLUMNS) + 1}")
        end = len(data)
        if at + _ROW_HEAD.size > end:
            return None, at
        n_id, episode, n_idx, idx, n_segment, segment = _ROW_HEAD.unpack_from(data, at)
        if (n_id, n_idx, n_segment) != (16, 4, 4):
            raise StorageError(f"a row of the turns' COPY starts with fields of {n_id}, {n_idx} and {n_segment} "
                               "bytes, not an episode id, an index and a segment")
        at += _ROW_HEAD.size
        values = []
        for _ in range(len(_TURN_COLUMNS) - 2):
            if at + 4 > end:
                return None, at
            (n,) = _INT32.unpack_from(data, at)
            at += 4
            if n < 0:
                values.append(None)
            elif at + n > end:
                return None, at
            else:
                values.append(data[at:at + n])
                at += n
        input_ids, output_ids, logprobs, experts, version, malformed_at, called = values
        return _turn_of(self.ids[episode], idx, segment, input_ids, output_ids, logprobs, experts,
                        None if version is None else _INT32.unpack(version)[0],
                        None if malformed_at is None else _INT32.unpack(malformed_at)[0],
                        called is not None and called[0] == 1), at

    def result(self) -> list[tuple]:
        if not self.ended or self.pending:
            raise StorageError("the turns' COPY stream ended early")
        return self.rows


async def _fetch_turns(conn: AsyncConnection, episode_ids: list[uuid.UUID]) -> list[tuple[uuid.UUID, TurnRecord]]:
    """The turns, as (episode id, TurnRecord), episode by episode in turn order (the (episode_id, idx) index, no
    sort of wide rows); on PostgreSQL one binary COPY (bytea as text would double the bytes),
    read on a thread of its own (see _copy_turns)."""
    if conn.dialect.name != "postgresql":
        query = (sa.select(*_TURN_COLUMNS, _CALLED).where(Turn.episode_id.in_(episode_ids))
                 .order_by(Turn.episode_id, Turn.idx))
        return [_turn_of(*r) for r in (await conn.execute(query)).all()]
    return await asyncio.to_thread(_copy_turns, libpq_url(conn.engine.url), list(episode_ids))


def _copy_turns(conninfo: str, episode_ids: list[uuid.UUID]) -> list[tuple[uuid.UUID, TurnRecord]]:
    """The COPY on a blocking connection, parsed as it streams (_CopyRows). On the event loop
    every row of a few hundred kB waits for the socket several times through asyncio (a probe
    of 330 MB under load: 1.02-1.09 s there, 0.79-0.99 s here); blocking, libpq waits in C.
    The groups and episodes were read on the caller's connection: the turns of final episodes
    do not change, so another snapshot reads the same."""
    import psycopg

    rows = _CopyRows(episode_ids)
    try:
        with psycopg.connect(conninfo, autocommit=True) as raw, raw.cursor().copy(_PG_FETCH, (episode_ids,)) as copy:
            for chunk in copy:
                rows.feed(chunk)
    except psycopg.Error as e:  # as SQLAlchemy wraps it: a lost connection stays an OperationalError
        raise sa.exc.DBAPIError.instance(_PG_FETCH, None, e, psycopg.Error, hide_parameters=True) from e
    return rows.result()


_NOT_FINAL = Episode.status.not_in([sa.literal_column(f"'{s}'") for s in EPISODE_FINAL])
"""An episode not yet final, its statuses written into the SQL: as a parameter list, SQLAlchemy
expanded them into the statement on every execution (a tenth of the worker's database time)."""

TURN_WRITER = "swerve turn writer"
"""The application_name of a process's turn-writing connection (pg_stat_activity shows it)."""


class _Link:
    """A process's own psycopg connection to an engine's database on the running loop, outside
    the engine's pool: no checkout, ping, BEGIN and COMMIT around each use. Autocommit: a
    pipeline of statements ended by one Sync runs as one transaction, committed at the Sync or
    rolled back whole on an error (PostgreSQL's implicit transaction). Opened on first use; a
    lost connection is dropped and the next use opens another; closed with the engine. Its
    statements go through libpq directly (_Conn)."""

    ATTR = ""
    """The engine's attribute holding its link of this kind."""
    NAME = ""
    """The connection's application_name (pg_stat_activity shows it)."""
    SETUP: tuple[str, ...] = ()
    """Statements run once on a new connection."""

    def __init__(self, engine: AsyncEngine):
        self.engine = engine
        self.loop = asyncio.get_running_loop()
        self.conn: _Conn | None = None  # opened on first use
        self.retired = False  # no longer its engine's (disposed, or moved to another loop)

    @classmethod
    def of(cls, engine: AsyncEngine):
        """The engine's link of this kind on the running loop (an engine serves one loop at a time)."""
        link = getattr(engine.sync_engine, cls.ATTR, None)
        if link is None or link.loop is not asyncio.get_running_loop():
            if link is not None:  # the engine moved to another loop: its connection was the old one's
                link.retire()
            if not sa.event.contains(engine.sync_engine, "engine_disposed", _close_links):
                sa.event.listen(engine.sync_engine, "engine_disposed", _close_links)
            link = cls(engine)
            setattr(engine.sync_engine, cls.ATTR, link)
        return link

    def retire(self) -> None:
        self.retired = True
        self.close()

    def close(self) -> None:
        """Close the connection now, from any thread (the loop that opened it may be gone; from
        another thread while that loop runs, the loop's own thread closes it)."""
        conn, self.conn = self.conn, None
        if conn is None:
            return
        try:
            here = asyncio.get_running_loop() is self.loop
        except RuntimeError:
            here = False
        if here or not self.loop.is_running():
            conn.close()
            return
        try:
            self.loop.call_soon_threadsafe(conn.close)
        except RuntimeError:  # the loop closed meanwhile: nothing of it to leave
            conn.raw.pgconn.finish()

    async def _connection(self) -> _Conn:
        import psycopg

        if self.conn is not None and self.conn.raw.closed:
            self.close()
        if self.conn is None:
            raw = await psycopg.AsyncConnection.connect(libpq_url(self.engine.url), autocommit=True,
                                                        application_name=self.NAME)
            try:
                for statement in self.SETUP:
                    await raw.execute(statement)
            except BaseException:
                raw.pgconn.finish()
                raise
            self.conn = _Conn(self.loop, raw)
        return self.conn

    def _failed(self, e, statement: str) -> sa.exc.DBAPIError:
        """psycopg's error `e` as SQLAlchemy wraps it (a lost connection stays an
        OperationalError, for db_retry), the connection dropped if it broke."""
        import psycopg

        if self.conn is not None and self.conn.raw.broken:
            self.close()
        return sa.exc.DBAPIError.instance(statement, None, e, psycopg.Error, hide_parameters=True)


class _Conn:
    """A link's connection on its loop. Statements go through libpq directly (psycopg's `pq`),
    not through a cursor: a cursor's query conversion, result handling and wait (a timer, and a
    reader added to the loop and removed again, each time) cost more than the statement's own
    libpq calls, 0.2-0.6 ms of CPU a statement (2026-12-07). The socket stays on the loop while
    the connection is open: what the server sends is taken in as it comes and wakes whoever
    waits for it."""

    def __init__(self, loop: asyncio.AbstractEventLoop, raw):
        from psycopg.adapt import Transformer

        self.loop, self.raw, self.pgconn = loop, raw, raw.pgconn
        self.tx = Transformer(raw)  # parameters dumped and rows loaded as psycopg's cursors do
        self.waiter: asyncio.Future | None = None  # a statement waiting for the server
        self.fd = raw.pgconn.socket
        loop.add_reader(self.fd, self._readable)

    def close(self) -> None:
        """On the loop's thread (or with the loop stopped)."""
        import psycopg

        fd, self.fd = self.fd, -1
        if fd >= 0 and not self.loop.is_closed():
            self.loop.remove_reader(fd)
        self.pgconn.finish()
        self._wake(psycopg.OperationalError("the connection was closed"))

    def _readable(self) -> None:
        """What the server sent, into libpq's buffer (the socket is no longer readable). A
        connection the server closed leaves the loop."""
        import psycopg

        try:
            self.pgconn.consume_input()
        except psycopg.Error as e:
            if self.fd >= 0:
                self.loop.remove_reader(self.fd)
                self.fd = -1
            self._wake(e)
            return
        self._wake(None)

    def _wake(self, error: BaseException | None) -> None:
        waiter, self.waiter = self.waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(error)

    def _lost(self) -> None:
        """A connection whose socket left the loop (the server closed it) fails as a lost one."""
        if self.fd < 0:
            import psycopg

            raise psycopg.OperationalError("the connection to the server was lost")

    async def _server(self) -> None:
        """Until the server sends something (taken in by _readable)."""
        self._lost()
        self.waiter = self.loop.create_future()
        if (error := await self.waiter) is not None:
            raise error

    async def _writable(self) -> None:
        self._lost()  # not add_writer(-1)'s ValueError, which no caller takes for a lost connection
        ready = self.loop.create_future()

        def wake() -> None:
            if not ready.done():
                ready.set_result(None)

        self.loop.add_writer(self.fd, wake)
        try:
            await ready
        finally:
            self.loop.remove_writer(self.fd)

    async def exchange(self, sends: list[tuple]) -> list:
        """Each of `sends` (a libpq send method and its arguments: one statement) in one
        transaction and one round trip; each one's last result. Several go as one pipeline
        ended by one Sync; one alone is a statement of its own (its own transaction). The first
        error among them is raised as psycopg's."""
        from psycopg import errors, pq

        pgconn = self.pgconn
        try:
            if len(sends) == 1:
                send, *args = sends[0]
                send(*args)
                await self._flush()
                outcomes = [await self._results()]
            else:
                pgconn.enter_pipeline_mode()
                for send, *args in sends:
                    send(*args)
                pgconn.pipeline_sync()
                await self._flush()
                outcomes = [await self._results() for _ in sends]
                await self._results()  # the Sync
                pgconn.exit_pipeline_mode()
        except BaseException:  # cut off mid-exchange (lost, cancelled): the connection's state is unknown
            self.close()
            raise
        for results in outcomes:  # an error, then the pipeline's aborted rest
            for result in results:
                if result.status == pq.ExecStatus.FATAL_ERROR:
                    raise errors.error_from_result(result, encoding=self.raw.info.encoding)
        return [results[-1] for results in outcomes]

    async def _flush(self) -> None:
        """What libpq holds for the server, sent (what the server sends meanwhile is taken in by
        _readable: a server blocked on its own full socket would never read the rest)."""
        while self.pgconn.flush():
            await self._writable()

    async def _results(self) -> list:
        """The next statement's results (up to the NULL that ends them), or a pipeline's Sync."""
        from psycopg import pq

        results = []
        while True:
            while self.pgconn.is_busy():
                await self._server()
            result = self.pgconn.get_result()
            if result is None:
                return results
            results.append(result)
            if result.status == pq.ExecStatus.PIPELINE_SYNC:
                return results


class _EpisodeLink(_Link):
    """Episode starts and ends (and the worker's heartbeats) on PostgreSQL: each a pipeline of
    statements in one round trip and one transaction, on a connection of the process's own, one
    at a time. Through the engine's pool a start took 6 round trips (ping, BEGIN, three
    statements, COMMIT) and an end 6, with SQLAlchemy's own work around each: a tenth of the
    worker's CPU at 11-turn episodes (bench/rollouts.py, 2026-12-07). Its commits are synchronous
    (the turn writer's are not): an episode's end is what makes its turns count. Parameters are
    dumped and rows loaded by psycopg's Transformer, as its cursors do."""

    ATTR = "_swerve_episode_link"
    NAME = "swerve episode link"

    def __init__(self, engine: AsyncEngine):
        super().__init__(engine)
        self.lock = asyncio.Lock()

    async def run(self, statements: list[tuple[_Compiled, dict]]) -> list[tuple[list, int]]:
        """The statements as one transaction in one round trip: each one's rows (named tuples)
        and row count."""
        import psycopg

        async with self.lock:
            try:
                conn = await self._connection()
                pgconn, tx, sends = conn.pgconn, conn.tx, []
                for compiled, params in statements:
                    values = tx.dump_sequence(compiled.values(params), compiled.formats)
                    sends.append((pgconn.send_query_params, compiled.sql, values, tx.types, tx.formats))
                out = []
                for result in await conn.exchange(sends):
                    rows = []
                    if result.ntuples:
                        tx.set_pgresult(result)
                        rows = tx.load_rows(0, result.ntuples, _row_type(tuple(
                            result.fname(i).decode() for i in range(result.nfields)))._make)
                    count = result.command_tuples
                    out.append((rows, result.ntuples if count is None else count))
                return out
            except psycopg.Error as e:
                raise self._failed(e, statements[0][0].sql.decode()) from e
            except BaseException:  # cut off (cancelled): the connection's state is unknown
                self.close()
                raise


@lru_cache(maxsize=64)
def _row_type(names: tuple[str, ...]):
    return namedtuple("Row", names, rename=True)


class _TurnWriter(_Link):
    """Group commit of the turns a process's episodes append on PostgreSQL at the same time.
    The first turn is written at once; turns that arrive while a write is in flight go together
    in the next one: one transaction, one round trip and one connection for all of them, so a
    worker with many episodes in flight pays a round trip per batch instead of per turn. Each
    caller still learns what became of its own turn (stored, or not: a repeat or a fenced-off
    attempt) or gets its own error: a batch the database refuses is written again turn by turn,
    so one bad turn fails only its episode.

    The writer has a connection of its own (a _Link: its batches go one at a time), with
    synchronous_commit set once, and a batch is one pipeline of inserts ended by one Sync: one
    transaction and one round trip, where BEGIN (psycopg waits for it in a pipeline) and COMMIT
    made three. Retired, it closes its connection, and again once batches still queued are
    written (a new writer serves the engine from then on)."""

    ATTR = "_swerve_turn_writer"
    NAME = TURN_WRITER
    SETUP = ("SET synchronous_commit TO OFF", _PG_PREPARE)
    MAX_ROWS = 64
    MAX_BYTES = 32 << 20
    """A batch's bounds: a transaction of many large turns holds its connection and memory long."""

    def __init__(self, engine: AsyncEngine):
        super().__init__(engine)
        self.queue: list[tuple[dict, int | None, asyncio.Future]] = []
        self.drainer: asyncio.Task | None = None

    async def append(self, row: dict, attempt: int | None) -> bool:
        """Whether the turn was stored (False: a repeat, or `attempt` is not the running one)."""
        done = self.loop.create_future()
        self.queue.append((row, attempt, done))
        if self.drainer is None:
            self.drainer = asyncio.create_task(self._drain())
        return await done

    async def _drain(self) -> None:
        batch = []
        try:
            while self.queue:
                batch, size = [], 0
                while self.queue and len(batch) < self.MAX_ROWS and (not batch or size < self.MAX_BYTES):
                    batch.append(self.queue.pop(0))
                    size += _row_bytes(batch[-1][0])
                await self._write(batch)
        except BaseException:  # cancelled (the loop shutting down): no caller waits forever
            for _, _, done in batch + self.queue:
                done.cancel()
            self.queue.clear()
            raise
        finally:
            self.drainer = None
            if self.retired:
                self.close()

    async def _write(self, batch: list[tuple[dict, int | None, asyncio.Future]]) -> None:
        try:
            stored = await self._store([(row, attempt) for row, attempt, _ in batch])
        except Exception as e:  # noqa: BLE001 - every caller gets its outcome
            if len(batch) > 1:  # whose turn was it? each on its own
                for one in batch:
                    await self._write([one])
                return
            if not batch[0][2].done():
                batch[0][2].set_exception(e)
            return
        for (_, _, done), ok in zip(batch, stored):
            if not done.done():  # its caller may have been cancelled
                done.set_result(ok)

    async def _store(self, rows: list[tuple[dict, int | None]]) -> list[bool]:
        """The turns in one transaction and one round trip: _PG_APPEND, prepared, through libpq
        directly, with parameters encoded here (binary for ids and arrays, text for the rest).
        A batch of several is one pipeline ended by one Sync (see the class); a batch of one
        turn (most of them unless many episodes append at once) one plain statement. A turn is
        durable once the server has it; waiting for its WAL flush on every turn would cap a
        worker at a few hundred turns/s (episode ends stay synchronous, and an episode end
        checks that all its turns are there).

        psycopg's cursor cost about 1 ms of CPU a turn on a slow machine, 0.2 ms on a fast one
        (its query conversion, parameter dumping, result handling and wait, each per statement),
        most of a worker's CPU at 300-turn episodes; libpq's calls alone are a small part of it
        (2026-12-07). (2026-12-04 night: one INSERT of arrays per batch cost the worker more CPU,
        as psycopg dumps array elements in Python, and wrote large turns at 0.64x of COPY.)"""
        import psycopg
        from psycopg import errors

        try:
            try:
                params = [_append_params(row, attempt) for row, attempt in rows]
            except (TypeError, ValueError, AttributeError, struct.error) as e:  # refused as psycopg's dumping did
                raise errors.DataError(f"a turn holds a value no column of its takes: {type(e).__name__}: {e}") from e
            conn = await self._connection()
            send = conn.pgconn.send_query_prepared
            results = await conn.exchange([(send, _PG_APPEND_NAME, one, _PG_FORMATS) for one in params])
            return [result.ntuples > 0 for result in results]
        except psycopg.Error as e:
            raise self._failed(e, _PG_APPEND) from e
        except BaseException:  # cancelled mid-batch: the connection is in an unknown state
            self.close()
            raise


def _close_links(engine: sa.Engine) -> None:
    for kind in (_TurnWriter, _EpisodeLink):
        link = getattr(engine, kind.ATTR, None)
        if link is not None:
            link.retire()
            setattr(engine, kind.ATTR, None)


def _row_bytes(row: dict) -> int:
    return sum(len(v) for v in row.values() if isinstance(v, (bytes, str)))


@lru_cache(maxsize=64)
def _episode_end(names: tuple[str, ...], fenced: bool, counted: bool, checked: bool = False) -> sa.Update:
    """finish_episode's statement for these fields, built once: its values and ids are bound
    parameters (v_<field>, p_episode, p_attempt, p_now; no column's name, which an
    UPDATE would take for a value to set), so SQLAlchemy neither builds nor keys it per
    call. Returns the group's id, and with `counted` the episode's stored turns, read in the
    same statement (its turns were all committed before); `checked` instead ends the episode
    only if they are v_n_turns."""
    where = [Episode.id == sa.bindparam("p_episode"), _NOT_FINAL]
    if fenced:
        where.append(Episode.attempt == sa.bindparam("p_attempt"))
    returning = [Episode.group_id]
    if checked:
        where.append(_STORED_TURNS == sa.bindparam("v_n_turns"))
    elif counted:
        returning.append(_STORED_TURNS)
    return (sa.update(Episode).where(*where)
            .values(finished_at=sa.bindparam("p_now"), **{name: sa.bindparam(f"v_{name}") for name in names})
            .returning(*returning))


_STORED_TURNS = (sa.select(sa.func.count()).select_from(Turn)
                 .where(Turn.episode_id == sa.bindparam("p_episode")).scalar_subquery())
_END_MISSED = sa.select(Episode.status, Episode.attempt, _STORED_TURNS).where(Episode.id == sa.bindparam("p_episode"))
"""Why a checked end ended nothing: the episode as it is, and its stored turns."""
_JSON_FIELDS = frozenset(c.name for c in Episode.__table__.columns if isinstance(c.type, sa.JSON))


def _group_lock(group) -> sa.Select:
    return sa.select(Group.id).where(Group.id == group)


def _group_ready(group) -> sa.Update:
    """The group becomes ready once none of its episodes is pending; statuses, oldest policy
    and kind read by the statement."""
    return (sa.update(Group).where(Group.id == group, Group.status == "pending",
                                   ~sa.exists().where(Episode.group_id == group, _NOT_FINAL))
            .values(status=sa.case((sa.select(Run.kind).where(Run.id == Group.run_id).scalar_subquery() == "eval",
                                    "evaluated"), else_="ready"),
                    ready_at=sa.bindparam("p_now"),
                    min_policy_version=sa.select(sa.func.min(Episode.policy_version_min))
                    .where(Episode.group_id == group).scalar_subquery()))


_GROUP_ROW = _group_lock(sa.bindparam("p_group"))
_GROUP_READY = _group_ready(sa.bindparam("p_group"))
_GROUP_OF = sa.select(Episode.group_id).where(Episode.id == sa.bindparam("p_episode")).scalar_subquery()
_GROUP_LOCK_OF = _group_lock(_GROUP_OF).with_for_update()
_GROUP_READY_OF = _group_ready(_GROUP_OF)
"""An episode's group locked, then made ready, after its end in one pipeline (PostgreSQL). Two
statements: the lock serialises the last two finishers of a group, and the update's check must
be a statement of its own, begun after the lock is held, so that its snapshot sees the other
finisher's committed end (read committed takes a snapshot per statement; a check inside the
locking statement would see the one from before the wait)."""


_ATTEMPT_START = (sa.update(Episode).where(Episode.id == sa.bindparam("p_episode"),
                                           Episode.status == sa.bindparam("p_status"),
                                           Episode.attempt == sa.bindparam("p_attempt"))
                  .values(status="running", started_at=sa.bindparam("p_now"), heartbeat_at=sa.bindparam("p_now"),
                          attempt=sa.bindparam("p_next")))
"""start_attempt's claim: the episode as the worker saw it (status, attempt) becomes its next attempt."""
_CLAIMED = _ATTEMPT_START.returning(Episode.id).cte("claimed")
_ATTEMPT_RESTART = (sa.select(sa.func.count()).select_from(_CLAIMED).add_cte(
    sa.delete(Turn).where(Turn.episode_id.in_(sa.select(_CLAIMED.c.id))).cte("gone")))
"""A restart's claim and the old attempt's turns gone, in one statement (PostgreSQL): the
turns go only if the claim was made, after the attempt moved."""

_TO_START = (sa.select(Episode.status, Episode.attempt, Episode.heartbeat_at, Episode.task_id, Episode.run_id,
                       Run.status.label("run_status"), Run.config)
             .join(Run, Run.id == Episode.run_id).where(Episode.id == sa.bindparam("p_episode")))
_TASK_TO_START = sa.select(Task).where(
    Task.id == sa.select(Episode.task_id).where(Episode.id == sa.bindparam("p_episode")).scalar_subquery())
"""What a worker reads to start an episode: the episode with its run, and its task's row."""


@dataclass(frozen=True)
class _Compiled:
    """A statement as libpq runs it: its SQL with $1.. for its parameters, their names in that
    order, and the values of the parameters it was built with (the literals SQLAlchemy made
    parameters of)."""

    sql: bytes
    names: tuple[str, ...]
    fixed: dict
    formats: tuple

    @classmethod
    @lru_cache(maxsize=128)
    def of(cls, statement) -> _Compiled:
        from sqlalchemy.dialects.postgresql import psycopg

        compiled = statement.compile(dialect=psycopg.dialect())
        names: list[str] = []

        def number(match: re.Match) -> str:
            if match.group(1) is None:
                return "%"
            if match.group(1) not in names:
                names.append(match.group(1))
            return f"${names.index(match.group(1)) + 1}"

        from psycopg.adapt import PyFormat

        sql = re.sub(r"%\((\w+)\)s|%%", number, compiled.string)
        return cls(sql.encode(), tuple(names), {name: bind.value for name, bind in compiled.binds.items()
                                               if not name.startswith("%(") and bind.value is not None},
                   (PyFormat.AUTO,) * len(names))

    def values(self, params: dict) -> list:
        return [params[name] if name in params else self.fixed[name] for name in self.names]

    def __call__(self, params: dict) -> tuple[_Compiled, dict]:
        return self, params


_HEARTBEAT_PG = (sa.update(Episode)
                 .where(Episode.id == sa.any_(sa.bindparam("p_ids", type_=ARRAY(sa.Uuid))), Episode.status == "running")
                 .values(heartbeat_at=sa.bindparam("p_now")).returning(Episode.id, Episode.attempt))
_RUN_STATUSES_PG = sa.select(Run.id, Run.status).where(Run.id == sa.any_(sa.bindparam("p_runs", type_=ARRAY(sa.Uuid))))


class Buffer:
    def __init__(self, engine: AsyncEngine):
        self.engine = engine

    async def append_turn(self, episode_id: uuid.UUID, turn: TurnRecord, attempt: int | None = None) -> None:
        """Store one finished turn; a repeat of the same (episode, idx) is ignored. With
        `attempt`, raise Superseded (storing nothing) unless that attempt is the running one.
        Raises StorageError if the database refuses the turn."""
        row = {
            "episode_id": episode_id, "idx": turn.idx, "segment": turn.segment,
            "input_ids": encode_ids(turn.input_ids), "output_ids": encode_ids(turn.output_ids),
            # absent stays absent (NULL), not an array of one NaN that every reader would take for logprobs
            "output_logprobs": None if turn.output_logprobs is None else encode_logprobs(turn.output_logprobs),
            "routed_experts": None if turn.routed_experts is None else encode_routed_experts(turn.routed_experts),
            "n_input_tokens": len(turn.input_ids), "n_output_tokens": len(turn.output_ids),
            "policy_version": turn.policy_version, "finish_reason": storable(turn.finish_reason),
            "text": storable(turn.text), "tool_call": storable(turn.tool_call),
            "observation": storable(turn.observation),
            "started_at": utcnow(), "generation_s": turn.generation_s, "tool_s": turn.tool_s,
            "malformed_at": turn.malformed_at,
        }  # fmt: skip
        with _refusals(f"turn {turn.idx} of episode {episode_id}"):
            if self.engine.dialect.name == "postgresql":
                await self._append_pg(row, attempt)
                return
            async with self.engine.begin() as conn:
                if attempt is not None:
                    fence = sa.select(Episode.id).where(Episode.id == episode_id, Episode.attempt == attempt,
                                                        Episode.status == "running")
                    if (await conn.execute(fence)).first() is None:
                        raise Superseded(f"episode {episode_id}: attempt {attempt} is no longer the running one")
                stmt = _insert(conn)(Turn).values(**row).on_conflict_do_nothing(index_elements=["episode_id", "idx"])
                await conn.execute(stmt)

    async def _append_pg(self, row: dict, attempt: int | None) -> None:
        """The hot path: psycopg directly, binary arrays, batched with the turns other episodes
        of this process append at the same time (_TurnWriter)."""
        stored = await _TurnWriter.of(self.engine).append(row, attempt)
        if not stored and attempt is not None:  # a repeat of a stored turn, or a fenced-off attempt
            async with self.engine.connect() as conn:
                current = await conn.scalar(sa.select(Episode.id).where(
                    Episode.id == row["episode_id"], Episode.attempt == attempt, Episode.status == "running"))
            if current is None:
                raise Superseded(f"episode {row['episode_id']}: attempt {attempt} is no longer the running one")

    async def finish_episode(self, episode_id: uuid.UUID, attempt: int | None = None, **fields) -> bool:
        """Make an episode final (status and results in `fields`) exactly once; when it was the
        last of its group, the group becomes ready. Returns False if it was already final (or,
        with `attempt`, if a newer attempt took over). Raises StorageError if the database
        refuses the fields, TurnsLost if fewer than `n_turns` turns are stored."""
        if fields.get("status") not in EPISODE_FINAL:
            raise ValueError(f"status must be one of {EPISODE_FINAL}, got {fields.get('status')!r}")
        params = {"p_episode": episode_id, "p_attempt": attempt, "p_now": utcnow(),
                  **{f"v_{name}": storable(value) for name, value in fields.items()}}
        with _refusals(f"the end of episode {episode_id}"):
            if self.engine.dialect.name == "postgresql":
                return await self._finish_pg(episode_id, attempt, fields, params)
            statement = _episode_end(tuple(fields), attempt is not None, fields.get("n_turns") is not None)
            async with self.engine.begin() as conn:
                ended = (await conn.execute(statement, params)).first()
                if ended is None:
                    return False
                if fields.get("n_turns") is not None and ended[1] != fields["n_turns"]:
                    raise TurnsLost(f"episode {episode_id}: {fields['n_turns']} turns produced, {ended[1]} stored")
                await self._maybe_ready(conn, ended[0])
        return True

    async def _finish_pg(self, episode_id: uuid.UUID, attempt: int | None, fields: dict, params: dict) -> bool:
        """finish_episode in one round trip (_EpisodeLink): the end, checked against the stored
        turns in its own WHERE, then the group's lock and readiness (_GROUP_LOCK_OF and
        _GROUP_READY_OF, the group found by the episode), one transaction. Where the end ended
        nothing, a second look tells a lost turn from an episode already final or superseded."""
        from psycopg.types.json import Jsonb

        n_turns = fields.get("n_turns")
        for name in _JSON_FIELDS.intersection(fields):
            if params[f"v_{name}"] is not None:
                params[f"v_{name}"] = Jsonb(params[f"v_{name}"])
        end = _episode_end(tuple(fields), attempt is not None, False, n_turns is not None)
        link = _EpisodeLink.of(self.engine)
        (ended, _), _, _ = await link.run([_Compiled.of(end)(params), _Compiled.of(_GROUP_LOCK_OF)(params),
                                           _Compiled.of(_GROUP_READY_OF)(params)])
        if ended:
            return True
        if n_turns is not None:
            [(missed, _)] = await link.run([_Compiled.of(_END_MISSED)(params)])
            if missed and missed[0].status not in EPISODE_FINAL and attempt in (None, missed[0].attempt):
                raise TurnsLost(f"episode {episode_id}: {n_turns} turns produced, {missed[0][2]} stored")
        return False

    async def episode_to_start(self, episode_id: uuid.UUID):
        """What a worker needs to start the episode: the episode (status, attempt, heartbeat_at,
        task_id, run_id, run_status, config) and its task's row; None if there is no such
        episode. One round trip on PostgreSQL."""
        params = {"p_episode": episode_id}
        if self.engine.dialect.name == "postgresql":
            (episode, _), (task, _) = await _EpisodeLink.of(self.engine).run(
                [_Compiled.of(_TO_START)(params), _Compiled.of(_TASK_TO_START)(params)])
        else:
            async with self.engine.connect() as conn:
                episode = (await conn.execute(_TO_START, params)).all()
                task = (await conn.execute(_TASK_TO_START, params)).all()
        return (episode[0], task[0]) if episode else None

    async def claim_attempt(self, episode_id: uuid.UUID, *, seen_status: EpisodeStatus, seen_attempt: int) -> int | None:
        """start_attempt in a transaction of its own (one statement on PostgreSQL)."""
        if self.engine.dialect.name != "postgresql":
            async with self.engine.begin() as conn:
                return await self.start_attempt(conn, episode_id, seen_status=seen_status, seen_attempt=seen_attempt)
        restart = seen_status == "running"
        attempt = seen_attempt + restart
        params = {"p_episode": episode_id, "p_status": seen_status, "p_attempt": seen_attempt, "p_next": attempt,
                  "p_now": utcnow()}
        [(rows, count)] = await _EpisodeLink.of(self.engine).run(
            [_Compiled.of(_ATTEMPT_RESTART if restart else _ATTEMPT_START)(params)])
        return attempt if (rows[0][0] if restart else count) == 1 else None

    async def _maybe_ready(self, conn: AsyncConnection, group_id: uuid.UUID) -> None:
        """The group becomes ready (evaluated, for an evaluation's) once none of its episodes is
        pending (SQLite, which serialises writers: PostgreSQL's ends lock the group, _finish_pg)."""
        await conn.execute(_GROUP_ROW, {"p_group": group_id})
        await conn.execute(_GROUP_READY, {"p_group": group_id, "p_now": utcnow()})

    async def claim(self, n_groups: int, *, trainer_step: int, max_staleness: int,
                    lease_s: float = 600.0, run_id: uuid.UUID | None = None,
                    owner: str | None = None) -> Claim:  # fmt: skip
        """Claim up to n ready groups (oldest first; of one run if given), dropping the ones too
        stale to train on. `owner` names the trainer (see release_owner)."""
        now = utcnow()
        claim_id = uuid.uuid4()
        claimable = sa.or_(Group.status == "ready",
                           sa.and_(Group.status == "claimed", Group.claim_expires_at < now))
        taken, dropped = [], []
        async with self.engine.begin() as conn:
            while len(taken) < n_groups:  # lock only rows this claim takes or drops
                query = (sa.select(Group.id, Group.min_policy_version).where(claimable)
                         .where(Group.id.not_in(taken + dropped), *([Group.run_id == run_id] if run_id else []))
                         .order_by(Group.ready_at, Group.id)
                         .limit(n_groups - len(taken)))
                if conn.dialect.name == "postgresql":
                    query = query.with_for_update(skip_locked=True)
                rows = (await conn.execute(query)).all()
                if not rows:
                    break
                for row in rows:
                    version = row.min_policy_version
                    stale = version is not None and version >= 0 and trainer_step - version > max_staleness
                    (dropped if stale else taken).append(row.id)
            if dropped:
                await conn.execute(sa.update(Group).where(Group.id.in_(dropped)).values(
                    status="dropped", dropped_reason=f"stale at step {trainer_step}", claim_id=None))
            if taken:
                await conn.execute(sa.update(Group).where(Group.id.in_(taken)).values(
                    status="claimed", claim_id=claim_id, claim_expires_at=now + timedelta(seconds=lease_s),
                    claimed_by=owner))
        return Claim(claim_id, taken, len(dropped))

    async def commit(self, claim: Claim, trainer_step: int) -> None:
        """Mark the claim's groups consumed. Raises ClaimLost if the lease was lost meanwhile."""
        await self.consume(claim, claim.group_ids, trainer_step)

    async def consume(self, claim: Claim, group_ids: list[uuid.UUID], trainer_step: int) -> Claim:
        """Mark these of the claim's groups consumed now, before the step commits (groups that
        teach nothing, which a trainer filling its step with useful ones would otherwise hold,
        with the orchestrator counting them as waiting to be trained on); returns the claim
        with the rest. Raises ClaimLost if the lease was lost meanwhile (and consumes none)."""
        wanted = set(group_ids)
        ids = [g for g in claim.group_ids if g in wanted]
        if not ids:
            return claim
        async with self.engine.begin() as conn:
            done = await conn.execute(
                sa.update(Group).where(Group.claim_id == claim.id, Group.id.in_(ids), Group.status == "claimed",
                                       Group.claim_expires_at >= utcnow())
                .values(status="consumed", consumed_at=utcnow(), trainer_step=trainer_step))
            if done.rowcount != len(ids):
                raise ClaimLost(f"claim {claim.id}: {len(ids) - done.rowcount} group(s) went back to the "
                                "buffer before they were consumed")  # and none is: the transaction rolls back
        return Claim(claim.id, [g for g in claim.group_ids if g not in wanted], claim.dropped)

    async def release_owner(self, owner: str, run_id: uuid.UUID | None = None) -> int:
        """Give back every group `owner` holds claimed (a trainer restarting: the claims of the
        incarnation that died are its own, no need to wait out their lease). Returns how many."""
        async with self.engine.begin() as conn:
            back = await conn.execute(
                sa.update(Group).where(Group.status == "claimed", Group.claimed_by == owner,
                                       *([Group.run_id == run_id] if run_id else []))
                .values(**GIVEN_BACK))
        return back.rowcount

    async def release(self, claim: Claim) -> None:
        """Give the claim's groups back (a step that failed before committing)."""
        async with self.engine.begin() as conn:
            await conn.execute(sa.update(Group).where(Group.claim_id == claim.id, Group.status == "claimed")
                               .values(**GIVEN_BACK))

    async def trained_group_ids(self, run_id: uuid.UUID) -> list[uuid.UUID]:
        """The run's groups that are (or were) there to train on: ready, claimed or consumed;
        in their order in the run (seq), the same for every run of the same plan. A dataset for
        training on the same trajectories more than once. (By id, a random uuid4, two SFT runs of
        one seed took their demonstrations in different orders: 0.373 and 0.416 after SFT.)"""
        async with self.engine.connect() as conn:
            return list((await conn.execute(sa.select(Group.id).where(
                Group.run_id == run_id, Group.status.in_(("ready", "claimed", "consumed")))
                .order_by(Group.seq))).scalars())

    async def load(self, claim: Claim) -> list[GroupData]:
        """The claimed groups with their episodes and decoded turns."""
        return await self.load_groups(claim.group_ids)

    async def load_groups(self, group_ids: list[uuid.UUID]) -> list[GroupData]:
        """These groups with their episodes and decoded turns."""
        async with self.engine.connect() as conn:
            groups = (await conn.execute(sa.select(Group).where(Group.id.in_(group_ids)))).all()
            episodes = (await conn.execute(sa.select(Episode).where(Episode.group_id.in_(group_ids))
                                           .order_by(Episode.sample_index))).all()
            turns = await _fetch_turns(conn, [e.id for e in episodes])
        by_episode: dict[uuid.UUID, list[TurnRecord]] = {}
        for episode_id, turn in turns:
            by_episode.setdefault(episode_id, []).append(turn)
        out = {g.id: GroupData(g.id, g.run_id, g.task_id, []) for g in groups}
        for e in episodes:
            out[e.group_id].episodes.append(EpisodeData(e.id, e.sample_index, e.status, e.reward,
                                                        e.policy_version_min, by_episode.get(e.id, [])))
        return [out[g] for g in group_ids if g in out]

    @staticmethod
    async def create_run(conn: AsyncConnection, run_id: uuid.UUID, *, suite_id: uuid.UUID, name: str | None,
                         config: dict, config_hash: str, task_ids: list[uuid.UUID], samples: int,
                         trainable: bool, kind: RunKind = "sample", parent_id: uuid.UUID | None = None,
                         policy_version: int | None = None) -> None:  # fmt: skip
        """A running run with one pending group of `samples` pending episodes per task (a
        training run starts with none: its orchestrator adds them with add_groups)."""
        await conn.execute(sa.insert(Run).values(id=run_id, suite_id=suite_id, name=name, status="running",
                                                 config=config, config_hash=config_hash, created_at=utcnow(),
                                                 started_at=utcnow(), kind=kind, parent_id=parent_id,
                                                 policy_version=policy_version))
        await Buffer.add_groups(conn, run_id, [PlannedGroup(seq, 0, task_id) for seq, task_id in enumerate(task_ids)],
                                samples=samples, trainable=trainable, config_hash=config_hash)

    @staticmethod
    async def add_groups(conn: AsyncConnection, run_id: uuid.UUID, planned: list[PlannedGroup], *, samples: int,
                         trainable: bool, config_hash: str) -> None:  # fmt: skip
        """The run's next groups, in schedule order: pending with `samples` pending episodes
        each, or skipped (the difficulty filter passed the task over: no episodes)."""
        groups, episodes = [], []
        for plan in planned:  # creation times follow the schedule's order
            group_id = uuid.uuid4()
            groups.append({"id": group_id, "run_id": run_id, "task_id": plan.task_id, "seq": plan.seq,
                           "epoch": plan.epoch, "size": 0 if plan.skipped else samples,
                           "status": "skipped" if plan.skipped else "pending", "created_at": utcnow(),
                           "dropped_reason": plan.skipped, "min_policy_version": plan.version})
            if not plan.skipped:
                episodes += [{"id": uuid.uuid4(), "run_id": run_id, "group_id": group_id, "task_id": plan.task_id,
                              "sample_index": i, "status": "pending", "trainable": trainable,
                              "config_hash": config_hash, "created_at": utcnow()} for i in range(samples)]
        if groups:
            await conn.execute(sa.insert(Group), groups)
        if episodes:
            await conn.execute(sa.insert(Episode), episodes)

    @staticmethod
    async def mark_exhausted(conn: AsyncConnection, run_id: uuid.UUID) -> None:
        """A training run's schedule is done: its last group is created."""
        await conn.execute(sa.update(Run).where(Run.id == run_id, Run.exhausted_at.is_(None))
                           .values(exhausted_at=utcnow()))

    # Episode attempts. The orchestrator and the workers move episodes only through these; each
    # runs in the caller's transaction (the orchestrator's holds the run row locked).

    @staticmethod
    async def queue(conn: AsyncConnection, episode_ids: list[uuid.UUID]) -> None:
        """Pending episodes handed to the broker (their message is being sent)."""
        await conn.execute(sa.update(Episode).where(Episode.id.in_(episode_ids))
                           .values(status="queued", queued_at=utcnow()))

    @staticmethod
    async def requeue(conn: AsyncConnection, episode_ids: list[uuid.UUID]) -> None:
        """Queued episodes whose message is sent again (it may have been lost)."""
        await conn.execute(sa.update(Episode).where(Episode.id.in_(episode_ids)).values(queued_at=utcnow()))

    @staticmethod
    async def start_attempt(conn: AsyncConnection, episode_id: uuid.UUID, *, seen_status: EpisodeStatus,
                            seen_attempt: int) -> int | None:  # fmt: skip
        """A worker takes the episode as it saw it (queued, or running under a dead worker: then
        as the next attempt, whose predecessor's turns go). The new attempt, or None if another
        worker took it first."""
        restart = seen_status == "running"
        attempt = seen_attempt + restart
        now = utcnow()
        claimed = await conn.execute(_ATTEMPT_START, {"p_episode": episode_id, "p_status": seen_status,
                                                      "p_attempt": seen_attempt, "p_next": attempt, "p_now": now})
        if claimed.rowcount != 1:
            return None
        if restart:  # after the attempt moved, so the old attempt can add nothing more
            await conn.execute(sa.delete(Turn).where(Turn.episode_id == episode_id))
        return attempt

    @staticmethod
    async def restart_attempts(conn: AsyncConnection, episode_ids: list[uuid.UUID]) -> None:
        """Running episodes back to queued as their next attempt (a dead worker, lost turns): the
        attempt moves first, so the old attempt's later turns and end are refused, then its
        turns go."""
        await conn.execute(sa.update(Episode).where(Episode.id.in_(episode_ids), Episode.status == "running")
                           .values(status="queued", attempt=Episode.attempt + 1, queued_at=utcnow(),
                                   heartbeat_at=None))
        await conn.execute(sa.delete(Turn).where(Turn.episode_id.in_(episode_ids)))

    async def beat(self, episode_ids: list[uuid.UUID], run_ids: list[uuid.UUID]) -> tuple[dict, dict]:
        """A worker's heartbeat: its running episodes marked alive, with their current attempts
        (a missing id is no longer running), and its runs' statuses; one round trip on
        PostgreSQL (_EpisodeLink), the ids as arrays rather than a parameter each to expand."""
        if self.engine.dialect.name == "postgresql":
            (alive, _), (runs, _) = await _EpisodeLink.of(self.engine).run(
                [_Compiled.of(_HEARTBEAT_PG)({"p_ids": episode_ids, "p_now": utcnow()}),
                 _Compiled.of(_RUN_STATUSES_PG)({"p_runs": run_ids})])
            return dict(alive), dict(runs)
        async with self.engine.begin() as conn:
            alive = dict((await conn.execute(
                sa.update(Episode).where(Episode.id.in_(episode_ids), Episode.status == "running")
                .values(heartbeat_at=utcnow()).returning(Episode.id, Episode.attempt))).all())
            runs = dict((await conn.execute(sa.select(Run.id, Run.status).where(Run.id.in_(run_ids)))).all())
        return alive, runs

    # Runs' ownership and ends: one orchestrator owns an active run under a lease.

    @staticmethod
    async def own_run(conn: AsyncConnection, run_id: uuid.UUID, owner: str, lease_s: float) -> bool:
        """Take or renew the run's lease; the row stays locked until the transaction ends."""
        now = utcnow()
        taken = await conn.execute(sa.update(Run).where(
            Run.id == run_id, Run.status.in_(RUN_ACTIVE),
            sa.or_(Run.owner.is_(None), Run.owner == owner, Run.owner_heartbeat_at < now - timedelta(seconds=lease_s)),
        ).values(owner=owner, owner_heartbeat_at=now))
        return taken.rowcount == 1

    @staticmethod
    async def set_gate(conn: AsyncConnection, run_id: uuid.UUID, gate: str | None) -> None:
        """Why the orchestrator holds new groups back (None: it does not)."""
        await conn.execute(sa.update(Run).where(Run.id == run_id).values(gate=gate))

    @staticmethod
    async def finish_run(conn: AsyncConnection, run_id: uuid.UUID, status: RunStatus, error: str | None = None) -> None:
        """The run ends (finished, cancelled or failed; `error`: why it could not go on) and
        nobody owns it any more."""
        await conn.execute(sa.update(Run).where(Run.id == run_id).values(
            status=status, finished_at=utcnow(), owner=None, gate=None, error=error))

    @staticmethod
    async def drop_unclaimed(conn: AsyncConnection, run_id: uuid.UUID, final: str) -> None:
        """A training run ended: its groups no trainer will train on (sampled ahead of the last
        version, or still being sampled) are dropped, so that a trainer claiming from every run
        never takes them, nor their episodes that end later."""
        await conn.execute(sa.update(Group).where(
            Group.run_id == run_id, Group.status.in_(("pending", "ready", "claimed"))).values(
            status="dropped", dropped_reason=LEFT_AT_END.format(final), claim_id=None, claim_expires_at=None, claimed_by=None))

    async def release_runs(self, owner: str) -> None:
        """Give up every run `owner` holds (a clean shutdown: others take them over at once)."""
        async with self.engine.begin() as conn:
            await conn.execute(sa.update(Run).where(Run.owner == owner).values(owner=None))

    async def set_endpoints(self, run_id: uuid.UUID, endpoints: list[str]) -> None:
        """The vLLM servers a run (and its active evaluations) samples from, changed (a job
        resumed with servers elsewhere); the rest of its config stays."""
        async with self.engine.begin() as conn:
            rows = (await conn.execute(sa.select(Run.id, Run.config).where(
                sa.or_(Run.id == run_id, sa.and_(Run.parent_id == run_id, Run.status.in_(RUN_ACTIVE)))))).all()
            for rid, config in rows:
                sampler = dict(config.get("sampler") or {})
                if sampler.get("type") == "vllm" and sampler.get("endpoints") != endpoints:
                    await conn.execute(sa.update(Run).where(Run.id == rid).values(
                        config={**config, "sampler": {**sampler, "endpoints": endpoints}}))

    @staticmethod
    async def request_cancel(conn: AsyncConnection, run_id: uuid.UUID) -> bool:
        """An active run is asked to stop (its orchestrator ends it). False if it was not active."""
        done = await conn.execute(sa.update(Run).where(Run.id == run_id, Run.status.in_(RUN_ACTIVE))
                                  .values(status="cancelling"))
        return done.rowcount == 1

    # Policies: the trainer records and withdraws versions only through these.

    async def record_policy(self, version: int, weights_path: str, trainer_step: int, info: dict | None = None,
                            *, if_absent: bool = False) -> bool:  # fmt: skip
        """Record a published version; with if_absent, only if the version is not there yet.
        Returns whether it was written."""
        async with self.engine.begin() as conn:
            if if_absent and await conn.scalar(sa.select(Policy.version).where(Policy.version == version)) is not None:
                return False
            await conn.execute(sa.insert(Policy).values(version=version, weights_path=weights_path,
                                                        trainer_step=trainer_step, created_at=utcnow(), info=info))
        return True

    async def annotate_policy(self, version: int, info: dict) -> None:
        """Add to a recorded version's info what was measured after it was recorded (the time
        its publication and the fleet's reload took)."""
        async with self.engine.begin() as conn:
            current = await conn.scalar(sa.select(Policy.info).where(Policy.version == version))
            await conn.execute(sa.update(Policy).where(Policy.version == version)
                               .values(info={**(current or {}), **info}))

    async def rewind(self, step: int, run_id: uuid.UUID | None = None) -> tuple[int, int]:
        """Undo every step after `step` (a trainer resuming from that checkpoint): the groups
        they consumed go back to ready, the versions they published are withdrawn. Returns
        (groups back, versions withdrawn)."""
        async with self.engine.begin() as conn:
            undone = sa.update(Group).where(Group.status == "consumed", Group.trainer_step > step,
                                            *([Group.run_id == run_id] if run_id is not None else []))
            back = await conn.execute(undone.values(**GIVEN_BACK, consumed_at=None, trainer_step=None))
            withdrawn = await conn.execute(sa.delete(Policy).where(Policy.version > step))
        return back.rowcount, withdrawn.rowcount

    async def has_policy(self, version: int) -> bool:
        """Whether `version` is recorded (a trainer resumed at that step publishes it if not)."""
        async with self.engine.connect() as conn:
            return await conn.scalar(sa.select(Policy.version).where(Policy.version == version)) is not None

    @staticmethod
    async def evaluation_status(conn: AsyncConnection, run_id: uuid.UUID, version: int) -> str | None:
        """The status of the training run's newest evaluation of `version` made after that
        version was published (an earlier one evaluated withdrawn weights); None: none yet."""
        published = await conn.scalar(sa.select(Policy.created_at).where(Policy.version == version))
        if published is None:
            return None
        return await conn.scalar(sa.select(Run.status).where(
            Run.parent_id == run_id, Run.kind == "eval", Run.policy_version == version,
            Run.created_at >= published).order_by(Run.created_at.desc()).limit(1))

    async def evaluation(self, run_id: uuid.UUID, version: int) -> str | None:
        """evaluation_status, for the trainer."""
        async with self.engine.connect() as conn:
            return await Buffer.evaluation_status(conn, run_id, version)

    async def end_training(self, run_id: uuid.UUID, version: int) -> None:
        """The trainer stopped early (its time limit): `version` is the run's last, evaluated as
        the last and ending the run as `training.steps` would."""
        async with self.engine.begin() as conn:
            await conn.execute(sa.update(Run).where(Run.id == run_id).values(last_version=version))

    async def schedule_done(self, run_id: uuid.UUID) -> bool:
        """Whether a training run will make no more groups to train on: it ended, or its
        schedule is exhausted and none of its groups is still being sampled."""
        async with self.engine.connect() as conn:
            run = (await conn.execute(sa.select(Run.status, Run.exhausted_at).where(Run.id == run_id))).first()
            if run is None or run.status not in RUN_ACTIVE:
                return True
            if run.exhausted_at is None:
                return False
            sampling = await conn.scalar(sa.select(sa.func.count()).select_from(Group).where(
                Group.run_id == run_id, Group.status == "pending"))
        return sampling == 0

    async def stats(self) -> dict[str, int]:
        async with self.engine.connect() as conn:
            rows = (await conn.execute(sa.select(Group.status, sa.func.count()).group_by(Group.status))).all()
        counts = {"pending": 0, "ready": 0, "claimed": 0, "consumed": 0, "dropped": 0, "skipped": 0, "evaluated": 0}
        counts |= {status: n for status, n in rows}
        return counts
