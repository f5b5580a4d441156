"""Delivery (``threadline.delivery``): cursors, bounded sinks and the control-view reducer.

Pins. Cursor: an ordinary transient stream is all ``fresh``; one lost transient event is exactly one
``gap``; replays are ``duplicate``; durable events whose versions skip are ``fresh`` and never a gap;
scoping is per conversation (durable) and per run (transient). Sink: ``publish`` never raises and never
blocks — a raising consumer has every failure reported, a stalled consumer fills the bounded queue and the
rest is dropped and counted; durable ids are delivered once; ``project`` returning None drops; operator
``cause`` is redacted unless opted in. Reducer: pure; ``attempt-reset`` withdraws streamed text; tool
progress is kept until the call's final status; a transient gap requires a resync, which a snapshot
clears. Sink tests never depend on timing: a stalled consumer awaits an ``asyncio.Event`` never set.
"""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime

import pytest

from threadline.delivery import (
    AgentMultiSessionCursor,
    AgentRuntimeEventCursor,
    advance_agent_multi_session_cursor,
    advance_agent_runtime_event_cursor,
    create_agent_control_view,
    create_agent_operator_sink,
    create_agent_runtime_event_sink,
    reduce_agent_control_event,
    reduce_agent_control_snapshot,
)
from threadline.errors import AgentRuntimeUsageError
from threadline.events import (
    AdmissionEvent,
    AgentRunTerminalEvent,
    AssistantCheckpointEvent,
    AssistantDeltaEvent,
    AttemptResetEvent,
    ReasoningDeltaEvent,
    ReasoningEndEvent,
    ReasoningStartEvent,
    RunStateEvent,
    TerminalEvent,
    ToolProgressEvent,
    ToolStatusEvent,
    durable_event_id,
)
from threadline.records import ConversationSnapshot, Message, ReasoningPart, Run, TextPart
from threadline.usage import AgentUsage

NOW = datetime(2025, 1, 2, 3, 4, 5, tzinfo=UTC)


def delta(seq: int, text: str = "x", *, run: str = "r1", conv: str = "c1", epoch: str = "e1") -> AssistantDeltaEvent:
    return AssistantDeltaEvent(conversation_id=conv, run_id=run, runtime_epoch=epoch, sequence=seq, delta=text)


def transient(cls, seq: int, *, run: str = "r1", conv: str = "c1", **fields):
    return cls(conversation_id=conv, run_id=run, runtime_epoch="e1", sequence=seq, **fields)


def run_state(version: int, state: str = "running", *, run: str = "r1", conv: str = "c1") -> RunStateEvent:
    return RunStateEvent(
        event_id=durable_event_id(run, "run-state", version),
        conversation_id=conv,
        run_id=run,
        version=version,
        state=state,
    )


def checkpoint(version: int, *parts, run: str = "r1", conv: str = "c1") -> AssistantCheckpointEvent:
    return AssistantCheckpointEvent(
        event_id=durable_event_id(run, "assistant-checkpoint", version),
        conversation_id=conv,
        run_id=run,
        version=version,
        message_id="a1",
        parts=parts,
    )


def message(mid: str, role: str, status: str, *parts, run: str | None = None) -> Message:
    return Message(
        id=mid, conversation_id="c1", role=role, status=status, parts=parts, run_id=run, created_at=NOW, seq=1
    )


def terminal(version: int, reason: str = "success", *, run: str = "r1", text: str = "done") -> TerminalEvent:
    return TerminalEvent(
        event_id=durable_event_id(run, "terminal", version),
        conversation_id="c1",
        run_id=run,
        version=version,
        terminal_reason=reason,
        assistant=message("a1", "assistant", "completed", TextPart(text=text), run=run),
        usage=AgentUsage(),
    )


def classify(events, cursor=None, advance=advance_agent_runtime_event_cursor):
    out = []
    for event in events:
        cursor, classification = advance(cursor, event)
        out.append(classification)
    return cursor, out


# ------------------------------------------------------------------------------------------------- cursor


def test_an_ordinary_transient_stream_is_all_fresh():
    _, out = classify(delta(n) for n in range(1, 51))
    assert out == ["fresh"] * 50


