"""Event schemas (``threadline.events``): the delivery union and the separate operator union.

Pins: every event type validates and round-trips JSON through its union; both unions discriminate on
``type`` and refuse each other's events; JSON Schema export names every type; identities (durable ids per
run-operation phase, transient ``(run_id, runtime_epoch, sequence)`` from 1, operator ids per executor);
tool-progress messages are cut at 280 characters; the tool failure envelope keeps only its safe keys.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from decimal import Decimal

import pytest
from pydantic import BaseModel, ValidationError

from threadline.events import (
    AGENT_RUN_EVENT_ADAPTER,
    AGENT_RUNTIME_EVENT_ADAPTER,
    AGENT_TOOL_PROGRESS_MESSAGE_MAX,
    DURABLE_EVENT_TYPES,
    OPERATOR_EVENT_TYPES,
    TRANSIENT_EVENT_TYPES,
    AdmissionEvent,
    AgentProviderResponse,
    AgentRunStartedEvent,
    AgentRunTerminalEvent,
    AgentStepFinishedEvent,
    AssistantCheckpointEvent,
    AssistantDeltaEvent,
    AttemptResetEvent,
    ReasoningDeltaEvent,
    ReasoningEndEvent,
    ReasoningStartEvent,
    RunOperationEvent,
    RunStateEvent,
    TerminalEvent,
    ToolProgressEvent,
    ToolStatusEvent,
    describe_internal_cause,
    durable_event_id,
    export_event_json_schemas,
)
from threadline.records import Message, ProviderEnvelope, ReasoningPart, Run, RunOperation, TextPart
from threadline.usage import AgentCost, AgentUsage, UsageFigure

NOW = datetime(2025, 1, 2, 3, 4, 5, tzinfo=UTC)
C, R = "conv-1", "run-1"
USAGE = AgentUsage(
    steps=1,
    input_tokens=UsageFigure(value=10, provenance="provider-reported"),
    cost=AgentCost(amount=Decimal("0.0123"), currency="USD", provenance="provider-reported"),
)


def durable(cls, event_type: str, version: int, **fields):
    return cls(
        event_id=durable_event_id(R, event_type, version), conversation_id=C, run_id=R, version=version, **fields
    )


def transient(cls, sequence: int, **fields):
    return cls(conversation_id=C, run_id=R, runtime_epoch="epoch-1", sequence=sequence, **fields)


def make_input() -> Message:
    return Message(
        id="m1", conversation_id=C, role="user", status="committed", parts=(TextPart(text="hi"),), created_at=NOW, seq=1
    )


def make_run() -> Run:
    return Run(
        id=R,
        conversation_id=C,
        state="queued",
        revision=1,
        input_message_ids=("m1",),
        assistant_message_id="a1",
        admission_sequence=1,
        created_at=NOW,
        updated_at=NOW,
    )


OPERATION = RunOperation(kind="model-request", phase="first-output", operation_id="op1", step=0, started_at=NOW)

DELIVERY_EVENTS: list[BaseModel] = [
    durable(
        AdmissionEvent,
        "admission",
        1,
        outcome="accepted",
        input=make_input(),
        run=make_run(),
        assistant_message_id="a1",
    ),
    transient(AssistantDeltaEvent, 1, delta="Hel"),
    transient(ReasoningStartEvent, 2, envelope=ProviderEnvelope(provider="anthropic", data={"id": "r1"})),
    transient(ReasoningDeltaEvent, 3, delta="thinking"),
    transient(ReasoningEndEvent, 4),
    durable(AssistantCheckpointEvent, "assistant-checkpoint", 4, message_id="a1", parts=(TextPart(text="Hel"),)),
    durable(RunStateEvent, "run-state", 2, state="running"),
    RunOperationEvent(
        event_id=durable_event_id(R, "run-operation", 3, "first-output"),
        conversation_id=C,
        run_id=R,
        version=3,
        operation=OPERATION,
    ),
    transient(ToolStatusEvent, 5, call_id="k1", tool_name="search", status="started", input={"q": "x"}),
    transient(ToolStatusEvent, 6, call_id="k1", tool_name="search", status="completed", output=[1, "two", None]),
    transient(
        ToolStatusEvent,
        7,
        call_id="k2",
        tool_name="search",
        status="failed",
        error={"error": "NOT_FOUND", "retryable": False, "details": {"id": 3}, "_hint": "try another id"},
    ),
    transient(ToolProgressEvent, 8, call_id="k3", tool_name="crawl", message="page 2", progress=2, total=10),
    transient(AttemptResetEvent, 9, step=0, attempt=2),
    durable(TerminalEvent, "terminal", 9, terminal_reason="success", assistant=None, usage=USAGE),
]

OPERATOR_EVENTS: list[BaseModel] = [
    AgentRunStartedEvent(conversation_id=C, run_id=R, runtime_epoch="epoch-1", fencing_token=1, queue_wait=0.5),
    AgentStepFinishedEvent(
        conversation_id=C,
        run_id=R,
        runtime_epoch="epoch-1",
        fencing_token=1,
        step=0,
        usage=USAGE,
        response=AgentProviderResponse(id="gen-1", provider="Anthropic"),
        finish_reason="stop",
    ),
    AgentRunTerminalEvent(
        conversation_id=C,
        run_id=R,
        runtime_epoch="epoch-1",
        fencing_token=1,
        terminal_reason="provider_failure",
        usage=USAGE,
        steps=1,
        cause={"type": "httpx.ConnectError", "message": "refused"},
    ),
]


def test_the_fixtures_cover_every_type():
    assert {e.type for e in DELIVERY_EVENTS} == DURABLE_EVENT_TYPES | TRANSIENT_EVENT_TYPES
    assert {e.type for e in OPERATOR_EVENTS} == OPERATOR_EVENT_TYPES


@pytest.mark.parametrize("event", DELIVERY_EVENTS, ids=lambda e: e.type)
def test_every_delivery_event_round_trips_json(event):
    raw = event.model_dump_json()
    again = AGENT_RUNTIME_EVENT_ADAPTER.validate_json(raw)
    assert type(again) is type(event)
    assert again == event
    assert AGENT_RUNTIME_EVENT_ADAPTER.validate_python(json.loads(raw)) == event


@pytest.mark.parametrize("event", OPERATOR_EVENTS, ids=lambda e: e.type)
def test_every_operator_event_round_trips_json(event):
    again = AGENT_RUN_EVENT_ADAPTER.validate_json(event.model_dump_json())
    assert type(again) is type(event)
    assert again == event


def test_the_unions_discriminate_on_type_and_refuse_each_other():
    with pytest.raises(ValidationError):
        AGENT_RUNTIME_EVENT_ADAPTER.validate_python({**DELIVERY_EVENTS[1].model_dump(), "type": "no-such-event"})
    for event in OPERATOR_EVENTS:
        with pytest.raises(ValidationError):
            AGENT_RUNTIME_EVENT_ADAPTER.validate_python(event.model_dump())
    for event in DELIVERY_EVENTS:
        with pytest.raises(ValidationError):
            AGENT_RUN_EVENT_ADAPTER.validate_python(event.model_dump())
    # the same payload under another discriminator is validated as that type
    delta = DELIVERY_EVENTS[1].model_dump()
    assert (
        type(AGENT_RUNTIME_EVENT_ADAPTER.validate_python({**delta, "type": "reasoning-delta"})) is ReasoningDeltaEvent
    )


def test_schemas_export_and_name_every_type():
    schemas = export_event_json_schemas()
    json.dumps(schemas)
    delivery, operator = schemas["AgentRuntimeEvent"], schemas["AgentRunEvent"]
    assert delivery["discriminator"]["propertyName"] == "type"
    assert set(delivery["discriminator"]["mapping"]) == DURABLE_EVENT_TYPES | TRANSIENT_EVENT_TYPES
    assert set(operator["discriminator"]["mapping"]) == OPERATOR_EVENT_TYPES
    terminal = delivery["$defs"]["TerminalEvent"]
    assert "usage" in terminal["required"]
    assert "usage" in operator["$defs"]["AgentRunTerminalEvent"]["required"]


def test_durable_ids_derive_from_run_type_version_and_phase():
    assert durable_event_id(R, "terminal", 7) == durable_event_id(R, "terminal", 7)
    assert durable_event_id(R, "terminal", 7) != durable_event_id(R, "run-state", 7)
    phases = {durable_event_id(R, "run-operation", 7, p) for p in ("started", "first-output", "completed")}
    assert len(phases) == 3


def test_transient_identity_and_sequence_from_one():
    event = transient(AssistantDeltaEvent, 1, delta="x")
    assert event.identity == f"{R}:epoch-1:1"
    assert not event.durable and DELIVERY_EVENTS[0].durable
    with pytest.raises(ValidationError):
        transient(AssistantDeltaEvent, 0, delta="x")


def test_operator_ids_differ_per_executor_and_step():
    winner = AgentRunTerminalEvent(conversation_id=C, run_id=R, runtime_epoch="a", fencing_token=2, usage=USAGE)
    loser = AgentRunTerminalEvent(
        conversation_id=C, run_id=R, runtime_epoch="b", fencing_token=1, usage=USAGE, outcome="lost"
    )
    assert winner.event_id != loser.event_id
    step0, step1 = (
        AgentStepFinishedEvent(conversation_id=C, run_id=R, runtime_epoch="a", fencing_token=2, step=s, usage=USAGE)
        for s in (0, 1)
    )
    assert step0.event_id != step1.event_id
    explicit = AgentRunStartedEvent(event_id="mine", conversation_id=C, run_id=R, runtime_epoch="a")
    assert explicit.event_id == "mine"


def test_tool_progress_message_is_cut_at_280():
    event = transient(ToolProgressEvent, 1, call_id="k", tool_name="t", message="x" * 1000)
    assert AGENT_TOOL_PROGRESS_MESSAGE_MAX == 280
    assert len(event.message) == 280
    assert transient(ToolProgressEvent, 1, call_id="k", tool_name="t", message="short").message == "short"


def test_tool_failure_envelope_keeps_only_safe_keys():
    event = transient(
        ToolStatusEvent,
        1,
        call_id="k",
        tool_name="t",
        status="failed",
        error={"error": "INTERNAL_SERVER_ERROR", "retryable": False, "traceback": "secret"},
    )
    assert event.error == {"error": "INTERNAL_SERVER_ERROR", "retryable": False}
    dumped = json.loads(event.model_dump_json())
    assert dumped["error"] == {"error": "INTERNAL_SERVER_ERROR", "retryable": False}
    with_hint = DELIVERY_EVENTS[10]
    assert json.loads(with_hint.model_dump_json())["error"]["_hint"] == "try another id"


def test_terminal_event_requires_usage():
    with pytest.raises(ValidationError):
        TerminalEvent(event_id="x", conversation_id=C, run_id=R, version=1, terminal_reason="success")
    with pytest.raises(ValidationError):
        AGENT_RUN_EVENT_ADAPTER.validate_python(
            {k: v for k, v in OPERATOR_EVENTS[2].model_dump().items() if k != "usage"}
        )


def test_an_operator_field_belongs_to_the_kind_of_event_that_has_it():
    base = {"conversation_id": C, "run_id": R, "runtime_epoch": "e1"}
    started = AGENT_RUN_EVENT_ADAPTER.validate_python({**base, "type": "run-started", "queue_wait": 0.004})
    assert started.type == "run-started" and not hasattr(started, "usage")
    with pytest.raises(ValidationError):  # a step always knows which step it is
        AGENT_RUN_EVENT_ADAPTER.validate_python({**base, "type": "step-finished", "usage": AgentUsage().model_dump()})
    with pytest.raises(ValidationError):  # and a terminal always says what it spent
        AGENT_RUN_EVENT_ADAPTER.validate_python({**base, "type": "run-terminal", "terminal_reason": "success"})


def test_provider_response_identity_names_only_the_provider_it_is_given():
    from pydantic_ai.messages import ModelResponse

    # the runtime reads no gateway key: a response naming its upstream in provider_details stays unnamed
    routed = ModelResponse(
        parts=[],
        provider_name="openrouter",
        provider_response_id="gen-1",
        provider_details={"downstream_provider": "Anthropic"},
    )
    assert AgentProviderResponse.from_response(routed) == AgentProviderResponse(id="gen-1")
    assert AgentProviderResponse.from_response(routed, provider="Anthropic") == AgentProviderResponse(
        id="gen-1", provider="Anthropic"
    )
    assert AgentProviderResponse.from_response(ModelResponse(parts=[]), provider="x") is None


def test_describe_internal_cause_follows_the_chain():
    try:
        try:
            raise ConnectionError("refused")
        except ConnectionError as inner:
            raise RuntimeError("provider failed") from inner
    except RuntimeError as outer:
        described = describe_internal_cause(outer)
    assert described["type"] == "builtins.RuntimeError"
    assert described["chain"] == [{"type": "builtins.ConnectionError", "message": "refused"}]
    assert describe_internal_cause(None) is None
    json.dumps(described)


def test_checkpoint_parts_keep_their_types():
    event = durable(
        AssistantCheckpointEvent,
        "assistant-checkpoint",
        2,
        message_id="a1",
        parts=(ReasoningPart(text="r"), TextPart(text="t")),
    )
    again = AGENT_RUNTIME_EVENT_ADAPTER.validate_json(event.model_dump_json())
    assert [p.type for p in again.parts] == ["reasoning", "text"]
