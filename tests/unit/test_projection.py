"""History projection (``threadline.history.projection``): canonical records to pydantic-ai messages.

Pins: each projection rule on a tiny handmade history (users, files, tool/system/summary roles, the
multi-step split of one assistant record, input joined at a step boundary, reasoning per provider,
parts never sent, every assistant status, tool chronology repair, leading and adjacent assistants);
the seed examples; and a property test that random histories always project to provider-valid
messages — checked both on pydantic-ai's messages and on the OpenAI Chat wire format produced by
pydantic-ai's own adapter — with no superseded text anywhere.
"""

from __future__ import annotations

import asyncio
import base64
import importlib.util
from datetime import UTC, datetime
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st
from pydantic_ai.messages import (
    ImageUrl,
    ModelMessage,
    ModelMessagesTypeAdapter,
    ModelRequest,
    ModelResponse,
    TextPart as AiTextPart,
    ThinkingPart,
    ToolCallPart as AiToolCallPart,
    ToolReturnPart,
    UserPromptPart,
)
from pydantic_ai.models import ModelRequestParameters
from pydantic_ai.models.openai import OpenAIChatModel, OpenAIResponsesModel
from pydantic_ai.providers.openai import OpenAIProvider

from threadline.errors import AgentRecordValidationError, ThreadlineError
from threadline.history import (
    FAILED_MARKER,
    INTERRUPTED_MARKER,
    AgentHistoryProjectionError,
    AgentHistoryProjectionOptions,
    project_agent_history,
    project_agent_history_detailed,
)
from threadline.records import (
    ApprovalRequestPart,
    ControlPart,
    FilePart,
    InputJoinedPart,
    Message,
    ProviderEnvelope,
    ProviderPart,
    ReasoningPart,
    SourcePart,
    TextPart,
    ToolCallPart,
    ToolResultPart,
)

NOW = datetime(2026, 1, 1, tzinfo=UTC)
_seq = iter(range(10**9))


def msg(id: str, role: str, *parts: Any, status: str | None = None, **kw: Any) -> Message:
    default = "completed" if role == "assistant" else "committed"
    return Message(
        id=id,
        conversation_id="conv",
        role=role,
        status=status or default,
        parts=parts,
        created_at=NOW,
        seq=next(_seq),
        **kw,
    )


def user(id: str, text: str = "hello", **kw: Any) -> Message:
    return msg(id, "user", TextPart(text=text), **kw)


def call(call_id: str, tool: str = "lookup", **kw: Any) -> ToolCallPart:
    return ToolCallPart(call_id=call_id, tool_name=tool, **kw)


def result(call_id: str, output: Any = "ok", tool: str = "lookup", **kw: Any) -> ToolResultPart:
    return ToolResultPart(call_id=call_id, tool_name=tool, output=output, **kw)


def decision(projection: Any, message_id: str) -> Any:
    return next(d for d in projection.decisions if d.message_id == message_id)


# ------------------------------------------------------------------------------------------- users


def test_user_text_parts_join_into_one_string() -> None:
    out = project_agent_history([msg("u1", "user", TextPart(text="a"), TextPart(text="b"))])
    assert len(out) == 1 and isinstance(out[0], ModelRequest)
    assert [p.content for p in out[0].parts] == ["a\nb"]


def test_consecutive_users_merge_into_one_request() -> None:
    out = project_agent_history([user("u1", "one"), user("u2", "two")])
    assert len(out) == 1
    assert [(type(p), p.content) for p in out[0].parts] == [(UserPromptPart, "one"), (UserPromptPart, "two")]


FILE = FilePart(reference="s3://bucket/secret-key", media_type="image/png", filename="cat.png")


def test_file_resolved_by_resolve_file() -> None:
    image = ImageUrl(url="https://example.test/cat.png")
    out = project_agent_history([msg("u1", "user", TextPart(text="look"), FILE)], {"resolve_file": lambda f: image})
    assert out[0].parts[0].content == ["look", image]


