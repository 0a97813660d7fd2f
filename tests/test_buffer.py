"""The buffer on PostgreSQL and SQLite: idempotent turns, groups ready when complete, claims
with leases, exactly-once consumption, staleness drops; concurrent claimers on PostgreSQL; any
text stored (escaped), and a refused write told apart from a lost connection."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from datetime import timedelta

import numpy as np
import pytest
import sqlalchemy as sa

from service.store import db
from service.store.records import TurnRecord
from service.store.buffer import Buffer, ClaimLost, StorageError, Superseded, storable
from service.store.records import decode_array
from service.store.tables import Episode, Group, Run, Suite, Task, Turn, utcnow


async def make_groups(engine, n_groups: int, size: int = 2, version: int = 0) -> list[tuple[uuid.UUID, list[uuid.UUID]]]:
    suite_id, run_id = uuid.uuid4(), uuid.uuid4()
    out = []
    async with engine.begin() as conn:
        await conn.execute(sa.insert(Suite).values(id=suite_id, name=f"s-{suite_id.hex[:6]}", task_count=n_groups, created_at=utcnow()))
        await conn.execute(sa.insert(Run).values(id=run_id, suite_id=suite_id, status="running", config={}, config_hash="0" * 64, created_at=utcnow()))
        for g in range(n_groups):
            task_id, group_id = uuid.uuid4(), uuid.uuid4()
            await conn.execute(sa.insert(Task).values(
                id=task_id, suite_id=suite_id, position=g, instance_id=f"t-{g}", repo="o/r", base_commit="a" * 40,
                problem_statement="p", test_patch="", fail_to_pass=["x"], pass_to_pass=[], log_parser="pytest"))
            await conn.execute(sa.insert(Group).values(id=group_id, run_id=run_id, task_id=task_id, seq=g, size=size, status="pending", created_at=utcnow()))
            episodes = [uuid.uuid4() for _ in range(size)]
            for i, e in enumerate(episodes):
                await conn.execute(sa.insert(Episode).values(
                    id=e, run_id=run_id, group_id=group_id, task_id=task_id, sample_index=i, status="running",
                    policy_version_min=version, policy_version_max=version, created_at=utcnow()))
            out.append((group_id, episodes))
    return out


def turn(idx: int, version: int = 0) -> TurnRecord:
    return TurnRecord(idx=idx, segment=0, input_ids=[1, 2, 3], output_ids=[4, 5], output_logprobs=[-0.5, -1.5],
                      policy_version=version, finish_reason="stop", text="t", tool_call={"name": "bash"},
                      observation="o", generation_s=0.1, tool_s=0.2,
                      routed_experts=np.arange(5 * 2 * 2).reshape(5, 2, 2) % 8)


@pytest.fixture
async def buffer(db_url):
    engine = db.make_async_engine(db_url)
    yield Buffer(engine)
    await engine.dispose()


async def finish_all(buffer, groups, reward=1.0):
    for _, episodes in groups:
        for e in episodes:
            assert await buffer.finish_episode(e, status="submitted", reward=reward)


async def test_turns_are_idempotent_and_groups_ready_only_when_complete(buffer):
    [(group_id, episodes)] = await make_groups(buffer.engine, 1)
    await buffer.append_turn(episodes[0], turn(0))
    await buffer.append_turn(episodes[0], turn(0))  # a redelivered task writes the same turn again
    await buffer.append_turn(episodes[0], turn(1))
    assert await buffer.finish_episode(episodes[0], status="submitted", reward=1.0)
    assert not await buffer.finish_episode(episodes[0], status="cancelled")  # final exactly once
    assert (await buffer.stats())["pending"] == 1
    assert await buffer.finish_episode(episodes[1], status="reward_error", reward=None)
    assert (await buffer.stats())["ready"] == 1

    claim = await buffer.claim(4, trainer_step=0, max_staleness=2)
    [group] = await buffer.load(claim)
    first = next(e for e in group.episodes if e.id == episodes[0])
    assert [t.idx for t in first.turns] == [0, 1]
    assert first.turns[0].output_ids.tolist() == [4, 5]
    assert np.allclose(first.turns[0].output_logprobs, [-0.5, -1.5])
    assert first.turns[0].routed_experts.shape == (5, 2, 2)
    assert next(e for e in group.episodes if e.id == episodes[1]).reward is None


async def test_load_gives_every_episodes_turns_exactly_and_in_order(buffer):
    """Several groups and episodes read back in one go: each episode its own turns, in turn
    order whatever order they were written in, arrays bit for bit, absent arrays absent."""
    groups = await make_groups(buffer.engine, 3, size=3)
    rng = np.random.default_rng(7)
    written: dict[uuid.UUID, dict[int, TurnRecord]] = {}
    for _, episodes in groups:
        for n, e in enumerate(episodes):
            order = rng.permutation(2 + n)
            for idx in order.tolist():
                k = int(rng.integers(1, 300))
                t = TurnRecord(idx=idx, segment=idx // 2, input_ids=rng.integers(0, 150_000, k).tolist(),
                               output_ids=rng.integers(0, 150_000, k + 1).tolist(),
                               output_logprobs=None if idx == 1 else (-rng.random(k + 1)).astype(np.float32).tolist(),
                               policy_version=idx % 3, routed_experts=None if n == 0 else
                               rng.integers(0, 256, (2 * k + 1, 4, 8)).astype(np.uint8),
                               tool_call={"name": "bash", "arguments": {"command": "ls"}} if idx % 2 else None,
                               malformed_at=None if idx % 2 or n == 1 else int(rng.integers(0, k + 1)))
                await buffer.append_turn(e, t)
                written.setdefault(e, {})[idx] = t
    await finish_all(buffer, groups)
    claim = await buffer.claim(3, trainer_step=0, max_staleness=2)
    loaded = await buffer.load(claim)
    assert sorted(g.id for g in loaded) == sorted(g for g, _ in groups)
    for group in loaded:
        for episode in group.episodes:
            want = written[episode.id]
            assert [t.idx for t in episode.turns] == sorted(want)
            for got in episode.turns:
                ref = want[got.idx]
                assert (got.segment, got.policy_version) == (ref.segment, ref.policy_version)
                assert got.called is (ref.tool_call is not None)  # a well-formed call, as training asks
                assert got.malformed_at == ref.malformed_at
                assert got.input_ids.tolist() == list(ref.input_ids) and got.output_ids.tolist() == list(ref.output_ids)
                if ref.output_logprobs is None:
                    assert got.output_logprobs is None
                else:
                    assert got.output_logprobs.tobytes() == np.asarray(ref.output_logprobs, dtype=np.float32).tobytes()
                if ref.routed_experts is None:
                    assert got.routed_experts is None
                else:
                    assert np.array_equal(got.routed_experts, ref.routed_experts)


async def test_claim_commit_exactly_once(buffer):
    await finish_all(buffer, await make_groups(buffer.engine, 3))
    claim = await buffer.claim(2, trainer_step=1, max_staleness=4)
    assert len(claim.group_ids) == 2
    again = await buffer.claim(5, trainer_step=1, max_staleness=4)
    assert len(again.group_ids) == 1 and not set(again.group_ids) & set(claim.group_ids)
    await buffer.commit(claim, trainer_step=1)
    await buffer.release(again)
    assert (await buffer.stats()) | {} == {"pending": 0, "ready": 1, "claimed": 0, "consumed": 2, "dropped": 0, "skipped": 0, "evaluated": 0}


async def test_expired_lease_returns_groups_and_the_late_commit_fails(buffer):
    await finish_all(buffer, await make_groups(buffer.engine, 2))
    crashed = await buffer.claim(2, trainer_step=0, max_staleness=4, lease_s=0.05)
    await asyncio.sleep(0.1)
    survivor = await buffer.claim(2, trainer_step=0, max_staleness=4)
    assert sorted(survivor.group_ids) == sorted(crashed.group_ids)
    with pytest.raises(ClaimLost):
        await buffer.commit(crashed, trainer_step=0)
    await buffer.commit(survivor, trainer_step=0)
    assert (await buffer.stats())["consumed"] == 2


async def test_a_restarted_trainer_takes_back_only_its_own_claims(buffer):
    await finish_all(buffer, await make_groups(buffer.engine, 3))
    mine = await buffer.claim(2, trainer_step=1, max_staleness=4, owner="policy-a")
    theirs = await buffer.claim(1, trainer_step=1, max_staleness=4, owner="policy-b")
    assert await buffer.release_owner("policy-a") == 2
    assert (await buffer.stats())["ready"] == 2 and (await buffer.stats())["claimed"] == 1
    with pytest.raises(ClaimLost):  # the dead incarnation's claim is void
        await buffer.commit(mine, trainer_step=1)
    await buffer.commit(theirs, trainer_step=1)  # another trainer's claim is untouched
    assert await buffer.release_owner("policy-a") == 0


async def test_stale_groups_are_dropped_and_counted(buffer):
    await finish_all(buffer, await make_groups(buffer.engine, 2, version=0))
    await finish_all(buffer, await make_groups(buffer.engine, 1, version=5))
    claim = await buffer.claim(10, trainer_step=6, max_staleness=2)
    assert (claim.dropped, len(claim.group_ids)) == (2, 1)
    assert (await buffer.stats())["dropped"] == 2


async def test_concurrent_claimers_never_share_a_group(migrated_pg_url):
    from tests.conftest import _truncate_pg

    _truncate_pg(migrated_pg_url)
    engine = db.make_async_engine(migrated_pg_url, pool_size=10)
    try:
        buffer = Buffer(engine)
        await finish_all(buffer, await make_groups(engine, 40, size=1))
        claims = await asyncio.gather(*(buffer.claim(3, trainer_step=0, max_staleness=9) for _ in range(16)))
        taken = [g for c in claims for g in c.group_ids]
        assert len(taken) == len(set(taken)) == 40
    finally:
        await engine.dispose()


async def test_episodes_ending_at_the_same_time_make_their_group_ready_once(migrated_pg_url):
    """The last episodes of a group ending at once, each on its own connection (a worker process
    ends its episodes one at a time on a connection of its own: an engine each here): whichever
    commits last sees the others final, so every group becomes ready, with its oldest policy
    version."""
    from tests.conftest import _truncate_pg

    _truncate_pg(migrated_pg_url)
    engine = db.make_async_engine(migrated_pg_url, pool_size=8)
    workers = [db.make_async_engine(migrated_pg_url, pool_size=1) for _ in range(6)]
    try:
        groups = await make_groups(engine, 12, size=6, version=5)
        async with engine.begin() as conn:  # one episode of each group sampled from an older policy
            await conn.execute(sa.update(Episode).where(Episode.id.in_([e[3] for _, e in groups]))
                               .values(policy_version_min=3))
        ended = await asyncio.gather(*(Buffer(workers[i]).finish_episode(e, status="submitted", reward=1.0)
                                       for _, episodes in groups for i, e in enumerate(episodes)))
        assert all(ended)
        async with engine.connect() as conn:
            rows = (await conn.execute(sa.select(Group.status, Group.min_policy_version, Group.ready_at)
                                       .where(Group.id.in_([g for g, _ in groups])))).all()
        assert [(r.status, r.min_policy_version) for r in rows] == [("ready", 3)] * 12
        assert all(r.ready_at is not None for r in rows)
    finally:
        await engine.dispose()
        for worker in workers:
            await worker.dispose()


async def test_an_end_with_turns_missing_changes_nothing(buffer):
    """An episode that produced more turns than the database holds (lost in a crash) is not
    made final, and its group not ready: the worker starts it over."""
    from service.store.buffer import TurnsLost

    [(group_id, episodes)] = await make_groups(buffer.engine, 1, size=1)
    await buffer.append_turn(episodes[0], turn(0))
    with pytest.raises(TurnsLost, match="2 turns produced, 1 stored"):
        await buffer.finish_episode(episodes[0], status="submitted", reward=1.0, n_turns=2)
    async with buffer.engine.connect() as conn:
        assert await conn.scalar(sa.select(Episode.status).where(Episode.id == episodes[0])) == "running"
        assert await conn.scalar(sa.select(Group.status).where(Group.id == group_id)) == "pending"
    await buffer.append_turn(episodes[0], turn(1))
    assert await buffer.finish_episode(episodes[0], status="submitted", reward=1.0, n_turns=2)
    assert (await buffer.stats())["ready"] == 1


def _backends(admin, name: str) -> list[int]:
    """The server processes of this database's connections named `name` (application_name)."""
    with admin.connect() as conn:
        return list(conn.execute(sa.text("SELECT pid FROM pg_stat_activity WHERE application_name = :name "
                                         "AND datname = current_database()"), {"name": name}).scalars())


