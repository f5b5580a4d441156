"""Group commit in the SQLite driver, on real files.

The worker runs the jobs waiting in its queue in one transaction; an operation that fails after it wrote
rolls it back, and what ran after the first write runs again in the next one.
To make a batch deterministic, a *gate* (a blocking call handed to the worker through ``driver._call``)
holds the worker thread, and with it the connection, until the test opens it; every operation started
meanwhile is queued (none can run on the calling thread while the worker holds the connection), and the
next transactions take them together, ``driver.max_batch`` at a time. ``driver.transactions`` and
``driver.operations`` count what the driver did. No verdict depends on timing; a generous timeout only
keeps a broken build from hanging.
"""

from __future__ import annotations

import asyncio
import sqlite3
import threading
from collections.abc import Generator
from datetime import UTC, datetime
from pathlib import Path
from types import TracebackType
from typing import Any

import pytest

from threadline.errors import (
    AgentConversationPurgedError,
    AgentIdempotencyConflictError,
    AgentRecordValidationError,
    AgentStoreBusyError,
    AgentStoreUnavailableError,
)
from threadline.records import ConversationHead, Message, RunOperation, TextPart
from threadline.store import AgentRuntimeStore
from threadline.store.driver import LoadHead, Mutation, OperationStats, Write
from threadline.store.sqlite import SqliteStoreDriver, create_sqlite_agent_runtime_store

NOW = datetime(2030, 1, 1, tzinfo=UTC)
WAIT = 60.0  # seconds; only a broken build ever waits this long


def text(t: str) -> list[dict[str, str]]:
    return [{"type": "text", "text": t}]


@pytest.fixture
def db(tmp_path: Path) -> Path:
    return tmp_path / "threadline.db"


class Gate:
    """Holds the worker thread (and the connection) until the ``async with`` block ends."""

    def __init__(self, driver: SqliteStoreDriver) -> None:
        self.driver = driver
        self.entered = threading.Event()
        self.released = threading.Event()
        self.task: asyncio.Future[Any] | None = None

    def _hold(self) -> str:
        self.entered.set()
        self.released.wait(WAIT)
        return "gate"

    async def __aenter__(self) -> Gate:
        self.task = asyncio.ensure_future(self.driver._call(self._hold))
        assert await asyncio.to_thread(self.entered.wait, WAIT), "the worker never ran the gate"
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        # every task started in the block has run to its store call (one loop iteration), and the driver
        # has handed what it gathered in that iteration to the worker (the next one)
        for _ in range(2):
            await asyncio.sleep(0)
        self.released.set()
        assert self.task is not None
        assert await self.task == "gate"


def queue(*calls: Any) -> list[asyncio.Future[Any]]:
    return [asyncio.ensure_future(call) for call in calls]


async def settle(tasks: list[asyncio.Future[Any]]) -> list[Any]:
    return await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), WAIT)


def accept(store: AgentRuntimeStore, cid: str, key: str, input_id: str | None = None) -> Any:
    return store.accept_input_and_assign_run(
        conversation_id=cid,
        idempotency_key=key,
        input={"id": input_id or f"{cid}:{key}", "parts": text(f"input {key}")},
    )


def head(cid: str, version: int = 1) -> ConversationHead:
    return ConversationHead(conversation_id=cid, version=version, created_at=NOW, updated_at=NOW)


def writes_then_raises(cid: str, version: int = 1) -> Generator[Any, Any, None]:
    """An operation that writes a head, then fails: it must leave nothing."""
    yield LoadHead(cid)
    yield Write(Mutation(head=head(cid, version)))
    raise RuntimeError("the operation failed after writing")


def writes_then_hits_the_purge_guard(cid: str, purged: str) -> Generator[Any, Any, None]:
    """Writes a head, then a head for a purged conversation: SQLite's trigger aborts the second write."""
    yield Write(Mutation(head=head(cid)))
    yield Write(Mutation(head=head(purged)))


def settles_then_raises(cid: str, words: str) -> Generator[Any, Any, None]:
    """Writes a settled message (the full-text index notes it), then fails: it must leave nothing."""
    message = Message(
        id=f"{cid}:ghost",
        conversation_id=cid,
        role="user",
        status="committed",
        parts=(TextPart(text=words),),
        created_at=NOW,
        position=1000,
        seq=1000,
    )
    yield Write(Mutation(head=head(cid, version=1000), messages=(message,)))
    raise RuntimeError("the operation failed after settling a message")


