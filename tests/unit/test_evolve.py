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
