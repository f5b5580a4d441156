"""The relay's contract on real SQLite files and the real PostgreSQL server, within one process: two relay
objects on one store are two publishers/subscribers exactly as two processes' would be (each has its own
origin and its own connections).

What a publisher sends is decided by the test (events of a real run, replayed with a loss of the test's
choosing), so every gap here is certain and every heal observable.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import psycopg
import pytest
from psycopg import sql
from pydantic_ai.models.function import FunctionModel

from threadline import (
    create_agent_runtime,
    create_memory_agent_runtime_store,
    define_agent_protocol,
    define_model_registry,
)
from threadline.errors import AgentRuntimeUsageError
from threadline.events import AssistantDeltaEvent
from threadline.harness import AgentEventHub
from threadline.live import NOTIFY_PAYLOAD_LIMIT, create_agent_live_relay

from .conftest import WAIT, terminal_of, text_of


async def words(messages: list[Any], info: Any) -> AsyncIterator[str]:
    for word in ("one ", "two ", "three ", "four ", "five"):
        yield word


class Hub:
    """An event hub and what it delivered."""

    def __init__(self) -> None:
        self.hub = AgentEventHub()
        self.events: list[Any] = []
        self._changed = asyncio.Event()
        self.hub.subscribe(self._on)

    def _on(self, event: Any) -> None:
        self.events.append(event)
        self._changed.set()

    async def until(self, predicate: Any) -> Any:
        async with asyncio.timeout(WAIT):
            while not (found := predicate(self.events)):
                self._changed.clear()
                await self._changed.wait()
            return found


async def run_turns(store: Any, *keys: str) -> tuple[list[Any], list[Any]]:
    """Execute one turn per key in conversation c1 in this process; return the results and every delivery
    event the runtime published (nothing was relayed yet: the test replays them)."""
    published: list[Any] = []
    registry = define_model_registry(models={"m": {"model": FunctionModel(stream_function=words)}})
    runtime = create_agent_runtime(
        protocol=define_agent_protocol(),
        store=store,
        models={"resolve": lambda: registry.resolve("m")},
        publish=published.append,
    )
    results = []
    for key in keys:
        ticket = runtime.submit(
            conversation_id="c1", idempotency_key=key, context=None, parts=[{"type": "text", "text": key}]
        )
        results.append(await asyncio.wait_for(ticket.result, WAIT))
    await runtime.close()
    return results, published


async def test_a_transient_gap_heals_the_conversation_from_the_store(store_handle: Any) -> None:
    (result,), published = await run_turns(store_handle.store, "k1")
    run_id = result.run.id
    missing = next(e for e in published if e.type == "assistant-delta" and e.sequence == 2)
    async with create_agent_live_relay(store_handle) as worker, create_agent_live_relay(store_handle) as web:
        seam = Hub()
        subscription = await web.subscribe(seam.hub)
        # the worker's frames lose one delta and never carry the terminal
        for event in published:
            if event is not missing and event.type != "terminal":
                worker.publish(event)
        terminal = await seam.until(terminal_of(run_id))
        await asyncio.wait_for(subscription.drain(), WAIT)

    status = subscription.status()
    assert status.gaps == 1 and status.heals >= 1
    assert terminal.terminal_reason == "success" and text_of(terminal.assistant) == "one two three four five"
    assert terminal.version >= result.run.version
    assert not any(e.type == "assistant-delta" and e.sequence == 2 for e in seam.events)


async def test_a_durable_event_older_than_the_seams_is_healed_not_dropped(store_handle: Any) -> None:
    (first, second), published = await run_turns(store_handle.store, "k1", "k2")
    newer = next(e for e in published if e.type == "admission" and e.run_id == second.run.id)
    async with create_agent_live_relay(store_handle) as worker, create_agent_live_relay(store_handle) as web:
        seam = Hub()
        subscription = await web.subscribe(seam.hub)
        seam.hub.publish(newer)  # this process's own runtime published a newer fact first
        for event in published:
            if event.run_id == first.run.id:
                worker.publish(event)
        await seam.until(lambda events: sum(e.type == "terminal" for e in events) >= 1)
        await worker.flush()
        await asyncio.wait_for(subscription.drain(), WAIT)

    status = subscription.status()
    assert status.late >= 1 and status.heals >= 1
    terminal = terminal_of(first.run.id)(seam.events)
    assert terminal.version >= newer.version  # stamped so that downstream cursors accept it
    conversation = None
    from threadline.delivery import reduce_agent_control_event

    for event in seam.events:
        conversation = reduce_agent_control_event(conversation, event)
    assert conversation is not None
    view = conversation.conversations["c1"]
    assert view.run_states[first.run.id] == "completed"
    assert any(m.id == first.assistant.id and text_of(m) == text_of(first.assistant) for m in view.messages)


async def test_a_publisher_that_drops_events_reports_them_lost_and_they_heal(store_handle: Any) -> None:
    (result,), published = await run_turns(store_handle.store, "k1")
    async with (
        create_agent_live_relay(store_handle, capacity=2) as worker,
        create_agent_live_relay(store_handle) as web,
    ):
        seam = Hub()
        subscription = await web.subscribe(seam.hub)
        for event in published:  # all at once: the queue holds two
            worker.publish(event)
        terminal = await seam.until(terminal_of(result.run.id))
        sent = worker.status()

    assert sent.dropped == len(published) - 2 and sent.published == len(published)
    status = subscription.status()
    assert status.gaps >= 1 and status.heals >= 1
    assert text_of(terminal.assistant) == text_of(result.assistant)


async def test_a_process_does_not_receive_its_own_frames(store_handle: Any) -> None:
    own = AssistantDeltaEvent(conversation_id="c1", run_id="r1", runtime_epoch="e1", sequence=1, delta="own")
    other = AssistantDeltaEvent(conversation_id="c1", run_id="r2", runtime_epoch="e2", sequence=1, delta="other")
    async with create_agent_live_relay(store_handle) as here, create_agent_live_relay(store_handle) as there:
        seam = Hub()
        await here.subscribe(seam.hub)
        here.publish(own)
        await asyncio.wait_for(here.flush(), WAIT)
        there.publish(other)  # sent after ours: had ours come back, it would be here first
        await seam.until(lambda events: any(e.delta == "other" for e in events))
    assert [e.delta for e in seam.events] == ["other"]


async def test_relay_rows_stay_bounded(store_handle: Any) -> None:
    big = "x" * (NOTIFY_PAYLOAD_LIMIT + 100)  # a frame of its own, through the table on PostgreSQL too
    async with create_agent_live_relay(store_handle, max_rows=8) as relay:
        for sequence in range(1, 61):
            relay.publish(
                AssistantDeltaEvent(conversation_id="c1", run_id="r1", runtime_epoch="e", sequence=sequence, delta=big)
            )
            await asyncio.wait_for(relay.flush(), WAIT)
            assert _relay_rows(store_handle) <= 8 + 2  # max_rows, and at most a quarter more before a prune
        status = relay.status()
    assert status.table_frames == 60 and status.pruned >= 50


def _relay_rows(store_handle: Any) -> int:
    if store_handle.worker_args[0] == "sqlite":
        import sqlite3

        with sqlite3.connect(f"{store_handle.filename}-live") as conn:
            return int(conn.execute("SELECT count(*) FROM live_relay").fetchone()[0])
    dsn, schema = store_handle.worker_args[1:]
    with psycopg.connect(dsn) as conn:
        row = conn.execute(sql.SQL("SELECT count(*) FROM {}").format(sql.Identifier(schema, "live_relay"))).fetchone()
        return int(row[0]) if row else 0


async def test_closing_sends_what_was_published(store_handle: Any) -> None:
    (_result,), published = await run_turns(store_handle.store, "k1")
    async with create_agent_live_relay(store_handle) as web:
        seam = Hub()
        subscription = await web.subscribe(seam.hub)
        worker = await create_agent_live_relay(store_handle).open()
        for event in published:
            worker.publish(event)
        closed = await worker.aclose()
        assert closed.sent_events == len(published) and closed.dropped == 0 and closed.closed
        worker.publish(published[0])  # after closing: dropped, never raised
        assert worker.status().dropped == 1
        await seam.until(lambda events: len(events) == len(published))
        assert subscription.status().gaps == 0
    assert [(e.type, e.run_id) for e in seam.events] == [(e.type, e.run_id) for e in published]


@pytest.mark.postgres
@pytest.mark.parametrize("backend", ["postgres"], indirect=True)
async def test_processes_opening_at_once_create_the_relay_table_once(store_handle: Any) -> None:
    relays = [create_agent_live_relay(store_handle) for _ in range(4)]
    await asyncio.gather(*(relay.open() for relay in relays))
    for relay in relays:
        await relay.aclose()
    assert _relay_rows(store_handle) == 0


async def test_refusals_name_what_to_fix(tmp_path: Any) -> None:
    with pytest.raises(AgentRuntimeUsageError, match="SQLite or PostgreSQL"):
        create_agent_live_relay(create_memory_agent_runtime_store())
    with pytest.raises(AgentRuntimeUsageError, match="AgentRuntimeStore or a store handle"):
        create_agent_live_relay("threadline.db")
    from threadline.store.sqlite import create_sqlite_agent_runtime_store

    async with create_sqlite_agent_runtime_store(tmp_path / "t.db") as handle:
        for name, value in (("capacity", 0), ("max_rows", -1), ("max_age", 0), ("poll_interval", "1")):
            with pytest.raises(AgentRuntimeUsageError, match=name):
                create_agent_live_relay(handle, **{name: value})
        async with create_agent_live_relay(handle) as relay:
            with pytest.raises(AgentRuntimeUsageError, match="target"):
                await relay.subscribe(42)
            relay.publish({"type": "nonsense"})  # not a delivery event: dropped and counted, never raised
            assert relay.status().dropped == 1
