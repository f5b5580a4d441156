"""``records.evolve``: what ``model_copy(update=...)`` gives, for the records the reducer changes."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from pydantic import ValidationError

from threadline.records import ConversationHead, Message, TextPart, evolve

NOW = datetime(2030, 1, 1, tzinfo=UTC)


def test_evolve_is_model_copy_with_an_update() -> None:
    message = Message(
        id="m",
        conversation_id="c",
        role="assistant",
        status="streaming",
        parts=(TextPart(text="draft"),),
        created_at=NOW,
        seq=3,
    )
    changes = {"status": "committed", "position": 7, "version": 4}
    fast, reference = evolve(message, changes), message.model_copy(update=changes)
    assert fast == reference
    assert fast.model_fields_set == reference.model_fields_set
    assert fast.model_dump_json() == reference.model_dump_json()
    assert (fast.status, fast.position, fast.version, fast.parts) == ("committed", 7, 4, message.parts)
    # the source is untouched, and the two share no field dict
    assert (message.status, message.position, message.version) == ("streaming", None, 0)
    assert fast.__dict__ is not message.__dict__
    # the set of fields set is shared only when the changes add none to it (a frozen record never changes it
    # in place; pydantic's own copies copy it first)
    again = evolve(fast, {"version": 5})
    assert again.model_fields_set is fast.model_fields_set and again.version == 5
    copied = again.model_copy(update={"active": False})
    assert "active" in copied.model_fields_set and "active" not in again.model_fields_set


def test_evolve_keeps_the_record_frozen_and_hashable_like_its_source() -> None:
    head = ConversationHead(conversation_id="c", version=1, created_at=NOW, updated_at=NOW)
    bumped = evolve(head, {"version": 2})
    assert bumped.version == 2 and head.version == 1
    with pytest.raises(ValidationError, match="frozen"):
        bumped.version = 3  # type: ignore[misc]
    assert ConversationHead.model_validate_json(bumped.model_dump_json()) == bumped


async def test_records_the_reducer_copies_from_templates_are_what_validation_gives() -> None:
    """The reducer builds the records of a turn by copying templates (``build``), not by validating: each
    must equal its validated construction, report the same fields as set, and share no mutable field with
    another record (two drafts' metadata dicts are distinct)."""
    from threadline.loop import model_request
    from threadline.store import create_memory_agent_runtime_store

    store = create_memory_agent_runtime_store()
    first = model_request(0)
    accepted = await store.accept_input_and_assign_run(
        conversation_id="c", idempotency_key="k", input={"parts": [{"type": "text", "text": "q"}]},
        start_for="owner", operation=first,
    )  # fmt: skip
    other = await store.accept_input_and_assign_run(
        conversation_id="d", idempotency_key="k", input={"parts": [{"type": "text", "text": "q"}]},
        start_for="owner", operation=model_request(0),
    )  # fmt: skip
    run = accepted.run
    done = await store.checkpoint_run_assistant(
        conversation_id="c", run_id=run.id, expected_revision=run.revision, owner_id="owner",
        fencing_token=run.fencing_token, parts=[{"type": "text", "text": "a"}],
    )  # fmt: skip
    ended = await store.commit_run_terminal(
        conversation_id="c", run_id=run.id, expected_revision=done.run.revision, owner_id="owner",
        fencing_token=run.fencing_token, terminal_reason="success",
    )  # fmt: skip
    loaded = await store.load_run(conversation_id="c", run_id=run.id)
    assert loaded is not None
    for record in (first, accepted, accepted.receipt, accepted.receipt.input, done, ended, loaded):
        validated = type(record).model_validate(dict(record))
        assert validated == record and record.model_validate_json(record.model_dump_json()) == record
        assert record.model_fields_set <= set(type(record).model_fields), record
    assert first.model_fields_set == {"kind", "phase", "operation_id", "step", "attempt", "started_at"}
    assert accepted.model_fields_set == {"outcome", "receipt", "run", "version", "coalesced"}
    assert accepted.receipt.model_fields_set == {
        "conversation_id", "idempotency_key", "input", "run_id", "assistant_message_id", "version", "created_at",
    }  # fmt: skip
    assert "metadata" in accepted.receipt.input.model_fields_set
    # two drafts made from the template hold a dict each
    drafts = []
    for cid in ("e", "f"):
        queued = await store.accept_input_and_assign_run(
            conversation_id=cid, idempotency_key="k", input={"parts": [{"type": "text", "text": "q"}]}
        )
        acquired = await store.acquire_run(
            conversation_id=cid, run_id=queued.run.id, expected_revision=queued.run.revision, owner_id="owner",
            operation=model_request(0),
        )  # fmt: skip
        assert acquired.assistant is not None and "metadata" not in acquired.assistant.model_fields_set
        drafts.append(acquired.assistant)
    assert drafts[0].metadata == drafts[1].metadata == {} and drafts[0].metadata is not drafts[1].metadata
    assert other.receipt.input.metadata is not accepted.receipt.input.metadata
