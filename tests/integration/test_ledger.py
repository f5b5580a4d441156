"""The event ledger on real databases: migration baselines (SQLite and PostgreSQL), byte-identical archives
across memory, SQLite and PostgreSQL, and the provider records of real runs (constant-size requests, no
extra commit per turn)."""

from __future__ import annotations

import json
import sqlite3
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel
from pydantic_ai.messages import ModelRequest, ToolReturnPart
from pydantic_ai.models.function import AgentInfo, DeltaToolCall, FunctionModel

from threadline import (
    create_agent_runtime,
    create_memory_agent_runtime_store,
    create_sqlite_agent_runtime_store,
    define_agent_protocol,
    define_agent_tool,
    define_model_registry,
)
from threadline.errors import AgentRecordValidationError
from threadline.ledger import AgentStoreEvent, decode_agent_store_event
from threadline.ledger.digests import check_provider_requests
from threadline.store.sqlite import SQLITE_SCHEMA_VERSION


class Context(BaseModel):
    user_id: str = "u1"


VERSION_1 = Path(__file__).resolve().parent.parent / "fixtures" / "sqlite-schema-v1.db"


async def journal(store: Any, cid: str) -> list[AgentStoreEvent]:
    return list((await store.read_events(conversation_id=cid, limit=10_000)).items)


def text(t: str) -> list[dict[str, str]]:
    return [{"type": "text", "text": t}]


async def turn(store: Any, cid: str, n: str) -> None:
    accepted = await store.accept_input_and_assign_run(
        conversation_id=cid, idempotency_key=f"{n}:key", input={"id": f"{n}:in", "parts": text(f"question {n}")}
    )
    run = (
        await store.acquire_run(
            conversation_id=cid, run_id=accepted.run.id, expected_revision=accepted.run.revision, owner_id="o"
        )
    ).run
    await store.commit_run_terminal(
        conversation_id=cid,
        run_id=run.id,
        expected_revision=run.revision,
        owner_id="o",
        fencing_token=run.fencing_token,
        terminal_reason="success",
        parts=text(f"answer {n}"),
    )


# -------------------------------------------------------------------------------------------- migration


async def test_a_version_1_file_gets_one_baseline_per_conversation_and_continues_after_it(tmp_path: Path) -> None:
    db = tmp_path / "v1.db"
    db.write_bytes(VERSION_1.read_bytes())
    async with create_sqlite_agent_runtime_store(filename=db) as sqlite:
        store = sqlite.store
        for cid in ("c", "other"):
            (baseline,) = await journal(store, cid)
            event, record = decode_agent_store_event(baseline)
            assert (event.seq, event.kind) == (1, "runtime/baseline")
            snapshot = await store.load_snapshot(conversation_id=cid)
            assert {m.id for m in record.messages} >= {m.id for m in snapshot.messages}
            assert record.as_of == max(m.created_at for m in record.messages)
            assert record.head.version == snapshot.version and record.head.event_seq == 1
        assert await journal(store, "gone") == []  # purged before the migration: nothing to describe
        # a new transition continues the sequence; the migrated conversation exports, and the archive's
        # journal replays from its baseline to exactly the stored rows
        await turn(store, "other", "o9")
        events = await journal(store, "other")
        assert [e.seq for e in events] == [1, 2, 3, 4] and events[1].kind == "runtime/transition"
        data = await store.export_conversation("other")
        memory = create_memory_agent_runtime_store()
        await memory.import_conversation(data)
        assert await memory.export_conversation("other") == data
        # a migrated baseline has no earlier per-run boundary: it is copied at its settled tip
        copied = await store.branch_conversation(
            request_key="k",
            destination_conversation_id="other-copy",
            source={"kind": "conversation", "conversation_id": "other"},
        )
        assert copied.receipt.source_seq == 4
    conn = sqlite3.connect(db)
    try:
        assert conn.execute("SELECT value FROM threadline_meta").fetchone() == (str(SQLITE_SCHEMA_VERSION),)
    finally:
        conn.close()


def _downgrade_sqlite(db: Path) -> None:
    """Make a current database look like layout 4 written before the ledger (events gone, heads without
    ``event_seq``): what an upgrade finds."""
    conn = sqlite3.connect(db)
    try:
        conn.execute("DROP TABLE threadline_events")
        conn.execute("UPDATE threadline_meta SET value = '4' WHERE key = 'schema_version'")
        for cid, body in conn.execute("SELECT conversation_id, body FROM threadline_conversations").fetchall():
            head = json.loads(body)
            head.pop("event_seq")
            conn.execute(
                "UPDATE threadline_conversations SET body = ? WHERE conversation_id = ?", (json.dumps(head), cid)
            )
        conn.commit()
    finally:
        conn.close()


