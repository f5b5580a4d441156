"""``ticket.events()`` in a web process that only admits, for a run a worker process executes: with the
live relay subscribed to the web runtime, the ticket's follower yields the worker's events in the
worker's order and ends with the terminal; a relay gap yields a ``relay-gap`` resync marker, then what
the relay healed from the store. Two real processes, on SQLite and on PostgreSQL."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from threadline import ResyncEvent
from threadline.live import create_agent_live_relay

from .conftest import WAIT, Seam, text_of, web_harness
from .test_live_processes import BIG, _drop_relay_rows, submit

pytestmark = [pytest.mark.subprocess]


class Follow:
    """Reads a ticket's events on a task of its own, as an application would."""

    def __init__(self, ticket: Any) -> None:
        self.events: list[Any] = []
        self._changed = asyncio.Event()
        self.task = asyncio.ensure_future(self._read(ticket.events()))

    async def _read(self, events: Any) -> None:
        async for event in events:
            self.events.append(event)
            self._changed.set()

    async def until(self, predicate: Any) -> None:
        async with asyncio.timeout(WAIT):
            while not predicate(self.events):
                self._changed.clear()
                await self._changed.wait()

    async def ended(self) -> list[Any]:
        await asyncio.wait_for(self.task, WAIT)
        return self.events


def said_first(events: list[Any]) -> bool:
    return any(e.type == "assistant-delta" and e.delta == "first " for e in events)


async def test_a_web_tickets_events_are_the_workers_events_in_order(store_handle: Any, start_worker: Any) -> None:
    worker = await start_worker("--hold")
    async with create_agent_live_relay(store_handle) as relay:
        handed: list[Any] = []  # what the web harness's publish= receives: its own events and the relayed

        def publish(event: Any) -> None:
            handed.append(event)
            relay.publish(event)

        seam = Seam(web_harness(store_handle.store, publish=publish))
        await relay.subscribe(seam.harness)
        ticket = submit(seam)
        follow = Follow(ticket)

        await follow.until(said_first)
        # live: the first words reached the ticket while the worker still holds the run
        run_id = ticket.run_id
        loaded = await store_handle.store.load_run(conversation_id="c1", run_id=run_id)
        assert loaded is not None and loaded.run.state == "running" and not ticket.result.done()
        worker.release()
        followed = await follow.ended()
        result = await asyncio.wait_for(ticket.result, WAIT)
        published = relay.status().published

    kinds = [e.type for e in followed]
    assert kinds[0] == "admission" and kinds[-1] == "terminal" and kinds.count("terminal") == 1
    assert not any(isinstance(e, ResyncEvent) for e in followed)
    assert [e.status for e in followed if e.type == "tool-status"] == ["started", "completed"]
    progress = next(e for e in followed if e.type == "tool-progress")
    assert (progress.message, progress.progress, progress.total) == ("looking up q", 1, 2)
    # in the worker's order: reasoning, then the tool, then the answer; every transient event, once
    assert kinds.index("reasoning-delta") < kinds.index("tool-status") < kinds.index("assistant-delta")
    transient = [e for e in followed if not e.durable]
    assert {e.runtime_epoch for e in transient} == {transient[0].runtime_epoch}
    assert transient[0].runtime_epoch != seam.harness.runtime.runtime_epoch  # the worker's, not ours
    assert [e.sequence for e in transient] == list(range(1, len(transient) + 1))
    answer = text_of(result.assistant)
    assert answer == "first words then more answer to: hello"
    assert "".join(e.delta for e in followed if e.type == "assistant-delta") == answer
    assert followed[-1].terminal_reason == "success" and text_of(followed[-1].assistant) == answer
    # the same events reached the hub (every transport) and the application's publish=, and none of the
    # worker's went back out through the relay: it sent this process's admission and queued run-state only
    assert [e for e in seam.events if e.run_id == run_id and not e.durable] == transient
    assert [e for e in handed if e.run_id == run_id and not e.durable] == transient
    assert published == 2 and [e.type for e in handed[:2]] == ["admission", "run-state"]


async def test_a_relay_gap_reaches_the_ticket_as_a_resync_marker_then_the_healed_terminal(
    store_handle: Any, start_worker: Any
) -> None:
    worker = await start_worker("--hold", "--big", str(BIG))
    async with create_agent_live_relay(store_handle) as relay:
        seam = Seam(web_harness(store_handle.store, publish=relay.publish))
        subscription = await relay.subscribe(seam.harness)
        ticket = submit(seam)
        follow = Follow(ticket)
        await follow.until(said_first)

        # the web process stalls; the worker finishes; its relay rows are pruned before anyone read them
        worker.release()
        worker.expect_blocking("DONE")
        assert _drop_relay_rows(store_handle) >= 1

        followed = await follow.ended()
        result = await asyncio.wait_for(ticket.result, WAIT)

    assert subscription.status().heals >= 1
    markers = [i for i, e in enumerate(followed) if isinstance(e, ResyncEvent)]
    assert len(markers) == 1
    marker = followed[markers[0]]
    assert (marker.reason, marker.run_id, marker.conversation_id, marker.dropped) == (
        "relay-gap",
        result.run.id,
        "c1",
        None,
    )
    before, after = followed[: markers[0]], followed[markers[0] + 1 :]
    assert said_first(before)
    # what was lost is not made up: after the marker only durable facts the heal read from the store
    assert all(e.durable for e in after)
    assert after[-1].type == "terminal" and [e.type for e in after].count("terminal") == 1
    assert after[-1].terminal_reason == "success" and text_of(after[-1].assistant) == text_of(result.assistant)
    assert len(text_of(result.assistant)) > BIG


async def test_a_plain_runtime_subscribed_to_the_relay_gets_the_workers_events(
    store_handle: Any, start_worker: Any
) -> None:
    await start_worker()
    async with create_agent_live_relay(store_handle) as relay:
        handed: list[Any] = []

        def publish(event: Any) -> None:
            handed.append(event)
            relay.publish(event)

        runtime = web_harness(store_handle.store, publish=publish).runtime  # the runtime alone, no hub
        subscription = await relay.subscribe(runtime)
        ticket = runtime.submit(
            conversation_id="c1", idempotency_key="k1", context=None, parts=[{"type": "text", "text": "hello"}]
        )
        followed = await Follow(ticket).ended()
        result = await asyncio.wait_for(ticket.result, WAIT)
        await subscription.close()
        await runtime.close()

    assert followed[-1].type == "terminal" and text_of(followed[-1].assistant) == text_of(result.assistant)
    assert "".join(e.delta for e in followed if e.type == "assistant-delta") == text_of(result.assistant)
    assert [e for e in handed if e.run_id == result.run.id] == [e for e in followed if e.run_id == result.run.id]
    assert relay.status().published == 2  # its own admission and queued run-state
