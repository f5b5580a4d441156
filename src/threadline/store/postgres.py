"""The distributed driver (extra ``threadline[postgres]``): PostgreSQL through psycopg 3 (async) and psycopg-pool.

Every store operation is one transaction on one pooled connection:

- a **write** runs at ``READ COMMITTED`` and first takes ``pg_advisory_xact_lock`` on the conversation
  (before it reads anything: the head may not exist yet). Every write of a conversation takes the same
  lock, so they run one after another, and each statement after the lock sees everything the previous
  holder committed. A write touches one conversation, so it holds one lock: writers cannot deadlock.
- a **read** runs at ``REPEATABLE READ READ ONLY``: one consistent snapshot, no locks.

Round trips are what an operation costs, so statements that need no answer travel with the next one that
does: ``BEGIN``, the lock and the first read go in one round trip, the writes and ``COMMIT`` in another
(one simple-protocol query string, values bound client-side by psycopg). The reads in between are
single prepared statements (``prepare_threshold``). A write of ``n`` reads costs ``n + 1`` round trips.

Serialization failures (``40001``) and deadlocks (``40P01``) are retried inside the driver wherever the
server reports them (a statement or ``COMMIT``), by running the operation again from the start on a fresh
transaction: the store hands :meth:`PostgresStoreDriver.run` a zero-argument factory of the operation
(the :class:`~threadline.store.driver.StoreDriver` protocol), and the driver calls it again for each of
up to ``max_attempts`` attempts; only the attempt that commits counts in ``stats``. When every attempt
loses, the error is :class:`~threadline.errors.AgentStoreBusyError` (nothing was written; the call may be
retried). A bare generator is accepted too, but can be run again only if it failed before receiving its
first answer. A connection found dead before the operation read anything (a pooled connection the server
dropped while idle) is replaced once, transparently.

The schema lives in objects named ``threadline_*`` inside one configurable schema (``threadline`` by
default), with a ``threadline_meta`` row holding the layout version. Forward-only migrations run in one
transaction under an advisory lock, so processes opening at once agree. Records are stored as their JSON
text beside the few columns the queries index; a trigger refuses any row for a purged (tombstoned)
conversation. Failures are classified by exception type and SQLSTATE, never by message text:
unreachable server or dropped connection → :class:`~threadline.errors.AgentStoreUnavailableError`,
malformed row → :class:`~threadline.errors.AgentStoreCorruptRecordError`, unknown layout →
:class:`~threadline.errors.AgentStoreSchemaError`.

Usage::

    async with create_postgres_agent_runtime_store(dsn="postgresql://app@db/app") as pg:
        await pg.store.accept_input_and_assign_run(...)
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import re
from collections.abc import Awaitable, Callable, Iterable, Sequence
from datetime import datetime
from types import TracebackType
from typing import Any, TypeVar

try:
    import psycopg
    from psycopg import sql
    from psycopg.conninfo import conninfo_to_dict
    from psycopg.pq import TransactionStatus
    from psycopg_pool import AsyncConnectionPool, PoolClosed
except ImportError as _missing:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "threadline.store.postgres needs psycopg 3 and psycopg-pool; install them with: "
        "pip install 'threadline[postgres]'"
    ) from _missing

from pydantic import BaseModel

from ..errors import (
    AgentConversationPurgedError,
    AgentRecordValidationError,
    AgentStoreBusyError,
    AgentStoreCorruptRecordError,
    AgentStoreSchemaError,
    AgentStoreUnavailableError,
)
from ..records import AdmissionReceipt, ConversationHead, Message, Run, SeedRecord
from .aggregate import AgentConversationReader, AgentRuntimeStore, create_agent_runtime_store
from .driver import (
    _SYNC_DISPATCH,
    Access,
    HeadState,
    ListActiveRuns,
    ListConversations,
    LoadAllRuns,
    LoadHead,
    LoadHistory,
    LoadMessages,
    LoadMessagesSince,
    LoadReceipt,
    LoadReceiptByInput,
    LoadRuns,
    LoadRunsSince,
    LoadSeed,
    LoadSettledRange,
    LoadUnsettled,
    Operation,
    OperationStats,
    PageSettled,
    Purge,
    Request,
    ScanActiveRuns,
    Write,
    _count_write,
)

__all__ = [
    "POSTGRES_SCHEMA_VERSION",
    "PostgresAgentRuntimeStoreHandle",
    "PostgresStoreDriver",
    "create_postgres_agent_runtime_store",
]

T = TypeVar("T")
M = TypeVar("M", bound=BaseModel)

POSTGRES_SCHEMA_VERSION = 1
"""The version of the ``threadline_*`` layout this driver reads and writes (``threadline_meta``)."""

DEFAULT_SCHEMA = "threadline"

_SCHEMA_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
_MAX_IDENTIFIER = 63  # NAMEDATALEN - 1
_RETRY_SQLSTATES = frozenset({"40001", "40P01"})  # serialization_failure, deadlock_detected
_SCHEMA_SQLSTATES = frozenset({"42P01", "3F000", "42883"})  # undefined table, schema, function
_PURGED_SQLSTATE = "TLP01"  # raised by the purge guard trigger
_MAX_ATTEMPTS = 10
_INT64_MAX = 2**63 - 1
_INT64_MIN = -(2**63)
_CACHE_BUDGET = 4 * 1024 * 1024  # characters of JSON kept decoded per driver
_CACHE_MAX_ROW = 16 * 1024
_SORT_COLUMNS = ("band_rank", "position", "sub", "seq")

# ------------------------------------------------------------------------------------------------ schema

# {s} is the quoted schema identifier. Ids compare byte-wise (COLLATE "C"), exactly like Python strings,
# whatever the database's default collation is: paging order never depends on the server's locale.
_ID = 'text COLLATE "C" NOT NULL'
_GUARDED = ("conversations", "runs", "messages", "admissions", "seeds")

_TABLES_V1: dict[str, str] = {
    "threadline_meta": "CREATE TABLE {s}.threadline_meta (key text PRIMARY KEY, value text NOT NULL)",
    "threadline_conversations": (
        f"CREATE TABLE {{s}}.threadline_conversations (conversation_id {_ID} PRIMARY KEY, "
        "version bigint NOT NULL, body text NOT NULL)"
    ),
    "threadline_tombstones": (
        f"CREATE TABLE {{s}}.threadline_tombstones (conversation_id {_ID} PRIMARY KEY, "
        "purged_at timestamptz NOT NULL DEFAULT now())"
    ),
    "threadline_runs": (
        f"CREATE TABLE {{s}}.threadline_runs (conversation_id {_ID}, run_id {_ID}, "
        "row_id bigint GENERATED ALWAYS AS IDENTITY, active boolean NOT NULL, version bigint NOT NULL, "
        "body text NOT NULL, PRIMARY KEY (conversation_id, run_id))"
    ),
    "threadline_messages": (
        f"CREATE TABLE {{s}}.threadline_messages (conversation_id {_ID}, message_id {_ID}, "
        "row_id bigint GENERATED ALWAYS AS IDENTITY, band_rank smallint NOT NULL, position bigint, "
        "sub smallint NOT NULL, seq bigint NOT NULL, active boolean NOT NULL, version bigint NOT NULL, "
        "body text NOT NULL, PRIMARY KEY (conversation_id, message_id))"
    ),
    "threadline_admissions": (
        f"CREATE TABLE {{s}}.threadline_admissions (conversation_id {_ID}, idempotency_key {_ID}, "
        f"input_message_id {_ID}, body text NOT NULL, PRIMARY KEY (conversation_id, idempotency_key))"
    ),
    "threadline_seeds": (
        f"CREATE TABLE {{s}}.threadline_seeds (conversation_id {_ID}, seed_key {_ID}, body text NOT NULL, "
        "PRIMARY KEY (conversation_id, seed_key))"
    ),
}

_INDEXES_V1: dict[str, str] = {
    "threadline_runs_active": (
        "CREATE INDEX threadline_runs_active ON {s}.threadline_runs (conversation_id, run_id) WHERE active"
    ),
    "threadline_runs_version": "CREATE INDEX threadline_runs_version ON {s}.threadline_runs (conversation_id, version)",
    "threadline_messages_version": (
        "CREATE INDEX threadline_messages_version ON {s}.threadline_messages (conversation_id, version)"
    ),
    "threadline_messages_settled": (
        "CREATE INDEX threadline_messages_settled ON {s}.threadline_messages "
        "(conversation_id, band_rank, position, sub, seq) INCLUDE (active) WHERE position IS NOT NULL"
    ),
    "threadline_messages_unsettled": (
        "CREATE INDEX threadline_messages_unsettled ON {s}.threadline_messages (conversation_id) WHERE position IS NULL"
    ),
    "threadline_admissions_input": (
        "CREATE UNIQUE INDEX threadline_admissions_input ON {s}.threadline_admissions "
        "(conversation_id, input_message_id)"
    ),
}

_GUARD_FUNCTION = (
    "CREATE FUNCTION {s}.threadline_purged_guard() RETURNS trigger LANGUAGE plpgsql AS $guard$ "
    "BEGIN "
    "IF EXISTS (SELECT 1 FROM {s}.threadline_tombstones WHERE conversation_id = NEW.conversation_id) THEN "
    "RAISE EXCEPTION 'threadline: conversation % was purged; it accepts no rows', NEW.conversation_id "
    f"USING ERRCODE = '{_PURGED_SQLSTATE}'; "
    "END IF; "
    "RETURN NEW; "
    "END $guard$"
)

_TRIGGERS_V1: dict[str, str] = {
    f"threadline_{table}_purged_guard": (
        f"CREATE TRIGGER threadline_{table}_purged_guard BEFORE INSERT ON {{s}}.threadline_{table} "
        "FOR EACH ROW EXECUTE FUNCTION {s}.threadline_purged_guard()"
    )
    for table in _GUARDED
}

_MIGRATIONS: dict[int, tuple[str, ...]] = {
    1: (*_TABLES_V1.values(), *_INDEXES_V1.values(), _GUARD_FUNCTION, *_TRIGGERS_V1.values()),
}
"""Forward-only: migration ``n`` takes the layout from version ``n - 1`` to ``n`` (0 is empty)."""

_REQUIRED_RELATIONS = (*_TABLES_V1, *_INDEXES_V1)
_REQUIRED_TRIGGERS = tuple(_TRIGGERS_V1)

# ------------------------------------------------------------------------------------------- statements

_STATEMENTS: dict[str, str] = {
    "begin_write": "BEGIN ISOLATION LEVEL READ COMMITTED, READ WRITE",
    "begin_read": "BEGIN ISOLATION LEVEL REPEATABLE READ, READ ONLY",
    "lock": "SELECT pg_advisory_xact_lock(hashtextextended(%s, 0))",
    "head": (
        "SELECT (SELECT body FROM {s}.threadline_conversations WHERE conversation_id = %(c)s), "
        "EXISTS (SELECT 1 FROM {s}.threadline_tombstones WHERE conversation_id = %(c)s)"
    ),
    "run": "SELECT run_id, body FROM {s}.threadline_runs WHERE conversation_id = %s AND run_id = %s",
    "runs_any": (
        "SELECT run_id, body FROM {s}.threadline_runs WHERE conversation_id = %s AND run_id = ANY(%s::text[])"
    ),
    "active_runs": (
        "SELECT run_id, body FROM {s}.threadline_runs WHERE conversation_id = %s AND active ORDER BY run_id"
    ),
    "all_runs": "SELECT run_id, body FROM {s}.threadline_runs WHERE conversation_id = %s ORDER BY row_id",
    "receipt": (
        "SELECT idempotency_key, body FROM {s}.threadline_admissions "
        "WHERE conversation_id = %s AND idempotency_key = %s"
    ),
    "receipt_by_input": (
        "SELECT idempotency_key, body FROM {s}.threadline_admissions "
        "WHERE conversation_id = %s AND input_message_id = %s"
    ),
    "message": "SELECT message_id, body FROM {s}.threadline_messages WHERE conversation_id = %s AND message_id = %s",
    "messages_any": (
        "SELECT message_id, body FROM {s}.threadline_messages "
        "WHERE conversation_id = %s AND message_id = ANY(%s::text[])"
    ),
    "settled_range": (
        "SELECT message_id, body FROM {s}.threadline_messages WHERE conversation_id = %s AND band_rank = 1 "
        "AND position IS NOT NULL AND position BETWEEN %s::bigint AND %s::bigint AND active "
        "ORDER BY position, sub, seq"
    ),
    "seed": "SELECT seed_key, body FROM {s}.threadline_seeds WHERE conversation_id = %s AND seed_key = %s",
    "history": "SELECT message_id, body FROM {s}.threadline_messages WHERE conversation_id = %s AND active",
    "messages_since": (
        "SELECT message_id, body FROM {s}.threadline_messages WHERE conversation_id = %s AND version > %s::bigint "
        "ORDER BY version, row_id"
    ),
    "active_messages_since": (
        "SELECT message_id, body FROM {s}.threadline_messages WHERE conversation_id = %s AND version > %s::bigint "
        "AND active ORDER BY version, row_id"
    ),
    "runs_since": (
        "SELECT run_id, body FROM {s}.threadline_runs WHERE conversation_id = %s AND version > %s::bigint "
        "ORDER BY version, row_id"
    ),
    "unsettled": (
        "SELECT message_id, body FROM {s}.threadline_messages WHERE conversation_id = %s AND position IS NULL"
    ),
    "scan_first": (
        "SELECT r.conversation_id, r.run_id, r.body FROM {s}.threadline_runs AS r WHERE r.active "
        "AND NOT EXISTS (SELECT 1 FROM {s}.threadline_tombstones AS t WHERE t.conversation_id = r.conversation_id) "
        "ORDER BY r.conversation_id, r.run_id LIMIT %s"
    ),
    "scan_after": (
        "SELECT r.conversation_id, r.run_id, r.body FROM {s}.threadline_runs AS r WHERE r.active "
        "AND (r.conversation_id, r.run_id) > (%s, %s) "
        "AND NOT EXISTS (SELECT 1 FROM {s}.threadline_tombstones AS t WHERE t.conversation_id = r.conversation_id) "
        "ORDER BY r.conversation_id, r.run_id LIMIT %s"
    ),
    "conversations_first": (
        "SELECT conversation_id, body FROM {s}.threadline_conversations ORDER BY conversation_id LIMIT %s"
    ),
    "conversations_after": (
        "SELECT conversation_id, body FROM {s}.threadline_conversations WHERE conversation_id > %s "
        "ORDER BY conversation_id LIMIT %s"
    ),
    "upsert_head": (
        "INSERT INTO {s}.threadline_conversations (conversation_id, version, body) VALUES (%s, %s, %s) "
        "ON CONFLICT (conversation_id) DO UPDATE SET version = excluded.version, body = excluded.body"
    ),
    "upsert_run": (
        "INSERT INTO {s}.threadline_runs (conversation_id, run_id, active, version, body) "
        "VALUES (%s, %s, %s, %s, %s) ON CONFLICT (conversation_id, run_id) DO UPDATE SET "
        "active = excluded.active, version = excluded.version, body = excluded.body"
    ),
    "upsert_message": (
        "INSERT INTO {s}.threadline_messages "
        "(conversation_id, message_id, band_rank, position, sub, seq, active, version, body) "
        "VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s) ON CONFLICT (conversation_id, message_id) DO UPDATE SET "
        "band_rank = excluded.band_rank, position = excluded.position, sub = excluded.sub, seq = excluded.seq, "
        "active = excluded.active, version = excluded.version, body = excluded.body"
    ),
    "insert_receipt": (
        "INSERT INTO {s}.threadline_admissions (conversation_id, idempotency_key, input_message_id, body) "
        "VALUES (%s, %s, %s, %s)"
    ),
    "insert_seed": "INSERT INTO {s}.threadline_seeds (conversation_id, seed_key, body) VALUES (%s, %s, %s)",
    "purge_messages": "DELETE FROM {s}.threadline_messages WHERE conversation_id = %s",
    "purge_runs": "DELETE FROM {s}.threadline_runs WHERE conversation_id = %s",
    "purge_admissions": "DELETE FROM {s}.threadline_admissions WHERE conversation_id = %s",
    "purge_seeds": "DELETE FROM {s}.threadline_seeds WHERE conversation_id = %s",
    "purge_head": "DELETE FROM {s}.threadline_conversations WHERE conversation_id = %s",
    "insert_tombstone": "INSERT INTO {s}.threadline_tombstones (conversation_id) VALUES (%s)",
}
_PURGE_ORDER = ("purge_messages", "purge_runs", "purge_admissions", "purge_seeds", "purge_head", "insert_tombstone")


def _render(template: str, schema: str) -> str:
    """``template`` with ``{s}`` replaced by the quoted schema identifier (``psycopg.sql.Identifier``)."""
    return sql.SQL(template).format(s=sql.Identifier(schema)).as_string(None)


class _Statements:
    """Every statement of one schema, rendered once."""

    def __init__(self, schema: str) -> None:
        self.schema = schema
        for name, template in _STATEMENTS.items():
            setattr(self, name, _render(template, schema))
        self.purge = tuple(getattr(self, name) for name in _PURGE_ORDER)
        self.lock_prefix = f"threadline:{schema}:"
        self.channel = notification_channel(schema)
        self.notify = "SELECT pg_notify(%s, %s)"
        self._pages: dict[tuple[bool, str, int, str], str] = {}
        self._page_base = _render(
            "SELECT message_id, body FROM {s}.threadline_messages WHERE conversation_id = %s AND position IS NOT NULL",
            schema,
        )

    def page(self, include_inactive: bool, direction: str, arity: int, op: str) -> str:
        """The page statement for one shape of request (cached: a few dozen shapes exist at most)."""
        key = (include_inactive, direction, arity, op)
        text = self._pages.get(key)
        if text is None:
            text = self._page_base
            if not include_inactive:
                text += " AND active"
            if arity:
                columns = ", ".join(_SORT_COLUMNS[:arity])
                marks = ", ".join(["%s::bigint"] * arity)
                text += f" AND ({columns}) {op} ({marks})"
            order = "ASC" if direction == "after" else "DESC"
            text += " ORDER BY " + ", ".join(f"{c} {order}" for c in _SORT_COLUMNS) + " LIMIT %s"
            self._pages[key] = text
        return text


def _clamp(value: int) -> int:
    return _INT64_MAX if value > _INT64_MAX else _INT64_MIN if value < _INT64_MIN else value


def _cursor_shape(cursor: Sequence[int], direction: str) -> tuple[int, str, list[int]]:
    """Arity, operator and values of a row-value condition with exactly Python's tuple-comparison
    semantics against ``Message.sort_key`` (cursors from callers may be shorter or longer than the key)."""
    values = [_clamp(int(v)) for v in cursor]
    n = len(values)
    if n == 4:
        op = ">" if direction == "after" else "<"
    elif n < 4:  # equal prefix: the longer key (ours) is greater
        op = ">=" if direction == "after" else "<"
    else:  # equal prefix: the shorter key (ours) is smaller
        values, n = values[:4], 4
        op = ">" if direction == "after" else "<="
    return n, op, values


# ------------------------------------------------------------------------------------------------ decoding


def _decode(model: type[M], body: object, where: str) -> M:
    """Read one stored record. A malformed or foreign body is a corrupt record; an unknown
    ``schema_version`` propagates as :class:`~threadline.errors.AgentRecordSchemaVersionError`."""
    try:
        if not isinstance(body, str):
            raise TypeError(f"body is {type(body).__name__}, not JSON text")
        return model.model_validate_json(body)
    except (ValueError, TypeError) as error:  # pydantic's ValidationError is a ValueError
        lines = str(error).strip().splitlines()
        first = " ".join(lines[:3]) if lines else type(error).__name__
        raise AgentStoreCorruptRecordError(
            f"cannot read the row as a {model.__name__}: {first}", where=where
        ) from error


def _foreign(model: str, where: str, expected: str, found: str) -> AgentStoreCorruptRecordError:
    return AgentStoreCorruptRecordError(f"the {model} in this row belongs to {found!r}, not {expected!r}", where=where)


class _RecordCache:
    """Decoded records keyed by their exact stored JSON, so a row read or written before is not validated
    again. Only deeply immutable records are kept (runs, heads, seed records); messages and receipts hold
    JSON containers a caller could mutate and are decoded fresh. Bounded by size; shared by every
    connection of the driver (decoding is deterministic, so the key alone decides the record)."""

    def __init__(self, budget: int = _CACHE_BUDGET) -> None:
        self.budget = budget
        self.used = 0
        self.by_model: dict[type[BaseModel], dict[str, BaseModel]] = {Run: {}, ConversationHead: {}, SeedRecord: {}}

    def get(self, model: type[M], body: object, where: Callable[[], str]) -> M:
        table = self.by_model.get(model)
        if table is None or not isinstance(body, str):
            return _decode(model, body, where())
        record = table.get(body)
        if record is None:
            record = _decode(model, body, where())
            self._put(table, body, record)
        return record  # type: ignore[return-value]

    def remember(self, record: BaseModel, body: str) -> None:
        table = self.by_model.get(type(record))
        if table is not None:
            self._put(table, body, record)

    def _put(self, table: dict[str, BaseModel], body: str, record: BaseModel) -> None:
        size = len(body)
        if size > _CACHE_MAX_ROW:
            return
        if self.used + size > self.budget:
            for t in self.by_model.values():
                t.clear()
            self.used = 0
        if body not in table:
            table[body] = record
            self.used += size


# ------------------------------------------------------------------------------------------------- rows


class _PostgresRows:
    """The :class:`~threadline.store.driver.AsyncRows` primitives over one connection inside one transaction.

    Statements that need no answer (``BEGIN``, the conversation lock, writes) wait in ``pending``, bound
    client-side, and go to the server in front of the next statement that needs an answer, or in front of
    ``COMMIT``: one simple-protocol query string, one round trip. In a write transaction the first request
    naming a conversation takes that conversation's advisory lock before reading it.
    """

    def __init__(self, conn: psycopg.AsyncConnection[Any], q: _Statements, cache: _RecordCache, access: Access) -> None:
        self.conn = conn
        self.cur = conn.cursor()
        self._binder = psycopg.AsyncClientCursor(conn)
        self.q = q
        self.cache = cache
        self.writable = access == "write"
        self.pending: list[str] = [q.begin_write if self.writable else q.begin_read]
        self.locked: set[str] = set()
        self.written: list[str] = []

    def _bind(self, statement: str, params: Sequence[object] | dict[str, object]) -> str:
        return self._binder.mogrify(statement, params)

    def _lock(self, conversation_id: str) -> None:
        if self.writable and conversation_id not in self.locked:
            self.locked.add(conversation_id)
            self.pending.append(self._bind(self.q.lock, (self.q.lock_prefix + conversation_id,)))

    async def _execute(self, statement: str, params: Sequence[object] | dict[str, object]) -> None:
        """Run ``statement`` (after whatever is pending) and leave its result current on ``cur``."""
        if not self.pending:
            await self.cur.execute(statement, params)
            return
        self.pending.append(self._bind(statement, params))
        text = "; ".join(self.pending)
        self.pending.clear()
        await self.cur.execute(text, prepare=False)
        while self.cur.nextset():  # the last result is the statement's
            pass

    async def _fetch(self, statement: str, params: Sequence[object]) -> list[tuple[Any, ...]]:
        await self._execute(statement, params)
        return await self.cur.fetchall()

    async def commit(self) -> None:
        """Send what is pending, then ``COMMIT``, in one round trip."""
        self.pending.append("COMMIT")
        text = "; ".join(self.pending)
        self.pending.clear()
        await self.cur.execute(text, prepare=False)

    # ------------------------------------------------------------------ decoding rows of one table

    def _runs(self, conversation_id: str, rows: Iterable[tuple[Any, ...]]) -> list[Run]:
        out = []
        get = self.cache.get
        for run_id, body in rows:
            run = get(Run, body, lambda r=run_id: f"threadline_runs conversation_id={conversation_id} run_id={r}")
            if run.id != run_id or run.conversation_id != conversation_id:
                where = f"threadline_runs conversation_id={conversation_id} run_id={run_id}"
                raise _foreign("Run", where, f"{conversation_id}/{run_id}", f"{run.conversation_id}/{run.id}")
            out.append(run)
        return out

    def _messages(self, conversation_id: str, rows: Iterable[tuple[Any, ...]]) -> list[Message]:
        out = []
        for message_id, body in rows:
            where = f"threadline_messages conversation_id={conversation_id} message_id={message_id}"
            message = _decode(Message, body, where)
            if message.id != message_id or message.conversation_id != conversation_id:
                raise _foreign(
                    "Message", where, f"{conversation_id}/{message_id}", f"{message.conversation_id}/{message.id}"
                )
            out.append(message)
        return out

    def _head(self, conversation_id: str, body: object) -> ConversationHead:
        def where() -> str:
            return f"threadline_conversations conversation_id={conversation_id}"

        head = self.cache.get(ConversationHead, body, where)
        if head.conversation_id != conversation_id:
            raise _foreign("ConversationHead", where(), conversation_id, head.conversation_id)
        return head

    def _receipt(self, conversation_id: str, rows: list[tuple[Any, ...]]) -> AdmissionReceipt | None:
        if not rows:
            return None
        key, body = rows[0]
        where = f"threadline_admissions conversation_id={conversation_id} idempotency_key={key}"
        receipt = _decode(AdmissionReceipt, body, where)
        if receipt.conversation_id != conversation_id or receipt.idempotency_key != key:
            raise _foreign(
                "AdmissionReceipt",
                where,
                f"{conversation_id}/{key}",
                f"{receipt.conversation_id}/{receipt.idempotency_key}",
            )
        return receipt

    # ------------------------------------------------------------------------------- the primitives

    async def load_head(self, r: LoadHead) -> HeadState:
        cid = r.conversation_id
        self._lock(cid)
        await self._execute(self.q.head, {"c": cid})
        row = await self.cur.fetchone()
        if row is None:  # pragma: no cover - a scalar SELECT always answers one row
            raise AssertionError("the head query returned no row")
        body, purged = row
        return HeadState(self._head(cid, body) if body is not None else None, purged=bool(purged))

    async def load_runs(self, r: LoadRuns) -> list[Run]:
        cid = r.conversation_id
        if not r.run_ids:
            return []
        self._lock(cid)
        ids = list(dict.fromkeys(r.run_ids))
        if len(ids) == 1:
            rows = await self._fetch(self.q.run, (cid, ids[0]))
        else:
            rows = await self._fetch(self.q.runs_any, (cid, ids))
        found = {run.id: run for run in self._runs(cid, rows)}
        return [found[i] for i in r.run_ids if i in found]

    async def list_active_runs(self, r: ListActiveRuns) -> list[Run]:
        self._lock(r.conversation_id)
        return self._runs(r.conversation_id, await self._fetch(self.q.active_runs, (r.conversation_id,)))

    async def load_all_runs(self, r: LoadAllRuns) -> list[Run]:
        self._lock(r.conversation_id)
        return self._runs(r.conversation_id, await self._fetch(self.q.all_runs, (r.conversation_id,)))

    async def load_receipt(self, r: LoadReceipt) -> AdmissionReceipt | None:
        self._lock(r.conversation_id)
        rows = await self._fetch(self.q.receipt, (r.conversation_id, r.idempotency_key))
        return self._receipt(r.conversation_id, rows)

    async def load_receipt_by_input(self, r: LoadReceiptByInput) -> AdmissionReceipt | None:
        self._lock(r.conversation_id)
        rows = await self._fetch(self.q.receipt_by_input, (r.conversation_id, r.input_message_id))
        return self._receipt(r.conversation_id, rows)

    async def load_messages(self, r: LoadMessages) -> list[Message]:
        cid = r.conversation_id
        ids = list(dict.fromkeys(r.message_ids))
        if not ids:
            return []
        self._lock(cid)
        if len(ids) == 1:
            rows = await self._fetch(self.q.message, (cid, ids[0]))
        else:
            rows = await self._fetch(self.q.messages_any, (cid, ids))
        found = {m.id: m for m in self._messages(cid, rows)}
        return [found[i] for i in ids if i in found]

    async def load_settled_range(self, r: LoadSettledRange) -> list[Message]:
        self._lock(r.conversation_id)
        rows = await self._fetch(self.q.settled_range, (r.conversation_id, _clamp(r.lo), _clamp(r.hi)))
        return self._messages(r.conversation_id, rows)

    async def load_seed(self, r: LoadSeed) -> SeedRecord | None:
        self._lock(r.conversation_id)
        rows = await self._fetch(self.q.seed, (r.conversation_id, r.seed_key))
        if not rows:
            return None
        key, body = rows[0]
        where = f"threadline_seeds conversation_id={r.conversation_id} seed_key={key}"
        seed = self.cache.get(SeedRecord, body, lambda: where)
        if seed.conversation_id != r.conversation_id or seed.seed_key != r.seed_key:
            raise _foreign(
                "SeedRecord", where, f"{r.conversation_id}/{r.seed_key}", f"{seed.conversation_id}/{seed.seed_key}"
            )
        return seed

    async def load_history(self, r: LoadHistory) -> list[Message]:
        self._lock(r.conversation_id)
        return self._messages(r.conversation_id, await self._fetch(self.q.history, (r.conversation_id,)))

    async def load_messages_since(self, r: LoadMessagesSince) -> list[Message]:
        self._lock(r.conversation_id)
        statement = self.q.messages_since if r.include_inactive else self.q.active_messages_since
        rows = await self._fetch(statement, (r.conversation_id, _clamp(r.version)))
        return self._messages(r.conversation_id, rows)

    async def load_runs_since(self, r: LoadRunsSince) -> list[Run]:
        self._lock(r.conversation_id)
        rows = await self._fetch(self.q.runs_since, (r.conversation_id, _clamp(r.version)))
        return self._runs(r.conversation_id, rows)

    async def load_unsettled(self, r: LoadUnsettled) -> list[Message]:
        self._lock(r.conversation_id)
        return self._messages(r.conversation_id, await self._fetch(self.q.unsettled, (r.conversation_id,)))

    async def page_settled(self, r: PageSettled) -> list[Message]:
        self._lock(r.conversation_id)
        params: list[object] = [r.conversation_id]
        if r.cursor is None:
            statement = self.q.page(r.include_inactive, r.direction, 0, "")
        else:
            arity, op, values = _cursor_shape(r.cursor, r.direction)
            statement = self.q.page(r.include_inactive, r.direction, arity, op)
            params.extend(values)
        params.append(r.limit)
        return self._messages(r.conversation_id, await self._fetch(statement, params))

    async def scan_active_runs(self, r: ScanActiveRuns) -> list[Run]:
        if r.after is None:
            rows = await self._fetch(self.q.scan_first, (r.limit,))
        else:
            rows = await self._fetch(self.q.scan_after, (r.after[0], r.after[1], r.limit))
        out: list[Run] = []
        for cid, run_id, body in rows:
            out.extend(self._runs(cid, ((run_id, body),)))
        return out

    async def list_conversations(self, r: ListConversations) -> list[ConversationHead]:
        if r.after is None:
            rows = await self._fetch(self.q.conversations_first, (r.limit,))
        else:
            rows = await self._fetch(self.q.conversations_after, (r.after, r.limit))
        return [self._head(cid, body) for cid, body in rows]

    def _encode(self, record: BaseModel) -> str:
        body = record.model_dump_json()
        self.cache.remember(record, body)  # the next read of this row needs no validation
        return body

    async def write(self, r: Write) -> None:
        if not self.writable:
            raise AssertionError("a read operation wrote")
        m = r.mutation
        if m.head is None:
            raise AssertionError("every mutation writes the conversation head")
        cid = m.head.conversation_id
        self._lock(cid)
        self.written.append(cid)
        q, bind, encode, pending = self.q, self._bind, self._encode, self.pending
        # one statement per row, so a row written twice in one mutation keeps its last version, as in memory
        pending.append(bind(q.upsert_head, (cid, m.head.version, encode(m.head))))
        for run in m.runs:
            pending.append(bind(q.upsert_run, (run.conversation_id, run.id, run.active, run.version, encode(run))))
            if run.state in ("interrupt_requested", "queued"):
                # delivered at COMMIT: executors learn of a durable interrupt at once, workers of new work
                event = "interrupt" if run.state == "interrupt_requested" else "queued"
                payload = json.dumps({"event": event, "conversation_id": run.conversation_id, "run_id": run.id})
                pending.append(bind(q.notify, (q.channel, payload)))
        for msg in m.messages:
            row = (
                msg.conversation_id,
                msg.id,
                0 if msg.band == "lead" else 1,
                msg.position,
                1 if msg.role == "summary" else 0,
                msg.seq,
                msg.active,
                msg.version,
                encode(msg),
            )
            pending.append(bind(q.upsert_message, row))
        for x in m.receipts:
            pending.append(bind(q.insert_receipt, (x.conversation_id, x.idempotency_key, x.input.id, encode(x))))
        for seed in m.seeds:
            pending.append(bind(q.insert_seed, (seed.conversation_id, seed.seed_key, encode(seed))))

    async def purge(self, r: Purge) -> None:
        if not self.writable:
            raise AssertionError("a read operation purged")
        cid = r.conversation_id
        self._lock(cid)
        self.written.append(cid)
        self.pending.extend(self._bind(statement, (cid,)) for statement in self.q.purge)


# ----------------------------------------------------------------------------------------- the driver


class _Attempt:
    """What one transaction attempt got to: whether the operation received an answer (after which a
    generator cannot be rewound) and whether the commit was under way (after which the outcome of a
    lost connection is unknown)."""

    __slots__ = ("answered", "committing", "connected", "rows")

    def __init__(self) -> None:
        self.connected = False
        self.answered = False
        self.committing = False
        self.rows: _PostgresRows | None = None


def _sqlstate(error: BaseException) -> str | None:
    return getattr(error, "sqlstate", None)


def _merge(into: OperationStats, part: OperationStats) -> None:
    into.rows_read += part.rows_read
    into.rows_written += part.rows_written
    for key, n in part.by_request.items():
        into.by_request[key] = into.by_request.get(key, 0) + n
    into.writes.extend(part.writes)


def _describe(conninfo: str) -> str:
    """``host:port`` (or the socket directory) a conninfo string names, with libpq's defaults."""
    try:
        params = conninfo_to_dict(conninfo)
    except psycopg.Error:
        params = {}
    host = str(params.get("host") or params.get("hostaddr") or os.environ.get("PGHOST") or "localhost")
    port = str(params.get("port") or os.environ.get("PGPORT") or "5432")
    return f"{host}:{port}"


