"""Contract (issue 17, §1): lifecycle races around close(), recover() and resume().

Every interleaving is decided by asyncio events; every wait is bounded so a hang fails the test."""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator
from typing import Any

import pytest

from threadline import create_agent_runtime, define_agent_protocol, define_model_registry
from threadline.errors import AgentConfigError, AgentRunOrderConflictError
from threadline.runtime import AgentRuntimeClosedError

from .conftest import Context, Script, make_runtime, submit, text

WAIT = 5


def held_first_call(*, cooperative: bool = False) -> tuple[Script, asyncio.Event]:
    """Call 0 streams "partial" then waits for ``release`` (ignoring cancellation unless cooperative);
    later calls echo."""
    script = Script()
    release = asyncio.Event()

    async def handler(i: int, messages: list[Any], info: Any) -> AsyncIterator[Any]:
        if i == 0:
            yield "partial"
            while True:
                try:
                    await release.wait()
                    break
                except asyncio.CancelledError:
                    if cooperative:
                        raise
            yield " and the rest"
        else:
            async for item in Script.echo(i, messages, info):
                yield item

    script.handler = handler
    return script, release


async def queued_in_store(store: Any, conversation_id: str, key: str, **kw: Any) -> Any:
    accepted = await store.accept_input_and_assign_run(
        conversation_id=conversation_id,
        idempotency_key=key,
        input={"id": f"in-{conversation_id}-{key}", "parts": text(key)},
        **kw,
    )
    return accepted.run


async def version_of(store: Any, conversation_id: str = "c1") -> int:
    return (await store.load_snapshot(conversation_id=conversation_id)).version


async def spin(times: int = 20) -> None:
    """Let every ready task run (a yield, not a timer: nothing here is decided by elapsed time)."""
    for _ in range(times):
        await asyncio.sleep(0)


# ------------------------------------------------------------------ resume/recover once close() began


async def test_resume_and_recover_raise_at_once_while_close_is_awaiting_a_run(store: Any) -> None:
    script, release = held_first_call()
    runtime = make_runtime(store, script)
    ticket = submit(runtime, "k", "hello")
    await script.wait_entered(0)
    other = await queued_in_store(store, "c2", "q")  # a queued run resume()/recover() could start
    closing = asyncio.ensure_future(runtime.close(grace_period=30))
    await spin()
    assert not closing.done(), "close() is awaiting the run in flight"

    with pytest.raises(AgentRuntimeClosedError):
        await asyncio.wait_for(runtime.resume(conversation_id="c2", run_id=other.id, context={}), WAIT)
    with pytest.raises(AgentRuntimeClosedError):
        await asyncio.wait_for(runtime.recover(resolve_context=lambda run: {}), WAIT)

    release.set()
    closed = await asyncio.wait_for(closing, WAIT)
    assert closed.settled
    assert (await asyncio.wait_for(ticket.result, WAIT)).terminal_reason == "success"
    loaded = await store.load_run(conversation_id="c2", run_id=other.id)
    assert loaded.run.state == "queued" and loaded.run.fencing_token == 0, "nothing acquired the queued run"
    assert len(script.calls) == 1


# --------------------------------------------------------------------------- refused close budgets


@pytest.mark.parametrize("argument", ["grace_period", "force_timeout"])
@pytest.mark.parametrize("value", [-1, -0.5, math.nan, math.inf, -math.inf])
async def test_close_refuses_a_bad_budget_and_closes_nothing(store: Any, argument: str, value: float) -> None:
    runtime = make_runtime(store, Script())
    with pytest.raises(AgentConfigError) as error:
        await asyncio.wait_for(runtime.close(**{argument: value}), WAIT)
    assert error.value.field == argument
    result = await asyncio.wait_for(submit(runtime, "k", "still open?").result, WAIT)
    assert result.terminal_reason == "success"
    closed = await asyncio.wait_for(runtime.close(), WAIT)
    assert closed.settled