def test_unresolved_file_omit_text_and_error() -> None:
    history = [msg("u1", "user", TextPart(text="look"), FILE)]
    omitted = project_agent_history_detailed(history)
    assert omitted.messages[0].parts[0].content == "look"
    assert decision(omitted, "u1").omitted_parts == ["file"]

    text = project_agent_history(history, {"unresolved_file": "text"})
    assert text[0].parts[0].content == "look\n[attachment: cat.png]"
    no_name = FilePart(reference="ref-1", media_type="application/pdf")
    text = project_agent_history([msg("u1", "user", no_name)], {"unresolved_file": "text"})
    assert text[0].parts[0].content == "[attachment: application/pdf]"
    assert "secret-key" not in ModelMessagesTypeAdapter.dump_json(text).decode()

    with pytest.raises(AgentHistoryProjectionError, match="s3://bucket/secret-key"):
        project_agent_history(history, {"unresolved_file": "error"})
    assert issubclass(AgentHistoryProjectionError, ThreadlineError)


def test_resolver_returning_none_counts_as_unresolved() -> None:
    out = project_agent_history([msg("u1", "user", FILE)], {"resolve_file": lambda f: None, "unresolved_file": "text"})
    assert out[0].parts[0].content == "[attachment: cat.png]"


# ---------------------------------------------------------------------------------- other roles


def test_tool_messages_are_omitted_for_now() -> None:
    approval = msg("t1", "tool", TextPart(text="approved"))
    p = project_agent_history_detailed([user("u1"), approval])
    assert len(p.messages) == 1
    assert decision(p, "t1").action == "omitted" and decision(p, "t1").reason == "tool-message"


def test_system_and_summary_go_to_the_system_channel_in_order() -> None:
    history = [
        msg("s1", "summary", TextPart(text="earlier: they met")),
        user("u1", "hi"),
        msg("s2", "system", TextPart(text="be brief")),
    ]
    p = project_agent_history_detailed(history)
    assert p.system == ["earlier: they met", "be brief"]
    assert len(p.messages) == 1 and p.messages[0].parts[0].content == "hi"
    assert {(d.message_id, d.reason) for d in p.decisions if d.action == "projected"} >= {
        ("s1", "system-channel"),
        ("s2", "system-channel"),
    }


def test_compacted_messages_are_skipped() -> None:
    old = user("u0", "old secret", active=False, compacted_by="s1")
    p = project_agent_history_detailed([old, msg("s1", "summary", TextPart(text="sum")), user("u1")])
    assert decision(p, "u0").reason == "compacted" and decision(p, "u0").action == "omitted"
    assert "old secret" not in ModelMessagesTypeAdapter.dump_json(p.messages).decode()
    assert [d.message_id for d in p.decisions] == ["u0", "s1", "u1"]


# ----------------------------------------------------------------------------------- assistants


def test_multi_step_run_splits_into_rounds() -> None:
    a = msg(
        "a1",
        "assistant",
        TextPart(text="checking"),
        call("c1"),
        call("c2"),
        result("c1", 1),
        result("c2", "boom", outcome="error"),
        TextPart(text="again"),
        call("c3"),
        result("c3", 3),
        TextPart(text="done"),
    )
    out = project_agent_history([user("u1"), a])
    kinds = [m.kind for m in out]
    assert kinds == ["request", "response", "request", "response", "request", "response"]
    assert [type(p) for p in out[1].parts] == [AiTextPart, AiToolCallPart, AiToolCallPart]
    returns = out[2].parts
    assert [(r.tool_call_id, r.outcome) for r in returns] == [("c1", "success"), ("c2", "failed")]
    assert [p.tool_call_id for p in out[3].parts if isinstance(p, AiToolCallPart)] == ["c3"]
    assert out[5].parts == [AiTextPart("done")]


def test_input_joined_user_is_placed_after_the_boundary_returns() -> None:
    history = [
        user("u1", "first"),
        user("u2", "by the way", run_id="r2"),
        msg(
            "a1",
            "assistant",
            call("c1"),
            result("c1"),
            InputJoinedPart(run_id="r2", message_ids=("u2", "missing"), step=1),
            TextPart(text="noted"),
        ),
    ]
    p = project_agent_history_detailed(history)
    out = p.messages
    assert [m.kind for m in out] == ["request", "response", "request", "response"]
    assert [p.content for p in out[0].parts] == ["first"]
    assert [type(x) for x in out[2].parts] == [ToolReturnPart, UserPromptPart]
    assert out[2].parts[1].content == "by the way"
    assert decision(p, "u2").action == "projected"
    assert [d.message_id for d in p.decisions] == ["u1", "u2", "a1"]


