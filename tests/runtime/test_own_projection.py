"""``history.project``: an application that owns the projection outright. Its function sees what each
request may see (settled history, this run's input, the answer so far) and what it returns is exactly what
the provider receives; the ledger's request records still check."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from pydantic_ai.messages import ModelRequest, SystemPromptPart, UserPromptPart

from threadline.errors import AgentConfigError
from threadline.ledger.digests import check_provider_requests

from .conftest import Script, answer_text, make_runtime, submit

WAIT = 30


def _user_prompts(messages: list[Any]) -> list[str]:
    return [p.content for m in messages for p in m.parts if isinstance(p, UserPromptPart)]


async def test_the_provider_receives_exactly_what_the_projection_returns(store: Any) -> None:
    seen: list[list[tuple[str, str]]] = []

    async def project(messages: list[Any]) -> list[Any]:  # async: awaited
        seen.append([(m.role, m.status) for m in messages])
        said = [p.text for m in messages if m.role == "user" for p in m.parts if p.type == "text"]
        return [ModelRequest(parts=[SystemPromptPart("terse"), UserPromptPart(" | ".join(said))])]

    script = Script()
    runtime = make_runtime(store, script, history={"project": project})
    first = await asyncio.wait_for(submit(runtime, "k1", "hello").result, WAIT)
    second = await asyncio.wait_for(submit(runtime, "k2", "again").result, WAIT)
    assert (first.terminal_reason, second.terminal_reason) == ("success", "success")
    # the provider got the function's list and nothing else: no threadline projection of the history
    assert [_user_prompts(call) for call in script.calls] == [["hello"], ["hello | again"]]
    assert all(len(call) == 1 for call in script.calls)
    # the function saw the settled history, then this run's input (the answer so far had no parts yet)
    assert seen == [[("user", "committed")], [("user", "committed"), ("assistant", "completed"), ("user", "committed")]]
    assert answer_text(second)
    events = (await store.read_events(conversation_id="c1")).items
    assert [e for e in events if e.kind == "provider/request"] and check_provider_requests(events) == []
    await runtime.close()


async def test_a_projection_that_returns_no_messages_fails_the_run_naming_it(store: Any) -> None:
    script = Script()
    runtime = make_runtime(store, script, history={"project": lambda messages: "not messages"})
    result = await asyncio.wait_for(submit(runtime, "k1", "hello").result, WAIT)
    assert result.terminal_reason == "runtime_failure" and script.calls == []
    assert result.error is not None and "history.project" in result.error.summary
    await runtime.close()


def test_a_projection_that_is_not_callable_is_refused_at_construction(store: Any) -> None:
    with pytest.raises(AgentConfigError) as info:
        make_runtime(store, Script(), history={"project": "mine"})
    assert info.value.field == "history.project"


async def test_a_tool_step_shows_the_answer_so_far_to_the_projection(store: Any) -> None:
    from pydantic_ai.messages import ModelResponse, ToolCallPart, ToolReturnPart
    from pydantic_ai.models.function import DeltaToolCall

    from threadline import define_agent_tool

    @define_agent_tool
    async def lookup(topic: str) -> str:
        return f"notes on {topic}"

    async def handler(i: int, messages: list[Any], info: Any) -> Any:
        if i == 0:
            yield {0: DeltaToolCall(name="lookup", json_args='{"topic": "threads"}', tool_call_id="call-1")}
        else:
            yield "done"

    drafts: list[list[str]] = []

    def project(messages: list[Any]) -> list[Any]:  # sync: called as it is
        drafts.append([p.type for m in messages if m.role == "assistant" for p in m.parts])
        out: list[Any] = [ModelRequest(parts=[UserPromptPart("go")])]
        calls = [p for m in messages if m.role == "assistant" for p in m.parts if p.type == "tool-call"]
        results = [p for m in messages if m.role == "assistant" for p in m.parts if p.type == "tool-result"]
        if calls:
            out.append(ModelResponse(parts=[ToolCallPart(c.tool_name, c.input, tool_call_id=c.call_id) for c in calls]))
            out.append(
                ModelRequest(parts=[ToolReturnPart(r.tool_name, r.output, tool_call_id=r.call_id) for r in results])
            )
        return out

    script = Script(handler)
    runtime = make_runtime(store, script, tools=[lookup], history={"project": project})
    result = await asyncio.wait_for(submit(runtime, "k1", "hello").result, WAIT)
    assert result.terminal_reason == "success" and answer_text(result) == "done"
    assert drafts == [[], ["tool-call", "tool-result"]]  # the second request saw this run's answer so far
    assert [type(m).__name__ for m in script.calls[1]] == ["ModelRequest", "ModelResponse", "ModelRequest"]
    await runtime.close()
