"""The PostgreSQL driver on a real server: migrations, schema ownership, durability, concurrent writers from
several pools, retries of serialization failures and deadlocks, a backend terminated mid-transaction, an
unreachable server, typed failures, and answers equal to the memory reference driver.

Every test works in its own schema (``threadline_test_<uuid>``), dropped afterwards. No verdict depends on
wall-clock timing (a generous ``wait_for`` only keeps a broken build from hanging).
"""

from __future__ import annotations

import asyncio
import random
import re
import subprocess
import sys
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

import pytest

from threadline.errors import (
    AgentConversationPurgedError,
    AgentIdempotencyConflictError,
    AgentRecordValidationError,
    AgentStoreBusyError,
    AgentStoreCorruptRecordError,
    AgentStoreSchemaError,
    AgentStoreUnavailableError,
)
from threadline.store import AgentRuntimeStore, MemoryStoreDriver, create_agent_runtime_store, reducer
from threadline.store.driver import OperationStats

psycopg = pytest.importorskip("psycopg")
pytest.importorskip("psycopg_pool")

from psycopg_pool import AsyncConnectionPool  # noqa: E402

# helpers shared with the SQLite integration tests (same directory; pytest puts it on sys.path)
from test_sqlite_store import Clock, Pair, _changes, _scenario, all_pages, text, turn  # noqa: E402

from threadline.store.postgres import (  # noqa: E402
    POSTGRES_SCHEMA_VERSION,
    PostgresAgentRuntimeStoreHandle,
    create_postgres_agent_runtime_store,
)

pytestmark = pytest.mark.postgres

OWNER = "owner-1"


# ------------------------------------------------------------------------------------------------ fixtures


def handle_for(dsn: str, schema: str, **kwargs: Any) -> PostgresAgentRuntimeStoreHandle:
    return create_postgres_agent_runtime_store(dsn, schema=schema, clock=kwargs.pop("clock", Clock()), **kwargs)


async def sql(dsn: str, statement: str, params: Any = None) -> list[tuple[Any, ...]]:
    """One autocommit statement on a connection of its own; the rows it returned (if any)."""
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        cur = await conn.execute(statement, params)
        return await cur.fetchall() if cur.description else []


async def admit(store: AgentRuntimeStore, cid: str, n: str, **kwargs: Any) -> Any:
    return await store.accept_input_and_assign_run(
        conversation_id=cid,
        idempotency_key=f"key-{n}",
        input={"id": f"{n}:in", "parts": text(f"input {n}")},
        run_id=f"{n}:run",
        assistant_message_id=f"{n}:out",
        **kwargs,
    )


class Rows:
    """Wraps the driver's row primitives of one transaction; ``hooks`` run before (or instead of) one."""

    def __init__(self, inner: Any, hooks: dict[str, Callable[[Any, Any], Awaitable[Any]]]) -> None:
        self.inner = inner
        self.hooks = hooks

    def __getattr__(self, name: str) -> Any:
        hook = self.hooks.get(name)
        method = getattr(self.inner, name)
        if hook is None:
            return method

        async def call(request: Any) -> Any:
            return await hook(self.inner, request)

        return call


async def raise_sqlstate(rows: Any, code: str) -> None:
    """Make the server itself report ``code`` on the driver's connection, inside its transaction."""
    await rows._fetch(f"DO $$ BEGIN RAISE EXCEPTION 'injected' USING ERRCODE = '{code}'; END $$", ())


# ---------------------------------------------------------------------------------------------- factory


def test_factory_validates_its_arguments(postgres_dsn: str) -> None:
    with pytest.raises(AgentRecordValidationError):
        create_postgres_agent_runtime_store()
    pool = AsyncConnectionPool(postgres_dsn, open=False)
    with pytest.raises(AgentRecordValidationError):
        create_postgres_agent_runtime_store(postgres_dsn, pool=pool)
    for bad in ("", "1abc", "a-b", 'x"; DROP', "pg_mine", "a" * 64, "sch ema"):
        with pytest.raises(AgentRecordValidationError) as caught:
            create_postgres_agent_runtime_store(postgres_dsn, schema=bad)
        assert caught.value.field == "schema"
    with pytest.raises(AgentRecordValidationError):
        create_postgres_agent_runtime_store("host=x port=5432 nonsense_option=1 =broken")
    with pytest.raises(AgentRecordValidationError):
        create_postgres_agent_runtime_store(pool=object())  # type: ignore[arg-type]
    with pytest.raises(AgentRecordValidationError):
        create_postgres_agent_runtime_store(postgres_dsn, min_size=5, max_size=2)