def test_input_joined_marker_of_an_interrupted_run_is_ignored() -> None:
    history = [
        user("u1"),
        msg(
            "a1",
            "assistant",
            TextPart(text="hm"),
            InputJoinedPart(run_id="r2", message_ids=("u2",), step=0),
            status="interrupted",
        ),
        user("u2", "queued"),
    ]
    out = project_agent_history(history)
    assert [m.kind for m in out] == ["request", "response", "request"]
    assert out[2].parts[0].content == "queued"


def test_reasoning_only_for_its_own_provider() -> None:
    reasoning = ReasoningPart(text="thinking", envelope=ProviderEnvelope(provider="openai", data={"signature": "s"}))
    history = [user("u1"), msg("a1", "assistant", reasoning, TextPart(text="answer"))]
    same = project_agent_history(history, {"provider_name": "openai"})
    assert isinstance(same[1].parts[0], ThinkingPart) and same[1].parts[0].signature == "s"
    other = project_agent_history_detailed(history, {"provider_name": "anthropic"})
    assert other.messages[1].parts == [AiTextPart("answer")]
    assert decision(other, "a1").omitted_parts == ["reasoning"]


def test_parts_never_sent_are_listed_except_control() -> None:
    history = [
        user("u1"),
        msg(
            "a1",
            "assistant",
            TextPart(text="x"),
            SourcePart(source_id="s"),
            ProviderPart(envelope=ProviderEnvelope(provider="openai")),
            ApprovalRequestPart(approval_id="ap", call_id="c9", tool_name="t"),
            ControlPart(),
        ),
    ]
    p = project_agent_history_detailed(history)
    assert p.messages[1].parts == [AiTextPart("x")]
    assert decision(p, "a1").omitted_parts == ["source", "provider", "approval-request"]


def test_seed_interrupted_assistant_is_marked() -> None:
    history = [
        user("u1"),
        msg("a1", "assistant", TextPart(text="We are the team, where would you like"), status="interrupted"),
    ]
    out = project_agent_history(history)
    assert isinstance(out[1], ModelResponse)
    assert out[1].parts == [
        AiTextPart("We are the team, where would you like"),
        AiTextPart("[interrupted: this turn was cut off before it finished]"),
    ]
    assert INTERRUPTED_MARKER == "[interrupted: this turn was cut off before it finished]"


def test_an_interrupted_turn_marked_is_projected_like_any_other_with_or_without_its_control_part() -> None:
    for extra in ((), (ControlPart(),)):
        cut = msg("a1", "assistant", TextPart(text="We are the team"), *extra, status="interrupted")
        p = project_agent_history_detailed([user("u1"), cut, user("u2", "somewhere else")])
        d = decision(p, "a1")
        assert (d.action, d.reason, d.omitted_parts) == ("projected", "projected", [])
        assert p.messages[1].parts[-1] == AiTextPart(INTERRUPTED_MARKER)


def test_interrupted_system_note_and_omit() -> None:
    history = [user("u1"), msg("a1", "assistant", TextPart(text="partial"), status="interrupted")]
    note = project_agent_history_detailed(history, {"interrupted_assistant": "system-note"})
    assert [m.kind for m in note.messages] == ["request"]
    assert note.system == ["[interrupted] partial response: partial"]
    omit = project_agent_history_detailed(history, {"interrupted_assistant": "omit"})
    assert [m.kind for m in omit.messages] == ["request"] and omit.system == []
    assert (decision(omit, "a1").action, decision(omit, "a1").reason) == ("omitted", "interrupted")


def test_interrupted_dangling_calls_are_dropped_even_in_error_mode() -> None:
    a = msg("a1", "assistant", TextPart(text="let me"), call("c1"), status="interrupted")
    out = project_agent_history([user("u1"), a], {"incomplete_tool_turn": "error"})
    assert out[1].parts == [AiTextPart("let me"), AiTextPart(INTERRUPTED_MARKER)]


def test_interrupted_after_a_tool_round_gets_the_marker_in_a_final_response() -> None:
    a = msg("a1", "assistant", call("c1"), result("c1"), status="interrupted")
    out = project_agent_history([user("u1"), a])
    assert [m.kind for m in out] == ["request", "response", "request", "response"]
    assert out[3].parts == [AiTextPart(INTERRUPTED_MARKER)]


