"""Durable steps kept in the conversation's ledger (``create_local_step_durability(store=...)``) on the
memory store, real SQLite files and the real PostgreSQL server.

Pins. A child process SIGKILLed inside a step's body — after the intent's commit, before the proof —
leaves a bare intent in the runtime store itself: the parent reopening the store gets
:class:`AgentStepUncertainError` without running the body, and ``reconcile`` settles it for good. An
archive exported from SQLite and imported into PostgreSQL brings the proof and the bare intent along. A
runtime given this durability records every ``ctx.step`` of its tools beside the conversation; on every
driver, compacting those turns and export → import into a fresh store keep each proof, bare intent and
reconcile working, and no body runs twice. Wrong arguments are refused by name. No verdict depends on
timing (``wait_for`` only keeps a broken build from hanging).
"""

from __future__ import annotations

import asyncio
import signal
import sys
import textwrap
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel
from pydantic_ai.messages import ModelRequest, ToolReturnPart
from pydantic_ai.models.function import AgentInfo, DeltaToolCall, FunctionModel

from threadline import (
    AgentToolContext,
    create_agent_runtime,
    create_memory_agent_runtime_store,
    create_sqlite_agent_runtime_store,
    define_agent_protocol,
    define_agent_tool,
    define_model_registry,
)
from threadline.durability import AgentStepUncertainError, create_local_step_durability, run_agent_step
from threadline.errors import AgentRuntimeUsageError, AgentStoreCapabilityError
from threadline.store import create_agent_runtime_store
from threadline.store.memory import MemoryStoreDriver

GUARD = 120  # seconds; only a broken build ever waits this long

CHILD = textwrap.dedent(
    """
    import asyncio, os, signal, sys

    from threadline.durability import create_local_step_durability, run_agent_step

    target, mode = sys.argv[1], sys.argv[2]

    def open_store():
        if target.startswith("postgresql://"):
            from threadline.store.postgres import create_postgres_agent_runtime_store

            dsn, schema = target.rsplit("#", 1)
            return create_postgres_agent_runtime_store(dsn, schema=schema, max_size=2)
        from threadline import create_sqlite_agent_runtime_store

        return create_sqlite_agent_runtime_store(target)

    async def body():
        print("effect", flush=True)  # the external effect happened
        if mode == "kill":
            os.kill(os.getpid(), signal.SIGKILL)  # dies after the intent's commit, before the proof
        return {"sent": True}

    async def main():
        async with open_store() as handle:
            durability = create_local_step_durability(store=handle.store)
            print(await run_agent_step(durability, "c", "r", "send-mail", body), flush=True)

    asyncio.run(main())
    """
)


async def run_child(target: str, mode: str) -> tuple[int | None, list[str]]:
    child = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        CHILD,
        target,
        mode,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        out, err = await asyncio.wait_for(child.communicate(), timeout=GUARD)
    finally:
        if child.returncode is None:
            child.send_signal(signal.SIGKILL)
            await child.communicate()
    if mode != "kill" and child.returncode != 0:
        pytest.fail(f"child failed: {err.decode()}")
    return child.returncode, out.decode().split()


def open_store(target: str) -> Any:
    if target.startswith("postgresql://"):
        from threadline.store.postgres import create_postgres_agent_runtime_store

        dsn, schema = target.rsplit("#", 1)
        return create_postgres_agent_runtime_store(dsn, schema=schema, max_size=2)
    return create_sqlite_agent_runtime_store(target)


