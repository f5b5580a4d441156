"""The embedded driver (default): stdlib ``sqlite3`` in WAL mode, one dedicated thread per connection.

Group commit: operations started together share one transaction — ``BEGIN IMMEDIATE`` if any of them
writes, else ``BEGIN`` — each whole reducer operation in turn through
:func:`~threadline.store.driver.drive_sync`, then one ``COMMIT`` (at most ``max_batch`` operations per
transaction). An operation that raises having written nothing (a conflict, say) leaves the others to go on;
one that raises after it wrote rolls the transaction back, writes nothing, and the operations whose answers
came after the batch's first write run again, in order, in a new transaction (an operation is a pure
generator, so running it again from the start is always allowed). No savepoint per operation: it costs
every operation two statements and a copy of each page it touches, to undo what almost never fails. A
caller gets its answer only after the ``COMMIT`` succeeded; if it fails, no write of the batch is durable
and every caller whose answer depended on it gets the error.

Where they run: operations started on an event loop are gathered until that loop has run what was ready
(one loop iteration). If the connection's thread is idle and nothing waits for it, the gathered batch
runs right there on the calling thread (the connection is shared under a lock, never used by two threads
at once); otherwise it is queued for the thread, which takes everything waiting as one batch and wakes
each caller's loop once. Measured on the turn workload, handing every batch to the thread costs about a
third more CPU per turn (two thread hand-offs, and the GIL passed back and forth while both threads run
Python) and gives no parallelism back: the reducer and the encoding are Python too. The thread takes what
arrives while the connection is busy, searches, and, with ``synchronous='FULL'`` (an fsync per commit),
every write, so an fsync never stalls the event loop. Commits never checkpoint the WAL
(``wal_autocheckpoint`` is off on this connection): after every ``_CHECKPOINT_EVERY`` write transactions
a second thread, on a connection of its own, runs a passive checkpoint beside them.

The schema lives only in objects named ``threadline_*``; an application may keep its own tables (and
``PRAGMA user_version``) in the same file. Records are stored as their JSON, beside the few columns the
queries index. Busy is never waited for (``busy_timeout=0``): a write that meets another connection's
write lock raises :class:`~threadline.errors.AgentStoreBusyError` at once, having written nothing.

Usage::

    async with create_sqlite_agent_runtime_store(filename="threadline.db") as sqlite:
        await sqlite.store.accept_input_and_assign_run(...)
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import pickle
import queue
import sqlite3
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from datetime import UTC, datetime
from pathlib import Path
from types import TracebackType
from typing import Any, Literal, TypeVar

from ..errors import (
    AgentConversationPurgedError,
    AgentRecordValidationError,
    AgentStoreBusyError,
    AgentStoreSchemaError,
    AgentStoreUnavailableError,
)
from ..ledger.events import AgentStoreEvent, event_key
from ..records import (
    ACTIVE_RUN_STATES,
    AdmissionReceipt,
    ApprovalRequestPart,
    ConversationHead,
    Message,
    Run,
    SeedRecord,
    ToolCallPart,
    ToolResultPart,
)
from .aggregate import AgentConversationReader, AgentRuntimeStore, create_agent_runtime_store
from .codec import RecordCache, decode, encode as _encode, encode_event_bytes, encode_with, foreign, pack, unpack
from .driver import (
    Access,
    HeadState,
    ListActiveRuns,
    ListConversations,
    LoadAllReceipts,
    LoadAllRuns,
    LoadAllSeeds,
    LoadEventKeys,
    LoadEvents,
    LoadHead,
    LoadHistory,
    LoadMessages,
    LoadMessagesSince,
    LoadReceipt,
    LoadReceiptByInput,
    LoadRuns,
    LoadRunsByAssistant,
    LoadRunsSince,
    LoadSeed,
    LoadSettledRange,
    LoadUnsettled,
    Operation,
    OperationStats,
    PageSettled,
    Purge,
    ScanActiveRuns,
    Write,
    drive_sync,
)
from .reducer import baseline_rows

__all__ = [
    "SQLITE_SCHEMA_VERSION",
    "SqliteAgentRuntimeStoreHandle",
    "SqliteStoreDriver",
    "create_sqlite_agent_runtime_store",
]

T = TypeVar("T")

SQLITE_SCHEMA_VERSION = 5
"""The version of the ``threadline_*`` table layout this driver reads and writes. Opening a file of an
earlier version migrates it forward in one transaction (``_MIGRATIONS``); a later version is refused."""

MAX_SEARCH_LIMIT = 1000

_SYNCHRONOUS = ("NORMAL", "FULL")
_SQLITE_BUSY = 5
_SQLITE_LOCKED = 6
_SQLITE_CORRUPT = 11
_SQLITE_NOTADB = 26
_SQLITE_CONSTRAINT_TRIGGER = 1811  # SQLITE_CONSTRAINT | (7 << 8): RAISE(ABORT) in a trigger
_CHUNK = 500  # ids per IN (...) list, well under SQLite's variable limit
_OPEN_BUSY_GRACE = 2.0  # seconds an opening connection waits for another one creating the schema
_WAL_SIZE_LIMIT = 64 * 1024 * 1024  # bytes the WAL file is truncated back to after a checkpoint
_CACHE_KIB = 32 * 1024  # SQLite page cache per connection (grows only as pages are touched)
_CACHE_BUDGET = 2 * 1024 * 1024  # characters of JSON kept decoded per connection
_KNOWN_ROWS = 20_000  # rows a connection remembers having written (_SqliteRows.known)
_CHECKPOINT_EVERY = 64
"""Write transactions between two passive WAL checkpoints (run by the checkpointer thread). A transaction
writes about ten pages, so the WAL stays near SQLite's default of 1000 pages between checkpoints."""
_INT64_MAX = 2**63 - 1
_INT64_MIN = -(2**63)

# ------------------------------------------------------------------------------------------------ schema

# The text parts of a message body, joined by spaces: what the full-text index holds.
_TEXT_OF = (
    "(SELECT group_concat(json_extract(p.value, '$.text'), ' ') FROM json_each({body}, '$.parts') AS p "
    "WHERE json_extract(p.value, '$.type') = 'text')"
)

_GUARDED = ("conversations", "runs", "messages", "admissions", "seeds", "events")

_TABLES: dict[str, str] = {
    "threadline_meta": "CREATE TABLE threadline_meta (key TEXT PRIMARY KEY, value TEXT NOT NULL) WITHOUT ROWID",
    "threadline_conversations": (
        "CREATE TABLE threadline_conversations ("
        "conversation_id TEXT PRIMARY KEY, version INTEGER NOT NULL, body TEXT NOT NULL) WITHOUT ROWID"
    ),
    "threadline_tombstones": (
        "CREATE TABLE threadline_tombstones (conversation_id TEXT PRIMARY KEY, purged_at TEXT NOT NULL) WITHOUT ROWID"
    ),
    "threadline_runs": (
        "CREATE TABLE threadline_runs ("
        "conversation_id TEXT NOT NULL, run_id TEXT NOT NULL, active INTEGER NOT NULL, version INTEGER NOT NULL, "
        "body TEXT NOT NULL, assistant_message_id TEXT, PRIMARY KEY (conversation_id, run_id))"
    ),
    # row_id is an explicit INTEGER PRIMARY KEY so VACUUM never renumbers it: the full-text rows use it.
    "threadline_messages": (
        "CREATE TABLE threadline_messages ("
        "row_id INTEGER PRIMARY KEY, conversation_id TEXT NOT NULL, message_id TEXT NOT NULL, "
        "band_rank INTEGER NOT NULL, position INTEGER, sub INTEGER NOT NULL, seq INTEGER NOT NULL, "
        "active INTEGER NOT NULL, version INTEGER NOT NULL, body TEXT NOT NULL, UNIQUE (conversation_id, message_id))"
    ),
    "threadline_admissions": (
        "CREATE TABLE threadline_admissions ("
        "conversation_id TEXT NOT NULL, idempotency_key TEXT NOT NULL, input_message_id TEXT NOT NULL, "
        "body TEXT NOT NULL, PRIMARY KEY (conversation_id, idempotency_key))"
    ),
    "threadline_seeds": (
        "CREATE TABLE threadline_seeds ("
        "conversation_id TEXT NOT NULL, seed_key TEXT NOT NULL, body TEXT NOT NULL, "
        "PRIMARY KEY (conversation_id, seed_key))"
    ),
    "threadline_fts_queue": ("CREATE TABLE threadline_fts_queue (row_id INTEGER PRIMARY KEY, stale INTEGER NOT NULL)"),
    # the ledger: one append-only journal per conversation. A rowid table (bodies are larger than an index
    # entry should be), appended in seq order; ``digest`` is the event's lookup key (``event_key``: a
    # provider/message body's digest, a durable step's intent or proof), NULL for every other event
    "threadline_events": (
        "CREATE TABLE threadline_events (row_id INTEGER PRIMARY KEY, conversation_id TEXT NOT NULL, "
        "seq INTEGER NOT NULL, kind TEXT NOT NULL, digest TEXT, body TEXT NOT NULL, UNIQUE (conversation_id, seq))"
    ),
    "threadline_message_fts": (
        "CREATE VIRTUAL TABLE threadline_message_fts USING fts5(text, conversation_id UNINDEXED, message_id UNINDEXED)"
    ),
}

_INDEXES: dict[str, str] = {
    "threadline_runs_active": (
        "CREATE INDEX threadline_runs_active ON threadline_runs (conversation_id, run_id) WHERE active = 1"
    ),
    "threadline_runs_version": ("CREATE INDEX threadline_runs_version ON threadline_runs (conversation_id, version)"),
    # finds a run by the id of the answer it will write (or would have: absorbed runs write none), so an
    # input or summary cannot take that id; only caller-chosen ids are looked up. A column, not an
    # expression on the body: a run's answer id never changes, so its many updates leave this index alone
    "threadline_runs_assistant": (
        "CREATE INDEX threadline_runs_assistant ON threadline_runs (conversation_id, assistant_message_id)"
    ),
    "threadline_messages_version": (
        "CREATE INDEX threadline_messages_version ON threadline_messages (conversation_id, version)"
    ),
    "threadline_messages_settled": (
        "CREATE INDEX threadline_messages_settled ON threadline_messages "
        "(conversation_id, band_rank, position, sub, seq, active) WHERE position IS NOT NULL"
    ),
    "threadline_messages_unsettled": (
        "CREATE INDEX threadline_messages_unsettled ON threadline_messages (conversation_id) WHERE position IS NULL"
    ),
    "threadline_admissions_input": (
        "CREATE UNIQUE INDEX threadline_admissions_input ON threadline_admissions (conversation_id, input_message_id)"
    ),
    # a provider/message body is written once per conversation, a step's intent and proof once per key:
    # found by their key, never by a scan
    "threadline_events_bodies": (
        "CREATE UNIQUE INDEX threadline_events_bodies ON threadline_events (conversation_id, digest) "
        "WHERE digest IS NOT NULL"
    ),
}