async def test_sqlite_layout_4_moves_forward_in_one_transaction_with_baselines(tmp_path: Path) -> None:
    db = tmp_path / "v4.db"
    async with create_sqlite_agent_runtime_store(filename=db) as sqlite:
        await turn(sqlite.store, "a", "t1")
        await sqlite.store.replace_compacted_range(
            conversation_id="a",
            expected_version=3,
            replaced_message_ids=["t1:in"],
            summary={"id": "s1", "role": "summary", "parts": text("asked t1")},
        )
        await turn(sqlite.store, "a", "t2")
        before = await sqlite.store.load_snapshot(conversation_id="a")
    _downgrade_sqlite(db)
    async with create_sqlite_agent_runtime_store(filename=db) as sqlite:
        (baseline,) = await journal(sqlite.store, "a")
        record = decode_agent_store_event(baseline)[1]
        assert record.compacted == ("t1:in",)  # what compaction had folded away is named, and kept
        assert await sqlite.store.load_snapshot(conversation_id="a") == before
        await turn(sqlite.store, "a", "t3")
        assert [e.seq for e in await journal(sqlite.store, "a")] == [1, 2, 3, 4]


@pytest.mark.postgres
async def test_postgres_layout_3_moves_forward_with_baselines(postgres_dsn: str, schema: str) -> None:
    import psycopg

    from threadline.store.postgres import create_postgres_agent_runtime_store

    async with create_postgres_agent_runtime_store(postgres_dsn, schema=schema) as pg:
        await turn(pg.store, "a", "t1")
        await turn(pg.store, "b", "t1")
        before = await pg.store.load_snapshot(conversation_id="a")
    async with await psycopg.AsyncConnection.connect(postgres_dsn, autocommit=True) as conn:
        await conn.execute(f'DROP TABLE "{schema}".threadline_events')
        await conn.execute(f"UPDATE \"{schema}\".threadline_meta SET value = '3' WHERE key = 'schema_version'")
        await conn.execute(f"UPDATE \"{schema}\".threadline_conversations SET body = (body::jsonb - 'event_seq')::text")
    async with create_postgres_agent_runtime_store(postgres_dsn, schema=schema) as pg:
        for cid in ("a", "b"):
            (baseline,) = await journal(pg.store, cid)
            assert baseline.kind == "runtime/baseline" and baseline.seq == 1
        assert await pg.store.load_snapshot(conversation_id="a") == before
        await turn(pg.store, "a", "t2")
        assert [e.seq for e in await journal(pg.store, "a")] == [1, 2, 3, 4]
        # purge removes the ledger with everything else, and the tombstone still guards the id
        assert (await pg.store.purge_conversation(conversation_id="a")).outcome == "purged"
        assert await journal(pg.store, "a") == []


# ------------------------------------------------------------------------------------ across drivers


@pytest.mark.postgres
async def test_export_import_export_is_byte_identical_across_memory_sqlite_and_postgres(
    tmp_path: Path, postgres_dsn: str, schema: str
) -> None:
    from threadline.store.postgres import create_postgres_agent_runtime_store

    source = create_memory_agent_runtime_store()
    await turn(source, "x", "t1")
    await source.append_event(conversation_id="x", kind="state/set", payload={"name": "goal", "value": "ship"})
    await turn(source, "x", "t2")
    queued = await source.accept_input_and_assign_run(
        conversation_id="x", idempotency_key="t3:key", input={"id": "t3:in", "parts": text("waiting")}
    )
    data = await source.export_conversation("x")
    async with create_sqlite_agent_runtime_store(filename=tmp_path / "x.db") as sqlite:
        await sqlite.store.import_conversation(data)
        via_sqlite = await sqlite.store.export_conversation("x")
    async with create_postgres_agent_runtime_store(postgres_dsn, schema=schema) as pg:
        await pg.store.import_conversation(via_sqlite)
        via_postgres = await pg.store.export_conversation("x")
        retry = await pg.store.accept_input_and_assign_run(
            conversation_id="x", idempotency_key="t3:key", input={"id": "t3:in", "parts": text("waiting")}
        )
        assert (retry.outcome, retry.run.id) == ("duplicate", queued.run.id)
    back = create_memory_agent_runtime_store()
    await back.import_conversation(via_postgres)
    assert via_sqlite == data and via_postgres == data and await back.export_conversation("x") == data


