"""The SQLite driver on real files: durability, schema ownership, typed failures, busy, purge, search.

Behaviour only: no verdict here depends on wall-clock timing (a generous ``wait_for`` only keeps a broken
build from hanging). A differential test runs one long scenario on the memory reference driver and on
SQLite side by side and requires identical results.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import sqlite3
import sys
import textwrap
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from threadline.errors import (
    AgentConversationPurgedError,
    AgentRecordSchemaVersionError,
    AgentRecordValidationError,
    AgentStoreBusyError,
    AgentStoreCorruptRecordError,
    AgentStoreSchemaError,
    AgentStoreUnavailableError,
)
from threadline.store import AgentRuntimeStore, MemoryStoreDriver, create_agent_runtime_store
from threadline.store.sqlite import (
    _FTS_FLUSH,
    SQLITE_SCHEMA_VERSION,
    SqliteAgentRuntimeStoreHandle,
    create_sqlite_agent_runtime_store,
)

VERSION_1 = Path(__file__).resolve().parent.parent / "fixtures" / "sqlite-schema-v1.db"
"""A database written by threadline 0.1.0 (schema version 1): conversation ``c`` with turns t1 ("the quick
brown fox jumps") and t2 ("a persistent marmot") and run t3:run acquired with the draft "zebra draft";
conversation ``other`` with turn o1 ("another fox entirely"); conversation ``gone``, purged."""

OWNER = "owner-1"


def text(t: str) -> list[dict[str, str]]:
    return [{"type": "text", "text": t}]


class Clock:
    """A deterministic UTC clock: every call is one second later."""

    def __init__(self) -> None:
        self.now = datetime(2030, 1, 1, tzinfo=UTC)

    def __call__(self) -> datetime:
        self.now += timedelta(seconds=1)
        return self.now


async def drafted(
    store: AgentRuntimeStore, cid: str, n: str, parts: Any = None, metadata: dict[str, Any] | None = None
) -> tuple[Any, Any]:
    """accept -> acquire -> checkpoint of turn ``n``; returns the admission and the checkpoint results."""
    accepted = await store.accept_input_and_assign_run(
        conversation_id=cid,
        idempotency_key=f"key-{n}",
        input={"id": f"{n}:in", "parts": text(f"question {n}"), "metadata": metadata or {}},
        run_id=f"{n}:run",
        assistant_message_id=f"{n}:out",
    )
    run = (
        await store.acquire_run(
            conversation_id=cid, run_id=accepted.run.id, expected_revision=accepted.run.revision, owner_id=OWNER
        )
    ).run
    written = await store.checkpoint_run_assistant(
        conversation_id=cid,
        run_id=run.id,
        expected_revision=run.revision,
        owner_id=OWNER,
        fencing_token=run.fencing_token,
        parts=parts if parts is not None else text(f"draft {n}"),
    )
    return accepted, written


async def finish(store: AgentRuntimeStore, written: Any, answer: str | None = None) -> Any:
    """The terminal of a drafted turn (its draft stays the answer unless ``answer`` is given)."""
    run = written.run
    return await store.commit_run_terminal(
        conversation_id=run.conversation_id,
        run_id=run.id,
        expected_revision=run.revision,
        owner_id=OWNER,
        fencing_token=run.fencing_token,
        terminal_reason="success",
        **({"parts": text(answer)} if answer is not None else {}),
    )


async def turn(store: AgentRuntimeStore, cid: str, n: str, answer: str | None = None) -> Any:
    """accept -> acquire -> checkpoint -> terminal; returns the terminal result."""
    _, written = await drafted(store, cid, n)
    return await finish(store, written, answer or f"answer {n}")


async def all_pages(store: AgentRuntimeStore, cid: str, **kwargs: Any) -> list[Any]:
    pages, cursor = [], None
    for _ in range(500):  # a cursor that does not advance fails instead of looping for ever
        page = await store.conversations.messages(cid, cursor=cursor, **kwargs)
        pages.append(page)
        if page.next_cursor is None:
            return pages
        cursor = page.next_cursor
    raise AssertionError(f"paging {cid} did not end: {[m.id for p in pages[:6] for m in p.items]}")


def raw(path: Path) -> sqlite3.Connection:
    return sqlite3.connect(path, isolation_level=None, timeout=0)


def execute(path: Path, *statements: str) -> None:
    conn = raw(path)
    try:
        for sql in statements:
            conn.execute(sql)
    finally:
        conn.close()


@pytest.fixture
def db(tmp_path: Path) -> Path:
    return tmp_path / "threadline.db"


# ------------------------------------------------------------------------------------------ durability


async def test_durable_across_close_and_reopen(db: Path) -> None:
    async with create_sqlite_agent_runtime_store(filename=db, clock=Clock()) as sqlite:
        assert isinstance(sqlite, SqliteAgentRuntimeStoreHandle)
        assert sqlite.filename == str(db)
        assert sqlite.conversations is sqlite.store.conversations
        store = sqlite.store
        await store.seed_conversation_input(
            conversation_id="c", seed_key="lead", inputs=[{"id": "sys", "role": "system", "parts": text("be brief")}]
        )
        terminal = await turn(store, "c", "t1")
        queued = await store.accept_input_and_assign_run(
            conversation_id="c", idempotency_key="key-q", input={"id": "q:in", "parts": text("later")}, run_id="q:run"
        )
        before = (
            await store.load_run(conversation_id="c", run_id="t1:run"),
            await store.load_snapshot(conversation_id="c"),
            await all_pages(store, "c", limit=2),
            await store.list_active_runs(conversation_id="c"),
            await store.scan_recoverable(),
            await store.conversations.list(),
        )
        assert terminal.outcome == "committed"
        assert before[0] is not None and before[0].assistant is not None
        assert before[0].assistant.parts[0].text == "answer t1"  # type: ignore[union-attr]
        assert [r.id for r in before[3].runs] == [queued.run.id]

    handle = create_sqlite_agent_runtime_store(filename=db)
    try:
        store = handle.store
        after = (
            await store.load_run(conversation_id="c", run_id="t1:run"),
            await store.load_snapshot(conversation_id="c"),
            await all_pages(store, "c", limit=2),
            await store.list_active_runs(conversation_id="c"),
            await store.scan_recoverable(),
            await store.conversations.list(),
        )
        assert after == before
        duplicate = await store.accept_input_and_assign_run(
            conversation_id="c", idempotency_key="key-t1", input={"id": "t1:in", "parts": text("question t1")}
        )
        assert duplicate.outcome == "duplicate"
        assert duplicate.answer == before[0].assistant
    finally:
        await handle.close()


CHILD = textwrap.dedent(
    """
    import asyncio, sys, time
    from threadline.store.sqlite import create_sqlite_agent_runtime_store

    async def main():
        handle = create_sqlite_agent_runtime_store(filename=sys.argv[1])
        store = handle.store
        accepted = await store.accept_input_and_assign_run(
            conversation_id="c", idempotency_key="k1",
            input={"id": "in-1", "parts": [{"type": "text", "text": "hello"}]},
            run_id="run-1", assistant_message_id="out-1",
        )
        run = (await store.acquire_run(
            conversation_id="c", run_id="run-1", expected_revision=accepted.run.revision, owner_id="child"
        )).run
        await store.commit_run_terminal(
            conversation_id="c", run_id="run-1", expected_revision=run.revision, owner_id="child",
            fencing_token=run.fencing_token, terminal_reason="success",
            parts=[{"type": "text", "text": "durable answer"}],
        )
        await store.accept_input_and_assign_run(
            conversation_id="c", idempotency_key="k2",
            input={"id": "in-2", "parts": [{"type": "text", "text": "queued"}]}, run_id="run-2",
        )
        print("committed", flush=True)
        time.sleep(3600)  # never closes: the parent kills this process

    asyncio.run(main())
    """
)


@pytest.mark.subprocess
async def test_durable_across_sigkill(db: Path) -> None:
    child = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        CHILD,
        str(db),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        line = await asyncio.wait_for(child.stdout.readline(), timeout=60)  # type: ignore[union-attr]
        if line.strip() != b"committed":
            _, err = await child.communicate()
            pytest.fail(f"child did not commit: {line!r} {err.decode()}")
    finally:
        if child.returncode is None:
            child.send_signal(signal.SIGKILL)
        await child.communicate()
    assert child.returncode == -signal.SIGKILL

    async with create_sqlite_agent_runtime_store(filename=db) as sqlite:
        loaded = await sqlite.store.load_run(conversation_id="c", run_id="run-1")
        assert loaded is not None and loaded.run.state == "completed"
        assert loaded.assistant is not None and loaded.assistant.parts[0].text == "durable answer"  # type: ignore[union-attr]
        active = await sqlite.store.list_active_runs(conversation_id="c")
        assert [r.id for r in active.runs] == ["run-2"]
        page = await sqlite.conversations.messages("c")
        assert [m.id for m in page.items] == ["in-1", "out-1", "in-2"]
        retry = await sqlite.store.accept_input_and_assign_run(
            conversation_id="c", idempotency_key="k1", input={"id": "in-1", "parts": text("hello")}
        )
        assert retry.outcome == "duplicate" and retry.answered_by_run_id == "run-1"


# ------------------------------------------------------------------------------------- schema ownership


async def test_application_tables_and_user_version_untouched(db: Path) -> None:
    execute(
        db,
        "CREATE TABLE app_items (id INTEGER PRIMARY KEY, name TEXT)",
        "INSERT INTO app_items (name) VALUES ('kept')",
        "CREATE INDEX app_items_name ON app_items (name)",
        "PRAGMA user_version = 42",
    )
    async with create_sqlite_agent_runtime_store(filename=db) as sqlite:
        await turn(sqlite.store, "c", "t1")
        await sqlite.store.purge_conversation(conversation_id="c")
    async with create_sqlite_agent_runtime_store(filename=db) as sqlite:  # reopening changes nothing either
        assert (await sqlite.conversations.list()).items == ()
    conn = raw(db)
    try:
        assert conn.execute("PRAGMA user_version").fetchone()[0] == 42
        assert conn.execute("SELECT id, name FROM app_items").fetchall() == [(1, "kept")]
        names = {name for (name,) in conn.execute("SELECT name FROM sqlite_master")}
        foreign = {n for n in names if not n.startswith(("threadline_", "sqlite_autoindex_threadline_"))}
        assert foreign == {"app_items", "app_items_name"}
        meta = conn.execute("SELECT key, value FROM threadline_meta").fetchall()
        assert meta == [("schema_version", str(SQLITE_SCHEMA_VERSION))]
    finally:
        conn.close()


async def test_unknown_schema_version_refused(db: Path) -> None:
    async with create_sqlite_agent_runtime_store(filename=db):
        pass
    later = str(SQLITE_SCHEMA_VERSION + 1)
    execute(db, f"UPDATE threadline_meta SET value = '{later}' WHERE key = 'schema_version'")
    with pytest.raises(AgentStoreSchemaError) as caught:
        create_sqlite_agent_runtime_store(filename=db)
    assert f"'{later}'" in str(caught.value) and f"schema versions 1 to {SQLITE_SCHEMA_VERSION}" in str(caught.value)
    execute(db, "UPDATE threadline_meta SET value = 'two' WHERE key = 'schema_version'")
    with pytest.raises(AgentStoreSchemaError, match="'two' is not supported"):
        create_sqlite_agent_runtime_store(filename=db)


def schema_objects(path: Path) -> dict[str, str]:
    conn = raw(path)
    try:
        return dict(conn.execute("SELECT name, sql FROM sqlite_master WHERE name GLOB 'threadline_*'").fetchall())
    finally:
        conn.close()


async def test_a_version_1_file_is_migrated_forward_and_keeps_everything(db: Path) -> None:
    db.write_bytes(VERSION_1.read_bytes())
    before = schema_objects(db)
    async with create_sqlite_agent_runtime_store(filename=db) as sqlite:
        store = sqlite.store
        # the rows and the full-text index written by version 1 are all still there
        assert [h.conversation_id for h in (await sqlite.conversations.list()).items] == ["c", "other"]
        assert [m.id for m in (await sqlite.conversations.messages("c")).items] == [
            "t1:in",
            "t1:out",
            "t2:in",
            "t2:out",
            "t3:in",
            "t3:out",
        ]
        assert [m.id for m in await sqlite.search_messages("c", "fox")] == ["t1:out"]
        assert [m.id for m in await sqlite.search_messages("other", "fox")] == ["o1:out"]
        assert await sqlite.search_messages("gone", "fox") == []
        assert await sqlite.search_messages("c", "zebra") == []  # the in-flight draft: not settled
        # the run that was in flight finishes under the new schema and is indexed as it settles
        run = (await store.load_run(conversation_id="c", run_id="t3:run")).run  # type: ignore[union-attr]
        await store.commit_run_terminal(
            conversation_id="c",
            run_id=run.id,
            expected_revision=run.revision,
            owner_id=OWNER,
            fencing_token=run.fencing_token,
            terminal_reason="success",
            parts=text("zebra answer"),
        )
        assert {m.id for m in await sqlite.search_messages("c", "zebra")} == {"t3:in", "t3:out"}
        await turn(store, "other", "o2", answer="a second fox")
        assert {m.id for m in await sqlite.search_messages("other", "fox")} == {"o1:out", "o2:out"}
        assert (await store.purge_conversation(conversation_id="c")).outcome == "purged"
        assert await sqlite.search_messages("c", "fox") == []
    after = schema_objects(db)
    conn = raw(db)
    try:
        assert conn.execute("SELECT value FROM threadline_meta").fetchall() == [(str(SQLITE_SCHEMA_VERSION),)]
        assert conn.execute("SELECT count(*) FROM threadline_fts_queue").fetchone() == (0,)
        indexed = conn.execute("SELECT message_id FROM threadline_message_fts ORDER BY message_id").fetchall()
        assert indexed == [("o1:in",), ("o1:out",), ("o2:in",), ("o2:out",)]
        # every run kept from version 1 has its answer id in the column the lookup by answer id reads
        unfilled = (
            "SELECT count(*) FROM threadline_runs "
            "WHERE assistant_message_id IS NOT json_extract(body, '$.assistant_message_id')"
        )
        assert conn.execute(unfilled).fetchone() == (0,)
        assert conn.execute("SELECT count(*) FROM threadline_runs").fetchone()[0] > 0
    finally:
        conn.close()
    assert set(after) - set(before) == {
        "threadline_fts_queue",
        "threadline_runs_assistant",
        "threadline_events",
        "threadline_events_bodies",
        "threadline_events_purged_guard",
    }
    changed = {name for name in before if before[name] != after[name]}
    # the runs table gained its assistant_message_id column
    assert changed == {"threadline_runs", *(f"threadline_messages_fts_{t}" for t in ("insert", "update", "delete"))}
    async with create_sqlite_agent_runtime_store(filename=db):  # reopening migrates nothing more
        pass
    assert schema_objects(db) == after


async def test_a_version_1_file_missing_an_object_is_refused_and_left_as_it_was(db: Path) -> None:
    db.write_bytes(VERSION_1.read_bytes())
    execute(db, "DROP TRIGGER threadline_messages_fts_update")
    before = schema_objects(db)
    with pytest.raises(AgentStoreSchemaError, match="cannot migrate threadline schema version 1 to"):
        create_sqlite_agent_runtime_store(filename=db)
    assert schema_objects(db) == before
    conn = raw(db)
    try:
        assert conn.execute("SELECT value FROM threadline_meta").fetchall() == [("1",)]
    finally:
        conn.close()


async def test_handles_opened_at_once_on_a_version_1_file_migrate_it_once(db: Path) -> None:
    db.write_bytes(VERSION_1.read_bytes())
    handles = await asyncio.gather(
        *(asyncio.to_thread(create_sqlite_agent_runtime_store, filename=db) for _ in range(4))
    )
    try:
        for sqlite in handles:
            assert [m.id for m in await sqlite.search_messages("c", "marmot")] == ["t2:out"]
    finally:
        for sqlite in handles:
            await sqlite.close()
    assert "threadline_fts_queue" in schema_objects(db)


@pytest.mark.parametrize("dropped", ["threadline_runs", "threadline_message_fts", "threadline_messages_settled"])
async def test_partial_schema_refused(db: Path, dropped: str) -> None:
    async with create_sqlite_agent_runtime_store(filename=db):
        pass
    kind = "INDEX" if dropped.endswith("_settled") else "TABLE"
    execute(db, f"DROP {kind} {dropped}")
    with pytest.raises(AgentStoreSchemaError) as caught:
        create_sqlite_agent_runtime_store(filename=db)
    assert "partial threadline schema" in str(caught.value)
    assert dropped in str(caught.value)


async def test_schema_without_meta_refused(db: Path) -> None:
    async with create_sqlite_agent_runtime_store(filename=db):
        pass
    execute(db, "DROP TABLE threadline_meta")
    with pytest.raises(AgentStoreSchemaError, match="missing threadline_meta"):
        create_sqlite_agent_runtime_store(filename=db)


@pytest.mark.parametrize("content", [b"this is not a database at all", bytes(range(256)) * 64])
def test_non_database_file_is_a_typed_error(db: Path, content: bytes) -> None:
    db.write_bytes(content)
    with pytest.raises((AgentStoreSchemaError, AgentStoreUnavailableError)) as caught:
        create_sqlite_agent_runtime_store(filename=db)
    assert str(db) in str(caught.value)
    assert db.read_bytes() == content  # refused, not overwritten


def test_unopenable_path_is_unavailable(tmp_path: Path) -> None:
    with pytest.raises(AgentStoreUnavailableError):
        create_sqlite_agent_runtime_store(filename=tmp_path / "missing-dir" / "x.db")


def test_sqlite_without_fts5_is_refused(db: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import threadline.store.sqlite as module

    monkeypatch.setattr(module, "_fts5_available", lambda conn: False)
    with pytest.raises(AgentStoreSchemaError, match="requires FTS5 support"):
        create_sqlite_agent_runtime_store(filename=db)


@pytest.mark.parametrize("value", ["OFF", "normal-ish", "", 1, None])
def test_bad_synchronous_is_a_validation_error(db: Path, value: Any) -> None:
    with pytest.raises(AgentRecordValidationError) as caught:
        create_sqlite_agent_runtime_store(filename=db, synchronous=value)
    assert caught.value.field == "synchronous"
    assert not db.exists()


@pytest.mark.parametrize("value", ["NORMAL", "FULL", "full"])
async def test_synchronous_modes(db: Path, value: str) -> None:
    async with create_sqlite_agent_runtime_store(filename=db, synchronous=value) as sqlite:  # type: ignore[arg-type]
        await turn(sqlite.store, "c", "t1")
    conn = raw(db)
    try:
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    finally:
        conn.close()


# ------------------------------------------------------------------------------------- corrupt rows


async def test_foreign_run_body_is_a_corrupt_record(db: Path) -> None:
    async with create_sqlite_agent_runtime_store(filename=db) as sqlite:
        await turn(sqlite.store, "c", "t1")
    execute(db, """UPDATE threadline_runs SET body = '{"nope":1}' WHERE run_id = 't1:run'""")
    async with create_sqlite_agent_runtime_store(filename=db) as sqlite:
        with pytest.raises(AgentStoreCorruptRecordError) as caught:
            await sqlite.store.load_run(conversation_id="c", run_id="t1:run")
        assert caught.value.where.startswith("threadline_runs ")
        assert "conversation_id=c" in caught.value.where and "run_id=t1:run" in caught.value.where


@pytest.mark.parametrize("body", ["not json", "[]", "null"])
async def test_malformed_message_body_is_a_corrupt_record(db: Path, body: str) -> None:
    async with create_sqlite_agent_runtime_store(filename=db) as sqlite:
        await turn(sqlite.store, "c", "t1")
    conn = raw(db)
    try:  # the full-text trigger reads the old body as JSON: step around it, as a foreign writer might
        name = "threadline_messages_fts_update"
        (trigger,) = conn.execute("SELECT sql FROM sqlite_master WHERE name = ?", (name,)).fetchone()
        conn.execute("BEGIN")
        conn.execute(f"DROP TRIGGER {name}")
        conn.execute("UPDATE threadline_messages SET body = ? WHERE message_id = 't1:out'", (body,))
        conn.execute(trigger)
        conn.execute("COMMIT")
    finally:
        conn.close()
    async with create_sqlite_agent_runtime_store(filename=db) as sqlite:
        with pytest.raises(AgentStoreCorruptRecordError) as caught:
            await sqlite.conversations.messages("c")
        assert caught.value.where.startswith("threadline_messages ")
        assert "message_id=t1:out" in caught.value.where


async def test_row_belonging_to_another_key_is_a_corrupt_record(db: Path) -> None:
    async with create_sqlite_agent_runtime_store(filename=db) as sqlite:
        await turn(sqlite.store, "c", "t1")
        await turn(sqlite.store, "c", "t2")
    execute(
        db,
        "UPDATE threadline_runs SET body = (SELECT body FROM threadline_runs WHERE run_id = 't2:run') "
        "WHERE run_id = 't1:run'",
    )
    async with create_sqlite_agent_runtime_store(filename=db) as sqlite:
        with pytest.raises(AgentStoreCorruptRecordError, match="threadline_runs"):
            await sqlite.store.load_run(conversation_id="c", run_id="t1:run")


@pytest.mark.parametrize(
    ("table", "key_column", "key"),
    [("threadline_runs", "run_id", "t1:run"), ("threadline_conversations", "conversation_id", "c")],
)
async def test_newer_record_schema_version_propagates(db: Path, table: str, key_column: str, key: str) -> None:
    async with create_sqlite_agent_runtime_store(filename=db) as sqlite:
        await turn(sqlite.store, "c", "t1")
    execute(db, f"UPDATE {table} SET body = json_set(body, '$.schema_version', 2) WHERE {key_column} = '{key}'")
    async with create_sqlite_agent_runtime_store(filename=db) as sqlite:
        with pytest.raises(AgentRecordSchemaVersionError) as caught:
            await sqlite.store.load_run(conversation_id="c", run_id="t1:run")
        assert caught.value.version == 2 and caught.value.supported == 1


# ------------------------------------------------------------------------------------------------ busy


async def test_busy_write_lock_is_refused_at_once_and_writes_nothing(db: Path) -> None:
    async with create_sqlite_agent_runtime_store(filename=db) as first:
        await turn(first.store, "c", "t1")
        before = await first.store.load_snapshot(conversation_id="c")
        holder = raw(db)
        try:
            holder.execute("BEGIN IMMEDIATE")
            second = create_sqlite_agent_runtime_store(filename=db)  # opening needs no write lock
            try:
                for store in (first.store, second.store):
                    with pytest.raises(AgentStoreBusyError):
                        await asyncio.wait_for(
                            store.accept_input_and_assign_run(
                                conversation_id="c",
                                idempotency_key="key-busy",
                                input={"id": "busy:in", "parts": text("blocked")},
                            ),
                            timeout=30,
                        )
                # WAL readers are not blocked by the writer
                assert await second.store.load_snapshot(conversation_id="c") == before
                assert await first.store.load_snapshot(conversation_id="c") == before
            finally:
                holder.execute("ROLLBACK")
            # released: the same call now succeeds, and was not half-applied before
            accepted = await second.store.accept_input_and_assign_run(
                conversation_id="c", idempotency_key="key-busy", input={"id": "busy:in", "parts": text("blocked")}
            )
            assert accepted.outcome == "accepted"
            assert accepted.version == before.version + 1
            seen = await first.store.list_active_runs(conversation_id="c")
            assert [r.id for r in seen.runs] == [accepted.run.id]
            await second.close()
        finally:
            holder.close()


async def test_handles_opened_at_once_on_a_fresh_file_agree_on_one_schema(db: Path) -> None:
    handles = await asyncio.gather(*(asyncio.to_thread(create_sqlite_agent_runtime_store, db) for _ in range(4)))
    try:
        for i, handle in enumerate(handles):
            await turn(handle.store, f"c{i}", "t1")
        assert len((await handles[0].conversations.list()).items) == 4
    finally:
        for handle in handles:
            await handle.close()


async def test_two_handles_share_one_file(db: Path) -> None:
    async with (
        create_sqlite_agent_runtime_store(filename=db) as a,
        create_sqlite_agent_runtime_store(filename=db) as b,
    ):
        await turn(a.store, "c", "t1")
        loaded = await b.store.load_run(conversation_id="c", run_id="t1:run")
        assert loaded is not None and loaded.run.state == "completed"
        await turn(b.store, "c", "t2")
        assert [m.id for m in (await a.conversations.messages("c")).items] == ["t1:in", "t1:out", "t2:in", "t2:out"]


# ----------------------------------------------------------------------------------------------- purge


async def test_purge_tombstone_survives_reopen(db: Path) -> None:
    async with create_sqlite_agent_runtime_store(filename=db) as sqlite:
        await turn(sqlite.store, "c", "t1")
        await turn(sqlite.store, "other", "o1")
        assert (await sqlite.store.purge_conversation(conversation_id="c")).outcome == "purged"
    conn = raw(db)
    try:
        for table in ("conversations", "runs", "messages", "admissions", "seeds"):
            n = conn.execute(f"SELECT count(*) FROM threadline_{table} WHERE conversation_id = 'c'").fetchone()[0]
            assert n == 0, table
        assert (
            conn.execute("SELECT count(*) FROM threadline_message_fts WHERE conversation_id = 'c'").fetchone()[0] == 0
        )
        assert (
            conn.execute("SELECT count(*) FROM threadline_messages WHERE conversation_id = 'other'").fetchone()[0] == 2
        )
    finally:
        conn.close()
    async with create_sqlite_agent_runtime_store(filename=db) as sqlite:
        store = sqlite.store
        assert (await store.purge_conversation(conversation_id="c")).outcome == "already_purged"
        with pytest.raises(AgentConversationPurgedError):
            await store.accept_input_and_assign_run(
                conversation_id="c", idempotency_key="key-new", input={"id": "new:in", "parts": text("again")}
            )
        with pytest.raises(AgentConversationPurgedError):
            await store.seed_conversation_input(
                conversation_id="c", seed_key="s", inputs=[{"id": "s1", "role": "user", "parts": text("x")}]
            )
        assert (await store.load_snapshot(conversation_id="c")).version == 0
        assert [h.conversation_id for h in (await sqlite.conversations.list()).items] == ["other"]
        assert (await store.load_run(conversation_id="other", run_id="o1:run")) is not None


async def test_trigger_guard_refuses_raw_insert_for_purged_conversation(db: Path) -> None:
    async with create_sqlite_agent_runtime_store(filename=db) as sqlite:
        await turn(sqlite.store, "c", "t1")
        await sqlite.store.purge_conversation(conversation_id="c")
    conn = raw(db)
    try:
        statements = [
            "INSERT INTO threadline_conversations (conversation_id, version, body) VALUES ('c', 1, '{}')",
            "INSERT INTO threadline_runs (conversation_id, run_id, active, version, body)"
            " VALUES ('c', 'r', 1, 1, '{}')",
            "INSERT INTO threadline_messages"
            " (conversation_id, message_id, band_rank, position, sub, seq, active, version, body)"
            " VALUES ('c', 'm', 1, NULL, 0, 1, 1, 1, '{}')",
            "INSERT INTO threadline_admissions (conversation_id, idempotency_key, input_message_id, body)"
            " VALUES ('c', 'k', 'm', '{}')",
            "INSERT INTO threadline_seeds (conversation_id, seed_key, body) VALUES ('c', 's', '{}')",
        ]
        for sql in statements:
            with pytest.raises(sqlite3.IntegrityError):
                conn.execute(sql)
        # other conversations are not guarded
        conn.execute("INSERT INTO threadline_seeds (conversation_id, seed_key, body) VALUES ('d', 's', '{}')")
    finally:
        conn.close()


async def test_tombstone_written_behind_the_store_is_respected(db: Path) -> None:
    """A tombstone another writer added is seen on the next mutation, and when it is inconsistent with a live
    head (the store would not check it), the trigger guard still refuses the write, as a typed error."""
    async with create_sqlite_agent_runtime_store(filename=db) as sqlite:
        execute(db, "INSERT INTO threadline_tombstones (conversation_id, purged_at) VALUES ('ghost', 'x')")
        with pytest.raises(AgentConversationPurgedError):
            await sqlite.store.accept_input_and_assign_run(
                conversation_id="ghost", idempotency_key="k", input={"id": "i", "parts": text("boo")}
            )
        await turn(sqlite.store, "live", "t1")
        before = await sqlite.store.load_snapshot(conversation_id="live")
        execute(db, "INSERT INTO threadline_tombstones (conversation_id, purged_at) VALUES ('live', 'x')")
        with pytest.raises(AgentConversationPurgedError) as caught:
            await sqlite.store.accept_input_and_assign_run(
                conversation_id="live", idempotency_key="k2", input={"id": "i2", "parts": text("late")}
            )
        assert caught.value.conversation_id == "live"
        assert await sqlite.store.load_snapshot(conversation_id="live") == before
        assert [h.conversation_id for h in (await sqlite.conversations.list()).items] == ["live"]


# ----------------------------------------------------------------------------------------- compaction


async def test_include_compacted_pages_after_replacement(db: Path) -> None:
    async with create_sqlite_agent_runtime_store(filename=db) as sqlite:
        store = sqlite.store
        for n in ("t1", "t2", "t3"):
            await turn(store, "c", n)
        head = await store.list_active_runs(conversation_id="c")
        replaced = ["t1:in", "t1:out", "t2:in"]
        result = await store.replace_compacted_range(
            conversation_id="c",
            expected_version=head.version,
            replaced_message_ids=replaced,
            summary={"id": "sum", "role": "summary", "parts": text("summary of t1")},
        )
        assert result.outcome == "applied"
        full = ["t1:in", "t1:out", "t2:in", "sum", "t2:out", "t3:in", "t3:out"]
        page = await sqlite.conversations.messages("c", include_compacted=True)
        assert [m.id for m in page.items] == full
        assert page.compacted == tuple(replaced)
        assert all(not m.active for m in page.items if m.id in replaced)
        visible = await sqlite.conversations.messages("c")
        assert [m.id for m in visible.items] == ["sum", "t2:out", "t3:in", "t3:out"] and visible.compacted == ()
        for limit in (1, 2, 3):
            forward = await all_pages(store, "c", limit=limit, include_compacted=True)
            assert [m.id for p in forward for m in p.items] == full
            backward = await all_pages(store, "c", limit=limit, include_compacted=True, direction="before")
            assert [m.id for p in reversed(backward) for m in p.items] == full
        snapshot = await store.load_snapshot(conversation_id="c")
        assert [m.id for m in snapshot.messages] == ["sum", "t2:out", "t3:in", "t3:out"]
        # the full-text index keeps compacted history searchable and indexes the summary
        assert [m.id for m in await sqlite.search_messages("c", "summary")] == ["sum"]
        found = await sqlite.search_messages("c", "t1")
        assert {m.id for m in found} == {"t1:in", "t1:out", "sum"}
        assert all(m.active == (m.id == "sum") for m in found)


# ---------------------------------------------------------------------------------------------- search


async def test_search_messages_finds_settled_text_only(db: Path) -> None:
    async with create_sqlite_agent_runtime_store(filename=db) as sqlite:
        store = sqlite.store
        await turn(store, "c", "t1", answer="the quick brown fox jumps")
        await turn(store, "other", "o1", answer="another fox entirely")
        accepted = await store.accept_input_and_assign_run(
            conversation_id="c", idempotency_key="k2", input={"id": "t2:in", "parts": text("zebra question")}
        )
        run = (
            await store.acquire_run(
                conversation_id="c", run_id=accepted.run.id, expected_revision=accepted.run.revision, owner_id=OWNER
            )
        ).run
        await store.checkpoint_run_assistant(
            conversation_id="c",
            run_id=run.id,
            expected_revision=run.revision,
            owner_id=OWNER,
            fencing_token=run.fencing_token,
            parts=text("zebra draft"),
        )
        found = await sqlite.search_messages("c", "fox")
        assert [m.id for m in found] == ["t1:out"]
        assert found[0].parts[0].text == "the quick brown fox jumps"  # type: ignore[union-attr]
        assert await sqlite.search_messages("c", "zebra") == []  # unsettled: not indexed yet
        assert [m.id for m in await sqlite.search_messages("c", "question")] == ["t1:in"]
        assert await sqlite.search_messages("nobody", "fox") == []

        await sqlite.store.seed_conversation_input(
            conversation_id="c",
            seed_key="lead",
            inputs=[{"id": "sys", "role": "system", "parts": text("speak like a pirate fox")}],
        )
        assert {m.id for m in await sqlite.search_messages("c", "fox", limit=10)} == {"t1:out", "sys"}
        assert len(await sqlite.search_messages("c", "fox", limit=1)) == 1

        for bad in (0, 1001, -1):
            with pytest.raises(AgentRecordValidationError):
                await sqlite.search_messages("c", "fox", limit=bad)
        with pytest.raises(AgentRecordValidationError):
            await sqlite.search_messages("c", "AND (")
        with pytest.raises(AgentRecordValidationError):
            await sqlite.search_messages("c", "   ")

        await store.commit_run_terminal(
            conversation_id="c",
            run_id=run.id,
            expected_revision=run.revision + 1,
            owner_id=OWNER,
            fencing_token=run.fencing_token,
            terminal_reason="interrupted",
        )
        assert {m.id for m in await sqlite.search_messages("c", "zebra")} == {
            "t2:in",
            accepted.run.assistant_message_id,
        }

        assert (await store.purge_conversation(conversation_id="c")).outcome == "purged"
        assert await sqlite.search_messages("c", "fox") == []
        assert [m.id for m in await sqlite.search_messages("other", "fox")] == ["o1:out"]


async def test_a_record_a_caller_changed_in_place_is_not_what_the_store_reads_back(db: Path) -> None:
    """Records are frozen, but their JSON containers (a tool call's input, metadata) are plain dicts. The
    driver reuses the message records it wrote; one a caller has changed in place is read from its row."""
    call = [{"type": "tool-call", "call_id": "c1", "tool_name": "lookup", "input": {"query": "kept"}}]
    async with create_sqlite_agent_runtime_store(filename=db) as sqlite:
        store = sqlite.store
        accepted, written = await drafted(store, "c", "t", parts=call, metadata={"a": 1})
        assert written.assistant is not None
        written.assistant.parts[0].input["query"] = "tampered"
        accepted.receipt.input.metadata["a"] = 2
        done = await finish(store, written)
        assert done.assistant is not None
        assert done.assistant.parts[0].input == {"query": "kept"}
        stored = {m.id: m for m in (await store.load_snapshot(conversation_id="c")).messages}
        assert stored[done.assistant.id].parts[0].input == {"query": "kept"}
        assert stored["t:in"].metadata == {"a": 1}


async def test_a_change_in_place_that_compares_equal_is_seen_too(db: Path) -> None:
    """What a caller may change in place is compared exactly, as JSON would tell it: ``1`` and ``True``
    are equal in Python, not in the stored row; an empty metadata that gained a key is a change too."""
    call = [{"type": "tool-call", "call_id": "c1", "tool_name": "lookup", "input": {"n": 1, "ok": [True]}}]
    async with create_sqlite_agent_runtime_store(filename=db) as sqlite:
        store = sqlite.store
        accepted, written = await drafted(store, "c", "t", parts=call)
        assert written.assistant is not None
        written.assistant.parts[0].input["n"] = True
        written.assistant.parts[0].input["ok"][0] = 1
        accepted.receipt.input.metadata["gained"] = "a key"
        done = await finish(store, written)
        assert done.assistant is not None
        assert done.assistant.parts[0].input == {"n": 1, "ok": [True]}
        assert type(done.assistant.parts[0].input["n"]) is int and done.assistant.parts[0].input["ok"][0] is True
        stored = {m.id: m for m in (await store.load_snapshot(conversation_id="c")).messages}
        assert stored["t:in"].metadata == {}


def test_every_json_value_a_part_holds_is_compared_before_a_known_message_is_trusted() -> None:
    """The driver snapshots what of a known message could change in place (``_mutable``): every part field
    holding a JSON value must be among those it reads, or a change to it would go unseen."""
    import typing

    from threadline.records import Part
    from threadline.store.sqlite import _CONTAINERS

    for cls in typing.get_args(typing.get_args(Part)[0]):
        json_fields = {name for name, info in cls.model_fields.items() if "JsonValue" in str(info.annotation)}
        assert json_fields <= {_CONTAINERS.get(cls)}, cls
        if "envelope" in cls.model_fields:  # read from every part that has one
            assert "ProviderEnvelope" in str(cls.model_fields["envelope"].annotation), cls


async def test_settled_messages_are_not_kept_in_memory(db: Path) -> None:
    """The driver keeps the unsettled messages it wrote (the next mutation reads them) but not settled ones:
    their bodies would otherwise stay in memory, up to the driver's bound, for reads that seldom come."""
    async with create_sqlite_agent_runtime_store(filename=db) as sqlite:
        store = sqlite.store
        _, written = await drafted(store, "c", "t")
        kept = {key[2] for key in sqlite.driver._rows.known if key[0] == "m"}
        assert kept == {"t:in", "t:out"}
        await finish(store, written)
        assert not [key for key in sqlite.driver._rows.known if key[0] == "m"]
        stored = (await store.load_snapshot(conversation_id="c")).messages
        assert [(m.id, m.position) for m in stored] == [("t:in", 1), ("t:out", 2)]


async def test_indexing_settled_messages_reads_only_the_rows_it_indexes(db: Path) -> None:
    """The full-text flush before every COMMIT costs what it indexes, not what the file holds: its plan
    scans only the queue and reaches messages by primary key (an unlucky plan scanned every settled
    message of every conversation at every commit)."""
    async with create_sqlite_agent_runtime_store(filename=db) as sqlite:
        for n in range(3):
            await turn(sqlite.store, "c", f"t{n}")
    conn = raw(db)
    try:
        for sql in _FTS_FLUSH:
            plan = [row[3] for row in conn.execute("EXPLAIN QUERY PLAN " + sql)]
            # the queue is scanned; the index is reached by rowid, each body's parts by json_each
            allowed = ("SCAN threadline_fts_queue", "SCAN q", "SCAN threadline_message_fts VIRTUAL TABLE INDEX 0:=")
            scans = [step for step in plan if step.startswith("SCAN") and not step.startswith("SCAN p VIRTUAL")]
            assert all(step.startswith(allowed) for step in scans), (sql, plan)
    finally:
        conn.close()


async def test_search_survives_reopen(db: Path) -> None:
    async with create_sqlite_agent_runtime_store(filename=db) as sqlite:
        await turn(sqlite.store, "c", "t1", answer="persistent marmot")
    async with create_sqlite_agent_runtime_store(filename=db) as sqlite:
        assert [m.id for m in await sqlite.search_messages("c", "marmot")] == ["t1:out"]


# --------------------------------------------------------------------------------------------- closing


async def test_closed_handle_is_unavailable(db: Path) -> None:
    sqlite = create_sqlite_agent_runtime_store(filename=db)
    await turn(sqlite.store, "c", "t1")
    await sqlite.close()
    await sqlite.close()  # idempotent
    with pytest.raises(AgentStoreUnavailableError):
        await sqlite.store.load_run(conversation_id="c", run_id="t1:run")
    with pytest.raises(AgentStoreUnavailableError):
        await sqlite.store.accept_input_and_assign_run(
            conversation_id="c", idempotency_key="k", input={"id": "i", "parts": text("x")}
        )
    with pytest.raises(AgentStoreUnavailableError):
        await sqlite.conversations.messages("c")
    with pytest.raises(AgentStoreUnavailableError):
        await sqlite.search_messages("c", "answer")
    async with sqlite:  # exiting a closed handle again is fine
        pass


async def test_handle_offers_its_connection_and_one_write_transaction(db: Path) -> None:
    """``database`` is the store's connection and ``transaction(work)`` one write transaction in the store's
    own serialization: what the work writes commits together, or nothing of it when it raises."""
    async with create_sqlite_agent_runtime_store(filename=db) as sqlite:
        assert isinstance(sqlite.database, sqlite3.Connection)
        await turn(sqlite.store, "c", "t1")

        def add(conn: sqlite3.Connection) -> int:
            assert conn is sqlite.database and conn.in_transaction
            conn.execute("CREATE TABLE IF NOT EXISTS app_rows (id TEXT PRIMARY KEY, note TEXT)")
            conn.execute("INSERT INTO app_rows VALUES ('r1', 'kept')")
            return int(
                conn.execute("SELECT version FROM threadline_conversations WHERE conversation_id = 'c'").fetchone()[0]
            )

        assert await sqlite.transaction(add) == (await sqlite.store.load_snapshot(conversation_id="c")).version

        def half(conn: sqlite3.Connection) -> None:
            conn.execute("INSERT INTO app_rows VALUES ('r2', 'rolled back')")
            raise ValueError("the application changed its mind")

        with pytest.raises(ValueError, match="changed its mind"):
            await sqlite.transaction(half)
        holder = raw(db)
        try:
            assert holder.execute("SELECT id, note FROM app_rows").fetchall() == [("r1", "kept")]
            holder.execute("BEGIN IMMEDIATE")
            ran: list[bool] = []
            with pytest.raises(AgentStoreBusyError):
                await asyncio.wait_for(sqlite.transaction(lambda conn: ran.append(True)), timeout=30)
            assert ran == []
            holder.execute("ROLLBACK")
        finally:
            holder.close()
        await turn(sqlite.store, "c", "t2")  # the store goes on after the application's transactions
        assert [m.id for m in (await sqlite.conversations.messages("c")).items][-2:] == ["t2:in", "t2:out"]
    with pytest.raises(AgentStoreUnavailableError):
        await sqlite.transaction(lambda conn: None)
    async with create_sqlite_agent_runtime_store(db, read_only=True) as reader:
        with pytest.raises(AgentStoreUnavailableError):
            await reader.transaction(lambda conn: None)


async def test_close_waits_for_accepted_operations(db: Path) -> None:
    sqlite = create_sqlite_agent_runtime_store(filename=db)
    pending = [
        asyncio.ensure_future(
            sqlite.store.accept_input_and_assign_run(
                conversation_id=f"c{i}", idempotency_key="k", input={"id": "i", "parts": text("x")}
            )
        )
        for i in range(20)
    ]
    await asyncio.sleep(0)  # every call has handed its job to the worker
    await sqlite.close()
    results = await asyncio.gather(*pending)
    assert all(r.outcome == "accepted" for r in results)
    async with create_sqlite_agent_runtime_store(filename=db) as again:
        assert len((await again.conversations.list()).items) == 20


async def test_cancelled_caller_leaves_the_store_usable(db: Path) -> None:
    async with create_sqlite_agent_runtime_store(filename=db) as sqlite:
        task = asyncio.ensure_future(
            sqlite.store.accept_input_and_assign_run(
                conversation_id="c", idempotency_key="k", input={"id": "i", "parts": text("x")}
            )
        )
        await asyncio.sleep(0)
        task.cancel()
        # with the worker idle the operation ran at once and finished; queued, it was cancelled in flight
        with contextlib.suppress(asyncio.CancelledError):
            await task
        # the transaction either committed or rolled back as a whole; a retry resolves it
        retry = await sqlite.store.accept_input_and_assign_run(
            conversation_id="c", idempotency_key="k", input={"id": "i", "parts": text("x")}
        )
        assert retry.outcome in ("accepted", "duplicate")
        assert len((await sqlite.store.list_active_runs(conversation_id="c")).runs) == 1


async def test_concurrent_operations_serialize(db: Path) -> None:
    async with create_sqlite_agent_runtime_store(filename=db) as sqlite:
        results = await asyncio.gather(
            *(
                sqlite.store.accept_input_and_assign_run(
                    conversation_id="c", idempotency_key=f"k{i}", input={"id": f"i{i}", "parts": text("x")}
                )
                for i in range(30)
            )
        )
        assert sorted(r.version for r in results) == list(range(1, 31))
        assert len((await sqlite.store.list_active_runs(conversation_id="c")).runs) == 30


# ------------------------------------------------------------------------------ differential vs memory


def test_rows_answer_every_request_of_the_driver_protocol() -> None:
    from threadline.store import driver
    from threadline.store.sqlite import _SqliteRows

    missing = [name for name in driver._SYNC_DISPATCH.values() if not callable(getattr(_SqliteRows, name, None))]
    assert missing == []


class Pair:
    """The same calls on the memory reference store and on SQLite; answers must be equal."""

    def __init__(self, memory: AgentRuntimeStore, sqlite: AgentRuntimeStore) -> None:
        self.stores = (memory, sqlite)
        self.steps = 0

    async def __call__(self, call: Callable[[AgentRuntimeStore], Awaitable[Any]]) -> Any:
        outcomes = []
        for store in self.stores:
            try:
                outcomes.append(("ok", await call(store)))
            except Exception as error:
                outcomes.append(("error", (type(error), str(error))))
        self.steps += 1
        assert outcomes[0] == outcomes[1], f"step {self.steps}: memory {outcomes[0]!r} != sqlite {outcomes[1]!r}"
        kind, value = outcomes[0]
        return value if kind == "ok" else None


async def test_sqlite_answers_like_the_memory_reference(db: Path) -> None:
    memory = create_agent_runtime_store(MemoryStoreDriver(), clock=Clock())
    sqlite = create_sqlite_agent_runtime_store(filename=db, clock=Clock())
    both = Pair(memory, sqlite.store)
    try:
        await _scenario(both)
    finally:
        await memory.aclose()
        await sqlite.close()


async def _scenario(both: Pair) -> None:
    c = "conv-a"

    def admit(n: str, cid: str = c, **kw: Any) -> Callable[[AgentRuntimeStore], Awaitable[Any]]:
        return lambda s: s.accept_input_and_assign_run(
            conversation_id=cid,
            idempotency_key=f"key-{n}",
            input={"id": f"{n}:in", "parts": text(f"input {n}"), "metadata": {"n": n}},
            run_id=f"{n}:run",
            assistant_message_id=f"{n}:out",
            **kw,
        )

    async def acquire(run_id: str, cid: str = c) -> Any:
        run = (await both(lambda s: s.load_run(conversation_id=cid, run_id=run_id))).run
        return (
            await both(
                lambda s: s.acquire_run(
                    conversation_id=cid, run_id=run_id, expected_revision=run.revision, owner_id=OWNER
                )
            )
        ).run

    def owned(run: Any, cid: str = c) -> dict[str, Any]:
        return {
            "conversation_id": cid,
            "run_id": run.id,
            "expected_revision": run.revision,
            "owner_id": OWNER,
            "fencing_token": run.fencing_token,
        }

    async def pages(cid: str = c) -> None:
        for include in (False, True):
            for direction in ("after", "before"):
                for limit in (1, 2, 5, 1000):
                    await both(
                        lambda s, n=limit, d=direction, i=include: all_pages(  # type: ignore[misc]
                            s, cid, limit=n, direction=d, include_compacted=i
                        )
                    )
        cursors = ["[0]", "[1]", "[1, 3]", "[1, 3, 0, 99, 7]", "[2]", "[2, 0, 0, 0, 0, 0]", "[-5]", "[99]"]
        # keys of real messages, exact and with a longer or shorter tuple (Python tuple-comparison semantics)
        for page in await both(lambda s: all_pages(s, cid, limit=1, include_compacted=True)):
            if page.next_cursor is not None:
                key = json.loads(page.next_cursor)
                cursors += [page.next_cursor, json.dumps([*key, 0]), json.dumps(key[:2]), json.dumps(key[:3])]
        for cursor in cursors:
            for direction in ("after", "before"):
                await both(
                    lambda s, k=cursor, d=direction: s.conversations.messages(  # type: ignore[misc]
                        cid, cursor=k, direction=d, limit=3
                    )
                )
        await both(lambda s: s.load_snapshot(conversation_id=cid))
        version = (await both(lambda s: s.list_active_runs(conversation_id=cid))).version
        for since in sorted({0, 1, 3, version - 2, version - 1, version, version + 5, -1}):
            await both(lambda s, v=since: _changes(s, cid, v))  # type: ignore[misc]

    await both(
        lambda s: s.seed_conversation_input(
            conversation_id=c,
            seed_key="lead",
            inputs=[{"id": "lead:sys", "role": "system", "parts": text("system prompt")}],
        )
    )
    await both(admit("r1"))
    await both(admit("r2"))
    await both(admit("r3", priority="urgent", input_policy="interrupt-next"))
    await both(admit("r4", coalesce=True))  # joins r2, the latest queued ordinary run
    await both(admit("r1"))  # duplicate
    await both(
        lambda s: s.accept_input_and_assign_run(
            conversation_id=c, idempotency_key="key-r1", input={"id": "r1:in", "parts": text("different")}
        )
    )
    await both(admit("r5", cid=c))  # r5 queued behind
    await pages()

    await both(lambda s: s.acquire_run(conversation_id=c, run_id="r1:run", expected_revision=1, owner_id=OWNER))
    r3 = await acquire("r3:run")
    op = {"kind": "model-request", "phase": "started", "operation_id": "op1", "started_at": "2030-01-01T00:00:00Z"}
    r3 = (await both(lambda s: s.record_run_operation(**owned(r3), operation=op))).run
    r3 = (await both(lambda s: s.checkpoint_run_assistant(**owned(r3), parts=text("partial r3")))).run
    r3 = (await both(lambda s: s.checkpoint_run_assistant(**owned(r3), parts=text("partial r3 more")))).run
    await both(lambda s: s.checkpoint_run_assistant(**{**owned(r3), "fencing_token": 99}, parts=text("stale")))
    await pages()
    await both(lambda s: s.request_run_interrupt(conversation_id=c, run_id="r3:run"))
    await both(lambda s: s.request_run_interrupt(conversation_id=c, run_id="r1:run"))
    r3 = (await both(lambda s: s.load_run(conversation_id=c, run_id="r3:run"))).run
    await both(lambda s: s.commit_run_terminal(**owned(r3), terminal_reason="interrupted"))
    await both(lambda s: s.commit_run_terminal(**owned(r3), terminal_reason="interrupted"))  # already terminal

    r1 = await acquire("r1:run")
    r1 = (await both(lambda s: s.checkpoint_run_assistant(**owned(r1), parts=text("answer r1")))).run
    r2 = (await both(lambda s: s.load_run(conversation_id=c, run_id="r2:run"))).run
    claim = {"run_id": "r2:run", "expected_revision": r2.revision, "input_message_ids": list(r2.input_message_ids)}
    stale = {"run_id": "r5:run", "expected_revision": 99, "input_message_ids": ["r5:in"]}
    await both(lambda s: s.commit_run_terminal(**owned(r1), terminal_reason="success", absorb=[claim, stale]))
    await both(admit("r2"))  # duplicate of an absorbed run: answered by r1
    await both(admit("r4"))
    await pages()

    await both(
        lambda s: s.seed_conversation_input(
            conversation_id=c,
            seed_key="imported",
            placement="after-settled",
            inputs=[
                {"id": "imp:u", "role": "user", "parts": text("imported question")},
                {"id": "imp:a", "role": "assistant", "parts": text("imported answer")},
            ],
        )
    )
    await both(
        lambda s: s.seed_conversation_input(
            conversation_id=c,
            seed_key="imported",
            placement="after-settled",
            inputs=[{"id": "imp:u", "role": "user", "parts": text("imported question")}],
        )
    )
    version = (await both(lambda s: s.list_active_runs(conversation_id=c))).version
    summary = {"id": "sum1", "role": "summary", "parts": text("summary")}
    await both(
        lambda s: s.replace_compacted_range(
            conversation_id=c, expected_version=version - 1, replaced_message_ids=["r3:in"], summary=summary
        )
    )
    await both(
        lambda s: s.replace_compacted_range(
            conversation_id=c, expected_version=version, replaced_message_ids=["r3:in", "r1:in"], summary=summary
        )
    )
    await both(
        lambda s: s.replace_compacted_range(
            conversation_id=c,
            expected_version=version,
            replaced_message_ids=["r3:in", "r3:out", "r1:in"],
            summary=summary,
        )
    )
    await pages()

    # a second conversation: requeue and abandon
    b = "conv-b"
    await both(admit("b1", cid=b))
    await both(admit("b2", cid=b))
    b1 = await acquire("b1:run", b)
    b1 = (await both(lambda s: s.checkpoint_run_assistant(**owned(b1, b), parts=text("b1 draft")))).run
    await both(
        lambda s: s.recover_run(
            conversation_id=b, run_id="b1:run", expected_revision=b1.revision, action="requeue", replay_safe=True
        )
    )
    b1 = await acquire("b1:run", b)
    await both(
        lambda s: s.recover_run(
            conversation_id=b, run_id="b1:run", expected_revision=b1.revision, action="abandon", stale_owner=True
        )
    )
    await pages(b)
    for limit in (1, 2, 100):
        await both(lambda s, n=limit: _scan_all(s, n))  # type: ignore[misc]
        await both(lambda s, n=limit: _list_all(s, n))  # type: ignore[misc]
    await both(lambda s: s.scan_recoverable(cursor='["conv-a", "r5:run"]'))
    await both(lambda s: s.conversations.list(cursor='["conv-a"]'))

    await both(lambda s: s.purge_conversation(conversation_id=b))  # b2 still queued
    await both(lambda s: s.purge_conversation(conversation_id="never-seen"))
    await both(admit("x", cid="never-seen"))
    r5 = await acquire("r5:run")
    await both(lambda s: s.commit_run_terminal(**owned(r5), terminal_reason="provider_failure"))
    await both(lambda s: s.purge_conversation(conversation_id=c, expected_version=1))
    await both(lambda s: s.purge_conversation(conversation_id=c))
    await both(lambda s: s.purge_conversation(conversation_id=c))
    await both(admit("r9"))
    await pages()
    await both(lambda s: _scan_all(s, 1))
    await both(lambda s: _list_all(s, 1))


async def _changes(store: AgentRuntimeStore, cid: str, since: int) -> Any:
    """``load_changes`` with its rows in a canonical order (the driver may answer in any order)."""
    changes = await store.load_changes(conversation_id=cid, since_version=since)
    return (
        changes.model_copy(update={"messages": (), "runs": ()}),
        sorted(changes.messages, key=lambda m: m.id),
        sorted(changes.runs, key=lambda r: r.id),
    )


async def _scan_all(store: AgentRuntimeStore, limit: int) -> list[Any]:
    pages, cursor = [], None
    for _ in range(500):
        page = await store.scan_recoverable(cursor=cursor, limit=limit)
        pages.append(page)
        if page.next_cursor is None:
            return pages
        cursor = page.next_cursor
    raise AssertionError("scan_recoverable paging did not end")


async def _list_all(store: AgentRuntimeStore, limit: int) -> list[Any]:
    pages, cursor = [], None
    for _ in range(500):
        page = await store.conversations.list(cursor=cursor, limit=limit)
        pages.append(page)
        if page.next_cursor is None:
            return pages
        cursor = page.next_cursor
    raise AssertionError("conversations.list paging did not end")
