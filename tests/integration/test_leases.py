"""Leases across processes on one SQLite file: a live owner keeps renewing; a SIGKILLed owner's run is
taken over after its lease expired, with a higher fencing token, and the old token can write nothing."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from pydantic_ai.models.function import FunctionModel

from threadline import (
    create_agent_runtime,
    create_sqlite_agent_runtime_store,
    define_agent_protocol,
    define_agent_tool,
    define_model_registry,
    takeover_expired_leases,
)

CHILD = Path(__file__).with_name("_lease_child.py")
pytestmark = pytest.mark.subprocess


def runtime_on(store: Any, handler: Any, **sections: Any) -> Any:
    registry = define_model_registry(models={"m": {"model": FunctionModel(stream_function=handler)}})
    return create_agent_runtime(
        protocol=define_agent_protocol(), store=store, models={"resolve": lambda: registry.resolve("m")}, **sections
    )


async def answer(messages: list[Any], info: Any) -> AsyncIterator[Any]:
    yield "taken over and answered"


async def until(predicate: Any, timeout: float = 20.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not await predicate():
        assert asyncio.get_running_loop().time() < deadline, "condition never held"
        await asyncio.sleep(0.05)


@pytest.fixture(params=["sqlite", "postgres"])
async def backend(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[tuple[list[str], Any]]:
    """(child arguments, a function opening the same store in this process)."""
    if request.param == "sqlite":
        db = tmp_path / "leases.db"
        yield [str(db)], lambda: create_sqlite_agent_runtime_store(filename=db)
        return
    import uuid

    import psycopg

    from threadline.store.postgres import create_postgres_agent_runtime_store

    dsn = request.getfixturevalue("postgres_dsn")
    schema = f"threadline_test_{uuid.uuid4().hex}"
    yield [dsn, schema], lambda: create_postgres_agent_runtime_store(dsn, schema=schema)
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        await conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


async def test_a_killed_owner_is_taken_over_after_its_lease(backend: tuple[list[str], Any]) -> None:
    args, open_store = backend
    with subprocess.Popen(
        [sys.executable, str(CHILD), args[0], "0.5", *args[1:]],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    ) as child:
        try:
            line = await asyncio.wait_for(asyncio.to_thread(child.stdout.readline), 60)  # type: ignore[union-attr]
            assert line.strip() == "ACQUIRED", line
            child.send_signal(signal.SIGKILL)
            child.wait(10)
        finally:
            if child.poll() is None:
                child.kill()
                child.wait(10)
    async with open_store() as handle:
        store = handle.store
        active = (await store.list_active_runs(conversation_id="c1")).runs
        assert len(active) == 1 and active[0].owner_id == "child-process" and active[0].fencing_token == 1
        orphan = active[0]
        runtime = runtime_on(store, answer)
        # while the lease is live nobody takes the run over
        assert orphan.lease_expires_at is not None
        if orphan.lease_expires_at > datetime.now(UTC):
            early = await runtime.recover(resolve_context=lambda run: None, policy=takeover_expired_leases())
            assert [o.outcome for o in early] == ["skipped"]

        async def expired() -> bool:
            return orphan.lease_expires_at <= datetime.now(UTC)  # type: ignore[operator]

        await until(expired)
        outcomes = await runtime.recover(resolve_context=lambda run: None, policy=takeover_expired_leases())
        assert [o.outcome for o in outcomes] == ["requeued"]
        result = await asyncio.wait_for(outcomes[0].result, 10)
        assert result.terminal_reason == "success" and result.run.fencing_token == 2
        assert result.run.owner_id == runtime.owner_id
        # the dead owner's token can no longer write anything
        with pytest.raises(Exception) as late:
            await store.checkpoint_run_assistant(
                conversation_id="c1",
                run_id=orphan.id,
                expected_revision=orphan.revision,
                owner_id="child-process",
                fencing_token=1,
                parts=[{"type": "text", "text": "late"}],
            )
        assert type(late.value).__name__ in ("AgentRunStateConflictError", "AgentRunOwnershipConflictError")
        await runtime.close()


async def test_a_live_owner_keeps_renewing_its_lease(tmp_path: Path) -> None:
    release = asyncio.Event()
    started = asyncio.Event()

    @define_agent_tool
    async def long_task() -> str:
        started.set()
        await release.wait()
        return "done"

    async def handler(messages: list[Any], info: Any) -> AsyncIterator[Any]:
        from pydantic_ai.messages import ModelRequest, ToolReturnPart
        from pydantic_ai.models.function import DeltaToolCall

        last = messages[-1]
        if isinstance(last, ModelRequest) and any(isinstance(p, ToolReturnPart) for p in last.parts):
            yield "finished"
        else:
            yield {0: DeltaToolCall(name="long_task", json_args="{}", tool_call_id="c")}

    async with create_sqlite_agent_runtime_store(filename=tmp_path / "renew.db") as sqlite:
        runtime = runtime_on(sqlite.store, handler, tools=[long_task], runs={"lease_duration": 0.3})
        ticket = runtime.submit(
            conversation_id="c1", idempotency_key="k", context=None, parts=[{"type": "text", "text": "go"}]
        )
        run_id = (await ticket.admission).run.id
        await asyncio.wait_for(started.wait(), 10)
        first = (await sqlite.store.load_run(conversation_id="c1", run_id=run_id)).run.lease_expires_at

        async def renewed() -> bool:
            loaded = await sqlite.store.load_run(conversation_id="c1", run_id=run_id)
            return loaded.run.lease_expires_at > first  # type: ignore[operator]

        await until(renewed)
        other = runtime_on(sqlite.store, answer)
        skipped = await other.recover(resolve_context=lambda run: None, policy=takeover_expired_leases())
        assert [o.outcome for o in skipped] == ["skipped"], "a renewed lease is never taken over"
        release.set()
        result = await asyncio.wait_for(ticket.result, 10)
        assert result.terminal_reason == "success" and result.run.fencing_token == 1
        await runtime.close()
        await other.close()
