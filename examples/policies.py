"""The five input policies, side by side, on the same three inputs — offline, with a scripted model.

Input 1 is being answered when inputs 2 and 3 arrive: input 2 is an ordinary follow-up (``queue``), input 3
arrives under the policy being shown. The scripted model pauses mid-answer on an ``asyncio.Event`` this
script holds, so every outcome is decided by events, never by timing.

    python examples/policies.py
"""

import asyncio
import json

from pydantic import BaseModel
from pydantic_ai.messages import ModelRequest, ModelResponse, ToolReturnPart, UserPromptPart
from pydantic_ai.models.function import DeltaToolCall, FunctionModel

from threadline import (
    create_agent_runtime,
    create_memory_agent_runtime_store,
    define_agent_protocol,
    define_agent_tool,
    define_model_registry,
)

INPUTS = ["plan a day in Lisbon", "suggest a restaurant", "actually, make it Porto"]


class Context(BaseModel):
    user_id: str


def user_texts_since_last_answer(messages):
    """The user inputs this request answers (those after the last response that called no tool)."""
    texts = []
    for message in reversed(messages):
        if isinstance(message, ModelResponse) and not message.tool_calls:
            break
        if isinstance(message, ModelRequest):
            texts[:0] = [p.content for p in message.parts if isinstance(p, UserPromptPart)]
    return texts


@define_agent_tool
async def lookup(city: str) -> str:
    """Notes about a city."""
    return f"{city}: the old town, a museum, the river at sunset"


async def show(policy: str) -> None:
    paused, release = asyncio.Event(), asyncio.Event()
    calls = 0

    async def model(messages, info):
        nonlocal calls
        calls += 1
        if calls == 1:  # the first answer: a few words, a pause the script controls, then a tool call
            yield "Let me look that up."
            paused.set()
            await release.wait()
            yield {1: DeltaToolCall(name="lookup", json_args=json.dumps({"city": "Lisbon"}), tool_call_id="c1")}
            return
        returned = isinstance(messages[-1], ModelRequest) and any(
            isinstance(p, ToolReturnPart) for p in messages[-1].parts
        )
        yield (
            ("Using my notes: " if returned else "") + "answering " + " + ".join(user_texts_since_last_answer(messages))
        )

    registry = define_model_registry(models={"m": {"model": FunctionModel(stream_function=model)}})
    runtime = create_agent_runtime(
        protocol=define_agent_protocol(context=Context),
        store=create_memory_agent_runtime_store(),
        models={"resolve": lambda: registry.resolve("m")},
        tools=[lookup],
        runs={"input_policy": lambda raw: policy if raw.idempotency_key == "k3" else "queue"},
    )

    def submit(i: int):
        return runtime.submit(
            conversation_id="c1",
            idempotency_key=f"k{i + 1}",
            context={"user_id": "u1"},
            parts=[{"type": "text", "text": INPUTS[i]}],
        )

    tickets = [submit(0)]
    await paused.wait()  # input 1 is mid-answer
    for i in (1, 2):
        tickets.append(submit(i))
        await tickets[-1].accepted  # admitted, and its policy applied to the run in flight
    release.set()
    results = [await t.result for t in tickets]
    answered = sorted((r for r in results if r.terminal_reason == "success"), key=lambda r: r.run.terminal_at)
    order = " → ".join(str(1 + [t.run.id for t in results].index(r.run.id)) for r in answered)
    reasons = "  ".join(f"{r.terminal_reason:<11}" for r in results)
    print(f"{policy:<15} {reasons}  answered: {order}")
    for r in answered:
        text = " ".join(p.text for p in r.assistant.parts if p.type == "text")
        print(f"{'':<15}   {1 + results.index(r)}: {text}")
    await runtime.close()


async def main() -> None:
    print(f"{'policy':<15} {'input 1':<11}  {'input 2':<11}  {'input 3':<11}")
    for policy in ("queue", "interrupt", "interrupt-next", "supersede", "inject"):
        await show(policy)


asyncio.run(main())
