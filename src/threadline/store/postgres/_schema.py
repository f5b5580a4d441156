"""The ``threadline_*`` layout inside one schema: tables, indexes, the purge guard trigger, and the
forward-only migrations that create them (:func:`migrate`)."""

from __future__ import annotations

import re
from datetime import UTC, datetime
from typing import Any

import psycopg
from psycopg import sql

from ...errors import (
    AgentRecordValidationError,
    AgentStoreSchemaError,
)
from ...records import AdmissionReceipt, ConversationHead, Message, Run, SeedRecord
from ..codec import decode, encode
from ..reducer import baseline_rows

POSTGRES_SCHEMA_VERSION = 4
"""The version of the ``threadline_*`` layout this driver reads and writes (``threadline_meta``)."""

DEFAULT_SCHEMA = "threadline"

_SCHEMA_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
_MAX_IDENTIFIER = 63  # NAMEDATALEN - 1
PURGED_SQLSTATE = "TLP01"  # raised by the purge guard trigger


# {s} is the quoted schema identifier. Ids compare byte-wise (COLLATE "C"), exactly like Python strings,
# whatever the database's default collation is: paging order never depends on the server's locale.
_ID = 'text COLLATE "C" NOT NULL'
_GUARDED = ("conversations", "runs", "messages", "admissions", "seeds")  # + events, from layout 4

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
    f"USING ERRCODE = '{PURGED_SQLSTATE}'; "
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

_INDEXES_V3: dict[str, str] = {
    # finds a run by the id of the answer it will write (or would have: absorbed runs write none), so an
    # input or summary cannot take that id; only caller-chosen ids are looked up. A column of its own: a
    # run's answer id never changes, so the run's many updates stay HOT and leave this index alone
    "threadline_runs_assistant": (
        "CREATE INDEX threadline_runs_assistant ON {s}.threadline_runs (conversation_id, assistant_message_id)"
    ),
}

_TABLES_V4: dict[str, str] = {
    # the ledger: one append-only journal per conversation; ``digest`` is the event's lookup key
    # (``event_key``: a provider/message body's digest, a durable step's intent or proof)
    "threadline_events": (
        f"CREATE TABLE {{s}}.threadline_events (conversation_id {_ID}, seq bigint NOT NULL, kind text NOT NULL, "
        "digest text, body text NOT NULL, PRIMARY KEY (conversation_id, seq))"
    ),
}
_INDEXES_V4: dict[str, str] = {
    # a provider/message body is written once per conversation, a step's intent and proof once per key:
    # found by their key, never by a scan
    "threadline_events_bodies": (
        "CREATE UNIQUE INDEX threadline_events_bodies ON {s}.threadline_events (conversation_id, digest) "
        "WHERE digest IS NOT NULL"
    ),
}
_TRIGGERS_V4: dict[str, str] = {
    "threadline_events_purged_guard": (
        "CREATE TRIGGER threadline_events_purged_guard BEFORE INSERT ON {s}.threadline_events "
        "FOR EACH ROW EXECUTE FUNCTION {s}.threadline_purged_guard()"
    ),
}

_MIGRATIONS: dict[int, tuple[str, ...]] = {
    1: (*_TABLES_V1.values(), *_INDEXES_V1.values(), _GUARD_FUNCTION, *_TRIGGERS_V1.values()),
    # 2: runs found by their answer id, through an expression on the body (parsed at every run write)
    2: (
        "CREATE INDEX threadline_runs_assistant ON {s}.threadline_runs "
        "(conversation_id, ((body::jsonb) ->> 'assistant_message_id'))",
    ),
    # 3: ... through a column of its own
    3: (
        "DROP INDEX {s}.threadline_runs_assistant",
        "ALTER TABLE {s}.threadline_runs ADD COLUMN assistant_message_id text",
        "UPDATE {s}.threadline_runs SET assistant_message_id = (body::jsonb) ->> 'assistant_message_id'",
        *_INDEXES_V3.values(),
    ),
    # 4: the event ledger (and each existing conversation's runtime/baseline: :func:`_baselines`)
    4: (*_TABLES_V4.values(), *_INDEXES_V4.values(), *_TRIGGERS_V4.values()),
}
"""Forward-only: migration ``n`` takes the layout from version ``n - 1`` to ``n`` (0 is empty)."""

_REQUIRED_RELATIONS = (*_TABLES_V1, *_INDEXES_V1, *_INDEXES_V3, *_TABLES_V4, *_INDEXES_V4)
_REQUIRED_TRIGGERS = (*_TRIGGERS_V1, *_TRIGGERS_V4)


def render(template: str, schema: str) -> str:
    """``template`` with ``{s}`` replaced by the quoted schema identifier (``psycopg.sql.Identifier``)."""
    return sql.SQL(template).format(s=sql.Identifier(schema)).as_string(None)


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
                await cur.execute(render(statement, schema), prepare=False)
            if version == 4 and found:  # a new schema has no conversation to give a baseline
                await _baselines(cur, schema)
        if found < POSTGRES_SCHEMA_VERSION:
            await cur.execute(
                render(
                    "INSERT INTO {s}.threadline_meta (key, value) VALUES ('schema_version', %s) "
                    "ON CONFLICT (key) DO UPDATE SET value = excluded.value",
                    schema,
                ),
                (str(POSTGRES_SCHEMA_VERSION),),
                prepare=False,
            )
        await _check_complete(cur, schema)
    return found


async def _baselines(cur: psycopg.AsyncCursor[Any], schema: str) -> None:
    """Give every existing conversation its ``runtime/baseline`` at seq 1, inside the migration's
    transaction, one conversation at a time: its rows as they stand, dated now."""
    migrated_at = datetime.now(UTC)
    await cur.execute(render("SELECT conversation_id FROM {s}.threadline_conversations", schema), prepare=False)
    cids = [cid for (cid,) in await cur.fetchall()]
    for cid in cids:

        async def bodies(table: str, order: str = "", cid: str = cid) -> list[str]:
            statement = render(f"SELECT body FROM {{s}}.{table} WHERE conversation_id = %s {order}", schema)
            await cur.execute(statement, (cid,), prepare=False)
            return [body for (body,) in await cur.fetchall()]

        where = f"schema {schema!r} conversation {cid!r}"
        head, event = baseline_rows(
            head=decode(ConversationHead, (await bodies("threadline_conversations"))[0], where),
            messages=[decode(Message, b, where) for b in await bodies("threadline_messages", "ORDER BY seq")],
            runs=[decode(Run, b, where) for b in await bodies("threadline_runs", "ORDER BY row_id")],
            receipts=[decode(AdmissionReceipt, b, where) for b in await bodies("threadline_admissions")],
            seeds=[decode(SeedRecord, b, where) for b in await bodies("threadline_seeds")],
            now=migrated_at,
        )
        await cur.execute(
            render("UPDATE {s}.threadline_conversations SET body = %s WHERE conversation_id = %s", schema),
            (encode(head), cid),
            prepare=False,
        )
        await cur.execute(
            render(
                "INSERT INTO {s}.threadline_events (conversation_id, seq, kind, digest, body) "
                "VALUES (%s, %s, %s, NULL, %s)",
                schema,
            ),
            (cid, event.seq, event.kind, encode(event)),
            prepare=False,
        )


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
        render("SELECT value FROM {s}.threadline_meta WHERE key = 'schema_version'", schema), prepare=False
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


def validate_schema(schema: object) -> str:
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