def test_importing_threadline_does_not_import_psycopg() -> None:
    code = "import threadline, threadline.store, threadline.store.sqlite, sys; assert 'psycopg' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_missing_extra_names_the_install_command() -> None:
    code = (
        "import sys; sys.modules['psycopg'] = None\n"
        "try:\n    import threadline.store.postgres\n"
        "except ImportError as e:\n    assert \"pip install 'threadline[postgres]'\" in str(e), e\n"
        "else:\n    raise SystemExit('imported without psycopg')\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# ------------------------------------------------------------------------------------------- migrations


async def test_migrations_are_idempotent(postgres_dsn: str, schema: str) -> None:
    for _ in range(3):
        async with handle_for(postgres_dsn, schema) as pg:
            await admit(pg.store, "c", "a")
    rows = await sql(postgres_dsn, f'SELECT key, value FROM "{schema}".threadline_meta')
    assert rows == [("schema_version", str(POSTGRES_SCHEMA_VERSION))]
    async with handle_for(postgres_dsn, schema) as pg:
        assert [r.id for r in (await pg.store.list_active_runs(conversation_id="c")).runs] == ["a:run"]


async def test_a_layout_1_schema_is_migrated_forward_and_keeps_everything(postgres_dsn: str, schema: str) -> None:
    """Layout 1 (threadline before runs were found by their answer id) gains the index and the ledger on
    open; its rows stay, and the new refusal works on them."""
    async with handle_for(postgres_dsn, schema) as pg:
        await turn(pg.store, "c", "t1")
    await sql(postgres_dsn, f'DROP INDEX "{schema}".threadline_runs_assistant')
    await sql(postgres_dsn, f'ALTER TABLE "{schema}".threadline_runs DROP COLUMN assistant_message_id')
    await sql(postgres_dsn, f'DROP TABLE "{schema}".threadline_events')  # and the ledger of layout 4
    heads = f'"{schema}".threadline_conversations'
    await sql(postgres_dsn, f"UPDATE {heads} SET body = (body::jsonb - 'event_seq')::text")
    await sql(postgres_dsn, f"UPDATE \"{schema}\".threadline_meta SET value = '1' WHERE key = 'schema_version'")
    async with handle_for(postgres_dsn, schema) as pg:
        (baseline,) = (await pg.store.read_events(conversation_id="c")).items  # the ledger begins at seq 1
        assert baseline.kind == "runtime/baseline"
        loaded = await pg.store.load_run(conversation_id="c", run_id="t1:run")
        assert loaded is not None and loaded.run.terminal_reason == "success"
        with pytest.raises(AgentIdempotencyConflictError):
            await pg.store.accept_input_and_assign_run(
                conversation_id="c",
                idempotency_key="clash",
                input={"id": loaded.run.assistant_message_id, "parts": [{"type": "text", "text": "x"}]},
            )
    rows = await sql(postgres_dsn, f'SELECT value FROM "{schema}".threadline_meta')
    assert rows == [(str(POSTGRES_SCHEMA_VERSION),)]
    indexes = await sql(
        postgres_dsn,
        "SELECT indexname FROM pg_indexes WHERE schemaname = %s AND indexname = %s",
        (schema, "threadline_runs_assistant"),
    )
    assert indexes == [("threadline_runs_assistant",)]


async def test_concurrent_opens_agree_on_one_schema(postgres_dsn: str, schema: str) -> None:
    handles = [handle_for(postgres_dsn, schema) for _ in range(4)]
    try:
        await asyncio.wait_for(asyncio.gather(*(h.open() for h in handles)), timeout=60)
        results = await asyncio.gather(*(admit(h.store, f"c{i}", f"a{i}") for i, h in enumerate(handles)))
        assert [r.outcome for r in results] == ["accepted"] * 4
    finally:
        for h in handles:
            await h.close()
    rows = await sql(postgres_dsn, f'SELECT count(*) FROM "{schema}".threadline_meta')
    assert rows == [(1,)]


async def test_unknown_future_version_is_refused(postgres_dsn: str, schema: str) -> None:
    async with handle_for(postgres_dsn, schema):
        pass
    await sql(postgres_dsn, f"UPDATE \"{schema}\".threadline_meta SET value = '99' WHERE key = 'schema_version'")
    handle = handle_for(postgres_dsn, schema)
    with pytest.raises(AgentStoreSchemaError, match="99"):
        await handle.open()
    await handle.close()
    with pytest.raises(AgentStoreSchemaError):
        async with handle_for(postgres_dsn, schema):
            pass


@pytest.mark.parametrize("damage", ["drop_table", "drop_index", "drop_trigger", "no_meta_row", "no_meta_table"])
async def test_partial_schema_is_refused(postgres_dsn: str, schema: str, damage: str) -> None:
    async with handle_for(postgres_dsn, schema):
        pass
    statement = {
        "drop_table": f'DROP TABLE "{schema}".threadline_seeds',
        "drop_index": f'DROP INDEX "{schema}".threadline_messages_settled',
        "drop_trigger": f'DROP TRIGGER threadline_runs_purged_guard ON "{schema}".threadline_runs',
        "no_meta_row": f'DELETE FROM "{schema}".threadline_meta',
        "no_meta_table": f'DROP TABLE "{schema}".threadline_meta',
    }[damage]
    await sql(postgres_dsn, statement)
    with pytest.raises(AgentStoreSchemaError):
        async with handle_for(postgres_dsn, schema):
            pass


async def test_only_threadline_objects_in_the_schema(postgres_dsn: str, schema: str) -> None:
    before = await sql(postgres_dsn, "SELECT count(*) FROM pg_class WHERE relname LIKE 'threadline%%'")
    async with handle_for(postgres_dsn, schema) as pg:
        await turn(pg.store, "c", "t1")
    relations = await sql(
        postgres_dsn,
        "SELECT c.relname, c.relkind FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
        "WHERE n.nspname = %s",
        (schema,),
    )
    functions = await sql(
        postgres_dsn,
        "SELECT p.proname FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace WHERE n.nspname = %s",
        (schema,),
    )
    names = [name for name, _ in relations] + [name for (name,) in functions]
    assert names and all(name.startswith("threadline_") for name in names), names
    tables = sorted(name for name, kind in relations if kind == "r")
    assert tables == [
        "threadline_admissions",
        "threadline_conversations",
        "threadline_events",
        "threadline_messages",
        "threadline_meta",
        "threadline_runs",
        "threadline_seeds",
        "threadline_tombstones",
    ]
    # nothing outside the schema: every threadline relation created since lives in it
    after = await sql(postgres_dsn, "SELECT count(*) FROM pg_class WHERE relname LIKE 'threadline%%'")
    assert after[0][0] - before[0][0] == sum(1 for name, kind in relations if name.startswith("threadline"))


async def test_application_objects_in_other_schemas_untouched(postgres_dsn: str, schema: str) -> None:
    app = f"{schema}_app"
    try:
        await sql(postgres_dsn, f'CREATE SCHEMA "{app}"')
        await sql(postgres_dsn, f'CREATE TABLE "{app}".threadline_runs (id int)')  # same name, other schema
        async with handle_for(postgres_dsn, schema) as pg:
            await turn(pg.store, "c", "t1")
        assert await sql(postgres_dsn, f'SELECT count(*) FROM "{app}".threadline_runs') == [(0,)]
    finally:
        await sql(postgres_dsn, f'DROP SCHEMA IF EXISTS "{app}" CASCADE')


# ------------------------------------------------------------------------------------------- durability


async def test_durable_across_close_and_reopen(postgres_dsn: str, schema: str) -> None:
    async with handle_for(postgres_dsn, schema) as pg:
        assert pg.conversations is pg.store.conversations
        store = pg.store
        await store.seed_conversation_input(
            conversation_id="c", seed_key="lead", inputs=[{"id": "sys", "role": "system", "parts": text("be brief")}]
        )
        await turn(store, "c", "t1")
        await admit(store, "c", "q")
        before = (
            await store.load_run(conversation_id="c", run_id="t1:run"),
            await store.load_snapshot(conversation_id="c"),
            await all_pages(store, "c", limit=2),
            await store.list_active_runs(conversation_id="c"),
            await store.scan_recoverable(),
            await store.conversations.list(),
        )
    with pytest.raises(AgentStoreUnavailableError):
        await store.load_run(conversation_id="c", run_id="t1:run")

    async with handle_for(postgres_dsn, schema) as pg:
        store = pg.store
        after = (
            await store.load_run(conversation_id="c", run_id="t1:run"),
            await store.load_snapshot(conversation_id="c"),
            await all_pages(store, "c", limit=2),
            await store.list_active_runs(conversation_id="c"),
            await store.scan_recoverable(),
            await store.conversations.list(),
        )
        assert after == before
        dup = await store.accept_input_and_assign_run(
            conversation_id="c", idempotency_key="key-t1", input={"id": "t1:in", "parts": text("question t1")}
        )
        assert dup.outcome == "duplicate" and dup.answer == before[0].assistant


async def test_a_pool_passed_in_stays_open(postgres_dsn: str, schema: str) -> None:
    async with AsyncConnectionPool(postgres_dsn, min_size=1, max_size=2, open=False) as pool:
        async with create_postgres_agent_runtime_store(pool=pool, schema=schema) as pg:
            await turn(pg.store, "c", "t1")
            assert pg.driver.pool is pool
        assert not pool.closed
        async with pool.connection() as conn:
            assert conn.autocommit is False  # the store borrowed it in autocommit mode and restored it
            cur = await conn.execute(f'SELECT count(*) FROM "{schema}".threadline_runs')
            assert await cur.fetchone() == (1,)


async def test_a_pool_not_yet_open_is_a_typed_error(postgres_dsn: str, schema: str) -> None:
    pool = AsyncConnectionPool(postgres_dsn, open=False)
    handle = create_postgres_agent_runtime_store(pool=pool, schema=schema)
    with pytest.raises(AgentStoreUnavailableError, match="not open"):
        await handle.open()
    await handle.close()


async def test_operations_before_open_and_after_close_are_unavailable(postgres_dsn: str, schema: str) -> None:
    handle = handle_for(postgres_dsn, schema)
    with pytest.raises(AgentStoreUnavailableError, match="not open"):
        await admit(handle.store, "c", "a")
    await handle.open()
    await handle.open()  # idempotent
    await admit(handle.store, "c", "a")
    await handle.close()
    await handle.close()  # idempotent
    with pytest.raises(AgentStoreUnavailableError, match="closed"):
        await admit(handle.store, "c", "b")
    with pytest.raises(AgentStoreUnavailableError):
        await handle.open()


async def test_close_waits_for_operations_in_flight(postgres_dsn: str, schema: str) -> None:
    pg = await handle_for(postgres_dsn, schema).open()
    tasks = [asyncio.create_task(admit(pg.store, "c", f"a{i}")) for i in range(10)]
    await asyncio.sleep(0)
    await pg.close()
    results = await asyncio.gather(*tasks)
    assert sorted(r.version for r in results) == list(range(1, 11))


async def test_cancelled_callers_leave_whole_operations_and_a_usable_store(postgres_dsn: str, schema: str) -> None:
    async with handle_for(postgres_dsn, schema, max_size=3) as pg:
        store = pg.store
        for round_ in range(10):
            tasks = [asyncio.create_task(admit(store, "c", f"r{round_}-{i}")) for i in range(6)]
            for _ in range(round_):
                await asyncio.sleep(0)  # cancel at a different point of the transactions each round
            await asyncio.sleep(0.0008 * round_)
            for task in tasks[::2]:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        snapshot = await store.load_snapshot(conversation_id="c")
        # every admission is whole or absent: its input message, its run and its receipt together
        runs = {r.id for r in snapshot.runs}
        inputs = {m.id for m in snapshot.messages}
        assert {i.removesuffix(":in") for i in inputs} == {r.removesuffix(":run") for r in runs}
        assert snapshot.version == len(runs)
        for run_id in runs:
            n = run_id.removesuffix(":run")
            dup = await admit(store, "c", n)
            assert dup.outcome == "duplicate"
        assert (await admit(store, "c", "after")).outcome == "accepted"


# ------------------------------------------------------------------------------------------ concurrency


async def test_concurrent_writers_from_two_pools_lose_no_update(postgres_dsn: str, schema: str) -> None:
    one, two = handle_for(postgres_dsn, schema, max_size=5), handle_for(postgres_dsn, schema, max_size=5)
    async with one, two:
        results = await asyncio.wait_for(
            asyncio.gather(*(admit((one if i % 2 else two).store, "shared", f"a{i}") for i in range(20))), timeout=120
        )
        assert [r.outcome for r in results] == ["accepted"] * 20
        versions = sorted(r.version for r in results)
        assert versions == list(range(1, 21)), versions
        by_version = sorted(results, key=lambda r: r.version)
        assert [r.run.admission_sequence for r in by_version] == list(range(1, 21))
        snapshot = await one.store.load_snapshot(conversation_id="shared")
        assert snapshot.version == 20
        assert [m.id for m in snapshot.messages] == [r.receipt.input.id for r in by_version]
        active = await two.store.list_active_runs(conversation_id="shared")
        assert [r.id for r in active.runs] == [r.run.id for r in by_version]
        # coalescing from both pools at once: every input lands once, in one successor, in commit order
        coalesced = await asyncio.gather(
            *(admit((one if i % 2 else two).store, "coalesce", f"b{i}", coalesce=True) for i in range(12))
        )
        successor = {r.run.id for r in coalesced}
        assert len(successor) == 1
        loaded = await one.store.load_run(conversation_id="coalesce", run_id=successor.pop())
        assert loaded is not None
        ordered = sorted(coalesced, key=lambda r: r.version)
        assert list(loaded.run.input_message_ids) == [r.receipt.input.id for r in ordered]
        # racing acquires of one run from two pools: exactly one wins
        head = by_version[0].run
        raced = await asyncio.gather(
            *(
                h.store.acquire_run(conversation_id="shared", run_id=head.id, expected_revision=1, owner_id=f"o{i}")
                for i, h in enumerate((one, two, one, two))
            ),
            return_exceptions=True,
        )
        wins = [r for r in raced if not isinstance(r, BaseException)]
        assert len(wins) == 1, raced
    assert one.driver.retries == 0 and two.driver.retries == 0  # writers queue on the lock: nothing to retry


# --------------------------------------------------------------------------------------------- retries


async def test_serialization_failure_after_reads_is_retried_through_the_store(postgres_dsn: str, schema: str) -> None:
    async with handle_for(postgres_dsn, schema) as pg:
        await admit(pg.store, "c", "a")
        injected = []

        async def fail_once(rows: Any, request: Any) -> Any:
            if not injected:  # the operation has read the head: only a fresh generator can start again
                injected.append(request)
                await raise_sqlstate(rows, "40001")
            return await rows.load_receipt(request)

        pg.driver.rows_wrapper = lambda rows: Rows(rows, {"load_receipt": fail_once})
        seen: list[Any] = []
        pg.store.observe(seen.append)
        result = await admit(pg.store, "c", "b")
        pg.driver.rows_wrapper = None
        assert result.outcome == "accepted" and result.version == 2
        assert pg.driver.retries == 1 and len(injected) == 1
        metrics = pg.store.metrics["accept_input_and_assign_run"]
        assert metrics.by_request["LoadHead"] == 2  # one per call: the failed attempt is not counted
        assert len(seen) == 1  # observers hear the committed write once
        active = await pg.store.list_active_runs(conversation_id="c")
        assert [r.id for r in active.runs] == ["a:run", "b:run"]


async def test_serialization_failure_at_commit_is_retried_through_the_store(postgres_dsn: str, schema: str) -> None:
    fault = f"{schema}_fault"
    await sql(postgres_dsn, f'CREATE SCHEMA "{fault}"')
    try:
        await sql(postgres_dsn, f'CREATE TABLE "{fault}".f (x int)')
        await sql(
            postgres_dsn,
            f'CREATE FUNCTION "{fault}".fail() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN '
            "RAISE EXCEPTION 'injected at commit' USING ERRCODE = '40001'; END $$",
        )
        await sql(
            postgres_dsn,
            f'CREATE CONSTRAINT TRIGGER fail AFTER INSERT ON "{fault}".f DEFERRABLE INITIALLY DEFERRED '
            f'FOR EACH ROW EXECUTE FUNCTION "{fault}".fail()',
        )
        async with handle_for(postgres_dsn, schema) as pg:
            attempts = []

            async def write_then_fail_at_commit(rows: Any, request: Any) -> Any:
                attempts.append(request)
                await rows.write(request)
                if len(attempts) == 1:  # travels with the writes; its deferred trigger fails the COMMIT
                    rows.pending.append(f'INSERT INTO "{fault}".f VALUES (1)')
                return None

            pg.driver.rows_wrapper = lambda rows: Rows(rows, {"write": write_then_fail_at_commit})
            result = await pg.store.seed_conversation_input(
                conversation_id="c", seed_key="s", inputs=[{"id": "s1", "role": "system", "parts": text("hi")}]
            )
            pg.driver.rows_wrapper = None
            assert result.outcome == "seeded" and result.version == 1
            assert len(attempts) == 2 and pg.driver.retries == 1
            snapshot = await pg.store.load_snapshot(conversation_id="c")
            assert [m.id for m in snapshot.messages] == ["s1"] and snapshot.version == 1
    finally:
        await sql(postgres_dsn, f'DROP SCHEMA IF EXISTS "{fault}" CASCADE')


async def test_a_transaction_that_always_loses_is_busy_and_writes_nothing(postgres_dsn: str, schema: str) -> None:
    async with handle_for(postgres_dsn, schema) as pg:
        calls = []

        async def always(rows: Any, request: Any) -> Any:
            calls.append(request)
            await raise_sqlstate(rows, "40P01")

        pg.driver.rows_wrapper = lambda rows: Rows(rows, {"load_receipt": always})
        pg.driver.max_attempts = 3
        with pytest.raises(AgentStoreBusyError, match="3 time"):
            await admit(pg.store, "c", "a")
        pg.driver.rows_wrapper = None
        assert len(calls) == 3
        assert (await pg.store.list_active_runs(conversation_id="c")).version == 0


async def test_a_bare_generator_is_retried_only_before_its_first_answer(postgres_dsn: str, schema: str) -> None:
    async with handle_for(postgres_dsn, schema) as pg:
        injected = []

        async def deadlock_once(rows: Any, request: Any) -> Any:
            if not injected:
                injected.append(request)
                await raise_sqlstate(rows, "40P01")
            return await rows.load_head(request)

        pg.driver.rows_wrapper = lambda rows: Rows(rows, {"load_head": deadlock_once})
        result = await pg.driver.run(_accept_operation("a"), access="write", stats=OperationStats())
        assert result.outcome == "accepted" and pg.driver.retries == 1

        async def always(rows: Any, request: Any) -> Any:
            await raise_sqlstate(rows, "40001")

        pg.driver.rows_wrapper = lambda rows: Rows(rows, {"load_receipt": always})
        with pytest.raises(AgentStoreBusyError, match="1 time"):  # it had read the head: not rewindable
            await pg.driver.run(_accept_operation("b"), access="write", stats=OperationStats())
        pg.driver.rows_wrapper = None
        assert pg.driver.retries == 1
        assert (await pg.store.list_active_runs(conversation_id="c")).version == 1


def _accept_operation(n: str) -> Any:
    return reducer.accept_input_and_assign_run(
        conversation_id="c",
        idempotency_key=f"key-{n}",
        input=_draft(n),
        run_id=f"{n}:run",
        assistant_message_id=f"{n}:out",
        now=Clock()(),
    )


def _draft(n: str, role: str = "user") -> Any:
    from threadline.records import MessageDraft

    return MessageDraft.model_validate({"id": n, "role": role, "parts": text(f"input {n}")})


# ---------------------------------------------------------------------------------- connection failures


async def _terminate(dsn: str, pid: int) -> None:
    await sql(dsn, "SELECT pg_terminate_backend(%s)", (pid,))
    for _ in range(500):
        if not await sql(dsn, "SELECT 1 FROM pg_stat_activity WHERE pid = %s", (pid,)):
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"backend {pid} did not end")