def test_seed_superseded_and_source_provider_decisions() -> None:
    history = [
        user("u1", "hi"),
        msg("assistant-1", "assistant", TextPart(text="SUPERSEDED draft"), status="superseded"),
        msg(
            "assistant-2",
            "assistant",
            TextPart(text="Hello!"),
            SourcePart(source_id="doc-1", url="https://example.test"),
            ProviderPart(envelope=ProviderEnvelope(provider="openai", data={"id": "x"})),
        ),
    ]
    p = project_agent_history_detailed(history)
    d2, d1 = decision(p, "assistant-2"), decision(p, "assistant-1")
    assert (d2.message_id, d2.action, d2.reason, d2.omitted_parts) == (
        "assistant-2",
        "projected",
        "projected",
        ["source", "provider"],
    )
    assert (d1.message_id, d1.action, d1.reason) == ("assistant-1", "omitted", "superseded")
    assert "SUPERSEDED" not in ModelMessagesTypeAdapter.dump_json(p.messages).decode()
    assert [m.kind for m in p.messages] == ["request", "response"]


def test_failed_assistant_omitted_or_marked() -> None:
    history = [user("u1"), msg("a1", "assistant", TextPart(text="half"), status="failed")]
    omitted = project_agent_history_detailed(history)
    assert len(omitted.messages) == 1 and decision(omitted, "a1").reason == "failed"
    marked = project_agent_history(history, {"evidence_policy": {"failed_assistant": "assistant-marked"}})
    assert marked[1].parts == [AiTextPart("half"), AiTextPart(FAILED_MARKER)]
    assert FAILED_MARKER == "[failed: partial evidence from a run that did not complete successfully]"
    empty = [user("u1"), msg("a1", "assistant", status="failed")]
    marked = project_agent_history(empty, {"evidence_policy": {"failed_assistant": "assistant-marked"}})
    assert marked[1].parts == [AiTextPart(FAILED_MARKER)]


def test_streaming_draft_is_a_crash_draft() -> None:
    p = project_agent_history_detailed([user("u1"), msg("a1", "assistant", TextPart(text="x"), status="streaming")])
    assert len(p.messages) == 1 and decision(p, "a1").reason == "crash-draft"


def test_unmatched_call_dropped_or_raised() -> None:
    history = [user("u1"), msg("a1", "assistant", TextPart(text="keep me"), call("c1"))]
    p = project_agent_history_detailed(history)
    assert p.messages[1].parts == [AiTextPart("keep me")]
    d = decision(p, "a1")
    assert (d.action, d.reason) == ("projected", "unmatched-tool-chronology") and "c1" in (d.detail or "")
    with pytest.raises(AgentHistoryProjectionError):
        project_agent_history(history, {"incomplete_tool_turn": "error"})


def test_orphan_result_and_duplicate_call_id() -> None:
    orphan = [user("u1"), msg("a1", "assistant", TextPart(text="x"), result("nope"))]
    p = project_agent_history_detailed(orphan)
    assert p.messages[1].parts == [AiTextPart("x")] and len(p.messages) == 2
    assert decision(p, "a1").reason == "unmatched-tool-chronology"
    with pytest.raises(AgentHistoryProjectionError):
        project_agent_history(orphan, {"incomplete_tool_turn": "error"})

    dup = [
        user("u1"),
        msg("a1", "assistant", call("c1"), result("c1"), TextPart(text="a")),
        user("u2"),
        msg("a2", "assistant", call("c1"), result("c1"), TextPart(text="b")),
    ]
    p = project_agent_history_detailed(dup)
    ids = [x.tool_call_id for m in p.messages for x in m.parts if isinstance(x, AiToolCallPart)]
    assert ids == ["c1"]
    assert decision(p, "a2").reason == "unmatched-tool-chronology"
    assert_provider_valid(p.messages)
    with pytest.raises(AgentHistoryProjectionError):
        project_agent_history(dup, {"incomplete_tool_turn": "error"})


def test_a_turn_holding_only_an_unpairable_result_is_an_incomplete_tool_turn() -> None:
    history = [user("u1"), msg("a1", "assistant", result("absent"))]
    p = project_agent_history_detailed(history)
    d = decision(p, "a1")
    assert (d.action, d.reason, d.omitted_parts) == ("omitted", "incomplete-tool-turn", ["tool-result"])
    assert [m.kind for m in p.messages] == ["request"]
    with pytest.raises(AgentHistoryProjectionError, match="incomplete tool chronology"):
        project_agent_history(history, {"incomplete_tool_turn": "error"})


