"""Records to stored JSON and back, for the drivers that keep rows as JSON text (SQLite, PostgreSQL).

Decoding validates: a malformed or foreign body is :class:`~threadline.errors.AgentStoreCorruptRecordError`,
an unknown ``schema_version`` :class:`~threadline.errors.AgentRecordSchemaVersionError`. A
:class:`RecordCache` skips that validation for a body seen before.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from typing import TypeVar

from pydantic import BaseModel

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


def encode_with(record: BaseModel, field: str, body: str) -> str:
    """:func:`encode` of ``record`` when the stored JSON of its ``field`` is ``body`` already (a receipt's
    input, written beside it): encoded once, spliced in (the field comes last; key order is not meaning)."""
    rest = type(record).__pydantic_serializer__.to_json(record, exclude={field}, context=STORAGE).decode()
    return f'{rest[:-1]},"{field}":{body}}}'


def event_digest(event: AgentStoreEvent) -> str | None:
    """The indexed digest of a ledger event: a ``provider/message`` body's ``sha256``, else None."""
    if event.kind == "provider/message" and isinstance(event.payload, dict):
        sha = event.payload.get("sha256")
        return sha if isinstance(sha, str) else None
    return None


PACK_FROM = 384
"""Characters: a stored ledger body this long or longer is kept zlib-compressed (a BLOB; shorter ones stay
text). Event JSON repeats its keys, ids and digests, and compresses to about half: what keeps a
conversation's database, ledger included, within DESIGN §5's size target."""


def pack(body: str) -> str | bytes:
    """A ledger body as the SQLite driver stores it (see :data:`PACK_FROM`)."""
    return zlib.compress(body.encode(), 6) if len(body) >= PACK_FROM else body


def unpack(stored: object) -> object:
    """What :func:`pack` stored, as JSON text (or bytes) again."""
    if isinstance(stored, bytes):
        try:
            return zlib.decompress(stored)
        except zlib.error:
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