async def test_backend_terminated_mid_transaction_leaves_no_partial_state(postgres_dsn: str, schema: str) -> None:
    async with handle_for(postgres_dsn, schema, min_size=1, max_size=2) as pg:
        store = pg.store
        await turn(store, "c", "t1")
        before = await store.load_snapshot(conversation_id="c")
        paused, resume = asyncio.Event(), asyncio.Event()
        pids: list[int] = []

        async def write_then_pause(rows: Any, request: Any) -> Any:
            await rows.write(request)
            # the writes reach the server (uncommitted) together with this query
            pids.append((await rows._fetch("SELECT pg_backend_pid()", ()))[0][0])
            paused.set()
            await resume.wait()
            return None

        pg.driver.rows_wrapper = lambda rows: Rows(rows, {"write": write_then_pause})
        task = asyncio.create_task(admit(store, "c", "a"))
        await asyncio.wait_for(paused.wait(), timeout=30)
        pg.driver.rows_wrapper = None
        # the uncommitted admission holds its rows; no other transaction sees them
        assert await sql(postgres_dsn, f'SELECT count(*) FROM "{schema}".threadline_runs') == [(1,)]
        await _terminate(postgres_dsn, pids[0])
        resume.set()
        with pytest.raises(AgentStoreUnavailableError) as caught:
            await asyncio.wait_for(task, timeout=30)
        assert isinstance(caught.value.__cause__, psycopg.OperationalError)
        assert pg.driver.where in str(caught.value)

        assert await store.load_snapshot(conversation_id="c") == before
        assert await store.load_run(conversation_id="c", run_id="a:run") is None
        # the store works afterwards, and the refused admission can be retried
        again = await admit(store, "c", "a")
        assert again.outcome == "accepted" and again.version == before.version + 1