async def _all_closed(admin, name: str) -> bool:
    for _ in range(50):  # a closed connection's backend exits a moment later
        if not _backends(admin, name):
            return True
        await asyncio.sleep(0.1)
    return False


async def test_the_turn_writers_own_connection_comes_back_after_a_loss_and_closes_with_the_engine(migrated_pg_url):
    """Turns go through a connection of the writer's own, outside the pool: killed (a restart,
    a failover), the batch it was writing fails as a lost connection (the worker retries it)
    and the next batch opens another; disposing of the engine closes it."""
    from service.store.buffer import TURN_WRITER
    from tests.conftest import _truncate_pg

    _truncate_pg(migrated_pg_url)
    engine = db.make_async_engine(migrated_pg_url)
    admin = db.make_engine(migrated_pg_url, isolation_level="AUTOCOMMIT")

    def writers() -> list[int]:
        return _backends(admin, TURN_WRITER)

    try:
        buffer = Buffer(engine)
        [(_, [episode])] = await make_groups(engine, 1, size=1)
        await buffer.append_turn(episode, turn(0), attempt=0)
        [first] = writers()
        with admin.connect() as conn:
            conn.execute(sa.text("SELECT pg_terminate_backend(:pid)"), {"pid": first})
        with pytest.raises(sa.exc.OperationalError):
            await buffer.append_turn(episode, turn(1), attempt=0)
        await buffer.append_turn(episode, turn(1), attempt=0)
        await buffer.append_turn(episode, turn(1), attempt=0)  # a repeat of a stored turn: nothing more, no error
        assert [p for p in writers() if p != first] and len(writers()) == 1
        assert await buffer.finish_episode(episode, attempt=0, status="submitted", n_turns=2)
        await engine.dispose()
        assert await _all_closed(admin, TURN_WRITER)
    finally:
        await engine.dispose()
        admin.dispose()


