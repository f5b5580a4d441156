"""Admission in one runtime, execution in another: a web-style runtime (``execute=False``) submits on a
SQLite file while a worker runtime (``serve``) executes; tickets settle from the stored runs."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from pydantic_ai.messages import ModelRequest, UserPromptPart
from pydantic_ai.models.function import FunctionModel

from threadline import (
    create_agent_runtime,
    create_sqlite_agent_runtime_store,
    define_agent_protocol,
    define_model_registry,
)


async def echo(messages: list[Any], info: Any) -> AsyncIterator[Any]:
    last = messages[-1]
    text = (
        " | ".join(p.content for p in last.parts if isinstance(p, UserPromptPart))
        if isinstance(last, ModelRequest)
        else ""
    )
    yield f"worker answered: {text}"


def runtime(store: Any, **runs: Any) -> Any:
    registry = define_model_registry(models={"m": {"model": FunctionModel(stream_function=echo)}})
    return create_agent_runtime(
        protocol=define_agent_protocol(), store=store, models={"resolve": lambda: registry.resolve("m")}, runs=runs
    )


async def test_a_worker_executes_what_another_runtime_admitted(tmp_path: Path) -> None:
    db = tmp_path / "shared.db"
    async with (
        create_sqlite_agent_runtime_store(filename=db) as web_store,
        create_sqlite_agent_runtime_store(filename=db) as worker_store,
    ):
        web = runtime(web_store.store, execute=False, watch_interval=0.05)
        worker = runtime(worker_store.store)
        serving = asyncio.ensure_future(worker.serve(resolve_context=lambda run: None, poll_interval=0.05))
        tickets = [
            web.submit(
                conversation_id=f"c{i % 3}",
                idempotency_key=f"k{i}",
                context=None,
                parts=[{"type": "text", "text": f"q{i}"}],
            )
            for i in range(9)
        ]
        results = [await asyncio.wait_for(t.result, 20) for t in tickets]
        assert [r.terminal_reason for r in results] == ["success"] * 9
        assert {r.run.owner_id for r in results} == {worker.owner_id}
        assert [r.assistant.parts[0].text for r in results] == [f"worker answered: q{i}" for i in range(9)]
        # per conversation, runs executed in admission order
        for c in range(3):
            mine = [r.run for r in results if r.run.conversation_id == f"c{c}"]
            assert [r.execution_sequence for r in mine] == sorted(r.execution_sequence for r in mine)
        closed = await worker.close()
        assert closed.settled
        serving.cancel()
        await web.close()