def notification_channel(schema: str) -> str:
    """The LISTEN/NOTIFY channel of one schema's store."""
    return f"threadline_{schema}"[:63]


class PostgresStoreDriver:
    """A :class:`~threadline.store.driver.StoreDriver` over a psycopg async connection pool.

    ``run`` takes a zero-argument factory of the operation (the protocol) and retries serialization
    failures and deadlocks by calling it again; a bare generator is accepted, but is retried only when it
    failed before receiving its first answer. ``retries`` counts transactions run again.
    """

    def __init__(
        self,
        *,
        dsn: str | None = None,
        pool: AsyncConnectionPool[Any] | None = None,
        schema: str = DEFAULT_SCHEMA,
        min_size: int = 1,
        max_size: int = 10,
        timeout: float = 10.0,
        max_attempts: int = _MAX_ATTEMPTS,
    ) -> None:
        self.schema = schema
        self._dsn = dsn
        self._pool = pool
        self._owns_pool = pool is None
        self._min_size = min_size
        self._max_size = max_size
        self._timeout = timeout
        self.max_attempts = max_attempts
        self.where = _describe(dsn if dsn is not None else (pool.conninfo if pool is not None else ""))
        self._q = _Statements(schema)
        self._cache = _RecordCache()
        self._opened = False
        self._closed = False
        self._open_lock = asyncio.Lock()
        self._in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self.retries = 0
        """Transactions run again after a serialization failure, deadlock or dead pooled connection."""
        self.rows_wrapper: Callable[[_PostgresRows], Any] | None = None
        """Testing seam: wraps the row primitives of every transaction (for fault injection)."""

    @property
    def pool(self) -> AsyncConnectionPool[Any] | None:
        return self._pool

    async def listen(self, callback: Callable[[dict[str, Any]], None]) -> Callable[[], Awaitable[None]]:
        """Deliver this store's notifications (``{"event": "interrupt" | "queued", "conversation_id",
        "run_id"}``, sent by other processes' commits) to ``callback`` on the event loop, over one
        dedicated connection, until the returned ``stop()`` is awaited. A notification is a hint to look
        now; the durable record stays the authority (a missed one is caught by the next CAS or sweep)."""
        conninfo = self._dsn if self._dsn is not None else (self._pool.conninfo if self._pool is not None else "")
        try:
            conn = await psycopg.AsyncConnection.connect(conninfo, autocommit=True, connect_timeout=self._timeout)
            await conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(self._q.channel)))
        except psycopg.Error as error:
            raise AgentStoreUnavailableError(f"cannot listen on {self.where}: {error}") from error

        async def pump() -> None:
            async for notify in conn.notifies():
                try:
                    callback(json.loads(notify.payload))
                except Exception:
                    continue

        task = asyncio.ensure_future(pump())

        async def stop() -> None:
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
            await conn.close()

        return stop

    # ------------------------------------------------------------------------------------ lifecycle

    async def open(self) -> None:
        """Create the pool (when built from a DSN) and bring the schema to this version. Idempotent."""
        async with self._open_lock:
            if self._closed:
                raise AgentStoreUnavailableError(f"the PostgreSQL store at {self.where} was closed")
            if self._opened:
                return
            if self._pool is None:
                assert self._dsn is not None
                await self._migrate_direct(self._dsn)
                pool: AsyncConnectionPool[Any] = AsyncConnectionPool(
                    self._dsn,
                    min_size=self._min_size,
                    max_size=self._max_size,
                    kwargs={"autocommit": True, "prepare_threshold": 0},
                    open=False,
                    timeout=self._timeout,
                    name=f"threadline:{self.schema}",
                )
                try:
                    await pool.open(wait=True, timeout=self._timeout)
                except psycopg.OperationalError as error:
                    with contextlib.suppress(Exception):
                        await pool.close()
                    raise self._unavailable(error, "could not open the connection pool") from error
                self._pool = pool
            else:
                try:
                    async with self._pool.connection(timeout=self._timeout) as conn:
                        await migrate(conn, self.schema)
                except PoolClosed as error:
                    raise AgentStoreUnavailableError(
                        f"PostgreSQL at {self.where}: the pool passed in is not open; await pool.open() first"
                    ) from error
                except psycopg.OperationalError as error:
                    raise self._unavailable(error, "could not migrate the schema") from error
            self._opened = True

    async def _migrate_direct(self, dsn: str) -> None:
        try:
            conn = await psycopg.AsyncConnection.connect(
                dsn, autocommit=True, connect_timeout=max(1, round(self._timeout)), prepare_threshold=None
            )
        except psycopg.OperationalError as error:
            raise self._unavailable(error, "cannot connect") from error
        try:
            await migrate(conn, self.schema)
        except psycopg.OperationalError as error:
            raise self._unavailable(error, "could not migrate the schema") from error
        finally:
            await conn.close()

    async def aclose(self) -> None:
        """Let operations in flight finish, then close the pool if this driver created it. Idempotent."""
        self._closed = True
        await self._idle.wait()
        if self._owns_pool and self._pool is not None:
            pool, self._pool = self._pool, None
            await pool.close()

    # ------------------------------------------------------------------------------------ operations

    def _unavailable(
        self, error: BaseException, what: str, *, unknown_commit: bool = False
    ) -> AgentStoreUnavailableError:
        detail = str(error).strip().splitlines()
        text = f"PostgreSQL at {self.where}: {what} ({type(error).__name__}: {detail[0] if detail else ''})"
        if unknown_commit:
            text += "; the connection was lost during COMMIT, so whether it committed is unknown: read back"
        else:
            text += "; nothing was written"
        return AgentStoreUnavailableError(text)

    async def run(
        self,
        operation: Operation[T] | Callable[[], Operation[T]],
        *,
        access: Access,
        stats: OperationStats,
    ) -> T:
        if self._closed:
            raise AgentStoreUnavailableError(f"the PostgreSQL store at {self.where} was closed")
        if not self._opened or self._pool is None:
            raise AgentStoreUnavailableError(
                f"the PostgreSQL store at {self.where} is not open: await handle.open() or use 'async with'"
            )
        factory = operation if callable(operation) else None
        op: Operation[T] = factory() if factory is not None else operation  # type: ignore[assignment,operator]
        self._in_flight += 1
        self._idle.clear()
        try:
            # the first request needs no database: pure argument errors never take a connection
            try:
                request = op.send(None)
            except StopIteration as done:
                return done.value  # type: ignore[no-any-return]
            attempts, replaced = 0, False
            while True:
                attempts += 1
                attempt = _Attempt()
                part = OperationStats()
                try:
                    result = await self._transaction(op, request, access, part, attempt)
                    _merge(stats, part)
                    return result
                except psycopg.Error as error:
                    state = _sqlstate(error)
                    fresh = not attempt.answered
                    if state in _RETRY_SQLSTATES:
                        if attempts < self.max_attempts and (fresh or factory is not None):
                            self.retries += 1
                            await asyncio.sleep(random.uniform(0, min(0.05, 0.001 * 2**attempts)))
                            if not fresh:
                                op.close()
                                op = factory()  # type: ignore[misc]
                                request = op.send(None)
                            continue
                        op.close()
                        raise AgentStoreBusyError(
                            f"PostgreSQL at {self.where}: the transaction lost to a concurrent one "
                            f"(SQLSTATE {state}) {attempts} time(s); nothing was written, retry the call"
                        ) from error
                    if (
                        isinstance(error, psycopg.OperationalError)
                        and fresh
                        and not replaced
                        and not isinstance(error, psycopg.errors.QueryCanceled)
                        and attempt.connected  # a connection was taken: not a pool timeout
                        and not self._closed
                    ):
                        replaced = True  # a pooled connection the server dropped while idle: take another
                        self.retries += 1
                        continue
                    op.close()
                    mapped = self._map(error, access, attempt)
                    if mapped is error:
                        raise
                    raise mapped from error
                except BaseException:
                    op.close()
                    raise
        finally:
            self._in_flight -= 1
            if not self._in_flight:
                self._idle.set()

    def _map(self, error: psycopg.Error, access: Access, attempt: _Attempt) -> Exception:
        state = _sqlstate(error)
        if state == _PURGED_SQLSTATE:
            rows = attempt.rows
            cid = rows.written[0] if rows is not None and rows.written else "?"
            return AgentConversationPurgedError(cid)
        if isinstance(error, psycopg.OperationalError):
            if self._closed and self._pool is None:
                return AgentStoreUnavailableError(f"the PostgreSQL store at {self.where} was closed")
            return self._unavailable(
                error, "the operation failed", unknown_commit=access == "write" and attempt.committing
            )
        if state in _SCHEMA_SQLSTATES:
            return AgentStoreSchemaError(
                f"PostgreSQL at {self.where}: the threadline schema {self.schema!r} is missing or damaged "
                f"(SQLSTATE {state}: {type(error).__name__}); nothing was written"
            )
        return error

    async def _transaction(
        self, op: Operation[T], request: Request, access: Access, stats: OperationStats, attempt: _Attempt
    ) -> T:
        pool = self._pool
        if pool is None:
            raise AgentStoreUnavailableError(f"the PostgreSQL store at {self.where} was closed")
        async with pool.connection(timeout=self._timeout) as conn:
            attempt.connected = True
            restore = not conn.autocommit  # a pool passed in may hand out non-autocommit connections
            if restore:
                await conn.set_autocommit(True)
            try:
                rows = attempt.rows = _PostgresRows(conn, self._q, self._cache, access)
                target: Any = self.rows_wrapper(rows) if self.rows_wrapper is not None else rows
                try:
                    while True:
                        answer = await getattr(target, _SYNC_DISPATCH[type(request)])(request)
                        if isinstance(request, Write | Purge):
                            _count_write(request, stats)
                        else:
                            stats.read(request, answer)
                        attempt.answered = True
                        try:
                            request = op.send(answer)
                        except StopIteration as done:
                            result: T = done.value
                            break
                    attempt.committing = True
                    await rows.commit()
                except BaseException:
                    await _rollback(conn)
                    raise
            finally:
                if restore and not conn.closed and conn.info.transaction_status == TransactionStatus.IDLE:
                    await conn.set_autocommit(False)
        return result


