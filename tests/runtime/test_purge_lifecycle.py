"""Purge against work already under way: a submit paused before its admission, a recovery decision paused
across an abandonment and the purge. Each one is refused with ``AgentConversationPurgedError``, no model
is called and the conversation stays empty (an attached controller: ``tests/harness/test_control.py``).
Interleavings are decided by events the test opens, never by timing."""

from __future__ import annotations

import asyncio
from typing import Any

from threadline.errors import AgentConversationPurgedError
from threadline.store import purge_agent_conversation

from .conftest import Script, make_runtime, text

WAIT = 5.0


async def test_a_submit_paused_in_its_preflight_is_refused_after_the_purge(store: Any) -> None:
    script = Script()
    runtime = make_runtime(store, script)
    entered, release = asyncio.Event(), asyncio.Event()

    async def preflight(*_: Any) -> None:
        entered.set()
        await release.wait()

    runtime._preflight = preflight
    try:
        ticket = runtime.submit(
            conversation_id="target", idempotency_key="pending", context={}, parts=[{"type": "text", "text": "late"}]
        )
        await asyncio.wait_for(entered.wait(), WAIT)
        assert (await purge_agent_conversation(store, conversation_id="target")).outcome == "purged"
        release.set()
        try:
            await asyncio.wait_for(ticket.result, WAIT)
        except AgentConversationPurgedError:
            pass
        else:
            raise AssertionError("a submit admitted after the purge")
        assert script.calls == []
        assert (await store.load_snapshot(conversation_id="target")).messages == ()
    finally:
        release.set()
        await runtime.close()


async def test_a_recovery_decision_paused_across_abandon_and_purge_neither_requeues_nor_runs(store: Any) -> None:
    admitted = await store.accept_input_and_assign_run(
        conversation_id="target", idempotency_key="k", input={"id": "in-1", "parts": text("x")}, run_id="run-1"
    )
    acquired = await store.acquire_run(
        conversation_id="target", run_id="run-1", expected_revision=admitted.run.revision, owner_id="crashed"
    )
    script = Script()
    runtime = make_runtime(store, script)
    entered, release = asyncio.Event(), asyncio.Event()

    async def decide(_: Any) -> dict[str, Any]:
        entered.set()
        await release.wait()
        return {"action": "requeue", "replay_safe": True}

    try:
        recovery = asyncio.ensure_future(runtime.recover(resolve_context=lambda _: {}, policy=decide))
        await asyncio.wait_for(entered.wait(), WAIT)
        active = await purge_agent_conversation(store, conversation_id="target")
        assert (active.outcome, active.run_ids) == ("active", ("run-1",))
        abandoned = await store.recover_run(
            conversation_id="target",
            run_id="run-1",
            expected_revision=acquired.run.revision,
            action="abandon",
            stale_owner=True,
        )
        assert abandoned.outcome == "abandoned"
        assert (await purge_agent_conversation(store, conversation_id="target")).outcome == "purged"
        release.set()
        outcomes = await asyncio.wait_for(recovery, WAIT)
        assert [(o.conversation_id, o.run_id, o.outcome) for o in outcomes] == [("target", "run-1", "failed")]
        assert isinstance(outcomes[0].error, AgentConversationPurgedError)
        assert script.calls == []
        assert (await store.scan_recoverable(limit=10)).runs == ()
    finally:
        release.set()
        await runtime.close()
