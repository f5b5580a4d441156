"""Every statement the driver sends, rendered once per schema (:class:`Statements`), and the pooled
connection it is sent on (:class:`Wire`: libpq quoting, what is prepared there)."""

from __future__ import annotations

import contextlib
import hashlib
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import psycopg
from psycopg import pq

from ._schema import render

if TYPE_CHECKING:
    from ._driver import PostgresStoreDriver


INT64_MAX = 2**63 - 1
INT64_MIN = -(2**63)
SORT_COLUMNS = ("band_rank", "position", "sub", "seq")


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
    "runs_by_assistant": (
        "text, text[]",
        "SELECT run_id, body FROM {s}.threadline_runs WHERE conversation_id = $1 AND assistant_message_id = ANY($2)",
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
    "upsert_run": (  # a run's assistant_message_id never changes: an update leaves it as it is
        "text, text, boolean, bigint, text, text",
        "INSERT INTO {s}.threadline_runs (conversation_id, run_id, active, version, body, assistant_message_id) "
        "VALUES ($1, $2, $3, $4, $5, $6) ON CONFLICT (conversation_id, run_id) DO UPDATE SET "
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
    "update_run": (  # $6: the run's unchanging answer id, passed as to upsert_run and not written
        "text, text, boolean, bigint, text, text",
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
    "insert_event": (
        "text, bigint, text, text, text",
        "INSERT INTO {s}.threadline_events (conversation_id, seq, kind, digest, body) VALUES ($1, $2, $3, $4, $5)",
    ),
    "events": (
        "text, bigint, bigint, bigint",
        "SELECT seq, body FROM {s}.threadline_events WHERE conversation_id = $1 AND seq BETWEEN $2 AND $3 "
        "ORDER BY seq LIMIT $4",
    ),
    "event_keys": (
        "text, text[]",
        "SELECT digest, seq FROM {s}.threadline_events WHERE conversation_id = $1 AND digest = ANY($2)",
    ),
    "all_receipts": (
        "text",
        "SELECT idempotency_key, body FROM {s}.threadline_admissions WHERE conversation_id = $1",
    ),
    "all_seeds": ("text", "SELECT seed_key, body FROM {s}.threadline_seeds WHERE conversation_id = $1"),
    "purge_events": ("text", "DELETE FROM {s}.threadline_events WHERE conversation_id = $1"),
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
GUARD_PARTS: dict[str, tuple[tuple[str, ...], str]] = {
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
    "no_event_keys": (  # no event with these lookup keys: body digests, step keys (threadline_events_bodies)
        ("text[]",),
        "NOT EXISTS (SELECT 1 FROM {s}.threadline_events WHERE conversation_id = $1 AND digest = ANY(${0}))",
    ),
    "no_answers": (  # no run's answer has these ids (threadline_runs_assistant)
        ("text[]",),
        "NOT EXISTS (SELECT 1 FROM {s}.threadline_runs WHERE conversation_id = $1 "
        "AND assistant_message_id = ANY(${0}))",
    ),
}
_DIGEST = "encode(sha256(convert_to(body, 'UTF8')), 'hex')"  # :func:`digest` on the server, any encoding

PURGE_ORDER = (
    "purge_events",
    "purge_messages",
    "purge_runs",
    "purge_admissions",
    "purge_seeds",
    "purge_head",
    "insert_tombstone",
)
BEGIN_WRITE = b"BEGIN ISOLATION LEVEL READ COMMITTED, READ WRITE"
BEGIN_READ = b"BEGIN ISOLATION LEVEL REPEATABLE READ, READ ONLY"
# Every statement here is keyed by the conversation (an index lookup whatever the values), so one generic
# plan serves; left to choose, the server re-plans some of them at every EXECUTE (a custom plan folds the
# guard's NULL and empty-array tests). Set once per connection of the driver's own pool; for every
# transaction on a pool passed in, whose sessions are the application's.
GENERIC_PLANS = b"SET plan_cache_mode TO force_generic_plan"
GENERIC_PLANS_LOCAL = b"SET LOCAL plan_cache_mode TO force_generic_plan"
COMMIT = b"COMMIT"


class Statements:
    """Every statement of one schema, rendered once: the ``PREPARE`` text of the prepared ones (their names
    carry a digest of the schema, so drivers of different schemas can share a connection) and the
    ``EXECUTE name(`` prefix of each."""

    def __init__(self, schema: str) -> None:
        self.schema = schema
        tag = hashlib.sha1(schema.encode()).hexdigest()[:12]
        self.prepare = "; ".join(
            f"PREPARE tl_{tag}_{name} ({types}) AS {render(text, schema)}" for name, (types, text) in _PREPARED.items()
        ).encode()
        self.execute: dict[str, bytes] = {name: f"EXECUTE tl_{tag}_{name}(".encode() for name in _PREPARED}
        self._tag = tag
        self._guards: dict[tuple[str, ...], tuple[bytes, bytes]] = {}
        self.lock_prefix = f"threadline:{schema}:"
        self.channel = notification_channel(schema)
        self._pages: dict[tuple[bool, str, int, str], str] = {}
        self._page_base = render(
            "SELECT message_id, body FROM {s}.threadline_messages WHERE conversation_id = %s AND position IS NOT NULL",
            schema,
        )

    def guard(self, parts: tuple[str, ...]) -> tuple[bytes, bytes]:
        """The ``PREPARE`` text and the ``EXECUTE name(`` prefix of the guard made of ``parts`` (in
        :data:`GUARD_PARTS` order)."""
        found = self._guards.get(parts)
        if found is None:
            mask = sum(1 << i for i, part in enumerate(GUARD_PARTS) if part in parts)
            name = f"tl_{self._tag}_guard{mask:02x}"  # short: identifiers are cut at 63 bytes
            types, conditions = ["text"], []
            for part in parts:
                part_types, condition = GUARD_PARTS[part]
                numbers = [str(len(types) + 1 + i) for i in range(len(part_types))]
                conditions.append(condition.format(*numbers, d=_DIGEST, s="{s}"))
                types.extend(part_types)
            text = f"SELECT 1 / ({' AND '.join(conditions)})::int"
            prepare = f"PREPARE {name} ({', '.join(types)}) AS {render(text, self.schema)}"
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
                columns = ", ".join(SORT_COLUMNS[:arity])
                marks = ", ".join(["%s::bigint"] * arity)
                text += f" AND ({columns}) {op} ({marks})"
            order = "ASC" if direction == "after" else "DESC"
            text += " ORDER BY " + ", ".join(f"{c} {order}" for c in SORT_COLUMNS) + " LIMIT %s"
            self._pages[key] = text
        return text


class Wire:
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
            if value.isascii() and "'" not in value and "\\" not in value:
                # exactly what libpq's quoting makes of it (ASCII reads the same in every client encoding),
                # without the call and the copy: most ids and many bodies
                return b"'" + value.encode() + b"'"
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


_WIRES: weakref.WeakKeyDictionary[psycopg.AsyncConnection[Any], Wire] = weakref.WeakKeyDictionary()


async def prepared_wire(conn: psycopg.AsyncConnection[Any], q: Statements, driver: PostgresStoreDriver) -> Wire:
    """The connection's :class:`Wire`, with ``q``'s statements prepared (one round trip, once per
    connection). A connection on which preparing failed is closed: the pool replaces it, and no statement
    is left half-prepared."""
    wire = _WIRES.get(conn)
    if wire is None:
        wire = _WIRES[conn] = Wire(conn)
    if q.schema not in wire.prepared:
        driver.round_trips += 1
        driver._own_backend(conn.info.backend_pid)
        own = driver._owns_pool and not wire.session_settings
        try:
            await conn.execute(GENERIC_PLANS + b"; " + q.prepare if own else q.prepare, prepare=False)
        except BaseException:
            with contextlib.suppress(Exception):
                await conn.close()
            raise
        wire.prepared.add(q.schema)
        wire.session_settings = wire.session_settings or own
    return wire


def clamp(value: int) -> int:
    return INT64_MAX if value > INT64_MAX else INT64_MIN if value < INT64_MIN else value


def cursor_shape(cursor: Sequence[int], direction: str) -> tuple[int, str, list[int]]:
    """Arity, operator and values of a row-value condition with exactly Python's tuple-comparison
    semantics against ``Message.sort_key`` (cursors from callers may be shorter or longer than the key)."""
    values = [clamp(int(v)) for v in cursor]
    n = len(values)
    if n == 4:
        op = ">" if direction == "after" else "<"
    elif n < 4:  # equal prefix: the longer key (ours) is greater
        op = ">=" if direction == "after" else "<"
    else:  # equal prefix: the shorter key (ours) is smaller
        values, n = values[:4], 4
        op = ">" if direction == "after" else "<="
    return n, op, values


def notification_channel(schema: str) -> str:
    """The LISTEN/NOTIFY channel of one schema's store."""
    return f"threadline_{schema}"[:63]
