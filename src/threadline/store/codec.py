"""Records to stored JSON and back, for the drivers that keep rows as JSON text (SQLite, PostgreSQL).

Decoding validates: a malformed or foreign body is :class:`~threadline.errors.AgentStoreCorruptRecordError`,
an unknown ``schema_version`` :class:`~threadline.errors.AgentRecordSchemaVersionError`. A
:class:`RecordCache` skips that validation for a body seen before.
"""

from __future__ import annotations

import functools
import json
import threading
import zlib
from collections.abc import Callable
from datetime import datetime
from typing import Any, TypeVar

import orjson
from pydantic import BaseModel
from pydantic_core import to_jsonable_python

from ..errors import AgentStoreCorruptRecordError
from ..ledger.events import AgentStoreEvent
from ..records import STORAGE, ConversationHead, Run, SeedRecord

M = TypeVar("M", bound=BaseModel)

MAX_CACHED_ROW = 16 * 1024
"""Characters: a longer body is decoded at every read rather than kept."""


def encode(record: BaseModel) -> str:
    """The stored JSON of ``record``: its serializer called directly, in the ``STORAGE`` context (a run's
    usage is kept compact there; ``model_dump_json`` gives the same record in full)."""
    return type(record).__pydantic_serializer__.to_json(record, context=STORAGE).decode()


_EVENT_OPTIONS = (
    orjson.OPT_PASSTHROUGH_DATETIME
    | orjson.OPT_PASSTHROUGH_SUBCLASS
    | orjson.OPT_PASSTHROUGH_DATACLASS
    | orjson.OPT_NON_STR_KEYS
)
"""Anything that is not plain JSON data (a record inside a payload: a run's usage carries its cost record; a
datetime; a ``str`` or ``dict`` subclass) goes through :func:`_jsonable`, so it is written as pydantic
writes it, not as orjson would on its own."""


def _jsonable(value: object) -> object:
    return to_jsonable_python(value)


_EVENT_JSON = json.JSONEncoder(ensure_ascii=False, allow_nan=False, separators=(",", ":"), default=_jsonable)
"""What orjson cannot write (an integer beyond 64 bits) is written by the standard library's encoder."""


def _stamp(at: datetime) -> str:
    """A timestamp as pydantic writes it (``Z`` for UTC)."""
    text = at.isoformat()
    return text[:-6] + "Z" if text.endswith("+00:00") else text


def encode_event(event: AgentStoreEvent) -> str:
    """The stored JSON of a ledger event (what :func:`encode` gives, read back the same)."""
    return encode_event_bytes(event).decode()


def encode_event_bytes(event: AgentStoreEvent) -> bytes:
    """:func:`encode_event` as UTF-8 bytes, written by orjson: an event's payload is plain JSON data already,
    and both pydantic's encoder for a free-form value (which inspects every node) and the standard
    library's cost an order of magnitude more (JSON encoding was the largest part of a ledger write).
    A float that is not finite is written ``null``, as JSON has no spelling for it."""
    values = event.__dict__
    envelope: dict[str, object] = {
        "schema_version": values["schema_version"],
        "event_id": values["event_id"],
        "conversation_id": values["conversation_id"],
        "seq": values["seq"],
        "kind": values["kind"],
        "occurred_at": _stamp(values["occurred_at"]),
        "payload": values["payload"],
    }
    if values["ignorable"]:
        envelope["ignorable"] = True
    try:
        return orjson.dumps(envelope, default=_jsonable, option=_EVENT_OPTIONS)
    except orjson.JSONEncodeError:
        return _EVENT_JSON.encode(envelope).encode()


def encode_with(record: BaseModel, field: str, body: str) -> str:
    """:func:`encode` of ``record`` when the stored JSON of its ``field`` is ``body`` already (a receipt's
    input, written beside it): encoded once, spliced in (the field comes last; key order is not meaning)."""
    rest = type(record).__pydantic_serializer__.to_json(record, exclude={field}, context=STORAGE).decode()
    return f'{rest[:-1]},"{field}":{body}}}'


PACK_FROM = 96
"""Characters: a stored ledger body this long or longer is kept compressed (a BLOB; shorter ones stay
text). What keeps a conversation's database, ledger included, within DESIGN §5's size target."""