async def test_backend_terminated_during_a_read_is_unavailable(postgres_dsn: str, schema: str) -> None:
    async with handle_for(postgres_dsn, schema, min_size=1, max_size=1) as pg:
        await turn(pg.store, "c", "t1")
        paused, resume = asyncio.Event(), asyncio.Event()
        pids: list[int] = []

        async def pause(rows: Any, request: Any) -> Any:
            pids.append(rows.cur.connection.info.backend_pid)
            paused.set()
            await resume.wait()
            return await rows.load_messages(request)

        pg.driver.rows_wrapper = lambda rows: Rows(rows, {"load_messages": pause})
        task = asyncio.create_task(pg.store.load_run(conversation_id="c", run_id="t1:run"))
        await asyncio.wait_for(paused.wait(), timeout=30)
        pg.driver.rows_wrapper = None
        await _terminate(postgres_dsn, pids[0])
        resume.set()
        with pytest.raises(AgentStoreUnavailableError):
            await asyncio.wait_for(task, timeout=30)
        loaded = await pg.store.load_run(conversation_id="c", run_id="t1:run")  # the pool replaced the connection
        assert loaded is not None and loaded.run.state == "completed"


async def test_idle_pooled_connection_dropped_by_the_server_is_replaced(postgres_dsn: str, schema: str) -> None:
    async with handle_for(postgres_dsn, schema, min_size=1, max_size=1) as pg:
        await admit(pg.store, "c", "a")
        assert pg.driver.pool is not None
        async with pg.driver.pool.connection() as conn:
            pid = conn.info.backend_pid
        await _terminate(postgres_dsn, pid)
        result = await admit(pg.store, "c", "b")
        assert result.outcome == "accepted" and result.version == 2
        assert pg.driver.retries == 1


