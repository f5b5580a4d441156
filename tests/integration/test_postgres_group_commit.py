"""Group commit in the PostgreSQL driver, on a real server.

Writes of different conversations that find every connection busy wait in a queue; the next free
connection commits them together: one transaction, one round trip, each write's lock and guard before its
statements. To make a batch deterministic, the driver gets one connection (``max_size=1``) and a read of
the conversation ``hold`` keeps it (a row-primitive hook waits) until the test lets go; writes started
meanwhile queue, and the next transaction takes them. ``driver.batches`` counts transactions that committed
more than one write. No verdict depends on timing; a generous timeout only keeps a broken build from
hanging.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable
from typing import Any

import pytest

from threadline.errors import AgentConversationPurgedError, AgentStoreUnavailableError

psycopg = pytest.importorskip("psycopg")
pytest.importorskip("psycopg_pool")

from psycopg_pool import AsyncConnectionPool  # noqa: E402
from test_postgres_store import Rows, _terminate, admit, handle_for, sql  # noqa: E402
from test_sqlite_store import Clock, turn  # noqa: E402

from threadline.store.postgres import (  # noqa: E402
    PostgresAgentRuntimeStoreHandle,
    create_postgres_agent_runtime_store,
)

pytestmark = pytest.mark.postgres

WAIT = 60.0  # seconds; only a broken build ever waits this long


class Hold:
    """Keeps the driver's only connection busy with a read of ``hold`` until the ``async with`` ends; extra
    ``hooks`` (by primitive name) see every other call, batched or not."""

    def __init__(self, pg: PostgresAgentRuntimeStoreHandle, **hooks: Any) -> None:
        self.pg = pg
        self.hooks = hooks
        self.entered = asyncio.Event()
        self.release = asyncio.Event()
        self.task: asyncio.Future[Any] | None = None

    async def _load_head(self, rows: Any, request: Any) -> Any:
        if request.conversation_id == "hold" and not self.release.is_set():
            self.entered.set()
            await self.release.wait()
        hook = self.hooks.get("load_head")
        return await (hook(rows, request) if hook is not None else rows.load_head(request))

    async def __aenter__(self) -> Hold:
        self.pg.driver.rows_wrapper = lambda rows: Rows(rows, {**self.hooks, "load_head": self._load_head})
        self.task = asyncio.ensure_future(self.pg.store.load_run(conversation_id="hold", run_id="none"))
        await asyncio.wait_for(self.entered.wait(), WAIT)
        return self

    async def queued(self, n: int) -> None:
        """Wait until ``n`` writes wait for a batch (they queue at their first await)."""
        for _ in range(1000):
            if len(self.pg.driver._group_commit.queue) == n:
                return
            await asyncio.sleep(0)
        raise AssertionError(f"{len(self.pg.driver._group_commit.queue)} writes queued, not {n}")

    async def __aexit__(self, *exc: object) -> None:
        self.release.set()
        assert self.task is not None
        assert await asyncio.wait_for(self.task, WAIT) is None  # the hooks stay: writes may go on alone


def start(*calls: Awaitable[Any]) -> list[asyncio.Future[Any]]:
    return [asyncio.ensure_future(call) for call in calls]


async def seen(pg: PostgresAgentRuntimeStoreHandle, *cids: str) -> None:
    """Two turns on each conversation: the driver has seen them live, so their writes can answer from hints,
    and its connection has prepared the guards of a steady turn."""
    for cid in cids:
        await turn(pg.store, cid, "s0")
        await turn(pg.store, cid, "s1")


async def admitted(pg: PostgresAgentRuntimeStoreHandle, cid: str, n: str) -> bool:
    return await pg.store.load_run(conversation_id=cid, run_id=f"{n}:run") is not None


@pytest.fixture(params=["own pool", "pool passed in"])
async def one_connection(request: pytest.FixtureRequest, postgres_dsn: str, schema: str) -> AsyncIterator[Any]:
    """A store with one connection: its own pool, or an application's pool (not autocommit) passed in."""
    if request.param == "own pool":
        async with handle_for(postgres_dsn, schema, max_size=1) as pg:
            yield pg
        return
    async with (
        AsyncConnectionPool(postgres_dsn, min_size=1, max_size=1, open=False) as pool,
        create_postgres_agent_runtime_store(pool=pool, schema=schema, clock=Clock()) as pg,
    ):
        yield pg


