"""Relay frames: how delivery events travel between processes.

A frame is one JSON object, the same text in a PostgreSQL NOTIFY payload and in a relay table row:

- ``{"o": origin, "s": seq, "e": [event, ...]}`` — events of one publisher, in the order it published them;
- ``{"o": origin, "s": seq, "r": row_id, "c": [conversation_id, ...] | null}`` — PostgreSQL only: the
  events are in relay row ``row_id`` (they did not fit a NOTIFY payload); ``c`` names their conversations
  (null: too many to list), so a subscriber that finds the row pruned knows what to heal;
- ``{"o": origin, "s": seq, "lost": [conversation_id, ...] | null}`` — the publisher dropped events of
  these conversations (a full queue, a failed send, an event too large to relay; null: of any).

``o`` identifies one publisher (a relay object, so one process); ``s`` numbers its frames from 1 without
holes, so a subscriber that sees ``s`` skip knows frames were lost between them.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from pydantic import TypeAdapter

from ..events import AgentRuntimeEvent

NOTIFY_PAYLOAD_LIMIT = 7_999
"""Bytes a PostgreSQL NOTIFY payload may hold (it must be shorter than 8,000 bytes): larger frames go
through the relay table."""

MAX_FRAME_BYTES = 1024 * 1024
"""Bytes of events packed into one relay row at most (one event larger than this travels alone)."""

MAX_EVENT_BYTES = 16 * 1024 * 1024
"""An event whose JSON is larger is not relayed: its conversation is reported lost, and subscribers heal
it from the store."""

MAX_LISTED_CONVERSATIONS = 32
"""Conversation ids a pointer or lost frame lists at most; beyond it (or beyond 4,000 bytes of ids, so the
frame stays a NOTIFY payload) the frame says null (any)."""
_MAX_LISTED_BYTES = 4_000

_EVENTS: TypeAdapter[list[AgentRuntimeEvent]] = TypeAdapter(list[AgentRuntimeEvent])


@dataclass(frozen=True, slots=True)
class OutgoingFrame:
    """One frame ready to send: ``body`` is its whole JSON text; ``inline`` says it fits a NOTIFY
    payload (always False without an inline limit); ``conversations`` its conversations (None: unknown)."""

    seq: int
    body: str
    inline: bool
    conversations: tuple[str, ...] | None


@dataclass(frozen=True, slots=True)
class IncomingFrame:
    """A frame as a subscriber reads it. ``events`` decoded; ``row`` set for a PostgreSQL pointer frame
    (whose events are still to be read); ``lost`` for a lost frame (``lost_all`` when it named none)."""

    origin: str
    seq: int
    events: tuple[Any, ...] = ()
    row: int | None = None
    conversations: tuple[str, ...] | None = None
    lost: tuple[str, ...] = ()
    lost_all: bool = False


class RelayGap:
    """Frames were lost (pruned before they were read, dropped by a full subscriber, missed while a
    connection was away): heal what may be affected (``conversations``; None: any)."""

    __slots__ = ("conversations",)

    def __init__(self, conversations: tuple[str, ...] | None = None) -> None:
        self.conversations = conversations


Sink = Callable[[IncomingFrame | RelayGap], None]
"""What a backend hands what it receives to, in order (on the event loop)."""


def _listed(conversations: Iterable[str]) -> tuple[str, ...] | None:
    listed = tuple(dict.fromkeys(conversations))
    if len(listed) > MAX_LISTED_CONVERSATIONS or sum(len(json.dumps(c)) + 1 for c in listed) > _MAX_LISTED_BYTES:
        return None
    return listed


def _header(origin: str, seq: int) -> str:
    return '{"o":' + json.dumps(origin) + ',"s":' + str(seq)


def pack_frames(
    origin: str,
    first_seq: int,
    events: list[tuple[str, str]],
    *,
    inline_limit: int | None,
    max_frame_bytes: int = MAX_FRAME_BYTES,
) -> list[OutgoingFrame]:
    """Pack ``events`` — ``(conversation_id, event JSON)`` pairs, in publish order — into frames numbered
    from ``first_seq``, keeping their order. With ``inline_limit``, a frame is filled up to that many bytes
    (a NOTIFY payload); an event that cannot fit one alone gets a frame of its own, not inline. Without it,
    frames are filled up to ``max_frame_bytes``."""
    limit = inline_limit if inline_limit is not None else max_frame_bytes
    frames: list[OutgoingFrame] = []
    batch: list[str] = []
    cids: list[str] = []
    size = 0
    seq = first_seq

    def close(inline: bool) -> None:
        nonlocal batch, cids, size, seq
        body = _header(origin, seq) + ',"e":[' + ",".join(batch) + "]}"
        frames.append(OutgoingFrame(seq=seq, body=body, inline=inline, conversations=_listed(cids)))
        seq += 1
        batch, cids, size = [], [], 0

    overhead = len(_header(origin, first_seq + len(events))) + 8  # '"e":[' ']}' and a comma or two
    for conversation_id, text in events:
        n = len(text.encode()) if not text.isascii() else len(text)
        if batch and size + n + 1 + overhead > limit:
            close(inline_limit is not None)
        if n + overhead > limit:  # alone and still too large for inline: a row of its own
            batch, cids, size = [text], [conversation_id], n
            close(False)
            continue
        batch.append(text)
        cids.append(conversation_id)
        size += n + 1
    if batch:
        close(inline_limit is not None)
    return frames


def lost_frame(origin: str, seq: int, conversations: Iterable[str] | None) -> OutgoingFrame:
    """A frame saying events of ``conversations`` (None: of any) were dropped by the publisher."""
    listed = None if conversations is None else _listed(conversations)
    body = _header(origin, seq) + ',"lost":' + json.dumps(list(listed) if listed is not None else None) + "}"
    return OutgoingFrame(seq=seq, body=body, inline=True, conversations=listed)


def pointer_prefix(frame: OutgoingFrame, origin: str) -> str:
    """The NOTIFY payload of a frame stored in the relay table, up to the row id (the SQL appends the id
    and the closing brace)."""
    listed = json.dumps(list(frame.conversations) if frame.conversations is not None else None)
    return _header(origin, frame.seq) + ',"c":' + listed + ',"r":'


def decode_frame(note: dict[str, Any]) -> IncomingFrame:
    """An incoming frame from its parsed JSON. Raises ``ValueError`` (or pydantic's ``ValidationError``)
    for a malformed one."""
    origin, seq = note["o"], note["s"]
    if not isinstance(origin, str) or not isinstance(seq, int):
        raise ValueError("a relay frame has a string 'o' and an integer 's'")
    if "lost" in note:
        lost = note["lost"]
        return IncomingFrame(origin=origin, seq=seq, lost=tuple(lost or ()), lost_all=lost is None)
    if "r" in note:
        listed = note.get("c")
        return IncomingFrame(
            origin=origin, seq=seq, row=int(note["r"]), conversations=tuple(listed) if listed is not None else None
        )
    return IncomingFrame(origin=origin, seq=seq, events=tuple(_EVENTS.validate_python(note["e"])))


def decode_body(body: str) -> IncomingFrame:
    """A frame from its JSON text (a relay row)."""
    return decode_frame(json.loads(body))