async def test_unreachable_server_is_unavailable_quickly(schema: str) -> None:
    handle = create_postgres_agent_runtime_store("postgresql://postgres@127.0.0.1:1/test", schema=schema)
    with pytest.raises(AgentStoreUnavailableError, match=re.escape("127.0.0.1:1")):
        await asyncio.wait_for(handle.open(), timeout=30)
    with pytest.raises(AgentStoreUnavailableError):
        await admit(handle.store, "c", "a")
    await handle.close()
    with pytest.raises(AgentStoreUnavailableError, match=re.escape("127.0.0.1:1")):
        async with create_postgres_agent_runtime_store("host=127.0.0.1 port=1 dbname=test", schema=schema):
            pass


# ------------------------------------------------------------------------------------- records and guards


async def test_malformed_and_foreign_rows_are_corrupt_records(postgres_dsn: str, schema: str) -> None:
    async with handle_for(postgres_dsn, schema) as pg:
        await turn(pg.store, "c", "t1")
        await turn(pg.store, "c", "t2")
        runs = f'"{schema}".threadline_runs'
        await sql(
            postgres_dsn,
            f"UPDATE {runs} SET body = (SELECT body FROM {runs} WHERE run_id = 't2:run') WHERE run_id = 't1:run'",
        )
        with pytest.raises(AgentStoreCorruptRecordError, match="t1:run"):
            await pg.store.load_run(conversation_id="c", run_id="t1:run")
        await sql(
            postgres_dsn, f"UPDATE \"{schema}\".threadline_messages SET body = '{{nope' WHERE message_id = 't2:out'"
        )
        with pytest.raises(AgentStoreCorruptRecordError, match="t2:out"):
            await pg.store.load_snapshot(conversation_id="c")
        await sql(postgres_dsn, f"UPDATE \"{schema}\".threadline_conversations SET body = '[]'")
        with pytest.raises(AgentStoreCorruptRecordError, match="threadline_conversations"):
            await admit(pg.store, "c", "t3")