def test_a_result_naming_another_tool_is_unmatched_chronology() -> None:
    answer = msg("a1", "assistant", call("c1", "lookup"), result("c1", tool="delete"), TextPart(text="x"))
    history = [user("u1"), answer]
    p = project_agent_history_detailed(history)
    assert p.messages[1].parts == [AiTextPart("x")]  # neither the call nor the result that does not answer it
    d = decision(p, "a1")
    assert (d.action, d.reason) == ("projected", "unmatched-tool-chronology")
    assert "'delete'" in (d.detail or "") and "'lookup'" in (d.detail or "")
    assert d.omitted_parts == ["tool-result", "tool-call"]
    assert_provider_valid(p.messages)
    with pytest.raises(AgentHistoryProjectionError, match="names tool 'delete'") as refused:
        project_agent_history(history, {"incomplete_tool_turn": "error"})
    assert refused.value.message_id == "a1"


@pytest.mark.parametrize(
    ("status", "interrupted_assistant"),
    [
        ("completed", "assistant-marked"),
        ("interrupted", "assistant-marked"),
        ("interrupted", "system-note"),
    ],
)
def test_an_assistant_holding_only_an_unanswered_call_is_an_incomplete_tool_turn(
    status: str, interrupted_assistant: str
) -> None:
    history = [user("u1"), msg("a1", "assistant", call("c1"), ControlPart(), status=status), user("u2")]
    p = project_agent_history_detailed(history, {"interrupted_assistant": interrupted_assistant})
    d = decision(p, "a1")
    assert (d.action, d.reason, d.omitted_parts) == ("omitted", "incomplete-tool-turn", ["tool-call"])
    assert [m.kind for m in p.messages] == ["request"] and p.system == []  # no marker, no empty note


def test_an_unanswered_call_in_error_mode_refuses_a_completed_turn_only() -> None:
    completed = [user("u1"), msg("a1", "assistant", call("c1"))]
    with pytest.raises(AgentHistoryProjectionError, match="unanswered"):
        project_agent_history(completed, {"incomplete_tool_turn": "error"})
    cut = [user("u1"), msg("a1", "assistant", call("c1"), status="interrupted")]  # cut off: expected
    p = project_agent_history_detailed(cut, {"incomplete_tool_turn": "error"})
    assert decision(p, "a1").reason == "incomplete-tool-turn"


def test_a_system_note_lists_what_it_leaves_out() -> None:
    a = msg("a1", "assistant", TextPart(text="let me"), call("c1"), status="interrupted")
    p = project_agent_history_detailed([user("u1"), a], {"interrupted_assistant": "system-note"})
    assert p.system == ["[interrupted] partial response: let me"]
    d = decision(p, "a1")
    assert (d.action, d.reason, d.omitted_parts) == ("projected", "interrupted-system-note", ["tool-call"])


def test_a_call_awaiting_approval_alone_is_omitted_as_awaiting_approval() -> None:
    asks = msg("a1", "assistant", call("c9"), ApprovalRequestPart(approval_id="ap", call_id="c9", tool_name="lookup"))
    p = project_agent_history_detailed([user("u1"), asks], {"incomplete_tool_turn": "error"})
    d = decision(p, "a1")
    assert (d.action, d.reason, d.omitted_parts) == ("omitted", "awaiting-approval", ["tool-call", "approval-request"])


def test_failed_evidence_holding_only_an_unanswered_call_fails_closed() -> None:
    # opting a failed run in as evidence does not make an effect of uncertain outcome evidence
    history = [user("u1"), msg("a1", "assistant", call("c1", "effect"), status="failed")]
    p = project_agent_history_detailed(history, {"evidence_policy": {"failed_assistant": "assistant-marked"}})
    assert [m.kind for m in p.messages] == ["request"]
    d = decision(p, "a1")
    assert (d.action, d.reason, d.omitted_parts) == ("omitted", "incomplete-tool-turn", ["tool-call"])


def test_failed_evidence_with_text_and_no_tool_call_still_says_it_failed() -> None:
    for parts in ((TextPart(text="The key finding held."),), (ControlPart(),)):
        history = [user("u1"), msg("a1", "assistant", *parts, status="failed")]
        p = project_agent_history_detailed(history, {"evidence_policy": {"failed_assistant": "assistant-marked"}})
        assert p.messages[-1].parts[-1] == AiTextPart(FAILED_MARKER)
        assert "did not complete successfully" in FAILED_MARKER
        assert decision(p, "a1").action == "projected"


def test_leading_assistant_is_omitted() -> None:
    p = project_agent_history_detailed([msg("a0", "assistant", TextPart(text="welcome")), user("u1")])
    assert [m.kind for m in p.messages] == ["request"]
    assert decision(p, "a0").reason == "leading-assistant"