async def test_writes_waiting_together_commit_in_one_transaction(
    one_connection: PostgresAgentRuntimeStoreHandle, postgres_dsn: str, schema: str
) -> None:
    cids = [f"c{i}" for i in range(6)]
    pg = one_connection
    await seen(pg, *cids)
    async with Hold(pg) as hold:
        trips = pg.driver.round_trips
        tasks = start(*(admit(pg.store, cid, "t1") for cid in cids))
        await hold.queued(len(cids))
    results = await asyncio.wait_for(asyncio.gather(*tasks), WAIT)
    assert [r.outcome for r in results] == ["accepted"] * len(cids)
    assert pg.driver.batches == 1
    assert pg.driver.round_trips - trips == 2  # the held read, and the batch
    assert pg.driver.restarts == 0
    async with handle_for(postgres_dsn, schema) as fresh:  # what a process that never saw them reads
        for cid, result in zip(cids, results, strict=True):
            loaded = await fresh.store.load_run(conversation_id=cid, run_id="t1:run")
            assert loaded is not None and loaded.run == result.run


async def test_a_stale_write_fails_its_batch_and_every_write_runs_alone(postgres_dsn: str, schema: str) -> None:
    async with handle_for(postgres_dsn, schema, max_size=1) as pg, handle_for(postgres_dsn, schema) as other:
        await seen(pg, "c0", "c1", "c2")
        await admit(other.store, "c0", "t1")  # behind pg's back: what pg remembers of c0 is stale
        async with Hold(pg) as hold:
            tasks = start(*(admit(pg.store, cid, "t2") for cid in ("c0", "c1", "c2")))
            await hold.queued(3)
        results = await asyncio.wait_for(asyncio.gather(*tasks), WAIT)
        assert [r.outcome for r in results] == ["accepted"] * 3
        assert results[0].run.admission_sequence == 4  # after s0, s1 and other's t1
        assert pg.driver.batches == 0  # the batch committed nothing; each write then committed alone
        assert pg.driver.restarts == 1  # c0, on the rows its guard found moved
        for cid in ("c0", "c1", "c2"):
            assert await admitted(pg, cid, "t2")


async def test_two_writes_of_one_conversation_go_in_successive_batches(postgres_dsn: str, schema: str) -> None:
    async with handle_for(postgres_dsn, schema, max_size=1) as pg:
        await seen(pg, "c0", "c1")
        async with Hold(pg) as hold:
            tasks = start(admit(pg.store, "c0", "t1"), admit(pg.store, "c0", "t2"), admit(pg.store, "c1", "t1"))
            await hold.queued(3)
        first, second, other = await asyncio.wait_for(asyncio.gather(*tasks), WAIT)
        assert (first.outcome, second.outcome, other.outcome) == ("accepted",) * 3
        assert (first.run.admission_sequence, second.run.admission_sequence) == (3, 4)  # queue order
        assert pg.driver.batches == 1 and pg.driver.restarts == 0  # c0's second write saw the first's rows


async def test_a_write_cancelled_while_it_waits_is_not_written(postgres_dsn: str, schema: str) -> None:
    async with handle_for(postgres_dsn, schema, max_size=1) as pg:
        await seen(pg, "c0", "c1", "c2")
        async with Hold(pg) as hold:
            tasks = start(*(admit(pg.store, cid, "t1") for cid in ("c0", "c1", "c2")))
            await hold.queued(3)
            tasks[1].cancel()
        done = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), WAIT)
        assert isinstance(done[1], asyncio.CancelledError)
        assert [await admitted(pg, cid, "t1") for cid in ("c0", "c1", "c2")] == [True, False, True]
        assert pg.driver.batches == 1


