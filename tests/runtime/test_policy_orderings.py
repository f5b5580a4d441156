"""Input policies and admission, checked end to end: which inputs each request carries, in which order
runs execute and their records are kept, what a duplicate or a caller's record ids give back, and what a
runtime that closed refuses. Interleavings are decided by asyncio events; every wait is bounded."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
from pydantic_ai.messages import ModelRequest, ModelResponse, TextPart, UserPromptPart
from pydantic_ai.models.function import DeltaToolCall

from threadline import define_agent_tool
from threadline.errors import AgentRuntimeClosedError
from threadline.loop import AgentRetryPolicy

from .conftest import Script, last_user_text, make_runtime, submit, text

WAIT = 5
PARTIAL = "Hello! We are the team, where would you like"


def halting_first_call() -> Script:
    """Call 0 streams ``PARTIAL`` and then waits until it is cancelled; later calls echo."""
    script = Script()

    async def handler(i: int, messages: list[Any], info: Any) -> AsyncIterator[Any]:
        if i == 0:
            yield PARTIAL
            await asyncio.Event().wait()
        yield f"ANSWER to {last_user_text(messages)}"

    script.handler = handler
    return script


def user_texts(messages: list[Any]) -> list[str]:
    return [
        p.content
        for m in messages
        if isinstance(m, ModelRequest)
        for p in m.parts
        if isinstance(p, UserPromptPart) and isinstance(p.content, str)
    ]


def response_texts(messages: list[Any]) -> list[str]:
    return [p.content for m in messages if isinstance(m, ModelResponse) for p in m.parts if isinstance(p, TextPart)]


# ------------------------------------------------------------------------------------------- supersede


async def test_a_superseded_turn_leaves_both_inputs_and_no_answer_in_the_next_request(store: Any) -> None:
    script = halting_first_call()
    runtime = make_runtime(store, script, runs={"input_policy": "supersede"})
    first = submit(runtime, "a", "Hello")
    await script.wait_entered(0)
    second = submit(runtime, "b", "I want to buy a tour to Cape Town")
    ended = await asyncio.wait_for(first.result, WAIT)
    await asyncio.wait_for(second.result, WAIT)
    await runtime.close()
    assert (ended.terminal_reason, ended.run.state, ended.assistant.status) == ("superseded",) * 3
    request = script.calls[1]
    assert user_texts(request) == ["Hello", "I want to buy a tour to Cape Town"]
    assert response_texts(request) == [], "the superseded answer never reaches the model"
    snapshot = await store.load_snapshot(conversation_id="c1")
    kept = [m for m in snapshot.messages if m.status == "superseded"]
    assert [p.text for p in kept[0].parts if p.type == "text"] == [PARTIAL]


async def test_the_superseding_inputs_coalesce_into_the_successor_not_the_ended_run(store: Any) -> None:
    script = halting_first_call()
    runtime = make_runtime(store, script, runs={"input_policy": "supersede", "coalesce_pending": True})
    first = submit(runtime, "a", "Hello")
    first_admission = await asyncio.wait_for(first.admission, WAIT)
    await script.wait_entered(0)
    second, third = submit(runtime, "b", "two"), submit(runtime, "c", "three")
    second_admission, third_admission = await asyncio.wait_for(asyncio.gather(second.admission, third.admission), WAIT)
    assert second_admission.run.id == third_admission.run.id != first_admission.run.id
    await asyncio.wait_for(asyncio.gather(first.result, second.result, third.result), WAIT)
    await runtime.close()
    runs = {r.id: r for r in (await store.load_snapshot(conversation_id="c1")).runs}
    ended, successor = runs[first_admission.run.id], runs[second_admission.run.id]
    assert ended.state == "superseded" and len(ended.input_message_ids) == 1
    assert successor.state == "completed" and len(successor.input_message_ids) == 2


async def test_a_durable_interrupt_landing_on_a_superseding_terminal_keeps_it_superseded(store: Any) -> None:
    script = halting_first_call()
    runtime = make_runtime(store, script, runs={"input_policy": "supersede"})
    commit = store.commit_run_terminal
    raced: list[bool] = []

    async def interrupt_first(**kwargs: Any) -> Any:
        if not raced:  # a stop button between the executor's last read and its terminal commit
            raced.append(True)
            loaded = await store.load_run(conversation_id=kwargs["conversation_id"], run_id=kwargs["run_id"])
            await store.request_run_interrupt(
                conversation_id=kwargs["conversation_id"],
                run_id=kwargs["run_id"],
                expected_revision=loaded.run.revision,
            )
        return await commit(**kwargs)

    store.commit_run_terminal = interrupt_first
    first = submit(runtime, "a", "Hello")
    await script.wait_entered(0)
    second = submit(runtime, "b", "Actually, somewhere else")
    ended = await asyncio.wait_for(first.result, WAIT)
    await asyncio.wait_for(second.result, WAIT)
    await runtime.close()
    assert (ended.terminal_reason, ended.assistant.status) == ("superseded", "superseded")
    assert PARTIAL not in str(script.calls[1])


async def test_stop_supersede_ends_the_run_superseded(store: Any) -> None:
    script = halting_first_call()
    runtime = make_runtime(store, script)
    first = submit(runtime, "a", "Hello")
    await script.wait_entered(0)
    assert runtime.stop("c1", "supersede") is True
    ended = await asyncio.wait_for(first.result, WAIT)
    await runtime.close()
    assert (ended.terminal_reason, ended.assistant.status) == ("superseded", "superseded")


# ---------------------------------------------------------------------------------------------- inject


async def test_inject_into_a_one_step_run_that_already_ended_is_an_ordinary_run(store: Any) -> None:
    script = Script()
    runtime = make_runtime(store, script, runs={"input_policy": "inject"})
    first = await asyncio.wait_for(submit(runtime, "a", "one").result, WAIT)
    second = await asyncio.wait_for(submit(runtime, "b", "two").result, WAIT)
    await runtime.close()
    assert second.run.id != first.run.id and second.terminal_reason == "success"
    runs = (await store.load_snapshot(conversation_id="c1")).runs
    assert [r.state for r in runs] == ["completed", "completed"]


async def test_an_input_injected_at_step_zero_survives_a_retried_attempt(store: Any) -> None:
    """The injection joins before the first request; that attempt fails and is retried. The retry carries
    the injected input again, and the run that answered absorbs it."""
    script = Script()

    async def handler(i: int, messages: list[Any], info: Any) -> AsyncIterator[Any]:
        yield "partial"
        if i == 0:
            raise ConnectionResetError("the stream was cut")
        yield " answered"

    script.handler = handler
    entered, release = asyncio.Event(), asyncio.Event()

    async def tools(ctx: Any) -> list[Any]:  # resolved after the acquisition, before the first request
        if not entered.is_set():
            entered.set()
            await release.wait()
        return []

    runtime = make_runtime(
        store,
        script,
        tools=tools,
        runs={"input_policy": "inject"},
        loop={"retry": AgentRetryPolicy(max_attempts=2, initial_delay=0, retry_on=lambda error: True)},
    )
    first = submit(runtime, "a", "summarise this")
    await asyncio.wait_for(entered.wait(), WAIT)
    second = submit(runtime, "b", "in bullet points")
    second_admission = await asyncio.wait_for(second.admission, WAIT)
    release.set()
    first_result = await asyncio.wait_for(first.result, WAIT)
    second_result = await asyncio.wait_for(second.result, WAIT)
    await runtime.close()
    assert len(script.calls) == 2 and first_result.terminal_reason == "success"
    assert all("in bullet points" in user_texts(call) for call in script.calls)
    absorbed = await store.load_run(conversation_id="c1", run_id=second_admission.run.id)
    assert (absorbed.run.terminal_reason, absorbed.run.absorbed_into_run_id) == ("absorbed", first_result.run.id)
    assert second_result.answered and second_result.answered_by_run_id == first_result.run.id


async def test_an_injected_input_reaches_only_requests_after_it_arrived(store: Any) -> None:
    script = Script()
    arrived = asyncio.Event()

    @define_agent_tool
    async def ping() -> str:
        return "pong"

    async def handler(i: int, messages: list[Any], info: Any) -> AsyncIterator[Any]:
        if i == 1:
            await arrived.wait()
        if i < 2:
            yield {0: DeltaToolCall(name="ping", json_args="{}", tool_call_id=f"call-{i}")}
        else:
            yield "answered"

    script.handler = handler
    runtime = make_runtime(store, script, tools=[ping], runs={"input_policy": "inject"}, loop={"max_steps": 10})
    first = submit(runtime, "a", "start the task")
    await script.wait_entered(0)
    second = submit(runtime, "b", "and also mention the deadline")
    await asyncio.wait_for(second.admission, WAIT)
    arrived.set()
    first_result = await asyncio.wait_for(first.result, WAIT)
    second_result = await asyncio.wait_for(second.result, WAIT)
    await runtime.close()
    assert first_result.terminal_reason == "success"
    assert second_result.assistant.id == first_result.assistant.id
    assert len(first_result.run.input_message_ids) == 2
    assert "and also mention the deadline" not in str(script.calls[0])
    assert "and also mention the deadline" in user_texts(script.calls[-1])
    snapshot = await store.load_snapshot(conversation_id="c1")
    said = [p.text for m in snapshot.messages if m.role == "user" for p in m.parts if p.type == "text"]
    assert said == ["start the task", "and also mention the deadline"]


# -------------------------------------------------------------------------------------- interrupt-next


async def test_an_urgent_input_runs_before_queued_work_and_never_sees_it(store: Any) -> None:
    script = halting_first_call()
    policy = lambda raw: "interrupt-next" if raw.input_metadata and raw.input_metadata.get("urgent") else "queue"  # noqa: E731
    runtime = make_runtime(store, script, runs={"input_policy": policy, "coalesce_pending": True})

    def send(name: str, urgent: bool = False) -> Any:
        return runtime.submit(
            conversation_id="c1",
            idempotency_key=name,
            context={"user_id": "u1"},
            parts=text(f"INPUT_{name}"),
            input_metadata={"urgent": urgent},
            record_ids={"input_message_id": f"{name}-input", "run_id": name, "assistant_message_id": f"{name}-answer"},
        )

    first = send("A")
    await script.wait_entered(0)
    ordinary = send("B")
    await asyncio.wait_for(ordinary.admission, WAIT)
    urgent = send("C", urgent=True)
    results = await asyncio.wait_for(asyncio.gather(first.result, urgent.result, ordinary.result), WAIT)
    await runtime.close()
    assert [r.terminal_reason for r in results] == ["interrupted", "success", "success"]
    assert [r.run.id for r in results[1:]] == ["C", "B"]
    assert len(script.calls) == 3
    assert "INPUT_C" in user_texts(script.calls[1]) and "INPUT_B" not in user_texts(script.calls[1])
    assert user_texts(script.calls[2])[-2:] == ["INPUT_C", "INPUT_B"]
    assert "ANSWER to INPUT_C" in response_texts(script.calls[2])
    snapshot = await store.load_snapshot(conversation_id="c1")
    assert [r.id for r in snapshot.runs] == ["A", "C", "B"]
    sequences = [r.execution_sequence for r in snapshot.runs]
    assert None not in sequences and sequences == sorted(sequences)
    assert [m.id for m in snapshot.messages] == [
        "A-input",
        "A-answer",
        "C-input",
        "C-answer",
        "B-input",
        "B-answer",
    ]


async def test_recover_starts_an_urgent_run_before_an_earlier_ordinary_one(store: Any) -> None:
    for key, priority in (("B", "ordinary"), ("C", "urgent")):
        await store.accept_input_and_assign_run(
            conversation_id="c1",
            idempotency_key=key,
            input={"id": f"{key}-input", "parts": text(f"INPUT_{key}")},
            run_id=key,
            priority=priority,
        )
    script = Script()
    runtime = make_runtime(store, script)
    outcomes = await asyncio.wait_for(runtime.recover(resolve_context=lambda run: {}, page_size=1), WAIT)
    assert [(o.run_id, o.outcome) for o in outcomes] == [("C", "resumed"), ("B", "resumed")]
    await asyncio.wait_for(asyncio.gather(*(o.result for o in outcomes)), WAIT)
    await runtime.close()
    assert [last_user_text(call) for call in script.calls] == ["INPUT_C", "INPUT_B"]
    assert [r.id for r in (await store.load_snapshot(conversation_id="c1")).runs] == ["C", "B"]


# -------------------------------------------------------------------------------- queue and admission


async def test_an_input_admitted_while_its_predecessor_prepares_stays_out_of_its_request(store: Any) -> None:
    script = Script()
    entered, release = asyncio.Event(), asyncio.Event()

    async def tools(ctx: Any) -> list[Any]:
        if not entered.is_set():
            entered.set()
            await release.wait()
        return []

    runtime = make_runtime(store, script, tools=tools)
    first = submit(runtime, "a", "FIRST_INPUT")
    await asyncio.wait_for(entered.wait(), WAIT)
    second = submit(runtime, "b", "SECOND_QUEUED_INPUT")
    await asyncio.wait_for(second.admission, WAIT)
    release.set()
    first_result, second_result = await asyncio.wait_for(asyncio.gather(first.result, second.result), WAIT)
    await runtime.close()
    assert len(first_result.run.input_message_ids) == len(second_result.run.input_message_ids) == 1
    assert user_texts(script.calls[0]) == ["FIRST_INPUT"]
    assert user_texts(script.calls[1]) == ["FIRST_INPUT", "SECOND_QUEUED_INPUT"]
    assert response_texts(script.calls[1]) == ["answer to: FIRST_INPUT"]
    snapshot = await store.load_snapshot(conversation_id="c1")
    assert [m.id for m in snapshot.messages] == [
        first_result.run.input_message_ids[0],
        first_result.assistant.id,
        second_result.run.input_message_ids[0],
        second_result.assistant.id,
    ]


async def test_coalesced_admissions_share_the_answer_id_at_growing_versions(store: Any) -> None:
    script = halting_first_call()
    runtime = make_runtime(store, script, runs={"coalesce_pending": True, "input_policy": "queue"})
    first = submit(runtime, "a", "one")
    await script.wait_entered(0)
    second, third = submit(runtime, "b", "two"), submit(runtime, "c", "three")
    b, c = await asyncio.wait_for(asyncio.gather(second.admission, third.admission), WAIT)
    assert b.run.id == c.run.id and b.assistant_message_id == c.assistant_message_id
    assert b.version < c.version
    runtime.stop("c1")
    await asyncio.wait_for(asyncio.gather(first.result, second.result, third.result), WAIT)
    await runtime.close()


async def test_caller_record_ids_are_the_admitted_identities(store: Any) -> None:
    events: list[Any] = []
    runtime = make_runtime(store, Script(), publish=events.append)
    ids = {"input_message_id": "product-user-1", "run_id": "product-run-1", "assistant_message_id": "product-answer-1"}
    ticket = runtime.submit(
        conversation_id="c1", idempotency_key="request-1", context={}, parts="hello", record_ids=ids
    )
    admission = await asyncio.wait_for(ticket.admission, WAIT)
    await asyncio.wait_for(ticket.result, WAIT)
    assert (admission.input_message_id, admission.run_id, admission.assistant_message_id) == tuple(ids.values())
    assert admission.version == 1 and admission.pending.status == "pending"
    announced = next(e for e in events if e.type == "admission")
    assert (announced.input.id, announced.run.id) == ("product-user-1", "product-run-1")

    # a duplicate proposing other ids gets the durable ones back
    again = runtime.submit(
        conversation_id="c1",
        idempotency_key="request-1",
        context={},
        parts="hello",
        record_ids={**ids, "run_id": "discarded-run", "assistant_message_id": "discarded-answer"},
    )
    duplicate = await asyncio.wait_for(again.admission, WAIT)
    await runtime.close()
    assert duplicate.outcome == "duplicate"
    assert (duplicate.run_id, duplicate.assistant_message_id) == ("product-run-1", "product-answer-1")
    assert duplicate.version == (await store.load_snapshot(conversation_id="c1")).version
    assert (await again.result).run.id == "product-run-1"


@pytest.mark.parametrize("separator", [":", "/", "|", "\u2028"])
async def test_identities_containing_separators_stay_distinct(store: Any, separator: str) -> None:
    """Control characters are refused in ids (stores-and-drivers.md); any other separator is just text."""
    runtime = make_runtime(store, Script())
    first = runtime.submit(conversation_id=f"a{separator}b", idempotency_key="c", context={}, parts="one")
    second = runtime.submit(conversation_id="a", idempotency_key=f"b{separator}c", context={}, parts="two")
    one, two = await asyncio.wait_for(asyncio.gather(first.admission, second.admission), WAIT)
    await asyncio.wait_for(asyncio.gather(first.result, second.result), WAIT)
    await runtime.close()
    assert one.outcome == two.outcome == "accepted" and one.run.id != two.run.id


# ------------------------------------------------------------------------------------------------ close


async def test_a_closed_runtime_says_it_admits_no_further_work(store: Any) -> None:
    runtime = make_runtime(store, Script())
    closed = await runtime.close(force_timeout=0)
    assert (closed.settled, closed.timed_out, closed.remaining) == (True, False, 0)
    ticket = submit(runtime, "k", "hello")
    for future in (ticket.admission, ticket.accepted, ticket.result):
        try:
            await asyncio.wait_for(future, WAIT)
        except AgentRuntimeClosedError as error:
            assert "closed and admits no further work" in str(error)
        else:
            raise AssertionError("a closed runtime admitted an input")
    for call in (
        lambda: runtime.resume(conversation_id="c1", run_id="r1", context={}),
        lambda: runtime.recover(resolve_context=lambda run: {}),
    ):
        try:
            await call()
        except AgentRuntimeClosedError as error:
            assert "closed and admits no further work" in str(error)
        else:
            raise AssertionError("a closed runtime started work")
    assert (await store.load_snapshot(conversation_id="c1")).version == 0


async def test_an_input_admitted_before_close_is_executed_within_the_grace(store: Any) -> None:
    runtime = make_runtime(store, Script())
    ticket = submit(runtime, "k", "hello")
    await asyncio.wait_for(ticket.accepted, WAIT)
    closed = await asyncio.wait_for(runtime.close(grace_period=2, force_timeout=2), WAIT)
    assert closed.settled
    result = await asyncio.wait_for(ticket.result, WAIT)
    assert result.terminal_reason == "success"


async def test_close_counts_every_run_still_in_flight(store: Any) -> None:
    script = Script()
    release = asyncio.Event()

    async def stubborn(i: int, messages: list[Any], info: Any) -> AsyncIterator[Any]:
        yield "partial"
        while not release.is_set():
            try:
                await release.wait()
            except asyncio.CancelledError:
                continue  # ignores the abort: only the force budget ends close()'s wait

    script.handler = stubborn
    runtime = make_runtime(store, script)
    tickets = [submit(runtime, f"k{n}", "hello", conversation_id=f"c{n}") for n in range(3)]
    for n in range(3):
        await script.wait_entered(n)
    closed = await asyncio.wait_for(runtime.close(force_timeout=0.05), WAIT)
    assert (closed.settled, closed.timed_out, closed.remaining) == (False, True, 3)
    release.set()
    results = await asyncio.wait_for(asyncio.gather(*(t.result for t in tickets)), WAIT)
    assert {r.terminal_reason for r in results} == {"shutdown"}


async def test_a_store_refusing_the_admission_rejects_every_promise_of_the_ticket(store: Any) -> None:
    async def refuse(**kwargs: Any) -> Any:
        raise RuntimeError("admission failed")

    store.accept_input_and_assign_run = refuse
    runtime = make_runtime(store, Script())
    ticket = submit(runtime, "k", "hello")
    outcomes = await asyncio.wait_for(
        asyncio.gather(ticket.admission, ticket.accepted, ticket.result, return_exceptions=True), WAIT
    )
    await runtime.close()
    assert all(isinstance(outcome, BaseException) for outcome in outcomes), outcomes