# ------------------------------------------------------ close() landing before a decision is written


def gated_preflight_runtime(store: Any, script: Script) -> tuple[Any, asyncio.Event, asyncio.Event]:
    registry = define_model_registry(models={"m": {"model": script.model, "context_window": 100_000}})
    entered, release = asyncio.Event(), asyncio.Event()

    async def preflight() -> Any:
        entered.set()
        await release.wait()
        return registry.preflight("m")

    runtime = create_agent_runtime(
        protocol=define_agent_protocol(context=Context),
        store=store,
        models={"preflight": preflight, "resolve": lambda: registry.resolve("m")},
    )
    return runtime, entered, release


async def test_close_during_the_preflight_commits_no_admission(store: Any) -> None:
    script = Script()
    runtime, entered, release = gated_preflight_runtime(store, script)
    ticket = submit(runtime, "k", "hello")
    await asyncio.wait_for(entered.wait(), WAIT)
    closing = asyncio.ensure_future(runtime.close())
    await spin()
    release.set()  # the preflight answers after close() began
    with pytest.raises(AgentRuntimeClosedError):
        await asyncio.wait_for(ticket.admission, WAIT)
    with pytest.raises(AgentRuntimeClosedError):
        await asyncio.wait_for(ticket.result, WAIT)
    await asyncio.wait_for(closing, WAIT)
    assert await version_of(store) == 0, "no admission was committed"
    assert script.calls == []


async def test_close_while_the_recovery_policy_decides_writes_no_decision(store: Any) -> None:
    orphan = await queued_in_store(store, "c1", "k1")
    await store.acquire_run(conversation_id="c1", run_id=orphan.id, expected_revision=orphan.revision, owner_id="dead")
    before = await version_of(store)
    script = Script()
    runtime = make_runtime(store, script)
    deciding, decide = asyncio.Event(), asyncio.Event()

    async def policy(run: Any) -> dict[str, Any]:
        deciding.set()
        await decide.wait()
        return {"action": "requeue", "replay_safe": True}

    recovering = asyncio.ensure_future(runtime.recover(resolve_context=lambda run: {}, policy=policy))
    await asyncio.wait_for(deciding.wait(), WAIT)
    closing = asyncio.ensure_future(runtime.close())
    await spin()
    decide.set()
    with pytest.raises(AgentRuntimeClosedError):
        await asyncio.wait_for(recovering, WAIT)
    await asyncio.wait_for(closing, WAIT)
    loaded = await store.load_run(conversation_id="c1", run_id=orphan.id)
    assert (loaded.run.state, loaded.run.owner_id) == ("running", "dead"), "the acquired run was not requeued"
    assert await version_of(store) == before
    assert script.calls == []


# ------------------------------------------------------------------ an admission write already sent


def blocking_admission(store: Any) -> tuple[asyncio.Event, asyncio.Event]:
    called, release = asyncio.Event(), asyncio.Event()
    original = store.accept_input_and_assign_run

    async def blocked(**kwargs: Any) -> Any:
        called.set()
        await release.wait()
        return await original(**kwargs)

    store.accept_input_and_assign_run = blocked
    return called, release


async def test_close_with_no_force_budget_reports_an_admission_write_in_flight(store: Any) -> None:
    runtime = make_runtime(store, Script())
    called, release = blocking_admission(store)
    ticket = submit(runtime, "k", "hello")
    await asyncio.wait_for(called.wait(), WAIT)
    closed = await asyncio.wait_for(runtime.close(force_timeout=0), WAIT)
    assert closed.settled is False and closed.timed_out is True
    assert closed.remaining >= 1, "the admission write in flight is counted"
    release.set()
    # the write lands after close() reported: the ticket settles, and no run is left acquired by a runtime
    # that will never execute it (it ended ``shutdown`` at once, or it waits queued for recover())
    await asyncio.wait_for(asyncio.gather(ticket.result, return_exceptions=True), WAIT)
    admission = await asyncio.wait_for(ticket.admission, WAIT)
    loaded = await store.load_run(conversation_id="c1", run_id=admission.run.id)
    assert loaded.run.state != "running", loaded.run
    assert loaded.run.state == "queued" or loaded.run.terminal_reason == "shutdown", loaded.run


