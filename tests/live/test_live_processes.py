"""Two real processes on one store: a web process that only admits and a worker that executes.

The web process's seam (its harness's event hub, which the control server and HTTP transports read)
receives the worker's reasoning, tool status and progress, deltas and terminal while the run is still
running; relay rows pruned before they were read and a dropped LISTEN connection are detected and healed
from the store. The losses are made certain, not likely: the web process's event loop is blocked (as a
stalled process would be) while the worker finishes, and the rows or the connection go meanwhile.
"""

from __future__ import annotations

import asyncio
import sqlite3
from typing import Any

import psycopg
import pytest
from psycopg import sql

from threadline.live import NOTIFY_PAYLOAD_LIMIT, create_agent_live_relay
from threadline.live.postgres import live_channel

from .conftest import WAIT, Seam, terminal_of, text_of, web_harness

pytestmark = [pytest.mark.subprocess]

BIG = NOTIFY_PAYLOAD_LIMIT + 2_000  # the answer outgrows a NOTIFY payload: it travels through the relay table


def submit(seam: Seam, key: str = "k1", conversation_id: str = "c1") -> Any:
    return seam.harness.submit(
        conversation_id=conversation_id, idempotency_key=key, context=None, parts=[{"type": "text", "text": "hello"}]
    )


def first_words(run_id: str) -> Any:
    return lambda events: any(
        e.type == "assistant-delta" and e.run_id == run_id and e.delta == "first " for e in events
    )


async def test_the_web_process_sees_the_workers_stream_live(store_handle: Any, start_worker: Any) -> None:
    worker = await start_worker("--hold", "--big", str(BIG))
    async with create_agent_live_relay(store_handle) as relay:
        seam = Seam(web_harness(store_handle.store, publish=relay.publish))
        subscription = await relay.subscribe(seam.harness)
        ticket = submit(seam)
        run_id = (await asyncio.wait_for(ticket.admission, WAIT)).run_id

        await seam.until(first_words(run_id))
        # live: the answer's first words are here while the worker still holds the run
        loaded = await store_handle.store.load_run(conversation_id="c1", run_id=run_id)
        assert loaded is not None and loaded.run.state == "running"
        seen = [e for e in seam.events if e.run_id == run_id]
        kinds = {e.type for e in seen}
        assert {"reasoning-start", "reasoning-delta", "tool-status", "tool-progress", "run-state"} <= kinds
        statuses = [e.status for e in seen if e.type == "tool-status"]
        assert statuses == ["started", "completed"]
        progress = next(e for e in seen if e.type == "tool-progress")
        assert (progress.message, progress.progress, progress.total) == ("looking up q", 1, 2)
        web_epoch = seam.harness.runtime.runtime_epoch
        assert {e.runtime_epoch for e in seen if not getattr(e, "durable", True)} - {web_epoch}

        worker.release()
        terminal = await seam.until(terminal_of(run_id))
        result = await asyncio.wait_for(ticket.result, WAIT)

    answer = text_of(result.assistant)
    assert answer.startswith("first words then more answer to: hello") and len(answer) > BIG
    assert terminal.terminal_reason == "success" and text_of(terminal.assistant) == answer
    transient = [e for e in seam.events if e.run_id == run_id and not e.durable]
    assert [e.sequence for e in transient] == list(range(1, len(transient) + 1))  # nothing lost, in order
    assert "".join(e.delta for e in transient if e.type == "assistant-delta") == answer
    conversation = seam.view().conversations["c1"]
    assert not conversation.resync_required
    assert conversation.run_states[run_id] == "completed"
    assert text_of(next(m for m in conversation.messages if m.id == result.assistant.id)) == answer
    status = subscription.status()
    assert (status.gaps, status.heals, status.late) == (0, 0, 0)


def _drop_relay_rows(store_handle: Any) -> int:
    """Delete every relay row, as pruning does to rows nobody read in time (blocking: the loop is stalled)."""
    if store_handle.worker_args[0] == "sqlite":
        with sqlite3.connect(f"{store_handle.filename}-live") as conn:
            return conn.execute("DELETE FROM live_relay").rowcount
    dsn, schema = store_handle.worker_args[1:]
    with psycopg.connect(dsn, autocommit=True) as conn:
        return conn.execute(sql.SQL("DELETE FROM {}").format(sql.Identifier(schema, "live_relay"))).rowcount


async def test_relay_rows_pruned_before_they_were_read_heal_from_the_store(
    store_handle: Any, start_worker: Any
) -> None:
    worker = await start_worker("--hold", "--big", str(BIG))
    async with create_agent_live_relay(store_handle) as relay:
        seam = Seam(web_harness(store_handle.store, publish=relay.publish))
        subscription = await relay.subscribe(seam.harness)
        ticket = submit(seam)
        run_id = (await asyncio.wait_for(ticket.admission, WAIT)).run_id
        await seam.until(first_words(run_id))

        # the web process stalls; the worker finishes; the rows it wrote are pruned before anyone read them
        worker.release()
        worker.expect_blocking("DONE")
        assert _drop_relay_rows(store_handle) >= 1

        terminal = await seam.until(terminal_of(run_id))
        result = await asyncio.wait_for(ticket.result, WAIT)
        await asyncio.wait_for(subscription.drain(), WAIT)

    status = subscription.status()
    assert status.gaps >= 1 and status.heals >= 1 and status.healed_events >= 1
    assert terminal.terminal_reason == "success"
    assert text_of(terminal.assistant) == text_of(result.assistant)
    assert terminal.version >= result.run.version  # read from the store, stamped with the version read
    conversation = seam.view().conversations["c1"]
    assert conversation.run_states[run_id] == "completed"
    assert run_id not in conversation.transient_by_run


@pytest.mark.postgres
@pytest.mark.parametrize("backend", ["postgres"], indirect=True)
async def test_a_dropped_listen_connection_is_detected_and_healed(store_handle: Any, start_worker: Any) -> None:
    worker = await start_worker("--hold")
    dsn, schema = store_handle.worker_args[1:]
    async with create_agent_live_relay(store_handle) as relay:
        seam = Seam(web_harness(store_handle.store, publish=relay.publish))
        subscription = await relay.subscribe(seam.harness)
        ticket = submit(seam)
        run_id = (await asyncio.wait_for(ticket.admission, WAIT)).run_id
        await seam.until(first_words(run_id))

        # the web process stalls with its LISTEN connection gone; the worker's frames meanwhile reach no one
        listen = sql.SQL("LISTEN {}").format(sql.Identifier(live_channel(schema))).as_string(None)
        with psycopg.connect(dsn, autocommit=True) as conn:
            ended = conn.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE query = %s", (listen,)
            ).fetchall()
        assert ended == [(True,)]
        worker.release()
        worker.expect_blocking("DONE")

        terminal = await seam.until(terminal_of(run_id))
        result = await asyncio.wait_for(ticket.result, WAIT)

    status = subscription.status()
    assert status.gaps >= 1 and status.heals >= 1
    assert terminal.terminal_reason == "success" and text_of(terminal.assistant) == text_of(result.assistant)
    assert not any(e.type == "assistant-delta" and e.delta == "words " for e in seam.events)  # those were lost
    assert seam.view().conversations["c1"].run_states[run_id] == "completed"