_TRIGGERS: dict[str, str] = {
    **{
        f"threadline_{table}_purged_guard": (
            f"CREATE TRIGGER threadline_{table}_purged_guard BEFORE INSERT ON threadline_{table} "
            "WHEN EXISTS (SELECT 1 FROM threadline_tombstones WHERE conversation_id = NEW.conversation_id) "
            "BEGIN SELECT RAISE(ABORT, 'threadline: the conversation was purged; it accepts no rows'); END"
        )
        for table in _GUARDED
    },
    # The full-text index follows settled messages, through a queue: a trigger only notes the row, and the
    # driver indexes every noted row in one statement just before COMMIT (``_FTS_FLUSH``). Written row by
    # row, FTS5 flushes its pending terms into a new segment at every later statement of the transaction
    # (each opens a statement savepoint), which cost a segment and merge work per settled message. An
    # unsettled draft (checkpoints) is never noted; compaction flips ``active`` without touching the text,
    # so it is not either. ``stale``: the row may have an index entry to remove first.
    "threadline_messages_fts_insert": (
        "CREATE TRIGGER threadline_messages_fts_insert AFTER INSERT ON threadline_messages "
        "WHEN NEW.position IS NOT NULL BEGIN "
        "INSERT OR IGNORE INTO threadline_fts_queue (row_id, stale) VALUES (NEW.row_id, 0); END"
    ),
    "threadline_messages_fts_update": (
        "CREATE TRIGGER threadline_messages_fts_update AFTER UPDATE OF body ON threadline_messages "
        "WHEN (OLD.position IS NOT NULL OR NEW.position IS NOT NULL) AND (OLD.position IS NULL "
        "OR NEW.position IS NULL OR json_extract(OLD.body, '$.parts') IS NOT json_extract(NEW.body, '$.parts')) "
        "BEGIN "
        "INSERT OR REPLACE INTO threadline_fts_queue (row_id, stale) VALUES (NEW.row_id, OLD.position IS NOT NULL "
        "OR EXISTS (SELECT 1 FROM threadline_fts_queue WHERE row_id = NEW.row_id AND stale)); END"
    ),
    "threadline_messages_fts_delete": (
        "CREATE TRIGGER threadline_messages_fts_delete AFTER DELETE ON threadline_messages "
        "WHEN OLD.position IS NOT NULL BEGIN "
        "INSERT OR REPLACE INTO threadline_fts_queue (row_id, stale) VALUES (OLD.row_id, 1); END"
    ),
}

_REQUIRED: dict[str, str] = {**_TABLES, **_INDEXES, **_TRIGGERS}

_MIGRATIONS: dict[int, tuple[str, ...]] = {
    # 1 -> 2: the full-text triggers note rows in threadline_fts_queue instead of indexing them one by one
    # (the index itself is unchanged)
    1: (
        "DROP TRIGGER threadline_messages_fts_insert",
        "DROP TRIGGER threadline_messages_fts_update",
        "DROP TRIGGER threadline_messages_fts_delete",
        _TABLES["threadline_fts_queue"],
        _TRIGGERS["threadline_messages_fts_insert"],
        _TRIGGERS["threadline_messages_fts_update"],
        _TRIGGERS["threadline_messages_fts_delete"],
    ),
    # 2 -> 3: runs are found by their assistant message id (an index on the body's field)
    2: (
        "CREATE INDEX threadline_runs_assistant ON threadline_runs "
        "(conversation_id, json_extract(body, '$.assistant_message_id'))",
    ),
    # 3 -> 4: ... by a column of its own (SQLite parsed the body's JSON twice at every update of a run for
    # that index)
    3: (
        "DROP INDEX threadline_runs_assistant",
        "ALTER TABLE threadline_runs ADD COLUMN assistant_message_id TEXT",
        "UPDATE threadline_runs SET assistant_message_id = json_extract(body, '$.assistant_message_id')",
        _INDEXES["threadline_runs_assistant"],
    ),
    # 4 -> 5: the event ledger; every existing conversation gets its runtime/baseline at seq 1 (``_baselines``)
    4: (
        _TABLES["threadline_events"],
        _INDEXES["threadline_events_bodies"],
        _TRIGGERS["threadline_events_purged_guard"],
    ),
}
"""The statements that bring schema version ``n`` to ``n + 1`` (4 -> 5 also writes the baselines)."""

# ------------------------------------------------------------------------------------------- statements

_HEAD = "SELECT body FROM threadline_conversations WHERE conversation_id = ?"
_TOMBSTONE = "SELECT 1 FROM threadline_tombstones WHERE conversation_id = ?"
_RUN = "SELECT run_id, body FROM threadline_runs WHERE conversation_id = ? AND run_id = ?"
_RUNS_BY_ASSISTANT = (
    "SELECT run_id, body FROM threadline_runs WHERE conversation_id = ? AND assistant_message_id IN ({})"
)
_RUNS_IN = "SELECT run_id, body FROM threadline_runs WHERE conversation_id = ? AND run_id IN ({})"
_ACTIVE_RUNS = "SELECT run_id, body FROM threadline_runs WHERE conversation_id = ? AND active = 1 ORDER BY run_id"
_ALL_RUNS = "SELECT run_id, body FROM threadline_runs WHERE conversation_id = ? ORDER BY rowid"
_RECEIPT = "SELECT idempotency_key, body FROM threadline_admissions WHERE conversation_id = ? AND idempotency_key = ?"
_RECEIPT_BY_INPUT = (
    "SELECT idempotency_key, body FROM threadline_admissions WHERE conversation_id = ? AND input_message_id = ?"
)
_MESSAGE = "SELECT message_id, body FROM threadline_messages WHERE conversation_id = ? AND message_id = ?"
_MESSAGES_IN = "SELECT message_id, body FROM threadline_messages WHERE conversation_id = ? AND message_id IN ({})"
_SETTLED_RANGE = (
    "SELECT message_id, body FROM threadline_messages WHERE conversation_id = ? AND band_rank = 1 "
    "AND position IS NOT NULL AND position BETWEEN ? AND ? AND active = 1 ORDER BY position, sub, seq"
)
_SEED = "SELECT seed_key, body FROM threadline_seeds WHERE conversation_id = ? AND seed_key = ?"
_HISTORY = "SELECT message_id, body FROM threadline_messages WHERE conversation_id = ? AND active = 1"
_MESSAGES_SINCE = (
    "SELECT message_id, body FROM threadline_messages WHERE conversation_id = ? AND version > ? "
    "ORDER BY version, row_id"
)
_ACTIVE_MESSAGES_SINCE = (
    "SELECT message_id, body FROM threadline_messages WHERE conversation_id = ? AND version > ? AND active = 1 "
    "ORDER BY version, row_id"
)
_RUNS_SINCE = (
    "SELECT run_id, body FROM threadline_runs WHERE conversation_id = ? AND version > ? ORDER BY version, rowid"
)
_UNSETTLED = "SELECT message_id, body FROM threadline_messages WHERE conversation_id = ? AND position IS NULL"
_SCAN = (
    "SELECT conversation_id, run_id, body FROM threadline_runs AS r WHERE active = 1 {after}"
    "AND NOT EXISTS (SELECT 1 FROM threadline_tombstones AS t WHERE t.conversation_id = r.conversation_id) "
    "ORDER BY conversation_id, run_id LIMIT ?"
)
_SCAN_FIRST = _SCAN.format(after="")
_SCAN_AFTER = _SCAN.format(after="AND (conversation_id, run_id) > (?, ?) ")
_CONVERSATIONS_FIRST = "SELECT conversation_id, body FROM threadline_conversations ORDER BY conversation_id LIMIT ?"
_CONVERSATIONS_AFTER = (
    "SELECT conversation_id, body FROM threadline_conversations WHERE conversation_id > ? "
    "ORDER BY conversation_id LIMIT ?"
)
_UPSERT_HEAD = (
    "INSERT INTO threadline_conversations (conversation_id, version, body) VALUES (?, ?, ?) "
    "ON CONFLICT (conversation_id) DO UPDATE SET version = excluded.version, body = excluded.body"
)
_UPSERT_RUN = (  # a run's assistant_message_id never changes: an update leaves it (and its index) alone
    "INSERT INTO threadline_runs (conversation_id, run_id, active, version, body, assistant_message_id) "
    "VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT (conversation_id, run_id) DO UPDATE SET "
    "active = excluded.active, version = excluded.version, body = excluded.body"
)
_UPSERT_MESSAGE = (
    "INSERT INTO threadline_messages "
    "(conversation_id, message_id, band_rank, position, sub, seq, active, version, body) "
    "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT (conversation_id, message_id) DO UPDATE SET "
    "band_rank = excluded.band_rank, position = excluded.position, sub = excluded.sub, seq = excluded.seq, "
    "active = excluded.active, version = excluded.version, body = excluded.body"
)
# Rows this connection wrote (``_SqliteRows.known``) are rewritten with a plain UPDATE of what can change:
# no purge guard, no insert attempt, and no index whose columns stay the same is touched.
_UPDATE_HEAD = "UPDATE threadline_conversations SET version = ?, body = ? WHERE conversation_id = ?"
_UPDATE_RUN = "UPDATE threadline_runs SET version = ?, body = ? WHERE conversation_id = ? AND run_id = ?"
_UPDATE_RUN_ACTIVE = (
    "UPDATE threadline_runs SET active = ?, version = ?, body = ? WHERE conversation_id = ? AND run_id = ?"
)
_UPDATE_MESSAGE = "UPDATE threadline_messages SET version = ?, body = ? WHERE conversation_id = ? AND message_id = ?"
_UPDATE_MESSAGE_POSITION = (
    "UPDATE threadline_messages SET position = ?, version = ?, body = ? WHERE conversation_id = ? AND message_id = ?"
)
_INSERT_RECEIPT = (
    "INSERT INTO threadline_admissions (conversation_id, idempotency_key, input_message_id, body) VALUES (?, ?, ?, ?)"
)
_INSERT_SEED = "INSERT INTO threadline_seeds (conversation_id, seed_key, body) VALUES (?, ?, ?)"
_INSERT_EVENT = "INSERT INTO threadline_events (conversation_id, seq, kind, digest, body) VALUES (?, ?, ?, ?, ?)"
_EVENTS = (
    "SELECT seq, body FROM threadline_events WHERE conversation_id = ? AND seq BETWEEN ? AND ? ORDER BY seq LIMIT ?"
)
_BODIES = "SELECT digest, seq FROM threadline_events WHERE conversation_id = ? AND digest IN ({})"
_ALL_RECEIPTS = "SELECT idempotency_key, body FROM threadline_admissions WHERE conversation_id = ?"
_ALL_SEEDS = "SELECT seed_key, body FROM threadline_seeds WHERE conversation_id = ?"
_PURGE = (
    "DELETE FROM threadline_events WHERE conversation_id = ?",
    "DELETE FROM threadline_messages WHERE conversation_id = ?",
    "DELETE FROM threadline_runs WHERE conversation_id = ?",
    "DELETE FROM threadline_admissions WHERE conversation_id = ?",
    "DELETE FROM threadline_seeds WHERE conversation_id = ?",
    "DELETE FROM threadline_conversations WHERE conversation_id = ?",
)
_INSERT_TOMBSTONE = "INSERT INTO threadline_tombstones (conversation_id, purged_at) VALUES (?, ?)"
_FTS_FLUSH = (
    "DELETE FROM threadline_message_fts WHERE rowid IN (SELECT row_id FROM threadline_fts_queue WHERE stale)",
    "INSERT INTO threadline_message_fts (rowid, text, conversation_id, message_id) "
    f"SELECT m.row_id, {_TEXT_OF.format(body='m.body')}, m.conversation_id, m.message_id "
    # CROSS JOIN keeps this order (the planner would rather scan every settled message and probe the queue)
    "FROM threadline_fts_queue AS q CROSS JOIN threadline_messages AS m ON m.row_id = q.row_id "
    "WHERE m.position IS NOT NULL",
    "DELETE FROM threadline_fts_queue",
)
"""Index the rows the triggers noted, in three statements whatever their number (see ``_TRIGGERS``); each
reads the queue and, by primary key, only the rows it names."""
_SEARCH = (
    "SELECT m.message_id, m.body FROM threadline_message_fts AS f "
    "JOIN threadline_messages AS m ON m.row_id = f.rowid "
    "WHERE threadline_message_fts MATCH ? AND f.conversation_id = ? AND m.conversation_id = ? "
    "ORDER BY f.rank LIMIT ?"
)
_SORT_COLUMNS = ("band_rank", "position", "sub", "seq")