def test_one_lost_transient_event_is_exactly_one_gap():
    _, out = classify(delta(n) for n in range(1, 11) if n != 4)
    assert out.count("gap") == 1
    assert out[3] == "gap"  # sequence 5, right after 3
    assert out.count("fresh") == 8


def test_replays_are_duplicates():
    cursor, _ = classify(delta(n) for n in range(1, 6))
    _, out = classify([delta(n) for n in range(1, 6)], cursor)
    assert out == ["duplicate"] * 5


def test_durable_versions_that_skip_are_fresh_never_a_gap():
    events = [
        run_state(1, "queued"),
        run_state(4),
        checkpoint(9),
        run_state(9, "completed"),
        terminal(9),
        checkpoint(30),
    ]
    cursor, out = classify(events)
    assert out == ["fresh"] * 6
    # the same id again, and anything older than what was seen, is a duplicate
    _, replay = classify([terminal(9), run_state(4), checkpoint(30)], cursor)
    assert replay == ["duplicate"] * 3


def test_several_durable_events_share_one_version():
    cursor, out = classify([run_state(5, "completed"), terminal(5)])
    assert out == ["fresh", "fresh"]
    assert classify([terminal(5)], cursor)[1] == ["duplicate"]


def test_transient_sequences_are_per_run_and_per_epoch():
    events = [delta(1, run="r1"), delta(2, run="r1"), delta(1, run="r2"), delta(3, run="r1"), delta(2, run="r2")]
    _, out = classify(events)
    assert out == ["fresh"] * 5
    # a restarted runtime (new epoch) numbers the same run from 1 again
    cursor, _ = classify([delta(n) for n in (1, 2, 3)])
    assert classify([delta(1, epoch="e2"), delta(2, epoch="e2")], cursor)[1] == ["fresh", "fresh"]
    # a run first seen mid-stream is a gap: its first events were missed
    assert classify([delta(7, run="r9")])[1] == ["gap"]


def test_the_cursor_is_pure_and_takes_json_events():
    cursor = AgentRuntimeEventCursor()
    advanced, classification = advance_agent_runtime_event_cursor(cursor, delta(1).model_dump(mode="json"))
    assert classification == "fresh"
    assert cursor == AgentRuntimeEventCursor()
    assert advanced.runs["r1"].sequence == 1


def test_multi_session_scoping_two_conversations_two_runs():
    events = [
        run_state(40, conv="c1"),
        run_state(3, conv="c2", run="r2"),  # a lower version in another conversation is not a regression
        delta(1, conv="c1"),
        delta(1, conv="c2", run="r2"),
        delta(2, conv="c1"),
        delta(3, conv="c2", run="r2"),  # r2 lost its 2
        checkpoint(41, TextPart(text="xx"), conv="c1"),
        delta(3, conv="c1"),
        run_state(2, conv="c2", run="r2"),  # older than c2's 3
    ]
    cursor, out = classify(events, AgentMultiSessionCursor(), advance_agent_multi_session_cursor)
    assert out == ["fresh", "fresh", "fresh", "fresh", "fresh", "gap", "fresh", "fresh", "duplicate"]
    assert cursor.conversations["c1"].version == 41
    assert cursor.conversations["c2"].version == 3
    assert cursor.conversations["c2"].runs["r2"].sequence == 3


# --------------------------------------------------------------------------------------------------- sinks


async def test_a_consumer_that_always_raises_never_reaches_publish():
    errors: list[tuple[BaseException, object]] = []

    def deliver(event):
        raise RuntimeError(f"transport down for {event.sequence}")

    sink = create_agent_runtime_event_sink(
        deliver=deliver, capacity=10, on_publish_error=lambda e, ev: errors.append((e, ev))
    )
    events = [delta(n) for n in range(1, 6)]
    for event in events:
        assert sink(event) is None  # usable as the runtime's publish= callback
    await sink.drain()
    assert [ev for _, ev in errors] == events
    assert all(isinstance(e, RuntimeError) for e, _ in errors)
    assert sink.failed == 5 and sink.delivered == 0
    # delivery goes on after failures
    assert (await sink.aclose()).failed == 5