async def _rollback(conn: psycopg.AsyncConnection[Any]) -> None:
    """End a failed transaction; a broken connection is left to the pool, which discards it."""
    if conn.closed or conn.info.transaction_status not in (TransactionStatus.INTRANS, TransactionStatus.INERROR):
        return
    with contextlib.suppress(psycopg.Error):
        await conn.execute("ROLLBACK", prepare=False)


# ----------------------------------------------------------------------------------------- migrations


async def migrate(conn: psycopg.AsyncConnection[Any], schema: str) -> int:
    """Bring ``schema`` to :data:`POSTGRES_SCHEMA_VERSION` in one transaction under an advisory lock.

    Returns the version found before migrating (0 for none). Refuses an unknown (newer) version, a partial
    layout and a schema holding ``threadline_*`` objects without a version row, with
    :class:`~threadline.errors.AgentStoreSchemaError`. Safe to run from many processes at once.
    """
    q = sql.Identifier(schema).as_string(None)
    async with conn.transaction():
        cur = conn.cursor()
        await cur.execute("SET TRANSACTION ISOLATION LEVEL READ COMMITTED, READ WRITE", prepare=False)
        await cur.execute(
            "SELECT pg_advisory_xact_lock(hashtextextended(%s, 0))", (f"threadline-migrate:{schema}",), prepare=False
        )
        await cur.execute("SELECT 1 FROM pg_namespace WHERE nspname = %s", (schema,), prepare=False)
        if await cur.fetchone() is None:
            await cur.execute(f"CREATE SCHEMA {q}", prepare=False)
        found = await _schema_version(cur, schema)
        if found > POSTGRES_SCHEMA_VERSION:
            raise AgentStoreSchemaError(
                f"schema {schema!r} holds threadline layout version {found}; this threadline supports version "
                f"{POSTGRES_SCHEMA_VERSION}. Use the threadline release that wrote this database."
            )
        for version in range(found + 1, POSTGRES_SCHEMA_VERSION + 1):
            for statement in _MIGRATIONS[version]:
                await cur.execute(_render(statement, schema), prepare=False)
        if found < POSTGRES_SCHEMA_VERSION:
            await cur.execute(
                _render(
                    "INSERT INTO {s}.threadline_meta (key, value) VALUES ('schema_version', %s) "
                    "ON CONFLICT (key) DO UPDATE SET value = excluded.value",
                    schema,
                ),
                (str(POSTGRES_SCHEMA_VERSION),),
                prepare=False,
            )
        await _check_complete(cur, schema)
    return found