# ------------------------------------------------------------------------------------------ error mapping


def _is_busy(error: sqlite3.Error) -> bool:
    """SQLITE_BUSY or SQLITE_LOCKED, including their extended codes (the low byte is the primary code)."""
    code = getattr(error, "sqlite_errorcode", None)
    if not isinstance(error, sqlite3.OperationalError) or code is None:
        return False
    return code & 0xFF in (_SQLITE_BUSY, _SQLITE_LOCKED)


def _map_error(error: sqlite3.Error, filename: str) -> Exception | None:
    """The typed error for a sqlite3 failure, by exception type and result code (never message text);
    ``None`` for programming errors, which propagate as they are."""
    code = getattr(error, "sqlite_errorcode", None)
    name = getattr(error, "sqlite_errorname", None) or type(error).__name__
    if _is_busy(error):
        return AgentStoreBusyError(
            f"{filename}: another connection holds the database lock ({name}); nothing was written, retry"
        )
    primary = code & 0xFF if code is not None else None
    if primary in (_SQLITE_NOTADB, _SQLITE_CORRUPT):
        return AgentStoreUnavailableError(f"{filename}: the file is not a usable SQLite database ({name})")
    if isinstance(error, sqlite3.OperationalError | sqlite3.InternalError):
        return AgentStoreUnavailableError(f"{filename}: SQLite failed ({name}): {error}")
    if type(error) is sqlite3.DatabaseError:
        return AgentStoreUnavailableError(f"{filename}: SQLite failed ({name}): {error}")
    return None


def _clamp(value: int) -> int:
    return _INT64_MAX if value > _INT64_MAX else _INT64_MIN if value < _INT64_MIN else value


def _cursor_condition(cursor: Sequence[int], direction: Literal["after", "before"]) -> tuple[str, list[int]]:
    """A row-value condition with exactly Python's tuple-comparison semantics against ``Message.sort_key``
    (cursors from callers may be shorter or longer than the four sort columns)."""
    values = [_clamp(int(v)) for v in cursor]
    n = len(values)
    if n == 4:
        op = ">" if direction == "after" else "<"
    elif n < 4:  # equal prefix: the longer key is greater
        op = ">=" if direction == "after" else "<"
    else:  # equal prefix: the shorter key (ours) is smaller
        values = values[:4]
        n = 4
        op = ">" if direction == "after" else "<="
    columns = ", ".join(_SORT_COLUMNS[:n])
    marks = ", ".join("?" * n)
    return f" AND ({columns}) {op} ({marks})", values


def _chunks(ids: Sequence[str]) -> Iterable[Sequence[str]]:
    for start in range(0, len(ids), _CHUNK):
        yield ids[start : start + _CHUNK]


# ------------------------------------------------------------------------------------------------- rows