def test_adjacent_responses_merge() -> None:
    history = [
        user("u1"),
        msg("a1", "assistant", TextPart(text="one"), status="interrupted"),
        msg("a2", "assistant", TextPart(text="two"), call("c1"), result("c1")),
    ]
    out = project_agent_history(history)
    assert [m.kind for m in out] == ["request", "response", "request"]
    assert [type(x) for x in out[1].parts] == [AiTextPart, AiTextPart, AiTextPart, AiToolCallPart]
    assert_provider_valid(out)


def test_empty_assistant_is_omitted() -> None:
    p = project_agent_history_detailed([user("u1"), msg("a1", "assistant", ControlPart(), TextPart(text=""))])
    assert len(p.messages) == 1 and decision(p, "a1").reason == "empty"


def test_options_as_dict_and_invalid_options() -> None:
    opts = AgentHistoryProjectionOptions(interrupted_assistant="omit")
    assert AgentHistoryProjectionOptions.model_validate({"interrupted_assistant": "omit"}) == opts
    with pytest.raises(AgentRecordValidationError):
        project_agent_history([], {"interrupted_assistant": "maybe"})


# ------------------------------------------------------------------------------- validity checks


def assert_provider_valid(messages: list[ModelMessage]) -> None:
    """Alternation, a leading request, every call answered exactly once by the next request, no orphans."""
    if not messages:
        return
    assert isinstance(messages[0], ModelRequest)
    seen_calls: set[str] = set()
    for i, m in enumerate(messages):
        assert m.parts, "no empty message"
        if i:
            assert m.kind != messages[i - 1].kind, "request/response alternate"
        if isinstance(m, ModelResponse):
            assert all(isinstance(p, AiTextPart | ThinkingPart | AiToolCallPart) for p in m.parts)
            ids = [p.tool_call_id for p in m.parts if isinstance(p, AiToolCallPart)]
            assert len(ids) == len(set(ids)) and not seen_calls & set(ids), "no duplicate call ids"
            seen_calls |= set(ids)
            if ids:
                assert i + 1 < len(messages), "a call is answered by a following request"
        else:
            assert all(isinstance(p, UserPromptPart | ToolReturnPart) for p in m.parts)
            returned = sorted(p.tool_call_id for p in m.parts if isinstance(p, ToolReturnPart))
            previous = messages[i - 1] if i else None
            called = sorted(p.tool_call_id for p in previous.parts if isinstance(p, AiToolCallPart)) if previous else []
            assert returned == called, "each call of the previous response answered exactly once, no orphans"


_OPENAI = OpenAIChatModel("gpt-4o", provider=OpenAIProvider(api_key="x"))


def assert_openai_wire_valid(messages: list[ModelMessage]) -> None:
    """Map with pydantic-ai's own OpenAI Chat adapter; tool_call ids must pair up on the wire."""
    wire = asyncio.run(_OPENAI._map_messages(messages, ModelRequestParameters()))
    pending: set[str] = set()
    seen: set[str] = set()
    for item in wire:
        if item["role"] == "tool":
            assert item["tool_call_id"] in pending, "a tool message answers an open call"
            pending.discard(item["tool_call_id"])
            continue
        assert not pending, "every call is answered before the next non-tool message"
        if item["role"] == "assistant":
            ids = {c["id"] for c in item.get("tool_calls") or ()}
            assert not ids & seen
            seen |= ids
            pending = ids
    assert not pending


def test_openai_wire_of_a_multi_step_history() -> None:
    history = [
        user("u1"),
        user("u2", run_id="r2"),
        msg(
            "a1",
            "assistant",
            call("c1"),
            call("c2"),
            result("c2"),
            result("c1", outcome="error"),
            InputJoinedPart(run_id="r2", message_ids=("u2",), step=1),
            TextPart(text="done"),
        ),
    ]
    out = project_agent_history(history)
    assert_provider_valid(out)
    assert_openai_wire_valid(out)