async def test_purge_guard_refuses_rows_for_a_tombstoned_conversation(postgres_dsn: str, schema: str) -> None:
    async with handle_for(postgres_dsn, schema) as pg:
        await turn(pg.store, "c", "t1")
        assert (await pg.store.purge_conversation(conversation_id="c")).outcome == "purged"
        for table, columns, values in (
            ("threadline_conversations", "conversation_id, version, body", "'c', 1, '{}'"),
            ("threadline_runs", "conversation_id, run_id, active, version, body", "'c', 'r', true, 1, '{}'"),
            ("threadline_seeds", "conversation_id, seed_key, body", "'c', 's', '{}'"),
        ):
            with pytest.raises(psycopg.Error) as caught:
                await sql(postgres_dsn, f'INSERT INTO "{schema}".{table} ({columns}) VALUES ({values})')
            assert caught.value.sqlstate == "TLP01"
        with pytest.raises(AgentConversationPurgedError):
            await admit(pg.store, "c", "t2")
        # a tombstone written behind the store is respected
        await turn(pg.store, "d", "t1")
        await sql(postgres_dsn, f"INSERT INTO \"{schema}\".threadline_tombstones (conversation_id) VALUES ('d')")
        with pytest.raises(AgentConversationPurgedError):
            await admit(pg.store, "d", "t2")
        assert (await pg.store.scan_recoverable()).runs == ()