async def test_a_purge_leaves_the_batch_and_runs_alone(postgres_dsn: str, schema: str) -> None:
    async with handle_for(postgres_dsn, schema, max_size=1) as pg:
        await seen(pg, "c0", "c1", "c2")
        async with Hold(pg) as hold:
            tasks = start(
                admit(pg.store, "c0", "t1"),
                pg.store.purge_conversation(conversation_id="c1"),
                admit(pg.store, "c2", "t1"),
            )
            await hold.queued(3)
        first, purged, last = await asyncio.wait_for(asyncio.gather(*tasks), WAIT)
        assert (first.outcome, last.outcome) == ("accepted", "accepted")
        assert purged.outcome == "purged"
        assert pg.driver.batches == 1  # c0 and c2 together; the purge on its own
        with pytest.raises(AgentConversationPurgedError):
            await admit(pg.store, "c1", "t2")


async def test_no_free_connection_in_time_is_a_typed_error_and_nothing_is_written(
    postgres_dsn: str, schema: str
) -> None:
    async with handle_for(postgres_dsn, schema, max_size=1, timeout=0.2) as pg:
        await seen(pg, "c0", "c1")
        async with Hold(pg) as hold:
            tasks = start(admit(pg.store, "c0", "t1"), admit(pg.store, "c1", "t1"))
            await hold.queued(2)
            # the connection stays held until both gave up: first waiting for a batch, then alone
            done = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), WAIT)
        assert all(isinstance(e, AgentStoreUnavailableError) for e in done), done
        assert [await admitted(pg, cid, "t1") for cid in ("c0", "c1")] == [False, False]
        assert (await admit(pg.store, "c0", "t1")).outcome == "accepted"


async def test_a_write_that_needs_the_server_leaves_the_batch(postgres_dsn: str, schema: str) -> None:
    asked: list[bool] = []

    async def ask_the_server(rows: Any, request: Any) -> Any:
        if request.conversation_id == "c1":
            asked.append(rows.deferred)
            await rows._fetch("SELECT 1", ())  # in a batch nothing may be sent: this write goes alone
        return await rows.load_head(request)

    async with handle_for(postgres_dsn, schema, max_size=1) as pg:
        await seen(pg, "c0", "c1", "c2")
        async with Hold(pg, load_head=ask_the_server) as hold:
            tasks = start(*(admit(pg.store, cid, "t1") for cid in ("c0", "c1", "c2")))
            await hold.queued(3)
        results = await asyncio.wait_for(asyncio.gather(*tasks), WAIT)
        assert [r.outcome for r in results] == ["accepted"] * 3
        assert asked == [True, False]  # tried in the batch, then done alone
        assert pg.driver.batches == 1 and pg.driver.restarts == 0


async def test_a_batch_whose_connection_dies_commits_none_of_its_writes(postgres_dsn: str, schema: str) -> None:
    async def kill_before_sending(rows: Any, request: Any) -> Any:
        if rows.deferred and request.conversation_id == "c2":  # the last write of the batch is built
            await _terminate(postgres_dsn, rows.conn.info.backend_pid)
        return await rows.load_head(request)

    async with handle_for(postgres_dsn, schema, max_size=1) as pg:
        await seen(pg, "c0", "c1", "c2")
        async with Hold(pg, load_head=kill_before_sending) as hold:
            tasks = start(*(admit(pg.store, cid, "t1") for cid in ("c0", "c1", "c2")))
            await hold.queued(3)
        done = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), WAIT)
        for error in done:  # each learns that its commit may or may not have happened
            assert isinstance(error, AgentStoreUnavailableError) and "whether it committed is unknown" in str(error)
        assert [await admitted(pg, cid, "t1") for cid in ("c0", "c1", "c2")] == [False] * 3  # all or nothing
        again = await admit(pg.store, "c0", "t1")  # the pool replaced the connection; the store goes on
        assert again.outcome == "accepted"