async def test_an_end_that_ends_nothing_says_why(buffer):
    """An end with a turn count that ends nothing: a lost turn is TurnsLost only for the running
    attempt; an episode already final, or a fenced-off attempt, is False whatever the count."""
    from service.store.buffer import TurnsLost

    [(group_id, [first, second])] = await make_groups(buffer.engine, 1)
    async with buffer.engine.begin() as conn:
        await conn.execute(sa.update(Episode).where(Episode.id == first).values(attempt=1))
    await buffer.append_turn(first, turn(0), attempt=1)
    assert not await buffer.finish_episode(first, attempt=0, status="submitted", n_turns=3)  # superseded
    with pytest.raises(TurnsLost, match="3 turns produced, 1 stored"):
        await buffer.finish_episode(first, attempt=1, status="submitted", n_turns=3)
    assert await buffer.finish_episode(first, attempt=1, status="submitted", n_turns=1)
    assert not await buffer.finish_episode(first, attempt=1, status="submitted", n_turns=5)  # final already
    assert not await buffer.finish_episode(uuid.uuid4(), status="submitted", n_turns=0)  # no such episode
    assert await buffer.finish_episode(second, status="max_turns", n_turns=0, report={"a": [1]}, guards=["g"],
                                       segment_starts=[0])
    async with buffer.engine.connect() as conn:
        row = (await conn.execute(sa.select(Episode.report, Episode.guards, Episode.segment_starts)
                                  .where(Episode.id == second))).one()
        assert await conn.scalar(sa.select(Group.status).where(Group.id == group_id)) == "ready"
    assert tuple(row) == ({"a": [1]}, ["g"], [0])