def reads_then_writes(cid: str) -> Generator[Any, Any, None]:
    yield LoadHead(cid)
    yield Write(Mutation(head=head(cid)))


def heads_in(path: Path) -> set[str]:
    conn = sqlite3.connect(path)
    try:
        return {cid for (cid,) in conn.execute("SELECT conversation_id FROM threadline_conversations")}
    finally:
        conn.close()


async def test_operations_queued_together_share_transactions(db: Path) -> None:
    conversations = 20
    async with create_sqlite_agent_runtime_store(filename=db) as sqlite:
        driver = sqlite.driver
        n = driver.max_batch + 36
        async with Gate(driver):
            transactions, operations = driver.transactions, driver.operations
            tasks = queue(*(accept(sqlite.store, f"c{i % conversations}", f"k{i}") for i in range(n)))
            searches = queue(sqlite.search_messages("c0", "input"), sqlite.search_messages("c1", '"unterminated'))
        results = await settle(tasks)
        found, invalid = await settle(searches)
        assert all(not isinstance(r, BaseException) and r.outcome == "accepted" for r in results), results
        # every job queued behind the gate ran in ceil((n + 2) / max_batch) transactions, in queue order
        assert driver.operations - operations == n + 2
        assert driver.transactions - transactions == -(-(n + 2) // driver.max_batch) == 2
        # inside a shared transaction each operation saw the ones before it, as if committed one by one
        for c in range(conversations):
            versions = [r.version for i, r in enumerate(results) if i % conversations == c]
            assert versions == list(range(1, len(versions) + 1))
        assert found == []  # accepted inputs are not settled yet: nothing to find
        assert isinstance(invalid, AgentRecordValidationError)
    async with create_sqlite_agent_runtime_store(filename=db) as again:
        for c in range(conversations):
            active = await again.store.list_active_runs(conversation_id=f"c{c}")
            assert len(active.runs) == len(range(c, n, conversations))


async def test_a_failing_operation_leaves_no_trace_and_its_batch_commits(db: Path) -> None:
    async with create_sqlite_agent_runtime_store(filename=db) as sqlite:
        store, driver = sqlite.store, sqlite.driver
        assert (await store.purge_conversation(conversation_id="purged")).outcome == "purged"
        async with Gate(driver):
            transactions = driver.transactions
            tasks = queue(
                accept(store, "c1", "k1"),
                driver.run(lambda: writes_then_raises("ghost"), access="write", stats=OperationStats()),
                accept(store, "c2", "k2"),
                driver.run(
                    lambda: writes_then_hits_the_purge_guard("phantom", "purged"),
                    access="write",
                    stats=OperationStats(),
                ),
                accept(store, "purged", "k3"),  # refused by the reducer: the conversation was purged
                accept(store, "c1", "k4"),
            )
        first, raised, second, guarded, refused, third = await settle(tasks)
        # the ghost fails after writing: its transaction is rolled back, and k1 (which wrote before it) and
        # the rest run in a second one, which the phantom ends the same way; the third commits the rest
        assert driver.transactions - transactions == 3
        assert isinstance(raised, RuntimeError)
        assert isinstance(guarded, AgentConversationPurgedError)
        assert isinstance(refused, AgentConversationPurgedError)
        assert [first.outcome, second.outcome, third.outcome] == ["accepted"] * 3
        assert third.version == first.version + 1
    assert heads_in(db) == {"c1", "c2"}  # no ghost, no phantom; the purged conversation stays purged
    async with create_sqlite_agent_runtime_store(filename=db) as again:
        assert len((await again.store.list_active_runs(conversation_id="c1")).runs) == 2
        assert len((await again.store.list_active_runs(conversation_id="c2")).runs) == 1
        assert (await again.store.load_snapshot(conversation_id="ghost")).version == 0


async def test_what_ran_after_the_first_write_runs_again_after_a_failed_write(db: Path) -> None:
    """An operation that fails after writing rolls its transaction back; the answers that came after the
    first write of that transaction (a read that saw it, and a conflict decided on it too) are void and
    the operations run again, in their order, counting their rows once; a read before any write stands."""
    async with create_sqlite_agent_runtime_store(filename=db) as sqlite:
        store, driver = sqlite.store, sqlite.driver
        await accept(store, "c", "k0")
        async with Gate(driver):
            transactions = driver.transactions
            tasks = queue(
                store.list_active_runs(conversation_id="c"),  # before any write: its answer stands
                accept(store, "c", "k1"),
                store.list_active_runs(conversation_id="c"),  # saw k1's uncommitted run
                accept(store, "c", "k1"),  # the same key again: a duplicate of the uncommitted admission
                driver.run(lambda: writes_then_raises("ghost"), access="write", stats=OperationStats()),
                accept(store, "c", "k2"),
            )
        before, first, seen, again, raised, second = await settle(tasks)
        assert driver.transactions - transactions == 2
        assert isinstance(raised, RuntimeError)
        assert len(before.runs) == 1 and len(seen.runs) == 2
        assert (first.outcome, again.outcome, second.outcome) == ("accepted", "duplicate", "accepted")
        assert again.run.id == first.run.id and (first.version, second.version) == (2, 3)
        stats = store.metrics["accept_input_and_assign_run"]
        # the rows of three admissions (head, run, input, receipt, ledger event), once each
        assert (stats.calls, stats.rows_written) == (4, 3 * 5)
    assert heads_in(db) == {"c"}


async def test_a_row_missing_behind_the_connection_is_written_again_whole(db: Path) -> None:
    """The driver rewrites the rows it remembers writing with an UPDATE; one that is not there (deleted on
    its own connection, so nothing told it) is upserted instead, never lost."""
    async with create_sqlite_agent_runtime_store(filename=db) as sqlite:
        store, driver = sqlite.store, sqlite.driver
        accepted = await accept(store, "c", "k1")
        started = RunOperation(kind="model-request", phase="started", operation_id="op", started_at=NOW)
        acquired = await store.acquire_run(
            conversation_id="c",
            run_id=accepted.run.id,
            expected_revision=accepted.run.revision,
            owner_id="o",
            operation=started,
        )
        conn = driver._rows.conn

        def delete_behind() -> None:
            for table in ("conversations", "runs", "messages"):
                conn.execute(f"DELETE FROM threadline_{table} WHERE conversation_id = 'c'")

        await driver._call(delete_behind)
        done = await store.checkpoint_run_assistant(
            conversation_id="c",
            run_id=acquired.run.id,
            expected_revision=acquired.run.revision,
            owner_id="o",
            fencing_token=acquired.run.fencing_token,
            parts=text("draft"),
        )
    async with create_sqlite_agent_runtime_store(filename=db) as again:
        loaded = await again.store.load_run(conversation_id="c", run_id=accepted.run.id)
        assert loaded is not None and loaded.run == done.run and loaded.version == done.version
        snapshot = await again.store.load_snapshot(conversation_id="c")
        assert [m.id for m in snapshot.messages] == [done.assistant.id]  # type: ignore[union-attr]
        assert snapshot.messages[0] == done.assistant
        # the lookup by answer id reads the column the upsert wrote
        with pytest.raises(AgentIdempotencyConflictError):
            await accept(again.store, "c", "k2", input_id=done.run.assistant_message_id)


async def test_a_search_in_a_batch_sees_what_the_operations_before_it_settled(db: Path) -> None:
    async with create_sqlite_agent_runtime_store(filename=db) as sqlite:
        store, driver = sqlite.store, sqlite.driver
        async with Gate(driver):
            transactions = driver.transactions
            writes = queue(
                store.seed_conversation_input(
                    conversation_id="c", seed_key="s", inputs=[{"id": "s1", "parts": text("a settled walrus")}]
                ),
                driver.run(
                    lambda: settles_then_raises("c", "a ghostly narwhal"), access="write", stats=OperationStats()
                ),
            )
            for _ in range(2):  # the writes reach the worker's queue (gathered for one loop iteration) first
                await asyncio.sleep(0)
            searches = queue(sqlite.search_messages("c", "walrus"), sqlite.search_messages("c", "narwhal"))
        seeded, raised, found, ghost = await settle(writes + searches)
        # the narwhal fails after writing: its transaction is rolled back, and the seed (written before it)
        # and the searches run again in a second one
        assert driver.transactions - transactions == 2
        assert seeded.outcome == "seeded", seeded
        assert isinstance(raised, RuntimeError)
        assert [m.id for m in found] == ["s1"]
        assert ghost == []  # rolled back with its transaction, index note included
        assert [m.id for m in await sqlite.search_messages("c", "walrus")] == ["s1"]
    conn = sqlite3.connect(db)
    try:  # every note was indexed before COMMIT: none is left behind
        assert conn.execute("SELECT count(*) FROM threadline_fts_queue").fetchone() == (0,)
        assert conn.execute("SELECT message_id FROM threadline_message_fts").fetchall() == [("s1",)]
    finally:
        conn.close()


async def test_rows_a_failed_operation_wrote_are_not_remembered(db: Path) -> None:
    """The driver remembers the rows it wrote (the next operation mostly reads them); a failed operation's
    rows are rolled back, and so forgotten, whether it ran alone or shared its transaction."""
    async with create_sqlite_agent_runtime_store(filename=db) as sqlite:
        store, driver = sqlite.store, sqlite.driver
        assert (await accept(store, "c", "k1")).version == 1
        with pytest.raises(RuntimeError):
            await driver.run(lambda: writes_then_raises("c", version=50), access="write", stats=OperationStats())
        assert (await accept(store, "c", "k2")).version == 2
        async with Gate(driver):
            tasks = queue(
                driver.run(lambda: writes_then_raises("c", version=60), access="write", stats=OperationStats()),
                accept(store, "c", "k3"),
            )
        raised, third = await settle(tasks)
        assert isinstance(raised, RuntimeError)
        assert third.version == 3
        assert [r.input_message_ids for r in (await store.list_active_runs(conversation_id="c")).runs] == [
            ("c:k1",),
            ("c:k2",),
            ("c:k3",),
        ]


async def test_what_another_connection_commits_is_seen_by_the_next_operation(db: Path) -> None:
    """Two handles on one file (two processes, say) taking turns on one conversation: neither writes over
    the other's rows with what it remembered writing itself."""
    async with (
        create_sqlite_agent_runtime_store(filename=db) as one,
        create_sqlite_agent_runtime_store(filename=db) as two,
    ):
        versions = []
        for k in range(6):
            store = (one, two)[k % 2].store
            versions.append((await accept(store, "c", f"k{k}")).version)
        assert versions == [1, 2, 3, 4, 5, 6]
        for handle in (one, two):
            snapshot = await handle.store.load_snapshot(conversation_id="c")
            assert snapshot.version == 6
            assert len((await handle.store.list_active_runs(conversation_id="c")).runs) == 6


async def test_a_read_operation_that_writes_still_fails(db: Path) -> None:
    async with create_sqlite_agent_runtime_store(filename=db) as sqlite:
        store, driver = sqlite.store, sqlite.driver
        with pytest.raises(AssertionError):  # alone in its transaction
            await driver.run(lambda: reads_then_writes("alone"), access="read", stats=OperationStats())
        async with Gate(driver):
            tasks = queue(
                accept(store, "c1", "k1"),
                driver.run(lambda: reads_then_writes("batched"), access="read", stats=OperationStats()),
                accept(store, "c2", "k2"),
            )
        first, wrote, second = await settle(tasks)
        assert isinstance(wrote, AssertionError)
        assert first.outcome == second.outcome == "accepted"
    assert heads_in(db) == {"c1", "c2"}


async def test_close_while_jobs_are_queued_runs_them_all(db: Path) -> None:
    sqlite = create_sqlite_agent_runtime_store(filename=db)
    n = 2 * sqlite.driver.max_batch + 5
    async with Gate(sqlite.driver):
        tasks = queue(*(accept(sqlite.store, f"c{i}", "k") for i in range(n)))
        await asyncio.sleep(0)  # the jobs are queued before the close
        closing = queue(sqlite.close())
    results = await settle(tasks)
    await settle(closing)
    assert all(not isinstance(r, BaseException) and r.outcome == "accepted" for r in results), results
    with pytest.raises(AgentStoreUnavailableError):
        await accept(sqlite.store, "late", "k")
    assert len(heads_in(db)) == n


async def test_write_lock_held_elsewhere_fails_the_writes_of_a_batch_and_not_its_reads(db: Path) -> None:
    async with create_sqlite_agent_runtime_store(filename=db) as sqlite:
        store, driver = sqlite.store, sqlite.driver
        await accept(store, "c1", "k1")
        holder = sqlite3.connect(db, isolation_level=None, timeout=0)
        try:
            holder.execute("BEGIN IMMEDIATE")
            async with Gate(driver):
                tasks = queue(
                    accept(store, "c2", "k2"),
                    store.list_active_runs(conversation_id="c1"),
                    accept(store, "c1", "k3"),
                    store.load_snapshot(conversation_id="c1"),
                )
            blocked, active, also_blocked, snapshot = await settle(tasks)
        finally:
            holder.execute("ROLLBACK")
            holder.close()
        assert isinstance(blocked, AgentStoreBusyError)
        assert isinstance(also_blocked, AgentStoreBusyError)
        assert len(active.runs) == 1
        assert snapshot.version == 1
        assert (await accept(store, "c2", "k2")).outcome == "accepted"  # released: nothing was half-applied
    assert heads_in(db) == {"c1", "c2"}


class FaultyConnection:
    """Forwards to the driver's connection, failing the chosen statements the way SQLite fails them."""

    def __init__(self, conn: sqlite3.Connection) -> None:
        self.conn = conn
        self.commits = 0
        self.fail_commit = 0  # the n-th COMMIT from now fails (0: none)
        self.abort_head_of: str | None = None  # writing this conversation's head aborts the transaction

    @staticmethod
    def error(name: str, code: int) -> sqlite3.OperationalError:
        error = sqlite3.OperationalError(f"{name} (injected by the test)")
        error.sqlite_errorcode = code  # type: ignore[attr-defined]
        error.sqlite_errorname = name  # type: ignore[attr-defined]
        return error

    def execute(self, sql: str, *args: Any) -> Any:
        if sql == "COMMIT":
            self.commits += 1
            if self.commits == self.fail_commit:
                raise self.error("SQLITE_IOERR", 10)
        head_insert = sql.startswith("INSERT INTO threadline_conversations")
        if head_insert and args and args[0][0] == self.abort_head_of:
            self.conn.execute("ROLLBACK")  # what SQLite may do on SQLITE_FULL: the whole transaction
            raise self.error("SQLITE_FULL", 13)
        return self.conn.execute(sql, *args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.conn, name)


@pytest.fixture
async def faulty(db: Path) -> Any:
    async with create_sqlite_agent_runtime_store(filename=db) as sqlite:
        rows = sqlite.driver._rows  # the fault is injected between the driver and SQLite
        real, cursor = rows.conn, rows.cur
        rows.conn = rows.cur = FaultyConnection(real)  # type: ignore[assignment]
        try:
            yield sqlite, rows.conn
        finally:
            rows.conn, rows.cur = real, cursor


async def test_a_failed_commit_fails_every_answer_that_depended_on_it(db: Path, faulty: Any) -> None:
    sqlite, conn = faulty
    store, driver = sqlite.store, sqlite.driver
    await accept(store, "c0", "k0")
    async with Gate(driver):
        conn.commits, conn.fail_commit = 0, 1  # the first transaction after the gate fails to commit
        tasks = queue(
            store.list_active_runs(conversation_id="c0"),  # read before any write: its answer stands
            accept(store, "c1", "k1"),
            store.load_snapshot(conversation_id="c1"),  # saw an uncommitted write: fails with it
            accept(store, "c2", "k2"),
        )
    before, first, snapshot, second = await settle(tasks)
    assert len(before.runs) == 1
    for failed in (first, snapshot, second):
        assert isinstance(failed, AgentStoreUnavailableError), failed
    assert (await store.load_snapshot(conversation_id="c1")).version == 0  # nothing of the batch is durable
    assert (await accept(store, "c1", "k1")).version == 1
    assert heads_in(db) == {"c0", "c1"}


async def test_a_transaction_sqlite_aborts_fails_what_ran_in_it_and_the_rest_runs_again(db: Path, faulty: Any) -> None:
    sqlite, conn = faulty
    store, driver = sqlite.store, sqlite.driver
    async with Gate(driver):
        transactions = driver.transactions
        conn.abort_head_of = "doomed"
        tasks = queue(accept(store, "c1", "k1"), accept(store, "doomed", "k"), accept(store, "c2", "k2"))
    lost, doomed, second = await settle(tasks)
    assert isinstance(lost, AgentStoreUnavailableError)  # its write went with the aborted transaction
    assert isinstance(doomed, AgentStoreUnavailableError)
    assert second.outcome == "accepted"  # it had not run yet: it got a transaction of its own
    assert driver.transactions - transactions == 2
    assert heads_in(db) == {"c2"}


async def test_a_cancelled_caller_s_queued_operation_may_still_commit(db: Path) -> None:
    async with create_sqlite_agent_runtime_store(filename=db) as sqlite:
        async with Gate(sqlite.driver):
            (task,) = queue(accept(sqlite.store, "c1", "k1"))
            await asyncio.sleep(0)  # handed to the worker
            task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        active = await sqlite.store.list_active_runs(conversation_id="c1")  # queued after it: runs after it
        assert len(active.runs) == 1


# ------------------------------------------------------------------------------ the idle fast path


def where_it_ran(threads: list[int]) -> Any:
    """A read operation that records the thread it runs on."""

    def operation() -> Generator[Any, Any, None]:
        yield LoadHead("probe")
        threads.append(threading.get_ident())

    return operation


def writes_a_head_on(cid: str, threads: list[int]) -> Any:
    def operation() -> Generator[Any, Any, None]:
        threads.append(threading.get_ident())
        yield Write(Mutation(head=head(cid)))

    return operation


async def test_with_the_worker_idle_an_operation_runs_on_the_calling_thread(db: Path) -> None:
    async with create_sqlite_agent_runtime_store(filename=db) as sqlite:
        driver, here = sqlite.driver, threading.get_ident()
        threads: list[int] = []
        inline = driver.inline_operations
        await driver.run(where_it_ran(threads), access="read", stats=OperationStats())
        await driver.run(writes_a_head_on("c1", threads), access="write", stats=OperationStats())
        assert threads == [here, here]
        assert driver.inline_operations - inline == 2
        async with Gate(driver):  # the worker holds the connection: the next operation is queued for it
            (task,) = queue(driver.run(where_it_ran(threads), access="read", stats=OperationStats()))
        await settle([task])
        assert threads[2] == driver._thread.ident != here
    assert heads_in(db) == {"c1"}  # the write committed like any other


async def test_with_synchronous_full_writes_always_go_to_the_worker(db: Path) -> None:
    async with create_sqlite_agent_runtime_store(filename=db, synchronous="FULL") as sqlite:
        driver, here = sqlite.driver, threading.get_ident()
        threads: list[int] = []
        await driver.run(writes_a_head_on("c1", threads), access="write", stats=OperationStats())
        await driver.run(where_it_ran(threads), access="read", stats=OperationStats())
        assert threads == [driver._thread.ident, here]  # an fsync per commit never blocks the event loop
    assert heads_in(db) == {"c1"}


async def test_a_second_connection_checkpoints_the_wal_every_so_many_write_transactions(db: Path) -> None:
    from threadline.store.sqlite import _CHECKPOINT_EVERY

    async with create_sqlite_agent_runtime_store(filename=db) as sqlite:
        driver = sqlite.driver
        size = db.stat().st_size
        for k in range(_CHECKPOINT_EVERY - 1):
            await accept(sqlite.store, f"c{k}", "k")
        assert driver.checkpoints == 0 and db.stat().st_size == size  # commits alone never checkpoint
        await accept(sqlite.store, "last", "k")
        assert await asyncio.to_thread(driver._checkpointer.wait_for, 1, WAIT)
        assert db.stat().st_size > size  # the committed pages were copied into the database file
    assert len(heads_in(db)) == _CHECKPOINT_EVERY


async def test_a_burst_of_operations_commits_together_on_the_calling_thread_when_the_worker_is_idle(
    db: Path,
) -> None:
    async with create_sqlite_agent_runtime_store(filename=db) as sqlite:
        driver = sqlite.driver
        transactions, inline = driver.transactions, driver.inline_operations
        results = await settle(queue(*(accept(sqlite.store, f"c{i}", "k") for i in range(10))))
        assert [r.outcome for r in results] == ["accepted"] * 10
        assert driver.inline_operations - inline == 10
        assert driver.transactions - transactions == 1  # started in one loop iteration: one commit


async def test_a_burst_larger_than_max_batch_takes_one_transaction_per_max_batch(db: Path) -> None:
    async with create_sqlite_agent_runtime_store(filename=db) as sqlite:
        driver = sqlite.driver
        driver.max_batch = 4
        transactions = driver.transactions
        results = await settle(queue(*(accept(sqlite.store, f"c{i}", "k") for i in range(10))))
        assert [r.outcome for r in results] == ["accepted"] * 10
        assert driver.transactions - transactions == 3
    assert len(heads_in(db)) == 10