async def test_a_write_that_missed_the_tombstone_is_refused_by_the_trigger(postgres_dsn: str, schema: str) -> None:
    async with handle_for(postgres_dsn, schema) as pg:
        await turn(pg.store, "c", "t1")

        async def tombstone_behind(rows: Any, request: Any) -> Any:
            state = await rows.load_head(request)
            rows.pending.append(f"INSERT INTO \"{schema}\".threadline_tombstones (conversation_id) VALUES ('c')")
            return state  # the operation believes the conversation is live

        pg.driver.rows_wrapper = lambda rows: Rows(rows, {"load_head": tombstone_behind})
        with pytest.raises(AgentConversationPurgedError):
            await admit(pg.store, "c", "t2")
        pg.driver.rows_wrapper = None
        assert await sql(postgres_dsn, f'SELECT count(*) FROM "{schema}".threadline_tombstones') == [(0,)]


# ----------------------------------------------------------------------------- differential vs memory


async def test_postgres_answers_like_the_memory_reference(postgres_dsn: str, schema: str) -> None:
    memory = create_agent_runtime_store(MemoryStoreDriver(), clock=Clock())
    async with handle_for(postgres_dsn, schema) as pg:
        try:
            await _scenario(Pair(memory, pg.store))
        finally:
            await memory.aclose()


@pytest.mark.parametrize("seed", [1, 2, 3, 4])
async def test_random_operations_answer_like_the_memory_reference(postgres_dsn: str, schema: str, seed: int) -> None:
    memory = create_agent_runtime_store(MemoryStoreDriver(), clock=Clock())
    async with handle_for(postgres_dsn, schema) as pg:
        try:
            await _random_scenario(Pair(memory, pg.store), random.Random(seed), steps=80)
        finally:
            await memory.aclose()


async def _random_scenario(both: Pair, rng: random.Random, steps: int) -> None:
    """A seeded random walk of mutations and reads over three conversations; every answer (and every
    error's type and message) must be equal on both stores."""
    cids = ["conv-a", "conv-b", "conv-ü"]
    for step in range(1, steps + 1):
        await _random_step(both, rng, rng.choice(cids), f"x{step}", step)
    for cid in cids:
        await both(lambda s, c=cid: s.load_snapshot(conversation_id=c))  # type: ignore[misc]
        await both(lambda s, c=cid: all_pages(s, c, limit=2, include_compacted=True))  # type: ignore[misc]
    await both(lambda s: _scan_all(s, 2))
    await both(lambda s: s.conversations.list(limit=2))


async def _scan_all(store: AgentRuntimeStore, limit: int) -> list[Any]:
    pages, cursor = [], None
    while True:
        page = await store.scan_recoverable(cursor=cursor, limit=limit)
        pages.append(page)
        if page.next_cursor is None:
            return pages
        cursor = page.next_cursor


