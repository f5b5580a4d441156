"""The durable request record a run keeps (``run.last_operation`` and its ``run-operation`` events) and
what ``loop.idle_timeout`` measures: provider silence only — not preparation, not tools."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from pydantic_ai.models.function import DeltaToolCall
from pydantic_ai.models.wrapper import WrapperModel

from threadline import (
    compose_agent_prompt,
    create_memory_agent_runtime_store,
    create_postgres_agent_runtime_store,
    create_sqlite_agent_runtime_store,
    define_agent_tool,
)
from threadline.errors import AgentStoreUnavailableError

from .conftest import Script, answer_text, make_runtime, submit
from .test_inputs_and_stores import drop_schema


@pytest.fixture(params=["memory", "sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
async def each_store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Any]:
    if request.param == "memory":
        yield create_memory_agent_runtime_store()
    elif request.param == "sqlite":
        async with create_sqlite_agent_runtime_store(tmp_path / "ops.db") as handle:
            yield handle.store
    else:
        dsn, schema = request.getfixturevalue("postgres_dsn"), f"threadline_test_{uuid.uuid4().hex}"
        try:
            async with create_postgres_agent_runtime_store(dsn, schema=schema) as handle:
                yield handle.store
        finally:
            await drop_schema(dsn, schema)


class Recorder:
    def __init__(self) -> None:
        self.events: list[Any] = []

    def __call__(self, event: Any) -> None:
        self.events.append(event)

    def operations(self) -> list[Any]:
        return [e.operation for e in self.events if e.type == "run-operation"]


async def run_one(store: Any, script: Script, **sections: Any) -> Any:
    runtime = make_runtime(store, script, **sections)
    result = await asyncio.wait_for(submit(runtime, "k", "hello").result, 10)
    await runtime.close()
    return result


@define_agent_tool
async def lookup(query: str) -> dict[str, str]:
    """Looks a value up."""
    return {"answer": query}


async def one_lookup_then_answer(i: int, messages: list[Any], info: Any) -> AsyncIterator[Any]:
    if i == 0:
        yield {0: DeltaToolCall(name="lookup", json_args='{"query": "value"}', tool_call_id="call-1")}
    else:
        yield "done"


async def nothing(i: int, messages: list[Any], info: Any) -> AsyncIterator[Any]:
    yield ""  # the provider ends the step without any content


# --- the request record ---------------------------------------------------------------------------------


async def test_the_request_is_recorded_before_the_provider_answers(each_store: Any) -> None:
    started, first_chunk, rest = asyncio.Event(), asyncio.Event(), asyncio.Event()
    delivery = Recorder()

    def publish(event: Any) -> None:
        delivery(event)
        if event.type == "run-operation" and event.operation.phase == "started":
            started.set()

    async def held(i: int, messages: list[Any], info: Any) -> AsyncIterator[Any]:
        await first_chunk.wait()
        yield "hello"
        await rest.wait()
        yield " world"

    runtime = make_runtime(each_store, Script(held), publish=publish)
    ticket = submit(runtime, "k", "hello")
    await asyncio.wait_for(started.wait(), 5)
    admitted = delivery.operations()
    assert [(o.kind, o.phase, o.step) for o in admitted] == [("model-request", "started", 0)]
    durable = (await each_store.load_snapshot(conversation_id="c1")).runs[0].last_operation
    assert durable == admitted[0]  # the event is the durable record, timestamps included
    first_chunk.set()
    await asyncio.sleep(0.02)  # the first chunk is observed after the request's start
    rest.set()
    result = await asyncio.wait_for(ticket.result, 10)
    await runtime.close()
    assert answer_text(result) == "hello world"
    start, first, done = delivery.operations()
    assert (first.phase, first.operation_id, first.started_at) == ("first-output", start.operation_id, start.started_at)
    assert first.first_output_at > first.started_at and first.finished_at is None
    assert (done.phase, done.operation_id) == ("completed", start.operation_id)
    assert done.first_output_at == first.first_output_at
    assert done.finished_at is not None and done.finished_at >= done.first_output_at


async def test_each_step_is_its_own_request(each_store: Any) -> None:
    delivery = Recorder()
    await run_one(each_store, Script(one_lookup_then_answer), tools=[lookup], publish=delivery, loop={"max_steps": 3})
    starts = [o for o in delivery.operations() if o.phase == "started"]
    assert [o.step for o in starts] == [0, 1]
    assert starts[0].operation_id != starts[1].operation_id
    last = (await each_store.load_snapshot(conversation_id="c1")).runs[0].last_operation
    assert (last.operation_id, last.step, last.phase, last.started_at) == (
        starts[1].operation_id,
        1,
        "completed",
        starts[1].started_at,
    )


async def test_a_step_without_content_has_no_first_output(each_store: Any) -> None:
    delivery = Recorder()
    result = await run_one(each_store, Script(nothing), publish=delivery)
    assert (result.terminal_reason, list(result.assistant.parts)) == ("success", [])
    assert [o.phase for o in delivery.operations()] == ["started", "completed"]
    assert delivery.operations()[-1].first_output_at is None


async def test_a_compaction_is_recorded_before_the_request(each_store: Any) -> None:
    delivery = Recorder()
    entered, release = asyncio.Event(), asyncio.Event()

    async def compact(request: Any) -> None:
        entered.set()
        await release.wait()

    runtime = make_runtime(each_store, Script(nothing), history={"compaction": compact}, publish=delivery)
    ticket = submit(runtime, "k", "hello")
    await asyncio.wait_for(entered.wait(), 5)
    during = (await each_store.load_snapshot(conversation_id="c1")).runs[0].last_operation
    assert (during.kind, during.phase) == ("compaction", "started")
    release.set()
    await asyncio.wait_for(ticket.result, 10)
    await runtime.close()
    assert [(o.kind, o.phase) for o in delivery.operations()] == [
        ("compaction", "started"),
        ("compaction", "completed"),
        ("model-request", "started"),
        ("model-request", "completed"),
    ]


async def test_a_failing_compaction_closes_its_record_without_its_cause(store: Any) -> None:
    delivery = Recorder()

    async def compact(request: Any) -> None:
        raise RuntimeError("private-compaction-cause")

    script = Script()
    result = await run_one(store, script, history={"compaction": compact}, publish=delivery)
    assert (result.terminal_reason, script.calls) == ("runtime_failure", [])
    assert [(o.kind, o.phase) for o in delivery.operations()] == [("compaction", "started"), ("compaction", "failed")]
    assert "private-compaction-cause" not in repr(delivery.operations())


async def test_an_interrupted_request_is_cancelled_without_a_first_output(store: Any) -> None:
    delivery = Recorder()

    async def hangs(i: int, messages: list[Any], info: Any) -> AsyncIterator[Any]:
        await asyncio.Event().wait()
        yield "never"

    script = Script(hangs)
    runtime = make_runtime(store, script, publish=delivery)
    ticket = submit(runtime, "k", "hello")
    run_id = (await ticket.admission).run.id
    await script.wait_entered(0)
    assert (await runtime.interrupt(conversation_id="c1", run_id=run_id)).outcome == "requested"
    result = await asyncio.wait_for(ticket.result, 10)
    await runtime.close()
    assert result.terminal_reason == "interrupted"
    last = delivery.operations()[-1]
    assert (last.kind, last.phase, last.first_output_at) == ("model-request", "cancelled", None)


async def test_a_failed_request_says_failed_without_the_providers_words(store: Any) -> None:
    delivery = Recorder()

    async def breaks(i: int, messages: list[Any], info: Any) -> AsyncIterator[Any]:
        raise ConnectionResetError("provider-secret-response")
        yield ""  # pragma: no cover

    result = await run_one(store, Script(breaks), publish=delivery)
    assert result.terminal_reason == "provider_failure"
    last = delivery.operations()[-1]
    assert (last.phase, last.first_output_at) == ("failed", None)
    assert "provider-secret-response" not in repr(delivery.operations())


async def test_a_request_whose_admission_cannot_be_written_is_never_sent(store: Any) -> None:
    """Step 1's ``started`` write fails: the second provider call never happens and the run ends as a
    storage failure, not a provider one."""
    delivery = Recorder()

    def second_admission(kwargs: dict[str, Any]) -> bool:
        operation = kwargs.get("operation")
        return operation is not None and (operation.kind, operation.phase, operation.step) == (
            "model-request",
            "started",
            1,
        )

    def refusing(write: Any) -> Any:
        async def wrapped(**kwargs: Any) -> Any:
            if second_admission(kwargs):
                raise AgentStoreUnavailableError("operation storage unavailable")
            return await write(**kwargs)

        return wrapped

    store.checkpoint_run_assistant = refusing(store.checkpoint_run_assistant)
    store.record_run_operation = refusing(store.record_run_operation)
    script = Script(one_lookup_then_answer)
    result = await run_one(store, script, tools=[lookup], publish=delivery, loop={"max_steps": 3})
    assert len(script.calls) == 1
    assert (result.terminal_reason, result.error.origin) == ("runtime_failure", "storage")
    assert [o.step for o in delivery.operations()] == [0, 0, 0]


async def test_runs_of_two_conversations_keep_their_own_versions_when_writes_yield(each_store: Any) -> None:
    outcomes: list[Any] = []

    def deferred(write: Any) -> Any:
        async def wrapped(**kwargs: Any) -> Any:
            await asyncio.sleep(0)
            result = await write(**kwargs)
            outcomes.append(result)
            return result

        return wrapped

    each_store.checkpoint_run_assistant = deferred(each_store.checkpoint_run_assistant)
    each_store.record_run_operation = deferred(each_store.record_run_operation)
    script = Script()
    runtime = make_runtime(each_store, script, loop={"checkpoint_every_events": 1})
    first, second = await asyncio.wait_for(
        asyncio.gather(
            submit(runtime, "ka", "hello", conversation_id="ca").result,
            submit(runtime, "kb", "hello", conversation_id="cb").result,
        ),
        10,
    )
    await runtime.close()
    assert (first.terminal_reason, second.terminal_reason, len(script.calls)) == ("success", "success", 2)


async def test_a_second_reader_sees_the_tool_result_while_the_next_request_runs(tmp_path: Path) -> None:
    path = tmp_path / "shared.db"

    async def then_hangs(i: int, messages: list[Any], info: Any) -> AsyncIterator[Any]:
        if i == 0:
            yield {0: DeltaToolCall(name="lookup", json_args='{"query": "value"}', tool_call_id="call-1")}
        else:
            await asyncio.Event().wait()
            yield "never"

    async with create_sqlite_agent_runtime_store(path) as handle:
        script = Script(then_hangs)
        runtime = make_runtime(handle.store, script, tools=[lookup], loop={"max_steps": 3})
        ticket = submit(runtime, "k", "hello")
        await script.wait_entered(1)
        async with create_sqlite_agent_runtime_store(path) as reader:
            snapshot = await reader.store.load_snapshot(conversation_id="c1")
        assert [p.type for p in snapshot.messages[-1].parts] == ["tool-call", "tool-result"]
        await runtime.close()
        await asyncio.wait_for(ticket.result, 5)


# --- idle_timeout ---------------------------------------------------------------------------------------


async def test_a_provider_that_never_opens_its_stream_times_out(each_store: Any) -> None:
    class NeverOpens(WrapperModel):
        def request_stream(self, *args: Any, **kwargs: Any) -> Any:
            class _Stream:
                async def __aenter__(self_inner) -> Any:
                    await asyncio.Event().wait()

                async def __aexit__(self_inner, *exc: Any) -> None:
                    return None

            return _Stream()

    script = Script()
    script.model = NeverOpens(script.model)  # type: ignore[assignment]
    result = await run_one(each_store, script, loop={"idle_timeout": 0.05})
    assert (result.terminal_reason, result.run.state) == ("timeout", "cancelled")
    stored = (await each_store.load_snapshot(conversation_id="c1")).runs[0]
    assert stored.terminal_reason == "timeout"


async def test_slow_preparation_spends_no_idle_budget(store: Any) -> None:
    async def slow_render(ctx: Any) -> str:
        await asyncio.sleep(0.15)  # three idle budgets, before the provider is called
        return "Be brief."

    prompt = compose_agent_prompt([{"name": "p", "stability": "stable", "render": slow_render}])
    result = await run_one(store, Script(), prompt=prompt, loop={"idle_timeout": 0.05})
    assert result.terminal_reason == "success"


async def test_stream_activity_resets_the_idle_deadline(store: Any) -> None:
    async def steady(i: int, messages: list[Any], info: Any) -> AsyncIterator[Any]:
        for word in ("one", "two", "three"):
            await asyncio.sleep(0.03)
            yield word

    began = time.monotonic()
    result = await run_one(store, Script(steady), loop={"idle_timeout": 0.08})
    assert time.monotonic() - began > 0.08  # longer than one budget in total, never silent that long
    assert (result.terminal_reason, answer_text(result)) == ("success", "onetwothree")


async def test_stop_reaches_a_tool_that_waits(store: Any) -> None:
    waiting = asyncio.Event()
    cancelled: list[bool] = []

    @define_agent_tool
    async def wait_for_child() -> str:
        """Waits for a child."""
        waiting.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.append(True)
            raise
        return "never"

    async def calls_it(i: int, messages: list[Any], info: Any) -> AsyncIterator[Any]:
        if i == 0:
            yield {0: DeltaToolCall(name="wait_for_child", json_args="{}", tool_call_id="child")}
        else:
            yield "done"

    runtime = make_runtime(store, Script(calls_it), tools=[wait_for_child], loop={"idle_timeout": 0.02})
    ticket = submit(runtime, "k", "hello")
    await asyncio.wait_for(waiting.wait(), 5)
    assert runtime.stop("c1") is True
    result = await asyncio.wait_for(ticket.result, 5)
    await runtime.close()
    assert cancelled == [True]
    assert result.terminal_reason != "timeout"


# --- what the delivery shows of tools and stop policies -------------------------------------------------


async def test_prepare_step_runs_again_after_a_tool_and_its_overrides_apply(store: Any) -> None:
    seen: list[int] = []

    def prepare(step: Any) -> dict[str, Any] | None:
        seen.append(step.step)
        return {"active_tools": [], "instructions": "after tool"} if step.step == 1 else None

    script = Script(one_lookup_then_answer)
    result = await run_one(store, script, tools=[lookup], loop={"max_steps": 3, "prepare_step": prepare})
    assert (result.terminal_reason, seen, len(script.calls)) == ("success", [0, 1], 2)
    assert [t.name for t in script.infos[0].function_tools] == ["lookup"]
    assert (script.infos[1].function_tools, script.infos[1].instructions) == ([], "after tool")


async def test_tool_status_carries_safe_payloads_and_the_terminal_names_the_policy(store: Any) -> None:
    delivery = Recorder()

    async def always_lookup(i: int, messages: list[Any], info: Any) -> AsyncIterator[Any]:
        yield {0: DeltaToolCall(name="lookup", json_args='{"query": "value"}', tool_call_id="call-1")}

    result = await run_one(
        store,
        Script(always_lookup),
        tools=[lookup],
        publish=delivery,
        loop={"stop_policies": [{"name": "enough-evidence", "should_stop": lambda step: True}]},
    )
    assert (result.terminal_reason, result.policy_name) == ("policy_stop", "enough-evidence")
    statuses = [(e.status, e.input, e.output) for e in delivery.events if e.type == "tool-status"]
    assert statuses == [("started", {"query": "value"}, None), ("completed", None, {"answer": "value"})]
    terminal = next(e for e in delivery.events if e.type == "terminal")
    assert (terminal.terminal_reason, terminal.policy_name) == ("policy_stop", "enough-evidence")


async def test_an_internal_tool_failure_stays_out_of_the_delivery(store: Any) -> None:
    delivery = Recorder()

    @define_agent_tool
    async def broken(query: str) -> str:
        """Fails."""
        raise RuntimeError("private failure detail")

    async def calls_broken(i: int, messages: list[Any], info: Any) -> AsyncIterator[Any]:
        yield {0: DeltaToolCall(name="broken", json_args='{"query": "value"}', tool_call_id="call-1")}

    await run_one(
        store,
        Script(calls_broken),
        tools=[broken],
        publish=delivery,
        loop={"stop_policies": [{"name": "failed-once", "should_stop": lambda step: True}]},
    )
    failed = [e for e in delivery.events if e.type == "tool-status" and e.status == "failed"]
    assert len(failed) == 1 and failed[0].output["error"] == "INTERNAL_SERVER_ERROR"
    assert "private failure detail" not in repr(delivery.events)
