"""What a transport and an operator see: event order per run, transient numbering without false gaps,
reasoning, parallel tools, progress, retries (attempt-reset) and failure-isolated sinks."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
from pydantic_ai.exceptions import ModelHTTPError
from pydantic_ai.models.function import DeltaThinkingPart, DeltaToolCall

import threadline.loop as loop_module
from threadline import AgentToolContext, define_agent_tool
from threadline.delivery import (
    AgentRuntimeEventCursor,
    advance_agent_runtime_event_cursor,
    create_agent_operator_sink,
    create_agent_runtime_event_sink,
    reduce_agent_control_event,
)
from threadline.loop import AgentRetryPolicy

from .conftest import Script, answer_text, make_runtime, submit


class Recorder:
    def __init__(self) -> None:
        self.events: list[Any] = []

    def __call__(self, event: Any) -> None:
        self.events.append(event)

    def types(self, run_id: str | None = None) -> list[str]:
        return [e.type for e in self.events if run_id is None or e.run_id == run_id]

    def of(self, kind: str) -> list[Any]:
        return [e for e in self.events if e.type == kind]


async def run_with(store: Any, script: Script, **sections: Any) -> tuple[Any, Recorder, Recorder]:
    delivery, operator = Recorder(), Recorder()
    runtime = make_runtime(store, script, publish=delivery, operator_publish=operator, **sections)
    result = await asyncio.wait_for(submit(runtime, "k", "hello").result, 10)
    await runtime.close()
    return result, delivery, operator


def transient_sequences(events: list[Any], run_id: str) -> list[int]:
    return [e.sequence for e in events if e.run_id == run_id and hasattr(e, "sequence")]


async def test_a_streamed_answer_in_order(store: Any) -> None:
    async def words(i: int, messages: list[Any], info: Any) -> AsyncIterator[Any]:
        for w in ("one ", "two ", "three"):
            yield w

    result, delivery, operator = await run_with(store, Script(words))
    run_id = result.run.id
    types = delivery.types(run_id)
    # nothing else ran in the conversation: one commit admitted and started the run, the first request
    # admitted with it
    assert types[:4] == ["admission", "run-state", "assistant-checkpoint", "run-operation"]
    admission, state = delivery.of("admission")[0], delivery.of("run-state")[0]
    assert (state.state, state.version) == ("running", admission.version)
    assert types[-2:] == ["run-state", "terminal"]
    assert [e.delta for e in delivery.of("assistant-delta")] == ["one ", "two ", "three"]
    phases = [e.operation.phase for e in delivery.of("run-operation")]
    assert phases == ["started", "first-output", "completed"]
    # durable events follow their commits: versions never go backwards
    versions = [e.version for e in delivery.events if hasattr(e, "version")]
    assert versions == sorted(versions)
    assert transient_sequences(delivery.events, run_id) == [1, 2, 3]
    terminal = delivery.of("terminal")[0]
    assert terminal.usage.output_tokens.provenance == "computed", "a run total is computed"
    assert [e.type for e in operator.events] == ["run-started", "step-finished", "run-terminal"]
    assert operator.events[1].usage.output_tokens.provenance == "provider-reported", "a step's own figure"
    assert operator.events[-1].outcome == "committed" and operator.events[-1].usage.steps == 1


async def test_an_input_behind_a_running_run_is_queued_then_acquired(store: Any) -> None:
    release = asyncio.Event()

    async def handler(i: int, messages: list[Any], info: Any) -> AsyncIterator[Any]:
        if i == 0:
            await release.wait()
        yield f"answer {i}"

    delivery = Recorder()
    runtime = make_runtime(store, Script(handler), publish=delivery)
    first = submit(runtime, "k1", "first")
    await first.accepted
    second = submit(runtime, "k2", "second")
    queued = (await second.accepted).run
    assert queued.state == "queued"
    release.set()
    await asyncio.wait_for(asyncio.gather(first.result, second.result), 10)
    await runtime.close()
    states = [(e.state, e.version) for e in delivery.of("run-state") if e.run_id == queued.id]
    admitted = next(e for e in delivery.of("admission") if e.run_id == queued.id)
    assert [s for s, _ in states] == ["queued", "running", "completed"]
    assert states[0][1] == admitted.version < states[1][1]


async def test_reasoning_is_framed_by_start_and_end(store: Any) -> None:
    async def handler(i: int, messages: list[Any], info: Any) -> AsyncIterator[Any]:
        yield {0: DeltaThinkingPart(content="let me think")}
        yield {0: DeltaThinkingPart(content=" harder")}
        yield "the answer"

    result, delivery, _ = await run_with(store, Script(handler))
    kinds = [t for t in delivery.types(result.run.id) if t.startswith("reasoning") or t == "assistant-delta"]
    assert kinds == ["reasoning-start", "reasoning-delta", "reasoning-delta", "reasoning-end", "assistant-delta"]
    assert [e.delta for e in delivery.of("reasoning-delta")] == ["let me think", " harder"]
    assert any(p.type == "reasoning" for p in result.assistant.parts)


async def test_parallel_tool_calls_run_concurrently_and_record_in_call_order(store: Any) -> None:
    both_started = asyncio.Event()
    started: list[str] = []

    @define_agent_tool
    async def slow(name: str) -> str:
        started.append(name)
        if len(started) == 2:
            both_started.set()
        await asyncio.wait_for(both_started.wait(), 5)  # only returns if the calls overlap
        return f"done {name}"

    async def handler(i: int, messages: list[Any], info: Any) -> AsyncIterator[Any]:
        if i == 0:
            yield {0: DeltaToolCall(name="slow", json_args='{"name": "a"}', tool_call_id="ca")}
            yield {1: DeltaToolCall(name="slow", json_args='{"name": "b"}', tool_call_id="cb")}
        else:
            yield "both done"

    result, delivery, _ = await run_with(store, Script(handler), tools=[slow])
    assert result.terminal_reason == "success"
    statuses = [(e.call_id, e.status) for e in delivery.of("tool-status")]
    assert statuses[:2] == [("ca", "started"), ("cb", "started")]
    results = [p for p in result.assistant.parts if p.type == "tool-result"]
    assert [r.call_id for r in results] == ["ca", "cb"] and [r.output for r in results] == ["done a", "done b"]


async def test_a_tool_call_boundary_is_checkpointed_once(store: Any) -> None:
    """A completed tool call forces a checkpoint: at the next part's start, or, when the stream ends right
    after the call, by the step-finish commit alone (no second commit of the same draft)."""

    @define_agent_tool
    async def echo(name: str) -> str:
        return name

    async def handler(i: int, messages: list[Any], info: Any) -> AsyncIterator[Any]:
        if i == 0:
            yield {0: DeltaToolCall(name="echo", json_args='{"name": "a"}', tool_call_id="ca")}
        elif i == 1:
            yield {0: DeltaToolCall(name="echo", json_args='{"name": "b"}', tool_call_id="cb")}
            yield {1: DeltaToolCall(name="echo", json_args='{"name": "c"}', tool_call_id="cc")}
        else:
            yield "done"

    result, delivery, _ = await run_with(store, Script(handler), tools=[echo])
    assert result.terminal_reason == "success"
    drafts = [[f"{p.type}:{p.call_id}" for p in e.parts] for e in delivery.of("assistant-checkpoint")]
    ca, ra = "tool-call:ca", "tool-result:ca"
    step_1 = [ca, ra, "tool-call:cb", "tool-call:cc"]
    assert drafts == [
        [],  # step 0: the request's admission
        [ca],  # step 0 ends with its call: the step-finish commit is the call's checkpoint
        [ca, ra],  # step 1: its admission carries step 0's result
        step_1,  # cb ended as cc started: checkpointed there
        step_1,  # step 1's finish
        [*step_1, "tool-result:cb", "tool-result:cc"],  # step 2's admission
    ]


async def test_tool_progress_is_transient_throttled_and_final(store: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    reporters: list[Any] = []

    @define_agent_tool
    async def work(ctx: AgentToolContext, n: int) -> str:
        ctx.report_progress("starting", progress=0, total=n)
        ctx.report_progress("halfway", progress=n / 2, total=n)  # within the interval: dropped
        reporters.append(ctx.report_progress)
        return "ok"

    async def handler(i: int, messages: list[Any], info: Any) -> AsyncIterator[Any]:
        if i == 0:
            yield {0: DeltaToolCall(name="work", json_args='{"n": 4}', tool_call_id="c1")}
        else:
            yield "finished"

    monkeypatch.setattr(loop_module, "PROGRESS_MIN_INTERVAL", 1e9)  # no two reports of one call pass
    result, delivery, _ = await run_with(store, Script(handler), tools=[work])
    progress = delivery.of("tool-progress")
    assert [(e.call_id, e.message, e.progress, e.total) for e in progress] == [("c1", "starting", 0, 4)]
    reporters[0]("too late")  # after the call's terminal status: dropped
    assert len(delivery.of("tool-progress")) == 1
    assert all(p.type != "tool-progress" for p in result.assistant.parts), "progress never enters history"
    assert transient_sequences(delivery.events, result.run.id) == list(
        range(1, len(transient_sequences(delivery.events, result.run.id)) + 1)
    )


def flaky_then_fine(failures: int) -> Script:
    """Calls fail with a 503 after one streamed delta, ``failures`` times; then they answer."""

    async def handler(i: int, messages: list[Any], info: Any) -> AsyncIterator[Any]:
        if i < failures:
            yield f"attempt {i} partial"
            raise ModelHTTPError(503, "fault-model", body="overloaded")
        yield "a clean answer"

    return Script(handler)


async def test_a_retried_stream_resets_the_attempt(store: Any) -> None:
    script = flaky_then_fine(1)
    policy = AgentRetryPolicy(max_attempts=3, initial_delay=0)
    result, delivery, operator = await run_with(store, script, loop={"retry": policy})
    assert result.terminal_reason == "success"
    assert answer_text(result) == "a clean answer", "the failed attempt's text is discarded"
    types = [t for t in delivery.types(result.run.id) if t in ("assistant-delta", "attempt-reset")]
    assert types == ["assistant-delta", "attempt-reset", "assistant-delta"]
    assert result.usage.steps == 2, "the failed attempt's spend stays in the run's spend"
    assert [e.attempt for e in operator.of("step-finished")] == [1, 2]
    sequences = transient_sequences(delivery.events, result.run.id)
    assert sequences == list(range(1, len(sequences) + 1))


async def test_retries_are_bounded(store: Any) -> None:
    script = flaky_then_fine(5)
    result, _, _ = await run_with(store, script, loop={"retry": {"max_attempts": 2, "initial_delay": 0}})
    assert result.terminal_reason == "provider_failure" and len(script.calls) == 2


async def test_a_retry_never_replays_a_tool(store: Any) -> None:
    effects: list[str] = []

    @define_agent_tool
    async def charge(amount: int) -> str:
        effects.append(f"charged {amount}")
        return "charged"

    async def handler(i: int, messages: list[Any], info: Any) -> AsyncIterator[Any]:
        if i == 0:
            yield {0: DeltaToolCall(name="charge", json_args='{"amount": 5}', tool_call_id="c1")}
        else:
            yield "about to confirm"
            raise ModelHTTPError(503, "fault-model", body="overloaded")

    script = Script(handler)
    result, delivery, _ = await run_with(
        store, script, tools=[charge], loop={"retry": {"max_attempts": 5, "initial_delay": 0}}
    )
    assert result.terminal_reason == "provider_failure"
    assert effects == ["charged 5"] and len(script.calls) == 2
    assert delivery.of("attempt-reset") == []


async def test_a_consumer_that_raises_or_stalls_changes_no_outcome(store: Any) -> None:
    errors: list[BaseException] = []

    async def raising(event: Any) -> None:
        raise RuntimeError("consumer broke")

    never = asyncio.Event()

    async def stalled(event: Any) -> None:
        await never.wait()

    raising_sink = create_agent_runtime_event_sink(
        deliver=raising, capacity=4, on_publish_error=lambda error, event: errors.append(error)
    )
    stalled_sink = create_agent_runtime_event_sink(deliver=stalled, capacity=2)
    operator_sink = create_agent_operator_sink(deliver=raising, capacity=2)

    def both(event: Any) -> None:
        raising_sink(event)
        stalled_sink(event)

    runtime = make_runtime(store, Script(), publish=both, operator_publish=operator_sink)
    results = [await asyncio.wait_for(submit(runtime, f"k{i}", f"q{i}").result, 10) for i in range(3)]
    assert [r.terminal_reason for r in results] == ["success"] * 3
    await raising_sink.drain()
    assert errors, "the publisher's failures were reported, not raised"
    assert stalled_sink.dropped > 0
    await runtime.close()
    await raising_sink.aclose()
    await stalled_sink.aclose(timeout=0)
    await operator_sink.aclose(timeout=0)


async def test_a_reconnecting_consumer_sees_no_false_gap_and_a_true_one(store: Any) -> None:
    async def words(i: int, messages: list[Any], info: Any) -> AsyncIterator[Any]:
        for w in ("a", "b", "c", "d"):
            yield w

    _result, delivery, _ = await run_with(store, Script(words))
    cursor = AgentRuntimeEventCursor()
    kinds = []
    for event in delivery.events:
        cursor, kind = advance_agent_runtime_event_cursor(cursor, event)
        kinds.append(kind)
    assert set(kinds) == {"fresh"}
    deltas = [e for e in delivery.events if e.type == "assistant-delta"]
    cursor = AgentRuntimeEventCursor()
    seen = []
    for event in delivery.events:
        if event is deltas[1]:
            continue  # lost in transit
        cursor, kind = advance_agent_runtime_event_cursor(cursor, event)
        seen.append(kind)
    assert seen.count("gap") == 1


async def test_a_control_view_fed_a_run_s_events_accumulates_its_streamed_text_without_a_gap(store: Any) -> None:
    """Parts of a stream that publish nothing take no sequence number: what a view receives is numbered
    1, 2, 3... so it never asks for a resync, and it shows the streamed text as it grows."""

    async def hello(i: int, messages: list[Any], info: Any) -> AsyncIterator[Any]:
        yield "hel"
        yield "lo"

    result, delivery, _ = await run_with(store, Script(hello))
    assert transient_sequences(delivery.events, result.run.id) == [1, 2]
    view = None
    for event in delivery.events:
        if event.type == "terminal":
            break
        view = reduce_agent_control_event(view, event)
    assert view is not None
    conversation = view.conversations["c1"]
    assert not conversation.resync_required
    assert conversation.transient_by_run[result.run.id].text == "hello"


async def test_each_publisher_gets_its_events_without_the_other(store: Any) -> None:
    """Events are built only for a publisher that exists; a missing one changes nothing for the other."""

    async def words(i: int, messages: list[Any], info: Any) -> AsyncIterator[Any]:
        for w in ("one ", "two"):
            yield w

    async def one(key: str, **publishers: Any) -> Any:
        runtime = make_runtime(store, Script(words), **publishers)
        result = await asyncio.wait_for(submit(runtime, key, "hello").result, 10)
        await runtime.close()
        assert answer_text(result) == "one two"
        return result.run.id

    both_delivery, both_operator = Recorder(), Recorder()
    both = await one("both", publish=both_delivery, operator_publish=both_operator)
    delivery = Recorder()
    alone = await one("delivery", publish=delivery)
    operator = Recorder()
    operator_alone = await one("operator", operator_publish=operator)

    assert delivery.types(alone) == both_delivery.types(both)
    assert "assistant-delta" in delivery.types(alone) and delivery.types(alone)[-1] == "terminal"
    assert transient_sequences(delivery.events, alone) == transient_sequences(both_delivery.events, both) == [1, 2]
    assert (
        operator.types(operator_alone) == both_operator.types(both) == ["run-started", "step-finished", "run-terminal"]
    )


async def test_a_running_call_is_cancelled_and_reports_nothing_once_its_attempt_was_abandoned(store: Any) -> None:
    """Two calls of one step run side by side; the fence is lost when the first one ends, so the attempt is
    abandoned while the second still runs: the second is cancelled (its effect never happens), and nothing
    it would report afterwards is published."""
    from threadline.errors import AgentToolFenceLostError
    from threadline.tools import AgentToolLifecycle

    release = asyncio.Event()
    cancelled = asyncio.Event()
    effects: list[str] = []

    @define_agent_tool
    async def fast() -> str:
        return "fast"

    @define_agent_tool
    async def slow(ctx: AgentToolContext) -> str:
        try:
            await release.wait()
        except asyncio.CancelledError:
            cancelled.set()
            raise
        ctx.report_progress("after the attempt was abandoned")
        effects.append("slow")
        return "slow"

    def after(call: Any, output: Any) -> None:
        if call.tool_name == "fast":
            raise AgentToolFenceLostError("taken over")

    async def handler(i: int, messages: list[Any], info: Any) -> AsyncIterator[Any]:
        yield {0: DeltaToolCall(name="slow", json_args="{}", tool_call_id="s1")}
        yield {1: DeltaToolCall(name="fast", json_args="{}", tool_call_id="f1")}

    delivery = Recorder()
    runtime = make_runtime(
        store,
        Script(handler),
        tools=[fast, slow],
        publish=delivery,
        loop={"tool_lifecycle": AgentToolLifecycle(after=after)},
    )
    ticket = submit(runtime, "k", "go")
    with pytest.raises(Exception):  # noqa: B017  # the stale executor's ticket fails (ownership)
        await asyncio.wait_for(ticket.result, 5)
    await asyncio.wait_for(cancelled.wait(), 5)  # cancelled by the time the attempt gave up
    assert effects == []
    assert delivery.of("tool-progress") == []
    assert [e.status for e in delivery.of("tool-status") if e.call_id == "s1" and e.status == "completed"] == []
    await runtime.close()


async def test_a_tool_name_alone_is_not_first_output_its_arguments_are(store: Any) -> None:
    """First output is text, reasoning, a tool call's arguments or a complete call: a call whose name
    arrived while its arguments have not is not output yet."""
    from datetime import UTC, datetime

    @define_agent_tool
    async def lookup(q: str) -> str:
        return q

    marks: dict[str, datetime] = {}

    async def handler(i: int, messages: list[Any], info: Any) -> AsyncIterator[Any]:
        if i == 0:
            yield {0: DeltaToolCall(name="lookup", json_args=None, tool_call_id="c1")}
            marks["before_arguments"] = datetime.now(UTC)
            yield {0: DeltaToolCall(json_args='{"q": "x"}')}
        else:
            yield "done"

    result, delivery, _ = await run_with(store, Script(handler), tools=[lookup])
    assert result.terminal_reason == "success"
    first = next(e.operation for e in delivery.of("run-operation") if e.operation.phase == "first-output")
    assert first.step == 0 and first.first_output_at >= marks["before_arguments"]