async def test_the_episode_links_own_connection_comes_back_after_a_loss_and_closes_with_the_engine(migrated_pg_url):
    """Episode starts and ends go through a connection of the process's own (one round trip
    each): killed, the start or end on it fails as a lost connection (the worker retries it) and
    the next opens another; disposing of the engine closes it."""
    from service.store.buffer import _EpisodeLink
    from tests.conftest import _truncate_pg

    _truncate_pg(migrated_pg_url)
    engine = db.make_async_engine(migrated_pg_url)
    admin = db.make_engine(migrated_pg_url, isolation_level="AUTOCOMMIT")

    def links() -> list[int]:
        return _backends(admin, _EpisodeLink.NAME)

    try:
        buffer = Buffer(engine)
        [(_, [episode, other])] = await make_groups(engine, 1, size=2)
        row, task = await buffer.episode_to_start(episode)
        assert (row.status, row.attempt, task.instance_id, task.fail_to_pass) == ("running", 0, "t-0", ["x"])
        [first] = links()
        with admin.connect() as conn:
            conn.execute(sa.text("SELECT pg_terminate_backend(:pid)"), {"pid": first})
        with pytest.raises(sa.exc.OperationalError):
            await buffer.finish_episode(episode, attempt=0, status="submitted", n_turns=0)
        assert await buffer.finish_episode(episode, attempt=0, status="submitted", n_turns=0)
        assert await buffer.claim_attempt(other, seen_status="running", seen_attempt=1) is None  # not as seen
        await buffer.append_turn(other, turn(0), attempt=0)
        assert await buffer.claim_attempt(other, seen_status="running", seen_attempt=0) == 1  # a restart
        async with engine.connect() as conn:  # its old attempt's turns went with the claim
            assert await conn.scalar(sa.select(sa.func.count()).select_from(Turn).where(Turn.episode_id == other)) == 0
        assert [p for p in links() if p != first] and len(links()) == 1
        await engine.dispose()
        assert await _all_closed(admin, _EpisodeLink.NAME)
    finally:
        await engine.dispose()
        admin.dispose()