class _SqliteRows:
    """The :class:`~threadline.store.driver.SyncRows` primitives over one connection (worker thread only).

    ``writable`` is the current operation's access (a read operation that writes is a bug). ``wrote``
    records that the operation wrote (a failure after that needs the whole transaction rolled back).

    ``known`` holds the rows this connection wrote last, by key: heads and runs as their (immutable)
    records, messages as their stored JSON beside the record and a snapshot of what in it a caller could
    change in place (its JSON containers: metadata, a tool call's input; :func:`_snapshot`). A known
    message is handed out only while those are unchanged (pickled again and compared: a fraction of
    encoding the message), else decoded afresh from its row. A store operation
    mostly reads what the one before it wrote, so those reads need no statement, and a run a range query
    returns is not decoded again. Ended runs and settled messages are not kept (a mutation seldom reads
    them again, and every record and body kept alive is memory and work for the garbage collector). The
    entries are exactly the rows in the database as long as nothing else wrote it: every transaction
    begins with ``check_known`` (``PRAGMA data_version`` moves when another connection commits), and
    anything rolled back (a failed operation, a failed ``COMMIT``) or deleted (a purge) empties it.
    Bounded: ``_KNOWN_ROWS`` entries, then it starts again empty.
    """

    def __init__(self, conn: sqlite3.Connection) -> None:
        self.conn = conn
        self.cur = conn.cursor()  # one cursor for every statement: no cursor object per statement
        self.known: dict[tuple[str, ...], Any] = {}
        self.data_version: int | None = None
        self.writable = False
        self.wrote = False
        self.fts_pending = False  # a write may have noted rows for the full-text index (flush_fts)
        self.cache = RecordCache(_CACHE_BUDGET)

    def _begin_write(self, what: str) -> None:
        if not self.writable:
            raise AssertionError(f"a read operation {what}")
        self.wrote = True

    def check_known(self) -> None:
        """At the start of a transaction: forget the known rows if another connection committed since."""
        version = self.cur.execute("PRAGMA data_version").fetchone()[0]
        if version != self.data_version:
            self.known.clear()
            self.data_version = version

    def forget(self) -> None:
        """Something this connection wrote was rolled back or deleted: no known row is trusted."""
        self.known.clear()

    def flush_fts(self) -> None:
        """Index the rows noted since the last flush: before ``COMMIT``, and before a search in the same
        transaction (so it sees what the operations before it settled)."""
        if self.fts_pending:
            for sql in _FTS_FLUSH:
                self.cur.execute(sql)
            self.fts_pending = False

    # ------------------------------------------------------------------ decoding rows of one table

    def _runs(self, conversation_id: str, rows: Iterable[tuple[str, str]]) -> list[Run]:
        out = []
        get = self.cache.get
        known = self.known
        for run_id, body in rows:
            run = known.get(("r", conversation_id, run_id))
            if run is not None:  # this very row, as written here (see ``known``): nothing to decode
                out.append(run)
                continue
            run = get(Run, body, lambda r=run_id: f"threadline_runs conversation_id={conversation_id} run_id={r}")
            if run.id != run_id or run.conversation_id != conversation_id:
                where = f"threadline_runs conversation_id={conversation_id} run_id={run_id}"
                raise foreign("Run", where, f"{conversation_id}/{run_id}", f"{run.conversation_id}/{run.id}")
            out.append(run)
        return out

    def _messages(self, conversation_id: str, rows: Iterable[tuple[str, str]]) -> list[Message]:
        out = []
        get = self.cache.get
        for message_id, body in rows:
            message = get(
                Message,
                body,
                lambda m=message_id: f"threadline_messages conversation_id={conversation_id} message_id={m}",
            )
            if message.id != message_id or message.conversation_id != conversation_id:
                where = f"threadline_messages conversation_id={conversation_id} message_id={message_id}"
                raise foreign(
                    "Message", where, f"{conversation_id}/{message_id}", f"{message.conversation_id}/{message.id}"
                )
            out.append(message)
        return out

    def _head(self, conversation_id: str, body: str) -> ConversationHead:
        def where() -> str:
            return f"threadline_conversations conversation_id={conversation_id}"

        head = self.cache.get(ConversationHead, body, where)
        if head.conversation_id != conversation_id:
            raise foreign("ConversationHead", where(), conversation_id, head.conversation_id)
        return head

    def _receipt(self, conversation_id: str, row: tuple[str, str] | None) -> AdmissionReceipt | None:
        if row is None:
            return None
        key, body = row

        def where() -> str:
            return f"threadline_admissions conversation_id={conversation_id} idempotency_key={key}"

        receipt = self.cache.get(AdmissionReceipt, body, where)
        if receipt.conversation_id != conversation_id or receipt.idempotency_key != key:
            raise foreign(
                "AdmissionReceipt",
                where(),
                f"{conversation_id}/{key}",
                f"{receipt.conversation_id}/{receipt.idempotency_key}",
            )
        return receipt

    # ------------------------------------------------------------------------------- the primitives

    def load_head(self, r: LoadHead) -> HeadState:
        head = self.known.get(("h", r.conversation_id))
        if head is not None:
            return HeadState(head)
        row = self.cur.execute(_HEAD, (r.conversation_id,)).fetchone()
        if row is not None:
            return HeadState(self._head(r.conversation_id, row[0]))
        purged = self.cur.execute(_TOMBSTONE, (r.conversation_id,)).fetchone() is not None
        return HeadState(None, purged=purged)

    def load_runs(self, r: LoadRuns) -> list[Run]:
        cid = r.conversation_id
        known = self.known
        runs = [known.get(("r", cid, run_id)) for run_id in r.run_ids]
        if None not in runs:
            return runs  # type: ignore[return-value]
        if len(r.run_ids) == 1:
            return self._runs(cid, self.cur.execute(_RUN, (cid, r.run_ids[0])).fetchall())
        found: dict[str, Run] = {}
        for chunk in _chunks(tuple(dict.fromkeys(r.run_ids))):
            sql = _RUNS_IN.format(", ".join("?" * len(chunk)))
            found.update((run.id, run) for run in self._runs(cid, self.cur.execute(sql, (cid, *chunk)).fetchall()))
        return [found[i] for i in r.run_ids if i in found]

    def load_runs_by_assistant(self, r: LoadRunsByAssistant) -> list[Run]:
        cid, found = r.conversation_id, []
        for chunk in _chunks(tuple(dict.fromkeys(r.message_ids))):
            sql = _RUNS_BY_ASSISTANT.format(", ".join("?" * len(chunk)))
            found += self._runs(cid, self.cur.execute(sql, (cid, *chunk)).fetchall())
        return found

    def list_active_runs(self, r: ListActiveRuns) -> list[Run]:
        return self._runs(r.conversation_id, self.cur.execute(_ACTIVE_RUNS, (r.conversation_id,)).fetchall())

    def load_all_runs(self, r: LoadAllRuns) -> list[Run]:
        return self._runs(r.conversation_id, self.cur.execute(_ALL_RUNS, (r.conversation_id,)).fetchall())

    def load_receipt(self, r: LoadReceipt) -> AdmissionReceipt | None:
        row = self.cur.execute(_RECEIPT, (r.conversation_id, r.idempotency_key)).fetchone()
        return self._receipt(r.conversation_id, row)

    def load_receipt_by_input(self, r: LoadReceiptByInput) -> AdmissionReceipt | None:
        row = self.cur.execute(_RECEIPT_BY_INPUT, (r.conversation_id, r.input_message_id)).fetchone()
        return self._receipt(r.conversation_id, row)

    def load_messages(self, r: LoadMessages) -> list[Message]:
        cid = r.conversation_id
        ids = tuple(dict.fromkeys(r.message_ids))
        known = self.known
        entries = [known.get(("m", cid, message_id)) for message_id in ids]
        if None not in entries:
            out = []
            for message_id, (body, message, snapshot) in zip(ids, entries, strict=True):  # type: ignore[misc]
                if not _unchanged(message, snapshot):
                    # a caller changed the record's JSON containers in place: the row is what counts
                    (message,) = self._messages(cid, ((message_id, body),))
                    known["m", cid, message_id] = (body, message, _snapshot(message))
                out.append(message)
            return out
        if len(ids) == 1:
            return self._messages(cid, self.cur.execute(_MESSAGE, (cid, ids[0])).fetchall())
        found: dict[str, Message] = {}
        for chunk in _chunks(ids):
            sql = _MESSAGES_IN.format(", ".join("?" * len(chunk)))
            rows = self.cur.execute(sql, (cid, *chunk)).fetchall()
            found.update((m.id, m) for m in self._messages(cid, rows))
        return [found[i] for i in ids if i in found]

    def load_settled_range(self, r: LoadSettledRange) -> list[Message]:
        lo, hi = _clamp(r.lo), _clamp(r.hi)
        return self._messages(
            r.conversation_id, self.cur.execute(_SETTLED_RANGE, (r.conversation_id, lo, hi)).fetchall()
        )

    def load_seed(self, r: LoadSeed) -> SeedRecord | None:
        row = self.cur.execute(_SEED, (r.conversation_id, r.seed_key)).fetchone()
        if row is None:
            return None
        where = f"threadline_seeds conversation_id={r.conversation_id} seed_key={row[0]}"
        seed = self.cache.get(SeedRecord, row[1], lambda: where)
        if seed.conversation_id != r.conversation_id or seed.seed_key != r.seed_key:
            raise foreign(
                "SeedRecord", where, f"{r.conversation_id}/{r.seed_key}", f"{seed.conversation_id}/{seed.seed_key}"
            )
        return seed

    def load_history(self, r: LoadHistory) -> list[Message]:
        return self._messages(r.conversation_id, self.cur.execute(_HISTORY, (r.conversation_id,)).fetchall())

    def load_messages_since(self, r: LoadMessagesSince) -> list[Message]:
        sql = _MESSAGES_SINCE if r.include_inactive else _ACTIVE_MESSAGES_SINCE
        version = _clamp(r.version)
        return self._messages(r.conversation_id, self.cur.execute(sql, (r.conversation_id, version)).fetchall())

    def load_runs_since(self, r: LoadRunsSince) -> list[Run]:
        rows = self.cur.execute(_RUNS_SINCE, (r.conversation_id, _clamp(r.version))).fetchall()
        return self._runs(r.conversation_id, rows)

    def load_unsettled(self, r: LoadUnsettled) -> list[Message]:
        return self._messages(r.conversation_id, self.cur.execute(_UNSETTLED, (r.conversation_id,)).fetchall())

    def page_settled(self, r: PageSettled) -> list[Message]:
        sql = "SELECT message_id, body FROM threadline_messages WHERE conversation_id = ? AND position IS NOT NULL"
        params: list[object] = [r.conversation_id]
        if not r.include_inactive:
            sql += " AND active = 1"
        if r.cursor is not None:
            condition, values = _cursor_condition(r.cursor, r.direction)
            sql += condition
            params.extend(values)
        order = "ASC" if r.direction == "after" else "DESC"
        sql += " ORDER BY " + ", ".join(f"{c} {order}" for c in _SORT_COLUMNS) + " LIMIT ?"
        params.append(r.limit)
        return self._messages(r.conversation_id, self.cur.execute(sql, params).fetchall())

    def scan_active_runs(self, r: ScanActiveRuns) -> list[Run]:
        if r.after is None:
            rows = self.cur.execute(_SCAN_FIRST, (r.limit,)).fetchall()
        else:
            rows = self.cur.execute(_SCAN_AFTER, (r.after[0], r.after[1], r.limit)).fetchall()
        out: list[Run] = []
        for cid, run_id, body in rows:
            out.extend(self._runs(cid, ((run_id, body),)))
        return out

    def list_conversations(self, r: ListConversations) -> list[ConversationHead]:
        if r.after is None:
            rows = self.cur.execute(_CONVERSATIONS_FIRST, (r.limit,)).fetchall()
        else:
            rows = self.cur.execute(_CONVERSATIONS_AFTER, (r.after, r.limit)).fetchall()
        return [self._head(cid, body) for cid, body in rows]

    def load_events(self, r: LoadEvents) -> list[AgentStoreEvent]:
        cid = r.conversation_id
        rows = self.cur.execute(_EVENTS, (cid, _clamp(r.from_seq), _clamp(r.to_seq), r.limit)).fetchall()
        out = []
        for seq, body in rows:
            event = decode(AgentStoreEvent, unpack(body), f"threadline_events conversation_id={cid} seq={seq}")
            if event.conversation_id != cid or event.seq != seq:
                where = f"threadline_events conversation_id={cid} seq={seq}"
                raise foreign("AgentStoreEvent", where, f"{cid}/{seq}", f"{event.conversation_id}/{event.seq}")
            out.append(event)
        return out

    def load_event_keys(self, r: LoadEventKeys) -> list[tuple[str, int]]:
        found: list[tuple[str, int]] = []
        for chunk in _chunks(tuple(dict.fromkeys(r.keys))):
            sql = _BODIES.format(", ".join("?" * len(chunk)))
            found += self.cur.execute(sql, (r.conversation_id, *chunk)).fetchall()
        return found

    def load_all_receipts(self, r: LoadAllReceipts) -> list[AdmissionReceipt]:
        rows = self.cur.execute(_ALL_RECEIPTS, (r.conversation_id,)).fetchall()
        return [self._receipt(r.conversation_id, row) for row in rows]  # type: ignore[misc]

    def load_all_seeds(self, r: LoadAllSeeds) -> list[SeedRecord]:
        out = []
        for key, body in self.cur.execute(_ALL_SEEDS, (r.conversation_id,)).fetchall():
            where = f"threadline_seeds conversation_id={r.conversation_id} seed_key={key}"
            out.append(self.cache.get(SeedRecord, body, lambda where=where: where))
        return out

    def write(self, r: Write) -> None:
        self._begin_write("wrote")
        m = r.mutation
        if m.head is None:
            raise AssertionError("every mutation writes the conversation head")
        cid = m.head.conversation_id
        conn = self.cur
        # plain encoding: ``known`` answers the reads of these rows, and the decoded-record cache would only
        # keep every superseded version alive (work for the garbage collector, no later hit)
        encode = _encode
        known = self.known
        if len(known) > _KNOWN_ROWS:
            known.clear()
        try:
            head_body = encode(m.head)
            if ("h", cid) not in known or not self._updated(_UPDATE_HEAD, [(m.head.version, head_body, cid)]):
                conn.execute(_UPSERT_HEAD, (cid, m.head.version, head_body))
            known["h", cid] = m.head
            if m.runs:
                self._write_runs(m.runs)
            written: dict[int, str] = {}
            if m.messages:
                self.fts_pending = True
                written = self._write_messages(m.messages)
            if m.receipts:
                receipts = [
                    (x.conversation_id, x.idempotency_key, x.input.id, _receipt(x, written)) for x in m.receipts
                ]
                if len(receipts) == 1:
                    conn.execute(_INSERT_RECEIPT, receipts[0])
                else:
                    conn.executemany(_INSERT_RECEIPT, receipts)
            if m.seeds:
                conn.executemany(_INSERT_SEED, [(s.conversation_id, s.seed_key, encode(s)) for s in m.seeds])
            if m.events:
                events = [(cid, e.seq, e.kind, event_key(e), pack(encode_event_bytes(e))) for e in m.events]
                if len(events) == 1:
                    conn.execute(_INSERT_EVENT, events[0])
                else:
                    conn.executemany(_INSERT_EVENT, events)
        except sqlite3.IntegrityError as error:
            if getattr(error, "sqlite_errorcode", None) == _SQLITE_CONSTRAINT_TRIGGER:
                # only the purge guards RAISE in a threadline trigger: a writer that did not see the tombstone
                raise AgentConversationPurgedError(cid) from error
            raise

    def _updated(self, sql: str, rows: list[tuple[Any, ...]]) -> bool:
        """Run an UPDATE of rows ``known`` says are there; False (nothing to undo: the rows it found hold
        what the upsert then writes again) if any is missing, which a correct ``known`` never allows."""
        cur = self.cur
        if len(rows) == 1:
            cur.execute(sql, rows[0])
        else:
            cur.executemany(sql, rows)
        return cur.rowcount == len(rows)

    # Records' fields are read from their ``__dict__`` here: an attribute of a pydantic model goes through
    # its ``__getattr__`` hook (several times the cost of a dict lookup), and a row takes most of them.

    def _write_runs(self, runs: Sequence[Run]) -> None:
        known, encode = self.known, _encode
        upserts: list[tuple[Any, ...]] = []  # the rows of runs this connection did not write (new ones)
        updates: list[tuple[Any, ...]] = []
        ending: list[tuple[Any, ...]] = []  # known rows whose ``active`` changes (the run ended)
        for run in runs:
            f = run.__dict__
            cid, run_id, active = f["conversation_id"], f["id"], f["state"] in ACTIVE_RUN_STATES
            row = (cid, run_id, 1 if active else 0, f["version"], encode(run), f["assistant_message_id"])
            before = known.get(("r", cid, run_id))
            if before is None:
                upserts.append(row)
            else:
                was_active = before.__dict__["state"] in ACTIVE_RUN_STATES
                (updates if was_active == active else ending).append(row)
            if active:
                known["r", cid, run_id] = run
            else:  # an ended run is seldom read again: not worth keeping alive
                known.pop(("r", cid, run_id), None)
        if updates and not self._updated(_UPDATE_RUN, [(r[3], r[4], r[0], r[1]) for r in updates]):
            upserts += updates
        if ending and not self._updated(_UPDATE_RUN_ACTIVE, [(r[2], r[3], r[4], r[0], r[1]) for r in ending]):
            upserts += ending
        if upserts:
            if len(upserts) == 1:
                self.cur.execute(_UPSERT_RUN, upserts[0])
            else:
                self.cur.executemany(_UPSERT_RUN, upserts)

    def _write_messages(self, messages: Sequence[Message]) -> dict[int, str]:
        known, encode = self.known, _encode
        upserts: list[tuple[Any, ...]] = []  # full rows: new, or a change of what the sort and flags index
        updates: list[tuple[Any, ...]] = []
        settling: list[tuple[Any, ...]] = []  # known unsettled rows that take their position
        written: dict[int, str] = {}  # id(message) -> its body (the messages live as long as the mutation)
        for msg in messages:
            f = msg.__dict__
            cid, mid, position, body = f["conversation_id"], f["id"], f["position"], encode(msg)
            written[id(msg)] = body
            row = (
                cid,
                mid,
                0 if f["band"] == "lead" else 1,
                position,
                1 if f["role"] == "summary" else 0,
                f["seq"],
                1 if f["active"] else 0,
                f["version"],
                body,
            )
            entry = known.get(("m", cid, mid))
            b = entry[1].__dict__ if entry is not None else None
            if b is None or (b["active"], b["seq"], b["band"], b["role"]) != (
                f["active"],
                f["seq"],
                f["band"],
                f["role"],
            ):
                upserts.append(row)
            elif b["position"] == position:
                updates.append(row)
            else:
                settling.append(row)
            if position is None:
                known["m", cid, mid] = (body, msg, _snapshot(msg))
            else:  # settled: a mutation seldom reads it again, so its body is not worth keeping
                known.pop(("m", cid, mid), None)
        if updates and not self._updated(_UPDATE_MESSAGE, [(r[7], r[8], r[0], r[1]) for r in updates]):
            upserts += updates
        if settling and not self._updated(_UPDATE_MESSAGE_POSITION, [(r[3], r[7], r[8], r[0], r[1]) for r in settling]):
            upserts += settling
        if upserts:
            if len(upserts) == 1:
                self.cur.execute(_UPSERT_MESSAGE, upserts[0])
            else:
                self.cur.executemany(_UPSERT_MESSAGE, upserts)
        return written

    def purge(self, r: Purge) -> None:
        self._begin_write("purged")
        self.fts_pending = True
        self.forget()
        cid = (r.conversation_id,)
        for sql in _PURGE:
            self.cur.execute(sql, cid)
        # purged_at is informational wall-clock time; the reducer decided the purge
        self.cur.execute(_INSERT_TOMBSTONE, (r.conversation_id, datetime.now(UTC).isoformat()))

    def search(self, conversation_id: str, query: str, limit: int) -> list[Message]:
        rows = self.cur.execute(_SEARCH, (query, conversation_id, conversation_id, limit)).fetchall()
        return self._messages(conversation_id, rows)