@pytest.fixture(params=["sqlite", "postgres"])
def target(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return str(tmp_path / "threadline.db")
    return str(request.getfixturevalue("pg_target"))


def never() -> Any:
    raise AssertionError("the body ran again")


@pytest.mark.subprocess
async def test_sigkill_between_intent_and_proof_leaves_an_uncertain_step_in_the_store(target: str) -> None:
    returncode, lines = await run_child(target, "kill")
    assert returncode == -signal.SIGKILL and lines == ["effect"]
    async with open_store(target) as handle:
        durability = create_local_step_durability(store=handle.store)
        record = await durability.read("c", "r", "send-mail")
        assert record is not None and record.state == "intent" and record.value is None
        with pytest.raises(AgentStepUncertainError) as caught:
            await run_agent_step(durability, "c", "r", "send-mail", never)
        assert caught.value.key == ("c", "r", "send-mail")
        with pytest.raises(AgentStepUncertainError):
            await run_agent_step(durability, "c", "r", "send-mail", never, reconcile=lambda record: None)
        # the mail server says it was sent: the reconciled proof is accepted and durable
        assert await run_agent_step(
            durability, "c", "r", "send-mail", never, reconcile=lambda record: {"sent": True}
        ) == {"sent": True}
    async with open_store(target) as reopened:
        again = create_local_step_durability(store=reopened.store)
        record = await again.read("c", "r", "send-mail")
        assert record is not None and record.state == "accepted" and record.reconciled
        assert await run_agent_step(again, "c", "r", "send-mail", never) == {"sent": True}


@pytest.mark.subprocess
async def test_a_finished_child_leaves_a_proof_the_parent_replays(target: str) -> None:
    returncode, lines = await run_child(target, "finish")
    assert returncode == 0 and lines[0] == "effect"
    async with open_store(target) as handle:
        durability = create_local_step_durability(store=handle.store)
        assert await run_agent_step(durability, "c", "r", "send-mail", never) == {"sent": True}


async def test_an_archive_from_sqlite_restores_proof_and_intent_into_postgres(
    tmp_path: Path, postgres_dsn: str, schema: str
) -> None:
    from threadline.store.postgres import create_postgres_agent_runtime_store

    async with create_sqlite_agent_runtime_store(tmp_path / "source.db") as source:
        durability = create_local_step_durability(store=source.store)
        assert await run_agent_step(durability, "c", "r", "refund", lambda: {"amount": 1.5, "id": "R-1"}) == {
            "amount": 1.5,
            "id": "R-1",
        }
        with pytest.raises(ZeroDivisionError):
            await run_agent_step(durability, "c", "r", "mail", lambda: 1 / 0)
        archive = await source.store.export_conversation("c")
    async with create_postgres_agent_runtime_store(postgres_dsn, schema=schema, max_size=2) as target:
        await target.store.import_conversation(archive)
        restored = create_local_step_durability(store=target.store)
        assert await run_agent_step(restored, "c", "r", "refund", never) == {"amount": 1.5, "id": "R-1"}
        with pytest.raises(AgentStepUncertainError):
            await run_agent_step(restored, "c", "r", "mail", never)
        assert await run_agent_step(restored, "c", "r", "mail", never, reconcile=lambda record: "sent") == "sent"
        assert await target.store.export_conversation("c") != archive  # the reconciled proof is new history


class Context(BaseModel):
    user_id: str = "u1"


async def test_a_runtime_records_its_tools_steps_in_the_conversations_ledger(tmp_path: Path) -> None:
    sent: list[str] = []

    @define_agent_tool
    async def send_mail(ctx: AgentToolContext, to: str) -> str:
        async def deliver() -> str:
            sent.append(to)
            return f"mail-{len(sent)}"

        return await ctx.step(f"mail:{to}", deliver)

    async def stream(messages: list[Any], info: AgentInfo) -> AsyncIterator[Any]:
        last = messages[-1]
        if isinstance(last, ModelRequest) and any(isinstance(p, ToolReturnPart) for p in last.parts):
            yield "sent"
        else:
            yield {0: DeltaToolCall(name="send_mail", json_args='{"to": "ada"}', tool_call_id="call-1")}

    registry = define_model_registry(models={"m": {"model": FunctionModel(stream_function=stream)}})
    async with create_sqlite_agent_runtime_store(tmp_path / "threadline.db") as handle:
        runtime = create_agent_runtime(
            protocol=define_agent_protocol(context=Context),
            store=handle.store,
            models={"resolve": lambda: registry.resolve("m")},
            tools=[send_mail],
            loop={"step_durability": create_local_step_durability(store=handle.store)},
        )
        try:
            ticket = runtime.submit(
                conversation_id="c1", idempotency_key="k1", context={}, parts=[{"type": "text", "text": "mail ada"}]
            )
            result = await asyncio.wait_for(ticket.result, GUARD)
        finally:
            await runtime.close()
        assert result.terminal_reason == "success" and sent == ["ada"]
        page = await handle.store.read_events(conversation_id="c1")
        steps = [e.payload for e in page.items if e.kind == "durability/effect"]
        assert [(p["run_id"], p["effect_name"], p["status"]) for p in steps] == [
            (result.run.id, "mail:ada", "intent"),
            (result.run.id, "mail:ada", "accepted"),
        ]
        assert steps[1]["value_json"] == '"mail-1"'
        # the same step of that run, asked again (a requeued run would): the proof, no second mail
        durability = create_local_step_durability(store=handle.store)
        assert await run_agent_step(durability, "c1", result.run.id, "mail:ada", never) == "mail-1"


async def test_wrong_arguments_are_refused_by_name(tmp_path: Path) -> None:
    store = create_memory_agent_runtime_store()
    with pytest.raises(AgentRuntimeUsageError, match="a filename or a store, not both"):
        create_local_step_durability(tmp_path / "steps.db", store=store)
    async with create_sqlite_agent_runtime_store(tmp_path / "threadline.db") as handle:
        with pytest.raises(AgentRuntimeUsageError, match=r"the handle's \.store"):
            create_local_step_durability(store=handle)

    class NoLedger(MemoryStoreDriver):
        ledger = False

    with pytest.raises(AgentStoreCapabilityError, match="keeps no event ledger"):
        create_local_step_durability(store=create_agent_runtime_store(NoLedger()))


@pytest.fixture(params=["memory", "sqlite", "postgres"])
def any_target(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "memory":
        return "memory"
    if request.param == "sqlite":
        return str(tmp_path / "threadline.db")
    return str(request.getfixturevalue("pg_target"))


@pytest.fixture
def pg_target(postgres_dsn: str, schema: str) -> str:
    return f"{postgres_dsn}#{schema}"


@pytest.fixture
async def any_store(any_target: str) -> AsyncIterator[Any]:
    if any_target == "memory":
        store = create_memory_agent_runtime_store()
        yield store
        await store.aclose()
        return
    async with open_store(any_target) as handle:
        yield handle.store


async def test_proofs_and_intents_outlive_compaction_and_travel_in_an_archive(any_store: Any) -> None:
    """A runtime's tools record a proof and leave a bare intent; after compaction of those turns and after
    export → import into a fresh store, a durability reconstructed there returns the proof, reports the
    intent uncertain or reconciles it, and never runs a body again."""
    attempts: list[str] = []

    @define_agent_tool
    async def effect(ctx: AgentToolContext, name: str) -> str:
        def body() -> str:
            attempts.append(name)
            if name == "lost":
                raise ConnectionError("the outcome is unknown")  # leaves the intent bare
            return f"done:{name}"

        try:
            return str(await ctx.step(name, body))
        except ConnectionError:
            return "unknown"

    async def stream(messages: list[Any], info: AgentInfo) -> AsyncIterator[Any]:
        last = messages[-1]
        if isinstance(last, ModelRequest) and any(isinstance(p, ToolReturnPart) for p in last.parts):
            yield "ok"
            return
        text = next(p.content for p in last.parts if getattr(p, "part_kind", "") == "user-prompt")
        yield {0: DeltaToolCall(name="effect", json_args=f'{{"name": "{text}"}}', tool_call_id=f"call-{text}")}

    registry = define_model_registry(models={"m": {"model": FunctionModel(stream_function=stream)}})
    runtime = create_agent_runtime(
        protocol=define_agent_protocol(context=Context),
        store=any_store,
        models={"resolve": lambda: registry.resolve("m")},
        tools=[effect],
        loop={"step_durability": create_local_step_durability(store=any_store)},
    )
    runs = {}
    try:
        for name in ("kept", "lost", "later"):
            ticket = runtime.submit(
                conversation_id="c", idempotency_key=name, context={}, parts=[{"type": "text", "text": name}]
            )
            runs[name] = (await asyncio.wait_for(ticket.result, GUARD)).run.id
    finally:
        await runtime.close()
    assert attempts == ["kept", "lost", "later"]
    snapshot = await any_store.load_snapshot(conversation_id="c")
    first_turns = [m.id for m in snapshot.messages if m.run_id in (runs["kept"], runs["lost"])]
    await any_store.replace_compacted_range(
        conversation_id="c",
        expected_version=snapshot.version,
        replaced_message_ids=first_turns,
        summary={"id": "summary-1", "role": "summary", "parts": [{"type": "text", "text": "two effects"}]},
    )
    assert all(m.id not in first_turns for m in (await any_store.load_snapshot(conversation_id="c")).messages)

    async def outcomes(store: Any) -> None:
        durability = create_local_step_durability(store=store)
        assert await run_agent_step(durability, "c", runs["kept"], "kept", never) == "done:kept"
        assert await run_agent_step(durability, "c", runs["later"], "later", never) == "done:later"
        with pytest.raises(AgentStepUncertainError):
            await run_agent_step(durability, "c", runs["lost"], "lost", never)

    await outcomes(any_store)  # compaction took the messages, not the steps
    archive = await any_store.export_conversation("c")
    fresh = create_memory_agent_runtime_store()
    await fresh.import_conversation(archive)
    await outcomes(fresh)
    settled = await run_agent_step(
        create_local_step_durability(store=fresh), "c", runs["lost"], "lost", never, reconcile=lambda r: "found"
    )
    assert settled == "found" and attempts == ["kept", "lost", "later"]
