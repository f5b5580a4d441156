"""Managed tools: the fence (a stale executor's result is never applied), the error envelope, lifecycle
hooks, and approvals that survive a reopened SQLite file."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from pydantic_ai.messages import ModelRequest, ModelResponse, ToolReturnPart
from pydantic_ai.models.function import DeltaToolCall

from threadline import AgentRunOwnershipConflictError, AgentToolContext, AppError, define_agent_tool
from threadline.approvals import AgentApprovalError
from threadline.store.sqlite import create_sqlite_agent_runtime_store
from threadline.tools import AgentToolLifecycle

from .conftest import Script, answer_text, make_runtime, submit

SECRET = "test-secret"


def call_then_answer(tool: str, args: str = "{}") -> Script:
    async def handler(i: int, messages: list[Any], info: Any) -> AsyncIterator[Any]:
        last = messages[-1]
        returns = [p for p in last.parts if isinstance(p, ToolReturnPart)] if isinstance(last, ModelRequest) else []
        if not returns:
            yield {0: DeltaToolCall(name=tool, json_args=args, tool_call_id=f"call-{i}")}
        else:
            yield f"the tool said: {returns[0].content}"

    return Script(handler)


def tool_returns_seen(script: Script, call: int) -> list[ToolReturnPart]:
    return [
        p for m in script.calls[call] if isinstance(m, ModelRequest) for p in m.parts if isinstance(p, ToolReturnPart)
    ]


async def test_a_fence_lost_mid_tool_stops_the_old_loop_without_applying_the_result(store: Any) -> None:
    release = asyncio.Event()
    entered = asyncio.Event()

    @define_agent_tool
    async def slow_effect() -> str:
        entered.set()
        await release.wait()
        return "effect done"

    script = call_then_answer("slow_effect")
    runtime = make_runtime(store, script, tools=[slow_effect])
    ticket = submit(runtime, "k", "go")
    run_id = (await ticket.admission).run.id
    await asyncio.wait_for(entered.wait(), 5)
    # another executor takes the run over with a higher fencing token
    loaded = await store.load_run(conversation_id="c1", run_id=run_id)
    requeued = await store.recover_run(
        conversation_id="c1", run_id=run_id, expected_revision=loaded.run.revision, action="requeue", replay_safe=True
    )
    taken = await store.acquire_run(
        conversation_id="c1", run_id=run_id, expected_revision=requeued.run.revision, owner_id="executor-b"
    )
    assert taken.run.fencing_token == 2
    release.set()
    with pytest.raises(AgentRunOwnershipConflictError):
        await asyncio.wait_for(ticket.result, 5)
    assert len(script.calls) == 1, "the stale loop never called the model again"
    current = await store.load_run(conversation_id="c1", run_id=run_id)
    assert current.run.owner_id == "executor-b" and current.run.state == "running"
    snapshot = await store.load_snapshot(conversation_id="c1")
    draft = next(m for m in snapshot.messages if m.id == current.run.assistant_message_id)
    assert not any(p.type == "tool-result" for p in draft.parts), "the stale result was not applied"
    await runtime.close()


async def test_the_step_finish_commit_is_the_fence_unless_an_application_hook_may_wait_between(store: Any) -> None:
    """The finish commit before a step's tools is a compare-and-swap on owner and fencing token: when
    nothing can run between it and the calls, it is their fence. An application ``before`` hook, or a
    callable approval rule, may wait on anything: then the fence reads the run again, once per call. After
    the tool returned, the result is accepted by the next owned commit (its compare-and-swap is the fence)
    unless application code sees it first: an application ``after`` hook gets it only after the fence
    lifecycle read the run again, a stop policy only after one read of the run per step."""
    effects: list[str] = []

    @define_agent_tool
    async def effect() -> str:
        effects.append("applied")
        return "ok"

    def fence_reads() -> int:
        stats = store.metrics.get("load_run")
        return stats.calls if stats is not None else 0

    cases: list[tuple[dict[str, Any], int]] = [
        ({}, 0),
        ({"tool_lifecycle": AgentToolLifecycle(before=lambda call: None)}, 2),
        ({"tool_approval": lambda call: False, "tool_approval_secret": SECRET}, 1),
        ({"stop_policies": [{"name": "never", "should_stop": lambda ctx: False}]}, 1),
    ]
    for n, (loop, reads) in enumerate(cases):
        runtime = make_runtime(store, call_then_answer("effect"), tools=[effect], loop=loop)
        before = fence_reads()
        result = await submit(runtime, f"k{n}", "go", conversation_id=f"c{n}").result
        assert answer_text(result) == "the tool said: ok"
        assert fence_reads() - before == reads, loop
        await runtime.close()
    assert effects == ["applied"] * len(cases)


async def test_error_envelopes_reach_the_model_and_causes_stay_local(store: Any) -> None:
    causes: list[BaseException] = []

    @define_agent_tool
    async def refuse(kind: str) -> Any:
        if kind == "app":
            raise AppError("NOT_FOUND", "no such order", details={"order": 7}, hint="list orders first")
        if kind == "crash":
            raise KeyError("secret internal detail")
        return {"error": "domain value"}  # a successful result that merely looks like an error

    for kind, outcome, expected in (
        (
            "app",
            "error",
            {
                "error": "NOT_FOUND",
                "message": "no such order",
                "retryable": False,
                "details": {"order": 7},
                "_hint": "list orders first",
                "status": 404,
            },
        ),
        ("crash", "error", {"error": "INTERNAL_SERVER_ERROR", "retryable": False}),
        ("domain", "success", {"error": "domain value"}),
    ):
        script = call_then_answer("refuse", f'{{"kind": "{kind}"}}')
        lifecycle = AgentToolLifecycle(on_error=lambda call, error: causes.append(error))
        runtime = make_runtime(store, script, tools=[refuse], loop={"tool_lifecycle": lifecycle})
        result = await submit(runtime, f"k-{kind}", "go", conversation_id=f"c-{kind}").result
        stored = next(p for p in result.assistant.parts if p.type == "tool-result")
        assert (stored.outcome, stored.output) == (outcome, expected)
        seen = tool_returns_seen(script, 1)
        assert seen[0].content == expected
        assert "secret internal detail" not in repr(script.calls)
        await runtime.close()
    assert [type(c).__name__ for c in causes] == ["AppError", "KeyError"], "local hooks see the real causes"


async def test_a_typed_failure_is_one_envelope_stored_published_and_shown_to_the_model(store: Any) -> None:
    @define_agent_tool
    async def guarded_operation() -> Any:
        raise AppError("CONFLICT", "Selection is stale", details={"revision": 7})

    events: list[Any] = []
    script = call_then_answer("guarded_operation", "{}")
    runtime = make_runtime(store, script, tools=[guarded_operation], publish=events.append)
    result = await submit(runtime, "k", "go").result
    await runtime.close()
    expected = {
        "error": "CONFLICT",
        "message": "Selection is stale",
        "retryable": False,  # a conflict repeats the same way: not a retry class
        "details": {"revision": 7},
        "status": 409,
    }
    [stored] = [p for p in result.assistant.parts if p.type == "tool-result"]
    assert (stored.tool_name, stored.outcome, stored.output) == ("guarded_operation", "error", expected)
    [failed] = [e for e in events if e.type == "tool-status" and e.status == "failed"]
    assert (failed.tool_name, failed.output, dict(failed.error)) == ("guarded_operation", expected, expected)
    assert tool_returns_seen(script, 1)[0].content == expected
    assert result.terminal_reason == "success"


async def test_an_authorization_hook_refuses_before_the_effect(store: Any) -> None:
    effects: list[str] = []

    @define_agent_tool
    async def delete_all() -> str:
        effects.append("deleted")
        return "gone"

    def authorize(call: Any) -> None:
        raise AppError("FORBIDDEN", f"{call.tool_name} is not allowed here")

    script = call_then_answer("delete_all")
    runtime = make_runtime(
        store, script, tools=[delete_all], loop={"tool_lifecycle": AgentToolLifecycle(before=authorize)}
    )
    result = await submit(runtime, "k", "go").result
    assert effects == [] and result.terminal_reason == "success"
    assert tool_returns_seen(script, 1)[0].content["error"] == "FORBIDDEN"
    await runtime.close()


def approval_runtime(store: Any, script: Script, effects: list[str], secret: str = SECRET) -> Any:
    @define_agent_tool
    async def charge(amount: int) -> str:
        effects.append(f"charged {amount}")
        return f"charged {amount}"

    return make_runtime(
        store,
        script,
        tools=[charge],
        loop={"tool_approval": {"charge"}, "tool_approval_secret": secret},
    )


async def test_an_approval_round_trip_across_a_reopened_store(tmp_path: Path) -> None:
    effects: list[str] = []
    db = tmp_path / "approvals.db"
    async with create_sqlite_agent_runtime_store(filename=db) as sqlite:
        script = call_then_answer("charge", '{"amount": 5}')
        runtime = approval_runtime(sqlite.store, script, effects)
        paused = await submit(runtime, "k", "charge me 5").result
        assert paused.terminal_reason == "provider_stop" and effects == []
        request = next(p for p in paused.assistant.parts if p.type == "approval-request")
        assert request.signature
        await runtime.close()

    async with create_sqlite_agent_runtime_store(filename=db) as sqlite:  # a new process, say
        script = call_then_answer("charge", '{"amount": 5}')
        runtime = approval_runtime(sqlite.store, script, effects)
        pending = await runtime.pending_approvals("c1")
        assert [(p.approval_id, p.tool_name, p.input) for p in pending] == [
            (request.approval_id, "charge", {"amount": 5})
        ]
        ticket = await runtime.respond_to_approval(
            conversation_id="c1", approval_id=request.approval_id, approved=True, context={"user_id": "u1"}
        )
        result = await asyncio.wait_for(ticket.result, 10)
        assert result.terminal_reason == "success" and effects == ["charged 5"]
        assert answer_text(result).endswith("the tool said: charged 5")
        # the model saw the call and its result, once, in a valid order
        request_messages = script.calls[0]
        assert (
            isinstance(request_messages[-2], ModelResponse) and tool_returns_seen(script, 0)[0].content == "charged 5"
        )
        assert await runtime.pending_approvals("c1") == []
        with pytest.raises(AgentApprovalError) as duplicate:
            await runtime.respond_to_approval(
                conversation_id="c1", approval_id=request.approval_id, approved=True, context={"user_id": "u1"}
            )
        assert duplicate.value.reason == "duplicate"
        with pytest.raises(AgentApprovalError) as unknown:
            await runtime.respond_to_approval(
                conversation_id="c1", approval_id="apr_forged", approved=True, context={"user_id": "u1"}
            )
        assert unknown.value.reason == "unknown"
        await runtime.close()


async def test_a_denied_call_is_reported_to_the_model_and_never_runs(store: Any) -> None:
    effects: list[str] = []
    script = call_then_answer("charge", '{"amount": 9}')
    runtime = approval_runtime(store, script, effects)
    paused = await submit(runtime, "k", "charge me 9").result
    approval = (await runtime.pending_approvals("c1"))[0]
    ticket = await runtime.respond_to_approval(
        conversation_id="c1", approval_id=approval.approval_id, approved=False, context={}, reason="too expensive"
    )
    result = await ticket.result
    assert effects == [] and result.terminal_reason == "success"
    denied = tool_returns_seen(script, 1)[0].content
    assert denied["error"] == "APPROVAL_DENIED" and denied["message"] == "too expensive"
    assert paused.run.id != result.run.id
    await runtime.close()


async def test_a_forged_or_mismatched_approval_fails_the_run_and_runs_nothing(store: Any) -> None:
    effects: list[str] = []
    script = call_then_answer("charge", '{"amount": 1}')
    signer = approval_runtime(store, script, effects, secret="the real secret")
    await submit(signer, "k", "charge me 1").result
    approval = (await signer.pending_approvals("c1"))[0]
    await signer.close()

    # a runtime holding another secret cannot verify the stored request: it refuses to run the tool
    forger = approval_runtime(store, script, effects, secret="a guessed secret")
    ticket = await forger.respond_to_approval(
        conversation_id="c1", approval_id=approval.approval_id, approved=True, context={}
    )
    result = await ticket.result
    assert result.terminal_reason == "runtime_failure" and effects == []
    await forger.close()
    # the rejection is in the ledger, committed with the run's terminal
    events = (await store.read_events(conversation_id="c1", limit=10_000)).items
    (rejected,) = [e for e in events if e.kind == "approval/response-rejected"]
    assert rejected.payload == {
        "run_id": result.run.id,
        "approval_id": approval.approval_id,
        "call_id": approval.call_id,
        "reason": "has no valid signed request",
    }
    assert events[rejected.seq].payload["type"] == "terminal"  # the next event: that run's terminal

    # a response naming another call than the request's, written straight into the store
    mismatch = approval_runtime(store, call_then_answer("charge", '{"amount": 2}'), effects, secret="the real secret")
    await submit(mismatch, "k2", "charge me 2").result
    second = next(p for p in await mismatch.pending_approvals("c1") if p.approval_id != approval.approval_id)
    await store.accept_input_and_assign_run(
        conversation_id="c1",
        idempotency_key="forged",
        input={
            "id": "forged-response",
            "role": "tool",
            "parts": [
                {"type": "approval-response", "approval_id": second.approval_id, "call_id": "another", "approved": True}
            ],
        },
    )
    outcomes = await mismatch.recover(resolve_context=lambda run: {})
    assert (await outcomes[-1].result).terminal_reason == "runtime_failure" and effects == []
    await mismatch.close()


async def _rejections(store: Any) -> list[dict[str, Any]]:
    events = (await store.read_events(conversation_id="c1", limit=10_000)).items
    return [e.payload for e in events if e.kind == "approval/response-rejected"]


async def test_a_response_to_an_approval_already_answered_fails_the_run_and_runs_nothing_again(store: Any) -> None:
    effects: list[str] = []
    runtime = approval_runtime(store, call_then_answer("charge", '{"amount": 3}'), effects)
    await submit(runtime, "k", "charge me 3").result
    approval = (await runtime.pending_approvals("c1"))[0]
    ticket = await runtime.respond_to_approval(
        conversation_id="c1", approval_id=approval.approval_id, approved=True, context={}
    )
    assert (await ticket.result).terminal_reason == "success" and effects == ["charged 3"]

    # a second response to the same approval, written straight into the store
    response = {"type": "approval-response", "approval_id": approval.approval_id, "call_id": approval.call_id}
    await store.accept_input_and_assign_run(
        conversation_id="c1",
        idempotency_key="again",
        input={"id": "again", "role": "tool", "parts": [{**response, "approved": True}]},
    )
    outcomes = await runtime.recover(resolve_context=lambda run: {})
    result = await outcomes[-1].result
    assert result.terminal_reason == "runtime_failure" and effects == ["charged 3"]
    assert (await _rejections(store))[-1] == {
        "run_id": result.run.id,
        "approval_id": approval.approval_id,
        "call_id": approval.call_id,
        "reason": "was already answered",
    }
    await runtime.close()


async def test_two_responses_to_one_approval_in_one_run_run_nothing(store: Any) -> None:
    effects: list[str] = []
    runtime = approval_runtime(store, call_then_answer("charge", '{"amount": 4}'), effects)
    await submit(runtime, "k", "charge me 4").result
    approval = (await runtime.pending_approvals("c1"))[0]
    response = {"type": "approval-response", "approval_id": approval.approval_id, "call_id": approval.call_id}
    await store.accept_input_and_assign_run(
        conversation_id="c1",
        idempotency_key="twice",
        input={
            "id": "twice",
            "role": "tool",
            "parts": [{**response, "approved": True}, {**response, "approved": True}],
        },
    )
    outcomes = await runtime.recover(resolve_context=lambda run: {})
    result = await outcomes[-1].result
    # every response is checked before any runs: the valid first one does not run either
    assert result.terminal_reason == "runtime_failure" and effects == []
    assert (await _rejections(store))[-1]["reason"] == "was already answered"
    await runtime.close()


async def test_a_tool_with_its_own_context_schema(store: Any) -> None:
    from pydantic import BaseModel

    class Tenant(BaseModel):
        user_id: str

    seen: list[Any] = []

    async def whoami(ctx: AgentToolContext) -> str:
        seen.append(ctx.context)
        return ctx.context.user_id

    tool = define_agent_tool(whoami, context_schema=Tenant)
    script = call_then_answer("whoami")
    runtime = make_runtime(store, script, tools=[tool])
    result = await submit(runtime, "k", "who am I?").result
    assert result.terminal_reason == "success" and isinstance(seen[0], Tenant) and seen[0].user_id == "u1"
    assert tool_returns_seen(script, 1)[0].content == "u1"
    await runtime.close()