async def test_a_stalled_consumer_fills_the_queue_and_the_rest_is_dropped():
    never = asyncio.Event()
    started: list[object] = []
    drops: list[str] = []

    async def deliver(event):
        started.append(event)
        await never.wait()

    sink = create_agent_runtime_event_sink(deliver=deliver, capacity=3, on_drop=lambda e, reason: drops.append(reason))
    for n in range(1, 101):
        sink.publish(delta(n))  # returns at once: nothing here awaits
    assert sink.dropped == 97
    assert sink.pending == 3
    await asyncio.sleep(0)  # let the delivery task take the first event and stall on it
    assert len(started) == 1
    sink.publish(delta(101))  # one free slot again
    sink.publish(delta(102))
    assert sink.dropped == 98
    assert drops == ["capacity"] * 98
    status = await sink.aclose(timeout=0)
    assert status.closed
    assert status.dropped == 98 + 3  # the stalled one and the two queued are dropped at close
    sink.publish(delta(103))
    assert sink.dropped == 102 and drops[-1] == "closed"


async def test_durable_ids_are_delivered_once():
    delivered: list[object] = []
    sink = create_agent_runtime_event_sink(deliver=delivered.append, capacity=100)
    for _ in range(3):
        sink.publish(terminal(9))
        sink.publish(run_state(9, "completed"))
    sink.publish(delta(1))
    sink.publish(delta(1))  # transient events are the cursor's business, not deduplicated here
    await sink.drain()
    assert [e.type for e in delivered] == ["terminal", "run-state", "assistant-delta", "assistant-delta"]
    assert sink.duplicates == 4
    await sink.aclose()


async def test_project_returning_none_drops_and_a_projection_is_delivered():
    delivered: list[object] = []

    def project(event):
        if event.type == "reasoning-delta":
            return None
        if event.type == "assistant-delta":
            return {"text": event.delta}
        return event

    sink = create_agent_runtime_event_sink(deliver=delivered.append, capacity=10, project=project)
    sink.publish(transient(ReasoningDeltaEvent, 1, delta="secret"))
    sink.publish(delta(2, "hi"))
    await sink.drain()
    assert delivered == [{"text": "hi"}]
    assert sink.filtered == 1
    await sink.aclose()


async def test_a_raising_projection_or_an_invalid_event_is_reported_not_raised():
    errors: list[BaseException] = []

    def project(event):
        raise ValueError("bad projection")

    sink = create_agent_runtime_event_sink(
        deliver=lambda e: None, capacity=2, project=project, on_publish_error=lambda e, ev: errors.append(e)
    )
    sink.publish(delta(1))
    sink.publish({"type": "no-such-event"})
    assert len(errors) == 2 and sink.failed == 2
    await sink.aclose()


async def test_async_delivery_keeps_order():
    delivered: list[int] = []

    async def deliver(event):
        await asyncio.sleep(0)
        delivered.append(event.sequence)

    sink = create_agent_runtime_event_sink(deliver=deliver, capacity=50)
    for n in range(1, 21):
        sink.publish(delta(n))
    await sink.drain()
    assert delivered == list(range(1, 21))
    assert (await sink.aclose()).delivered == 20


def test_a_sink_refuses_a_nonsense_capacity():
    with pytest.raises(AgentRuntimeUsageError):
        create_agent_runtime_event_sink(deliver=print, capacity=0)


def run_terminal(**fields) -> AgentRunTerminalEvent:
    return AgentRunTerminalEvent(
        conversation_id="c1",
        run_id="r1",
        runtime_epoch="e1",
        fencing_token=1,
        terminal_reason="provider_failure",
        usage=AgentUsage(),
        cause={"type": "httpx.ConnectError", "message": "10.0.0.7 refused"},
        **fields,
    )


async def test_operator_cause_is_redacted_unless_opted_in():
    redacted: list[AgentRunTerminalEvent] = []
    full: list[AgentRunTerminalEvent] = []
    sink = create_agent_operator_sink(deliver=redacted.append, capacity=5)
    private = create_agent_operator_sink(deliver=full.append, capacity=5, include_internal_cause=True)
    event = run_terminal()
    for target in (sink, private):
        target.publish(event)
        target.publish(event)  # the same execution's terminal once
        await target.drain()
        await target.aclose()
    assert [e.cause for e in redacted] == [None]
    assert full[0].cause == event.cause
    assert sink.duplicates == 1