async def _random_step(both: Pair, rng: random.Random, cid: str, n: str, step: int) -> None:
    """One random operation on ``cid``; its arguments come from the (equal) snapshot both stores hold."""
    snap = await both(lambda s: s.load_snapshot(conversation_id=cid))
    active = [r for r in snap.runs if r.active]
    running = [r for r in active if r.acquired]
    queued = [r for r in active if r.state == "queued"]
    choice = rng.random()
    call: Callable[[AgentRuntimeStore], Awaitable[Any]] | None = None
    if choice < 0.25:
        kwargs: dict[str, Any] = {}
        if rng.random() < 0.3:
            kwargs["coalesce"] = True
        if rng.random() < 0.2:
            kwargs.update(priority="urgent", input_policy="interrupt-next")
        key = n if rng.random() < 0.85 else f"x{rng.randint(1, step)}"  # sometimes a repeated key
        call = partial(
            _accept,
            conversation_id=cid,
            idempotency_key=f"key-{key}",
            input={"id": f"{key}:in", "parts": text(f"input {key}")},
            run_id=f"{n}:run",
            assistant_message_id=f"{n}:out",
            **kwargs,
        )
    elif choice < 0.45 and queued:
        # mostly the run next in execution order (acquirable), sometimes any queued run (an order conflict)
        run = reducer.execution_order(queued)[0] if rng.random() < 0.8 else rng.choice(queued)

        def call(s: AgentRuntimeStore) -> Awaitable[Any]:
            return s.acquire_run(conversation_id=cid, run_id=run.id, expected_revision=run.revision, owner_id=OWNER)

    elif choice < 0.57 and running:
        run = rng.choice(running)
        token = run.fencing_token if rng.random() < 0.9 else run.fencing_token + 1

        def call(s: AgentRuntimeStore) -> Awaitable[Any]:
            return s.checkpoint_run_assistant(
                conversation_id=cid,
                run_id=run.id,
                expected_revision=run.revision,
                owner_id=OWNER,
                fencing_token=token,
                parts=text(f"draft {n}"),
            )

    elif choice < 0.75 and running:
        run = rng.choice(running)
        reason = rng.choice(["success", "interrupted", "provider_failure", "cancelled"])
        absorb = [
            {"run_id": q.id, "expected_revision": q.revision, "input_message_ids": list(q.input_message_ids)}
            for q in queued
            if rng.random() < 0.3 and reason == "success"
        ]

        def call(s: AgentRuntimeStore) -> Awaitable[Any]:
            return s.commit_run_terminal(
                conversation_id=cid,
                run_id=run.id,
                expected_revision=run.revision,
                owner_id=OWNER,
                fencing_token=run.fencing_token,
                terminal_reason=reason,
                parts=text(f"answer {n}"),
                absorb=absorb,
            )

    elif choice < 0.79 and active:
        run = rng.choice(active)

        def call(s: AgentRuntimeStore) -> Awaitable[Any]:
            return s.request_run_interrupt(conversation_id=cid, run_id=run.id)

    elif choice < 0.83 and running:
        run = rng.choice(running)
        action = rng.choice(["requeue", "abandon"])

        def call(s: AgentRuntimeStore) -> Awaitable[Any]:
            return s.recover_run(
                conversation_id=cid,
                run_id=run.id,
                expected_revision=run.revision,
                action=action,  # type: ignore[arg-type]
                replay_safe=True,
                stale_owner=True,
            )

    elif choice < 0.89:
        settled = [m for m in snap.messages if m.position is not None and m.band == "history"]
        if len(settled) >= 2:
            lo = rng.randrange(len(settled) - 1)
            ids = [m.id for m in settled[lo : lo + rng.randint(1, 3)]]

            def call(s: AgentRuntimeStore) -> Awaitable[Any]:
                return s.replace_compacted_range(
                    conversation_id=cid,
                    expected_version=snap.version,
                    replaced_message_ids=ids,
                    summary={"id": f"{n}:sum", "role": "summary", "parts": text("summary")},
                )

    elif choice < 0.93:
        placement = rng.choice(["lead", "after-settled"])
        second = {"id": f"{n}:seed2", "role": "system" if placement == "lead" else "assistant", "parts": text("s2")}

        def call(s: AgentRuntimeStore) -> Awaitable[Any]:
            return s.seed_conversation_input(
                conversation_id=cid,
                seed_key=f"seed-{n}",
                placement=placement,  # type: ignore[arg-type]
                inputs=[{"id": f"{n}:seed", "role": "user", "parts": text("seed")}, second],
            )

    elif choice < 0.945:

        def call(s: AgentRuntimeStore) -> Awaitable[Any]:
            return s.purge_conversation(conversation_id=cid)

    else:
        include = rng.random() < 0.5
        limit = rng.choice([1, 3])
        direction = rng.choice(["after", "before"])

        def call(s: AgentRuntimeStore) -> Awaitable[Any]:
            return all_pages(s, cid, limit=limit, direction=direction, include_compacted=include)

    if call is not None:
        await both(call)
    if rng.random() < 0.3:
        since = max(0, snap.version - rng.randint(0, 3))
        await both(lambda s: _changes(s, cid, since))


def _accept(store: AgentRuntimeStore, **kwargs: Any) -> Awaitable[Any]:
    return store.accept_input_and_assign_run(**kwargs)


# --------------------------------------------------------------------------------------------- literals


@pytest.mark.parametrize("standard_conforming_strings", ["on", "off"])
async def test_literals_quote_exactly_like_libpq_and_read_back_unchanged(
    postgres_dsn: str, standard_conforming_strings: str
) -> None:
    """Statements carry their values as SQL literals. Plain ASCII without quotes or backslashes is quoted
    by the driver itself; everything else by libpq. Either way the server reads back the very string."""
    from psycopg import pq

    from threadline.store.postgres._statements import Wire

    values = [
        "",
        "run_0f3a",
        '{"text": "a \\"quoted\\" word", "n": 1}',
        "it's",
        "back\\slash",
        "'",
        "\\'",
        "E'x'",
        "caf\u00e9 \u2603 \U0001f600",
        "line\nbreak\ttab",
        "x" * 70_000,
    ]
    async with await psycopg.AsyncConnection.connect(postgres_dsn, autocommit=True) as conn:
        await conn.execute(f"SET standard_conforming_strings TO {standard_conforming_strings}")
        wire, escape = Wire(conn), pq.Escaping(conn.pgconn).escape_literal
        for value in values:
            literal = wire.literal(value)
            assert literal == escape(value.encode()), value[:40]
            cur = await conn.execute(b"SELECT " + literal, prepare=False)
            assert (await cur.fetchone()) == (value,), value[:40]
        with pytest.raises(psycopg.DataError, match="NUL"):
            wire.literal("nul\x00byte")
