"""Many processes on one PostgreSQL database: a durable interrupt committed by another runtime reaches the
executor through LISTEN/NOTIFY at once (the provider here never speaks again, so nothing else could), and
a web-style runtime admits while a worker runtime executes. Each runtime has its own pool, as separate
processes would."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
from pydantic_ai.messages import ModelRequest, UserPromptPart
from pydantic_ai.models.function import FunctionModel

from threadline import create_agent_runtime, define_agent_protocol, define_model_registry
from threadline.store.postgres import create_postgres_agent_runtime_store

pytestmark = pytest.mark.postgres


def runtime(store: Any, handler: Any, **runs: Any) -> Any:
    registry = define_model_registry(models={"m": {"model": FunctionModel(stream_function=handler)}})
    return create_agent_runtime(
        protocol=define_agent_protocol(), store=store, models={"resolve": lambda: registry.resolve("m")}, runs=runs
    )


async def test_a_durable_interrupt_from_another_process_arrives_through_notify(postgres_dsn: str, schema: str) -> None:
    streamed = asyncio.Event()

    async def silent_after_one_word(messages: list[Any], info: Any) -> AsyncIterator[Any]:
        yield "partial"
        streamed.set()
        await asyncio.Event().wait()  # the provider never speaks again: no CAS, no timeout

    async with (
        create_postgres_agent_runtime_store(postgres_dsn, schema=schema) as executor_pg,
        create_postgres_agent_runtime_store(postgres_dsn, schema=schema) as other_pg,
    ):
        executor = runtime(executor_pg.store, silent_after_one_word)
        other = runtime(other_pg.store, silent_after_one_word, execute=False)
        ticket = executor.submit(
            conversation_id="c1", idempotency_key="k", context=None, parts=[{"type": "text", "text": "go"}]
        )
        run_id = (await ticket.admission).run.id
        await asyncio.wait_for(streamed.wait(), 20)
        await asyncio.sleep(0.2)  # let the executor's listener connection settle (a hint, not a verdict)
        outcome = await other.interrupt(conversation_id="c1", run_id=run_id)
        assert outcome.outcome == "requested"
        result = await asyncio.wait_for(ticket.result, 20)
        assert result.terminal_reason == "interrupted" and result.assistant.parts[0].text == "partial"
        await executor.close()
        await other.close()


async def test_a_worker_executes_what_a_web_runtime_admitted(postgres_dsn: str, schema: str) -> None:
    async def echo(messages: list[Any], info: Any) -> AsyncIterator[Any]:
        last = messages[-1]
        texts = (
            [p.content for p in last.parts if isinstance(p, UserPromptPart)] if isinstance(last, ModelRequest) else []
        )
        yield f"answered {' | '.join(texts)}"

    async with (
        create_postgres_agent_runtime_store(postgres_dsn, schema=schema) as web_pg,
        create_postgres_agent_runtime_store(postgres_dsn, schema=schema) as worker_pg,
    ):
        web = runtime(web_pg.store, echo, execute=False, watch_interval=0.05)
        worker = runtime(worker_pg.store, echo)
        serving = asyncio.ensure_future(worker.serve(resolve_context=lambda run: None, poll_interval=5))
        tickets = [
            web.submit(
                conversation_id=f"c{i % 4}",
                idempotency_key=f"k{i}",
                context=None,
                parts=[{"type": "text", "text": f"q{i}"}],
            )
            for i in range(12)
        ]
        results = [await asyncio.wait_for(t.result, 30) for t in tickets]
        assert [r.terminal_reason for r in results] == ["success"] * 12
        assert {r.run.owner_id for r in results} == {worker.owner_id}
        assert [r.assistant.parts[0].text for r in results] == [f"answered q{i}" for i in range(12)]
        await worker.close()
        serving.cancel()
        await web.close()
