"""Canonical records (``threadline.records``): the wire format, its schema version and its invariants.

Pins: every part round-trips through JSON; unknown part types and unknown schema versions are refused
(the latter with the typed ``AgentRecordSchemaVersionError``, not a pydantic error); a run's state and
terminal reason always agree; the assistant status each reason implies; message status/role rules;
durable execution order; what a run may see of the snapshot; records are frozen; JSON Schema export.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from pydantic import BaseModel, ValidationError

from threadline.errors import AgentRecordSchemaVersionError
from threadline.records import (
    ACTIVE_RUN_STATES,
    PARTS_ADAPTER,
    RECORD_MODELS,
    RUN_STATE_FOR_REASON,
    SCHEMA_VERSION,
    AdmissionReceipt,
    ApprovalRequestPart,
    ApprovalResponsePart,
    ControlPart,
    ConversationHead,
    ConversationSnapshot,
    FilePart,
    InputJoinedPart,
    Message,
    MessageDraft,
    ProviderEnvelope,
    ProviderPart,
    ReasoningPart,
    Run,
    SeedRecord,
    SourcePart,
    TextPart,
    ToolCallPart,
    ToolResultPart,
    assistant_status_for,
    export_json_schemas,
    run_state_for_terminal_reason,
)

NOW = datetime(2025, 1, 2, 3, 4, 5, tzinfo=UTC)

ALL_PARTS: list[BaseModel] = [
    TextPart(text="hello"),
    ReasoningPart(text="thinking", envelope=ProviderEnvelope(provider="anthropic", data={"signature": "abc"})),
    ReasoningPart(),
    ToolCallPart(call_id="call_1", tool_name="search", input={"q": "weather", "n": [1, 2.5, None, True]}),
    ToolResultPart(call_id="call_1", tool_name="search", outcome="error", output={"message": "boom"}),
    FilePart(reference="s3://bucket/key", media_type="image/png", filename="cat.png"),
    SourcePart(source_id="src_1", url="https://example.com", title="Example", media_type="text/html"),
    ProviderPart(envelope=ProviderEnvelope(provider="openai", data=["opaque", 1])),
    ApprovalRequestPart(approval_id="ap_1", call_id="call_2", tool_name="delete", input={"id": 7}, signature="sig"),
    ApprovalResponsePart(approval_id="ap_1", call_id="call_2", approved=False, reason="no"),
    ControlPart(),
    InputJoinedPart(run_id="run_1", message_ids=("m_1", "m_2"), step=2),
]
PART_TYPES = {
    "text",
    "reasoning",
    "tool-call",
    "tool-result",
    "file",
    "source",
    "provider",
    "approval-request",
    "approval-response",
    "control",
    "input-joined",
}


def make_message(**changes: Any) -> Message:
    fields: dict[str, Any] = {
        "id": "m_1",
        "conversation_id": "c_1",
        "role": "user",
        "status": "committed",
        "parts": (TextPart(text="hi"),),
        "created_at": NOW,
        "seq": 1,
    }
    fields.update(changes)
    return Message(**fields)


def run_fields(**changes: Any) -> dict[str, Any]:
    fields: dict[str, Any] = {
        "id": "run_1",
        "conversation_id": "c_1",
        "state": "queued",
        "revision": 1,
        "input_message_ids": ("m_1",),
        "assistant_message_id": "a_1",
        "admission_sequence": 1,
        "created_at": NOW,
        "updated_at": NOW,
    }
    fields.update(changes)
    return fields


def make_run(**changes: Any) -> Run:
    return Run(**run_fields(**changes))


def terminal_run_fields(state: str, reason: str, **changes: Any) -> dict[str, Any]:
    extra: dict[str, Any] = {"execution_sequence": 1, "owner_id": "w", "terminal_at": NOW}
    if reason == "absorbed":
        extra = {"absorbed_into_run_id": "run_0", "terminal_at": NOW}
    if reason == "policy_stop":
        extra["policy_name"] = "max-steps"
    extra.update(changes)
    return run_fields(state=state, terminal_reason=reason, **extra)


def make_head() -> ConversationHead:
    return ConversationHead(conversation_id="c_1", version=3, created_at=NOW, updated_at=NOW)


def make_receipt() -> AdmissionReceipt:
    return AdmissionReceipt(
        conversation_id="c_1",
        idempotency_key="k_1",
        input=make_message(run_id="run_1"),
        run_id="run_1",
        assistant_message_id="a_1",
        version=1,
        created_at=NOW,
    )


# ----------------------------------------------------------------------------------------------- parts


def test_the_part_fixture_covers_every_part_type() -> None:
    assert {p.type for p in ALL_PARTS} == PART_TYPES  # type: ignore[attr-defined]


@pytest.mark.parametrize("part", ALL_PARTS, ids=lambda p: p.type)
def test_every_part_round_trips_through_json(part: BaseModel) -> None:
    text = part.model_dump_json()
    assert json.loads(text)["type"] == part.type  # type: ignore[attr-defined]
    assert type(part).model_validate_json(text) == part


@pytest.mark.parametrize("part", ALL_PARTS, ids=lambda p: p.type)
def test_every_part_round_trips_through_the_parts_adapter(part: BaseModel) -> None:
    as_json = PARTS_ADAPTER.dump_json([part])  # type: ignore[list-item]
    back = PARTS_ADAPTER.validate_json(as_json)
    assert back == [part]
    assert type(back[0]) is type(part)
    assert PARTS_ADAPTER.validate_python(PARTS_ADAPTER.dump_python([part], mode="json")) == [part]  # type: ignore[list-item]


def test_a_message_with_every_part_round_trips_through_json() -> None:
    message = make_message(role="assistant", status="completed", parts=tuple(ALL_PARTS))
    assert Message.model_validate_json(message.model_dump_json()) == message


def test_unknown_part_type_is_refused() -> None:
    with pytest.raises(ValidationError) as caught:
        PARTS_ADAPTER.validate_python([{"type": "image", "url": "x"}])
    assert caught.value.errors()[0]["type"] == "union_tag_invalid"
    with pytest.raises(ValidationError):
        PARTS_ADAPTER.validate_json(b'[{"type": "video"}]')
    with pytest.raises(ValidationError):
        make_message(parts=({"type": "nope", "text": "x"},))


def test_a_part_without_its_type_is_refused() -> None:
    with pytest.raises(ValidationError) as caught:
        PARTS_ADAPTER.validate_python([{"text": "x"}])
    assert caught.value.errors()[0]["type"] == "union_tag_not_found"


def test_parts_forbid_extra_fields() -> None:
    with pytest.raises(ValidationError):
        PARTS_ADAPTER.validate_python([{"type": "text", "text": "x", "colour": "red"}])


# -------------------------------------------------------------------------------------- schema version

VERSIONED: dict[str, Any] = {
    "Message": lambda: make_message(),
    "Run": lambda: make_run(),
    "ConversationHead": make_head,
    "AdmissionReceipt": make_receipt,
}


@pytest.mark.parametrize("name", sorted(VERSIONED))
def test_current_schema_version_is_written_and_read(name: str) -> None:
    record = VERSIONED[name]()
    data = json.loads(record.model_dump_json())
    assert data["schema_version"] == SCHEMA_VERSION == 1
    assert type(record).model_validate(data) == record


@pytest.mark.parametrize("name", sorted(VERSIONED))
@pytest.mark.parametrize("via", ["python", "json"])
def test_unknown_schema_version_is_refused_with_the_typed_error(name: str, via: str) -> None:
    record = VERSIONED[name]()
    data = json.loads(record.model_dump_json())
    data["schema_version"] = 2
    model = type(record)
    with pytest.raises(AgentRecordSchemaVersionError) as caught:
        if via == "json":
            model.model_validate_json(json.dumps(data))
        else:
            model.model_validate(data)
    error = caught.value
    assert not isinstance(error, ValidationError)
    assert error.record == name
    assert error.version == 2
    assert error.supported == SCHEMA_VERSION
    assert name in str(error) and "2" in str(error)


def test_a_receipt_refuses_an_embedded_input_of_an_unknown_version() -> None:
    data = json.loads(make_receipt().model_dump_json())
    data["input"]["schema_version"] = 2
    with pytest.raises(AgentRecordSchemaVersionError) as caught:
        AdmissionReceipt.model_validate(data)
    assert caught.value.record == "Message"


# ------------------------------------------------------------------------------------------------ runs


@pytest.mark.parametrize(("reason", "state"), sorted(RUN_STATE_FOR_REASON.items()))
def test_every_reason_validates_with_its_state(reason: str, state: str) -> None:
    run = Run(**terminal_run_fields(state, reason))
    assert run.terminal and not run.active
    assert Run.model_validate_json(run.model_dump_json()) == run


@pytest.mark.parametrize("reason", sorted(RUN_STATE_FOR_REASON))
def test_the_state_a_reason_ends_a_run_in_is_one_the_record_accepts(reason: str) -> None:
    state = run_state_for_terminal_reason(reason)
    assert Run(**terminal_run_fields(state, reason)).state == state


def test_the_state_for_a_reason_is_public_and_refuses_an_unknown_reason() -> None:
    import threadline

    assert threadline.run_state_for_terminal_reason is run_state_for_terminal_reason
    assert [run_state_for_terminal_reason(r) for r in ("interrupted", "timeout", "policy_stop", "shutdown")] == [
        "interrupted",
        "cancelled",
        "completed",
        "interrupted",
    ]
    with pytest.raises(ValueError, match="unknown terminal reason"):
        run_state_for_terminal_reason("nope")


@pytest.mark.parametrize(("reason", "state"), sorted(RUN_STATE_FOR_REASON.items()))
def test_every_reason_is_refused_with_any_other_terminal_state(reason: str, state: str) -> None:
    terminal_states = set(RUN_STATE_FOR_REASON.values())
    for other in sorted(terminal_states - {state}):
        with pytest.raises(ValidationError, match="implies state"):
            Run(**terminal_run_fields(other, reason))


@pytest.mark.parametrize(
    ("state", "reason"),
    [
        ("completed", "interrupted"),
        ("failed", "success"),
        ("interrupted", "provider_failure"),
        ("superseded", "success"),
    ],
)
def test_mismatched_state_and_reason_is_refused(state: str, reason: str) -> None:
    with pytest.raises(ValidationError, match=f"terminal_reason '{reason}' implies state"):
        Run(**terminal_run_fields(state, reason))


@pytest.mark.parametrize("state", sorted(ACTIVE_RUN_STATES))
def test_an_active_run_has_no_terminal_reason(state: str) -> None:
    owned = {"owner_id": "w", "execution_sequence": 1} if state != "queued" else {}
    Run(**run_fields(state=state, **owned))  # consistent without a reason
    with pytest.raises(ValidationError, match="has no terminal_reason"):
        Run(**run_fields(state=state, terminal_reason="success", **owned))


@pytest.mark.parametrize("state", sorted(set(RUN_STATE_FOR_REASON.values())))
def test_a_terminal_run_has_a_terminal_reason(state: str) -> None:
    with pytest.raises(ValidationError, match="has a terminal_reason"):
        Run(**run_fields(state=state, execution_sequence=1, owner_id="w"))


@pytest.mark.parametrize("state", ["running", "interrupt_requested"])
def test_an_acquired_run_has_an_owner_and_an_execution_sequence(state: str) -> None:
    with pytest.raises(ValidationError, match="owner_id and an execution_sequence"):
        Run(**run_fields(state=state, execution_sequence=1))
    with pytest.raises(ValidationError, match="owner_id and an execution_sequence"):
        Run(**run_fields(state=state, owner_id="w"))


def test_absorbed_names_the_absorbing_run_and_only_absorbed_does() -> None:
    with pytest.raises(ValidationError, match="absorbed_into_run_id"):
        Run(**run_fields(state="superseded", terminal_reason="absorbed", terminal_at=NOW))
    with pytest.raises(ValidationError, match="absorbed_into_run_id"):
        Run(**terminal_run_fields("superseded", "superseded", absorbed_into_run_id="run_0"))


def test_policy_stop_names_its_policy() -> None:
    with pytest.raises(ValidationError, match="policy_name"):
        Run(**run_fields(state="completed", terminal_reason="policy_stop", execution_sequence=1, owner_id="w"))
    with pytest.raises(ValidationError, match="policy_name"):
        Run(**terminal_run_fields("completed", "policy_stop", policy_name=""))


def test_unknown_terminal_reason_and_state_are_refused() -> None:
    with pytest.raises(ValidationError):
        Run(**run_fields(state="completed", terminal_reason="exploded", execution_sequence=1, owner_id="w"))
    with pytest.raises(ValidationError):
        Run(**run_fields(state="paused"))


def test_a_run_has_at_least_one_input() -> None:
    with pytest.raises(ValidationError):
        Run(**run_fields(input_message_ids=()))


@pytest.mark.parametrize(
    ("reason", "status"),
    [
        ("success", "completed"),
        ("policy_stop", "completed"),
        ("provider_stop", "completed"),
        ("superseded", "superseded"),
        ("interrupted", "interrupted"),
        ("cancelled", "interrupted"),
        ("shutdown", "interrupted"),
        ("timeout", "failed"),
        ("context_overflow", "failed"),
        ("storage_conflict", "failed"),
        ("output_rejected", "failed"),
        ("runtime_failure", "failed"),
        ("provider_failure", "failed"),
        ("abandoned", "failed"),
        ("absorbed", "failed"),
    ],
)
def test_assistant_status_for_each_reason(reason: str, status: str) -> None:
    assert assistant_status_for(reason) == status


def test_assistant_status_table_covers_every_reason() -> None:
    # Every reason is listed above; a new reason must be added there deliberately.
    listed = {
        "success",
        "policy_stop",
        "provider_stop",
        "superseded",
        "interrupted",
        "cancelled",
        "shutdown",
        "timeout",
        "context_overflow",
        "storage_conflict",
        "output_rejected",
        "runtime_failure",
        "provider_failure",
        "abandoned",
        "absorbed",
    }
    assert set(RUN_STATE_FOR_REASON) == listed


def test_execution_order_started_then_urgent_fifo_then_ordinary_fifo() -> None:
    runs = [
        make_run(id="ordinary_late", admission_sequence=7),
        make_run(id="urgent_late", priority="urgent", admission_sequence=6),
        make_run(id="ordinary_early", admission_sequence=2),
        make_run(id="started_second", state="running", owner_id="w", execution_sequence=9, admission_sequence=8),
        make_run(id="urgent_early", priority="urgent", admission_sequence=4),
        # a requeued run keeps its execution sequence: started work goes first, by execution sequence
        make_run(id="started_first", execution_sequence=3, admission_sequence=5),
    ]
    ordered = [r.id for r in sorted(runs, key=lambda r: r.execution_order_key)]
    assert ordered == [
        "started_first",
        "started_second",
        "urgent_early",
        "urgent_late",
        "ordinary_early",
        "ordinary_late",
    ]


def test_execution_order_ignores_ids_and_timestamps() -> None:
    later = NOW + timedelta(hours=1)
    a = make_run(id="zzz", admission_sequence=1, created_at=later, updated_at=later)
    b = make_run(id="aaa", admission_sequence=2)
    assert sorted([b, a], key=lambda r: r.execution_order_key) == [a, b]


# -------------------------------------------------------------------------------------------- messages


@pytest.mark.parametrize("status", ["streaming", "completed", "interrupted", "superseded", "failed"])
def test_assistant_statuses(status: str) -> None:
    make_message(role="assistant", status=status)


def test_an_assistant_is_never_merely_committed() -> None:
    with pytest.raises(ValidationError, match="assistant message status"):
        make_message(role="assistant", status="committed")


@pytest.mark.parametrize("role", ["user", "tool", "system", "summary"])
def test_non_assistant_messages_are_committed(role: str) -> None:
    make_message(role=role, status="committed")
    for status in ("streaming", "completed", "interrupted", "failed"):
        with pytest.raises(ValidationError, match="has status 'committed'"):
            make_message(role=role, status=status)


def test_a_lead_message_has_a_position() -> None:
    make_message(band="lead", position=1)
    with pytest.raises(ValidationError, match="lead message has a position"):
        make_message(band="lead")


def test_an_inactive_message_names_its_summary() -> None:
    make_message(position=1, active=False, compacted_by="sum_1")
    with pytest.raises(ValidationError, match="compacted_by"):
        make_message(position=1, active=False)


def test_unknown_role_status_and_extra_fields_are_refused() -> None:
    with pytest.raises(ValidationError):
        make_message(role="robot")
    with pytest.raises(ValidationError):
        make_message(status="pending")
    with pytest.raises(ValidationError):
        make_message(colour="red")


def test_settled_sort_key_orders_lead_then_position_then_summary_after_replaced() -> None:
    lead = make_message(id="lead", band="lead", position=5, seq=9)
    first = make_message(id="first", position=1, seq=1)
    replaced = make_message(id="replaced", position=2, seq=2, active=False, compacted_by="sum")
    summary = make_message(id="sum", role="summary", position=2, seq=3)
    later = make_message(id="later", position=3, seq=4)
    ordered = sorted([later, summary, replaced, first, lead], key=lambda m: m.sort_key)
    assert [m.id for m in ordered] == ["lead", "first", "replaced", "sum", "later"]
    assert not make_message().settled and first.settled


def test_a_message_draft_has_parts() -> None:
    with pytest.raises(ValidationError):
        MessageDraft(id="m", parts=())


# -------------------------------------------------------------------------------------------- snapshot


def test_visible_to_hides_unsettled_messages_of_later_runs() -> None:
    settled_run = Run(**terminal_run_fields("completed", "success", id="run_0", input_message_ids=("u0",)))
    running = make_run(id="run_a", state="running", owner_id="w", execution_sequence=1, input_message_ids=("u1",))
    urgent = make_run(id="run_b", priority="urgent", admission_sequence=3, input_message_ids=("u2",))
    ordinary = make_run(id="run_c", admission_sequence=2, input_message_ids=("u3",))
    messages = (
        make_message(id="u0", run_id="run_0", position=1, seq=1),
        make_message(id="a0", role="assistant", status="completed", run_id="run_0", position=2, seq=2),
        make_message(id="u1", run_id="run_a", seq=3),
        make_message(id="a1", role="assistant", status="streaming", run_id="run_a", seq=4),
        make_message(id="u3", run_id="run_c", seq=5),
        make_message(id="u2", run_id="run_b", seq=6),
    )
    snapshot = ConversationSnapshot(
        conversation_id="c_1", version=6, messages=messages, runs=(settled_run, ordinary, urgent, running)
    )
    ids = lambda run_id: [m.id for m in snapshot.visible_to(run_id)]  # noqa: E731
    assert ids("run_a") == ["u0", "a0", "u1", "a1"]
    assert ids("run_b") == ["u0", "a0", "u1", "a1", "u2"]  # urgent runs before the ordinary one
    assert ids("run_c") == ["u0", "a0", "u1", "a1", "u3", "u2"]


def test_an_empty_snapshot() -> None:
    snapshot = ConversationSnapshot(conversation_id="unknown")
    assert snapshot.version == 0 and snapshot.messages == () and snapshot.runs == ()
    assert snapshot.visible_to("run_x") == ()


# ------------------------------------------------------------------------------------ frozen, schemas

FROZEN_SAMPLES: list[tuple[BaseModel, str, Any]] = [
    (make_message(), "status", "failed"),
    (make_run(), "state", "running"),
    (make_head(), "version", 9),
    (make_receipt(), "run_id", "run_2"),
    (TextPart(text="x"), "text", "y"),
    (ConversationSnapshot(conversation_id="c"), "version", 1),
    (
        SeedRecord(conversation_id="c", seed_key="s", placement="lead", message_ids=("m",), version=1, created_at=NOW),
        "seed_key",
        "t",
    ),
]


@pytest.mark.parametrize(("record", "field", "value"), FROZEN_SAMPLES, ids=lambda x: type(x).__name__)
def test_records_are_frozen(record: BaseModel, field: str, value: Any) -> None:
    with pytest.raises(ValidationError, match="frozen"):
        setattr(record, field, value)


def test_export_json_schemas_covers_every_record_and_is_json() -> None:
    schemas = export_json_schemas()
    assert (
        set(schemas)
        == set(RECORD_MODELS)
        >= {
            "Message",
            "Run",
            "ConversationHead",
            "AdmissionReceipt",
            "SeedRecord",
            "ConversationSnapshot",
        }
    )
    assert json.loads(json.dumps(schemas)) == schemas
    for name, schema in schemas.items():
        assert schema["type"] == "object", name
        assert schema["title"] == name
        assert "properties" in schema


def _find_discriminators(node: Any) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = []
    if isinstance(node, dict):
        if "discriminator" in node:
            found.append(node["discriminator"])
        for value in node.values():
            found.extend(_find_discriminators(value))
    elif isinstance(node, list):
        for value in node:
            found.extend(_find_discriminators(value))
    return found


def test_the_part_union_is_discriminated_by_type() -> None:
    schema = export_json_schemas()["Message"]
    items = schema["properties"]["parts"]["items"]
    assert items["discriminator"]["propertyName"] == "type"
    assert set(items["discriminator"]["mapping"]) == PART_TYPES
    assert len(items["oneOf"]) == len(PART_TYPES)
    # every place a part union appears uses the same discriminator
    everywhere = _find_discriminators(export_json_schemas())
    assert everywhere and all(d["propertyName"] == "type" for d in everywhere)


def test_run_schema_lists_every_state_and_reason() -> None:
    props = export_json_schemas()["Run"]["properties"]
    reasons = set(props["terminal_reason"]["anyOf"][0]["enum"])
    assert reasons == set(RUN_STATE_FOR_REASON)
    assert set(props["state"]["enum"]) == ACTIVE_RUN_STATES | set(RUN_STATE_FOR_REASON.values())


def test_the_part_discriminator_is_required_in_the_schema() -> None:
    defs = export_json_schemas()["Message"]["$defs"]
    assert "type" in defs["TextPart"].get("required", [])