# ----------------------------------------------------------------------------------------- worker thread

_MAX_BATCH = 64
"""Jobs one transaction takes at most. A batch only ever holds jobs already waiting when the worker looks
(nothing waits to fill one), so under light load it is a single job. The bound caps what one failed COMMIT
can take down and how long the first caller of a batch waits behind the others: 64 operations are a few
milliseconds of work, while the write lock is held (other connections get ``AgentStoreBusyError`` for that
long, as they would for 64 separate transactions in a row). Beyond a few dozen, a bigger batch saves
almost nothing: the per-transaction cost (BEGIN, COMMIT, one wake-up of the loop) is already spread thin."""

# A job is (kind, a, b, c, loop, future, box).
_JOB_OP = 0  # a, b, c = the operation (a factory of its generator: it may run again), its access, its OperationStats
_JOB_SEARCH = 1  # a, b, c = conversation_id, query, limit
_JOB_CALL = 2  # a, b = fn, args: run between transactions (bench hooks)
_JOB_CLOSE = 3


_CONTAINERS = {ToolCallPart: "input", ToolResultPart: "output", ApprovalRequestPart: "input"}
"""The part field holding a JSON value, per part record (any part's ``envelope`` holds one too)."""


def _mutable(message: Message) -> list[Any]:
    """What of ``message`` a caller could change in place: its metadata, then every JSON container its parts
    hold (a tool call's input, a result's output, provider data); records and their other values are
    frozen."""
    f = message.__dict__
    found: list[Any] = [f["metadata"]]
    for part in f["parts"]:
        fields = part.__dict__
        name = _CONTAINERS.get(type(part))
        if name is not None and isinstance(value := fields[name], (dict, list)):
            found.append(value)
        envelope = fields.get("envelope")
        if envelope is not None and isinstance(data := envelope.__dict__["data"], (dict, list)):
            found.append(data)
    return found


def _snapshot(message: Message) -> bytes | None:
    """:func:`_mutable` as pickled bytes (exact: ``1`` and ``True`` differ, as in JSON); None when it is an
    empty metadata alone, which is unchanged as long as it is still empty."""
    mutable = _mutable(message)
    if len(mutable) == 1 and not mutable[0]:
        return None
    return pickle.dumps(mutable, protocol=5)


def _unchanged(message: Message, snapshot: bytes | None) -> bool:
    """Whether nothing :func:`_snapshot` took of a known message changed since."""
    if snapshot is None:
        return not message.__dict__["metadata"]
    return pickle.dumps(_mutable(message), protocol=5) == snapshot


def _receipt(receipt: AdmissionReceipt, written: dict[int, str]) -> str:
    """A receipt's stored JSON; its input is the message its admission writes beside it, encoded once
    (found by identity: a restore writes thousands of receipts and messages in one mutation)."""
    body = written.get(id(receipt.input))
    return _encode(receipt) if body is None else encode_with(receipt, "input", body)


def _reset(stats: OperationStats) -> None:
    """What an operation counted, forgotten before it runs again from the start."""
    stats.rows_read = stats.rows_written = 0
    stats.by_request.clear()
    stats.writes.clear()


def _wake_all(futures: list[asyncio.Future[None]]) -> None:
    for future in futures:
        if not future.done():  # else its caller was cancelled; whatever the job did stands
            future.set_result(None)


def _fts5_available(conn: sqlite3.Connection) -> bool:
    """Whether this SQLite has FTS5: the compile option, else a probe in the temp schema."""
    try:
        if conn.execute("SELECT sqlite_compileoption_used('ENABLE_FTS5')").fetchone()[0]:
            return True
        conn.execute("CREATE VIRTUAL TABLE temp.threadline_fts5_probe USING fts5(x)")
        conn.execute("DROP TABLE temp.threadline_fts5_probe")
        return True
    except sqlite3.OperationalError:
        return False


class _Checkpointer:
    """Runs ``PRAGMA wal_checkpoint(PASSIVE)`` on a connection and thread of its own when asked. A passive
    checkpoint never blocks the writer or readers of the main connection, and it copies only what no
    reader still needs; the next one catches up with the rest. Started on the first request."""

    def __init__(self, filename: str) -> None:
        self.filename = filename
        self.done = 0
        self._wanted = threading.Condition()
        self._pending = False
        self._stopping = False
        self._thread: threading.Thread | None = None

    def request(self) -> None:
        with self._wanted:
            if self._stopping:
                return
            self._pending = True
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._main,
                    name=f"threadline-sqlite-checkpoint:{os.path.basename(self.filename)}",
                    daemon=True,
                )
                self._thread.start()
            self._wanted.notify()

    def wait_for(self, count: int, timeout: float) -> bool:
        """Block until ``count`` checkpoints completed (tests); False on timeout."""
        with self._wanted:
            return self._wanted.wait_for(lambda: self.done >= count, timeout)

    def stop(self) -> None:
        """Finish a checkpoint in progress, then stop the thread. Idempotent."""
        with self._wanted:
            self._stopping = True
            self._wanted.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join()

    def _main(self) -> None:
        conn = None
        try:
            conn = sqlite3.connect(self.filename, timeout=0, isolation_level=None, check_same_thread=False)
            conn.execute(f"PRAGMA journal_size_limit = {_WAL_SIZE_LIMIT}")
            while True:
                with self._wanted:
                    self._wanted.wait_for(lambda: self._pending or self._stopping)
                    if self._stopping:
                        return
                    self._pending = False
                with contextlib.suppress(sqlite3.Error):  # busy: the next request catches up
                    conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()
                with self._wanted:
                    self.done += 1
                    self._wanted.notify_all()
        except sqlite3.Error:
            return  # no checkpointer: the WAL still checkpoints when the last connection closes
        finally:
            if conn is not None:
                with contextlib.suppress(sqlite3.Error):
                    conn.close()