_PACKED_1 = b"\x01"
_DICTIONARY_1 = (
    b'"ignorable":true,"schema_version":1,"event_id":"evt_","conversation_id":"","seq":,"kind":"provider/response",'
    b'"occurred_at":"","payload":{"run_id":"run_","attempt":1,"step_number":0,"response":{"id":"","provider":""}}}'
    b'"kind":"state/set","payload":{"name":"","value":"kind":"retry/scheduled","delay":,"reason":"provider_failure",'
    b'"error":"kind":"runtime/baseline","payload":{"compacted":[],"head":{"schema_version":1,"version":,'
    b'"settled_position":,"lead_position":,"message_seq":,"admission_seq":,"execution_seq":,"event_seq":,'
    b'"created_at":"","updated_at":""},"messages":[{"status":"committed","band":"history","active":true,'
    b'"position":,"compacted_by":"runs":[],"receipts":[],"seeds":[],"as_of":""'
    b'"type":"seed","input":{"seed_key":"","inputs":[],"placement":"after-settled"'
    b'"type":"compact","input":{"expected_version":,"replaced_message_ids":[],"summary":{"id":"msg_","role":"summary",'
    b'"type":"recover","input":{"action":"abandon","stale_owner":true,"replay_safe":true'
    b'"type":"interrupt","input":{"type":"lease","input":{"lease_expires_at":"'
    b'"type":"acquire","input":{"run_id":"run_","expected_revision":1,"owner_id":"runtime-"'
    b'"type":"operation","input":{"cache_read_tokens":{"value":,"provenance":"provider-reported"},'
    b'"cost":{"value":,"currency":"USD","provenance":"estimated"},"reasoning_tokens":{"value":,"floor":true,'
    b'{"type":"reasoning","text":"","envelope":{"version":1,"provider":"","data":'
    b'{"type":"control","marker":"interrupted"}{"type":"input-joined","run_id":"run_","message_ids":["msg_"],"step":'
    b'{"type":"approval-request","approval_id":"","signature":"{"type":"file","reference":"","media_type":"'
    b'"kind":"provider/message","occurred_at":"","payload":{"sha256":"","message":{"parts":[{"tool_name":"",'
    b'"args":{"},"tool_call_id":"call_","part_kind":"tool-call"},{"part_kind":"tool-return","content":{'
    b'"part_kind":"text"}],"model_name":"","provider_name":"","finish_reason":"stop","kind":"response"}}}'
    b'"kind":"provider/message","occurred_at":"","payload":{"sha256":"","message":{"parts":[{"content":"",'
    b'"part_kind":"user-prompt"}],"kind":"request"}}}'
    b'"kind":"provider/request","occurred_at":"","payload":{"run_id":"run_","attempt":1,"step_number":0,'
    b'"model_id":"","instructions_sha256":"","prefix":{"count":,"sha256":"","added":["","]},"message_shas":["","'
    b'"kind":"runtime/transition","occurred_at":"","payload":{"type":"accept","input":{"idempotency_key":"",'
    b'"input":{"id":"msg_","role":"user","parts":[{"type":"text","text":""}],"metadata":{}},"run_id":"run_",'
    b'"assistant_message_id":"msg_","start_for":"runtime-","operation":{"kind":"model-request","phase":"started",'
    b'"operation_id":"","step":0,"attempt":1,"started_at":""}},"version":}}'
    b'"kind":"runtime/transition","occurred_at":"","payload":{"type":"checkpoint","input":{"run_id":"run_",'
    b'"expected_revision":2,"owner_id":"runtime-","fencing_token":1,"assistant":{"id":"msg_","status":"streaming",'
    b'"sha256":"","parts":1,"bytes":},"operation":{"kind":"model-request","phase":"completed","operation_id":"",'
    b'"step":0,"attempt":1,"started_at":"","first_output_at":"","finished_at":""},"usage":{"input_tokens":{'
    b'"value":,"provenance":"computed"},"output_tokens":{"value":,"provenance":"computed"},"steps":1}},"version":}}'
    b'"kind":"runtime/transition","occurred_at":"","payload":{"type":"terminal","input":{"run_id":"run_",'
    b'"expected_revision":4,"owner_id":"runtime-","fencing_token":1,"terminal_reason":"success","parts":[{'
    b'"type":"tool-call","call_id":"call_","tool_name":"","input":{"}},{"type":"tool-result","call_id":"call_",'
    b'"tool_name":"","outcome":"success","output":{"}},{"type":"text","text":""}],"operation":{"kind":"model-request",'
    b'"phase":"completed","operation_id":"","step":1,"attempt":1,"started_at":"","first_output_at":"",'
    b'"finished_at":""},"usage":{"input_tokens":{"value":,"provenance":"computed"},"output_tokens":{"value":,'
    b'"provenance":"computed"},"steps":2}},"version":}}{"schema_version":1,"event_id":"evt_","conversation_id":"'
)
"""What ledger bodies share (keys, kinds, the shapes of each payload), given to the compressor as a preset
dictionary: an event compresses to about a third of its JSON instead of about half. A stored blob names its
format and dictionary in its first byte (1: zlib, written by earlier versions; 2: zstd); this text is never
changed (a new one would get a new first byte)."""


_PACKED_2 = b"\x02"
_LOCAL = threading.local()


