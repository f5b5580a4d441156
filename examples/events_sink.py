"""Delivery and operator events through bounded sinks, a cursor, a control view, usage with provenance.

A scripted model streams an answer around one tool call. The delivery sink receives every delivery event
(durable ones after their commit, transient ones numbered per run); the operator sink receives
``run-started``, ``step-finished`` (one provider call's own figures) and ``run-terminal`` (the run's
total). A UI-side control view is reduced from the same events and agrees with the stored snapshot.

    python examples/events_sink.py
"""

import asyncio
import json

from pydantic import BaseModel
from pydantic_ai.messages import ModelRequest, ToolReturnPart
from pydantic_ai.models.function import DeltaToolCall, FunctionModel

from threadline import (
    advance_agent_runtime_event_cursor,
    create_agent_operator_sink,
    create_agent_runtime,
    create_agent_runtime_event_sink,
    create_memory_agent_runtime_store,
    define_agent_protocol,
    define_agent_tool,
    define_model_registry,
    reduce_agent_control_event,
)


class Context(BaseModel):
    user_id: str


@define_agent_tool
async def weather(city: str) -> str:
    """Today's weather."""
    return f"sunny in {city}"


async def scripted(messages, info):
    last = messages[-1]
    if isinstance(last, ModelRequest) and any(isinstance(p, ToolReturnPart) for p in last.parts):
        for chunk in ["It is ", "sunny ", "today."]:
            yield chunk
    else:
        yield "Checking. "
        yield {1: DeltaToolCall(name="weather", json_args=json.dumps({"city": "Lisbon"}), tool_call_id="w1")}


def figures(usage) -> str:
    """Each figure with where it came from: read the provenance before the number."""
    tokens = ", ".join(
        f"{name} {getattr(usage, name).value} ({getattr(usage, name).provenance})"
        for name in ("input_tokens", "output_tokens")
    )
    return f"{tokens}, cost {usage.cost.amount} ({usage.cost.provenance}), {usage.steps} step(s)"


async def main() -> None:
    delivered, operated = [], []
    events = create_agent_runtime_event_sink(deliver=delivered.append, capacity=256)
    operator = create_agent_operator_sink(deliver=operated.append)
    store = create_memory_agent_runtime_store()
    registry = define_model_registry(models={"m": {"model": FunctionModel(stream_function=scripted)}})
    runtime = create_agent_runtime(
        protocol=define_agent_protocol(context=Context),
        store=store,
        models={"resolve": lambda: registry.resolve("m")},
        tools=[weather],
        publish=events,  # a sink is a publish callback: never blocks, never raises
        operator_publish=operator,
    )
    ticket = runtime.submit(
        conversation_id="c1", idempotency_key="k1", context={"user_id": "u1"}, parts=[{"type": "text", "text": "hi"}]
    )
    result = await ticket.result
    await runtime.close()
    print("delivery sink:", events.status().model_dump(include={"delivered", "dropped", "failed"}))
    await events.aclose()
    await operator.aclose()

    cursor, view = None, None
    for event in delivered:
        cursor, seen = advance_agent_runtime_event_cursor(cursor, event)
        view = reduce_agent_control_event(view, event)
        kind = "durable  " if event.durable else f"transient #{event.sequence}"
        detail = getattr(event, "delta", None) or getattr(event, "state", None) or getattr(event, "status", "")
        if event.type == "run-operation":
            detail = f"{event.operation.kind} {event.operation.phase}"
        print(f"  {kind:<13} {event.type:<20} {seen:<6} {detail}")

    # a redelivered event is recognised as a duplicate
    _, again = advance_agent_runtime_event_cursor(cursor, delivered[-1])
    print(f"redelivered terminal: {again}")

    conversation = view.conversations["c1"]
    shown = "".join(p.text for p in conversation.messages[-1].parts if p.type == "text")
    stored = "".join(p.text for p in result.assistant.parts if p.type == "text")
    print(f"control view answer == stored answer: {shown == stored} ({shown!r})")

    for event in operated:
        if event.type == "step-finished":
            print(f"operator step-finished step {event.step}: {figures(event.usage)}")
        elif event.type == "run-terminal":
            print(f"operator run-terminal {event.terminal_reason}: {figures(event.usage)}")
    print(f"ticket.result.usage: {figures(result.usage)}")


asyncio.run(main())