async def _schema_version(cur: psycopg.AsyncCursor[Any], schema: str) -> int:
    await cur.execute(
        "SELECT c.relname FROM pg_class AS c JOIN pg_namespace AS n ON n.oid = c.relnamespace "
        "WHERE n.nspname = %s AND c.relname LIKE 'threadline\\_%%'",
        (schema,),
        prepare=False,
    )
    names = {name for (name,) in await cur.fetchall()}
    if not names:
        return 0
    if "threadline_meta" not in names:
        raise AgentStoreSchemaError(f"schema {schema!r}: partial threadline layout: missing threadline_meta")
    await cur.execute(
        _render("SELECT value FROM {s}.threadline_meta WHERE key = 'schema_version'", schema), prepare=False
    )
    row = await cur.fetchone()
    if row is None:
        raise AgentStoreSchemaError(f"schema {schema!r}: partial threadline layout: no schema_version row")
    try:
        version = int(row[0])
    except ValueError:
        raise AgentStoreSchemaError(
            f"schema {schema!r}: threadline schema_version {row[0]!r} is not a number"
        ) from None
    if version < 1:
        raise AgentStoreSchemaError(f"schema {schema!r}: threadline schema_version {version} is not supported")
    return version


async def _check_complete(cur: psycopg.AsyncCursor[Any], schema: str) -> None:
    await cur.execute(
        "SELECT c.relname FROM pg_class AS c JOIN pg_namespace AS n ON n.oid = c.relnamespace "
        "WHERE n.nspname = %s AND c.relname = ANY(%s::text[]) "
        "UNION ALL SELECT t.tgname FROM pg_trigger AS t JOIN pg_class AS c ON c.oid = t.tgrelid "
        "JOIN pg_namespace AS n ON n.oid = c.relnamespace WHERE n.nspname = %s AND t.tgname = ANY(%s::text[])",
        (schema, list(_REQUIRED_RELATIONS), schema, list(_REQUIRED_TRIGGERS)),
        prepare=False,
    )
    present = {name for (name,) in await cur.fetchall()}
    missing = [name for name in (*_REQUIRED_RELATIONS, *_REQUIRED_TRIGGERS) if name not in present]
    if missing:
        raise AgentStoreSchemaError(f"schema {schema!r}: partial threadline layout: missing {', '.join(missing)}")


