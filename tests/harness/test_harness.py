"""The headless harness (issue 21 item 1): resources enter the prompt bounded and checked before any provider
request, each run resolves its own model, one ``profile-applied`` observation per run carries no text, and
observers never change a run. Submit, interrupt, snapshot, approvals and a bounded close go to the runtime."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from threadline import AgentApprovalError, define_agent_tool
from threadline.harness import (
    AgentHarnessDiagnostics,
    AgentHarnessProfileEvent,
    AgentHarnessResourceError,
    AgentHarnessResourceResult,
    create_headless_agent_harness,
)

from .conftest import SECRET, WAIT, Context, Scripted, answer_text, make_harness, submit, text

SECRET_TEXT = "the launch code is 0000"


def resources(*items: dict[str, Any], diagnostics: tuple[dict[str, Any], ...] = ()) -> Any:
    return lambda request: {"resources": list(items), "diagnostics": list(diagnostics)}


INSTRUCTION = {"kind": "instruction", "name": "house-rules", "text": "Answer briefly.", "provenance": "app:rules.md"}
SKILL = {"kind": "skill", "name": "pdf", "text": "Available skill: pdf.", "provenance": "skills:pdf/SKILL.md"}


@define_agent_tool
async def zeta() -> str:
    """Last in the alphabet."""
    return "z"


@define_agent_tool
async def alpha() -> str:
    """First in the alphabet."""
    return "a"


async def test_resources_enter_the_prompt_and_the_profile_names_them_without_text(scripted: Scripted) -> None:
    profiles: list[AgentHarnessProfileEvent] = []
    secret = {"kind": "resource", "name": "notes", "text": SECRET_TEXT, "provenance": "app:notes.txt"}
    harness = make_harness(
        scripted, resources=resources(INSTRUCTION, SKILL, secret), tools=[zeta, alpha], on_profile=profiles.append
    )
    result = await asyncio.wait_for(submit(harness, "k1", "hello").result, WAIT)

    assert result.terminal_reason == "success"
    instructions = scripted.infos[0].instructions or ""
    assert 'kind="instruction" name="house-rules" provenance="app:rules.md"' in instructions
    assert "Answer briefly." in instructions and SECRET_TEXT in instructions
    [profile] = profiles
    assert profile.type == "profile-applied" and profile.run_id == result.run.id
    assert [(r.kind, r.name, r.provenance) for r in profile.resources] == [
        ("instruction", "house-rules", "app:rules.md"),
        ("skill", "pdf", "skills:pdf/SKILL.md"),
        ("resource", "notes", "app:notes.txt"),
    ]
    assert profile.tool_names == ("alpha", "zeta")
    assert (profile.model.name, profile.model.model_name, profile.model.context_window) == ("m", "scripted", 100_000)
    encoded = profile.model_dump_json()
    assert SECRET_TEXT not in encoded and "Answer briefly" not in encoded and "hello" not in encoded
    await harness.close()


async def test_resource_names_that_escape_the_element_are_escaped(scripted: Scripted) -> None:
    tricky = {"kind": "instruction", "name": 'x" evil="1', "text": "t", "provenance": "a:<b>"}
    harness = make_harness(scripted, resources=resources(tricky))
    await asyncio.wait_for(submit(harness, "k1", "hello").result, WAIT)
    assert 'name="x&quot; evil=&quot;1" provenance="a:&lt;b&gt;"' in (scripted.infos[0].instructions or "")
    await harness.close()


@pytest.mark.parametrize(
    ("loaded", "limits", "field"),
    [
        ({"resources": [INSTRUCTION, {**SKILL, "name": "house-rules"}]}, None, "resources"),
        ({"resources": [INSTRUCTION, SKILL]}, {"max_resources": 1}, "max_resources"),
        ({"resources": [{**INSTRUCTION, "text": "é" * 6}]}, {"max_resource_bytes": 11}, "max_resource_bytes"),
        (
            {"resources": [], "diagnostics": [{"resource": "x", "severity": "warning", "message": "m"}] * 2},
            {"max_diagnostics": 1},
            "max_diagnostics",
        ),
        ({"resources": [{"kind": "secret", "name": "n", "text": "t", "provenance": "p"}]}, None, "resources"),
        ({"resources": [INSTRUCTION], "extra": 1}, None, "resources"),
    ],
    ids=["duplicate-name", "too-many", "too-many-bytes", "too-many-diagnostics", "bad-kind", "unknown-key"],
)
async def test_invalid_resources_fail_the_run_before_any_provider_request(
    scripted: Scripted, loaded: dict[str, Any], limits: dict[str, int] | None, field: str
) -> None:
    failures: list[Any] = []
    harness = make_harness(
        scripted,
        resources=lambda request: loaded,
        limits=limits,
        operator_publish=failures.append,
        include_internal_cause=True,
    )
    result = await asyncio.wait_for(submit(harness, "k1", "hello").result, WAIT)
    assert result.terminal_reason == "runtime_failure"
    assert scripted.calls == [], "no provider request was made"
    [terminal] = [e for e in failures if e.type == "run-terminal"]
    assert terminal.cause["type"].endswith("AgentHarnessResourceError")
    await harness.close()


def test_limits_are_checked_when_the_harness_is_built(scripted: Scripted) -> None:
    with pytest.raises(AgentHarnessResourceError) as caught:
        make_harness(scripted, limits={"max_resources": 0})
    assert caught.value.field == "limits"


async def test_exactly_at_the_byte_limit_is_accepted(scripted: Scripted) -> None:
    harness = make_harness(
        scripted, resources=resources({**INSTRUCTION, "text": "é" * 6}), limits={"max_resource_bytes": 12}
    )
    assert (await asyncio.wait_for(submit(harness, "k1", "hi").result, WAIT)).terminal_reason == "success"
    await harness.close()


async def test_a_failing_loader_fails_the_run_before_any_provider_request(scripted: Scripted) -> None:
    def broken(request: Any) -> Any:
        raise OSError("disk gone")

    harness = make_harness(scripted, resources=broken)
    result = await asyncio.wait_for(submit(harness, "k1", "hello").result, WAIT)
    assert result.terminal_reason == "runtime_failure" and scripted.calls == []
    await harness.close()


async def test_failing_observers_never_change_the_run(scripted: Scripted) -> None:
    seen: list[tuple[str, Any]] = []

    def bad_profile(event: AgentHarnessProfileEvent) -> None:
        raise RuntimeError("observer down")

    async def bad_diagnostics(report: AgentHarnessDiagnostics) -> None:
        seen.append(("diagnostics", report.diagnostics))
        raise RuntimeError("observer down")

    def bad_profile_error(event: AgentHarnessProfileEvent, error: BaseException) -> None:
        seen.append(("profile-error", type(error).__name__))
        raise RuntimeError("this one fails too")

    diagnostic = {"resource": "notes", "severity": "warning", "message": "stale"}
    harness = make_harness(
        scripted,
        resources=resources(INSTRUCTION, diagnostics=(diagnostic,)),
        on_profile=bad_profile,
        on_profile_error=bad_profile_error,
        on_diagnostics=bad_diagnostics,
    )
    result = await asyncio.wait_for(submit(harness, "k1", "hello").result, WAIT)
    assert result.terminal_reason == "success" and answer_text(result) == "answer to: hello"
    assert seen[0][0] == "diagnostics" and seen[0][1][0].message == "stale"
    assert seen[1] == ("profile-error", "RuntimeError")
    await harness.close()


async def test_each_run_resolves_its_own_model() -> None:
    fast, deep = Scripted("fast-model"), Scripted("deep-model")
    profiles: list[AgentHarnessProfileEvent] = []
    from threadline import create_memory_agent_runtime_store, define_agent_protocol, define_model_registry

    registry = define_model_registry(
        models={
            "fast": {"model": fast.model, "context_window": 8_000},
            "deep": {"model": deep.model, "context_window": 200_000, "capabilities": ["reasoning"]},
        }
    )

    def resolve(ctx: Any) -> Any:
        return registry.resolve("deep" if ctx.context.user_id == "researcher" else "fast")

    harness = create_headless_agent_harness(
        protocol=define_agent_protocol(context=Context),
        store=create_memory_agent_runtime_store(),
        models={"resolve": resolve},
        on_profile=profiles.append,
    )
    one = harness.submit(conversation_id="a", idempotency_key="1", context={"user_id": "u1"}, parts=text("x"))
    two = harness.submit(conversation_id="b", idempotency_key="1", context={"user_id": "researcher"}, parts=text("y"))
    await asyncio.wait_for(asyncio.gather(one.result, two.result), WAIT)
    assert (len(fast.calls), len(deep.calls)) == (1, 1)
    models = {p.conversation_id: p.model for p in profiles}
    assert (models["a"].name, models["a"].context_window) == ("fast", 8_000)
    assert (models["b"].name, models["b"].capabilities) == ("deep", ("reasoning",))
    await harness.close()


async def test_a_prompt_budget_the_resources_cannot_fit_ends_the_run_context_overflow(scripted: Scripted) -> None:
    big = {**INSTRUCTION, "text": "word " * 1000}  # about 1,250 estimated tokens
    harness = make_harness(
        scripted, resources=resources(big), prompt_budget=lambda request: {"reserved_output": 99_000}
    )
    result = await asyncio.wait_for(submit(harness, "k1", "hello").result, WAIT)
    assert result.terminal_reason == "context_overflow" and scripted.calls == []

    fits = make_harness(Scripted(), resources=resources(big), prompt_budget=lambda request: {"reserved_output": 1000})
    assert (await asyncio.wait_for(submit(fits, "k1", "hello").result, WAIT)).terminal_reason == "success"
    await harness.close()
    await fits.close()


async def test_loader_tools_are_offered_and_duplicate_tool_names_fail_the_run(scripted: Scripted) -> None:
    class Loader:
        tools = (alpha,)

        def load(self, request: Any) -> AgentHarnessResourceResult:
            return AgentHarnessResourceResult()

    profiles: list[AgentHarnessProfileEvent] = []
    harness = make_harness(scripted, resources=Loader(), tools=[zeta], on_profile=profiles.append)
    await asyncio.wait_for(submit(harness, "k1", "hello").result, WAIT)
    assert sorted(t.name for t in scripted.infos[0].function_tools) == ["alpha", "zeta"]
    assert profiles[0].tool_names == ("alpha", "zeta")

    clash = make_harness(Scripted(), resources=Loader(), tools=[alpha])
    assert (await asyncio.wait_for(submit(clash, "k1", "hello").result, WAIT)).terminal_reason == "runtime_failure"
    await harness.close()
    await clash.close()


async def test_subscribers_receive_delivery_events_until_they_unsubscribe(scripted: Scripted) -> None:
    published: list[Any] = []
    harness = make_harness(scripted, publish=published.append)
    seen: list[Any] = []
    only_other: list[Any] = []
    unsubscribe = harness.subscribe(seen.append)
    harness.subscribe(only_other.append, conversation_id="elsewhere")
    result = await asyncio.wait_for(submit(harness, "k1", "hello there").result, WAIT)
    types = [e.type for e in seen]
    assert types[0] == "admission" and types[-1] == "terminal" and "assistant-delta" in types
    assert [e.type for e in published] == types, "the application's publish sees the same events"
    assert only_other == []
    unsubscribe()
    await asyncio.wait_for(submit(harness, "k2", "again").result, WAIT)
    assert seen[-1].run_id == result.run.id, "nothing arrives after unsubscribing"
    await harness.close()


async def test_snapshot_interrupt_and_approvals_go_through_the_harness() -> None:
    effects: list[int] = []

    @define_agent_tool
    async def charge(amount: int) -> str:
        effects.append(amount)
        return f"charged {amount}"

    scripted = Scripted(tool="charge", tool_args='{"amount": 5}')
    harness = make_harness(scripted, tools=[charge], loop={"tool_approval": ["charge"], "tool_approval_secret": SECRET})
    paused = await asyncio.wait_for(submit(harness, "k1", "charge me").result, WAIT)
    assert paused.terminal_reason == "provider_stop" and effects == []
    [pending] = await harness.pending_approvals("c1")
    assert pending.tool_name == "charge" and pending.signature, "the pending approval carries its signed request"
    [request] = [p for m in (await harness.snapshot("c1")).messages for p in m.parts if p.type == "approval-request"]
    assert request.signature == pending.signature
    ticket = await harness.respond_to_approval(
        conversation_id="c1", approval_id=pending.approval_id, approved=True, context={"user_id": "u1"}
    )
    done = await asyncio.wait_for(ticket.result, WAIT)
    assert effects == [5] and answer_text(done) == "the tool said: charged 5"
    assert await harness.pending_approvals("c1") == []
    with pytest.raises(AgentApprovalError, match="already answered"):
        await harness.respond_to_approval(
            conversation_id="c1", approval_id=pending.approval_id, approved=True, context={"user_id": "u1"}
        )
    snapshot = await harness.snapshot("c1")
    assert [r.terminal_reason for r in snapshot.runs] == ["provider_stop", "success"]
    assert snapshot.messages[-1].id == done.assistant.id

    gated = Scripted()
    gated.gate(0)
    other = make_harness(gated)
    running = submit(other, "k1", "long answer please")
    await gated.wait_entered(0)
    admission = await running.admission
    interrupted = await other.interrupt(conversation_id="c1", run_id=admission.run_id)
    assert interrupted.outcome == "requested"
    assert (await asyncio.wait_for(running.result, WAIT)).terminal_reason == "interrupted"
    await harness.close()
    await other.close()


async def test_close_is_bounded_and_keeps_subscribers(scripted: Scripted) -> None:
    scripted.gate(0)  # the run never finishes on its own
    harness = make_harness(scripted)
    seen: list[Any] = []
    harness.subscribe(seen.append)
    ticket = submit(harness, "k1", "hello")
    await scripted.wait_entered(0)
    closed = await asyncio.wait_for(harness.close(grace_period=0, force_timeout=WAIT), WAIT)
    assert closed.settled and harness.closing
    assert (await asyncio.wait_for(ticket.result, WAIT)).terminal_reason == "shutdown"
    assert seen[-1].type == "terminal"
    assert json.loads(seen[-1].model_dump_json())["terminal_reason"] == "shutdown"