async def test_a_link_closed_under_a_waiting_statement_fails_it_at_once(migrated_pg_url):
    """A statement waiting for the server on a link's connection when the link closes (the
    engine disposed under it) fails as a lost connection, not a wait for ever; the next
    statement opens another connection."""
    from service.store.buffer import _Compiled, _EpisodeLink

    engine = db.make_async_engine(migrated_pg_url)
    try:
        link = _EpisodeLink.of(engine)
        sleeping = asyncio.create_task(link.run([_Compiled.of(sa.select(sa.func.pg_sleep(30)))({})]))
        await asyncio.sleep(0.5)
        assert not sleeping.done()
        link.close()
        with pytest.raises(sa.exc.OperationalError):
            await asyncio.wait_for(sleeping, 5)
        [(rows, _)] = await link.run([_Compiled.of(sa.select(sa.literal(7).label("seven")))({})])
        assert [r.seven for r in rows] == [7]
    finally:
        await engine.dispose()


async def test_a_link_the_server_closes_while_idle_leaves_the_loop_and_the_next_use_reconnects(migrated_pg_url):
    """The socket of an idle link stays on the loop: the server closing it (a restart, a
    failover, an idle timeout) takes it off the loop, with no wake-ups while it is gone, and the
    next turn goes through on a new connection."""
    from service.store.buffer import TURN_WRITER, _TurnWriter
    from tests.conftest import _truncate_pg

    _truncate_pg(migrated_pg_url)
    engine = db.make_async_engine(migrated_pg_url)
    admin = db.make_engine(migrated_pg_url, isolation_level="AUTOCOMMIT")
    try:
        buffer = Buffer(engine)
        [(_, [episode])] = await make_groups(engine, 1, size=1)
        await buffer.append_turn(episode, turn(0), attempt=0)
        conn = _TurnWriter.of(engine).conn
        [first] = _backends(admin, TURN_WRITER)
        with admin.connect() as c:
            c.execute(sa.text("SELECT pg_terminate_backend(:pid)"), {"pid": first})
        for _ in range(100):
            if conn.fd < 0:
                break
            await asyncio.sleep(0.05)
        assert conn.fd < 0 and conn.raw.closed
        await buffer.append_turn(episode, turn(1), attempt=0)
        assert _TurnWriter.of(engine).conn is not conn and _backends(admin, TURN_WRITER) != [first]
        assert await buffer.finish_episode(episode, attempt=0, status="submitted", n_turns=2)
    finally:
        await engine.dispose()
        admin.dispose()