async def test_operator_sink_keeps_a_cas_losers_own_terminal():
    delivered: list[AgentRunTerminalEvent] = []
    sink = create_agent_operator_sink(deliver=delivered.append, capacity=5)
    sink.publish(run_terminal())
    sink.publish(run_terminal(outcome="lost").model_copy(update={"event_id": "r1:run-terminal:e2:2"}))
    await sink.drain()
    assert len(delivered) == 2
    await sink.aclose()


async def test_a_failing_operator_consumer_is_counted_and_never_reaches_the_run():
    errors: list[BaseException] = []

    def deliver(event):
        raise RuntimeError("sink unavailable")

    sink = create_agent_operator_sink(deliver=deliver, capacity=5, on_publish_error=lambda e, ev: errors.append(e))
    assert sink(run_terminal()) is None  # usable as operator_publish=: never raises
    await sink.drain()
    assert sink.failed == 1 and sink.delivered == 0 and len(errors) == 1
    await sink.aclose()


async def test_deduplication_forgets_beyond_its_window():
    """Only the last ``dedupe_window`` ids are remembered: a long-lived sink does not grow without bound, and
    an id that fell out of the window is delivered again."""
    delivered: list[AgentRunTerminalEvent] = []
    sink = create_agent_operator_sink(deliver=delivered.append, capacity=20, dedupe_window=3)
    ids = ["r1:run-terminal:e1:0", "r1:run-terminal:e1:1", "r1:run-terminal:e1:2"]
    for event_id in [*ids, ids[2], "r1:run-terminal:e1:3", ids[0]]:
        sink.publish(run_terminal().model_copy(update={"event_id": event_id}))
    await sink.drain()
    assert [e.event_id for e in delivered] == [*ids, "r1:run-terminal:e1:3", ids[0]]
    assert sink.duplicates == 1
    await sink.aclose()


# ------------------------------------------------------------------------------------------------ reducer


def reduce_all(events, state=None):
    for event in events:
        state = reduce_agent_control_event(state, event)
    return state


def test_deltas_append_and_attempt_reset_withdraws_them():
    state = reduce_all([delta(1, "Hel"), delta(2, "lo"), transient(ReasoningDeltaEvent, 3, delta="hmm")])
    run = state.conversations["c1"].transient_by_run["r1"]
    assert (run.text, run.reasoning) == ("Hello", "hmm")
    state = reduce_agent_control_event(state, transient(AttemptResetEvent, 4, step=0, attempt=2))
    run = state.conversations["c1"].transient_by_run["r1"]
    assert (run.text, run.reasoning) == ("", "")
    state = reduce_agent_control_event(state, delta(5, "Hi"))
    assert state.conversations["c1"].transient_by_run["r1"].text == "Hi"


def test_a_checkpoint_replaces_streamed_text():
    state = reduce_all([delta(1, "Hel"), delta(2, "lo wor")])
    state = reduce_agent_control_event(state, checkpoint(5, ReasoningPart(text="r"), TextPart(text="Hello wor")))
    run = state.conversations["c1"].transient_by_run["r1"]
    assert (run.text, run.reasoning) == ("Hello wor", "r")
    assert state.conversations["c1"].version == 5


def test_reasoning_blocks_are_separated():
    events = [
        transient(ReasoningStartEvent, 1),
        transient(ReasoningDeltaEvent, 2, delta="one"),
        transient(ReasoningEndEvent, 3),
        transient(ReasoningStartEvent, 4),
        transient(ReasoningDeltaEvent, 5, delta="two"),
    ]
    run = reduce_all(events).conversations["c1"].transient_by_run["r1"]
    assert run.reasoning == "one\n\ntwo" and run.reasoning_active


