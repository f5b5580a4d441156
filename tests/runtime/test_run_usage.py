"""``Run.usage``: what a run spent is durable and honest (issue 17 §3). It is the run's cumulative spend
over every attempt and compaction invocation, written with commits the run makes anyway."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from pydantic_ai.messages import ModelRequest, ToolReturnPart
from pydantic_ai.models.function import DeltaToolCall
from pydantic_ai.usage import RequestUsage

from threadline import AgentUsage, define_agent_tool

from .conftest import Script, make_runtime, submit

WAIT = 5
WRITES = ("accept_input_and_assign_run", "checkpoint_run_assistant", "record_run_operation", "commit_run_terminal")


@define_agent_tool
async def lookup() -> str:
    return "found"


async def tool_then_answer(i: int, messages: list[Any], info: Any) -> AsyncIterator[Any]:
    last = messages[-1]
    if isinstance(last, ModelRequest) and any(isinstance(p, ToolReturnPart) for p in last.parts):
        yield "the answer"
    else:
        yield {0: DeltaToolCall(name="lookup", json_args="{}", tool_call_id=f"call-{i}")}


async def test_the_stored_run_holds_the_sum_of_its_steps_as_the_operator_events_report_them(store: Any) -> None:
    operator: list[Any] = []
    runtime = make_runtime(store, Script(tool_then_answer), tools=[lookup], operator_publish=operator.append)
    result = await asyncio.wait_for(submit(runtime, "k", "go").result, WAIT)
    await runtime.close()
    steps = [e.usage for e in operator if e.type == "step-finished"]
    assert len(steps) == 2
    expected = steps[0] + steps[1]
    stored = (await store.load_run(conversation_id="c1", run_id=result.run.id)).run
    assert stored.usage == expected == result.usage
    assert stored.usage.steps == 2 and stored.usage.input_tokens.provenance == "computed"
    assert result.metrics is not None and result.metrics.usage == expected


async def test_durable_usage_adds_no_commit(store: Any) -> None:
    """Spend rides on the checkpoints and the terminal commit a turn makes anyway."""
    runtime = make_runtime(store, Script(tool_then_answer), tools=[lookup])
    await asyncio.wait_for(submit(runtime, "k0", "warm up").result, WAIT)
    before = {name: stats.calls for name, stats in store.metrics.items()}
    await asyncio.wait_for(submit(runtime, "k1", "go").result, WAIT)
    writes = {name: stats.calls - before.get(name, 0) for name, stats in store.metrics.items() if name in WRITES}
    await runtime.close()
    # admission (which starts the run), the step-finish checkpoint, the next request's admission, the terminal
    assert sum(writes.values()) == 4, writes


async def test_a_failed_attempt_and_a_compaction_summarizer_count_in_the_run_s_spend(store: Any) -> None:
    async def flaky(i: int, messages: list[Any], info: Any) -> AsyncIterator[Any]:
        if i == 0:
            yield "partial "
            raise ConnectionError("the stream dropped")
        yield "the answer"

    async def compaction(request: Any) -> Any:
        request.report_usage(RequestUsage(input_tokens=100, output_tokens=7))

    operator: list[Any] = []
    runtime = make_runtime(
        store,
        Script(flaky),
        loop={"retry": {"max_attempts": 2, "initial_delay": 0, "retry_on": lambda error: True}},
        history={"compaction": compaction},
        operator_publish=operator.append,
    )
    result = await asyncio.wait_for(submit(runtime, "k", "go").result, WAIT)
    await runtime.close()
    assert result.terminal_reason == "success"
    steps = [e.usage for e in operator if e.type == "step-finished"]
    assert [e.attempt for e in operator if e.type == "step-finished"] == [1, 2]  # the failed one is reported
    usage = (await store.load_run(conversation_id="c1", run_id=result.run.id)).run.usage
    # two compaction invocations (one before each attempt) and both attempts
    assert usage.steps == 4
    assert usage.input_tokens.value == 200 + sum(s.input_tokens.value or 0 for s in steps)
    assert usage.output_tokens.value == 14 + sum(s.output_tokens.value or 0 for s in steps)
    assert usage == result.usage


async def test_a_run_that_never_reached_the_provider_has_every_field_unavailable(store: Any) -> None:
    release = asyncio.Event()

    async def slow(i: int, messages: list[Any], info: Any) -> AsyncIterator[Any]:
        await release.wait()
        yield "never"

    script = Script(slow)
    runtime = make_runtime(store, script)
    ticket = submit(runtime, "k", "go")
    await asyncio.wait_for(script.wait_entered(0), WAIT)
    runtime.stop("c1")
    result = await asyncio.wait_for(ticket.result, WAIT)
    await runtime.close()
    assert result.terminal_reason == "interrupted"
    assert isinstance(result.usage, AgentUsage) and result.usage.input_tokens.provenance == "unavailable"
    assert result.usage.cost.provenance == "unavailable"


async def test_a_one_step_run_total_on_its_terminal_events_is_computed_while_its_step_is_provider_reported(
    store: Any,
) -> None:
    """A run total is a sum, even over one step: only the step-finished figures carry the provider's word."""
    delivered: list[Any] = []
    operator: list[Any] = []

    async def answer(i: int, messages: list[Any], info: Any) -> AsyncIterator[Any]:
        yield "the answer"

    runtime = make_runtime(store, Script(answer), publish=delivered.append, operator_publish=operator.append)
    await asyncio.wait_for(submit(runtime, "k", "go").result, WAIT)
    await runtime.close()
    (step,) = [e.usage for e in operator if e.type == "step-finished"]
    assert step.input_tokens.provenance == step.output_tokens.provenance == "provider-reported"
    (terminal,) = [e for e in delivered if e.type == "terminal"]
    (run_terminal,) = [e for e in operator if e.type == "run-terminal"]
    for usage in (terminal.usage, run_terminal.usage):
        assert usage.steps == 1
        assert (usage.input_tokens.provenance, usage.output_tokens.provenance) == ("computed", "computed")
        assert (usage.input_tokens.value, usage.output_tokens.value) == (
            step.input_tokens.value,
            step.output_tokens.value,
        )
