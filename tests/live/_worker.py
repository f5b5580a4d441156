"""A worker process for the live-delivery tests: it executes whatever a web process admits (``serve``) and
publishes its delivery events through the store's live relay.

Usage::

    python _worker.py sqlite PATH [--hold] [--big N] [--max-rows N]
    python _worker.py postgres DSN SCHEMA [--hold] [--big N] [--max-rows N]

Each run reasons, calls ``lookup`` (which reports progress), then answers ``first words ... answer to:
<input>``. With ``--hold`` the answer stops after ``first `` until a line arrives on stdin (one line per
run). ``--big N`` appends N characters to the answer (so it outgrows a NOTIFY payload). Prints ``READY``
when serving and ``DONE <run id>`` once a run's terminal event was sent through the relay. Stops on SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
import threading
from collections.abc import AsyncIterator
from typing import Any

from pydantic_ai.messages import ModelRequest, ToolReturnPart, UserPromptPart
from pydantic_ai.models.function import DeltaThinkingPart, DeltaToolCall, FunctionModel

from threadline import (
    AgentToolContext,
    create_agent_runtime,
    define_agent_protocol,
    define_agent_tool,
    define_model_registry,
)
from threadline.live import create_agent_live_relay


@define_agent_tool
async def lookup(ctx: AgentToolContext, query: str) -> str:
    """Look something up."""
    ctx.report_progress(message=f"looking up {query}", progress=1, total=2)
    return f"found {query}"


def _user_text(messages: list[Any]) -> str:
    for message in reversed(messages):
        if isinstance(message, ModelRequest):
            for part in message.parts:
                if isinstance(part, UserPromptPart) and isinstance(part.content, str):
                    return part.content
    return ""


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("backend", choices=("sqlite", "postgres"))
    parser.add_argument("where", nargs="+")
    parser.add_argument("--hold", action="store_true")
    parser.add_argument("--big", type=int, default=0)
    parser.add_argument("--max-rows", type=int, default=10_000)
    args = parser.parse_args()

    lines: asyncio.Queue[str] = asyncio.Queue()
    loop = asyncio.get_running_loop()

    def read_stdin() -> None:  # a daemon thread: it never holds the process open at exit
        for line in sys.stdin:
            loop.call_soon_threadsafe(lines.put_nowait, line)

    async def stream(messages: list[Any], info: Any) -> AsyncIterator[Any]:
        last = messages[-1]
        if isinstance(last, ModelRequest) and any(isinstance(p, ToolReturnPart) for p in last.parts):
            yield "first "
            if args.hold:
                await lines.get()
            for word in ("words ", "then ", "more "):
                yield word
            yield f"answer to: {_user_text(messages)}" + "x" * args.big
            return
        yield {0: DeltaThinkingPart(content="pondering")}
        yield {1: DeltaToolCall(name="lookup", json_args=json.dumps({"query": "q"}), tool_call_id="call-1")}

    if args.backend == "sqlite":
        from threadline.store.sqlite import create_sqlite_agent_runtime_store

        handle: Any = create_sqlite_agent_runtime_store(args.where[0])
    else:
        from threadline.store.postgres import create_postgres_agent_runtime_store

        handle = await create_postgres_agent_runtime_store(args.where[0], schema=args.where[1]).open()
    registry = define_model_registry(models={"m": {"model": FunctionModel(stream_function=stream)}})
    threading.Thread(target=read_stdin, daemon=True).start()
    async with create_agent_live_relay(handle, max_rows=args.max_rows) as relay:

        async def done(run_id: str) -> None:
            await relay.flush()
            print("DONE", run_id, flush=True)

        reporting: set[asyncio.Future[None]] = set()

        def publish(event: Any) -> None:
            relay.publish(event)
            if event.type == "terminal":
                report = asyncio.ensure_future(done(event.run_id))
                reporting.add(report)
                report.add_done_callback(reporting.discard)

        runtime = create_agent_runtime(
            protocol=define_agent_protocol(),
            store=handle.store,
            models={"resolve": lambda: registry.resolve("m")},
            tools=[lookup],
            publish=publish,
        )
        stop = asyncio.Event()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
        serving = asyncio.ensure_future(runtime.serve(resolve_context=lambda run: None, poll_interval=0.05))
        print("READY", flush=True)
        await stop.wait()
        await runtime.close(grace_period=1, force_timeout=2)
        serving.cancel()
    await handle.close()


if __name__ == "__main__":
    asyncio.run(main())