async def test_every_field_of_a_turn_is_stored_as_given_and_a_value_out_of_range_is_refused(migrated_pg_url):
    """The turn writer encodes a turn's parameters itself (binary ids and arrays, text for the
    rest): each column reads back what was given, and a number no column can take is a
    StorageError from the database, as any refused write."""
    from tests.conftest import _truncate_pg

    _truncate_pg(migrated_pg_url)
    engine = db.make_async_engine(migrated_pg_url)
    try:
        buffer = Buffer(engine)
        [(_, [episode])] = await make_groups(engine, 1, size=1)
        given = TurnRecord(idx=0, segment=2, input_ids=[7, 2**31 - 1, 0], output_ids=[5], output_logprobs=[-0.25],
                           policy_version=-1, finish_reason="length", text="héllo ✓ \\ 'q' \"d\"",
                           tool_call={"name": "bash", "arguments": {"command": "echo 'a'\n", "n": [1, 2.5, None]}},
                           observation="line\n\ttab", generation_s=0.1, tool_s=1e-300, malformed_at=3,
                           routed_experts=None)
        before = utcnow()
        await buffer.append_turn(episode, given, attempt=0)
        async with engine.connect() as conn:
            row = (await conn.execute(sa.select(Turn).where(Turn.episode_id == episode))).one()
        assert (row.idx, row.segment, row.policy_version, row.finish_reason, row.text, row.tool_call, row.observation,
                row.generation_s, row.tool_s, row.malformed_at, row.n_input_tokens, row.n_output_tokens) == (
            0, 2, -1, "length", given.text, given.tool_call, given.observation, 0.1, 1e-300, 3, 3, 1)
        assert row.routed_experts is None and before <= row.started_at.replace(tzinfo=before.tzinfo) <= utcnow()
        assert decode_array(row.input_ids).tolist() == [7, 2**31 - 1, 0] and decode_array(row.output_logprobs).tolist() == [-0.25]
        with pytest.raises(StorageError, match="out of range"):
            await buffer.append_turn(episode, TurnRecord(**{**given.__dict__, "idx": 1, "policy_version": 2**31}),
                                     attempt=0)
        with pytest.raises(StorageError, match="turn 1 of episode"):
            await buffer.append_turn(episode, TurnRecord(**{**given.__dict__, "idx": 1, "generation_s": "soon"}),
                                     attempt=0)
        await buffer.append_turn(episode, TurnRecord(**{**given.__dict__, "idx": 1}), attempt=0)  # the writer goes on
        assert await buffer.finish_episode(episode, attempt=0, status="submitted", n_turns=2)
    finally:
        await engine.dispose()


async def test_turns_appended_at_the_same_time_go_together_and_each_learns_its_own_fate(migrated_pg_url):
    """Group commit on PostgreSQL: the turns many episodes append at once are written in a few
    transactions, not one each, and every caller still gets its own outcome: stored exactly, a
    repeat ignored, a fenced-off attempt Superseded, a refused turn a StorageError, and no other
    turn of the batch lost for them."""
    from service.store.buffer import _TurnWriter
    from tests.conftest import _truncate_pg

    _truncate_pg(migrated_pg_url)
    engine = db.make_async_engine(migrated_pg_url, pool_size=4)
    try:
        buffer = Buffer(engine)
        episodes = [e for _, es in await make_groups(engine, 20, size=2) for e in es]

        async def write(e):
            for i in range(3):
                await buffer.append_turn(e, turn(i), attempt=0)

        batches = []
        store = _TurnWriter._store

        async def counted(self, rows):
            batches.append(len(rows))
            return await store(self, rows)

        _TurnWriter._store = counted
        try:
            await asyncio.gather(*(write(e) for e in episodes))
            written = list(batches)
            outcomes = await asyncio.gather(
                buffer.append_turn(episodes[0], turn(0), attempt=0),  # a repeat: ignored
                buffer.append_turn(episodes[1], turn(3), attempt=1),  # not the running attempt
                buffer.append_turn(episodes[2], turn(None), attempt=0),  # idx NOT NULL: refused
                buffer.append_turn(episodes[3], turn(3)),  # unfenced, beside the fenced ones
                *(buffer.append_turn(e, turn(3), attempt=0) for e in episodes[4:]),
                return_exceptions=True)
        finally:
            _TurnWriter._store = store
        assert sum(written) == 3 * len(episodes) and len(written) <= 3 * len(episodes) / 4
        assert outcomes[0] is None and outcomes[3] is None and all(o is None for o in outcomes[4:])
        assert isinstance(outcomes[1], Superseded)
        assert isinstance(outcomes[2], StorageError) and "refused turn None of episode" in str(outcomes[2])
        async with engine.connect() as conn:
            counts = dict((await conn.execute(sa.select(Turn.episode_id, sa.func.count()).group_by(Turn.episode_id))).all())
        assert [counts[e] for e in episodes] == [3, 3, 3] + [4] * (len(episodes) - 3)
        assert all([await buffer.finish_episode(e, status="submitted", n_turns=counts[e]) for e in episodes])
        claim = await buffer.claim(20, trainer_step=0, max_staleness=9)
        loaded = {e.id: e for g in await buffer.load(claim) for e in g.episodes}
        want = turn(2)
        for e in episodes:
            got = loaded[e].turns[2]
            assert list(got.output_ids) == want.output_ids and np.array_equal(got.routed_experts, want.routed_experts)
    finally:
        await engine.dispose()