async def test_many_conversations_at_once_on_few_connections(postgres_dsn: str, schema: str) -> None:
    """Twenty conversations take three turns each at once on two connections: batches form, and every
    conversation ends with exactly its own turns, in order, as a driver without group commit writes them."""
    cids = [f"c{i:02d}" for i in range(20)]

    def shape(m: Any) -> tuple[Any, ...]:
        return m.id, m.role, m.parts, m.position, m.status

    async def conversation(pg: PostgresAgentRuntimeStoreHandle, cid: str) -> None:
        for n in ("t0", "t1", "t2"):
            await turn(pg.store, cid, n, answer=f"{cid} answer {n}")

    async with handle_for(postgres_dsn, schema, max_size=2) as pg:
        await asyncio.wait_for(asyncio.gather(*(conversation(pg, cid) for cid in cids)), WAIT)
        assert pg.driver.batches > 0
        async with handle_for(postgres_dsn, f"{schema}_plain", max_size=2) as plain:
            try:
                plain.driver.batch_writes = False
                for cid in cids:
                    await conversation(plain, cid)
                assert plain.driver.batches == 0
                for cid in cids:
                    a, b = [await h.store.load_snapshot(conversation_id=cid) for h in (pg, plain)]
                    assert [shape(m) for m in a.messages] == [shape(m) for m in b.messages]
                    assert [(r.id, r.state) for r in a.runs] == [(r.id, r.state) for r in b.runs]
                    assert a.messages[-1].parts[0].text == f"{cid} answer t2"  # type: ignore[union-attr]
            finally:
                await sql(postgres_dsn, f'DROP SCHEMA IF EXISTS "{schema}_plain" CASCADE')


async def test_close_lets_writes_waiting_for_a_batch_commit_first(postgres_dsn: str, schema: str) -> None:
    pg = handle_for(postgres_dsn, schema, max_size=1)
    async with pg:
        await seen(pg, "c0", "c1")
        async with Hold(pg) as hold:
            tasks = start(admit(pg.store, "c0", "t1"), admit(pg.store, "c1", "t1"))
            await hold.queued(2)
            closing = asyncio.ensure_future(pg.close())  # begins while the writes wait for their batch
            for _ in range(10):
                await asyncio.sleep(0)
        results = await asyncio.wait_for(asyncio.gather(*tasks), WAIT)
        await asyncio.wait_for(closing, WAIT)
    assert [r.outcome for r in results] == ["accepted", "accepted"]
    assert pg.driver.batches == 1
    async with handle_for(postgres_dsn, schema) as fresh:
        for cid in ("c0", "c1"):
            assert await fresh.store.load_run(conversation_id=cid, run_id="t1:run") is not None


async def test_a_batch_on_a_connection_new_to_the_driver_prepares_it_first(postgres_dsn: str, schema: str) -> None:
    async with handle_for(postgres_dsn, schema, max_size=1) as pg:
        await seen(pg, "c0", "c1")
        pool = pg.driver.pool
        assert pool is not None
        async with pool.connection() as conn:  # the only connection, as the driver prepared it
            old = conn.info.backend_pid
        await _terminate(postgres_dsn, old)
        await pool.check()  # the pool replaces it: a connection that has prepared nothing
        gate = pg.driver._gate
        await gate.acquire()  # every slot taken: the writes below wait for a batch
        try:
            tasks = start(admit(pg.store, "c0", "t1"), admit(pg.store, "c1", "t1"))
            for _ in range(1000):
                if len(pg.driver._group_commit.queue) == 2:
                    break
                await asyncio.sleep(0)
            assert len(pg.driver._group_commit.queue) == 2
            trips = pg.driver.round_trips
        finally:
            gate.release()
        results = await asyncio.wait_for(asyncio.gather(*tasks), WAIT)
        assert [r.outcome for r in results] == ["accepted", "accepted"]
        assert pg.driver.batches == 1
        assert pg.driver.round_trips - trips == 3  # preparing the statements, then the guard shape, then the batch