# ----------------------------------------------------------------------------------------------- handle


class PostgresAgentRuntimeStoreHandle:
    """A PostgreSQL store: ``store`` (the :class:`AgentRuntimeStore`), ``conversations`` (its paged
    reader), ``driver``, :meth:`open` and :meth:`close`. As an async context manager it opens on enter
    and closes on exit."""

    def __init__(self, driver: PostgresStoreDriver, store: AgentRuntimeStore) -> None:
        self.driver = driver
        self.store = store
        self.conversations: AgentConversationReader = store.conversations
        self.schema = driver.schema

    async def open(self) -> PostgresAgentRuntimeStoreHandle:
        """Create the pool (when built from a DSN) and migrate the schema. Idempotent.

        Raises :class:`~threadline.errors.AgentStoreUnavailableError` when the server cannot be reached and
        :class:`~threadline.errors.AgentStoreSchemaError` for an unknown or partial layout."""
        await self.driver.open()
        return self

    async def close(self) -> None:
        """Let operations in flight finish, then close the pool if the handle created it (a pool passed in
        stays open). Later calls raise :class:`~threadline.errors.AgentStoreUnavailableError`. Idempotent."""
        await self.store.aclose()

    async def __aenter__(self) -> PostgresAgentRuntimeStoreHandle:
        try:
            return await self.open()
        except BaseException:
            await self.close()
            raise

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    def __repr__(self) -> str:
        return f"<PostgresAgentRuntimeStoreHandle {self.driver.where} schema={self.schema!r}>"


