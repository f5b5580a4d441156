"""Relay frames: packing keeps the publisher's order, numbers frames without holes, keeps every inline
frame within a NOTIFY payload (in bytes, multi-byte text included), and decodes back to the same events."""

from __future__ import annotations

import json

from hypothesis import given, settings, strategies as st

from threadline.events import AssistantDeltaEvent
from threadline.live.frames import (
    MAX_LISTED_CONVERSATIONS,
    NOTIFY_PAYLOAD_LIMIT,
    decode_body,
    decode_frame,
    lost_frame,
    pack_frames,
    pointer_prefix,
)


def delta(conversation: str, sequence: int, text: str) -> tuple[str, str]:
    event = AssistantDeltaEvent(
        conversation_id=conversation, run_id="r", runtime_epoch="e", sequence=sequence, delta=text
    )
    return conversation, event.model_dump_json()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["c1", "c2", "ç3"]), st.text(max_size=3_000)), max_size=40))
def test_packing_keeps_order_numbers_and_the_payload_limit(items: list[tuple[str, str]]) -> None:
    events = [delta(c, i + 1, text) for i, (c, text) in enumerate(items)]
    frames = pack_frames("origin", 7, events, inline_limit=NOTIFY_PAYLOAD_LIMIT)
    assert [f.seq for f in frames] == list(range(7, 7 + len(frames)))
    decoded = []
    for frame in frames:
        size = len(frame.body.encode())
        if frame.inline:
            assert size <= NOTIFY_PAYLOAD_LIMIT
        else:  # only a single event too large for a payload leaves the inline path
            assert len(json.loads(frame.body)["e"]) == 1
        incoming = decode_body(frame.body)
        assert (incoming.origin, incoming.seq) == ("origin", frame.seq)
        assert frame.conversations == tuple(dict.fromkeys(e.conversation_id for e in incoming.events))
        decoded.extend(incoming.events)
    assert [e.model_dump_json() for e in decoded] == [text for _c, text in events]


def test_without_an_inline_limit_frames_fill_up_to_the_frame_size() -> None:
    events = [delta("c1", i, "x" * 100) for i in range(1, 101)]
    frames = pack_frames("o", 1, events, inline_limit=None, max_frame_bytes=2_000)
    assert all(not f.inline and len(f.body) <= 2_000 for f in frames)
    assert sum(len(decode_body(f.body).events) for f in frames) == 100


def test_lost_and_pointer_frames_name_their_conversations_or_none() -> None:
    listed = lost_frame("o", 3, ["c1", "c2"])
    assert decode_body(listed.body).lost == ("c1", "c2")
    many = lost_frame("o", 4, [f"c{i}" for i in range(MAX_LISTED_CONVERSATIONS + 1)])
    assert decode_body(many.body).lost_all
    assert decode_body(lost_frame("o", 5, None).body).lost_all
    big = pack_frames("o", 9, [delta("c9", 1, "y" * NOTIFY_PAYLOAD_LIMIT)], inline_limit=NOTIFY_PAYLOAD_LIMIT)[0]
    pointer = json.loads(pointer_prefix(big, "o") + "42}")
    incoming = decode_frame(pointer)
    assert (incoming.row, incoming.conversations, incoming.seq) == (42, ("c9",), 9)
