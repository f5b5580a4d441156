"""A worker process: ``serve`` on a PostgreSQL schema until SIGTERM, then a bounded ``close``.

Usage: python _pg_worker.py DSN SCHEMA NAME [POOL_SIZE]. The scripted model streams a few words (with tiny pauses, so
interrupts and policies meet runs in flight) and answers with the inputs it saw.
"""

from __future__ import annotations

import asyncio
import signal
import sys
from collections.abc import AsyncIterator
from typing import Any

from pydantic_ai.messages import ModelRequest, UserPromptPart
from pydantic_ai.models.function import FunctionModel

from threadline import create_agent_runtime, define_agent_protocol, define_model_registry, takeover_expired_leases
from threadline.store.postgres import create_postgres_agent_runtime_store


async def model(messages: list[Any], info: Any) -> AsyncIterator[Any]:
    last = messages[-1]
    texts = [p.content for p in last.parts if isinstance(p, UserPromptPart)] if isinstance(last, ModelRequest) else []
    for word in ("thinking", "about", "it"):
        yield word + " "
        await asyncio.sleep(0.01)
    yield "answer to " + " | ".join(str(t) for t in texts)


async def main(dsn: str, schema: str, name: str, pool_size: str = "10") -> None:
    registry = define_model_registry(models={"m": {"model": FunctionModel(stream_function=model)}})
    async with create_postgres_agent_runtime_store(dsn, schema=schema, max_size=int(pool_size)) as pg:
        runtime = create_agent_runtime(
            protocol=define_agent_protocol(),
            store=pg.store,
            models={"resolve": lambda: registry.resolve("m")},
            runs={"owner_id": name, "lease_duration": 5.0},
        )
        stop = asyncio.Event()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
        serving = asyncio.ensure_future(
            runtime.serve(resolve_context=lambda run: None, policy=takeover_expired_leases(), poll_interval=0.2)
        )
        print("READY", flush=True)
        await stop.wait()
        closed = await runtime.close(grace_period=5, force_timeout=5)
        serving.cancel()
        print("CLOSED", closed.settled, f"batches={pg.driver.batches}", flush=True)


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:5]))