def test_tool_progress_is_kept_until_the_call_finishes():
    def progress(seq, n):
        return transient(ToolProgressEvent, seq, call_id="k1", tool_name="crawl", message=f"page {n}", progress=n)

    state = reduce_all(
        [
            transient(ToolStatusEvent, 1, call_id="k1", tool_name="crawl", status="started"),
            progress(2, 1),
            progress(3, 2),
        ]
    )
    tools = state.conversations["c1"].transient_by_run["r1"].tools
    assert tools["k1"].message == "page 2"
    state = reduce_agent_control_event(
        state, transient(ToolStatusEvent, 4, call_id="k1", tool_name="crawl", status="completed", output="ok")
    )
    assert state.conversations["c1"].transient_by_run["r1"].tools == {}
    state = reduce_agent_control_event(state, progress(5, 3))  # late: the final status had the last word
    assert state.conversations["c1"].transient_by_run["r1"].tools == {}


def test_a_transient_gap_requires_a_resync_and_a_snapshot_clears_it():
    state = reduce_all([delta(1, "a"), delta(2, "b"), delta(4, "d")])
    assert state.conversations["c1"].resync_required
    running = Run(
        id="r1",
        conversation_id="c1",
        state="running",
        revision=2,
        input_message_ids=("m1",),
        assistant_message_id="a1",
        admission_sequence=1,
        execution_sequence=1,
        owner_id="o",
        created_at=NOW,
        updated_at=NOW,
    )
    snapshot = ConversationSnapshot(
        conversation_id="c1",
        version=7,
        messages=(
            message("m1", "user", "committed", TextPart(text="hi")),
            message("a1", "assistant", "streaming", TextPart(text="abcd"), run="r1"),
        ),
        runs=(running,),
    )
    state = reduce_agent_control_snapshot(snapshot, state)
    view = state.conversations["c1"]
    assert not view.resync_required
    assert view.transient_by_run["r1"].text == "abcd"
    assert [m.id for m in view.messages] == ["m1"]
    state = reduce_agent_control_event(state, delta(5, "e"))
    assert state.conversations["c1"].transient_by_run["r1"].text == "abcde"
    assert not state.conversations["c1"].resync_required
    # a durable event older than the snapshot is already in it
    assert reduce_agent_control_event(state, run_state(6)) is state


def test_a_fresh_view_from_a_snapshot_accepts_a_run_already_streaming():
    running = Run(
        id="r1",
        conversation_id="c1",
        state="running",
        revision=2,
        input_message_ids=("m1",),
        assistant_message_id="a1",
        admission_sequence=1,
        execution_sequence=1,
        owner_id="o",
        created_at=NOW,
        updated_at=NOW,
    )
    snapshot = ConversationSnapshot(conversation_id="c1", version=3, runs=(running,))
    state = reduce_agent_control_event(reduce_agent_control_snapshot(snapshot), delta(57, "x"))
    assert not state.conversations["c1"].resync_required
    assert reduce_agent_control_event(state, delta(59, "z")).conversations["c1"].resync_required


def test_terminal_clears_transient_state_and_records_the_answer():
    admission = AdmissionEvent(
        event_id=durable_event_id("r1", "admission", 1),
        conversation_id="c1",
        run_id="r1",
        version=1,
        outcome="accepted",
        input=message("m1", "user", "committed", TextPart(text="hi")),
        run=Run(
            id="r1",
            conversation_id="c1",
            state="queued",
            revision=1,
            input_message_ids=("m1",),
            assistant_message_id="a1",
            admission_sequence=1,
            created_at=NOW,
            updated_at=NOW,
        ),
        assistant_message_id="a1",
    )
    state = reduce_all(
        [admission, run_state(2), delta(1, "do"), delta(2, "ne"), run_state(3, "completed"), terminal(3)]
    )
    view = state.conversations["c1"]
    assert "r1" not in view.transient_by_run
    assert [m.id for m in view.messages] == ["m1", "a1"]
    assert view.run_states["r1"] == "completed"
    # nothing streams for a settled run
    assert "r1" not in reduce_agent_control_event(state, delta(3, "!")).conversations["c1"].transient_by_run


def test_the_reducer_is_pure_and_ignores_duplicates():
    state = reduce_all([delta(1, "a"), delta(2, "b")])
    before = state.model_dump()
    after = reduce_agent_control_event(state, delta(3, "c"))
    assert state.model_dump() == before
    assert after.conversations["c1"].transient_by_run["r1"].text == "abc"
    assert reduce_agent_control_event(after, delta(2, "b")) is after
    assert create_agent_control_view().conversations == {}