@pytest.mark.skipif(importlib.util.find_spec("anthropic") is None, reason="anthropic is not installed")
def test_anthropic_wire_of_a_multi_step_history() -> None:  # pragma: no cover - needs the anthropic extra
    from pydantic_ai.models.anthropic import AnthropicModel
    from pydantic_ai.providers.anthropic import AnthropicProvider

    history = [user("u1"), msg("a1", "assistant", call("c1"), result("c1"), TextPart(text="done"))]
    model = AnthropicModel("claude-sonnet-4-5", provider=AnthropicProvider(api_key="x"))
    _system, wire = asyncio.run(model._map_message(project_agent_history(history), ModelRequestParameters(), {}))
    assert [m["role"] for m in wire] == ["user", "assistant", "user", "assistant"]


def assert_responses_wire_valid(messages: list[ModelMessage]) -> None:
    """OpenAI Responses: every function_call answered by one function_call_output, no orphan output."""
    model = OpenAIResponsesModel("gpt-5", provider=OpenAIProvider(api_key="x"))
    wire = asyncio.run(model._map_messages(messages, {}, ModelRequestParameters()))[1]
    calls = [i["call_id"] for i in wire if i.get("type") == "function_call"]
    outputs = [i["call_id"] for i in wire if i.get("type") == "function_call_output"]
    assert sorted(calls) == sorted(outputs) and len(set(calls)) == len(calls)


def assert_anthropic_wire_valid(messages: list[ModelMessage]) -> None:
    """Anthropic: the tool_use blocks of an assistant message are answered by the next user message."""
    from pydantic_ai.models.anthropic import AnthropicModel
    from pydantic_ai.providers.anthropic import AnthropicProvider

    model = AnthropicModel("claude-sonnet-4-5", provider=AnthropicProvider(api_key="x"))
    wire = asyncio.run(model._map_message(messages, ModelRequestParameters(), {}))[1]
    for i, item in enumerate(wire):
        blocks = item["content"] if isinstance(item["content"], list) else []
        used = sorted(b["id"] for b in blocks if b.get("type") == "tool_use")
        if item["role"] == "assistant" and used:
            answer = wire[i + 1]["content"] if i + 1 < len(wire) else []
            assert sorted(b["tool_use_id"] for b in answer if b.get("type") == "tool_result") == used


def assert_google_wire_valid(messages: list[ModelMessage]) -> None:
    """Gemini: the function_call parts of a model turn are answered by the next user turn."""
    from pydantic_ai.models.google import GoogleModel
    from pydantic_ai.providers.google import GoogleProvider

    model = GoogleModel("gemini-2.5-flash", provider=GoogleProvider(api_key="x"))
    wire = asyncio.run(model._map_messages(messages, ModelRequestParameters()))[1]
    for i, item in enumerate(wire):
        called = sorted(p["function_call"]["id"] for p in item["parts"] if "function_call" in p)
        if item["role"] == "model" and called:
            answer = wire[i + 1]["parts"] if i + 1 < len(wire) else []
            assert sorted(p["function_response"]["id"] for p in answer if "function_response" in p) == called


WIRES: dict[str | None, Any] = {
    None: assert_openai_wire_valid,
    "openai": assert_responses_wire_valid,
    "anthropic": assert_anthropic_wire_valid,
    "google": assert_google_wire_valid,
}
HAVE_EXTRAS = all(importlib.util.find_spec(m) is not None for m in ("anthropic", "google.genai"))


def secret(provider: str) -> str:
    return f"SECRET-{provider}"


def encoded(provider: str) -> str:
    return base64.b64encode(secret(provider).encode()).decode()  # signatures are base64


def envelope_of(provider: str) -> ProviderEnvelope:
    """Metadata as ``canonical_parts`` stores it, marked so a leak to another provider is visible."""
    signature = encoded(provider)
    details = {"thought_signature": signature} if provider == "google" else {"marker": secret(provider)}
    return ProviderEnvelope(provider=provider, data={"id": secret(provider), "provider_details": details})


# ------------------------------------------------------------------------------- property test

CALL_IDS = ["c0", "c1", "c2", "c3"]
PROVIDER_NAMES = ["openai", "anthropic", "google"]
STATUSES = ["completed", "interrupted", "superseded", "failed", "streaming"]
KINDS = st.sampled_from(["user"] * 3 + ["assistant"] * 4 + ["system", "summary", "tool"])


