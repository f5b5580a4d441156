"""threadline's conversation archive: one conversation's ledger and runtime snapshot as canonical bytes.

The format (``format: "threadline.conversation-archive"``, ``format_version: 1``) is one JSON object in
RFC 8785 canonical form (the ``rfc8785`` package), UTF-8::

    {"conversation_id", "events": [envelope, ...], "format", "format_version",
     "projections": [{name, version, upto_seq, value, updated_at}, ...],
     "sha256": <SHA-256 of the canonical bytes of every other member>,
     "snapshot": {"head", "messages" (compacted ones too), "runs", "receipts", "seeds"},
     "spills": []}

Canonical form makes an archive a function of its content: export → import → export gives the same
bytes on every driver. ``sha256`` catches an archive changed by hand or damaged in transit (it is not a
signature: anyone can recompute it). :func:`decode_archive` checks what needs no store — size, encoding,
canonical form, digest, format, one conversation, contiguous ``seq`` from 1, unique event ids (and lookup
keys: one body per digest, one intent and one proof per durable step), known kinds and typed payloads,
records that parse — and raises :class:`~threadline.errors.AgentArchiveRejectedError`
naming the offence. Agreement between the events and the snapshot is the store's check
(:mod:`threadline.store.replay`).

Companion projections are derived caches: their envelopes are carried and validated, their values never
replayed as state. threadline keeps none yet, so its own exports carry ``[]``; spills likewise.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import rfc8785
from pydantic import AwareDatetime, BaseModel, ConfigDict, Field, JsonValue, ValidationError
from pydantic_core import to_jsonable_python

from ..errors import AgentArchiveRejectedError, AgentRecordValidationError
from ..records import STORAGE, AdmissionReceipt, ConversationHead, Message, Run, SeedRecord
from .events import AgentStoreEvent, decode_agent_store_event, event_key

__all__ = [
    "ARCHIVE_FORMAT",
    "ARCHIVE_FORMAT_VERSION",
    "MAX_ARCHIVE_BYTES",
    "ArchiveContent",
    "ProjectionEnvelope",
    "decode_archive",
    "encode_archive",
]

ARCHIVE_FORMAT = "threadline.conversation-archive"
ARCHIVE_FORMAT_VERSION = 1
MAX_ARCHIVE_BYTES = 256 * 1024 * 1024
"""The largest archive :func:`decode_archive` reads (bytes); a larger one is refused before parsing."""


class ProjectionEnvelope(BaseModel):
    """A companion projection's cached value as an archive carries it: validated, never replayed."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(min_length=1)
    version: int = Field(ge=1)
    upto_seq: int = Field(ge=0)
    value: JsonValue = None
    updated_at: AwareDatetime


@dataclass(frozen=True, slots=True)
class ArchiveContent:
    """What an archive holds, as records."""

    conversation_id: str
    events: tuple[AgentStoreEvent, ...]
    head: ConversationHead
    messages: tuple[Message, ...]
    runs: tuple[Run, ...]
    receipts: tuple[AdmissionReceipt, ...]
    seeds: tuple[SeedRecord, ...]
    projections: tuple[ProjectionEnvelope, ...] = ()


def _record_json(record: BaseModel) -> Any:
    return to_jsonable_python(record, context=STORAGE)


def _object(members: dict[str, bytes]) -> bytes:
    """The RFC 8785 form of a top-level object whose member values are canonical already (each encoded by
    ``rfc8785`` once): its members sorted by name (ASCII names: code-unit order is byte order)."""
    return b"{" + b",".join(b'"%s":%s' % (name.encode(), members[name]) for name in sorted(members)) + b"}"


