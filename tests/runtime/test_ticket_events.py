"""``async for event in ticket.events():`` — one run's delivery events, in order, ending at its result;
bounded (a slow consumer reads a resync marker and never slows the run); independent of ``publish=``."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
from pydantic_ai.models.function import DeltaToolCall

from threadline import AgentConfigError, ResyncEvent, define_agent_tool

from .conftest import Script, answer_text, make_runtime, submit

WAIT = 10


@define_agent_tool
async def slow_lookup(query: str) -> str:
    """Looks up, slowly."""
    await asyncio.sleep(0)
    return query


async def tool_then_words(i: int, messages: list[Any], info: Any) -> AsyncIterator[Any]:
    if i == 0:
        yield "Let me look. "
        yield {1: DeltaToolCall(name="slow_lookup", json_args='{"query": "q"}', tool_call_id="call-1")}
    else:
        for word in ("The ", "answer ", "is ", "q."):
            yield word


async def collect(events: Any) -> list[Any]:
    async def read() -> list[Any]:
        return [event async for event in events]

    return await asyncio.wait_for(read(), WAIT)


async def test_a_tickets_events_are_its_runs_events_in_publish_order(store: Any) -> None:
    published: list[Any] = []
    runtime = make_runtime(store, Script(tool_then_words), tools=[slow_lookup], publish=published.append)
    ticket = submit(runtime, "k", "question")
    followed = await collect(ticket.events())
    result = await ticket.result
    await runtime.close()
    mine = [e for e in published if e.run_id == result.run.id]
    assert followed == mine  # the same objects, the same order
    kinds = [e.type for e in followed]
    assert kinds[0] == "admission" and kinds[-1] == "terminal"
    for kind in ("run-state", "assistant-delta", "assistant-checkpoint", "run-operation", "tool-status"):
        assert kind in kinds, kind
    assert "".join(e.delta for e in followed if e.type == "assistant-delta") == "Let me look. The answer is q."
    assert [e.status for e in followed if e.type == "tool-status"] == ["started", "completed"]
    assert followed[-1].terminal_reason == "success"


async def test_events_are_built_for_a_follower_without_any_publisher(store: Any) -> None:
    runtime = make_runtime(store, Script(tool_then_words), tools=[slow_lookup])  # no publish=
    ticket = submit(runtime, "k", "question")
    followed = await collect(ticket.events())
    await runtime.close()
    assert followed[0].type == "admission" and followed[-1].type == "terminal"
    assert sum(e.type == "assistant-delta" for e in followed) == 5


async def test_each_ticket_sees_only_its_own_run(store: Any) -> None:
    runtime = make_runtime(store, Script())
    one = submit(runtime, "k1", "one", conversation_id="a")
    two = submit(runtime, "k2", "two", conversation_id="b")
    first, second = await asyncio.gather(collect(one.events()), collect(two.events()))
    await runtime.close()
    assert {e.conversation_id for e in first} == {"a"} and {e.conversation_id for e in second} == {"b"}
    assert "".join(e.delta for e in first if e.type == "assistant-delta") == "answer to: one"
    assert "".join(e.delta for e in second if e.type == "assistant-delta") == "answer to: two"


async def test_a_slow_consumer_gets_a_resync_marker_and_never_slows_the_run(store: Any) -> None:
    async def chatty(i: int, messages: list[Any], info: Any) -> AsyncIterator[Any]:
        for n in range(60):
            yield f"w{n} "

    published: list[Any] = []
    runtime = make_runtime(store, Script(chatty), publish=published.append)
    ticket = submit(runtime, "k", "talk")
    events = ticket.events(capacity=8)
    result = await asyncio.wait_for(ticket.result, WAIT)  # the run ended while nobody read a thing
    followed = await collect(events)
    await runtime.close()
    mine = [e for e in published if e.run_id == result.run.id]
    markers = [e for e in followed if isinstance(e, ResyncEvent)]
    assert len(markers) == 1 and followed.index(markers[0]) == 8  # after what fitted
    assert markers[0].run_id == result.run.id and markers[0].conversation_id == "c1"
    assert followed[:8] == mine[:8]
    assert followed[-1].type == "terminal" and followed[-1] is mine[-1]  # the terminal is always kept
    assert len(followed) - 1 + markers[0].dropped == len(mine)


async def test_a_consumer_that_keeps_up_after_a_resync_gets_everything_after_it(store: Any) -> None:
    gate, first_burst_published = asyncio.Event(), asyncio.Event()

    async def two_bursts(i: int, messages: list[Any], info: Any) -> AsyncIterator[Any]:
        for n in range(20):
            yield f"a{n} "
        first_burst_published.set()  # the loop asks for more only once it published what came before
        await gate.wait()
        for n in range(3):
            yield f"b{n} "

    runtime = make_runtime(store, Script(two_bursts), loop={"checkpoint_every_events": 1000})
    ticket = submit(runtime, "k", "talk")
    events = ticket.events(capacity=4)
    await asyncio.wait_for(first_burst_published.wait(), WAIT)
    head = [await anext(events) for _ in range(5)]
    gate.set()
    rest = await collect(events)
    await runtime.close()
    assert [type(e).__name__ for e in head][-1] == "ResyncEvent" and head[4].dropped > 10
    assert [e.delta for e in rest if e.type == "assistant-delta"] == ["b0 ", "b1 ", "b2 "]
    assert not any(isinstance(e, ResyncEvent) for e in rest) and rest[-1].type == "terminal"


async def test_following_later_starts_with_the_next_event(store: Any) -> None:
    gate = asyncio.Event()

    async def paused(i: int, messages: list[Any], info: Any) -> AsyncIterator[Any]:
        yield "before "
        await gate.wait()
        yield "after"

    script = Script(paused)
    runtime = make_runtime(store, script)  # no publisher: nothing was built until someone followed
    ticket = submit(runtime, "k", "go")
    await script.wait_entered(0)
    events = ticket.events()
    gate.set()
    followed = await collect(events)
    await runtime.close()
    assert [e.delta for e in followed if e.type == "assistant-delta"] == ["after"]
    assert followed[-1].type == "terminal"


async def test_a_duplicate_submission_yields_its_admission_and_ends(store: Any) -> None:
    runtime = make_runtime(store, Script())
    await asyncio.wait_for(submit(runtime, "k", "hello").result, WAIT)
    again = submit(runtime, "k", "hello")
    followed = await collect(again.events())
    await runtime.close()
    assert [(e.type, e.outcome) for e in followed] == [("admission", "duplicate")]


async def test_an_interrupted_run_ends_its_events_with_its_terminal(store: Any) -> None:
    gate = asyncio.Event()

    async def stuck(i: int, messages: list[Any], info: Any) -> AsyncIterator[Any]:
        yield "partial"
        await gate.wait()
        yield "never"

    script = Script(stuck)
    runtime = make_runtime(store, script)
    ticket = submit(runtime, "k", "go")
    events = ticket.events()
    await script.wait_entered(0)
    admission = await ticket.admission
    await runtime.interrupt(conversation_id="c1", run_id=admission.run_id)
    followed = await collect(events)
    await runtime.close()
    assert followed[-1].type == "terminal" and followed[-1].terminal_reason == "interrupted"


async def test_breaking_out_stops_following(store: Any) -> None:
    runtime = make_runtime(store, Script(tool_then_words), tools=[slow_lookup])
    ticket = submit(runtime, "k", "question")
    events = ticket.events()
    seen = []
    async for event in events:
        seen.append(event.type)
        if event.type == "assistant-delta":
            await events.aclose()
            break
    result = await asyncio.wait_for(ticket.result, WAIT)
    await runtime.close()
    assert seen[-1] == "assistant-delta" and result.terminal_reason == "success"
    assert await collect(events) == []  # closed: nothing more arrives


def test_capacity_is_checked() -> None:
    from threadline import AgentRuntimeTicket

    loop = asyncio.new_event_loop()
    try:
        ticket = AgentRuntimeTicket(loop.create_future(), loop.create_future(), loop.create_future())
        with pytest.raises(Exception, match="not made by a runtime"):
            ticket.events()
    finally:
        loop.close()


async def test_capacity_must_be_positive(store: Any) -> None:
    runtime = make_runtime(store, Script())
    ticket = submit(runtime, "k", "hi")
    with pytest.raises(AgentConfigError):
        ticket.events(capacity=0)
    await asyncio.wait_for(ticket.result, WAIT)
    await runtime.close()


# ------------------------------------------------------------------ runs another process executes


async def _admit_here_execute_there(store: Any, publish: Any) -> tuple[Any, Any, Any]:
    """A runtime that only admits, and an executor over the same store publishing through ``publish`` (as
    a worker process does through its live relay). Returns (web runtime, executor, serving task)."""
    web = make_runtime(store, Script(), runs={"execute": False, "watch_interval": 0.05})
    executor = make_runtime(store, Script(tool_then_words), tools=[slow_lookup], publish=publish)
    serving = asyncio.ensure_future(executor.serve(resolve_context=lambda run: {"user_id": "u1"}, poll_interval=0.02))
    return web, executor, serving


async def _stop(*runtimes: Any, serving: Any) -> None:
    for runtime in runtimes:
        await runtime.close()
    serving.cancel()


async def test_relayed_events_reach_a_web_tickets_followers_in_the_executors_order(store: Any) -> None:
    relayed: list[Any] = []
    deliveries: list[Any] = []

    def relay(event: Any) -> None:  # a perfect relay: every event of the executor, in order
        relayed.append(event)
        deliveries[0].publish(event)

    web, executor, serving = await _admit_here_execute_there(store, relay)
    deliveries.append(web.relayed_delivery())
    ticket = submit(web, "k", "question")
    followed = await collect(ticket.events())
    result = await asyncio.wait_for(ticket.result, WAIT)
    await _stop(web, executor, serving=serving)
    mine = [e for e in relayed if e.run_id == result.run.id]
    # this process's admission (and queued run-state), then exactly what the executor published
    assert [e.type for e in followed[:2]] == ["admission", "run-state"]
    assert followed[2:] == [e for e in mine if e.type != "admission"]
    assert followed[-1].type == "terminal" and answer_text(result) == "Let me look. The answer is q."
    assert not any(isinstance(e, ResyncEvent) for e in followed)


async def test_a_loss_the_relay_reports_is_a_relay_gap_marker_where_it_was_noticed(store: Any) -> None:
    deliveries: list[Any] = []
    seen_deltas = 0

    def lossy_relay(event: Any) -> None:
        nonlocal seen_deltas
        if event.type == "assistant-delta":
            seen_deltas += 1
            if seen_deltas in (2, 3):  # lost on the way, and the relay noticed
                if seen_deltas == 2:
                    deliveries[0].lost(event.conversation_id)
                return
        deliveries[0].publish(event)

    web, executor, serving = await _admit_here_execute_there(store, lossy_relay)
    deliveries.append(web.relayed_delivery())
    ticket = submit(web, "k", "question")
    followed = await collect(ticket.events())
    await _stop(web, executor, serving=serving)
    markers = [i for i, e in enumerate(followed) if isinstance(e, ResyncEvent)]
    assert len(markers) == 1
    marker = followed[markers[0]]
    assert (marker.reason, marker.dropped, marker.conversation_id) == ("relay-gap", None, "c1")
    deltas_before = [e.delta for e in followed[: markers[0]] if e.type == "assistant-delta"]
    assert deltas_before == ["Let me look. "]
    assert followed[-1].type == "terminal"


async def test_a_terminal_the_relay_never_brought_comes_from_the_store_after_a_marker(store: Any) -> None:
    web, executor, serving = await _admit_here_execute_there(store, None)  # the executor relays nothing
    delivery = web.relayed_delivery()  # but this runtime is told a relay feeds it
    ticket = submit(web, "k", "question")
    followed = await collect(ticket.events())
    result = await asyncio.wait_for(ticket.result, WAIT)
    await _stop(web, executor, serving=serving)
    delivery.close()
    assert [e.type for e in followed] == ["admission", "run-state", "resync", "terminal"]
    assert followed[2].reason == "relay-gap"
    terminal = followed[3]
    assert terminal.run_id == result.run.id and terminal.terminal_reason == "success"
    assert terminal.assistant.id == result.assistant.id and terminal.version == result.run.version


async def test_without_a_relay_a_web_ticket_ends_after_its_admission_as_before(store: Any) -> None:
    web, executor, serving = await _admit_here_execute_there(store, None)
    ticket = submit(web, "k", "question")
    followed = await collect(ticket.events())
    await _stop(web, executor, serving=serving)
    assert [e.type for e in followed] == ["admission", "run-state"]