async def test_a_turn_twice_in_one_batch_is_stored_once_and_the_second_is_a_repeat(migrated_pg_url):
    """A turn that comes twice in a batch is stored by the first and reported a repeat for the
    second; a fenced-off turn beside them is not stored, an unfenced one is; a batch of one turn
    (a plain execute, not a pipeline) the same."""
    from service.store.buffer import _TurnWriter
    from tests.conftest import _truncate_pg

    _truncate_pg(migrated_pg_url)
    engine = db.make_async_engine(migrated_pg_url, pool_size=2)
    try:
        buffer = Buffer(engine)
        (_, (a, b)), = await make_groups(engine, 1, size=2)
        rows = []
        real = _TurnWriter._write

        async def keep(self, batch):  # the rows as append_turn builds them
            rows.extend((row, attempt) for row, attempt, _ in batch)
            for _, _, done in batch:
                done.set_result(False)

        _TurnWriter._write = keep
        try:
            for episode, idx, attempt in ((a, 0, 0), (b, 0, 1)):
                with contextlib.suppress(Superseded):
                    await buffer.append_turn(episode, turn(idx), attempt=attempt)
        finally:
            _TurnWriter._write = real
        (first, _), (fenced, _) = rows
        unfenced = {**first, "idx": 1}
        stored = await _TurnWriter.of(engine)._store([(first, 0), (dict(first), 0), (fenced, 1), (unfenced, None)])
        assert stored == [True, False, False, True]
        writer = _TurnWriter.of(engine)  # a batch of one is a statement of its own: the same outcomes
        assert [await writer._store([one]) for one in ((first, 0), (fenced, 1), ({**first, "idx": 2}, None))] == [
            [False], [False], [True]]
        async with engine.connect() as conn:
            keys = sorted((await conn.execute(sa.select(Turn.episode_id, Turn.idx))).all())
        assert keys == [(a, 0), (a, 1), (a, 2)]
    finally:
        await engine.dispose()


