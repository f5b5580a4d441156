"""The distributed driver (extra ``threadline[postgres]``): PostgreSQL through psycopg 3 (async) and psycopg-pool.

Every store operation is one transaction on one pooled connection:

- a **write** runs at ``READ COMMITTED`` and first takes ``pg_advisory_xact_lock`` on the conversation
  (before it reads anything: the head may not exist yet). Every write of a conversation takes the same
  lock, so they run one after another, and each statement after the lock sees everything the previous
  holder committed. A write touches one conversation, so it holds one lock: writers cannot deadlock.
- a **read** runs at ``REPEATABLE READ READ ONLY``: one consistent snapshot, no locks.

Round trips are what an operation costs (on the client: a wake-up of the event loop and psycopg's wait;
on the server: a wake-up of the backend), so an operation makes as few as it can:

- statements that need no answer (``BEGIN``, the lock, the writes, ``COMMIT``) travel with the next one
  that does, in one simple-protocol query string;
- every statement is prepared once per pooled connection (``PREPARE``; then ``EXECUTE name(literals)``,
  literals quoted by libpq): the server neither parses nor plans it again;
- *prefetch*: the operation is a pure generator, so a second copy of it (a *probe*) answered from the rows
  the driver last saw (:class:`_Hints`) foresees which requests follow the one asked now; they go in the
  same round trip, and their rows wait until asked for. A read whose requests were all foreseen ends its
  snapshot (``COMMIT``) in that round trip too; if it must go on, its next snapshot re-reads the
  conversation head, and a moved head runs the read again (every committed write of a conversation
  rewrites its head with a higher version, or deletes it);
- a write may be *answered from the rows it last saw* (its own previous commit, usually) — and, for an id
  it has never seen (a new idempotency key, a new run or message), that there is no such row — if it saw
  the conversation before. Each such answer adds a claim to a *guard* that travels behind the lock: the
  SHA-256 of each row's stored JSON, the absence of each row, the exact set of active runs; unless the
  server holds exactly that, the guard fails the transaction (``22012``) before anything commits, and the
  operation runs again on the rows read from the server, as does an operation that gave up (a conflict) on
  answers not yet verified. So a steady write (admission, acquire, checkpoint, terminal) is one round trip:
  lock, guard, writes, ``COMMIT``. None of this changes what an operation acts on: every answer it
  committed with was read, or verified, under the lock.
- a row the write read under the lock, or had its guard vouch for, is rewritten with a plain ``UPDATE``;
  only a row it has not seen is upserted (an upsert first attempts the insert: an index probe, a row lock
  and the purge guard trigger for nothing). Rows are deleted only by a purge, which takes the same lock.

*Group commit*: a write that could answer from hints and finds every connection busy waits in a queue;
one task at a time waits for the next free connection and commits what is queued then in one transaction
and one round trip (:meth:`PostgresStoreDriver._batched`): each write's lock, guard and statements in turn,
in conversation order, at most one write per conversation, then one ``COMMIT`` (and one WAL flush) for
all. A write that needs the server before its commit leaves the batch; a batch that fails before its
``COMMIT`` has written nothing, and each of its writes runs again alone.

``round_trips`` counts them; ``restarts`` counts operations run again because a shortcut met moved rows
(not failures). ``prefetch``, ``speculate`` and ``batch_writes`` turn the last three shortcuts off.

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
import functools
import hashlib
import json
import os
import random
import re
import select
import weakref
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable, Iterable, Sequence
from datetime import datetime
from types import TracebackType
from typing import Any, TypeVar

try:
    import psycopg
    from psycopg import pq, sql
    from psycopg.conninfo import conninfo_to_dict
    from psycopg.pq import TransactionStatus
    from psycopg_pool import AsyncConnectionPool, PoolClosed, PoolTimeout
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
    AgentStoreSchemaError,
    AgentStoreUnavailableError,
)
from ..records import AdmissionReceipt, ConversationHead, Message, Run, SeedRecord
from .aggregate import AgentConversationReader, AgentRuntimeStore, create_agent_runtime_store
from .codec import RecordCache, decode, foreign
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
_UNPREPARED_SQLSTATE = "26000"  # invalid_sql_statement_name: a prepared statement is gone
_SCHEMA_SQLSTATES = frozenset({"42P01", "3F000", "42883"})  # undefined table, schema, function
_PURGED_SQLSTATE = "TLP01"  # raised by the purge guard trigger
_MAX_ATTEMPTS = 10
_INT64_MAX = 2**63 - 1
_INT64_MIN = -(2**63)
_CACHE_BUDGET = 4 * 1024 * 1024  # characters of JSON kept decoded per driver
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

# Every statement a store operation runs is a server-side prepared statement (``PREPARE`` once per pooled
# connection, then ``EXECUTE name(literals)``): the server parses and plans it once per connection instead
# of once per call, and an ``EXECUTE`` still travels in a simple-protocol query string together with the
# statements before and after it. {s} is the quoted schema; $n the parameters, typed here.
_PREPARED: dict[str, tuple[str, str]] = {
    "lock": ("text", "SELECT pg_advisory_xact_lock(hashtextextended($1, 0))"),
    "head": (
        "text",
        "SELECT (SELECT body FROM {s}.threadline_conversations WHERE conversation_id = $1), "
        "EXISTS (SELECT 1 FROM {s}.threadline_tombstones WHERE conversation_id = $1)",
    ),
    "run": ("text, text", "SELECT run_id, body FROM {s}.threadline_runs WHERE conversation_id = $1 AND run_id = $2"),
    "runs_any": (
        "text, text[]",
        "SELECT run_id, body FROM {s}.threadline_runs WHERE conversation_id = $1 AND run_id = ANY($2)",
    ),
    "active_runs": (
        "text",
        "SELECT run_id, body FROM {s}.threadline_runs WHERE conversation_id = $1 AND active ORDER BY run_id",
    ),
    "all_runs": ("text", "SELECT run_id, body FROM {s}.threadline_runs WHERE conversation_id = $1 ORDER BY row_id"),
    "receipt": (
        "text, text",
        "SELECT idempotency_key, body FROM {s}.threadline_admissions "
        "WHERE conversation_id = $1 AND idempotency_key = $2",
    ),
    "receipt_by_input": (
        "text, text",
        "SELECT idempotency_key, body FROM {s}.threadline_admissions "
        "WHERE conversation_id = $1 AND input_message_id = $2",
    ),
    "message": (
        "text, text",
        "SELECT message_id, body FROM {s}.threadline_messages WHERE conversation_id = $1 AND message_id = $2",
    ),
    "messages_any": (
        "text, text[]",
        "SELECT message_id, body FROM {s}.threadline_messages WHERE conversation_id = $1 AND message_id = ANY($2)",
    ),
    "settled_range": (
        "text, bigint, bigint",
        "SELECT message_id, body FROM {s}.threadline_messages WHERE conversation_id = $1 AND band_rank = 1 "
        "AND position IS NOT NULL AND position BETWEEN $2 AND $3 AND active ORDER BY position, sub, seq",
    ),
    "seed": (
        "text, text",
        "SELECT seed_key, body FROM {s}.threadline_seeds WHERE conversation_id = $1 AND seed_key = $2",
    ),
    "history": ("text", "SELECT message_id, body FROM {s}.threadline_messages WHERE conversation_id = $1 AND active"),
    "messages_since": (
        "text, bigint",
        "SELECT message_id, body FROM {s}.threadline_messages WHERE conversation_id = $1 AND version > $2 "
        "ORDER BY version, row_id",
    ),
    "active_messages_since": (
        "text, bigint",
        "SELECT message_id, body FROM {s}.threadline_messages WHERE conversation_id = $1 AND version > $2 "
        "AND active ORDER BY version, row_id",
    ),
    "runs_since": (
        "text, bigint",
        "SELECT run_id, body FROM {s}.threadline_runs WHERE conversation_id = $1 AND version > $2 "
        "ORDER BY version, row_id",
    ),
    "unsettled": (
        "text",
        "SELECT message_id, body FROM {s}.threadline_messages WHERE conversation_id = $1 AND position IS NULL",
    ),
    "scan_first": (
        "bigint",
        "SELECT r.conversation_id, r.run_id, r.body FROM {s}.threadline_runs AS r WHERE r.active "
        "AND NOT EXISTS (SELECT 1 FROM {s}.threadline_tombstones AS t WHERE t.conversation_id = r.conversation_id) "
        "ORDER BY r.conversation_id, r.run_id LIMIT $1",
    ),
    "scan_after": (
        "text, text, bigint",
        "SELECT r.conversation_id, r.run_id, r.body FROM {s}.threadline_runs AS r WHERE r.active "
        "AND (r.conversation_id, r.run_id) > ($1, $2) "
        "AND NOT EXISTS (SELECT 1 FROM {s}.threadline_tombstones AS t WHERE t.conversation_id = r.conversation_id) "
        "ORDER BY r.conversation_id, r.run_id LIMIT $3",
    ),
    "conversations_first": (
        "bigint",
        "SELECT conversation_id, body FROM {s}.threadline_conversations ORDER BY conversation_id LIMIT $1",
    ),
    "conversations_after": (
        "text, bigint",
        "SELECT conversation_id, body FROM {s}.threadline_conversations WHERE conversation_id > $1 "
        "ORDER BY conversation_id LIMIT $2",
    ),
    "upsert_head": (
        "text, bigint, text",
        "INSERT INTO {s}.threadline_conversations (conversation_id, version, body) VALUES ($1, $2, $3) "
        "ON CONFLICT (conversation_id) DO UPDATE SET version = excluded.version, body = excluded.body",
    ),
    "upsert_run": (
        "text, text, boolean, bigint, text",
        "INSERT INTO {s}.threadline_runs (conversation_id, run_id, active, version, body) "
        "VALUES ($1, $2, $3, $4, $5) ON CONFLICT (conversation_id, run_id) DO UPDATE SET "
        "active = excluded.active, version = excluded.version, body = excluded.body",
    ),
    "upsert_message": (
        "text, text, smallint, bigint, smallint, bigint, boolean, bigint, text",
        "INSERT INTO {s}.threadline_messages "
        "(conversation_id, message_id, band_rank, position, sub, seq, active, version, body) "
        "VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9) ON CONFLICT (conversation_id, message_id) DO UPDATE SET "
        "band_rank = excluded.band_rank, position = excluded.position, sub = excluded.sub, seq = excluded.seq, "
        "active = excluded.active, version = excluded.version, body = excluded.body",
    ),
    # a row this transaction read under the lock, or had the guard vouch for, exists: a plain UPDATE
    # rewrites it (an upsert would first try to insert, lock the row and fire the purge guard trigger)
    "update_head": (
        "text, bigint, text",
        "UPDATE {s}.threadline_conversations SET version = $2, body = $3 WHERE conversation_id = $1",
    ),
    "update_run": (
        "text, text, boolean, bigint, text",
        "UPDATE {s}.threadline_runs SET active = $3, version = $4, body = $5 "
        "WHERE conversation_id = $1 AND run_id = $2",
    ),
    "update_message": (
        "text, text, smallint, bigint, smallint, bigint, boolean, bigint, text",
        "UPDATE {s}.threadline_messages SET band_rank = $3, position = $4, sub = $5, seq = $6, active = $7, "
        "version = $8, body = $9 WHERE conversation_id = $1 AND message_id = $2",
    ),
    "insert_receipt": (
        "text, text, text, text",
        "INSERT INTO {s}.threadline_admissions (conversation_id, idempotency_key, input_message_id, body) "
        "VALUES ($1, $2, $3, $4)",
    ),
    "insert_seed": (
        "text, text, text",
        "INSERT INTO {s}.threadline_seeds (conversation_id, seed_key, body) VALUES ($1, $2, $3)",
    ),
    "notify": ("text, text", "SELECT pg_notify($1, $2)"),
    "purge_messages": ("text", "DELETE FROM {s}.threadline_messages WHERE conversation_id = $1"),
    "purge_runs": ("text", "DELETE FROM {s}.threadline_runs WHERE conversation_id = $1"),
    "purge_admissions": ("text", "DELETE FROM {s}.threadline_admissions WHERE conversation_id = $1"),
    "purge_seeds": ("text", "DELETE FROM {s}.threadline_seeds WHERE conversation_id = $1"),
    "purge_head": ("text", "DELETE FROM {s}.threadline_conversations WHERE conversation_id = $1"),
    "insert_tombstone": ("text", "INSERT INTO {s}.threadline_tombstones (conversation_id) VALUES ($1)"),
}
# A guard fails the transaction (division by zero, SQLSTATE 22012) unless the conversation's rows are as a
# write was told from hints. It is one statement made of the parts its claims need (a *shape*), prepared
# on a connection the first time that shape is used there. $1 is the conversation; each part takes the
# parameters after. A row's JSON holds its own id, so a digest can only match the row it was taken from.
_GUARD_PARTS: dict[str, tuple[tuple[str, ...], str]] = {
    "head": (  # the head's digest; no tombstone
        ("text",),
        "COALESCE((SELECT {d} FROM {s}.threadline_conversations WHERE conversation_id = $1) = ${0}, false) "
        "AND NOT EXISTS (SELECT 1 FROM {s}.threadline_tombstones WHERE conversation_id = $1)",
    ),
    "runs": (  # these runs, with these digests
        ("text[]", "text[]"),
        "(SELECT count(*) FROM {s}.threadline_runs WHERE conversation_id = $1 AND run_id = ANY(${0}) "
        "AND {d} = ANY(${1})) = cardinality(${0})",
    ),
    "no_runs": (
        ("text[]",),
        "NOT EXISTS (SELECT 1 FROM {s}.threadline_runs WHERE conversation_id = $1 AND run_id = ANY(${0}))",
    ),
    "active": (  # exactly these active runs, with these digests
        ("text[]", "text[]"),
        "(SELECT count(*) FROM {s}.threadline_runs WHERE conversation_id = $1 AND active) = cardinality(${0}) "
        "AND (SELECT count(*) FROM {s}.threadline_runs WHERE conversation_id = $1 AND active "
        "AND run_id = ANY(${0}) AND {d} = ANY(${1})) = cardinality(${0})",
    ),
    "messages": (
        ("text[]", "text[]"),
        "(SELECT count(*) FROM {s}.threadline_messages WHERE conversation_id = $1 AND message_id = ANY(${0}) "
        "AND {d} = ANY(${1})) = cardinality(${0})",
    ),
    "no_messages": (
        ("text[]",),
        "NOT EXISTS (SELECT 1 FROM {s}.threadline_messages WHERE conversation_id = $1 AND message_id = ANY(${0}))",
    ),
    "no_keys": (
        ("text[]",),
        "NOT EXISTS (SELECT 1 FROM {s}.threadline_admissions WHERE conversation_id = $1 "
        "AND idempotency_key = ANY(${0}))",
    ),
    "no_inputs": (
        ("text[]",),
        "NOT EXISTS (SELECT 1 FROM {s}.threadline_admissions WHERE conversation_id = $1 "
        "AND input_message_id = ANY(${0}))",
    ),
}
_DIGEST = "encode(sha256(convert_to(body, 'UTF8')), 'hex')"  # :func:`_digest` on the server, any encoding

_PURGE_ORDER = ("purge_messages", "purge_runs", "purge_admissions", "purge_seeds", "purge_head", "insert_tombstone")
_BEGIN_WRITE = b"BEGIN ISOLATION LEVEL READ COMMITTED, READ WRITE"
_BEGIN_READ = b"BEGIN ISOLATION LEVEL REPEATABLE READ, READ ONLY"
# Every statement here is keyed by the conversation (an index lookup whatever the values), so one generic
# plan serves; left to choose, the server re-plans some of them at every EXECUTE (a custom plan folds the
# guard's NULL and empty-array tests). Set once per connection of the driver's own pool; for every
# transaction on a pool passed in, whose sessions are the application's.
_GENERIC_PLANS = b"SET plan_cache_mode TO force_generic_plan"
_GENERIC_PLANS_LOCAL = b"SET LOCAL plan_cache_mode TO force_generic_plan"
_COMMIT = b"COMMIT"


def _render(template: str, schema: str) -> str:
    """``template`` with ``{s}`` replaced by the quoted schema identifier (``psycopg.sql.Identifier``)."""
    return sql.SQL(template).format(s=sql.Identifier(schema)).as_string(None)


class _Statements:
    """Every statement of one schema, rendered once: the ``PREPARE`` text of the prepared ones (their names
    carry a digest of the schema, so drivers of different schemas can share a connection) and the
    ``EXECUTE name(`` prefix of each."""

    def __init__(self, schema: str) -> None:
        self.schema = schema
        tag = hashlib.sha1(schema.encode()).hexdigest()[:12]
        self.prepare = "; ".join(
            f"PREPARE tl_{tag}_{name} ({types}) AS {_render(text, schema)}" for name, (types, text) in _PREPARED.items()
        ).encode()
        self.execute: dict[str, bytes] = {name: f"EXECUTE tl_{tag}_{name}(".encode() for name in _PREPARED}
        self._tag = tag
        self._guards: dict[tuple[str, ...], tuple[bytes, bytes]] = {}
        self.lock_prefix = f"threadline:{schema}:"
        self.channel = notification_channel(schema)
        self._pages: dict[tuple[bool, str, int, str], str] = {}
        self._page_base = _render(
            "SELECT message_id, body FROM {s}.threadline_messages WHERE conversation_id = %s AND position IS NOT NULL",
            schema,
        )

    def guard(self, parts: tuple[str, ...]) -> tuple[bytes, bytes]:
        """The ``PREPARE`` text and the ``EXECUTE name(`` prefix of the guard made of ``parts`` (in
        :data:`_GUARD_PARTS` order)."""
        found = self._guards.get(parts)
        if found is None:
            mask = sum(1 << i for i, part in enumerate(_GUARD_PARTS) if part in parts)
            name = f"tl_{self._tag}_guard{mask:02x}"  # short: identifiers are cut at 63 bytes
            types, conditions = ["text"], []
            for part in parts:
                part_types, condition = _GUARD_PARTS[part]
                numbers = [str(len(types) + 1 + i) for i in range(len(part_types))]
                conditions.append(condition.format(*numbers, d=_DIGEST, s="{s}"))
                types.extend(part_types)
            text = f"SELECT 1 / ({' AND '.join(conditions)})::int"
            prepare = f"PREPARE {name} ({', '.join(types)}) AS {_render(text, self.schema)}"
            found = self._guards[parts] = (prepare.encode(), f"EXECUTE {name}(".encode())
        return found

    def page(self, include_inactive: bool, direction: str, arity: int, op: str) -> str:
        """The page statement for one shape of request (cached: a few dozen shapes exist at most). Not
        prepared: paging is rare, and its shapes many."""
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


class _Wire:
    """One pooled connection as the driver uses it: SQL literals quoted by libpq for that connection
    (``PQescapeLiteral``: its encoding and ``standard_conforming_strings``), and the schemas whose
    statements are prepared on it. Kept per connection object (a new connection starts unprepared)."""

    __slots__ = ("_escape", "encoding", "guards", "prepared", "session_settings")

    def __init__(self, conn: psycopg.AsyncConnection[Any]) -> None:
        self._escape = pq.Escaping(conn.pgconn).escape_literal
        self.encoding = conn.info.encoding
        self.prepared: set[str] = set()
        self.guards: set[bytes] = set()  # the guard shapes prepared (their PREPARE texts)
        self.session_settings = False  # the session is the driver's own: settings were made once

    def literal(self, value: object) -> bytes:
        if isinstance(value, str):
            if "\x00" in value:
                raise psycopg.DataError("PostgreSQL text fields cannot contain NUL (0x00) bytes")
            return self._escape(value.encode(self.encoding))  # type: ignore[no-any-return]
        if value is None:
            return b"NULL"
        if value is True:
            return b"true"
        if value is False:
            return b"false"
        if isinstance(value, int):
            return b"%d" % value
        if isinstance(value, list | tuple):
            if not value:
                return b"'{}'::text[]"
            return b"ARRAY[" + b", ".join(self.literal(v) for v in value) + b"]::text[]"
        raise TypeError(f"cannot send a {type(value).__name__} as an SQL literal")


_WIRES: weakref.WeakKeyDictionary[psycopg.AsyncConnection[Any], _Wire] = weakref.WeakKeyDictionary()


async def _wire(conn: psycopg.AsyncConnection[Any], q: _Statements, driver: PostgresStoreDriver) -> _Wire:
    """The connection's :class:`_Wire`, with ``q``'s statements prepared (one round trip, once per
    connection). A connection on which preparing failed is closed: the pool replaces it, and no statement
    is left half-prepared."""
    wire = _WIRES.get(conn)
    if wire is None:
        wire = _WIRES[conn] = _Wire(conn)
    if q.schema not in wire.prepared:
        driver.round_trips += 1
        driver._own_backend(conn.info.backend_pid)
        own = driver._owns_pool and not wire.session_settings
        try:
            await conn.execute(_GENERIC_PLANS + b"; " + q.prepare if own else q.prepare, prepare=False)
        except BaseException:
            with contextlib.suppress(Exception):
                await conn.close()
            raise
        wire.prepared.add(q.schema)
        wire.session_settings = wire.session_settings or own
    return wire


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


# ------------------------------------------------------------------------------------------------ hints

_HINT_CONVERSATIONS = 4096
_HINT_ROWS = 16  # runs, and messages, per conversation
_HINT_MAX_BODY = 64 * 1024  # characters: a larger message is not remembered
_HINT_MESSAGE_BUDGET = 16 * 1024 * 1024  # characters of message bodies remembered per driver
_MAX_PREDICTED = 8
_BATCH_MAX = 32  # writes committed together in one transaction, at most

_Body = tuple[str, str]  # a row's stored JSON and its digest (:func:`_digest`)


def _digest(body: str) -> str:
    """What a guard compares: ``sha256(convert_to(body, 'UTF8'))`` on the server (whatever its encoding)."""
    return hashlib.sha256(body.encode()).hexdigest()


class _Hint:
    __slots__ = ("active", "head", "message_chars", "messages", "purged", "runs")

    def __init__(self) -> None:
        self.head: _Body | None = None
        self.purged = False
        self.runs: dict[str, _Body] = {}
        self.messages: dict[str, _Body] = {}
        self.message_chars = 0
        self.active: dict[str, None] | None = None  # the ids of exactly the active runs, when known


class _Hints:
    """The rows this driver last read or committed of each recent conversation: its head, its recent runs
    and messages (stored JSON and digest), which runs are active. Bounded: recent conversations, recent rows
    each, a budget of message text.

    They serve twice, never as a plain answer: a *probe* of an operation is answered from them to foresee
    its next requests (:meth:`PostgresStoreDriver._predict`), and a write may answer from them *under
    guard* (:meth:`_PostgresRows._speculate`): the digest of each row it was given is checked by the server,
    under the conversation lock, in the round trip that carries the writes. A wrong hint costs time only.
    """

    def __init__(self, cache: RecordCache) -> None:
        self.by_conversation: OrderedDict[str, _Hint] = OrderedDict()
        self.cache = cache
        self.message_chars = 0

    def get(self, cid: str) -> _Hint | None:
        return self.by_conversation.get(cid)

    def forget(self, cid: str) -> None:
        self._drop(cid)

    def _get(self, cid: str) -> _Hint:
        hint = self.by_conversation.get(cid)
        if hint is None:
            hint = self.by_conversation[cid] = _Hint()
            if len(self.by_conversation) > _HINT_CONVERSATIONS:
                self._drop(next(iter(self.by_conversation)))
        else:
            self.by_conversation.move_to_end(cid)
        return hint

    def _drop(self, cid: str) -> None:
        hint = self.by_conversation.pop(cid, None)
        if hint is not None:
            self.message_chars -= hint.message_chars

    @staticmethod
    def _put(table: dict[str, _Body], key: str, value: _Body) -> _Body | None:
        table.pop(key, None)
        table[key] = value
        if len(table) > _HINT_ROWS:
            return table.pop(next(iter(table)))
        return None

    def _message(self, hint: _Hint, key: str, value: _Body) -> None:
        old = hint.messages.pop(key, None)
        if old is not None:
            hint.message_chars -= len(old[0])
            self.message_chars -= len(old[0])
        if len(value[0]) > _HINT_MAX_BODY:
            return
        evicted = self._put(hint.messages, key, value)
        hint.message_chars += len(value[0]) - (len(evicted[0]) if evicted else 0)
        self.message_chars += len(value[0]) - (len(evicted[0]) if evicted else 0)
        while self.message_chars > _HINT_MESSAGE_BUDGET and self.by_conversation:
            self._drop(next(iter(self.by_conversation)))

    # ------------------------------------------------------------------------------------ learning

    def saw(self, r: Request, rows: list[tuple[Any, ...]]) -> None:
        """Remember the rows the server answered ``r`` with (read under the lock, or in a snapshot)."""
        kind = type(r)
        if kind is LoadHead:
            hint = self._get(r.conversation_id)  # type: ignore[attr-defined]
            body, purged = rows[0]
            hint.head = (body, _digest(body)) if isinstance(body, str) else None
            hint.purged = bool(purged)
        elif kind is LoadRuns or kind is ListActiveRuns:
            hint = self._get(r.conversation_id)  # type: ignore[attr-defined]
            for run_id, body in rows:
                if isinstance(body, str):
                    self._put(hint.runs, run_id, (body, _digest(body)))
            if kind is ListActiveRuns:
                hint.active = dict.fromkeys(run_id for run_id, _ in rows)
        elif kind is LoadMessages:
            hint = self._get(r.conversation_id)  # type: ignore[attr-defined]
            for message_id, body in rows:
                if isinstance(body, str):
                    self._message(hint, message_id, (body, _digest(body)))

    def wrote(self, cid: str, written: list[tuple[str, str, str, bool]]) -> None:
        """Remember the rows of a committed write: ``(table, id, body, active)``; table ``head``, ``run``,
        ``message`` or ``purge``."""
        hint = self._get(cid)
        for table, key, body, active in written:
            if table == "purge":
                self._drop(cid)
                return
            value = (body, _digest(body))
            if table == "head":
                hint.head, hint.purged = value, False
            elif table == "run":
                self._put(hint.runs, key, value)
                if hint.active is not None:
                    if active:
                        hint.active[key] = None
                    else:
                        hint.active.pop(key, None)
            else:
                self._message(hint, key, value)

    # ------------------------------------------------------------------------------------- probing

    def answer(self, r: Request) -> Any:
        """A plausible answer to ``r`` for a probe: the remembered rows, else nothing found."""
        kind = type(r)
        if kind in (LoadReceipt, LoadReceiptByInput, LoadSeed):
            return None
        hint = self.by_conversation.get(getattr(r, "conversation_id", ""))
        if kind is LoadHead:
            if hint is None or hint.head is None:
                return HeadState(None, purged=hint.purged if hint is not None else False)
            return HeadState(self._decode(ConversationHead, hint.head[0]), purged=hint.purged)
        if hint is None:
            return []
        if kind is LoadRuns:
            runs = hint.runs
            return [self._decode(Run, runs[i][0]) for i in r.run_ids if i in runs]  # type: ignore[attr-defined]
        if kind is ListActiveRuns and hint.active is not None:
            runs = hint.runs
            return [self._decode(Run, runs[i][0]) for i in sorted(hint.active) if i in runs]
        return []

    def _decode(self, model: type[M], body: str) -> M:
        return self.cache.get(model, body, lambda: "a remembered row")


# ------------------------------------------------------------------------------------------------- rows


class _Alone(Exception):
    """A write in a batch needs the server before its commit (a row the hints cannot vouch for): it leaves
    the batch and runs in a transaction of its own."""


class _Restart(Exception):
    """What the operation was answered from moved (a read's second snapshot found the conversation
    changed, or a guard of a write failed): run the operation again, without that shortcut."""


class _Guard:
    """The claims one guard statement checks (its parts: :data:`_GUARD_PARTS`), gathered from the answers a write
    was given from hints until the round trip that carries them."""

    __slots__ = (
        "absent_inputs",
        "absent_keys",
        "absent_messages",
        "absent_runs",
        "active",
        "cid",
        "head",
        "messages",
        "runs",
    )

    def __init__(self, cid: str) -> None:
        self.cid = cid
        self.head: str | None = None
        self.runs: dict[str, str] = {}
        self.absent_runs: dict[str, None] = {}
        self.active: dict[str, str] | None = None
        self.messages: dict[str, str] = {}
        self.absent_messages: dict[str, None] = {}
        self.absent_keys: dict[str, None] = {}
        self.absent_inputs: dict[str, None] = {}

    def statement(self, q: _Statements, literal: Callable[[object], bytes]) -> tuple[bytes, bytes]:
        """The ``PREPARE`` text of this guard's shape and the ``EXECUTE`` that checks its claims."""
        parts: list[str] = []
        values: list[object] = [self.cid]
        for part, claim in (
            ("head", self.head),
            ("runs", self.runs),
            ("no_runs", self.absent_runs),
            ("active", self.active),
            ("messages", self.messages),
            ("no_messages", self.absent_messages),
            ("no_keys", self.absent_keys),
            ("no_inputs", self.absent_inputs),
        ):
            if claim is None or (not claim and part != "active"):
                continue
            parts.append(part)
            if isinstance(claim, str):
                values.append(claim)
            elif part in ("runs", "active", "messages"):
                values += [list(claim), list(claim.values())]  # type: ignore[union-attr]
            else:
                values.append(list(claim))
        prepare, execute = q.guard(tuple(parts))
        return prepare, execute + b", ".join([literal(v) for v in values]) + b")"


# the tables a request's rows come from (first column: the row's id), for what a write knows exists
_ROW_TABLE: dict[type, str] = {
    **dict.fromkeys((LoadRuns, ListActiveRuns, LoadAllRuns, LoadRunsSince), "run"),
    **dict.fromkeys(
        (LoadMessages, LoadSettledRange, LoadHistory, LoadMessagesSince, LoadUnsettled, PageSettled), "message"
    ),
}

_ANCHOR = object()  # the result slot of a continued read's head check
_RAW = object()  # the result slot of a raw statement (left current on the cursor)
_NONE = object()


class _PostgresRows:
    """The :class:`~threadline.store.driver.AsyncRows` primitives over one connection inside one transaction.

    Statements that need no answer (``BEGIN``, the conversation lock, writes) wait in ``pending`` and go to
    the server in front of the next statement that needs an answer, or in front of ``COMMIT``: one
    simple-protocol query string, one round trip. A request that needs an answer goes together with the
    requests the operation is predicted to make next (``predict``: the driver's probe); their rows wait in
    ``known`` until the operation asks. In a write transaction the first statement naming a conversation
    is preceded by that conversation's advisory lock.

    A read whose requests were all foreseen ends its snapshot (``COMMIT``) in the same round trip. Should
    it ask for more, a new snapshot is opened and the conversation head read again: every committed write
    of a conversation rewrites its head (a higher version) or deletes it (purge), so an unchanged head means
    no commit in between, and the two snapshots agree on that conversation. A moved head is
    :class:`_Restart`.
    """

    def __init__(
        self,
        conn: psycopg.AsyncConnection[Any],
        q: _Statements,
        cache: RecordCache,
        access: Access,
        wire: _Wire,
        hints: _Hints,
    ) -> None:
        self.conn = conn
        self.cur = conn.cursor()
        self.q = q
        self.cache = cache
        self.wire = wire
        self.hints = hints
        self.writable = access == "write"
        self.speculate = False  # a write may answer from hints under guard
        self.unverified = False  # guards of answers given are pending
        self.round_trips = 0  # batches answered
        self.sent = 0  # batches sent (answered or failed)
        self.wrote: list[tuple[str, str, str, bool]] = []  # (table, id, body, active) for the hints
        self.pending: list[str | bytes | _Guard] = [_BEGIN_WRITE if self.writable else _BEGIN_READ]
        self.begin_settings: tuple[bytes, ...] = () if wire.session_settings else (_GENERIC_PLANS_LOCAL,)
        self.pending.extend(self.begin_settings)
        self.guard: _Guard | None = None  # the guard gathering claims, already in ``pending``
        self.open = True  # a transaction is open (or opens with what is pending)
        self.locked: set[str] = set()
        self.written: list[str] = []
        # (table, conversation, id) of the rows this write transaction knows exist: read under the lock,
        # vouched for by its guard, or written by it. Only a purge deletes rows, and it takes the same lock.
        self.present: set[tuple[str, str, str]] = set()
        self.known: dict[Request, list[tuple[Any, ...]]] = {}
        self.predict: Callable[[Request], tuple[list[Request], bool]] | None = None
        self.anchor_request: LoadHead | None = None  # a read's first request, when it may end its snapshot early
        self.anchor: tuple[str, tuple[Any, ...]] | None = None
        self._binder: psycopg.AsyncClientCursor[Any] | None = None
        self.deferred = False  # a member of a batch: it sends nothing, and a request needing the server is _Alone

    # ------------------------------------------------------------------------ statements and batches

    def _x(self, name: str, *values: object) -> bytes:
        literal = self.wire.literal
        return self.q.execute[name] + b", ".join([literal(v) for v in values]) + b")"

    def _bind(self, statement: str, params: Sequence[object] | dict[str, object]) -> bytes:
        if self._binder is None:
            self._binder = psycopg.AsyncClientCursor(self.conn)
        return self._binder.mogrify(statement, params).encode(self.wire.encoding)

    def _statement(self, r: Request) -> bytes | None:
        """The statement answering ``r`` (``None``: the answer is empty without asking)."""
        kind = type(r)
        x = self._x
        if kind is LoadHead:
            return x("head", r.conversation_id)  # type: ignore[attr-defined]
        if kind is LoadRuns:
            assert isinstance(r, LoadRuns)
            ids = list(dict.fromkeys(r.run_ids))
            if not ids:
                return None
            return x("run", r.conversation_id, ids[0]) if len(ids) == 1 else x("runs_any", r.conversation_id, ids)
        if kind is LoadMessages:
            assert isinstance(r, LoadMessages)
            ids = list(dict.fromkeys(r.message_ids))
            if not ids:
                return None
            if len(ids) == 1:
                return x("message", r.conversation_id, ids[0])
            return x("messages_any", r.conversation_id, ids)
        if kind is ListActiveRuns:
            return x("active_runs", r.conversation_id)  # type: ignore[attr-defined]
        if kind is LoadReceipt:
            assert isinstance(r, LoadReceipt)
            return x("receipt", r.conversation_id, r.idempotency_key)
        if kind is LoadReceiptByInput:
            assert isinstance(r, LoadReceiptByInput)
            return x("receipt_by_input", r.conversation_id, r.input_message_id)
        if kind is LoadMessagesSince:
            assert isinstance(r, LoadMessagesSince)
            name = "messages_since" if r.include_inactive else "active_messages_since"
            return x(name, r.conversation_id, _clamp(r.version))
        if kind is LoadRunsSince:
            assert isinstance(r, LoadRunsSince)
            return x("runs_since", r.conversation_id, _clamp(r.version))
        if kind is LoadAllRuns:
            return x("all_runs", r.conversation_id)  # type: ignore[attr-defined]
        if kind is LoadSettledRange:
            assert isinstance(r, LoadSettledRange)
            return x("settled_range", r.conversation_id, _clamp(r.lo), _clamp(r.hi))
        if kind is LoadSeed:
            assert isinstance(r, LoadSeed)
            return x("seed", r.conversation_id, r.seed_key)
        if kind is LoadHistory:
            return x("history", r.conversation_id)  # type: ignore[attr-defined]
        if kind is LoadUnsettled:
            return x("unsettled", r.conversation_id)  # type: ignore[attr-defined]
        if kind is PageSettled:
            assert isinstance(r, PageSettled)
            params: list[object] = [r.conversation_id]
            if r.cursor is None:
                statement = self.q.page(r.include_inactive, r.direction, 0, "")
            else:
                arity, op, values = _cursor_shape(r.cursor, r.direction)
                statement = self.q.page(r.include_inactive, r.direction, arity, op)
                params.extend(values)
            params.append(r.limit)
            return self._bind(statement, params)
        if kind is ScanActiveRuns:
            assert isinstance(r, ScanActiveRuns)
            if r.after is None:
                return x("scan_first", r.limit)
            return x("scan_after", r.after[0], r.after[1], r.limit)
        if kind is ListConversations:
            assert isinstance(r, ListConversations)
            return x("conversations_first", r.limit) if r.after is None else x("conversations_after", r.after, r.limit)
        raise AssertionError(f"no statement answers {kind.__name__}")

    def _lock(self, conversation_id: str, into: list[bytes | str | _Guard] | None = None) -> None:
        if self.writable and conversation_id not in self.locked:
            self.locked.add(conversation_id)
            (self.pending if into is None else into).append(self._x("lock", self.q.lock_prefix + conversation_id))

    async def _send(self, requests: Sequence[Request] = (), ends: bool = False, raw: bytes | None = None) -> None:
        """One round trip: what is pending, then a statement for each of ``requests`` (rows into ``known``),
        then ``raw`` (its result left current on the cursor). A read ends its snapshot here when ``ends``."""
        if self.deferred:
            raise _Alone
        statements: list[str | bytes | _Guard] = []
        slots: list[object] = []
        if not self.open:  # a read continuing after its snapshot ended: a new one, checked against the first
            assert self.anchor is not None
            statements += [_BEGIN_READ, *self.begin_settings, self._x("head", self.anchor[0])]
            slots += [None] * (1 + len(self.begin_settings)) + [_ANCHOR]
            self.open = True
        statements += self.pending
        slots += [None] * len(self.pending)
        self.pending = []
        scope = getattr(requests[0], "conversation_id", None) if requests else None
        for i, r in enumerate(requests):
            cid = getattr(r, "conversation_id", None)
            if i and self.writable and cid != scope:
                continue  # a write locks the one conversation it touches, never a foreseen other
            statement = self._statement(r)
            if statement is None:
                self.known[r] = []
                continue
            if cid is not None:
                self._lock(cid, statements)
                slots += [None] * (len(statements) - len(slots))
            statements.append(statement)
            slots.append(r)
        if raw is not None:
            statements.append(raw)
            slots.append(_RAW)
        elif (
            ends
            and not self.writable
            and (self.anchor is not None or (self.anchor_request is not None and self.anchor_request in requests))
        ):
            statements.append(_COMMIT)
            slots.append(None)
            self.open = False
        wire = self.wire
        encoding = wire.encoding
        cur = self.cur
        self.guard = None
        rendered: list[bytes] = []
        for s in statements:
            if isinstance(s, _Guard):
                prepare, execute = s.statement(self.q, wire.literal)
                if prepare not in wire.guards:  # a shape new to this connection: prepared on its own
                    self.sent += 1
                    try:
                        await cur.execute(prepare, prepare=False)
                    except BaseException:  # prepared or not: unknown; the pool replaces a closed connection
                        with contextlib.suppress(Exception):
                            await self.conn.close()
                        raise
                    wire.guards.add(prepare)
                rendered.append(execute)
            else:
                rendered.append(s if isinstance(s, bytes) else s.encode(encoding))
        text = b"; ".join(rendered)
        self.sent += 1
        try:
            await cur.execute(text, prepare=False)
        except psycopg.errors.DivisionByZero as error:
            if self.unverified:  # a guard failed: a hint the operation was answered from is stale
                raise _Restart from error
            raise
        self.round_trips += 1
        self.unverified = False
        saw = self.hints.saw
        for i, slot in enumerate(slots):
            if i and not cur.nextset():
                raise AssertionError("a statement of the batch returned no result")
            if slot is None or slot is _RAW:
                continue
            rows = await cur.fetchall()
            if slot is _ANCHOR:
                assert self.anchor is not None
                if rows[0] != self.anchor[1]:
                    raise _Restart
                continue
            self.known[slot] = rows  # type: ignore[index]
            saw(slot, rows)  # type: ignore[arg-type]
            if slot is self.anchor_request and self.anchor is None:
                self.anchor = (self.anchor_request.conversation_id, rows[0])

    async def _rows(self, r: Request) -> list[tuple[Any, ...]]:
        rows = self.known.pop(r, _NONE)
        if rows is _NONE and self.speculate:
            rows = self._speculate(r)
        if rows is _NONE:
            requests, ends = self.predict(r) if self.predict is not None else ([r], False)
            await self._send(requests, ends)
            rows = self.known.pop(r)
        if self.writable:
            kind = type(r)
            cid: str = getattr(r, "conversation_id", "")
            if kind is LoadHead:
                if rows[0][0] is not None:  # type: ignore[index]
                    self.present.add(("head", cid, cid))
            else:
                table = _ROW_TABLE.get(kind)
                if table is not None:
                    self.present.update((table, cid, row[0]) for row in rows)  # type: ignore[union-attr]
        return rows  # type: ignore[return-value]

    def _speculate(self, r: Request) -> Any:
        """The rows answering ``r`` as the hints remember them — or, for an id never seen, no row — with
        what they claim added to the guard that the next round trip carries (after the lock): the server
        fails the transaction unless it holds exactly those rows. ``_NONE``: no claim worth making."""
        cid: str = getattr(r, "conversation_id", "")
        hint = self.hints.get(cid)
        if hint is None or hint.head is None or hint.purged:
            return _NONE  # a conversation this driver has not seen live: read it
        guard = self.guard
        if guard is None:
            guard = _Guard(cid)
        elif guard.cid != cid:
            return _NONE
        kind = type(r)
        rows: list[tuple[Any, ...]] = []
        if kind is LoadHead:
            if guard.head not in (None, hint.head[1]):
                return _NONE
            guard.head = hint.head[1]
            rows = [(hint.head[0], False)]
        elif kind is LoadRuns or kind is LoadMessages:
            messages = kind is LoadMessages
            ids = list(dict.fromkeys(r.message_ids if messages else r.run_ids))  # type: ignore[attr-defined]
            table, present, absent = (
                (hint.messages, guard.messages, guard.absent_messages)
                if messages
                else (hint.runs, guard.runs, guard.absent_runs)
            )
            inputs = self._inputs(hint) if messages and any(i not in table for i in ids) else ()
            for i in ids:
                body = table.get(i)
                if body is None:
                    if i in present or i in inputs:  # an input of a run: it exists, written elsewhere
                        return _NONE
                elif i in absent or present.get(i, body[1]) != body[1]:
                    return _NONE
            for i in ids:
                body = table.get(i)
                if body is None:
                    absent[i] = None
                else:
                    present[i] = body[1]
                    rows.append((i, body[0]))
        elif kind is ListActiveRuns:
            if hint.active is None or any(i not in hint.runs for i in hint.active):
                return _NONE
            active = {i: hint.runs[i][1] for i in sorted(hint.active)}
            if guard.active is not None and guard.active != active:
                return _NONE
            guard.active = active
            rows = [(i, hint.runs[i][0]) for i in active]
        elif kind is LoadReceipt:
            guard.absent_keys[r.idempotency_key] = None  # type: ignore[attr-defined]
        elif kind is LoadReceiptByInput:
            guard.absent_inputs[r.input_message_id] = None  # type: ignore[attr-defined]
        else:
            return _NONE
        if self.guard is None:
            self._lock(cid)
            self.pending.append(guard)
            self.guard = guard
        self.unverified = True
        return rows

    def _inputs(self, hint: _Hint) -> set[str]:
        """The input message ids of the runs the hints remember (they exist, though maybe never seen)."""
        out: set[str] = set()
        for body, _ in hint.runs.values():
            out.update(self.cache.get(Run, body, lambda: "a remembered run").input_message_ids)
        return out

    async def _execute(self, statement: str, params: Sequence[object] | dict[str, object]) -> None:
        """Run ``statement`` (after whatever is pending) and leave its result current on ``cur``."""
        await self._send(raw=self._bind(statement, params))

    async def _fetch(self, statement: str, params: Sequence[object]) -> list[tuple[Any, ...]]:
        await self._execute(statement, params)
        return await self.cur.fetchall()

    async def commit(self) -> None:
        """Send what is pending, then ``COMMIT``, in one round trip. A read that ended its snapshot early
        only makes sure its connection is still there (as a ``COMMIT`` would have)."""
        if self.open or self.pending:
            self.pending.append(_COMMIT)
            await self._send()
            self.open = False
        else:
            await self._check_alive()

    async def _check_alive(self) -> None:
        """Raise ``OperationalError`` if the server dropped this idle connection: an idle socket that is
        readable holds a notice or the server's goodbye; a round trip tells which."""
        try:
            ready = bool(select.select([self.conn.pgconn.socket], [], [], 0)[0])
        except (OSError, ValueError, psycopg.Error):
            ready = True
        if ready:
            self.sent += 1
            await self.cur.execute(b"SELECT 1", prepare=False)

    # ------------------------------------------------------------------ decoding rows of one table

    def _runs(self, conversation_id: str, rows: Iterable[tuple[Any, ...]]) -> list[Run]:
        out = []
        get = self.cache.get
        for run_id, body in rows:
            run = get(Run, body, lambda r=run_id: f"threadline_runs conversation_id={conversation_id} run_id={r}")
            if run.id != run_id or run.conversation_id != conversation_id:
                where = f"threadline_runs conversation_id={conversation_id} run_id={run_id}"
                raise foreign("Run", where, f"{conversation_id}/{run_id}", f"{run.conversation_id}/{run.id}")
            out.append(run)
        return out

    def _messages(self, conversation_id: str, rows: Iterable[tuple[Any, ...]]) -> list[Message]:
        out = []
        for message_id, body in rows:
            where = f"threadline_messages conversation_id={conversation_id} message_id={message_id}"
            message = decode(Message, body, where)
            if message.id != message_id or message.conversation_id != conversation_id:
                raise foreign(
                    "Message", where, f"{conversation_id}/{message_id}", f"{message.conversation_id}/{message.id}"
                )
            out.append(message)
        return out

    def _head(self, conversation_id: str, body: object) -> ConversationHead:
        def where() -> str:
            return f"threadline_conversations conversation_id={conversation_id}"

        head = self.cache.get(ConversationHead, body, where)
        if head.conversation_id != conversation_id:
            raise foreign("ConversationHead", where(), conversation_id, head.conversation_id)
        return head

    def _receipt(self, conversation_id: str, rows: list[tuple[Any, ...]]) -> AdmissionReceipt | None:
        if not rows:
            return None
        key, body = rows[0]
        where = f"threadline_admissions conversation_id={conversation_id} idempotency_key={key}"
        receipt = decode(AdmissionReceipt, body, where)
        if receipt.conversation_id != conversation_id or receipt.idempotency_key != key:
            raise foreign(
                "AdmissionReceipt",
                where,
                f"{conversation_id}/{key}",
                f"{receipt.conversation_id}/{receipt.idempotency_key}",
            )
        return receipt

    # ------------------------------------------------------------------------------- the primitives

    async def load_head(self, r: LoadHead) -> HeadState:
        cid = r.conversation_id
        rows = await self._rows(r)
        if not rows:  # pragma: no cover - a scalar SELECT always answers one row
            raise AssertionError("the head query returned no row")
        body, purged = rows[0]
        return HeadState(self._head(cid, body) if body is not None else None, purged=bool(purged))

    async def load_runs(self, r: LoadRuns) -> list[Run]:
        if not r.run_ids:
            return []
        found = {run.id: run for run in self._runs(r.conversation_id, await self._rows(r))}
        return [found[i] for i in r.run_ids if i in found]

    async def list_active_runs(self, r: ListActiveRuns) -> list[Run]:
        return self._runs(r.conversation_id, await self._rows(r))

    async def load_all_runs(self, r: LoadAllRuns) -> list[Run]:
        return self._runs(r.conversation_id, await self._rows(r))

    async def load_receipt(self, r: LoadReceipt) -> AdmissionReceipt | None:
        return self._receipt(r.conversation_id, await self._rows(r))

    async def load_receipt_by_input(self, r: LoadReceiptByInput) -> AdmissionReceipt | None:
        return self._receipt(r.conversation_id, await self._rows(r))

    async def load_messages(self, r: LoadMessages) -> list[Message]:
        if not r.message_ids:
            return []
        found = {m.id: m for m in self._messages(r.conversation_id, await self._rows(r))}
        return [found[i] for i in dict.fromkeys(r.message_ids) if i in found]

    async def load_settled_range(self, r: LoadSettledRange) -> list[Message]:
        return self._messages(r.conversation_id, await self._rows(r))

    async def load_seed(self, r: LoadSeed) -> SeedRecord | None:
        rows = await self._rows(r)
        if not rows:
            return None
        key, body = rows[0]
        where = f"threadline_seeds conversation_id={r.conversation_id} seed_key={key}"
        seed = self.cache.get(SeedRecord, body, lambda: where)
        if seed.conversation_id != r.conversation_id or seed.seed_key != r.seed_key:
            raise foreign(
                "SeedRecord", where, f"{r.conversation_id}/{r.seed_key}", f"{seed.conversation_id}/{seed.seed_key}"
            )
        return seed

    async def load_history(self, r: LoadHistory) -> list[Message]:
        return self._messages(r.conversation_id, await self._rows(r))

    async def load_messages_since(self, r: LoadMessagesSince) -> list[Message]:
        return self._messages(r.conversation_id, await self._rows(r))

    async def load_runs_since(self, r: LoadRunsSince) -> list[Run]:
        return self._runs(r.conversation_id, await self._rows(r))

    async def load_unsettled(self, r: LoadUnsettled) -> list[Message]:
        return self._messages(r.conversation_id, await self._rows(r))

    async def page_settled(self, r: PageSettled) -> list[Message]:
        return self._messages(r.conversation_id, await self._rows(r))

    async def scan_active_runs(self, r: ScanActiveRuns) -> list[Run]:
        out: list[Run] = []
        for cid, run_id, body in await self._rows(r):
            out.extend(self._runs(cid, ((run_id, body),)))
        return out

    async def list_conversations(self, r: ListConversations) -> list[ConversationHead]:
        return [self._head(cid, body) for cid, body in await self._rows(r)]

    async def write(self, r: Write) -> None:
        if not self.writable:
            raise AssertionError("a read operation wrote")
        m = r.mutation
        if m.head is None:
            raise AssertionError("every mutation writes the conversation head")
        cid = m.head.conversation_id
        self._lock(cid)
        self.written.append(cid)
        self.known.clear()  # rows read ahead predate this write
        x, encode, pending, wrote = self._x, self.cache.encode, self.pending, self.wrote
        # one statement per row, so a row written twice in one mutation keeps its last version, as in memory
        body = encode(m.head)
        pending.append(x(self._verb("head", cid, cid) + "_head", cid, m.head.version, body))
        wrote.append(("head", cid, body, True))
        for run in m.runs:
            body = encode(run)
            verb = self._verb("run", run.conversation_id, run.id)
            pending.append(x(verb + "_run", run.conversation_id, run.id, run.active, run.version, body))
            wrote.append(("run", run.id, body, run.active))
            if run.state in ("interrupt_requested", "queued"):
                # delivered at COMMIT: executors learn of a durable interrupt at once, workers of new work
                event = "interrupt" if run.state == "interrupt_requested" else "queued"
                payload = json.dumps({"event": event, "conversation_id": run.conversation_id, "run_id": run.id})
                pending.append(x("notify", self.q.channel, payload))
        for msg in m.messages:
            body = encode(msg)
            pending.append(
                x(
                    self._verb("message", msg.conversation_id, msg.id) + "_message",
                    msg.conversation_id,
                    msg.id,
                    0 if msg.band == "lead" else 1,
                    msg.position,
                    1 if msg.role == "summary" else 0,
                    msg.seq,
                    msg.active,
                    msg.version,
                    body,
                )
            )
            wrote.append(("message", msg.id, body, msg.active))
        for rc in m.receipts:
            pending.append(x("insert_receipt", rc.conversation_id, rc.idempotency_key, rc.input.id, encode(rc)))
        for seed in m.seeds:
            pending.append(x("insert_seed", seed.conversation_id, seed.seed_key, encode(seed)))

    def _verb(self, table: str, cid: str, key: str) -> str:
        """``update`` for a row known to exist, else ``upsert``; either way the row exists afterwards."""
        row = (table, cid, key)
        if row in self.present:
            return "update"
        self.present.add(row)
        return "upsert"

    async def purge(self, r: Purge) -> None:
        if not self.writable:
            raise AssertionError("a read operation purged")
        cid = r.conversation_id
        self._lock(cid)
        self.written.append(cid)
        self.known.clear()
        self.pending.extend(self._x(name, cid) for name in _PURGE_ORDER)
        self.wrote.append(("purge", cid, "", False))


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


class _Member:
    """A write waiting for, or in, a batch: its operation, the first request it asked, and where its
    outcome goes (``(result, stats)``; ``None``: run alone; or an error)."""

    __slots__ = ("cid", "done", "op", "request")

    def __init__(self, op: Operation[Any], request: Request, done: asyncio.Future[Any]) -> None:
        self.op = op
        self.request = request
        self.cid: str = request.conversation_id  # type: ignore[union-attr]
        self.done = done

    def resolve(self, outcome: Any) -> None:
        if not self.done.done():
            self.done.set_result(outcome)

    def fail(self, error: BaseException) -> None:
        if not self.done.done():
            self.done.set_exception(error)


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
    failed before receiving its first answer, and takes none of the round-trip shortcuts (they need to run
    the operation again). ``retries`` counts transactions run again.
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
        # callers beyond the pool's size wait here, in FIFO order, not inside the pool: a waiter in the
        # pool costs a timer and a wake-up per check, and with 100 conversations on 10 connections that
        # was a tenth of the client's CPU
        self._gate = asyncio.Semaphore(pool.max_size if pool is not None else max_size)
        self.max_attempts = max_attempts
        self.where = _describe(dsn if dsn is not None else (pool.conninfo if pool is not None else ""))
        self._q = _Statements(schema)
        self._cache = RecordCache(_CACHE_BUDGET)
        self._opened = False
        self._closed = False
        self._open_lock = asyncio.Lock()
        self._in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self.retries = 0
        """Transactions run again after a serialization failure, deadlock or dead pooled connection."""
        self.round_trips = 0
        """Round trips to the server by store operations (preparing statements and rollbacks included)."""
        self.restarts = 0
        """Operations run again because a shortcut met moved rows (a read's second snapshot found its
        conversation changed; a write's guard failed): not failures."""
        self.prefetch = True
        """Read the rows an operation is foreseen to ask for together with the ones it asks for now."""
        self.speculate = True
        """Let a write answer from the rows last seen, each checked by the server in the write's round trip."""
        self._hints = _Hints(self._cache)
        self._own_backends: set[int] = set()  # server pids of this driver's connections
        self.rows_wrapper: Callable[[_PostgresRows], Any] | None = None
        """Testing seam: wraps the row primitives of every transaction (for fault injection)."""
        self.batch_writes = True
        """Group commit: writes of different conversations that find every connection busy are committed
        together, in one transaction and one round trip (see :meth:`_batched`)."""
        self.batches = 0
        """Transactions that committed more than one write."""
        self._queue: deque[_Member] = deque()  # writes waiting for a batch
        self._leader_waiting = False  # a task waits for a connection to commit the next batch
        self._leaders: set[asyncio.Task[None]] = set()
        self._batching: set[str] = set()  # conversations with a write in a batch in flight

    @property
    def pool(self) -> AsyncConnectionPool[Any] | None:
        return self._pool

    async def listen(self, callback: Callable[[dict[str, Any]], None]) -> Callable[[], Awaitable[None]]:
        """Deliver this store's notifications (``{"event": "interrupt" | "queued", "conversation_id",
        "run_id"}``, sent by other processes' commits) to ``callback`` on the event loop, over one
        dedicated connection, until the returned ``stop()`` is awaited. A notification is a hint to look
        now; the durable record stays the authority (a missed one is caught by the next CAS or sweep).
        One from another process also makes the driver forget what it last saw of that conversation, so
        its next write reads the rows instead of guarding stale ones."""
        conninfo = self._dsn if self._dsn is not None else (self._pool.conninfo if self._pool is not None else "")
        try:
            conn = await psycopg.AsyncConnection.connect(conninfo, autocommit=True, connect_timeout=self._timeout)
            await conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(self._q.channel)))
        except psycopg.Error as error:
            raise AgentStoreUnavailableError(f"cannot listen on {self.where}: {error}") from error

        async def pump() -> None:
            async for notify in conn.notifies():
                try:
                    note = json.loads(notify.payload)
                    if notify.pid not in self._own_backends:  # another process wrote this conversation
                        self._hints.forget(str(note.get("conversation_id")))
                    callback(note)
                except Exception:
                    continue

        task = asyncio.ensure_future(pump())

        async def stop() -> None:
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
            await conn.close()

        return stop

    def _own_backend(self, pid: int) -> None:
        if len(self._own_backends) >= _HINT_CONVERSATIONS:
            self._own_backends.clear()
        self._own_backends.add(pid)

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
                    kwargs={"autocommit": True, "prepare_threshold": None},  # statements are prepared by the driver
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
            if factory is not None and access == "write" and self._batchable(request):
                outcome = await self._batched(op, request)
                if outcome is not None:
                    _merge(stats, outcome[1])
                    return outcome[0]  # type: ignore[no-any-return]
                op = factory()  # it needs a transaction of its own: from the start
                request = op.send(None)
            attempts, replaced, shortcuts = 0, False, True
            while True:
                attempts += 1
                attempt = _Attempt()
                part = OperationStats()
                try:
                    result = await self._transaction(op, request, access, part, attempt, factory, shortcuts)
                    _merge(stats, part)
                    return result
                except _Restart:
                    # what the operation was answered from moved: again, reading everything it asks for
                    assert factory is not None  # shortcuts are taken only with a factory
                    self.restarts += 1
                    attempts -= 1
                    shortcuts = False
                    op.close()
                    op = factory()  # type: ignore[misc]
                    request = op.send(None)
                    continue
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
                        not replaced
                        and not self._closed
                        and (
                            # the connection lost our prepared statements (a pool's reset ran DISCARD ALL)
                            (state == _UNPREPARED_SQLSTATE and (fresh or factory is not None))
                            # a pooled connection the server dropped while idle: take another
                            or (
                                isinstance(error, psycopg.OperationalError)
                                and not isinstance(error, psycopg.errors.QueryCanceled)
                                and attempt.connected  # a connection was taken: not a pool timeout
                                and not attempt.committing
                                and (attempt.rows is None or not attempt.rows.round_trips)  # nothing came back
                                and (fresh or factory is not None)
                            )
                        )
                    ):
                        replaced = True
                        self.retries += 1
                        if state == _UNPREPARED_SQLSTATE and attempt.rows is not None:
                            attempt.rows.wire.prepared.clear()  # the session was reset: settings went too
                            attempt.rows.wire.guards.clear()
                            attempt.rows.wire.session_settings = False
                        if not fresh:
                            op.close()
                            op = factory()  # type: ignore[misc]
                            request = op.send(None)
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

    # ------------------------------------------------------------------------------ group commit

    def _batchable(self, request: Request) -> bool:
        """Whether a write whose first request is ``request`` waits for a batch: group commit is on, the
        write can answer from hints under guard (a conversation seen live), and it would wait anyway (no
        connection is free, or writes are waiting already, or one of its conversation is in a batch)."""
        cid = getattr(request, "conversation_id", None)
        if not (self.batch_writes and self.speculate and isinstance(cid, str)):
            return False
        hint = self._hints.get(cid)
        if hint is None or hint.head is None or hint.purged:
            return False
        return self._gate.locked() or bool(self._queue) or cid in self._batching

    async def _batched(self, op: Operation[T], request: Request) -> tuple[T, OperationStats] | None:
        """Commit the write ``op`` (which asked ``request`` first) together with other writes waiting at the
        same moment: ``(result, stats)``, or ``None`` when it must run alone from the start — it needs the
        server before its commit, or the batch failed before committing (nothing of it was written).

        The batch is one transaction: each write's lock, guard and statements in turn, then ``COMMIT``; it
        commits all of them or none. A batch holds at most one write per conversation, and takes its
        locks in conversation order, so batches cannot deadlock with each other. ``op`` belongs to the batch
        from here on (it closes it). Cancelled while it waits, the write is dropped unwritten; cancelled
        once its batch is on its way, it may commit, like a write whose ``COMMIT`` was sent."""
        done: asyncio.Future[tuple[T, OperationStats] | None] = asyncio.get_running_loop().create_future()
        self._queue.append(_Member(op, request, done))
        self._kick()
        return await done

    def _kick(self) -> None:
        """Have a task wait for the next free connection to commit what is queued (one waits at a time)."""
        if self._queue and not self._leader_waiting:
            self._leader_waiting = True
            task = asyncio.ensure_future(self._lead())
            self._leaders.add(task)
            task.add_done_callback(self._leaders.discard)

    async def _lead(self) -> None:
        gate = self._gate
        try:
            if gate.locked():
                async with asyncio.timeout(self._timeout):
                    await gate.acquire()
            else:
                await gate.acquire()
        except BaseException as error:
            # no connection came free in time (or the loop is closing): each waiting write goes alone, and
            # waits (and times out) on its own
            self._leader_waiting = False
            while self._queue:
                self._queue.popleft().resolve(None)
            if isinstance(error, TimeoutError):
                return
            raise
        self._leader_waiting = False
        batch = self._take()
        try:
            if batch:
                self._kick()  # what is still queued waits for the next connection that comes free
                await self._commit_batch(batch)
        finally:
            gate.release()
            for member in batch:
                self._batching.discard(member.cid)
            if batch:
                self._kick()  # writes held back for these conversations can go now

    def _take(self) -> list[_Member]:
        """The next batch, in queue order: at most one write per conversation, none of a conversation
        whose batch is still in flight (that write is answered from hints the batch will change)."""
        batch: list[_Member] = []
        held: list[_Member] = []
        queue, batching = self._queue, self._batching
        while queue and len(batch) < _BATCH_MAX:
            member = queue.popleft()
            if member.done.done():  # its caller was cancelled while it waited
                member.op.close()
            elif member.cid in batching:
                held.append(member)
            else:
                batching.add(member.cid)
                batch.append(member)
        queue.extendleft(reversed(held))
        return batch

    async def _commit_batch(self, batch: list[_Member]) -> None:
        """Build each write of ``batch`` on hints, send them with one ``COMMIT``, and answer each write once
        the connection is back in the pool: its result, ``None`` (alone, from the start) or an error."""
        pool = self._pool
        built: list[tuple[_Member, _PostgresRows, Any, OperationStats]] = []
        outcomes: dict[_Member, Any] = {}  # no entry: None
        committing = False
        try:
            if pool is None:
                return
            async with pool.connection(timeout=self._timeout) as conn:
                restore = not conn.autocommit
                if restore:
                    await conn.set_autocommit(True)
                try:
                    if not _idle_and_quiet(conn):
                        await conn.close()
                        return
                    wire = await _wire(conn, self._q, self)
                    for member in sorted(batch, key=lambda m: m.cid):  # one lock order for every batch
                        done = await self._build(conn, wire, member)
                        if done is not None:
                            built.append((member, *done))
                    if not built:
                        return
                    carrier = _PostgresRows(conn, self._q, self._cache, "write", wire, self._hints)
                    for _, rows, _, _ in built:
                        carrier.pending += rows.pending[1 + len(rows.begin_settings) :]
                    carrier.pending.append(_COMMIT)
                    carrier.unverified = True
                    committing = True
                    try:
                        await carrier._send()
                    except (_Restart, psycopg.Error) as error:
                        if isinstance(error, psycopg.OperationalError) and not isinstance(
                            error, psycopg.errors.QueryCanceled
                        ):
                            raise  # the connection went with the COMMIT on its way: unknown
                        committing = False  # a guard or a statement failed: nothing committed
                        self.round_trips += await _rollback(conn)
                        return
                    finally:
                        self.round_trips += carrier.sent
                    committing = False
                    if len(built) > 1:
                        self.batches += 1
                    for member, rows, result, part in built:
                        if rows.wrote:
                            self._hints.wrote(rows.written[0], rows.wrote)
                        outcomes[member] = (result, part)
                finally:
                    if restore and not conn.closed and conn.info.transaction_status == TransactionStatus.IDLE:
                        await conn.set_autocommit(False)
        except BaseException as error:
            if not committing:
                if isinstance(error, Exception):
                    return  # no connection, or none that works: each write meets that alone, and reports it
                raise
            unknown = self._unavailable(error, "a batched write failed", unknown_commit=True)
            for member, _, _, _ in built:
                self._hints.forget(member.cid)
                outcomes[member] = unknown
            if not isinstance(error, Exception):
                raise
        finally:
            for member in batch:
                outcome = outcomes.get(member)
                if isinstance(outcome, BaseException):
                    member.fail(outcome)
                else:
                    member.resolve(outcome)

    async def _build(
        self, conn: psycopg.AsyncConnection[Any], wire: _Wire, member: _Member
    ) -> tuple[_PostgresRows, Any, OperationStats] | None:
        """Run ``member``'s operation to its end on hints alone (nothing is sent): its statements wait in
        the rows' ``pending``. None when it needs the server first, or raised (alone, it meets that again,
        or gets past it on the stored rows)."""
        rows = _PostgresRows(conn, self._q, self._cache, "write", wire, self._hints)
        rows.deferred = rows.speculate = True
        target: Any = self.rows_wrapper(rows) if self.rows_wrapper is not None else rows
        part = OperationStats()
        op, request = member.op, member.request
        try:
            while True:
                if isinstance(request, Purge):
                    return None
                answer = await getattr(target, _SYNC_DISPATCH[type(request)])(request)
                if isinstance(request, Write):
                    _count_write(request, part)
                else:
                    part.read(request, answer)
                try:
                    request = op.send(answer)
                except StopIteration as done:
                    return rows, done.value, part
        except Exception:
            return None
        finally:
            op.close()

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

    def _predict(
        self,
        factory: Callable[[], Operation[Any]],
        history: list[tuple[Request, Any]],
        known: dict[Request, Any],
        first: Request,
    ) -> tuple[list[Request], bool]:
        """The requests the operation will make from ``first`` on, foreseen by a *probe*: a second
        generator of the same operation (it is pure), given the answers the real one got so far, then
        ``first`` and what follows answered from :class:`_Hints`, up to its first write. Also whether the
        probe saw the operation end there. Costs CPU only; a wrong guess costs one more round trip later."""
        out = [first]
        if not self.prefetch:
            return out, False
        probe = factory()
        hints = self._hints

        def step(answer: Any) -> Request | None:
            """The probe's next request; None when the operation failed on the guessed rows (what it asked
            before stands). StopIteration when it ended."""
            try:
                return probe.send(answer)  # type: ignore[no-any-return]
            except StopIteration:
                raise
            except Exception:
                return None

        try:
            request = step(None)
            for asked, answer in history:
                if request is None or request != asked:
                    return out, False
                request = step(answer)
            if request is None or request != first:
                return out, False
            seen = {first}
            while True:
                # the hints are this driver's own code: a failure there is a bug, and it propagates
                request = step(hints.answer(request))
                if request is None or isinstance(request, Write | Purge):
                    return out, False
                if request not in seen and request not in known:
                    if len(out) >= _MAX_PREDICTED:
                        return out, False
                    seen.add(request)
                    out.append(request)
        except StopIteration:
            return out, True
        finally:
            probe.close()

    async def _transaction(
        self,
        op: Operation[T],
        request: Request,
        access: Access,
        stats: OperationStats,
        attempt: _Attempt,
        factory: Callable[[], Operation[T]] | None,
        shortcuts: bool,
    ) -> T:
        pool = self._pool
        if pool is None:
            raise AgentStoreUnavailableError(f"the PostgreSQL store at {self.where} was closed")
        gate = self._gate
        if gate.locked():
            try:
                async with asyncio.timeout(self._timeout):
                    await gate.acquire()
            except TimeoutError:
                raise PoolTimeout(f"no connection free within {self._timeout} s") from None
        else:
            await gate.acquire()
        try:
            return await self._on_connection(pool, op, request, access, stats, attempt, factory, shortcuts)
        finally:
            gate.release()

    async def _on_connection(
        self,
        pool: Any,
        op: Operation[T],
        request: Request,
        access: Access,
        stats: OperationStats,
        attempt: _Attempt,
        factory: Callable[[], Operation[T]] | None,
        shortcuts: bool,
    ) -> T:
        async with pool.connection(timeout=self._timeout) as conn:
            attempt.connected = True
            restore = not conn.autocommit  # a pool passed in may hand out non-autocommit connections
            if restore:
                await conn.set_autocommit(True)
            try:
                if not _idle_and_quiet(conn):  # the server's goodbye is waiting: use another connection
                    await conn.close()
                    raise psycopg.OperationalError("the pooled connection was closed by the server")
                wire = await _wire(conn, self._q, self)
                rows = attempt.rows = _PostgresRows(conn, self._q, self._cache, access, wire, self._hints)
                history: list[tuple[Request, Any]] | None = None
                if factory is not None and self.prefetch:
                    history = []
                    rows.predict = functools.partial(self._predict, factory, history, rows.known)
                    if shortcuts and access == "read" and type(request) is LoadHead:
                        rows.anchor_request = request
                if shortcuts and self.speculate and access == "write" and factory is not None:
                    # only on a conversation seen live before this operation: guesses about one just met
                    # (its ids are not new to it) would mostly be wrong
                    hint = self._hints.get(getattr(request, "conversation_id", ""))
                    rows.speculate = hint is not None and hint.head is not None and not hint.purged
                target: Any = self.rows_wrapper(rows) if self.rows_wrapper is not None else rows
                try:
                    while True:
                        answer = await getattr(target, _SYNC_DISPATCH[type(request)])(request)
                        if isinstance(request, Write | Purge):
                            _count_write(request, stats)
                        else:
                            stats.read(request, answer)
                        if history is not None:
                            history.append((request, answer))
                        attempt.answered = True
                        try:
                            request = op.send(answer)
                        except StopIteration as done:
                            result: T = done.value
                            break
                    attempt.committing = True
                    await rows.commit()
                except Exception as error:
                    self.round_trips += await _rollback(conn)
                    if rows.unverified and not isinstance(error, psycopg.Error | _Restart):
                        # the operation gave up on answers not yet verified: they may be stale
                        raise _Restart from error
                    raise
                except BaseException:
                    self.round_trips += await _rollback(conn)
                    raise
            finally:
                if attempt.rows is not None:
                    self.round_trips += attempt.rows.sent
                if restore and not conn.closed and conn.info.transaction_status == TransactionStatus.IDLE:
                    await conn.set_autocommit(False)
        if rows.wrote:
            self._hints.wrote(rows.written[0], rows.wrote)
        return result


def _idle_and_quiet(conn: psycopg.AsyncConnection[Any]) -> bool:
    """Whether nothing waits to be read on this idle connection (one ``select``, no round trip). A server
    that dropped the connection (restart, ``pg_terminate_backend``, idle timeout) has sent its goodbye."""
    try:
        return not select.select([conn.pgconn.socket], [], [], 0)[0]
    except (OSError, ValueError, psycopg.Error):
        return False


async def _rollback(conn: psycopg.AsyncConnection[Any]) -> int:
    """End a failed transaction; a broken connection is left to the pool, which discards it. Returns the
    round trips it took (0 or 1)."""
    if conn.closed or conn.info.transaction_status not in (TransactionStatus.INTRANS, TransactionStatus.INERROR):
        return 0
    with contextlib.suppress(psycopg.Error):
        await conn.execute("ROLLBACK", prepare=False)
    return 1


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