def _validate_schema(schema: object) -> str:
    if (
        not isinstance(schema, str)
        or not _SCHEMA_NAME.match(schema)
        or len(schema.encode()) > _MAX_IDENTIFIER
        or schema.lower().startswith("pg_")
    ):
        raise AgentRecordValidationError(
            f"schema is an identifier of letters, digits and underscores (at most {_MAX_IDENTIFIER} bytes, "
            f"not starting with a digit or 'pg_'), got {schema!r}",
            field="schema",
        )
    return schema


def create_postgres_agent_runtime_store(
    dsn: str | None = None,
    *,
    pool: AsyncConnectionPool[Any] | None = None,
    schema: str = DEFAULT_SCHEMA,
    clock: Callable[[], datetime] | None = None,
    min_size: int = 1,
    max_size: int = 10,
    timeout: float = 10.0,
) -> PostgresAgentRuntimeStoreHandle:
    """A handle on the threadline store in ``schema`` of a PostgreSQL database; call :meth:`open` (or use
    ``async with``) before the first operation.

    Pass exactly one of ``dsn`` (the handle creates, and later closes, an ``AsyncConnectionPool`` of
    ``min_size``..``max_size`` connections) or ``pool`` (an ``AsyncConnectionPool`` you opened and will
    close). ``timeout`` bounds connecting and waiting for a pooled connection, in seconds. The tables are
    ``threadline_*`` inside ``schema``, created on first open.
    """
    if (dsn is None) == (pool is None):
        raise AgentRecordValidationError("pass exactly one of dsn or pool", field="dsn" if dsn is None else "pool")
    if dsn is not None:
        if not isinstance(dsn, str) or not dsn.strip():
            raise AgentRecordValidationError(f"dsn is a non-empty connection string, got {dsn!r}", field="dsn")
        try:
            conninfo_to_dict(dsn)
        except psycopg.Error as error:
            raise AgentRecordValidationError(f"dsn is not a valid connection string: {error}", field="dsn") from error
    if pool is not None and not isinstance(pool, AsyncConnectionPool):
        raise AgentRecordValidationError(
            f"pool is a psycopg_pool.AsyncConnectionPool, got {type(pool).__name__}", field="pool"
        )
    _validate_schema(schema)
    for name, value in (("min_size", min_size), ("max_size", max_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < (0 if name == "min_size" else 1):
            raise AgentRecordValidationError(f"{name} must be a non-negative integer, got {value!r}", field=name)
    if min_size > max_size:
        raise AgentRecordValidationError(f"min_size {min_size} exceeds max_size {max_size}", field="min_size")
    if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not timeout > 0:
        raise AgentRecordValidationError(f"timeout is a positive number of seconds, got {timeout!r}", field="timeout")
    driver = PostgresStoreDriver(
        dsn=dsn, pool=pool, schema=schema, min_size=min_size, max_size=max_size, timeout=float(timeout)
    )
    store = create_agent_runtime_store(driver) if clock is None else create_agent_runtime_store(driver, clock=clock)
    return PostgresAgentRuntimeStoreHandle(driver, store)
