"""Every terminal reason produced by its real cause, and the run state / assistant status it implies.
Failures are classified by where they happened, never by message text."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
from pydantic_ai.messages import ModelResponse
from pydantic_ai.models.function import DeltaToolCall
from pydantic_ai.models.wrapper import WrapperModel

from threadline import (
    AgentContextOverflowError,
    AgentStoreConflictError,
    compose_agent_prompt,
    define_agent_protocol,
    define_agent_tool,
)

from .conftest import Context, Script, answer_text, make_runtime, submit


async def silence() -> None:
    """A provider that goes silent for ever."""
    await asyncio.Event().wait()


def script_of(handler: Any) -> Script:
    return Script(handler)


async def run_one(store: Any, script: Script, **sections: Any) -> Any:
    runtime = make_runtime(store, script, **sections)
    ticket = submit(runtime, "k", "hello")
    result = await asyncio.wait_for(ticket.result, 10)
    await runtime.close()
    return result


@define_agent_tool
async def noop() -> str:
    """Does nothing."""
    return "ok"


async def always_calls_a_tool(i: int, messages: list[Any], info: Any) -> AsyncIterator[Any]:
    yield {0: DeltaToolCall(name="noop", json_args="{}", tool_call_id=f"call-{i}")}


async def test_success(store: Any) -> None:
    result = await run_one(store, Script())
    assert (result.terminal_reason, result.run.state, result.assistant.status) == ("success", "completed", "completed")
    assert result.metrics is not None and result.metrics.steps == 1


async def test_max_steps_is_a_policy_stop(store: Any) -> None:
    script = script_of(always_calls_a_tool)
    result = await run_one(store, script, tools=[noop], loop={"max_steps": 2})
    assert (result.terminal_reason, result.run.state, result.policy_name) == ("policy_stop", "completed", "max-steps")
    assert result.run.policy_name == "max-steps"
    assert len(script.calls) == 2


async def test_named_stop_policy(store: Any) -> None:
    seen = []

    def budget(step: Any) -> bool:
        seen.append(step.step)
        return step.step == 1

    result = await run_one(
        store,
        script_of(always_calls_a_tool),
        tools=[noop],
        loop={"stop_policies": [{"name": "budget", "should_stop": budget}]},
    )
    assert (result.terminal_reason, result.policy_name) == ("policy_stop", "budget")
    assert seen == [0, 1]


async def test_provider_stop_when_the_provider_ends_on_length(store: Any) -> None:
    class Truncating(WrapperModel):
        def request_stream(self, *args: Any, **kwargs: Any) -> Any:
            inner = self.wrapped.request_stream(*args, **kwargs)

            class _Stream:
                async def __aenter__(self_inner) -> Any:
                    stream = await inner.__aenter__()
                    stream.finish_reason = "length"
                    return stream

                async def __aexit__(self_inner, *exc: Any) -> Any:
                    return await inner.__aexit__(*exc)

            return _Stream()

    script = Script()
    script.model = Truncating(script.model)  # type: ignore[assignment]
    result = await run_one(store, script)
    assert (result.terminal_reason, result.run.state, result.assistant.status) == (
        "provider_stop",
        "completed",
        "completed",
    )
    assert result.policy_name is None  # the provider's cap, not an application policy


async def test_idle_timeout_measures_provider_silence(store: Any) -> None:
    async def silent(i: int, messages: list[Any], info: Any) -> AsyncIterator[Any]:
        yield "thinking..."
        await silence()
        yield "never"

    result = await run_one(store, script_of(silent), loop={"idle_timeout": 0.05})
    assert (result.terminal_reason, result.run.state, result.assistant.status) == ("timeout", "cancelled", "failed")


async def test_idle_timeout_pauses_while_tools_run(store: Any) -> None:
    @define_agent_tool
    async def slow() -> str:
        await asyncio.sleep(0.2)  # longer than the idle timeout: tool time is not provider silence
        return "done"

    async def handler(i: int, messages: list[Any], info: Any) -> AsyncIterator[Any]:
        if i == 0:
            yield {0: DeltaToolCall(name="slow", json_args="{}", tool_call_id="c")}
        else:
            yield "finished"

    result = await run_one(store, script_of(handler), tools=[slow], loop={"idle_timeout": 0.1})
    assert result.terminal_reason == "success"


async def test_prepare_step_overflow_ends_context_overflow_without_calling_the_provider(store: Any) -> None:
    script = Script()

    def refuse(step: Any) -> None:
        raise AgentContextOverflowError("prepared step exceeds the selected model window")

    result = await run_one(store, script, loop={"prepare_step": refuse})
    assert (result.terminal_reason, result.run.state, result.assistant.status) == (
        "context_overflow",
        "failed",
        "failed",
    )
    assert script.calls == []


async def test_prompt_callback_failure_is_a_runtime_failure(store: Any) -> None:
    script = Script()

    def broken(ctx: Any) -> str:
        raise KeyError("missing template")

    prompt = compose_agent_prompt([{"name": "p", "stability": "stable", "render": broken}])
    result = await run_one(store, script, prompt=prompt)
    assert (result.terminal_reason, result.run.state) == ("runtime_failure", "failed")
    assert script.calls == []
    # the acquisition admitted the first request; the terminal says it failed before any call
    operation = result.run.last_operation
    assert operation is not None
    assert (operation.kind, operation.step, operation.phase, operation.detail) == (
        "model-request",
        0,
        "failed",
        "runtime_failure",
    )
    assert operation.finished_at is not None


async def test_a_run_interrupted_before_its_first_call_records_that_request_cancelled(store: Any) -> None:
    script = Script()
    entered, gate = asyncio.Event(), asyncio.Event()

    async def tools(ctx: Any) -> list[Any]:  # resolved after the acquisition, before the first call
        entered.set()
        await gate.wait()
        return []

    runtime = make_runtime(store, script, tools=tools)
    ticket = submit(runtime, "k", "hello")
    run_id = (await ticket.admission).run.id
    await asyncio.wait_for(entered.wait(), 5)
    await runtime.interrupt(conversation_id="c1", run_id=run_id)
    gate.set()
    result = await asyncio.wait_for(ticket.result, 5)
    await runtime.close()
    assert (result.terminal_reason, script.calls) == ("interrupted", [])
    operation = result.run.last_operation
    assert operation is not None
    assert (operation.kind, operation.step, operation.phase) == ("model-request", 0, "cancelled")
    assert operation.detail is None and operation.finished_at is not None


async def test_provider_error_is_a_provider_failure(store: Any) -> None:
    async def failing(i: int, messages: list[Any], info: Any) -> AsyncIterator[Any]:
        yield "partial"
        raise ConnectionResetError("the provider went away")

    result = await run_one(store, script_of(failing))
    assert (result.terminal_reason, result.run.state, result.assistant.status) == (
        "provider_failure",
        "failed",
        "failed",
    )
    assert result.policy_name is None and result.run.policy_name is None  # a failure is no policy's stop


async def test_require_output_rejects_a_blank_answer(store: Any) -> None:
    async def blank(i: int, messages: list[Any], info: Any) -> AsyncIterator[Any]:
        yield "   "

    protocol = define_agent_protocol(context=Context, terminal_acceptance="require-output")
    result = await run_one(store, script_of(blank), protocol=protocol)
    assert (result.terminal_reason, result.run.state, result.assistant.status) == (
        "output_rejected",
        "failed",
        "failed",
    )


async def test_terminal_acceptance_callback(store: Any) -> None:
    judged = []

    def accept(candidate: Any) -> bool:
        judged.append((candidate.terminal_reason, "".join(p.text for p in candidate.parts if p.type == "text")))
        return False

    protocol = define_agent_protocol(context=Context, terminal_acceptance=accept)
    result = await run_one(store, Script(), protocol=protocol)
    assert result.terminal_reason == "output_rejected"
    assert judged == [("success", "answer to: hello")]


async def test_a_refused_owned_mutation_is_a_storage_conflict(store: Any) -> None:
    original = store.checkpoint_run_assistant

    async def refusing(**kwargs: Any) -> Any:
        operation = kwargs.get("operation")
        if operation is not None and operation.phase == "started":  # the request's durable admission
            raise AgentStoreConflictError("refused by the store", conversation_id=kwargs["conversation_id"])
        return await original(**kwargs)

    store.checkpoint_run_assistant = refusing
    # step 0's admission rides on the acquisition; step 1's (after the tool) is a checkpoint, refused here
    script = script_of(always_calls_a_tool)
    result = await run_one(store, script, tools=[noop])
    assert (result.terminal_reason, result.run.state) == ("storage_conflict", "failed")
    assert len(script.calls) == 1, "a refused admission prevents the provider call"


async def test_interrupted_superseded_and_shutdown(store: Any) -> None:
    cases = (
        ("interrupt", "interrupted"),
        ("stop-supersede", "superseded"),
        ("stop-cancel", "cancelled"),
        ("close", "shutdown"),
    )
    for how, expected in cases:
        script = Script()
        streamed = asyncio.Event()

        async def hanging(
            i: int, messages: list[Any], info: Any, streamed: asyncio.Event = streamed
        ) -> AsyncIterator[Any]:
            yield "partial"
            streamed.set()  # the loop asked for more: "partial" was consumed
            await silence()

        script.handler = hanging
        runtime = make_runtime(store, script)
        ticket = submit(runtime, f"k-{how}", "hello", conversation_id=f"c-{how}")
        run_id = (await ticket.admission).run.id
        await asyncio.wait_for(streamed.wait(), 5)
        if how == "interrupt":
            await runtime.interrupt(conversation_id=f"c-{how}", run_id=run_id)
        elif how == "stop-supersede":
            assert runtime.stop(f"c-{how}", "supersede")
        elif how == "stop-cancel":
            assert runtime.stop(f"c-{how}", "cancel")
        else:
            closed = await runtime.close()
            assert closed.settled and closed.remaining == 0
        result = await asyncio.wait_for(ticket.result, 5)
        assert result.terminal_reason == expected
        status = {"superseded": "superseded"}.get(expected, "interrupted")
        state = {"superseded": "superseded", "cancelled": "cancelled"}.get(expected, "interrupted")
        assert (result.assistant.status, result.run.state) == (status, state)
        assert answer_text(result) == "partial"
        await runtime.close()


async def test_abandon_closes_an_orphan_with_evidence(store: Any) -> None:
    accepted = await store.accept_input_and_assign_run(
        conversation_id="c", idempotency_key="k", input={"id": "m", "parts": [{"type": "text", "text": "hi"}]}
    )
    orphan = await store.acquire_run(
        conversation_id="c", run_id=accepted.run.id, expected_revision=1, owner_id="a-dead-process"
    )
    runtime = make_runtime(store, Script())
    with pytest.raises(Exception) as refused:
        await runtime.abandon(conversation_id="c", run_id=orphan.run.id, expected_revision=orphan.run.revision)
    assert refused.type.__name__ == "AgentRecordValidationError"
    result = await runtime.abandon(
        conversation_id="c", run_id=orphan.run.id, expected_revision=orphan.run.revision, stale_owner=True
    )
    assert (result.run.state, result.run.terminal_reason, result.assistant.status) == (
        "abandoned",
        "abandoned",
        "failed",
    )
    await runtime.close()


async def test_45_deltas_give_two_checkpoints_and_the_terminal(store: Any) -> None:
    async def chatty(i: int, messages: list[Any], info: Any) -> AsyncIterator[Any]:
        for n in range(45):
            yield f"w{n} "

    result = await run_one(store, script_of(chatty))
    assert result.terminal_reason == "success"
    # the input's admission also started the run (nothing ran in the conversation) and wrote the initial
    # draft with the request's admission; then two batches of 20; the last step's end is written by the
    # terminal commit itself
    assert store.metrics["accept_input_and_assign_run"].calls == 1
    assert "acquire_run" not in store.metrics
    assert store.metrics["checkpoint_run_assistant"].calls == 2
    assert store.metrics["commit_run_terminal"].calls == 1
    assert result.run.last_operation is not None and result.run.last_operation.phase == "completed"
    assert answer_text(result) == "".join(f"w{n} " for n in range(45))


async def test_instructions_reach_every_request(store: Any) -> None:
    script = script_of(always_calls_a_tool)
    prompt = compose_agent_prompt(
        [{"name": "product", "stability": "stable", "render": lambda ctx: f"Help user {ctx.context.user_id}."}]
    )
    await run_one(store, script, tools=[noop], prompt=prompt, loop={"max_steps": 2})
    assert [info.instructions for info in script.infos] == ["Help user u1.", "Help user u1."]
    # step 2 carries the tool round of step 1
    assert isinstance(script.calls[1][-2], ModelResponse)