# -------------------------------------------------------------------------------------- provider records

LOOKUP = "lookup"


@define_agent_tool(name=LOOKUP)
async def lookup(query: str) -> dict[str, Any]:
    """Look a query up."""
    return {"query": query, "found": True}


async def _tool_then_answer(messages: list[Any], info: AgentInfo) -> AsyncIterator[Any]:
    last = messages[-1]
    if isinstance(last, ModelRequest) and any(isinstance(p, ToolReturnPart) for p in last.parts):
        yield "the answer, with the looked-up fact"
    else:
        yield {0: DeltaToolCall(name=LOOKUP, json_args='{"query": "q"}', tool_call_id=f"call_{len(messages)}")}


async def test_provider_requests_are_constant_size_checkable_and_cost_no_extra_commit(tmp_path: Path) -> None:
    model = FunctionModel(stream_function=_tool_then_answer, model_name="scripted")
    registry = define_model_registry(models={"m": {"model": model, "context_window": 10**6}})
    async with create_sqlite_agent_runtime_store(filename=tmp_path / "p.db") as sqlite:
        store = sqlite.store
        runtime = create_agent_runtime(
            protocol=define_agent_protocol(context=Context),
            store=store,
            models={"resolve": lambda: registry.resolve("m")},
            tools=[lookup],
        )
        sizes: list[dict[str, int]] = []
        writes: list[int] = []
        for k in range(12):
            before = sum(m.calls for name, m in store.metrics.items() if name not in _READS)
            result = await runtime.submit(
                conversation_id="p", idempotency_key=f"k{k}", context=Context(), parts=text(f"question {k}")
            ).result
            assert result.terminal_reason == "success"
            writes.append(sum(m.calls for name, m in store.metrics.items() if name not in _READS) - before)
            requests = [e for e in await journal(store, "p") if e.kind == "provider/request"]
            sizes.append({r.payload["step_number"]: len(json.dumps(r.payload)) for r in requests[-2:]})  # type: ignore[index]
        await runtime.close()
        events = await journal(store, "p")
    # a tool turn commits what it did before the ledger: admission+start, step finish, step 1's admission,
    # terminal; the provider records ride with them
    assert set(writes) == {4}
    assert check_provider_requests(events) == []
    bodies = [e for e in events if e.kind == "provider/message"]
    assert len({e.payload["sha256"] for e in bodies}) == len(bodies)  # type: ignore[index]
    # the request record does not grow with the conversation (same run id length, same digest counts)
    assert sizes[3] == sizes[-1]
    requests = [decode_agent_store_event(e)[1] for e in events if e.kind == "provider/request"]
    assert requests[-1].prefix.count > requests[2].prefix.count  # while the prefix it names grew
    kinds = [e.kind for e in events]
    assert kinds.count("provider/request") == 24
    assert kinds.count("runtime/transition") == 48
    # the runtime's own records are written without validating them again: each is its kind's typed record
    for event in events:
        assert decode_agent_store_event(event.model_dump(mode="json"))[1] is not None, event


_READS = frozenset({"load_snapshot", "load_changes", "load_run", "list_active_runs", "scan_recoverable", "read_events"})


def test_an_unknown_kind_is_refused_unless_ignorable() -> None:
    base = {
        "event_id": "e1",
        "conversation_id": "c",
        "seq": 1,
        "kind": "future/kind",
        "occurred_at": "2030-01-01T00:00:00Z",
        "payload": {},
    }
    with pytest.raises(AgentRecordValidationError) as caught:
        decode_agent_store_event(base)
    assert caught.value.field == "kind"
    assert decode_agent_store_event({**base, "ignorable": True})[1] is None
    with pytest.raises(AgentRecordValidationError) as caught:
        decode_agent_store_event({**base, "kind": "state/set", "schema_version": 2})
    assert caught.value.field == "schema_version"
    with pytest.raises(AgentRecordValidationError):  # ignorable never admits an extra envelope field
        decode_agent_store_event({**base, "ignorable": True, "extra": 1})
    with pytest.raises(AgentRecordValidationError):  # an offset is required
        decode_agent_store_event({**base, "kind": "state/set", "occurred_at": "2030-01-01T00:00:00"})
