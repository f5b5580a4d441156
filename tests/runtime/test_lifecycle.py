"""Lifecycle: submit validation, duplicates, durable interrupt racing completion, close budgets, recovery,
resume and store failures around execution."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest

from threadline import (
    AgentRecordValidationError,
    AgentRuntimeClosedError,
    AgentRunUnsettledError,
    AgentStoreUnavailableError,
)
from threadline.models import AgentModelUnavailableError

from .conftest import Script, answer_text, make_runtime, submit


def hanging_script(*, cooperative: bool = True) -> tuple[Script, asyncio.Event, asyncio.Event]:
    """Call 0 streams "partial" then waits for ``release``; a non-cooperative one ignores cancellation
    until released. Later calls echo."""
    script = Script()
    release = asyncio.Event()
    streamed = asyncio.Event()

    async def handler(i: int, messages: list[Any], info: Any) -> AsyncIterator[Any]:
        if i == 0:
            yield "partial"
            streamed.set()
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
    return script, release, streamed


async def test_bad_context_is_refused_before_anything_is_written(store: Any) -> None:
    runtime = make_runtime(store, Script())
    ticket = runtime.submit(conversation_id="c1", idempotency_key="k", context={"user_id": 5}, parts=[])
    with pytest.raises(AgentRecordValidationError) as error:
        await ticket.admission
    assert error.value.field == "context.user_id"
    with pytest.raises(AgentRecordValidationError):
        await ticket.result
    assert (await store.load_snapshot(conversation_id="c1")).version == 0
    await runtime.close()


async def test_bad_parts_and_failed_preflight_write_nothing(store: Any) -> None:
    runtime = make_runtime(store, Script())
    bad = runtime.submit(conversation_id="c1", idempotency_key="k", context={}, parts=[{"type": "nope"}])
    with pytest.raises(AgentRecordValidationError):
        await bad.admission

    def preflight() -> None:
        raise AgentModelUnavailableError("model 'm' is unavailable: Set the `OPENAI_API_KEY` environment variable")

    runtime._preflight = preflight
    refused = runtime.submit(
        conversation_id="c1", idempotency_key="k", context={}, parts=[{"type": "text", "text": "x"}]
    )
    with pytest.raises(AgentModelUnavailableError):
        await refused.admission
    assert (await store.load_snapshot(conversation_id="c1")).version == 0
    await runtime.close()


async def test_a_duplicate_after_the_end_returns_the_same_answer(store: Any) -> None:
    script = Script()
    runtime = make_runtime(store, script)
    first = await submit(runtime, "k", "hello").result
    again = submit(runtime, "k", "hello")
    admission = await again.admission
    assert admission.outcome == "duplicate" and admission.run.id == first.run.id
    second = await again.result
    assert second.assistant.id == first.assistant.id and second.metrics is None
    assert len(script.calls) == 1
    await runtime.close()


async def test_durable_interrupt_racing_completion_commits_interrupted(store: Any) -> None:
    runtime = make_runtime(store, Script())
    original = store.commit_run_terminal
    raced: list[str] = []

    async def racing(**kwargs: Any) -> Any:
        if not raced:  # the provider finished; an interrupt commits before the terminal CAS
            raced.append(kwargs["run_id"])
            await store.request_run_interrupt(conversation_id=kwargs["conversation_id"], run_id=kwargs["run_id"])
        return await original(**kwargs)

    store.commit_run_terminal = racing
    result = await submit(runtime, "k", "hello").result
    assert result.terminal_reason == "interrupted" and result.assistant.status == "interrupted"
    assert answer_text(result) == "answer to: hello"
    await runtime.close()


async def test_interrupt_after_the_end_reports_terminal(store: Any) -> None:
    runtime = make_runtime(store, Script())
    result = await submit(runtime, "k", "hello").result
    outcome = await runtime.interrupt(conversation_id="c1", run_id=result.run.id)
    assert outcome.outcome == "terminal" and outcome.run.terminal_reason == "success"
    await runtime.close()


async def test_a_terminal_lost_to_another_executor_settles_from_the_winner(store: Any) -> None:
    runtime = make_runtime(store, Script())
    original = store.commit_run_terminal

    async def beaten(**kwargs: Any) -> Any:
        await original(**{**kwargs, "terminal_reason": "cancelled", "parts": []})  # the other execution wins
        return await original(**kwargs)

    store.commit_run_terminal = beaten
    result = await submit(runtime, "k", "hello").result
    assert result.terminal_reason == "cancelled" and result.metrics is None
    await runtime.close()


# ---------------------------------------------------------------------------------- close budgets


async def test_close_without_budgets_aborts_at_once_and_waits(store: Any) -> None:
    script, _release, streamed = hanging_script()
    runtime = make_runtime(store, script)
    ticket = submit(runtime, "k", "hello")
    await streamed.wait()
    closed = await runtime.close()
    assert (closed.settled, closed.timed_out, closed.remaining) == (True, False, 0)
    assert (await ticket.result).terminal_reason == "shutdown"


async def test_close_with_grace_lets_the_run_finish(store: Any) -> None:
    script, release, streamed = hanging_script()
    runtime = make_runtime(store, script)
    ticket = submit(runtime, "k", "hello")
    await streamed.wait()
    closing = asyncio.ensure_future(runtime.close(grace_period=30))
    await asyncio.sleep(0)
    release.set()
    closed = await closing
    assert closed.settled and (await ticket.result).terminal_reason == "success"


async def test_close_with_force_timeout_reports_a_run_still_in_flight(store: Any) -> None:
    script, release, streamed = hanging_script(cooperative=False)
    runtime = make_runtime(store, script)
    ticket = submit(runtime, "k", "hello")
    await streamed.wait()
    closed = await runtime.close(force_timeout=0.05)
    assert (closed.settled, closed.timed_out, closed.remaining) == (False, True, 1)
    release.set()  # the non-cooperative provider finally returns; the run still ends as shut down
    result = await asyncio.wait_for(ticket.result, 5)
    assert result.terminal_reason == "shutdown"


async def test_close_with_both_budgets(store: Any) -> None:
    script, release, streamed = hanging_script(cooperative=False)
    runtime = make_runtime(store, script)
    ticket = submit(runtime, "k", "hello")
    await streamed.wait()
    closed = await runtime.close(grace_period=0.01, force_timeout=0.05)
    assert (closed.timed_out, closed.remaining) == (True, 1)
    release.set()
    assert (await asyncio.wait_for(ticket.result, 5)).terminal_reason == "shutdown"


async def test_a_run_its_admission_started_while_the_runtime_closed_ends_at_once(store: Any) -> None:
    """close() begins between the commit that admitted and started a run and the run's first step: the
    run is not left acquired by a runtime that will never execute it; it ends ``shutdown`` at once."""
    script = Script()
    runtime = make_runtime(store, script)
    admit = store.accept_input_and_assign_run
    closing: list[asyncio.Future[Any]] = []

    async def admit_then_close(**kwargs: Any) -> Any:
        accepted = await admit(**kwargs)
        closing.append(asyncio.ensure_future(runtime.close()))
        await asyncio.sleep(0)  # close() is under way before the admission's caller goes on
        return accepted

    store.accept_input_and_assign_run = admit_then_close
    ticket = submit(runtime, "k", "hello")
    run = (await ticket.admission).run
    assert run.state == "running"
    await asyncio.wait_for(closing[0], 5)
    loaded = await asyncio.wait_for(_terminal(store, run.id), 5)
    assert (loaded.run.terminal_reason, loaded.run.state) == ("shutdown", "interrupted")
    assert script.calls == [], "no provider call was made"


async def _terminal(store: Any, run_id: str) -> Any:
    while True:
        loaded = await store.load_run(conversation_id="c1", run_id=run_id)
        if loaded.run.terminal:
            return loaded
        await asyncio.sleep(0.01)


async def test_close_leaves_queued_work_recoverable(store: Any) -> None:
    script, _release, streamed = hanging_script()
    runtime = make_runtime(store, script)
    first = submit(runtime, "a", "first")
    await streamed.wait()
    queued = submit(runtime, "b", "second")
    run_b = (await queued.admission).run
    await runtime.close()
    assert (await first.result).terminal_reason == "shutdown"
    with pytest.raises(AgentRuntimeClosedError):
        await queued.result
    late = submit(runtime, "c", "third")
    with pytest.raises(AgentRuntimeClosedError):
        await late.admission
    active = await store.list_active_runs(conversation_id="c1")
    assert [r.id for r in active.runs] == [run_b.id] and active.runs[0].state == "queued"

    # a new runtime recovers it
    later = make_runtime(store, Script())
    outcomes = await later.recover(resolve_context=lambda run: {"user_id": "u1"})
    assert [(o.run_id, o.outcome) for o in outcomes] == [(run_b.id, "resumed")]
    result = await outcomes[0].result
    assert result.terminal_reason == "success"
    await later.close()


# ---------------------------------------------------------------------------------------- recovery


async def test_recover_skips_acquired_runs_unless_a_policy_gives_evidence(store: Any) -> None:
    accepted = await store.accept_input_and_assign_run(
        conversation_id="c1", idempotency_key="k1", input={"id": "m1", "parts": [{"type": "text", "text": "one"}]}
    )
    behind = await store.accept_input_and_assign_run(
        conversation_id="c1", idempotency_key="k2", input={"id": "m2", "parts": [{"type": "text", "text": "two"}]}
    )
    await store.acquire_run(conversation_id="c1", run_id=accepted.run.id, expected_revision=1, owner_id="dead")
    script = Script()
    runtime = make_runtime(store, script)
    outcomes = await runtime.recover(resolve_context=lambda run: {})
    assert [(o.run_id, o.outcome) for o in outcomes] == [(accepted.run.id, "skipped"), (behind.run.id, "blocked")]
    assert script.calls == []

    outcomes = await runtime.recover(
        resolve_context=lambda run: {}, policy=lambda run: {"action": "requeue", "replay_safe": True}
    )
    assert [(o.run_id, o.outcome) for o in outcomes] == [(accepted.run.id, "requeued"), (behind.run.id, "resumed")]
    results = [await o.result for o in outcomes]
    assert [r.terminal_reason for r in results] == ["success", "success"]
    assert results[0].run.fencing_token == 2, "the requeued run was acquired again with a higher token"
    await runtime.close()


async def test_a_requeued_run_publishes_its_queued_run_state_before_it_runs_again(store: Any) -> None:
    accepted = await store.accept_input_and_assign_run(
        conversation_id="c1", idempotency_key="k1", input={"id": "m1", "parts": [{"type": "text", "text": "one"}]}
    )
    await store.acquire_run(conversation_id="c1", run_id=accepted.run.id, expected_revision=1, owner_id="dead")
    events: list[Any] = []
    runtime = make_runtime(store, Script(), publish=events.append)
    outcomes = await runtime.recover(
        resolve_context=lambda run: {}, policy=lambda run: {"action": "requeue", "replay_safe": True}
    )
    assert [o.outcome for o in outcomes] == ["requeued"]
    assert (await outcomes[0].result).terminal_reason == "success"
    states = [(e.state, e.version) for e in events if e.type == "run-state"]
    assert [s for s, _ in states] == ["queued", "running", "completed"]
    assert [v for _, v in states] == sorted(v for _, v in states)
    await runtime.close()


async def test_an_interrupting_input_for_a_run_executing_elsewhere_publishes_interrupt_requested(store: Any) -> None:
    accepted = await store.accept_input_and_assign_run(
        conversation_id="c1", idempotency_key="k1", input={"id": "m1", "parts": [{"type": "text", "text": "one"}]}
    )
    await store.acquire_run(conversation_id="c1", run_id=accepted.run.id, expected_revision=1, owner_id="worker")
    events: list[Any] = []
    web = make_runtime(store, Script(), publish=events.append, runs={"execute": False, "input_policy": "interrupt"})
    ticket = submit(web, "k2", "two")
    await ticket.accepted
    wanted = (accepted.run.id, "interrupt_requested")

    async def published() -> None:
        while wanted not in [(e.run_id, e.state) for e in events if e.type == "run-state"]:
            await asyncio.sleep(0.01)

    await asyncio.wait_for(published(), 5)
    loaded = await store.load_run(conversation_id="c1", run_id=accepted.run.id)
    assert loaded.run.state == "interrupt_requested"
    await web.close(force_timeout=1)


async def test_recover_abandons_with_stale_owner_evidence(store: Any) -> None:
    accepted = await store.accept_input_and_assign_run(
        conversation_id="c1", idempotency_key="k1", input={"id": "m1", "parts": [{"type": "text", "text": "one"}]}
    )
    await store.acquire_run(conversation_id="c1", run_id=accepted.run.id, expected_revision=1, owner_id="dead")
    runtime = make_runtime(store, Script())
    outcomes = await runtime.recover(
        resolve_context=lambda run: {}, policy=lambda run: {"action": "abandon", "stale_owner": True}
    )
    assert [o.outcome for o in outcomes] == ["abandoned"]
    loaded = await store.load_run(conversation_id="c1", run_id=accepted.run.id)
    assert loaded.run.state == "abandoned"
    await runtime.close()


async def test_recover_restores_execution_order_across_pages(store: Any) -> None:
    ids = []
    for i, (key, urgent) in enumerate([("o1", False), ("u1", True), ("o2", False), ("u2", True)]):
        accepted = await store.accept_input_and_assign_run(
            conversation_id="c1",
            idempotency_key=key,
            input={"id": f"m{i}", "parts": [{"type": "text", "text": key}]},
            run_id=f"run-{9 - i}",  # ids in reverse order of admission
            priority="urgent" if urgent else "ordinary",
        )
        ids.append(accepted.run.id)
    script = Script()
    runtime = make_runtime(store, script)
    outcomes = await runtime.recover(resolve_context=lambda run: {}, page_size=1)
    assert [o.run_id for o in outcomes] == [ids[1], ids[3], ids[0], ids[2]]
    for o in outcomes:
        await o.result
    from .conftest import last_user_text

    assert [last_user_text(c) for c in script.calls] == ["u1", "u2", "o1", "o2"]
    await runtime.close()


async def test_resume_one_known_queued_run(store: Any) -> None:
    accepted = await store.accept_input_and_assign_run(
        conversation_id="c1", idempotency_key="k1", input={"id": "m1", "parts": [{"type": "text", "text": "one"}]}
    )
    runtime = make_runtime(store, Script())
    ticket = await runtime.resume(conversation_id="c1", run_id=accepted.run.id, context={})
    acquired = await ticket.accepted
    assert acquired.state == "running" and acquired.owner_id == runtime.owner_id
    assert (await ticket.result).terminal_reason == "success"
    await runtime.close()


async def test_a_store_that_fails_at_the_terminal_leaves_the_run_unsettled(store: Any) -> None:
    runtime = make_runtime(store, Script())

    async def down(**kwargs: Any) -> Any:
        raise AgentStoreUnavailableError("database unreachable")

    store.commit_run_terminal = down
    ticket = submit(runtime, "k", "hello")
    with pytest.raises(AgentRunUnsettledError) as error:
        await ticket.result
    assert error.value.owner_id == runtime.owner_id and error.value.run.state == "running"
    await runtime.close()


async def test_an_acquisition_the_store_keeps_failing_abandons_the_run(store: Any) -> None:
    release = asyncio.Event()

    async def handler(i: int, messages: list[Any], info: Any) -> AsyncIterator[Any]:
        if i == 0:
            await release.wait()
        yield f"answer {i}"

    runtime = make_runtime(store, Script(handler))
    first = submit(runtime, "k1", "first")  # nothing else runs in c1: its admission starts it
    await first.accepted

    async def failing(**kwargs: Any) -> Any:
        raise AgentStoreUnavailableError("database unreachable")

    store.acquire_run = failing
    second = submit(runtime, "k2", "second")  # queued behind the first; its acquisition will fail
    assert (await second.accepted).run.state == "queued"
    release.set()
    assert (await first.result).terminal_reason == "success"
    result = await second.result
    assert (result.terminal_reason, result.run.state, result.assistant.status) == ("abandoned", "abandoned", "failed")
    await runtime.close()


async def test_an_abandoned_acquisition_reports_its_cause_on_the_operator_run_terminal(store: Any) -> None:
    release = asyncio.Event()

    async def handler(i: int, messages: list[Any], info: Any) -> AsyncIterator[Any]:
        if i == 0:
            await release.wait()
        yield f"answer {i}"

    operator: list[Any] = []
    runtime = make_runtime(store, Script(handler), operator_publish=operator.append, include_internal_cause=True)
    first = submit(runtime, "k1", "first")
    await first.accepted

    async def failing(**kwargs: Any) -> Any:
        raise AgentStoreUnavailableError("database unreachable")

    store.acquire_run = failing
    second = submit(runtime, "k2", "second")
    queued = (await second.accepted).run
    release.set()
    assert (await second.result).terminal_reason == "abandoned"
    ends = [e for e in operator if e.type == "run-terminal" and e.run_id == queued.id]
    assert len(ends) == 1
    (end,) = ends
    assert (end.outcome, end.terminal_reason, end.steps) == ("committed", "abandoned", 0)
    assert "database unreachable" in json.dumps(end.cause)
    assert end.usage.input_tokens.provenance == "unavailable" and end.usage.cost.provenance == "unavailable"
    assert not [e for e in operator if e.type == "run-started" and e.run_id == queued.id]
    await runtime.close()


async def test_input_queued_behind_an_orphan_is_reported_unsettled(store: Any) -> None:
    accepted = await store.accept_input_and_assign_run(
        conversation_id="c1", idempotency_key="k1", input={"id": "m1", "parts": [{"type": "text", "text": "one"}]}
    )
    await store.acquire_run(conversation_id="c1", run_id=accepted.run.id, expected_revision=1, owner_id="gone")
    runtime = make_runtime(store, Script())
    ticket = submit(runtime, "k2", "two")
    queued = (await ticket.admission).run
    with pytest.raises(AgentRunUnsettledError) as error:
        await ticket.result
    assert error.value.run.id == queued.id and error.value.owner_id is None
    # with evidence the orphan is abandoned and the queued input runs
    outcomes = await runtime.recover(
        resolve_context=lambda run: {}, policy=lambda run: {"action": "abandon", "stale_owner": True}
    )
    assert [(o.run_id, o.outcome) for o in outcomes] == [(accepted.run.id, "abandoned"), (queued.id, "resumed")]
    assert (await outcomes[1].result).terminal_reason == "success"
    await runtime.close()


async def test_a_runtime_managed_compaction_hook_runs_before_each_step(store: Any) -> None:
    calls: list[Any] = []

    async def compact(request: Any) -> None:
        calls.append((request.step, request.context_usage.context_window))
        page = await request.store.conversations.messages(request.conversation_id, limit=50)
        settled = [m for m in page.items if m.position is not None]
        if len(settled) < 4:
            return  # not needed yet: the invocation is still recorded
        version = (await request.store.list_active_runs(conversation_id=request.conversation_id)).version
        await request.store.replace_compacted_range(
            conversation_id=request.conversation_id,
            expected_version=version,
            replaced_message_ids=[m.id for m in settled],
            summary={"id": f"summary-{len(calls)}", "role": "summary", "parts": [{"type": "text", "text": "SUMMARY"}]},
        )

    script = Script()
    runtime = make_runtime(store, script, history={"compaction": compact})
    for i in range(3):
        await submit(runtime, f"k{i}", f"question {i}").result
    assert [c[0] for c in calls] == [0, 0, 0] and calls[0][1] == 100_000
    # the third request no longer carries the first two turns; the summary reaches the instructions
    from .conftest import last_user_text

    assert last_user_text(script.calls[2]) == "question 2"
    assert "question 0" not in repr(script.calls[2]) and script.infos[2].instructions == "SUMMARY"
    loaded = await store.load_run(
        conversation_id="c1", run_id=(await submit(runtime, "k0", "question 0").admission).run.id
    )
    assert loaded.run.terminal_reason == "success"
    await runtime.close()