@functools.cache
def _dictionary_2() -> Any:
    """The same shared text as :data:`_DICTIONARY_1`, as a zstd dictionary: what :func:`pack` writes now (a
    blob whose first byte is 1 is still read as zlib). zstandard is imported on first use: a command that
    only reads short rows never pays for it."""
    import zstandard

    dictionary = zstandard.ZstdCompressionDict(_DICTIONARY_1, dict_type=zstandard.DICT_TYPE_RAWCONTENT)
    dictionary.precompute_compress(level=3)
    return dictionary


def _zstd() -> tuple[Any, Any]:
    """This thread's zstd compressor and decompressor (neither may be shared between threads; each SQLite
    driver writes from its own)."""
    pair = getattr(_LOCAL, "zstd", None)
    if pair is None:
        import zstandard

        dictionary = _dictionary_2()
        pair = _LOCAL.zstd = (
            zstandard.ZstdCompressor(dict_data=dictionary, level=3, write_checksum=False, write_dict_id=False),
            zstandard.ZstdDecompressor(dict_data=dictionary),
        )
    return pair


def pack(body: str | bytes) -> str | bytes:
    """A ledger body (JSON text, or its UTF-8 bytes) as the SQLite driver stores it (see :data:`PACK_FROM`):
    text when short, else zstd with the shared dictionary (smaller than zlib, and about a third of its
    cost on a ledger body)."""
    if len(body) < PACK_FROM:
        return body.decode() if isinstance(body, bytes) else body
    data = body if isinstance(body, bytes) else body.encode()
    return _PACKED_2 + _zstd()[0].compress(data)


def _zstd_error() -> type[Exception]:
    import zstandard

    return zstandard.ZstdError


def unpack(stored: object) -> object:
    """What :func:`pack` stored (or an earlier version of it), as JSON text (or bytes) again."""
    if isinstance(stored, bytes):
        try:
            if stored[:1] == _PACKED_2:
                return _zstd()[1].decompress(stored[1:])
            if stored[:1] == _PACKED_1:
                unpacker = zlib.decompressobj(15, _DICTIONARY_1)
                return unpacker.decompress(stored[1:]) + unpacker.flush()
            return zlib.decompress(stored)
        except (zlib.error, _zstd_error()):
            return stored  # not ours: decoding it reports the row as corrupt
    return stored


def decode(model: type[M], body: object, where: str) -> M:
    """Read one stored record (``where`` names the row in an error)."""
    try:
        if not isinstance(body, str | bytes):
            raise TypeError(f"body is {type(body).__name__}, not JSON text")
        return model.model_validate_json(body)
    except (ValueError, TypeError) as error:  # pydantic's ValidationError is a ValueError
        lines = str(error).strip().splitlines()
        first = " ".join(lines[:3]) if lines else type(error).__name__
        raise AgentStoreCorruptRecordError(
            f"cannot read the row as a {model.__name__}: {first}", where=where
        ) from error


def foreign(model: str, where: str, expected: str, found: str) -> AgentStoreCorruptRecordError:
    """The error for a row whose record names another conversation or id than its key columns."""
    return AgentStoreCorruptRecordError(f"the {model} in this row belongs to {found!r}, not {expected!r}", where=where)


class RecordCache:
    """Decoded records keyed by their exact stored JSON, so a row read or written before is not validated
    again. Decoding is deterministic, so the body alone decides the record. Only deeply immutable records
    are kept (runs, heads, seed records: frozen, holding tuples, strings, numbers and datetimes only);
    messages and receipts hold JSON containers a caller could mutate, so they are decoded at every read.
    Bounded: ``budget`` characters of JSON in all, after which it starts again empty."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.used = 0
        self.by_model: dict[type[BaseModel], dict[str, BaseModel]] = {Run: {}, ConversationHead: {}, SeedRecord: {}}

    def get(self, model: type[M], body: object, where: Callable[[], str]) -> M:
        table = self.by_model.get(model)
        if table is None or not isinstance(body, str):
            return decode(model, body, where())
        record = table.get(body)
        if record is None:
            record = decode(model, body, where())
            self._put(table, body, record)
        return record  # type: ignore[return-value]

    def encode(self, record: BaseModel) -> str:
        """:func:`encode`, remembering the record under its body (the next read of the row needs no
        validation)."""
        body = encode(record)
        table = self.by_model.get(type(record))
        if table is not None:
            self._put(table, body, record)
        return body

    def _put(self, table: dict[str, BaseModel], body: str, record: BaseModel) -> None:
        size = len(body)
        if size > MAX_CACHED_ROW:
            return
        if self.used + size > self.budget:
            for t in self.by_model.values():
                t.clear()
            self.used = 0
        if body not in table:
            table[body] = record
            self.used += size