class SqliteStoreDriver:
    """A :class:`~threadline.store.driver.StoreDriver` over one SQLite connection with a thread of its own
    (see the module docstring for group commit and where a batch runs).

    An operation that raises leaves nothing and the others go on (if it had written, after its batch's
    transaction was rolled back and what depended on that transaction ran again in a new one). Answers are
    delivered only after the ``COMMIT``; if it fails (or SQLite aborts the transaction), every operation
    whose answer depended on it gets the mapped error and nothing of it is durable. An operation sees the
    rows written by the operations before it in its batch, exactly as if they had committed one by one.

    ``max_batch`` is the most operations one transaction takes. Counters (read from any thread):
    ``transactions`` begun, ``operations`` run in them (operations and searches), ``inline_operations``
    (those run on the calling thread), ``transaction_ns`` (wall time inside transactions, ``BEGIN`` to
    ``COMMIT``, on either thread) and ``checkpoints``; ``operations / transactions`` is the mean batch size.
    """

    ledger = True
    """This driver keeps the event ledger (``threadline_events``)."""

    def __init__(
        self,
        filename: str,
        *,
        synchronous: str = "NORMAL",
        read_only: bool = False,
    ) -> None:
        self.filename = filename
        self.read_only = read_only
        self.max_batch = _MAX_BATCH
        self.transactions = 0
        self.operations = 0
        self.transaction_ns = 0
        self.inline_operations = 0
        self._synchronous = synchronous
        self._jobs: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._conn_lock = threading.Lock()  # held by whichever thread is using the connection
        self._inline_writes = synchronous.upper() not in ("FULL", "EXTRA")
        self._writes_since_checkpoint = 0
        self._checkpointer = _Checkpointer(filename)
        self._gathering: dict[asyncio.AbstractEventLoop, list[tuple[Any, ...]]] = {}
        self._closed = False
        self._close_future: asyncio.Future[None] | None = None
        self._init_error: BaseException | None = None
        ready = threading.Event()
        self._thread = threading.Thread(
            target=self._main, args=(ready,), name=f"threadline-sqlite:{os.path.basename(filename)}", daemon=True
        )
        self._thread.start()
        ready.wait()
        if self._init_error is not None:
            error, self._init_error = self._init_error, None
            self._thread.join()
            self._closed = True
            raise error

    # ------------------------------------------------------------------------------ worker side

    def _main(self, ready: threading.Event) -> None:
        conn: sqlite3.Connection | None = None
        try:
            if self.read_only:  # SQLite itself refuses every write, and a missing file is not created
                target, uri = f"{Path(self.filename).resolve().as_uri()}?mode=ro", True
            else:
                target, uri = self.filename, False
            conn = sqlite3.connect(
                target, timeout=0, isolation_level=None, cached_statements=256, check_same_thread=False, uri=uri
            )
            deadline = time.monotonic() + _OPEN_BUSY_GRACE
            while True:
                try:
                    self._initialize(conn)
                    break
                except sqlite3.OperationalError as error:
                    # only opening waits out a lock (another process creating the schema or switching
                    # to WAL at the same moment); operations never do
                    if not _is_busy(error) or time.monotonic() > deadline:
                        raise
                    time.sleep(0.01)
        except BaseException as error:
            if conn is not None:
                with contextlib.suppress(sqlite3.Error):
                    conn.close()
            if isinstance(error, sqlite3.Error):
                mapped = _map_error(error, self.filename)
                if isinstance(mapped, AgentStoreUnavailableError) and _is_notadb(error):
                    mapped = AgentStoreSchemaError(
                        f"{self.filename} is not a SQLite database (SQLITE_NOTADB); threadline will not touch it"
                    )
                if mapped is not None:
                    mapped.__cause__ = error
                    error = mapped
            self._init_error = error
            ready.set()
            return
        self._rows = _SqliteRows(conn)
        ready.set()
        jobs = self._jobs
        max_batch = self.max_batch
        held: tuple[Any, ...] | None = None
        while True:
            job = jobs.get() if held is None else held
            held = None
            kind = job[0]
            if kind <= _JOB_SEARCH:
                batch = [job]
                while len(batch) < max_batch:
                    try:
                        job = jobs.get_nowait()
                    except queue.Empty:
                        break
                    if job[0] > _JOB_SEARCH:
                        held = job  # a call or the close runs after this batch, in queue order
                        break
                    batch.append(job)
                with self._conn_lock:
                    self._execute(batch)
                self._post_batch(batch)
                del batch
            else:
                box = job[6]
                with self._conn_lock:
                    try:
                        if kind == _JOB_CALL:
                            box += (True, job[1](*job[2]))
                        else:  # close: every job accepted before it has run
                            self._checkpointer.stop()
                            conn.close()
                            box += (True, None)
                    except BaseException as error:
                        box += (False, error)
                _post(job[4], [job[5]])
                if kind == _JOB_CLOSE:
                    return
                del box
            del job

    def _execute(self, batch: list[tuple[Any, ...]]) -> None:
        """Run ``batch`` (in as few transactions as it takes: normally one) and fill every job's box.
        The caller holds ``_conn_lock``."""
        start = time.perf_counter_ns()
        try:
            todo = batch
            while todo:
                todo = self._batch_transaction(todo)
        except BaseException as error:  # a bug in this driver: still, no caller may wait for ever
            for job in batch:
                if not job[6]:
                    job[6] += (False, error)
        finally:
            self.transaction_ns += time.perf_counter_ns() - start

    def _post_batch(self, batch: list[tuple[Any, ...]]) -> None:
        """Wake each caller's loop once for the whole batch."""
        loop = batch[0][4]
        if all(job[4] is loop for job in batch):
            _post(loop, [job[5] for job in batch])
        else:
            by_loop: dict[asyncio.AbstractEventLoop, list[asyncio.Future[None]]] = {}
            for job in batch:
                by_loop.setdefault(job[4], []).append(job[5])
            for loop, futures in by_loop.items():
                _post(loop, futures)

    def _batch_transaction(self, todo: list[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
        """Run ``todo`` in one transaction and fill every job's box; return the jobs that need another
        transaction, in order: those that did not run because SQLite aborted the transaction under them, or,
        when an operation failed after it wrote, those that ran after the first write and did not run yet."""
        rows = self._rows
        conn = rows.conn
        write = any(job[0] == _JOB_OP and job[2] == "write" for job in todo)
        try:
            rows.cur.execute("BEGIN IMMEDIATE" if write else "BEGIN")
            rows.check_known()
        except sqlite3.Error as error:
            self._rollback(conn)
            reads = []
            for job in todo:
                if write and _is_busy(error) and not (job[0] == _JOB_OP and job[2] == "write"):
                    reads.append(job)  # another connection's write lock stops writes only; reads go on
                else:
                    self._fail(job, error)
            return reads
        self.transactions += 1
        rows.fts_pending = False
        dirty = False  # an operation that succeeded here wrote: the answers after it saw uncommitted rows
        pending: list[tuple[Any, ...]] = []  # answers that stand only if this transaction commits
        after_write: list[tuple[Any, ...]] = []  # pending, and the failures that saw uncommitted rows too
        rest: list[tuple[Any, ...]] = []
        lost: BaseException | None = None
        failed = False
        for index, job in enumerate(todo):
            box = job[6]
            rows.wrote = False
            self.operations += 1
            try:
                if job[0] == _JOB_OP:
                    box += (True, self._transaction(job[1], job[2], job[3]))
                else:
                    box += (True, self._search(job[1], job[2], job[3]))
            except BaseException as error:
                box += (False, error)
                failed = True
                if not conn.in_transaction:
                    # SQLite rolled the transaction back: what ran before is gone, and what did not run
                    # yet needs a transaction of its own
                    lost, rest = error, todo[index + 1 :]
                    break
                if rows.wrote and len(todo) > 1:
                    # it wrote before it failed: only rolling the whole transaction back undoes that. Its
                    # error stands; every answer that came after the first write is void, and runs again
                    rows.forget()
                    self._rollback(conn)
                    for again in after_write:
                        again[6].clear()
                        if again[0] == _JOB_OP:
                            _reset(again[3])
                    return after_write + todo[index + 1 :]
                if dirty:
                    after_write.append(job)
                continue
            if dirty or rows.wrote:
                dirty = True
                pending.append(job)
                after_write.append(job)
        if lost is not None or (failed and len(todo) == 1):
            rows.forget()
            self._rollback(conn)  # a lone operation's failure rolls back everything it did
        else:
            try:
                rows.flush_fts()
                rows.cur.execute("COMMIT")
            except BaseException as error:
                rows.forget()
                self._rollback(conn)
                lost = error
            else:
                if write:
                    self._wrote()
        if lost is not None:
            for job in pending:
                job[6][:] = (False, self._failure(lost))
        return rest

    def _wrote(self) -> None:
        """Count a committed write transaction; every ``_CHECKPOINT_EVERY``, wake the checkpointer (commits
        on this connection never checkpoint by themselves)."""
        self._writes_since_checkpoint += 1
        if self._writes_since_checkpoint >= _CHECKPOINT_EVERY:
            self._writes_since_checkpoint = 0
            self._checkpointer.request()

    @property
    def checkpoints(self) -> int:
        """Passive WAL checkpoints completed by the checkpointer thread."""
        return self._checkpointer.done

    def _fail(self, job: tuple[Any, ...], error: BaseException) -> None:
        job[6][:] = (False, self._failure(error))

    def _failure(self, error: BaseException) -> Exception:
        """A fresh error for a job whose transaction could not begin or commit because of ``error``
        (nothing of the job was written)."""
        cause = error.__cause__ if isinstance(error.__cause__, sqlite3.Error) else error
        mapped = _map_error(cause, self.filename) if isinstance(cause, sqlite3.Error) else None
        if mapped is None:
            mapped = AgentStoreUnavailableError(
                f"{self.filename}: the transaction was rolled back ({type(error).__name__}: {error}); "
                "nothing of this call was written"
            )
        mapped.__cause__ = error
        return mapped

    def _initialize(self, conn: sqlite3.Connection) -> None:
        conn.execute("PRAGMA busy_timeout = 0")
        if self.read_only:
            self._initialize_read_only(conn)
            return
        mode = conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]
        if str(mode).lower() not in ("wal", "memory"):
            raise AgentStoreUnavailableError(
                f"{self.filename}: SQLite refused WAL journal mode (got {mode!r}); threadline needs WAL"
            )
        conn.execute(f"PRAGMA synchronous = {self._synchronous}")
        conn.execute(f"PRAGMA cache_size = -{_CACHE_KIB}")
        # savepoints and statement journals copy every page they first touch into a sub-journal: in memory,
        # not a temporary file (about an eighth of the write statements' time on the turn workload)
        conn.execute("PRAGMA temp_store = MEMORY")
        conn.execute(f"PRAGMA journal_size_limit = {_WAL_SIZE_LIMIT}")
        conn.execute("PRAGMA wal_autocheckpoint = 0")  # the worker checkpoints (see _wrote)
        if not _fts5_available(conn):
            raise AgentStoreSchemaError(
                f"threadline requires FTS5 support: SQLite {sqlite3.sqlite_version} at {sqlite3.__file__} was built "
                "without ENABLE_FTS5; use a Python whose sqlite3 includes FTS5"
            )
        try:
            conn.execute("BEGIN")
            version = self._inspect(conn)
            conn.execute("COMMIT")
            if version == SQLITE_SCHEMA_VERSION:
                return
            conn.execute("BEGIN IMMEDIATE")
            version = self._inspect(conn)  # again under the write lock: another connection may have been first
            if version == 0:  # no threadline object: create everything at once
                for sql in _REQUIRED.values():
                    conn.execute(sql)
                conn.execute(
                    "INSERT INTO threadline_meta (key, value) VALUES ('schema_version', ?)",
                    (str(SQLITE_SCHEMA_VERSION),),
                )
            elif version < SQLITE_SCHEMA_VERSION:
                self._migrate(conn, version)
            conn.execute("COMMIT")
        except BaseException:
            self._rollback(conn)
            raise

    def _initialize_read_only(self, conn: sqlite3.Connection) -> None:
        """Read-only: change nothing (no journal mode, no schema, no migration); the schema must be there,
        at this threadline's version."""
        conn.execute(f"PRAGMA cache_size = -{_CACHE_KIB}")
        conn.execute("BEGIN")
        try:
            version = self._inspect(conn)
        finally:
            self._rollback(conn)
        if version == 0:
            raise AgentStoreSchemaError(
                f"{self.filename} holds no threadline tables (opened read-only: nothing created)"
            )
        if version != SQLITE_SCHEMA_VERSION:
            raise AgentStoreSchemaError(
                f"{self.filename} holds threadline schema version {version}; this threadline migrates it to "
                f"{SQLITE_SCHEMA_VERSION} when it opens the file for writing (opened read-only: nothing changed)"
            )

    def _inspect(self, conn: sqlite3.Connection) -> int:
        """The schema version present (0: no threadline object exists). A partial schema, or a version this
        driver does not know, is :class:`AgentStoreSchemaError`; an earlier version is checked by its
        migration."""
        names = {name for (name,) in conn.execute("SELECT name FROM sqlite_master WHERE name GLOB 'threadline_*'")}
        if not names:
            return 0
        if "threadline_meta" not in names:
            raise AgentStoreSchemaError(f"{self.filename}: partial threadline schema: missing threadline_meta")
        row = conn.execute("SELECT value FROM threadline_meta WHERE key = 'schema_version'").fetchone()
        if row is None:
            raise AgentStoreSchemaError(
                f"{self.filename}: partial threadline schema: missing threadline_meta schema_version"
            )
        version = int(row[0]) if str(row[0]).isdigit() else -1
        if not 1 <= version <= SQLITE_SCHEMA_VERSION:
            raise AgentStoreSchemaError(
                f"{self.filename}: threadline schema version {row[0]!r} is not supported; this threadline supports "
                f"schema versions 1 to {SQLITE_SCHEMA_VERSION} (earlier ones are migrated forward). Use the "
                "threadline release that wrote this database."
            )
        if version == SQLITE_SCHEMA_VERSION:
            missing = [name for name in _REQUIRED if name not in names]
            if missing:
                raise AgentStoreSchemaError(f"{self.filename}: partial threadline schema: missing {', '.join(missing)}")
        return version

    def _migrate(self, conn: sqlite3.Connection, version: int) -> None:
        """Bring a schema of ``version`` forward to this driver's, inside the caller's write transaction
        (all of it commits, or none)."""
        try:
            for step in range(version, SQLITE_SCHEMA_VERSION):
                for sql in _MIGRATIONS[step]:
                    conn.execute(sql)
                if step == 4:
                    self._baselines(conn)
        except sqlite3.OperationalError as error:  # an object the earlier version had is missing
            raise AgentStoreSchemaError(
                f"{self.filename}: cannot migrate threadline schema version {version} to "
                f"{SQLITE_SCHEMA_VERSION}: {error}; the database was left as it was"
            ) from error
        conn.execute("UPDATE threadline_meta SET value = ? WHERE key = 'schema_version'", (str(SQLITE_SCHEMA_VERSION),))
        self._inspect(conn)  # complete at the new version, or refused (and rolled back)

    def _baselines(self, conn: sqlite3.Connection) -> None:
        """Give every existing conversation its ``runtime/baseline`` at seq 1 (inside the migration's
        transaction), one conversation at a time: its rows as they stand, dated now."""
        migrated_at = datetime.now(UTC)
        cids = [cid for (cid,) in conn.execute("SELECT conversation_id FROM threadline_conversations")]
        for cid in cids:

            def rows(sql: str, cid: str = cid) -> list[str]:
                return [body for (body,) in conn.execute(sql, (cid,))]

            head_body = rows("SELECT body FROM threadline_conversations WHERE conversation_id = ?")[0]
            head, event = baseline_rows(
                head=decode(ConversationHead, head_body, f"threadline_conversations conversation_id={cid}"),
                messages=[
                    decode(Message, b, f"threadline_messages conversation_id={cid}")
                    for b in rows("SELECT body FROM threadline_messages WHERE conversation_id = ? ORDER BY seq")
                ],
                runs=[
                    decode(Run, b, f"threadline_runs conversation_id={cid}")
                    for b in rows("SELECT body FROM threadline_runs WHERE conversation_id = ? ORDER BY rowid")
                ],
                receipts=[
                    decode(AdmissionReceipt, b, f"threadline_admissions conversation_id={cid}")
                    for b in rows("SELECT body FROM threadline_admissions WHERE conversation_id = ?")
                ],
                seeds=[
                    decode(SeedRecord, b, f"threadline_seeds conversation_id={cid}")
                    for b in rows("SELECT body FROM threadline_seeds WHERE conversation_id = ?")
                ],
                now=migrated_at,
            )
            conn.execute(_UPDATE_HEAD, (head.version, _encode(head), cid))
            conn.execute(_INSERT_EVENT, (cid, event.seq, event.kind, None, pack(_encode(event))))

    def _transaction(self, operation: Callable[[], Operation[T]], access: Access, stats: OperationStats) -> T:
        """Run one operation inside the batch's open transaction (``bench/`` wraps this hook to time it).

        If it raises, the caller rolls back what it wrote (with the whole transaction: see
        :meth:`_batch_transaction`)."""
        rows = self._rows
        rows.writable = access == "write"
        steps = operation()
        try:
            return drive_sync(steps, rows, stats)
        except BaseException as error:
            steps.close()
            rows.forget()  # it may have written: what it wrote is rolled back (with the whole transaction)
            if isinstance(error, sqlite3.Error):
                mapped = _map_error(error, self.filename)
                if mapped is not None:
                    raise mapped from error
            raise
        finally:
            rows.writable = False

    def _search(self, conversation_id: str, query: str, limit: int) -> list[Message]:
        try:
            self._rows.flush_fts()
            return self._rows.search(conversation_id, query, limit)
        except sqlite3.Error as error:
            if isinstance(error, sqlite3.OperationalError) and getattr(error, "sqlite_errorcode", None) == 1:
                # SQLITE_ERROR from a fixed, valid statement: the caller's FTS5 query does not parse
                raise AgentRecordValidationError(
                    f"query is not a valid FTS5 query: {error}; quote words with double quotes", field="query"
                ) from error
            mapped = _map_error(error, self.filename)
            if mapped is not None:
                raise mapped from error
            raise

    @staticmethod
    def _rollback(conn: sqlite3.Connection) -> None:
        if conn.in_transaction:
            # the original error is what matters; a failed ROLLBACK leaves SQLite to abort the transaction
            with contextlib.suppress(sqlite3.Error):
                conn.execute("ROLLBACK")

    # ------------------------------------------------------------------------------ loop side

    async def _submit(self, kind: int, a: object, b: object, c: object) -> Any:
        """Queue one job for the worker thread and return its answer (or raise its exception).

        The answer travels in ``box``, not in the future: asyncio keeps the waking future referenced until
        the loop finishes its batch, and a large answer (a whole snapshot) freed there would make the next
        job wait for the GIL. This way the caller alone decides when an answer is freed.
        """
        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()
        box: list[Any] = []
        with self._lock:
            if self._closed:
                raise self._closed_error()
            self._jobs.put((kind, a, b, c, loop, future, box))
        await future
        return _unbox(box)

    def _flush(self, loop: asyncio.AbstractEventLoop) -> None:
        jobs = self._gathering.pop(loop, None)
        if not jobs:  # close took them first
            return
        if self._jobs.empty() and self._conn_lock.acquire(False):
            try:
                if self._closed:
                    self._refuse(jobs)
                else:
                    self.inline_operations += len(jobs)
                    for start in range(0, len(jobs), self.max_batch):
                        self._execute(jobs[start : start + self.max_batch])
            finally:
                self._conn_lock.release()
            _wake_all([job[5] for job in jobs])
            return
        with self._lock:
            if not self._closed:
                for job in jobs:
                    self._jobs.put(job)
                return
        self._refuse(jobs)
        _wake_all([job[5] for job in jobs])

    def _refuse(self, jobs: list[tuple[Any, ...]]) -> None:
        for job in jobs:
            job[6][:] = (False, self._closed_error())

    def _closed_error(self) -> AgentStoreUnavailableError:
        return AgentStoreUnavailableError(f"the SQLite store {self.filename} was closed")

    async def _call(self, fn: Callable[..., T], *args: object) -> T:
        """Run ``fn(*args)`` on the worker thread, between transactions (in queue order), and return its
        result. A private hook for ``bench/`` (profilers, thread CPU time)."""
        return await self._submit(_JOB_CALL, fn, args, None)  # type: ignore[no-any-return]

    async def run(self, operation: Callable[[], Operation[T]], *, access: Access, stats: OperationStats) -> T:
        """Run ``operation()`` in a transaction it may share with the operations started at the same
        moment (group commit): on the calling thread when the connection's thread is idle, else on that
        thread (always there for a write with ``synchronous='FULL'``).

        When it returns, the transaction holding its writes has committed: durable against a process
        crash with ``synchronous='NORMAL'``, against power loss too with ``'FULL'``. When it raises,
        nothing it attempted was written; another operation of the same batch failing does not make it
        fail unless the shared transaction itself could not commit. Cancelling the awaiting task does not
        withdraw the operation: once queued it runs, and it may still commit (with its batch) — the caller
        cannot tell whether it did; read back or retry with the same identity.
        """
        if not (access == "read" or self._inline_writes):
            return await self._submit(_JOB_OP, operation, access, stats)  # type: ignore[no-any-return]
        # Gathered: held until the event loop has run what is ready now (``_flush``); everything gathered
        # by then commits together, here on the calling thread when the worker is idle and nothing waits
        # for it, else on the worker.
        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()
        box: list[Any] = []
        pending = self._gathering.get(loop)
        if pending is None:
            pending = self._gathering[loop] = []
            loop.call_soon(self._flush, loop)
        pending.append((_JOB_OP, operation, access, stats, loop, future, box))
        await future
        return _unbox(box)  # type: ignore[no-any-return]

    async def search_messages(self, conversation_id: str, query: str, limit: int = 20) -> list[Message]:
        if not isinstance(conversation_id, str) or not conversation_id:
            raise AgentRecordValidationError("conversation_id is a non-empty string", field="conversation_id")
        if not isinstance(query, str) or not query.strip():
            raise AgentRecordValidationError("query is a non-empty FTS5 query string", field="query")
        if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_SEARCH_LIMIT:
            raise AgentRecordValidationError(
                f"limit must be between 1 and {MAX_SEARCH_LIMIT}, got {limit!r}", field="limit"
            )
        return await self._submit(_JOB_SEARCH, conversation_id, query, limit)  # type: ignore[no-any-return]

    async def aclose(self) -> None:
        """Let every accepted job finish, close the connection and stop the thread. Idempotent."""
        with self._lock:
            future = self._close_future
            if future is None and not self._closed:
                loop = asyncio.get_running_loop()
                future = self._close_future = loop.create_future()
                self._closed = True
                for job in self._gathering.pop(loop, ()):  # started before close: they run first
                    self._jobs.put(job)
                self._jobs.put((_JOB_CLOSE, None, None, None, loop, future, []))
        if future is None:
            return
        if future.get_loop() is asyncio.get_running_loop():
            await asyncio.shield(future)
        else:
            await asyncio.to_thread(self._thread.join)
        self._thread.join()


def _unbox(box: list[Any]) -> Any:
    """A job's answer, emptied out of its box (see ``_submit``): the value, or its exception raised."""
    ok, value = box
    box.clear()
    if ok:
        return value
    try:
        raise value
    finally:
        del value


def _post(loop: asyncio.AbstractEventLoop, futures: list[asyncio.Future[None]]) -> None:
    with contextlib.suppress(RuntimeError):  # the loop was closed: nobody is waiting any more
        loop.call_soon_threadsafe(_wake_all, futures)


def _is_notadb(error: sqlite3.Error) -> bool:
    code = getattr(error, "sqlite_errorcode", None)
    return code is not None and code & 0xFF == _SQLITE_NOTADB


# ----------------------------------------------------------------------------------------------- handle


def _application_transaction(driver: SqliteStoreDriver, work: Callable[[sqlite3.Connection], T]) -> T:
    """``work(connection)`` in one ``BEGIN IMMEDIATE`` transaction on the store's thread, between the
    store's own transactions (the caller holds the connection lock: see ``SqliteStoreDriver._main``)."""
    rows = driver._rows
    conn = rows.conn
    try:
        conn.execute("BEGIN IMMEDIATE")
    except sqlite3.Error as error:
        driver._rollback(conn)
        mapped = _map_error(error, driver.filename)
        if mapped is None:
            raise
        raise mapped from error
    try:
        result = work(conn)
        if not conn.in_transaction:
            raise AgentRecordValidationError(
                "the transaction's work ended the transaction itself (COMMIT or ROLLBACK); the store commits it",
                field="work",
            )
        # the work may have changed threadline rows: what this connection remembers is no longer trusted,
        # and settled messages it touched are indexed for search before the COMMIT, as the store does
        rows.forget()
        rows.fts_pending = True
        rows.flush_fts()
        conn.execute("COMMIT")
    except BaseException as error:
        rows.forget()
        driver._rollback(conn)
        if isinstance(error, sqlite3.Error) and not isinstance(
            error, sqlite3.IntegrityError | sqlite3.ProgrammingError
        ):
            mapped = _map_error(error, driver.filename)
            if isinstance(mapped, AgentStoreBusyError):
                raise mapped from error
        raise
    driver._wrote()
    return result


class SqliteAgentRuntimeStoreHandle:
    """An open SQLite store: ``store`` (the :class:`AgentRuntimeStore`), ``conversations`` (its paged
    reader), ``database`` (the store's own connection), :meth:`transaction` (one write transaction of the
    application's, in the store's own serialization), full-text :meth:`search_messages`, and :meth:`aclose`.
    Also an async context manager that closes it on exit. ``create_agent_runtime(store=handle)`` takes the
    handle itself."""

    def __init__(self, driver: SqliteStoreDriver, store: AgentRuntimeStore) -> None:
        self.driver = driver
        self.store = store
        self.conversations: AgentConversationReader = store.conversations
        self.filename = driver.filename

    @property
    def database(self) -> sqlite3.Connection:
        """The store's one connection (shared: its thread uses it). Use it only inside :meth:`transaction`,
        which hands it to the work; anywhere else it may be in the middle of a store transaction."""
        return self.driver._rows.conn

    async def transaction(self, work: Callable[[sqlite3.Connection], T]) -> T:
        """Run ``work(connection)`` — a synchronous function, on the store's thread — in one write
        transaction (``BEGIN IMMEDIATE``) in the store's own serialization: no store operation of this handle
        runs inside it, and what ``work`` writes commits together or not at all. Returns what ``work``
        returns. If ``work`` raises, everything it wrote is rolled back and its exception propagates (do not
        ``COMMIT`` or ``ROLLBACK`` inside it). Another connection's write lock is
        :class:`~threadline.errors.AgentStoreBusyError` at once, having written nothing (never waited
        for); a closed or read-only handle is :class:`~threadline.errors.AgentStoreUnavailableError`."""
        if not callable(work):
            raise AgentRecordValidationError(f"work is a function of the connection, got {work!r}", field="work")
        if self.driver.read_only:
            raise AgentStoreUnavailableError(f"{self.filename} was opened read-only: it takes no write transaction")
        return await self.driver._call(_application_transaction, self.driver, work)

    async def search_messages(self, conversation_id: str, query: str, limit: int = 20) -> list[Message]:
        """Settled messages of one conversation whose text matches the FTS5 ``query``, best match first.
        A purged or unknown conversation has none. ``limit`` is 1..1000."""
        return await self.driver.search_messages(conversation_id, query, limit)

    async def aclose(self) -> None:
        """Finish accepted operations, then close the connection. Later calls raise
        :class:`~threadline.errors.AgentStoreUnavailableError`. Idempotent. ``async with`` closes the same
        way on exit; ``close()`` is the same call."""
        await self.store.aclose()

    async def close(self) -> None:
        """:meth:`aclose` (kept as a second spelling)."""
        await self.store.aclose()

    async def __aenter__(self) -> SqliteAgentRuntimeStoreHandle:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    def __repr__(self) -> str:
        return f"<SqliteAgentRuntimeStoreHandle {self.filename!r}>"


def create_sqlite_agent_runtime_store(
    filename: str | os.PathLike[str],
    *,
    synchronous: Literal["NORMAL", "FULL"] = "NORMAL",
    clock: Callable[[], datetime] | None = None,
    read_only: bool = False,
) -> SqliteAgentRuntimeStoreHandle:
    """Open (creating if needed) the threadline schema in ``filename`` and return a handle.

    ``synchronous='NORMAL'`` (default) survives process crashes; ``'FULL'`` also survives power loss at
    the cost of an fsync per commit. ``read_only=True`` opens an existing database with SQLite's
    ``mode=ro`` (what ``threadline inspect`` does): nothing is created or migrated, every write fails with
    :class:`~threadline.errors.AgentStoreUnavailableError`, and a file without the current threadline
    schema is :class:`~threadline.errors.AgentStoreSchemaError`. Raises
    :class:`~threadline.errors.AgentStoreSchemaError` for an unknown, partial or foreign schema (or a
    SQLite without FTS5), and :class:`~threadline.errors.AgentStoreUnavailableError` when the file cannot
    be opened (read-only: also when it does not exist).
    """
    if not isinstance(synchronous, str) or synchronous.upper() not in _SYNCHRONOUS:
        raise AgentRecordValidationError(f"synchronous is 'NORMAL' or 'FULL', got {synchronous!r}", field="synchronous")
    if not isinstance(read_only, bool):
        raise AgentRecordValidationError(f"read_only is True or False, got {read_only!r}", field="read_only")
    driver = SqliteStoreDriver(os.fspath(filename), synchronous=synchronous.upper(), read_only=read_only)
    store = create_agent_runtime_store(driver) if clock is None else create_agent_runtime_store(driver, clock=clock)
    return SqliteAgentRuntimeStoreHandle(driver, store)
