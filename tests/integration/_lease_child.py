"""A child process: one run on a SQLite file whose tool blocks for ever, under a short lease.

Usage: python _lease_child.py DB LEASE_SECONDS [SCHEMA]. DB is a SQLite file, or a PostgreSQL DSN when
SCHEMA is given. Prints ``ACQUIRED`` once the tool started.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator
from typing import Any

from pydantic_ai.models.function import DeltaToolCall, FunctionModel

from threadline import (
    create_agent_runtime,
    create_sqlite_agent_runtime_store,
    define_agent_protocol,
    define_agent_tool,
    define_model_registry,
)


def open_store(db: str, schema: str | None) -> Any:
    if schema is None:
        return create_sqlite_agent_runtime_store(filename=db)
    from threadline.store.postgres import create_postgres_agent_runtime_store

    return create_postgres_agent_runtime_store(db, schema=schema)


async def main(db: str, lease: float, schema: str | None = None) -> None:
    @define_agent_tool
    async def block() -> str:
        print("ACQUIRED", flush=True)
        await asyncio.Event().wait()
        return "never"

    async def model(messages: list[Any], info: Any) -> AsyncIterator[Any]:
        yield {0: DeltaToolCall(name="block", json_args="{}", tool_call_id="call-block")}

    registry = define_model_registry(models={"m": {"model": FunctionModel(stream_function=model)}})
    async with open_store(db, schema) as handle:
        runtime = create_agent_runtime(
            protocol=define_agent_protocol(),
            store=handle.store,
            models={"resolve": lambda: registry.resolve("m")},
            tools=[block],
            runs={"lease_duration": lease, "owner_id": "child-process"},
        )
        ticket = runtime.submit(
            conversation_id="c1", idempotency_key="k", context=None, parts=[{"type": "text", "text": "go"}]
        )
        await ticket.result


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], float(sys.argv[2]), sys.argv[3] if len(sys.argv) > 3 else None))
