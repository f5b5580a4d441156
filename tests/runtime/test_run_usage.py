"""``Run.usage``: what a run spent is durable and honest (issue 17 §3). It is the run's cumulative spend
over every attempt and compaction invocation, written with commits the run makes anyway."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from decimal import Decimal
from typing import Any

import pytest
from pydantic_ai.messages import ModelRequest, ToolReturnPart
from pydantic_ai.models.function import DeltaToolCall
from pydantic_ai.models.wrapper import WrapperModel
from pydantic_ai.usage import RequestUsage

from threadline import AgentRunUnsettledError, AgentStoreUnavailableError, AgentUsage, define_agent_tool
from threadline.usage import AgentCost, UsageFigure

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


class _Reporting(WrapperModel):
    """The wrapped model, its i-th request reporting ``usages[i]`` (the last one after) as the provider's
    figures for that request, and ``costs[i]`` (US dollars) as its reported cost when given."""

    def __init__(self, wrapped: Any, *usages: RequestUsage, costs: tuple[str, ...] = ()) -> None:
        super().__init__(wrapped)
        self.usages = usages
        self.costs = costs
        self.requests = 0

    def request_stream(self, *args: Any, **kwargs: Any) -> Any:
        inner = self.wrapped.request_stream(*args, **kwargs)
        reported = self.usages[min(self.requests, len(self.usages) - 1)]
        cost = self.costs[self.requests] if self.requests < len(self.costs) else None
        self.requests += 1

        class _Stream:
            async def __aenter__(self_inner) -> Any:
                stream = await inner.__aenter__()
                stream.__class__ = type("Reported", (type(stream),), {"usage": property(lambda _: reported)})
                if cost is not None:
                    stream.provider_details = {"cost": cost}
                return stream

            async def __aexit__(self_inner, *exc: Any) -> Any:
                return await inner.__aexit__(*exc)

        return _Stream()


async def test_a_fractional_token_count_from_the_provider_is_unavailable_and_the_run_still_answers(
    store: Any,
) -> None:
    """A token is a whole number: a provider that reports 3.5 input tokens gave no usable input count, and
    that is recorded as ``unavailable`` rather than failing the run that already answered."""
    operator: list[Any] = []
    script = Script()
    script.model = _Reporting(script.model, RequestUsage(input_tokens=3.5, output_tokens=10))  # type: ignore[arg-type]
    runtime = make_runtime(store, script, operator_publish=operator.append)
    result = await asyncio.wait_for(submit(runtime, "k", "go").result, WAIT)
    await runtime.close()
    assert result.terminal_reason == "success"
    (step,) = [e.usage for e in operator if e.type == "step-finished"]
    assert step.input_tokens == UsageFigure()  # unavailable
    assert step.output_tokens == UsageFigure(value=10, provenance="provider-reported")
    assert result.usage.input_tokens.value is None and result.usage.output_tokens.value == 10


async def test_each_step_is_told_the_previous_request_s_prompt_size_not_the_run_s_input_total(store: Any) -> None:
    """``context_usage`` is how full the window is: the last request's input tokens, as the provider reported
    them. The first step has no such figure and says ``unavailable``, not 0; later steps never see the
    run's cumulative input (which would count every earlier prompt again)."""
    seen: list[Any] = []

    async def two_lookups(i: int, messages: list[Any], info: Any) -> AsyncIterator[Any]:
        if i < 2:
            yield {0: DeltaToolCall(name="lookup", json_args="{}", tool_call_id=f"call-{i}")}
        else:
            yield "the answer"

    script = Script(two_lookups)
    prompts = (40_000, 50_000, 70_000)
    script.model = _Reporting(script.model, *(RequestUsage(input_tokens=n, output_tokens=5) for n in prompts))  # type: ignore[assignment]
    runtime = make_runtime(
        store, script, tools=[lookup], loop={"prepare_step": lambda step: seen.append(step.context_usage)}
    )
    result = await asyncio.wait_for(submit(runtime, "k", "go").result, WAIT)
    await runtime.close()
    assert result.terminal_reason == "success"
    assert [(u.input_tokens, u.provenance) for u in seen] == [
        (None, "unavailable"),
        (40_000, "provider-reported"),
        (50_000, "provider-reported"),
    ]
    assert {u.context_window for u in seen} == {100_000}
    assert [u.ratio for u in seen] == [None, 0.4, 0.5]
    assert result.usage.input_tokens.value == sum(prompts)  # the run's spend is the other, cumulative, figure


