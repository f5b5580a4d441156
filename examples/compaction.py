"""Runtime-managed compaction: older turns folded into one summary, the recent ones kept — offline.

``history={"compaction": AgentCompactionHook(...)}`` is called before every step (recorded as a durable
``compaction`` operation). ``should_compact`` gets the step's context usage and decides — here a simple
rule: compact whenever there is anything beyond the two most recent turns. ``summarize`` would normally be
a model call; here it joins the inputs. The replaced messages stay readable with ``include_compacted``;
the model sees the summary through its instructions, not as a message.

    python examples/compaction.py
"""

import asyncio

from pydantic import BaseModel
from pydantic_ai.messages import UserPromptPart
from pydantic_ai.models.function import FunctionModel

from threadline import (
    create_agent_runtime,
    create_memory_agent_runtime_store,
    define_agent_protocol,
    define_model_registry,
)
from threadline.history import AgentCompactionHook

seen_by_model: list[tuple[int, str]] = []  # (messages in the prompt, instructions) per call


class Context(BaseModel):
    user_id: str


async def scripted(messages, info):
    seen_by_model.append((len(messages), info.instructions or ""))
    question = next(p.content for p in messages[-1].parts if isinstance(p, UserPromptPart))
    yield f"noted: {question}"


def summarize(messages, previous_summary):
    """A stand-in for a model call: the facts the user gave, in order."""
    facts = [p.text for m in messages if m.role == "user" for p in m.parts if p.type == "text"]
    return "Earlier, the user said: " + "; ".join(
        ([previous_summary.split(": ", 1)[1]] if previous_summary else []) + facts
    )


async def main() -> None:
    store = create_memory_agent_runtime_store()
    registry = define_model_registry(models={"m": {"model": FunctionModel(stream_function=scripted)}})
    runtime = create_agent_runtime(
        protocol=define_agent_protocol(context=Context),
        store=store,
        models={"resolve": lambda: registry.resolve("m")},
        history={
            "compaction": AgentCompactionHook(
                should_compact=lambda context_usage: True,  # the threshold is yours: e.g. context_usage.ratio > 0.8
                summarize=summarize,
                keep_recent_turns=2,
            )
        },
    )
    facts = ["my name is Ada", "I live in Porto", "I like trams", "I hate rain", "what do you know about me?"]
    for i, text in enumerate(facts):
        ticket = runtime.submit(
            conversation_id="c1",
            idempotency_key=f"k{i}",
            context={"user_id": "u1"},
            parts=[{"type": "text", "text": text}],
        )
        await ticket.result
    await runtime.close()

    page = await store.conversations.messages("c1", include_compacted=True)
    print(f"stored messages: {len(page.items)}, compacted (kept, no longer sent): {len(page.compacted)}")
    for m in page.items:
        mark = "compacted" if m.id in page.compacted else m.role
        text = " ".join(p.text for p in m.parts if p.type == "text")
        print(f"  {mark:<10} {text}")
    count, instructions = seen_by_model[-1]
    print(f"the last request carried {count} messages; its instructions: {instructions!r}")


asyncio.run(main())