async def test_the_turns_copy_stream_parses_the_same_however_it_is_cut(migrated_pg_url):
    """The PostgreSQL read path parses the binary COPY itself, row by row as it streams: the
    same rows whatever the chunk boundaries (psycopg hands one message per row; a row split
    across chunks, or the header alone, must parse the same), and a stream cut short is an error,
    never fewer turns."""
    import psycopg

    from service.store.buffer import _PG_FETCH, StorageError, _CopyRows, _fetch_turns
    from tests.conftest import _truncate_pg

    _truncate_pg(migrated_pg_url)
    engine = db.make_async_engine(migrated_pg_url)
    try:
        buffer = Buffer(engine)
        [(_, episodes)] = await make_groups(engine, 1, size=2)
        rng = np.random.default_rng(3)
        for e in episodes:
            for idx in range(3):
                await buffer.append_turn(e, TurnRecord(
                    idx=idx, segment=idx, input_ids=rng.integers(0, 9, 40).tolist(), output_ids=[idx, 7],
                    output_logprobs=None if idx == 1 else [-0.25, -2.0], policy_version=None if idx == 2 else idx,
                    routed_experts=rng.integers(0, 8, (42, 2, 2)).astype(np.uint8) if idx == 0 else None,
                    tool_call={"name": "submit"} if idx else None, malformed_at=None if idx else 1))
        async with engine.connect() as conn:
            want = await _fetch_turns(conn, episodes)
    finally:
        await engine.dispose()
    assert [(e, t.idx) for e, t in want] == sorted((e, i) for e in episodes for i in range(3))
    assert [t.policy_version for _, t in want] == [0, 1, None] * 2
    assert [t.called for _, t in want] == [False, True, True] * 2
    assert [t.malformed_at for _, t in want] == [1, None, None] * 2
    assert [t.output_logprobs is None for _, t in want] == [False, True, False] * 2

    with psycopg.connect(db.sync_url(migrated_pg_url).replace("postgresql+psycopg", "postgresql")) as conn:
        with conn.cursor().copy(_PG_FETCH, (episodes,)) as copy:
            stream = b"".join(bytes(chunk) for chunk in copy)

    def comparable(rows):
        def plain(v):
            return (v.dtype.str, v.shape, v.tobytes()) if isinstance(v, np.ndarray) else v

        return [(e, tuple(plain(v) for v in vars(t).values())) for e, t in rows]

    for size in (1, 2, 5, 19, 64, 333, len(stream)):
        rows = _CopyRows(episodes)
        for at in range(0, len(stream), size):
            rows.feed(stream[at:at + size])
        assert comparable(rows.result()) == comparable(want), size
    for cut in (10, len(stream) // 2, len(stream) - 2):
        rows = _CopyRows(episodes)
        rows.feed(stream[:cut])
        with pytest.raises(StorageError, match="ended early"):
            rows.result()


@pytest.mark.parametrize(("raw", "stored"), [
    ("plain text, tabs\tand\r\nline breaks stay; ünïcödé ✓ 字 🙂", None),
    ("a\x00b", "a\u2400b"),
    ("\x1b[31mred\x1b[0m\x07", "\u241b[31mred\u241b[0m\u2407"),
    ("\x01\x08\x0b\x0c\x0e\x1f\x7f", "\u2401\u2408\u240b\u240c\u240e\u241f\u2421"),
    ("bad utf-8 \ufffd, lone surrogates \udcff\ud800 and a pair 😀", "bad utf-8 \ufffd, lone surrogates \ufffd\ufffd and a pair 😀"),
    ({"k\x00": ["\x1b", 1, None, {"n": 2.5}]}, {"k\u2400": ["\u241b", 1, None, {"n": 2.5}]}),
])  # fmt: skip
def test_storable_escapes_only_what_databases_and_terminals_cannot_take(raw, stored):
    assert storable(raw) == (raw if stored is None else stored)


async def test_any_text_is_stored_escaped_and_tokens_exactly(buffer):
    """What an agent or task wrote cannot fail a write, on either database; the token arrays
    (what the trainer reads) are untouched."""
    [(_, [episode_id, _])] = await make_groups(buffer.engine, 1)
    raw = "a\x00b\ufffd\udcff\x1b[31mred\x7f"
    shown = "a\u2400b\ufffd\ufffd\u241b[31mred\u2421"
    record = turn(0)
    record.text, record.observation, record.tool_call = raw, raw, {"name": "bash", "arguments": {raw: [raw]}}
    await buffer.append_turn(episode_id, record, attempt=0)
    assert await buffer.finish_episode(episode_id, attempt=0, status="submitted", n_turns=1, diff=raw,
                                       error_message=raw, report={"log_tail": raw})
    async with buffer.engine.connect() as conn:
        stored = (await conn.execute(sa.select(Turn).where(Turn.episode_id == episode_id))).one()
        episode = (await conn.execute(sa.select(Episode).where(Episode.id == episode_id))).one()
    assert (stored.text, stored.observation, stored.tool_call) == (shown, shown, {"name": "bash", "arguments": {shown: [shown]}})
    assert (episode.diff, episode.error_message, episode.report) == (shown, shown, {"log_tail": shown})
    assert decode_array(stored.input_ids).tolist() == [1, 2, 3] and decode_array(stored.output_ids).tolist() == [4, 5]


async def test_a_write_the_database_refuses_is_a_storage_error(buffer):
    """Not a lost connection: retrying cannot help, so the caller is told (no retry loop)."""
    [(_, [episode_id, _])] = await make_groups(buffer.engine, 1)
    with pytest.raises(StorageError, match="refused turn None of episode"):
        await buffer.append_turn(episode_id, turn(None), attempt=0)  # idx is NOT NULL
    with pytest.raises(StorageError, match="refused the end of episode"):
        await buffer.finish_episode(episode_id, status="submitted", input_tokens=None)  # NOT NULL
    async with buffer.engine.connect() as conn:
        assert await conn.scalar(sa.select(Episode.status).where(Episode.id == episode_id)) == "running"


async def test_a_runs_dataset_is_its_groups_in_their_order_in_the_run(buffer):
    """trained_group_ids (SFT's fixed dataset) lists the run's trainable groups by their seq, not
    by id: ids are random uuid4s, and two runs of one seed must take their demonstrations in the
    same order. Pending groups are not part of it."""
    groups = await make_groups(buffer.engine, 12, size=1)
    await finish_all(buffer, groups[:10])
    by_id = sorted(g for g, _ in groups)
    async with buffer.engine.begin() as conn:  # seq runs against the ids' order
        run_id = await conn.scalar(sa.select(Group.run_id).where(Group.id == by_id[0]))
        for g in by_id:
            await conn.execute(sa.update(Group).where(Group.id == g).values(seq=Group.seq + 100))
        for seq, g in enumerate(reversed(by_id)):
            await conn.execute(sa.update(Group).where(Group.id == g).values(seq=seq))
    ready = {g for g, _ in groups[:10]}
    assert await buffer.trained_group_ids(run_id) == [g for g in reversed(by_id) if g in ready]