def encode_archive(content: ArchiveContent) -> bytes:
    """The archive bytes of ``content`` (canonical: equal content, equal bytes). Each member is encoded
    once: the digest covers the object of the others, and the archive adds ``sha256`` to it."""
    members = {
        "format": ARCHIVE_FORMAT,
        "format_version": ARCHIVE_FORMAT_VERSION,
        "conversation_id": content.conversation_id,
        "events": [to_jsonable_python(e) for e in content.events],
        "snapshot": {
            "head": _record_json(content.head),
            "messages": [_record_json(m) for m in content.messages],
            "runs": [_record_json(r) for r in content.runs],
            "receipts": [_record_json(r) for r in content.receipts],
            "seeds": [_record_json(s) for s in content.seeds],
        },
        "projections": [to_jsonable_python(p) for p in content.projections],
        "spills": [],
    }
    encoded = {name: rfc8785.dumps(value) for name, value in members.items()}
    encoded["sha256"] = rfc8785.dumps(hashlib.sha256(_object(encoded)).hexdigest())
    return _object(encoded)


def _reject(code: str, message: str, where: str | None = None) -> AgentArchiveRejectedError:
    return AgentArchiveRejectedError(code, message, where=where)


_MEMBERS = frozenset(
    {"format", "format_version", "conversation_id", "events", "snapshot", "projections", "spills", "sha256"}
)
_SNAPSHOT = frozenset({"head", "messages", "runs", "receipts", "seeds"})


