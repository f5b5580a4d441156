"""Input policies: what happens to the run in flight when new input arrives (queue, interrupt, supersede,
interrupt-next, inject) and coalescing. Interleavings are driven by asyncio events, never by sleeps."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
from pydantic_ai.messages import ModelResponse, TextPart
from pydantic_ai.models.function import DeltaToolCall

from threadline import define_agent_tool

from .conftest import Script, answer_text, last_user_text, make_runtime, submit, tool_returns

INTERRUPT_MARKER = "[interrupted: this turn was cut off before it finished]"


def gated_first_call(partial: str = "We are the team, where would you like") -> Script:
    """Call 0 streams ``partial`` then waits on gate(0); later calls echo."""
    script = Script()

    async def handler(i: int, messages: list[Any], info: Any) -> AsyncIterator[Any]:
        if i == 0:
            yield partial
            await script.gate(0).wait()
            yield " to go?"
        else:
            yield f"answer to: {last_user_text(messages)}"

    script.handler = handler
    return script


def response_texts(messages: list[Any]) -> list[str]:
    return [p.content for m in messages if isinstance(m, ModelResponse) for p in m.parts if isinstance(p, TextPart)]


async def test_queue_waits_for_the_run_in_flight(store: Any) -> None:
    script = gated_first_call()
    runtime = make_runtime(store, script)
    a = submit(runtime, "a", "first")
    await script.wait_entered(0)
    b = submit(runtime, "b", "second")
    await b.admission
    assert len(script.calls) == 1, "a queued input never starts while its predecessor runs"
    script.gate(0).set()
    ra, rb = await a.result, await b.result
    assert (ra.terminal_reason, rb.terminal_reason) == ("success", "success")
    assert answer_text(ra) == "We are the team, where would you like to go?"
    # the successor sees the predecessor's whole turn before its own input
    assert response_texts(script.calls[1]) == ["We are the team, where would you like to go?"]
    assert last_user_text(script.calls[1]) == "second"
    await runtime.close()


async def test_interrupt_keeps_the_partial_and_marks_it(store: Any) -> None:
    script = gated_first_call()
    runtime = make_runtime(store, script, runs={"input_policy": "interrupt"})
    a = submit(runtime, "a", "who are you?")
    await script.wait_entered(0)
    b = submit(runtime, "b", "never mind")
    ra, rb = await a.result, await b.result
    assert ra.terminal_reason == "interrupted" and ra.run.state == "interrupted"
    assert ra.assistant.status == "interrupted"
    assert answer_text(ra) == "We are the team, where would you like"
    assert rb.terminal_reason == "success"
    # the next request carries the partial answer with the explicit marker
    parts = [p.content for m in script.calls[1] if isinstance(m, ModelResponse) for p in m.parts]
    assert parts == ["We are the team, where would you like", INTERRUPT_MARKER]
    await runtime.close()


@pytest.mark.parametrize(
    ("form", "responses", "system_line"),
    [
        ("system-note", [], "[interrupted] partial response: We are the team, where would you like"),
        ("omit", [], None),
    ],
)
async def test_the_interrupted_form_decides_how_the_partial_reaches_the_model(
    store: Any, form: str, responses: list[str], system_line: str | None
) -> None:
    script = gated_first_call()
    runtime = make_runtime(store, script, runs={"input_policy": "interrupt"}, history={"interrupted_assistant": form})
    a = submit(runtime, "a", "who are you?")
    await script.wait_entered(0)
    b = submit(runtime, "b", "never mind")
    ra, rb = await a.result, await b.result
    await runtime.close()
    assert (ra.terminal_reason, ra.assistant.status, rb.terminal_reason) == ("interrupted", "interrupted", "success")
    assert response_texts(script.calls[1]) == responses  # never an ordinary assistant turn
    instructions = script.infos[1].instructions or ""
    if system_line is None:
        assert "We are the team" not in instructions
    else:
        assert system_line in instructions


async def test_supersede_discards_the_partial_from_the_prompt_but_keeps_the_record(store: Any) -> None:
    script = gated_first_call("a draft nobody saw")
    runtime = make_runtime(store, script, runs={"input_policy": "supersede"})
    a = submit(runtime, "a", "first")
    await script.wait_entered(0)
    b = submit(runtime, "b", "second")
    ra, rb = await a.result, await b.result
    assert (ra.terminal_reason, ra.run.state, ra.assistant.status) == ("superseded", "superseded", "superseded")
    assert rb.terminal_reason == "success"
    assert all("a draft nobody saw" not in t for t in response_texts(script.calls[1]))
    snapshot = await store.load_snapshot(conversation_id="c1")
    kept = [m for m in snapshot.messages if m.id == ra.assistant.id]
    assert kept and kept[0].status == "superseded", "the superseded record is kept"
    await runtime.close()


async def test_interrupt_next_runs_before_ordinary_queued_work(store: Any) -> None:
    script = gated_first_call()
    policy = lambda raw: "interrupt-next" if "urgent" in raw.parts[0]["text"] else "queue"  # noqa: E731
    runtime = make_runtime(store, script, runs={"input_policy": policy})
    a = submit(runtime, "a", "A")
    await script.wait_entered(0)
    b = submit(runtime, "b", "B ordinary")
    await b.admission
    c = submit(runtime, "c", "C urgent")
    c2 = submit(runtime, "c2", "C2 urgent")
    ra, rb, rc, rc2 = await a.result, await b.result, await c.result, await c2.result
    assert ra.terminal_reason == "interrupted"
    assert [last_user_text(call) for call in script.calls[1:]] == ["C urgent", "C2 urgent", "B ordinary"]
    assert rc.run.priority == "urgent" and rb.run.priority == "ordinary"
    assert rb.run.input_message_ids != rc.run.input_message_ids, "urgent input never coalesces into B"
    assert {rb.terminal_reason, rc.terminal_reason, rc2.terminal_reason} == {"success"}
    await runtime.close()


async def test_coalesced_inputs_share_one_successor(store: Any) -> None:
    script = gated_first_call()
    runtime = make_runtime(store, script, runs={"coalesce_pending": True})
    a = submit(runtime, "a", "A")
    await script.wait_entered(0)
    tickets = [submit(runtime, f"b{i}", f"B{i}") for i in range(3)]
    admissions = [await t.admission for t in tickets]
    assert len({adm.run.id for adm in admissions}) == 1
    assert [adm.coalesced for adm in admissions] == [False, True, True]
    script.gate(0).set()
    results = [await t.result for t in tickets]
    await a.result
    assert {r.run.id for r in results} == {admissions[0].run.id}
    assert len(results[0].run.input_message_ids) == 3
    assert len(script.calls) == 2 and last_user_text(script.calls[1]) == "B0 | B1 | B2"
    await runtime.close()


def tool_then_answer(script: Script, tool_gate: asyncio.Event) -> tuple[Any, Any]:
    """Call 0: a tool call; the tool waits on ``tool_gate``. Later calls answer every user text they see
    after the last response."""

    @define_agent_tool
    async def lookup(topic: str) -> str:
        await tool_gate.wait()
        return f"facts about {topic}"

    async def handler(i: int, messages: list[Any], info: Any) -> AsyncIterator[Any]:
        if i == 0:
            yield {0: DeltaToolCall(name="lookup", json_args='{"topic": "threads"}', tool_call_id="call-1")}
        else:
            returns = tool_returns(messages)
            seen = last_user_text(messages) if not returns else last_user_text(messages[-1:])
            yield f"summary ({len(returns)} results) for: {seen}"

    script.handler = handler
    return lookup, handler


async def test_inject_joins_at_the_step_boundary_and_is_absorbed(store: Any) -> None:
    script = Script()
    gate = asyncio.Event()
    lookup, _ = tool_then_answer(script, gate)
    runtime = make_runtime(store, script, tools=[lookup], runs={"input_policy": "inject"})
    a = submit(runtime, "a", "summarise this thread")
    await script.wait_entered(0)
    b = submit(runtime, "b", "actually, in bullet points")
    await b.admission
    gate.set()
    ra, rb = await a.result, await b.result
    assert len(script.calls) == 2, "the injected input was answered by the run in flight"
    assert "actually, in bullet points" in last_user_text(script.calls[1][-1:])
    assert ra.terminal_reason == "success"
    assert (rb.terminal_reason, rb.run.state, rb.run.absorbed_into_run_id) == ("absorbed", "superseded", ra.run.id)
    assert rb.assistant is not None and rb.assistant.id == ra.assistant.id
    assert ra.run.absorbed_run_ids == (rb.run.id,)
    # a retry of the absorbed key resolves to the absorbing answer
    again = submit(runtime, "b", "actually, in bullet points")
    assert (await again.admission).outcome == "duplicate"
    assert (await again.result).assistant.id == ra.assistant.id
    await runtime.close()


async def test_inject_into_a_run_that_is_interrupted_leaves_an_ordinary_successor(store: Any) -> None:
    script = Script()
    gate = asyncio.Event()
    lookup, handler = tool_then_answer(script, gate)

    async def gated(i: int, messages: list[Any], info: Any) -> AsyncIterator[Any]:
        if i == 1:
            yield "partial"
            await script.gate(1).wait()
        async for item in handler(i, messages, info):
            yield item

    script.handler = gated
    runtime = make_runtime(store, script, tools=[lookup], runs={"input_policy": "inject"})
    a = submit(runtime, "a", "first")
    await script.wait_entered(0)
    b = submit(runtime, "b", "joins")
    await b.admission
    gate.set()
    await script.wait_entered(1)
    adm = await a.admission
    await runtime.interrupt(conversation_id="c1", run_id=adm.run.id)
    ra, rb = await a.result, await b.result
    assert ra.terminal_reason == "interrupted"
    assert rb.terminal_reason == "success" and rb.run.absorbed_into_run_id is None
    assert len(script.calls) == 3, "the successor answered its own input"
    assert not any(p.type == "input-joined" for p in ra.assistant.parts), "no absorption, no join marker"
    await runtime.close()


async def test_an_input_coalescing_after_the_last_boundary_cancels_the_absorption(store: Any) -> None:
    script = Script()
    gate = asyncio.Event()
    lookup, handler = tool_then_answer(script, gate)

    async def gated(i: int, messages: list[Any], info: Any) -> AsyncIterator[Any]:
        if i == 1:
            yield "working"
            await script.gate(1).wait()
        async for item in handler(i, messages, info):
            yield item

    script.handler = gated
    runtime = make_runtime(store, script, tools=[lookup], runs={"input_policy": "inject", "coalesce_pending": True})
    a = submit(runtime, "a", "first")
    await script.wait_entered(0)
    b = submit(runtime, "b", "joins early")
    await b.admission
    gate.set()
    await script.wait_entered(1)  # the boundary passed: b joined
    b2 = submit(runtime, "b2", "joins late")
    assert (await b2.admission).coalesced
    script.gate(1).set()
    ra, rb, rb2 = await a.result, await b.result, await b2.result
    assert ra.terminal_reason == "success" and ra.run.absorbed_run_ids == ()
    assert rb.run.id == rb2.run.id and rb.terminal_reason == "success", "the successor answers all its inputs"
    assert last_user_text(script.calls[2]) == "joins early | joins late"
    await runtime.close()
