"""The README quickstart with a scripted model instead of a real one: runs offline, exactly as written."""

import asyncio

from pydantic import BaseModel
from pydantic_ai.models.function import FunctionModel

from threadline import (
    compose_agent_prompt,
    create_agent_runtime,
    create_sqlite_agent_runtime_store,
    define_agent_protocol,
    define_model_registry,
)


class Context(BaseModel):
    user_id: str


async def scripted(messages, info):
    yield "Hello from a scripted model."


async def main() -> None:
    models = define_model_registry(
        models={
            "fast": {
                "model": FunctionModel(stream_function=scripted),
                "context_window": 128_000,
                "capabilities": ["tools"],
            },
        }
    )
    prompt = compose_agent_prompt(
        [{"name": "product", "stability": "stable", "render": lambda ctx: f"Help user {ctx.context.user_id}."}]
    )
    async with create_sqlite_agent_runtime_store(filename="quickstart.db") as sqlite:
        runtime = create_agent_runtime(
            protocol=define_agent_protocol(context=Context),
            store=sqlite.store,
            models={
                "preflight": lambda: models.preflight("fast", ["tools"]),
                "resolve": lambda: models.resolve("fast", ["tools"]),
            },
            prompt=prompt,
            runs={"input_policy": "interrupt", "coalesce_pending": True},
        )
        ticket = runtime.submit(
            conversation_id="c1",
            idempotency_key="r1",
            context={"user_id": "u1"},
            parts=[{"type": "text", "text": "Hello"}],
        )
        print((await ticket.admission).run.id)
        print((await ticket.result).terminal_reason)  # success
        await runtime.close()


asyncio.run(main())