def decode_archive(data: bytes, *, max_bytes: int = MAX_ARCHIVE_BYTES) -> ArchiveContent:
    """Read and check archive bytes (everything that needs no store; see the module docstring). Raises
    :class:`~threadline.errors.AgentArchiveRejectedError` with the offence's ``code``."""
    if not isinstance(data, bytes | bytearray | memoryview):
        raise AgentRecordValidationError(f"an archive is bytes, got {type(data).__name__}", field="data")
    data = bytes(data)
    if len(data) > max_bytes:
        raise _reject("ARCHIVE_TOO_LARGE", f"{len(data)} bytes is more than the {max_bytes} an archive may hold")
    try:
        value = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as error:
        raise _reject("ARCHIVE_MALFORMED", f"not UTF-8 JSON (truncated or damaged?): {error}") from None
    if not isinstance(value, dict) or set(value) != _MEMBERS:
        found = sorted(value) if isinstance(value, dict) else type(value).__name__
        raise _reject("ARCHIVE_FORMAT", f"an archive object has exactly the members {sorted(_MEMBERS)}, got {found}")
    if value["format"] != ARCHIVE_FORMAT or value["format_version"] != ARCHIVE_FORMAT_VERSION:
        raise _reject(
            "ARCHIVE_FORMAT",
            f"format {value['format']!r} version {value['format_version']!r}; this threadline reads "
            f"{ARCHIVE_FORMAT!r} version {ARCHIVE_FORMAT_VERSION}",
        )
    try:  # every member encoded once: the canonical check and the digest share the bytes
        encoded = {name: rfc8785.dumps(member) for name, member in value.items()}
    except Exception as error:  # a number or string RFC 8785 cannot represent
        raise _reject("ARCHIVE_MALFORMED", f"not canonical JSON: {error}") from None
    if _object(encoded) != data:
        raise _reject("ARCHIVE_MALFORMED", "not in RFC 8785 canonical form: it was re-encoded or edited")
    claimed = value.pop("sha256")
    del encoded["sha256"]
    if hashlib.sha256(_object(encoded)).hexdigest() != claimed:
        raise _reject("ARCHIVE_DIGEST", "the content does not match its sha256: it was changed after export")
    del encoded
    cid = value["conversation_id"]
    if not isinstance(cid, str) or not cid:
        raise _reject("ARCHIVE_FORMAT", "conversation_id is a non-empty string", "conversation_id")
    if not isinstance(value["events"], list) or not isinstance(value["snapshot"], dict):
        raise _reject("ARCHIVE_FORMAT", "events is a list and snapshot an object")
    if set(value["snapshot"]) != _SNAPSHOT:
        raise _reject("ARCHIVE_FORMAT", f"snapshot has exactly the members {sorted(_SNAPSHOT)}", "snapshot")
    if value["spills"]:
        raise _reject("ARCHIVE_FORMAT", "this threadline keeps no spills: an archive with spills needs their store")

    events: list[AgentStoreEvent] = []
    ids: set[str] = set()
    keys: set[str] = set()
    for index, raw in enumerate(value["events"]):
        where = f"events[{index}]"
        if isinstance(raw, dict) and raw.get("conversation_id") != cid:
            raise _reject("ARCHIVE_FOREIGN", f"an event of conversation {raw.get('conversation_id')!r}", where)
        if isinstance(raw, dict) and raw.get("seq") != index + 1:
            raise _reject("ARCHIVE_SEQUENCE", f"seq {raw.get('seq')!r} where {index + 1} belongs (reordered?)", where)
        try:
            event, _ = decode_agent_store_event(raw)
        except AgentRecordValidationError as error:
            code = "ARCHIVE_UNKNOWN_KIND" if error.field in ("kind", "schema_version") else "ARCHIVE_PAYLOAD"
            raise _reject(code, str(error), where) from None
        if event.event_id in ids:
            raise _reject("ARCHIVE_DUPLICATE_ID", f"event id {event.event_id!r} appears twice", where)
        ids.add(event.event_id)
        key = event_key(event)
        if key is not None:
            if key in keys:  # a body written twice, a second intent or proof of one step
                raise _reject("ARCHIVE_DUPLICATE_ID", f"a second {event.kind} under one key ({key})", where)
            keys.add(key)
        events.append(event)

    snapshot = value["snapshot"]

    def records(model: type[Any], key: str) -> tuple[Any, ...]:
        out = []
        for index, raw in enumerate(snapshot[key]):
            try:
                record = model.model_validate(raw)
            except (ValidationError, ValueError) as error:
                raise _reject(
                    "ARCHIVE_PAYLOAD", f"not a {model.__name__}: {error}", f"snapshot.{key}[{index}]"
                ) from None
            if record.conversation_id != cid:
                raise _reject("ARCHIVE_FOREIGN", f"a record of {record.conversation_id!r}", f"snapshot.{key}[{index}]")
            out.append(record)
        return tuple(out)

    try:
        head = ConversationHead.model_validate(snapshot["head"])
    except (ValidationError, ValueError) as error:
        raise _reject("ARCHIVE_PAYLOAD", f"not a ConversationHead: {error}", "snapshot.head") from None
    if head.conversation_id != cid:
        raise _reject("ARCHIVE_FOREIGN", f"the head of {head.conversation_id!r}", "snapshot.head")
    if head.event_seq != len(events):
        raise _reject(
            "ARCHIVE_SEQUENCE",
            f"the head counts {head.event_seq} events, the archive holds {len(events)} (truncated?)",
            "snapshot.head",
        )
    projections = []
    for index, raw in enumerate(value["projections"]):
        try:
            projection = ProjectionEnvelope.model_validate(raw)
        except ValidationError as error:
            raise _reject("ARCHIVE_PAYLOAD", f"not a projection envelope: {error}", f"projections[{index}]") from None
        if projection.upto_seq > len(events):
            raise _reject("ARCHIVE_PAYLOAD", "a projection checkpoint past the journal", f"projections[{index}]")
        projections.append(projection)
    if len({p.name for p in projections}) != len(projections):
        raise _reject("ARCHIVE_PAYLOAD", "projection names are unique", "projections")
    return ArchiveContent(
        conversation_id=cid,
        events=tuple(events),
        head=head,
        messages=records(Message, "messages"),
        runs=records(Run, "runs"),
        receipts=records(AdmissionReceipt, "receipts"),
        seeds=records(SeedRecord, "seeds"),
        projections=tuple(projections),
    )


def archive_timestamp(value: datetime) -> str:
    """A time as archives write it (pydantic's JSON form)."""
    return str(to_jsonable_python(value))
