"""Structured output through pydantic-ai's own output modes (tool, native, prompted) over
``Model.request_stream``: ``result.output`` is the validated value, an invalid one is retried within a bound
and then ends ``output_rejected``, and a run may override the protocol's output."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from pydantic import BaseModel
from pydantic_ai import NativeOutput, PromptedOutput, TextOutput, ToolOutput
from pydantic_ai.messages import ModelRequest, ModelResponse, RetryFeedbackPart, ToolReturnPart
from pydantic_ai.models.function import DeltaToolCall
from pydantic_ai.models.test import TestModel

from threadline import AgentConfigError, create_agent_runtime, define_agent_protocol, define_agent_tool

from .conftest import Context, Script, make_runtime, submit

WAIT = 10


class City(BaseModel):
    name: str
    population: int


def with_output(output: Any, **kw: Any) -> Any:
    return define_agent_protocol(context=Context, output=output, **kw)


async def run(store: Any, script: Script, protocol: Any, message: str = "a city?", **kw: Any) -> Any:
    runtime = make_runtime(store, script, protocol=protocol, **kw)
    try:
        return await asyncio.wait_for(submit(runtime, "k", message).result, WAIT)
    finally:
        await runtime.close()


def final_result(args: dict[str, Any], call_id: str = "out-1", name: str = "final_result") -> dict[int, Any]:
    return {0: DeltaToolCall(name=name, json_args=json.dumps(args), tool_call_id=call_id)}


async def test_the_models_default_mode_with_the_test_model(store: Any) -> None:
    registry_model = TestModel()
    runtime = create_agent_runtime(protocol=with_output(City), store=store, models=registry_model, publish=None)
    result = await asyncio.wait_for(runtime.submit(conversation_id="c1", parts="a city?", context={}).result, WAIT)
    # a second turn projects the first one's output call and its result back: history stays provider-valid
    again = await asyncio.wait_for(runtime.submit(conversation_id="c1", parts="another?", context={}).result, WAIT)
    await runtime.close()
    assert result.terminal_reason == "success" and isinstance(result.output, City)
    assert result.output == City(name="a", population=0)  # what TestModel generates from the schema
    assert [p.type for p in result.assistant.parts] == ["tool-call", "tool-result"]
    call, done = result.assistant.parts
    assert (call.tool_name, done.outcome, done.output) == ("final_result", "success", "Final result processed.")
    assert again.output == City(name="a", population=0) and again.error is None


async def test_tool_output_retries_invalid_arguments_with_the_errors(store: Any) -> None:
    async def model(i: int, messages: list[Any], info: Any) -> AsyncIterator[Any]:
        if i == 0:
            yield final_result({"name": "Paris"})  # population missing
        else:
            yield final_result({"name": "Paris", "population": 2_100_000}, call_id="out-2")

    script = Script(model)
    result = await run(store, script, with_output(ToolOutput(City)))
    assert result.output == City(name="Paris", population=2_100_000)
    info = script.infos[0]
    assert [t.name for t in info.output_tools] == ["final_result"] and info.allow_text_output is False
    assert info.model_request_parameters.output_mode == "tool"
    [shown] = [p for p in script.calls[1][-1].parts if isinstance(p, ToolReturnPart)]
    assert shown.content["error"] == "INVALID_OUTPUT" and "population: Field required" in shown.content["message"]
    kinds = [(p.type, getattr(p, "outcome", None)) for p in result.assistant.parts]
    assert kinds == [("tool-call", None), ("tool-result", "error"), ("tool-call", None), ("tool-result", "success")]


async def test_native_output_is_the_answer_text(store: Any) -> None:
    async def model(i: int, messages: list[Any], info: Any) -> AsyncIterator[Any]:
        yield '{"name": "Lyon", '
        yield '"population": 520000}'

    script = Script(model)
    events: list[Any] = []
    result = await run(store, script, with_output(NativeOutput(City)), publish=events.append)
    params = script.infos[0].model_request_parameters
    assert params.output_mode == "native" and params.output_object.name == "City"
    assert result.output == City(name="Lyon", population=520000)
    assert result.text == '{"name": "Lyon", "population": 520000}'
    assert "".join(e.delta for e in events if e.type == "assistant-delta") == result.text  # it streams


async def test_prompted_output_puts_the_schema_in_the_instructions(store: Any) -> None:
    async def model(i: int, messages: list[Any], info: Any) -> AsyncIterator[Any]:
        yield '```json\n{"name": "Nice", "population": 340000}\n```'

    script = Script(model)
    result = await run(store, script, with_output(PromptedOutput(City)), prompt="Answer about France.")
    instructions = script.infos[0].instructions or ""
    assert "Answer about France." in instructions and '"population"' in instructions
    assert script.infos[0].model_request_parameters.output_mode == "prompted"
    assert result.output == City(name="Nice", population=340000)


async def test_invalid_text_is_withdrawn_retried_with_the_errors_then_rejected(store: Any) -> None:
    async def model(i: int, messages: list[Any], info: Any) -> AsyncIterator[Any]:
        yield '{"name": "Oops", "population": "many"}'

    script = Script(model)
    events: list[Any] = []
    result = await run(store, script, with_output(NativeOutput(City), output_retries=2), publish=events.append)
    assert result.terminal_reason == "output_rejected" and result.output is None
    assert len(script.calls) == 3  # the first attempt and two retries
    withdrawn, retry = script.calls[1][-2:]
    assert isinstance(withdrawn, ModelResponse)
    assert withdrawn.parts[0].content == '{"name": "Oops", "population": "many"}'
    assert isinstance(retry, ModelRequest) and isinstance(retry.parts[0], RetryFeedbackPart)
    assert retry.parts[0].content[0]["loc"] == ("population",)
    assert sum(e.type == "attempt-reset" for e in events) == 2
    error = result.error
    assert (error.origin, error.exception_type) == ("policy", "pydantic_core._pydantic_core.ValidationError")
    assert error.summary.startswith("the model's output did not fit City after 3 attempts: population:")
    # the last invalid answer stays as the failed answer's evidence; the withdrawn ones are gone
    assert result.text == '{"name": "Oops", "population": "many"}'


async def test_text_where_only_the_output_tool_may_answer_is_sent_back(store: Any) -> None:
    async def model(i: int, messages: list[Any], info: Any) -> AsyncIterator[Any]:
        if i == 0:
            yield "Paris, about two million."
        else:
            yield final_result({"name": "Paris", "population": 2_000_000})

    script = Script(model)
    result = await run(store, script, with_output(ToolOutput(City)))
    assert result.output == City(name="Paris", population=2_000_000)
    retry = script.calls[1][-1]
    assert "Give your final answer by calling final_result" in retry.parts[0].content
    assert result.text == ""  # the text answer was withdrawn


async def test_function_tools_and_the_output_tool_together(store: Any) -> None:
    ran: list[str] = []

    @define_agent_tool
    async def census(city: str) -> int:
        """The population of a city."""
        ran.append(city)
        return 2_100_000

    async def model(i: int, messages: list[Any], info: Any) -> AsyncIterator[Any]:
        if i == 0:
            yield {0: DeltaToolCall(name="census", json_args='{"city": "Paris"}', tool_call_id="t-1")}
        else:  # the answer, and a call the model should not have made alongside it
            yield {
                0: DeltaToolCall(name="census", json_args='{"city": "Lyon"}', tool_call_id="t-2"),
                1: DeltaToolCall(
                    name="final_result", json_args='{"name": "Paris", "population": 2100000}', tool_call_id="o-1"
                ),
            }

    script = Script(model)
    result = await run(store, script, with_output(City), tools=[census])
    assert result.output == City(name="Paris", population=2_100_000)
    assert ran == ["Paris"], "a call beside the final answer is not executed"
    skipped = [p for p in result.assistant.parts if p.type == "tool-result" and p.call_id == "t-2"]
    assert skipped[0].output["error"] == "NOT_EXECUTED"


async def test_require_output_accepts_a_structured_answer_without_text(store: Any) -> None:
    protocol = define_agent_protocol(context=Context, output=City, terminal_acceptance="require-output")
    runtime = create_agent_runtime(protocol=protocol, store=store, models=TestModel())
    result = await asyncio.wait_for(runtime.submit(conversation_id="c1", parts="a city?", context={}).result, WAIT)
    await runtime.close()
    assert result.terminal_reason == "success" and result.text == "" and result.output is not None


async def test_a_run_overrides_the_protocols_output_and_a_duplicate_reads_it_back(store: Any) -> None:
    class Country(BaseModel):
        name: str

    async def model(i: int, messages: list[Any], info: Any) -> AsyncIterator[Any]:
        if info.output_tools:
            yield final_result({"name": "France"})
        else:
            yield "plain text"

    script = Script(model)
    runtime = make_runtime(store, script)  # the protocol declares no output
    plain = await asyncio.wait_for(submit(runtime, "k1", "hello").result, WAIT)
    typed = await asyncio.wait_for(submit(runtime, "k2", "a country?", output=Country).result, WAIT)
    duplicate = await asyncio.wait_for(submit(runtime, "k2", "a country?", output=Country).result, WAIT)
    untyped_duplicate = await asyncio.wait_for(submit(runtime, "k2", "a country?").result, WAIT)
    await runtime.close()
    assert (plain.output, plain.text) == (None, "plain text")
    assert typed.output == Country(name="France")
    assert duplicate.run.id == typed.run.id and duplicate.output == Country(name="France")
    assert untyped_duplicate.output is None  # the override belongs to the submission that gave it


def rate(city: City) -> str:
    return city.name


@pytest.mark.parametrize(
    "output",
    [str, rate, TextOutput(rate), 42],
    ids=["str", "function", "text-output", "not-a-type"],
)
def test_outputs_pydantic_ai_or_threadline_cannot_validate_are_refused_where_declared(output: Any) -> None:
    with pytest.raises(AgentConfigError) as refused:
        define_agent_protocol(output=output)
    assert refused.value.field == "output"


async def test_a_bad_per_run_output_is_refused_at_submit(store: Any) -> None:
    runtime = make_runtime(store, Script())
    with pytest.raises(AgentConfigError):
        submit(runtime, "k", "hi", output=rate)
    await runtime.close()
    assert (await store.load_snapshot(conversation_id="c1")).version == 0


def test_output_retries_needs_an_output_and_a_count() -> None:
    with pytest.raises(AgentConfigError) as refused:
        define_agent_protocol(output_retries=3)
    assert refused.value.field == "output_retries"
    with pytest.raises(AgentConfigError) as refused:
        define_agent_protocol(output=City, output_retries=-1)
    assert refused.value.field == "output_retries"
