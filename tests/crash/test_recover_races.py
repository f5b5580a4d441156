"""Restart races: client retries arriving while ``recover()`` is still working through the crashed state.

After a crash, clients retry with their idempotency keys as soon as the service is back. A retry of an
admitted-but-unanswered input is a duplicate whose run is queued: ``submit`` hands the lane the run's
context, so the lane may answer it on its own, in parallel with the recovery pass.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from threadline import create_sqlite_agent_runtime_store

from ._scenario import CONTEXT, INPUTS, Hooks, build_runtime, submit

STEP_TIMEOUT = 3.0


class HoldConversation(Hooks):
    """Holds every model call of one conversation until ``release`` is set."""

    def __init__(self, conversation_id: str) -> None:
        self.conversation_id = conversation_id
        self.release = asyncio.Event()

    async def model_call(self, conversation_id: str, keys: list[str]) -> int:
        if conversation_id == self.conversation_id:
            await self.release.wait()
        return 0


async def test_recover_returns_when_a_retry_already_answered_a_run_it_scanned(tmp_path: Path) -> None:
    """The process died right after admitting k0 and k1 (c1) and k2 (c2); nothing ran. On restart,
    ``recover()`` scans all three runs as queued, then works through c1 (it waits for each run's
    acquisition; k1's run is acquired only once k0's has ended). Meanwhile the client retries k2: a
    duplicate, whose queued run c2's lane executes at once with the retry's context. When ``recover()``
    finally reaches k2's run, its scan still says ``queued``: it must not wait for an acquisition that
    already happened and ended."""
    handle = create_sqlite_agent_runtime_store(tmp_path / "threadline.db")
    try:
        # the durable state the crash left: three admitted inputs, three queued runs, nothing acquired
        for key in ("k0", "k1", "k2"):
            item = INPUTS[key]
            await handle.store.accept_input_and_assign_run(
                conversation_id=item.conversation_id,
                idempotency_key=key,
                input={"id": f"msg-{key}", "role": "user", "parts": [{"type": "text", "text": item.text}]},
            )
        hooks = HoldConversation("c1")
        runtime = build_runtime(handle.store, hooks, str(tmp_path / "effects.log"), owner_id="restarted")
        recovering = asyncio.ensure_future(runtime.recover(resolve_context=lambda _run: CONTEXT))
        retry = submit(runtime, "k2")
        assert (await asyncio.wait_for(retry.admission, STEP_TIMEOUT)).outcome == "duplicate"
        answered = await asyncio.wait_for(retry.result, STEP_TIMEOUT)
        assert answered.terminal_reason == "success"
        hooks.release.set()
        done, _ = await asyncio.wait({recovering}, timeout=STEP_TIMEOUT)
        if not done:
            recovering.cancel()
            pytest.fail(
                "recover() never returned: it reached k2's run with its stale scan ('queued'), registered an "
                "acquisition waiter and woke c2's lane, which found nothing to run, so nobody settles the waiter"
            )
        outcomes = recovering.result()
        snapshots = [await handle.store.load_snapshot(conversation_id=cid) for cid in ("c1", "c2")]
        assert sorted(o.run_id for o in outcomes) == sorted(r.id for s in snapshots for r in s.runs)
        for outcome in outcomes:
            assert outcome.outcome not in ("failed", "blocked"), (outcome, outcome.error)
            if outcome.result is not None:
                result = await asyncio.wait_for(outcome.result, STEP_TIMEOUT)
                assert result.terminal_reason == "success"
        assert (await handle.store.scan_recoverable()).runs == ()
        await runtime.close(force_timeout=STEP_TIMEOUT)
    finally:
        await handle.close()
