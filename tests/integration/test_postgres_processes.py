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
from threadline.store.postgres import create_postgres_agent_runtime_store, notification_channel

pytestmark = pytest.mark.postgres


def runtime(store: Any, handler: Any, **runs: Any) -> Any:
    registry = define_model_registry(models={"m": {"model": FunctionModel(stream_function=handler)}})
    return create_agent_runtime(
        protocol=define_agent_protocol(), store=store, models={"resolve": lambda: registry.resolve("m")}, runs=runs
    )


async def listeners(dsn: str, schema: str) -> list[int]:
    """The server pids of the connections listening for ``schema``'s notifications."""
    import psycopg

    query = f'LISTEN "{notification_channel(schema)}"'
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        cur = await conn.execute("SELECT pid FROM pg_stat_activity WHERE query = %s", [query])
        return [pid for (pid,) in await cur.fetchall()]


async def until(probe: Any, what: str) -> Any:
    for _ in range(400):
        found = await probe()
        if found:
            return found
        await asyncio.sleep(0.025)
    raise AssertionError(f"no {what} within 10 s")


@pytest.mark.parametrize("listener_killed", [False, True])
async def test_a_durable_interrupt_from_another_process_arrives_through_notify(
    postgres_dsn: str, schema: str, listener_killed: bool
) -> None:
    """The provider never speaks again after one word, so only NOTIFY can tell the executor. With
    ``listener_killed`` its LISTEN connection is terminated mid-run first: the driver connects again."""
    import psycopg

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
        [first] = await until(lambda: listeners(postgres_dsn, schema), "listener")
        if listener_killed:
            async with await psycopg.AsyncConnection.connect(postgres_dsn, autocommit=True) as conn:
                await conn.execute("SELECT pg_terminate_backend(%s)", [first])

            async def replaced() -> list[int]:
                return [pid for pid in await listeners(postgres_dsn, schema) if pid != first]

            await until(replaced, "new listener")
        outcome = await other.interrupt(conversation_id="c1", run_id=run_id)
        assert outcome.outcome == "requested"
        result = await asyncio.wait_for(ticket.result, 20)
        assert result.terminal_reason == "interrupted" and result.assistant.parts[0].text == "partial"
        await executor.close()
        await other.close()


async def test_a_runtime_whose_first_listen_failed_listens_again_later(
    postgres_dsn: str, schema: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import threadline.runtime as runtime_module
    from threadline.errors import AgentStoreUnavailableError

    monkeypatch.setattr(runtime_module, "_LISTEN_RETRY_S", 0.0)
    streamed = asyncio.Event()

    async def answers_then_silent(messages: list[Any], info: Any) -> AsyncIterator[Any]:
        last = messages[-1]
        text = last.parts[-1].content if isinstance(last, ModelRequest) else ""
        yield "partial"
        if text == "second":
            streamed.set()
            await asyncio.Event().wait()

    async with (
        create_postgres_agent_runtime_store(postgres_dsn, schema=schema) as executor_pg,
        create_postgres_agent_runtime_store(postgres_dsn, schema=schema) as other_pg,
    ):
        listen, calls = executor_pg.driver.listen, []

        async def away_at_first(callback: Any) -> Any:
            calls.append(callback)
            if len(calls) == 1:
                raise AgentStoreUnavailableError("the server is away (injected)")
            return await listen(callback)

        monkeypatch.setattr(executor_pg.driver, "listen", away_at_first)
        executor = runtime(executor_pg.store, answers_then_silent)
        other = runtime(other_pg.store, answers_then_silent, execute=False)
        first = executor.submit(
            conversation_id="c1", idempotency_key="k1", context=None, parts=[{"type": "text", "text": "first"}]
        )
        assert (await asyncio.wait_for(first.result, 20)).terminal_reason == "success"
        second = executor.submit(
            conversation_id="c1", idempotency_key="k2", context=None, parts=[{"type": "text", "text": "second"}]
        )
        run_id = (await second.admission).run.id
        await asyncio.wait_for(streamed.wait(), 20)
        assert len(calls) == 2  # the second run's execution asked again
        await until(lambda: listeners(postgres_dsn, schema), "listener")
        assert (await other.interrupt(conversation_id="c1", run_id=run_id)).outcome == "requested"
        result = await asyncio.wait_for(second.result, 20)
        assert result.terminal_reason == "interrupted"
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