async def test_close_without_budget_waits_for_the_admission_write(store: Any) -> None:
    runtime = make_runtime(store, Script())
    called, release = blocking_admission(store)
    ticket = submit(runtime, "k", "hello")
    await asyncio.wait_for(called.wait(), WAIT)
    closing = asyncio.ensure_future(runtime.close())
    await spin()
    assert not closing.done(), "close() waits for the admission write it cannot see answered"
    release.set()
    closed = await asyncio.wait_for(closing, WAIT)
    assert (closed.settled, closed.timed_out, closed.remaining) == (True, False, 0)
    admission = await asyncio.wait_for(ticket.admission, WAIT)
    assert admission.outcome == "accepted" and await version_of(store) >= 1
    await asyncio.wait_for(asyncio.gather(ticket.result, return_exceptions=True), WAIT)


# ----------------------------------------------------------------------- recover() never hangs


async def test_recover_reports_a_refused_acquisition_and_leaves_the_run_queued(store: Any) -> None:
    queued = await queued_in_store(store, "c1", "ordinary")
    original = store.acquire_run
    urgent: list[Any] = []

    async def moved_first(**kwargs: Any) -> Any:
        if not urgent:  # the queue moves under the acquisition: an interrupt-next input goes first
            accepted = await store.accept_input_and_assign_run(
                conversation_id="c1",
                idempotency_key="urgent",
                input={"id": "in-urgent", "parts": text("urgent")},
                priority="urgent",
            )
            urgent.append(accepted.run)
        return await original(**kwargs)

    store.acquire_run = moved_first
    script = Script()
    runtime = make_runtime(store, script)
    outcomes = await asyncio.wait_for(runtime.recover(resolve_context=lambda run: {}), WAIT)
    assert urgent, "the acquisition was attempted"
    mine = [o for o in outcomes if o.run_id == queued.id]
    assert len(mine) == 1, outcomes
    assert mine[0].outcome in ("failed", "blocked"), mine[0]
    if mine[0].outcome == "failed":
        assert mine[0].error is not None
    loaded = await store.load_run(conversation_id="c1", run_id=queued.id)
    assert loaded.run.state == "queued", "the refused run is not abandoned"
    assert loaded.run.terminal_reason is None
    active = await store.list_active_runs(conversation_id="c1")
    assert {(r.id, r.state) for r in active.runs} == {(queued.id, "queued"), (urgent[0].id, "queued")}
    assert script.calls == []
    await asyncio.wait_for(runtime.close(), WAIT)


async def test_recover_returns_when_the_store_refuses_every_acquisition(store: Any) -> None:
    queued = await queued_in_store(store, "c1", "ordinary")
    refusals: list[str] = []

    async def refusing(**kwargs: Any) -> Any:
        refusals.append(kwargs["run_id"])
        raise AgentRunOrderConflictError(
            f"run {kwargs['run_id']} is not next in execution order",
            conversation_id=kwargs["conversation_id"],
            run_id=kwargs["run_id"],
        )

    store.acquire_run = refusing
    script = Script()
    runtime = make_runtime(store, script)
    outcomes = await asyncio.wait_for(runtime.recover(resolve_context=lambda run: {}), WAIT)
    assert refusals, "the acquisition was attempted"
    assert [(o.run_id, o.outcome) for o in outcomes] == [(queued.id, "failed")]
    assert outcomes[0].error is not None
    loaded = await store.load_run(conversation_id="c1", run_id=queued.id)
    assert loaded.run.state == "queued", "a refused acquisition never abandons the run"
    assert script.calls == []
    await asyncio.wait_for(runtime.close(), WAIT)


# ------------------------------------------------------------- more writes and reads close() races


