"""Contract (issue 17, §2) on the real drivers: the admission and absorption records where the driver's own
reads decide the outcome — ids already promised to an active run's answer, the causal order of
``snapshot.runs``, and a duplicate on an absorbed key answered from the store in a fresh runtime.

SQLite always; PostgreSQL when a server answers (see tests/conftest.py). Every wait is bounded."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel
from pydantic_ai.messages import ModelRequest, ToolReturnPart, UserPromptPart
from pydantic_ai.models.function import AgentInfo, DeltaToolCall, FunctionModel

from threadline import (
    AgentIdempotencyConflictError,
    create_agent_runtime,
    define_agent_protocol,
    define_agent_tool,
    define_model_registry,
)
from threadline.store.sqlite import create_sqlite_agent_runtime_store

WAIT = 10


class Context(BaseModel):
    user_id: str = "u1"


def text(t: str) -> list[dict[str, str]]:
    return [{"type": "text", "text": t}]


def last_user_text(messages: list[Any]) -> str:
    for message in reversed(messages):
        if isinstance(message, ModelRequest):
            texts = [p.content for p in message.parts if isinstance(p, UserPromptPart) and isinstance(p.content, str)]
            if texts:
                return " | ".join(texts)
    return ""


class Script:
    """A FunctionModel whose call i is handled by ``handler(i, messages)``; ``entered(i)`` is set when it starts."""

    def __init__(self, handler: Any) -> None:
        self.handler = handler
        self.calls: list[list[Any]] = []
        self._entered: dict[int, asyncio.Event] = {}
        self.model = FunctionModel(stream_function=self._stream, model_name="scripted")

    def entered(self, i: int) -> asyncio.Event:
        return self._entered.setdefault(i, asyncio.Event())

    async def _stream(self, messages: list[Any], info: AgentInfo) -> AsyncIterator[Any]:
        i = len(self.calls)
        self.calls.append(messages)
        self.entered(i).set()
        async for item in self.handler(i, messages):
            yield item


def runtime_on(store: Any, script: Script, **sections: Any) -> Any:
    registry = define_model_registry(models={"m": {"model": script.model, "context_window": 100_000}})
    return create_agent_runtime(
        protocol=define_agent_protocol(context=Context),
        store=store,
        models={"preflight": lambda: registry.preflight("m"), "resolve": lambda: registry.resolve("m")},
        **sections,
    )


def submit(runtime: Any, key: str, message: str, **kw: Any) -> Any:
    return runtime.submit(
        conversation_id="c1", idempotency_key=key, context={"user_id": "u1"}, parts=text(message), **kw
    )


async def version_of(store: Any) -> int:
    return (await store.load_snapshot(conversation_id="c1")).version


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
async def store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Any]:
    if request.param == "sqlite":
        async with create_sqlite_agent_runtime_store(filename=tmp_path / "contract.db") as handle:
            yield handle.store
        return
    dsn = request.getfixturevalue("postgres_dsn")
    import psycopg

    from threadline.store.postgres import create_postgres_agent_runtime_store

    schema = f"threadline_test_{uuid.uuid4().hex}"
    try:
        async with create_postgres_agent_runtime_store(dsn, schema=schema) as handle:
            yield handle.store
    finally:
        async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
            await conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


# ------------------------------------------------------ ids already promised to an active run's answer


async def test_an_input_or_summary_reusing_an_active_runs_assistant_id_is_refused(store: Any) -> None:
    settled = await store.accept_input_and_assign_run(
        conversation_id="c1", idempotency_key="k0", input={"id": "m0", "parts": text("zero")}
    )
    owned = await store.acquire_run(
        conversation_id="c1", run_id=settled.run.id, expected_revision=settled.run.revision, owner_id="x"
    )
    await store.commit_run_terminal(
        conversation_id="c1",
        run_id=settled.run.id,
        expected_revision=owned.run.revision,
        owner_id="x",
        fencing_token=owned.run.fencing_token,
        terminal_reason="success",
        parts=text("answer zero"),
    )
    running = await store.accept_input_and_assign_run(
        conversation_id="c1", idempotency_key="k1", input={"id": "m1", "parts": text("one")}
    )
    await store.acquire_run(
        conversation_id="c1", run_id=running.run.id, expected_revision=running.run.revision, owner_id="x"
    )
    queued = await store.accept_input_and_assign_run(
        conversation_id="c1", idempotency_key="k2", input={"id": "m2", "parts": text("two")}
    )
    snapshot = await store.load_snapshot(conversation_id="c1")
    settled_ids = [m.id for m in snapshot.messages if m.position is not None]
    for n, taken in enumerate((running.run.assistant_message_id, queued.run.assistant_message_id)):
        for coalesce in (False, True):
            with pytest.raises(AgentIdempotencyConflictError):
                await store.accept_input_and_assign_run(
                    conversation_id="c1",
                    idempotency_key=f"clash-{n}-{coalesce}",
                    input={"id": taken, "parts": text("reusing an answer's id")},
                    coalesce=coalesce,
                )
            assert await version_of(store) == snapshot.version
        with pytest.raises(AgentIdempotencyConflictError):
            await store.replace_compacted_range(
                conversation_id="c1",
                expected_version=snapshot.version,
                replaced_message_ids=settled_ids,
                summary={"id": taken, "role": "summary", "parts": text("SUMMARY")},
            )
        assert await version_of(store) == snapshot.version
    active = await store.list_active_runs(conversation_id="c1")
    assert [r.input_message_ids for r in active.runs] == [("m1",), ("m2",)]


# ----------------------------------------------------------------------- snapshot.runs causal order


async def test_snapshot_runs_follow_execution_order(store: Any) -> None:
    gates = {0: asyncio.Event(), 1: asyncio.Event()}

    async def handler(i: int, messages: list[Any]) -> AsyncIterator[Any]:
        yield f"partial {i}"
        if i in gates:
            await gates[i].wait()
        yield f" answer to: {last_user_text(messages)}"

    script = Script(handler)
    policy = lambda raw: "interrupt-next" if "urgent" in raw.parts[0]["text"] else "queue"  # noqa: E731
    runtime = runtime_on(store, script, runs={"input_policy": policy})
    try:
        a = submit(runtime, "a", "A")
        run_a = (await asyncio.wait_for(a.admission, WAIT)).run.id
        await asyncio.wait_for(script.entered(0).wait(), WAIT)
        b = submit(runtime, "b", "B ordinary")
        run_b = (await asyncio.wait_for(b.admission, WAIT)).run.id
        c = submit(runtime, "c", "C urgent")
        run_c = (await asyncio.wait_for(c.admission, WAIT)).run.id
        assert (await asyncio.wait_for(a.result, WAIT)).terminal_reason == "interrupted"
        await asyncio.wait_for(script.entered(1).wait(), WAIT)
        snapshot = await store.load_snapshot(conversation_id="c1")
        assert [(r.id, r.state) for r in snapshot.runs] == [
            (run_a, "interrupted"),
            (run_c, "running"),
            (run_b, "queued"),
        ]
        gates[1].set()
        await asyncio.wait_for(asyncio.gather(b.result, c.result), WAIT)
        snapshot = await store.load_snapshot(conversation_id="c1")
        assert [r.id for r in snapshot.runs] == [run_a, run_c, run_b]
    finally:
        for gate in gates.values():
            gate.set()
        await runtime.close()


async def test_snapshot_lists_queued_runs_urgent_first_then_fifo(store: Any) -> None:
    ids = []
    for i, (key, priority) in enumerate([("o1", "ordinary"), ("u1", "urgent"), ("o2", "ordinary"), ("u2", "urgent")]):
        accepted = await store.accept_input_and_assign_run(
            conversation_id="c1",
            idempotency_key=key,
            input={"id": f"m{i}", "parts": text(key)},
            run_id=f"run-{9 - i}",  # ids in reverse order of admission
            priority=priority,
        )
        ids.append(accepted.run.id)
    snapshot = await store.load_snapshot(conversation_id="c1")
    assert [r.id for r in snapshot.runs] == [ids[1], ids[3], ids[0], ids[2]]


# ------------------------------------------------------------- an absorbed key, retried after restart


async def test_an_absorbed_key_is_answered_from_the_store_in_a_fresh_runtime(store: Any) -> None:
    tool_gate = asyncio.Event()

    @define_agent_tool
    async def lookup(topic: str) -> str:
        await tool_gate.wait()
        return f"facts about {topic}"

    async def handler(i: int, messages: list[Any]) -> AsyncIterator[Any]:
        if i == 0:
            yield {0: DeltaToolCall(name="lookup", json_args='{"topic": "threads"}', tool_call_id="call-1")}
        else:
            last = messages[-1]
            returns = [p for p in last.parts if isinstance(p, ToolReturnPart)] if isinstance(last, ModelRequest) else []
            yield f"final ({len(returns)} results) for: {last_user_text(messages[-1:])}"

    script = Script(handler)
    runtime = runtime_on(store, script, tools=[lookup], runs={"input_policy": "inject"})
    try:
        a = submit(runtime, "a", "summarise this thread")
        adm_a = await asyncio.wait_for(a.admission, WAIT)
        await asyncio.wait_for(script.entered(0).wait(), WAIT)
        b = submit(runtime, "b", "actually, in bullet points")
        adm_b = await asyncio.wait_for(b.admission, WAIT)
        b2 = submit(runtime, "b2", "and keep it short")
        adm_b2 = await asyncio.wait_for(b2.admission, WAIT)
        tool_gate.set()
        ra, rb = await asyncio.wait_for(asyncio.gather(a.result, b.result), WAIT)
        await asyncio.wait_for(b2.result, WAIT)
    finally:
        tool_gate.set()
        await runtime.close()
    assert len(script.calls) == 2
    stored_a = (await store.load_run(conversation_id="c1", run_id=adm_a.run.id)).run
    assert stored_a.input_message_ids == (adm_a.input_message_id, adm_b.input_message_id, adm_b2.input_message_id)
    assert (rb.terminal_reason, rb.answered_by_run_id, rb.assistant.id) == ("absorbed", adm_a.run.id, ra.assistant.id)

    fresh = runtime_on(store, Script(handler))
    try:
        retried = submit(fresh, "b", "actually, in bullet points")
        assert (await asyncio.wait_for(retried.admission, WAIT)).outcome == "duplicate"
        later = await asyncio.wait_for(retried.result, WAIT)
    finally:
        with contextlib.suppress(Exception):
            await fresh.close()
    assert (later.terminal_reason, later.answered_by_run_id) == ("absorbed", adm_a.run.id)
    assert later.answered is True and later.assistant is not None and later.assistant.id == ra.assistant.id