def _three_priced_steps() -> Script:
    """Two tool-calling steps and an answer: 1000/100 tokens for $0.50, 2000/200 for $1.00, 3000/300 for $1.50."""

    async def two_lookups(i: int, messages: list[Any], info: Any) -> AsyncIterator[Any]:
        if i < 2:
            yield {0: DeltaToolCall(name="lookup", json_args="{}", tool_call_id=f"call-{i}")}
        else:
            yield "the answer"

    script = Script(two_lookups)
    usages = (RequestUsage(input_tokens=1000 * n, output_tokens=100 * n) for n in (1, 2, 3))
    script.model = _Reporting(script.model, *usages, costs=("0.50", "1.00", "1.50"))  # type: ignore[assignment]
    return script


async def test_a_multi_step_run_reports_every_step_of_its_cost_as_a_computed_sum(store: Any) -> None:
    delivered: list[Any] = []
    operator: list[Any] = []
    runtime = make_runtime(
        store, _three_priced_steps(), tools=[lookup], publish=delivered.append, operator_publish=operator.append
    )
    result = await asyncio.wait_for(submit(runtime, "k", "go").result, WAIT)
    await runtime.close()
    steps = [e.usage for e in operator if e.type == "step-finished"]
    assert [s.cost for s in steps] == [
        AgentCost(amount=Decimal(v), currency="USD", provenance="provider-reported") for v in ("0.50", "1.00", "1.50")
    ]
    assert steps[0].input_tokens == UsageFigure(value=1000, provenance="provider-reported")
    (run_terminal,) = [e for e in operator if e.type == "run-terminal"]
    (terminal,) = [e for e in delivered if e.type == "terminal"]
    stored = (await store.load_run(conversation_id="c1", run_id=result.run.id)).run.usage
    for usage in (run_terminal.usage, terminal.usage, result.usage, stored):
        assert usage.cost == AgentCost(amount=Decimal(3), currency="USD", provenance="computed")
        assert usage.input_tokens == UsageFigure(value=6000, provenance="computed")
        assert usage.output_tokens == UsageFigure(value=600, provenance="computed")


async def test_an_executor_that_loses_the_terminal_still_reports_its_spend_and_delivers_no_terminal(
    store: Any,
) -> None:
    delivered: list[Any] = []
    operator: list[Any] = []
    runtime = make_runtime(
        store, _three_priced_steps(), tools=[lookup], publish=delivered.append, operator_publish=operator.append
    )
    original = store.commit_run_terminal

    async def beaten(**kwargs: Any) -> Any:
        await original(**kwargs)  # another execution settles the run first
        return await original(**kwargs)

    store.commit_run_terminal = beaten
    result = await asyncio.wait_for(submit(runtime, "k", "go").result, WAIT)
    await runtime.close()
    assert result.metrics is None  # this execution did not commit the terminal
    assert not [e for e in delivered if e.type == "terminal"]  # the winner delivered the turn
    (run_terminal,) = [e for e in operator if e.type == "run-terminal"]
    assert run_terminal.outcome == "lost"
    assert run_terminal.usage.cost == AgentCost(amount=Decimal(3), currency="USD", provenance="computed")
    assert result.run.id in run_terminal.event_id


async def test_an_execution_that_cannot_settle_its_run_still_reports_what_it_spent(store: Any) -> None:
    """The run's fate belongs to whoever settles it later; the money this execution spent is not in doubt."""
    operator: list[Any] = []
    runtime = make_runtime(store, _three_priced_steps(), tools=[lookup], operator_publish=operator.append)

    async def down(**kwargs: Any) -> Any:
        raise AgentStoreUnavailableError("database unreachable")

    store.commit_run_terminal = down
    with pytest.raises(AgentRunUnsettledError):
        await asyncio.wait_for(submit(runtime, "k", "go").result, WAIT)
    await runtime.close()
    (run_terminal,) = [e for e in operator if e.type == "run-terminal"]
    assert run_terminal.outcome == "unsettled"
    assert run_terminal.usage.cost == AgentCost(amount=Decimal(3), currency="USD", provenance="computed")
    assert run_terminal.usage.input_tokens == UsageFigure(value=6000, provenance="computed")