async def test_close_during_resumes_read_raises_and_acquires_nothing(store: Any) -> None:
    queued = await queued_in_store(store, "c1", "k1")
    runtime = make_runtime(store, Script())
    original = store.load_run
    reading, release = asyncio.Event(), asyncio.Event()

    async def slow_read(**kwargs: Any) -> Any:
        reading.set()
        await release.wait()
        return await original(**kwargs)

    store.load_run = slow_read
    resuming = asyncio.ensure_future(runtime.resume(conversation_id="c1", run_id=queued.id, context={}))
    await asyncio.wait_for(reading.wait(), WAIT)
    closing = asyncio.ensure_future(runtime.close())
    await spin()
    release.set()
    with pytest.raises(AgentRuntimeClosedError):
        await asyncio.wait_for(resuming, WAIT)
    await asyncio.wait_for(closing, WAIT)
    store.load_run = original
    loaded = await store.load_run(conversation_id="c1", run_id=queued.id)
    assert loaded.run.state == "queued" and loaded.run.fencing_token == 0


async def test_close_while_recover_resolves_a_context_writes_nothing(store: Any) -> None:
    queued = await queued_in_store(store, "c1", "k1")
    before = await version_of(store)
    script = Script()
    runtime = make_runtime(store, script)
    resolving, resolve = asyncio.Event(), asyncio.Event()

    async def resolve_context(run: Any) -> dict[str, Any]:
        resolving.set()
        await resolve.wait()
        return {"user_id": "u1"}

    recovering = asyncio.ensure_future(runtime.recover(resolve_context=resolve_context))
    await asyncio.wait_for(resolving.wait(), WAIT)
    closing = asyncio.ensure_future(runtime.close())
    await spin()
    resolve.set()
    with pytest.raises(AgentRuntimeClosedError):
        await asyncio.wait_for(recovering, WAIT)
    await asyncio.wait_for(closing, WAIT)
    loaded = await store.load_run(conversation_id="c1", run_id=queued.id)
    assert loaded.run.state == "queued" and await version_of(store) == before
    assert script.calls == []


async def test_close_during_an_acquisition_in_flight_aborts_the_run_it_acquires(store: Any) -> None:
    """close() without budgets aborts every executing run at once; a run whose acquisition was already sent
    when close() began is waited for and then aborted too (``shutdown``), not left to run to its end."""
    script = Script()
    release_provider = asyncio.Event()

    async def handler(i: int, messages: list[Any], info: Any) -> AsyncIterator[Any]:
        if i == 0:
            await script.gate(0).wait()
        if i == 1:  # the queued run's provider answers only when the test says so (or is cancelled)
            yield "partial"
            await release_provider.wait()
        yield f"answer {i}"

    script.handler = handler
    runtime = make_runtime(store, script)
    original = store.acquire_run
    acquiring, release_acquire = asyncio.Event(), asyncio.Event()

    async def slow_acquire(**kwargs: Any) -> Any:
        acquiring.set()
        await release_acquire.wait()
        return await original(**kwargs)

    store.acquire_run = slow_acquire
    first = submit(runtime, "a", "first")  # admitted and started in one commit: no acquisition
    await script.wait_entered(0)
    second = submit(runtime, "b", "second")  # queued: acquired once the first ends
    assert (await asyncio.wait_for(second.admission, WAIT)).run.state == "queued"
    script.gate(0).set()
    assert (await asyncio.wait_for(first.result, WAIT)).terminal_reason == "success"
    await asyncio.wait_for(acquiring.wait(), WAIT)
    closing = asyncio.ensure_future(runtime.close())
    await spin()
    assert not closing.done(), "close() waits for the acquisition already sent"
    release_acquire.set()
    try:
        closed = await asyncio.wait_for(closing, WAIT)
    finally:
        release_provider.set()
    assert closed.settled
    result = await asyncio.wait_for(second.result, WAIT)
    assert result.terminal_reason == "shutdown"