def assistant_parts(label: str, i: int, user_ids: list[str]) -> st.SearchStrategy[Any]:
    """Any assistant part; text, outputs and reasoning carry ``label`` so superseded text is traceable."""
    calls = st.sampled_from(CALL_IDS)
    well_formed_round = st.builds(  # parallel calls answered in order: the shape the loop writes
        lambda ids: [*(call(c) for c in ids), *(result(c, f"{label} out") for c in ids)],
        st.lists(calls, min_size=1, max_size=2, unique=True),
    )
    envelopes = st.one_of(st.none(), st.sampled_from(PROVIDER_NAMES).map(envelope_of))
    return st.one_of(
        well_formed_round,
        st.builds(lambda k, e: TextPart(text=f"{label} {i}.{k}", envelope=e), st.integers(0, 9), envelopes),
        st.builds(lambda c, e: call(c, envelope=e), calls, envelopes),
        st.builds(lambda c, o: result(c, f"{label} out", outcome=o), calls, st.sampled_from(["success", "error"])),
        st.builds(
            lambda p, signed: ReasoningPart(
                text=f"{label} thought",
                envelope=envelope_of(p).model_copy(update={"data": {**envelope_of(p).data, "signature": encoded(p)}})
                if signed
                else ProviderEnvelope(provider=p),
            ),
            st.sampled_from(PROVIDER_NAMES),
            st.booleans(),
        ),
        st.builds(
            lambda ids: InputJoinedPart(run_id="r", message_ids=tuple(ids), step=0),
            st.lists(st.sampled_from([*user_ids, "ghost"]), min_size=1, max_size=2),
        ),
        st.just(SourcePart(source_id="s")),
        st.just(ControlPart()),
    )


@st.composite
def histories(draw: st.DrawFn) -> list[Message]:
    n = draw(st.integers(0, 12))
    user_ids = [f"u{i}" for i in range(n)]
    history: list[Message] = []
    for i in range(n):
        leading_user = i == 0 and not (draw(st.booleans()) and draw(st.booleans()))
        kind = "user" if leading_user else draw(KINDS)
        inactive = draw(st.booleans()) and draw(st.booleans()) and draw(st.booleans())
        extra: dict[str, Any] = {"active": False, "compacted_by": "s"} if inactive else {}
        if kind == "user":
            file = [FILE] if draw(st.booleans()) and draw(st.booleans()) else []
            history.append(msg(user_ids[i], "user", TextPart(text=f"user text {i}"), *file, **extra))
        elif kind in ("system", "summary", "tool"):
            history.append(msg(f"x{i}", kind, TextPart(text=f"{kind} {i}"), **extra))
        else:
            status = draw(st.sampled_from(STATUSES))
            label = "SUPERSEDED" if status == "superseded" else "said"
            drawn = draw(st.lists(assistant_parts(label, i, user_ids), max_size=8))
            parts = [p for item in drawn for p in (item if isinstance(item, list) else [item])]
            history.append(msg(f"a{i}", "assistant", *parts, status=status, **extra))
    return history


OPTIONS = st.fixed_dictionaries(
    {
        "interrupted_assistant": st.sampled_from(["assistant-marked", "system-note", "omit"]),
        "evidence_policy": st.fixed_dictionaries({"failed_assistant": st.sampled_from(["omit", "assistant-marked"])}),
        "provider_name": st.sampled_from([None, *PROVIDER_NAMES]),
        "unresolved_file": st.sampled_from(["omit", "text"]),
    }
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(history=histories(), options=OPTIONS, wire=st.booleans())
def test_property_projection_is_always_provider_valid(
    history: list[Message], options: dict[str, Any], wire: bool
) -> None:
    p = project_agent_history_detailed(history, options)
    assert_provider_valid(p.messages)
    dumped = ModelMessagesTypeAdapter.dump_json(p.messages).decode()
    assert "SUPERSEDED" not in dumped and not any("SUPERSEDED" in line for line in p.system)
    assert [d.message_id for d in p.decisions] == [m.id for m in history]
    # provider metadata reaches only the provider that produced it
    own = options["provider_name"]
    for message in p.messages:
        for part in message.parts:
            if isinstance(part, AiTextPart | AiToolCallPart | ThinkingPart):
                assert part.provider_name in (None, own)
                assert own is not None or (part.id, part.provider_details) == (None, None)
    foreign = [marker for name in PROVIDER_NAMES if name != own for marker in (secret(name), encoded(name))]
    leaked = [marker for marker in foreign if marker in dumped]
    assert not leaked
    if wire and (own is None or HAVE_EXTRAS):
        WIRES[own](p.messages)

    try:
        strict = project_agent_history(history, {**options, "incomplete_tool_turn": "error"})
    except AgentHistoryProjectionError:
        return
    assert_provider_valid(strict)
