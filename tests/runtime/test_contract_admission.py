"""Contract (issue 17, §2): admission and absorption records, on every driver (memory, SQLite, and
PostgreSQL when a server answers): the driver's own reads decide these outcomes.

Interleavings are decided by asyncio events; every wait is bounded so a hang fails the test."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from pydantic_ai.models.function import DeltaToolCall

from threadline import AgentIdempotencyConflictError, create_memory_agent_runtime_store, define_agent_tool
from threadline.store.sqlite import create_sqlite_agent_runtime_store

from .conftest import Script, answer_text, last_user_text, make_runtime, submit, text, tool_returns

WAIT = 10


@pytest.fixture(params=["memory", "sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
async def store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Any]:
    if request.param == "memory":
        yield create_memory_agent_runtime_store()
        return
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


async def version_of(store: Any, conversation_id: str = "c1") -> int:
    return (await store.load_snapshot(conversation_id=conversation_id)).version


def held_first_call() -> Script:
    """Call 0 streams a partial and waits on gate(0); later calls echo."""
    script = Script()

    async def handler(i: int, messages: list[Any], info: Any) -> AsyncIterator[Any]:
        if i == 0:
            yield "partial"
            await script.gate(0).wait()
            yield " done"
        else:
            yield f"answer to: {last_user_text(messages)}"

    script.handler = handler
    return script


# ------------------------------------------------------ an input id that is an active run's answer id


@pytest.mark.parametrize("coalesce", [False, True], ids=["queue", "coalesce"])
async def test_an_input_id_equal_to_an_active_runs_assistant_id_is_refused(store: Any, coalesce: bool) -> None:
    script = held_first_call()
    runtime = make_runtime(store, script, runs={"coalesce_pending": coalesce})
    a = submit(runtime, "a", "first")
    running = await asyncio.wait_for(a.admission, WAIT)
    await script.wait_entered(0)
    b = submit(runtime, "b", "second")
    queued = await asyncio.wait_for(b.admission, WAIT)
    assert queued.run.state == "queued"
    before = await version_of(store)

    for n, taken in enumerate([running.assistant_message_id, queued.assistant_message_id]):
        clash = runtime.submit(
            conversation_id="c1",
            idempotency_key=f"clash-{n}",
            context={"user_id": "u1"},
            parts=text("an input reusing an answer's id"),
            record_ids={"input_message_id": taken},
        )
        with pytest.raises(AgentIdempotencyConflictError):
            await asyncio.wait_for(clash.admission, WAIT)
        with pytest.raises(AgentIdempotencyConflictError):
            await asyncio.wait_for(clash.result, WAIT)
        assert await version_of(store) == before, f"nothing written for {taken}"

    snapshot = await store.load_snapshot(conversation_id="c1")
    assert {r.id for r in snapshot.runs} == {running.run.id, queued.run.id}
    assert queued.run.id in {r.id for r in snapshot.runs if r.input_message_ids == (queued.input_message_id,)}
    script.gate(0).set()
    ra, rb = await asyncio.wait_for(asyncio.gather(a.result, b.result), WAIT)
    assert (ra.terminal_reason, rb.terminal_reason) == ("success", "success")
    assert rb.run.input_message_ids == (queued.input_message_id,)
    await runtime.close()


async def test_a_compaction_summary_id_equal_to_an_active_runs_assistant_id_is_refused(store: Any) -> None:
    # one settled turn to compact
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
    # a running run and a queued run behind it
    first = await store.accept_input_and_assign_run(
        conversation_id="c1", idempotency_key="k1", input={"id": "m1", "parts": text("one")}
    )
    await store.acquire_run(
        conversation_id="c1", run_id=first.run.id, expected_revision=first.run.revision, owner_id="x"
    )
    second = await store.accept_input_and_assign_run(
        conversation_id="c1", idempotency_key="k2", input={"id": "m2", "parts": text("two")}
    )
    snapshot = await store.load_snapshot(conversation_id="c1")
    replaced = [m.id for m in snapshot.messages if m.position is not None]
    assert len(replaced) == 2
    for taken in (first.run.assistant_message_id, second.run.assistant_message_id):
        with pytest.raises(AgentIdempotencyConflictError):
            await store.replace_compacted_range(
                conversation_id="c1",
                expected_version=snapshot.version,
                replaced_message_ids=replaced,
                summary={"id": taken, "role": "summary", "parts": text("SUMMARY")},
            )
        assert await version_of(store) == snapshot.version, f"nothing written for {taken}"
    # the same compaction with a fresh id goes through
    done = await store.replace_compacted_range(
        conversation_id="c1",
        expected_version=snapshot.version,
        replaced_message_ids=replaced,
        summary={"id": "summary-1", "role": "summary", "parts": text("SUMMARY")},
    )
    assert done is not None and await version_of(store) > snapshot.version


# ------------------------------------------------------------------------------ inject absorption


def tool_then_answer(tool_gate: asyncio.Event) -> tuple[Script, Any]:
    """Call 0 calls ``lookup`` (which waits on ``tool_gate``); later calls answer what they see."""

    @define_agent_tool
    async def lookup(topic: str) -> str:
        await tool_gate.wait()
        return f"facts about {topic}"

    async def handler(i: int, messages: list[Any], info: Any) -> AsyncIterator[Any]:
        if i == 0:
            yield {0: DeltaToolCall(name="lookup", json_args='{"topic": "threads"}', tool_call_id="call-1")}
        else:
            yield f"final ({len(tool_returns(messages))} results) for: {last_user_text(messages[-1:])}"

    return Script(handler), lookup


async def test_injected_inputs_are_recorded_on_the_absorbing_run_and_answered_by_it(store: Any) -> None:
    gate = asyncio.Event()
    script, lookup = tool_then_answer(gate)
    runtime = make_runtime(store, script, tools=[lookup], runs={"input_policy": "inject"})
    a = submit(runtime, "a", "summarise this thread")
    adm_a = await asyncio.wait_for(a.admission, WAIT)
    await script.wait_entered(0)  # A is in its first step
    b = submit(runtime, "b", "actually, in bullet points")
    adm_b = await asyncio.wait_for(b.admission, WAIT)
    b2 = submit(runtime, "b2", "and keep it short")
    adm_b2 = await asyncio.wait_for(b2.admission, WAIT)
    gate.set()
    ra, rb, rb2 = await asyncio.wait_for(asyncio.gather(a.result, b.result, b2.result), WAIT)
    assert len(script.calls) == 2, "the injected inputs were answered by the run in flight"

    assert ra.terminal_reason == "success"
    assert ra.answered is True and ra.answered_by_run_id == ra.run.id
    stored_a = (await store.load_run(conversation_id="c1", run_id=adm_a.run.id)).run
    assert stored_a.input_message_ids == (
        adm_a.input_message_id,
        adm_b.input_message_id,
        adm_b2.input_message_id,
    ), "A's own input, then the injected ones in admission order"
    assert set(stored_a.absorbed_run_ids) == {adm_b.run.id, adm_b2.run.id}

    for adm, result in ((adm_b, rb), (adm_b2, rb2)):
        stored = (await store.load_run(conversation_id="c1", run_id=adm.run.id)).run
        assert (stored.terminal_reason, stored.absorbed_into_run_id) == ("absorbed", adm_a.run.id)
        assert result.terminal_reason == "absorbed"
        assert result.answered is True and result.answered_by_run_id == adm_a.run.id
        assert result.assistant is not None and result.assistant.id == ra.assistant.id
        assert answer_text(result) == answer_text(ra)

    # a duplicate submission on B's key resolves to the same answer, here and in a fresh runtime
    again = submit(runtime, "b", "actually, in bullet points")
    assert (await asyncio.wait_for(again.admission, WAIT)).outcome == "duplicate"
    same = await asyncio.wait_for(again.result, WAIT)
    assert (same.answered_by_run_id, same.assistant.id) == (adm_a.run.id, ra.assistant.id)
    assert same.answered is True and answer_text(same) == answer_text(ra)
    await runtime.close()

    fresh = make_runtime(store, Script())
    retried = submit(fresh, "b", "actually, in bullet points")
    assert (await asyncio.wait_for(retried.admission, WAIT)).outcome == "duplicate"
    later = await asyncio.wait_for(retried.result, WAIT)
    assert (later.terminal_reason, later.answered_by_run_id) == ("absorbed", adm_a.run.id)
    assert later.answered is True and later.assistant is not None and later.assistant.id == ra.assistant.id
    assert answer_text(later) == answer_text(ra)
    await fresh.close()


async def test_an_interrupted_run_is_not_answered_and_a_completed_one_is(store: Any) -> None:
    script = held_first_call()
    runtime = make_runtime(store, script, runs={"input_policy": "interrupt"})
    a = submit(runtime, "a", "first")
    await script.wait_entered(0)
    b = submit(runtime, "b", "never mind")
    ra, rb = await asyncio.wait_for(asyncio.gather(a.result, b.result), WAIT)
    assert ra.terminal_reason == "interrupted"
    assert ra.answered is False and ra.answered_by_run_id is None
    assert rb.terminal_reason == "success"
    assert rb.answered is True and rb.answered_by_run_id == rb.run.id
    await runtime.close()


# ----------------------------------------------------------------------- snapshot.runs causal order


async def test_snapshot_runs_are_in_execution_order_not_admission_order(store: Any) -> None:
    script = Script()

    async def handler(i: int, messages: list[Any], info: Any) -> AsyncIterator[Any]:
        yield f"partial {i}"
        if i in (0, 1):
            await script.gate(i).wait()
        yield f" answer to: {last_user_text(messages)}"

    script.handler = handler
    policy = lambda raw: "interrupt-next" if "urgent" in raw.parts[0]["text"] else "queue"  # noqa: E731
    runtime = make_runtime(store, script, runs={"input_policy": policy})
    a = submit(runtime, "a", "A")
    run_a = (await asyncio.wait_for(a.admission, WAIT)).run.id
    await script.wait_entered(0)
    b = submit(runtime, "b", "B ordinary")
    run_b = (await asyncio.wait_for(b.admission, WAIT)).run.id
    c = submit(runtime, "c", "C urgent")
    run_c = (await asyncio.wait_for(c.admission, WAIT)).run.id
    assert (await asyncio.wait_for(a.result, WAIT)).terminal_reason == "interrupted"
    await script.wait_entered(1)  # C runs, B waits
    assert last_user_text(script.calls[1]) == "C urgent"

    snapshot = await store.load_snapshot(conversation_id="c1")
    assert [r.id for r in snapshot.runs] == [run_a, run_c, run_b]
    assert [r.state for r in snapshot.runs] == ["interrupted", "running", "queued"]

    script.gate(1).set()
    rb, rc = await asyncio.wait_for(asyncio.gather(b.result, c.result), WAIT)
    assert (rb.terminal_reason, rc.terminal_reason) == ("success", "success")
    snapshot = await store.load_snapshot(conversation_id="c1")
    assert [r.id for r in snapshot.runs] == [run_a, run_c, run_b]
    await runtime.close()


async def test_snapshot_lists_queued_runs_urgent_first_then_fifo(store: Any) -> None:
    """Queued runs that have not started yet: interrupt-next ones first (FIFO), then ordinary ones (FIFO),
    whatever their admission order."""
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


async def test_a_coalesced_successor_injected_before_the_boundary_is_absorbed_whole(store: Any) -> None:
    gate = asyncio.Event()
    script, lookup = tool_then_answer(gate)
    runtime = make_runtime(store, script, tools=[lookup], runs={"input_policy": "inject", "coalesce_pending": True})
    a = submit(runtime, "a", "summarise this thread")
    adm_a = await asyncio.wait_for(a.admission, WAIT)
    await script.wait_entered(0)
    b = submit(runtime, "b", "actually, in bullet points")
    adm_b = await asyncio.wait_for(b.admission, WAIT)
    b2 = submit(runtime, "b2", "and keep it short")
    adm_b2 = await asyncio.wait_for(b2.admission, WAIT)
    assert adm_b2.coalesced and adm_b2.run.id == adm_b.run.id
    gate.set()
    ra, rb, rb2 = await asyncio.wait_for(asyncio.gather(a.result, b.result, b2.result), WAIT)
    assert len(script.calls) == 2
    stored_a = (await store.load_run(conversation_id="c1", run_id=adm_a.run.id)).run
    assert stored_a.input_message_ids == (adm_a.input_message_id, adm_b.input_message_id, adm_b2.input_message_id)
    assert stored_a.absorbed_run_ids == (adm_b.run.id,)
    for result in (rb, rb2):
        assert (result.terminal_reason, result.answered_by_run_id) == ("absorbed", adm_a.run.id)
        assert result.answered is True and result.assistant.id == ra.assistant.id
    await runtime.close()
