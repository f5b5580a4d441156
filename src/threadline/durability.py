"""Durable steps inside tools: ``ctx.step(name, body)`` records an external effect's intent and proof.

A tool that performs an external effect (charge a card, send a mail, create a ticket) wraps it in a step::

    @define_agent_tool
    async def refund(ctx: AgentToolContext, order_id: str) -> dict:
        return await ctx.step(f"refund:{order_id}", lambda: payments.refund(order_id))

**The value.** A step body returns *lossless JSON*: ``None``, ``bool``, ``int``, finite ``float`` (not
``-0.0``), ``str`` (valid Unicode), ``list`` and ``dict`` with ``str`` keys — exact types, nested freely.
Anything else (tuples, sets, datetimes, ``Decimal``, bytes, enums, custom objects, ``nan``, ``inf``,
``-0.0``, a ``str`` subclass, a cycle) is refused with :class:`AgentStepValueError`, which names the path of
the offending value (``$.items[2].when``). The refusal happens **after the body ran**: the external effect
already happened, so effects still need their own idempotency. Return ``None`` explicitly from effect-only
bodies and convert datetimes to strings yourself. The first result and every replay are *detached* copies:
mutating what a step returned changes neither the record nor a later replay.

A body is a zero-argument callable: an ``async def``, or a plain function (which runs on the event
loop's thread — put blocking work in ``asyncio.to_thread`` — and may return an awaitable, as
``lambda: client.post(...)`` does).

**The ledger.** :func:`create_local_step_durability` keys records by ``(conversation_id, run_id,
effect_name)``. They live in process memory, in their own SQLite file, or — with ``store=`` — in the
conversation store's event ledger, as ``durability/effect`` events (below). Before the body runs, an
*intent* is committed; after it returns, the *accepted proof* (the JSON value). A later call with the
same key — typically the same tool running again after the run was requeued following a crash — never
runs the body again:

- accepted proof → the proof is returned (a detached copy);
- bare intent (the process died, the body raised, was cancelled, or returned a refused value) → the
  ``reconcile`` callback passed to ``ctx.step`` decides: it receives the intent's
  :class:`AgentStepRecord`, asks the external system, and returns the proof value (which becomes the
  accepted proof) or ``None``; without ``reconcile``, or when it returns ``None``, the outcome is
  *uncertain*: :class:`AgentStepUncertainError`, carrying the key. Uncertain is not failure: the effect
  may or may not have happened.

It does not deduplicate a new run or a newly named effect: a new ``run_id`` or ``effect_name`` is a new
key, and its body runs. The name must therefore identify the effect inside the run (include the business
identity, e.g. the order id, when one tool may run several distinct effects). Within one durability
object, concurrent calls with the same key wait for the first to finish and then see its record; two
processes sharing one SQLite file race only on the intent (an atomic insert): the loser sees a bare intent.

These records are not conversation history: compaction of the conversation never touches them, so an
intent (hence an uncertain outcome) and a proof stay available after history is compacted.

**In the conversation's ledger** (``create_local_step_durability(store=store)``, any store whose driver
keeps the ledger: memory, SQLite, PostgreSQL): the intent is a ``durability/effect`` event committed
before the body runs, the proof another committed after it, each in one write transaction of the store,
found by its key through the ledger's lookup index (constant work, whatever the conversation's length).
Being ledger events they travel with the conversation: an archive (``export_conversation``) carries them,
and after ``import_conversation`` into another store a durability built on that store returns the accepted
proof, reconciles the bare intent or reports it uncertain, exactly as before — without running the body.
A branch keeps them only as inert observations: the new conversation inherits no proof. Purging the
conversation (``purge_conversation``) removes them with it. Every process using the store shares the
records: the claim is serialized with the conversation's other writes, and a second claimant of a key sees
the first one's intent. Give the runtime this durability
(``loop={"step_durability": create_local_step_durability(store=handle.store)}``) and every ``ctx.step``
of its tools is recorded beside the conversation.

With the memory or file form, :meth:`LocalStepDurability.purge` removes a conversation's records when the
conversation is purged.

**Without durability** (no ledger given to the runtime), ``ctx.step`` still runs the body, enforces
lossless JSON and returns a detached copy, but records nothing: calling it again runs the body again, and
``reconcile`` is never called.

The error tree (both are :class:`~threadline.tools.AppError`, so a tool that does not catch them reports
their code to the model instead of ``INTERNAL_SERVER_ERROR``, with ``retryable`` false)::

    AppError
    ├── AgentStepValueError        STEP_VALUE_REFUSED: the body's value is not lossless JSON (the effect ran)
    └── AgentStepUncertainError    STEP_UNCERTAIN: a bare intent and no proof; the effect may have happened
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import os
import sqlite3
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime
from types import TracebackType
from typing import TYPE_CHECKING, Any, Literal, NamedTuple, Protocol, runtime_checkable

from .errors import (
    AgentRuntimeUsageError,
    AgentStoreBusyError,
    AgentStoreCapabilityError,
    AgentStoreCorruptRecordError,
    AgentStoreSchemaError,
    AgentStoreUnavailableError,
    AppError,
)
from .jsonvalue import LosslessJsonError, lossless_json

if TYPE_CHECKING:
    from .store.aggregate import AgentRuntimeStore

__all__ = [
    "STEP_EFFECTS_TABLE",
    "STEP_UNCERTAIN",
    "STEP_VALUE_REFUSED",
    "AgentStepDurability",
    "AgentStepKey",
    "AgentStepRecord",
    "AgentStepUncertainError",
    "AgentStepValueError",
    "LocalStepDurability",
    "create_local_step_durability",
    "run_agent_step",
]

STEP_VALUE_REFUSED = "STEP_VALUE_REFUSED"
STEP_UNCERTAIN = "STEP_UNCERTAIN"
STEP_EFFECTS_TABLE = "threadline_step_effects"

StepBody = Callable[[], Any]
"""A zero-argument callable: ``async def`` or plain; a plain one returning an awaitable is awaited."""
StepReconcile = Callable[["AgentStepRecord"], Any]
"""Called with the bare intent's record; returns (or resolves to) the proof value, or ``None``."""


# ------------------------------------------------------------------------------------------------ records


class AgentStepKey(NamedTuple):
    """What identifies one effect: the conversation, the run and the effect's name inside the run."""

    conversation_id: str
    run_id: str
    effect_name: str


@dataclass(frozen=True)
class AgentStepRecord:
    """One ledger record, as :meth:`LocalStepDurability.read` and ``reconcile`` see it."""

    conversation_id: str
    run_id: str
    effect_name: str
    state: Literal["intent", "accepted"]
    """``intent``: committed before the body ran, no proof yet. ``accepted``: the proof is recorded."""
    value: Any
    """The accepted proof (a detached copy: mutating it changes nothing stored); ``None`` for an intent."""
    intent_at: datetime
    """When the intent was committed (UTC)."""
    accepted_at: datetime | None
    """When the proof was committed (UTC); ``None`` for an intent."""
    reconciled: bool
    """True when the proof came from ``reconcile`` rather than from the body."""

    @property
    def key(self) -> AgentStepKey:
        return AgentStepKey(self.conversation_id, self.run_id, self.effect_name)


class AgentStepValueError(AppError):
    """A step body (or ``reconcile``) returned a value that is not lossless JSON.

    Raised **after** the body ran: the external effect already happened and its result was not recorded.
    With durability the intent stays, so a later call with the same key reconciles or is uncertain; it
    never runs the body again. ``path`` names the offending value (``$.items[2].when``), ``reason`` says
    what is wrong with it, ``effect_name`` which step it was.
    """

    def __init__(self, effect_name: str | None, path: str, reason: str) -> None:
        where = f"step {effect_name!r}" if effect_name is not None else "step"
        super().__init__(
            STEP_VALUE_REFUSED,
            f"{where} returned a value that is not lossless JSON at {path}: {reason}; "
            "the effect ran but its result was not recorded",
            details={"effect_name": effect_name, "path": path},
            hint="the effect already happened: do not repeat it without checking its outcome",
        )
        self.effect_name = effect_name
        self.path = path
        self.reason = reason


class AgentStepUncertainError(AppError):
    """A step's key holds a bare intent and no proof: the effect may or may not have happened.

    The body was **not** run again. Raised when ``ctx.step`` was called without ``reconcile``, or when
    ``reconcile`` returned ``None`` (``reconcile_attempted``). ``key`` and ``record`` (the intent) say which
    effect; the intent stays, so the next call with the same key is uncertain again until reconciled.
    """

    def __init__(self, record: AgentStepRecord, *, reconcile_attempted: bool) -> None:
        tried = "reconcile could not confirm it" if reconcile_attempted else "no reconcile was given"
        super().__init__(
            STEP_UNCERTAIN,
            f"the outcome of step {record.effect_name!r} is uncertain: it was started before and never "
            f"recorded a result ({tried})",
            details={"effect_name": record.effect_name},
            hint="the effect may or may not have happened: check it before doing it again",
        )
        self.record = record
        self.key = record.key
        self.conversation_id = record.conversation_id
        self.run_id = record.run_id
        self.effect_name = record.effect_name
        self.reconcile_attempted = reconcile_attempted


# ----------------------------------------------------------------------------------------- lossless JSON


def _lossless(value: Any, effect_name: str | None) -> tuple[Any, str]:
    """A detached copy of ``value`` and its JSON text, or :class:`AgentStepValueError` naming the path."""
    try:
        return lossless_json(value)
    except LosslessJsonError as refused:
        raise AgentStepValueError(effect_name, refused.path, refused.reason) from None


def _decode(text: str, where: str) -> Any:
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as error:
        raise AgentStoreCorruptRecordError("the stored proof is not JSON", where=where) from error


# --------------------------------------------------------------------------------------- calling bodies


def _check_callable(name: str, body: Any, what: str) -> None:
    if inspect.iscoroutine(body):
        body.close()
        raise AgentRuntimeUsageError(
            f"step {name!r}: {what} is a coroutine object; pass the function itself (e.g. `lambda: call()`), "
            "so a replay does not run it"
        )
    if not callable(body):
        raise AgentRuntimeUsageError(f"step {name!r}: {what} must be a callable, got {type(body).__name__}")


async def _call(fn: Callable[..., Any], *args: Any) -> Any:
    result = fn(*args)
    if inspect.isawaitable(result):
        result = await result
    return result


def _check_name(label: str, value: Any) -> None:
    if type(value) is not str or not value:
        raise AgentRuntimeUsageError(f"a step's {label} is a non-empty str, got {value!r}")


async def run_agent_step(
    durability: AgentStepDurability | None,
    conversation_id: str,
    run_id: str,
    effect_name: str,
    body: StepBody,
    *,
    reconcile: StepReconcile | None = None,
    joined_run_ids: tuple[str, ...] = (),
) -> Any:
    """What ``AgentToolContext.step`` does: through ``durability`` when there is one, otherwise run the
    body and return a detached, lossless-JSON copy of its value (nothing recorded, ``reconcile`` unused).
    ``joined_run_ids``: queued runs whose injected inputs the run answers too (the step stands for them).

    Cancellation: without durability, cancelling cancels the body; nothing is recorded either way.
    """
    if durability is not None:
        if joined_run_ids:  # only then: a ledger written before this keyword existed keeps working
            return await durability.step(
                conversation_id, run_id, effect_name, body, reconcile=reconcile, joined_run_ids=joined_run_ids
            )
        return await durability.step(conversation_id, run_id, effect_name, body, reconcile=reconcile)
    _check_name("effect name", effect_name)
    _check_callable(effect_name, body, "the body")
    if reconcile is not None:
        _check_callable(effect_name, reconcile, "reconcile")
    copied, _text = _lossless(await _call(body), effect_name)
    return copied


# ------------------------------------------------------------------------------------------- the ledger


@runtime_checkable
class AgentStepDurability(Protocol):
    """A ledger of step effects. :class:`LocalStepDurability` is the one threadline ships."""

    async def step(
        self,
        conversation_id: str,
        run_id: str,
        effect_name: str,
        body: StepBody,
        *,
        reconcile: StepReconcile | None = None,
        joined_run_ids: tuple[str, ...] = (),
    ) -> Any: ...

    async def read(self, conversation_id: str, run_id: str, effect_name: str) -> AgentStepRecord | None: ...

    async def purge(self, conversation_id: str) -> int: ...

    async def close(self) -> None: ...


_Row = tuple[str, str | None, str, str | None, int]
"""(state, value JSON, intent_at, accepted_at, reconciled)"""


class _MemoryLedger:
    """Process-local records; every operation is synchronous and atomic on the event-loop thread."""

    def __init__(self) -> None:
        self.rows: dict[AgentStepKey, _Row] = {}

    def claim(self, keys: tuple[AgentStepKey, ...], now: str) -> tuple[AgentStepKey, _Row] | None:
        for key in keys:
            row = self.rows.get(key)
            if row is not None:
                return key, row
        for key in keys:
            self.rows[key] = ("intent", None, now, None, 0)
        return None

    def accept(self, keys: tuple[AgentStepKey, ...], text: str, now: str, reconciled: bool) -> _Row | None:
        row = self.rows.get(keys[0])
        if row is None or row[0] != "intent":
            return row
        for key in keys:
            current = self.rows.get(key)
            if current is not None and current[0] == "intent":
                self.rows[key] = ("accepted", text, current[2], now, int(reconciled))
        return None

    def read(self, key: AgentStepKey) -> _Row | None:
        return self.rows.get(key)

    def purge(self, conversation_id: str) -> int:
        doomed = [key for key in self.rows if key.conversation_id == conversation_id]
        for key in doomed:
            del self.rows[key]
        return len(doomed)

    def close(self) -> None:
        pass


_SQLITE_BUSY, _SQLITE_LOCKED = 5, 6
_COLUMNS = ("conversation_id", "run_id", "effect_name", "state", "value", "reconciled", "intent_at", "accepted_at")
_CREATE = f"""
CREATE TABLE IF NOT EXISTS {STEP_EFFECTS_TABLE} (
    conversation_id TEXT NOT NULL,
    run_id TEXT NOT NULL,
    effect_name TEXT NOT NULL,
    state TEXT NOT NULL CHECK (state IN ('intent', 'accepted')),
    value TEXT,
    reconciled INTEGER NOT NULL DEFAULT 0,
    intent_at TEXT NOT NULL,
    accepted_at TEXT,
    PRIMARY KEY (conversation_id, run_id, effect_name)
) WITHOUT ROWID
"""
_WHERE_KEY = "conversation_id = ? AND run_id = ? AND effect_name = ?"
_SELECT = f"SELECT state, value, intent_at, accepted_at, reconciled FROM {STEP_EFFECTS_TABLE} WHERE {_WHERE_KEY}"


def _map_sqlite(error: sqlite3.Error, filename: str) -> Exception:
    """The typed error for a sqlite3 failure, by result code (never by message text)."""
    code = getattr(error, "sqlite_errorcode", None)
    name = getattr(error, "sqlite_errorname", None) or type(error).__name__
    if code is not None and code & 0xFF in (_SQLITE_BUSY, _SQLITE_LOCKED):
        return AgentStoreBusyError(f"{filename}: another connection holds the step ledger's lock ({name}); retry")
    return AgentStoreUnavailableError(f"{filename}: SQLite failed on the step ledger ({name}): {error}")


class _SqliteLedger:
    """Records in their own SQLite file. Every method runs on the ledger's one worker thread and commits
    before it returns."""

    def __init__(self, filename: str, synchronous: str, busy_timeout: float) -> None:
        self.filename = filename
        self.conn: sqlite3.Connection | None = None
        self._synchronous = synchronous
        self._busy_ms = max(0, int(busy_timeout * 1000))

    def open(self) -> None:
        try:
            conn = sqlite3.connect(self.filename, timeout=self._busy_ms / 1000, isolation_level=None)
        except sqlite3.Error as error:
            raise _map_sqlite(error, self.filename) from error
        try:
            conn.execute(f"PRAGMA busy_timeout = {self._busy_ms}")
            mode = str(conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]).lower()
            if mode not in ("wal", "memory"):
                raise AgentStoreUnavailableError(f"{self.filename}: SQLite refused WAL journal mode (got {mode!r})")
            conn.execute(f"PRAGMA synchronous = {self._synchronous}")
            names = {n for (n,) in conn.execute("SELECT name FROM sqlite_master WHERE name GLOB 'threadline_*'")}
            if "threadline_meta" in names:
                raise AgentStoreSchemaError(
                    f"{self.filename} holds a threadline runtime store; give the step ledger its own file"
                )
            conn.execute(_CREATE)
            columns = tuple(row[1] for row in conn.execute(f"PRAGMA table_info({STEP_EFFECTS_TABLE})"))
            if sorted(columns) != sorted(_COLUMNS):
                raise AgentStoreSchemaError(
                    f"{self.filename}: {STEP_EFFECTS_TABLE} has columns {list(columns)}; expected {list(_COLUMNS)}"
                )
        except BaseException as error:
            with contextlib.suppress(sqlite3.Error):
                conn.close()
            if isinstance(error, sqlite3.Error):
                raise _map_sqlite(error, self.filename) from error
            raise
        self.conn = conn

    def _transaction(self, work: Callable[[sqlite3.Connection], Any]) -> Any:
        conn = self.conn
        if conn is None:
            raise AgentStoreUnavailableError(f"{self.filename}: the step ledger is closed")
        try:
            conn.execute("BEGIN IMMEDIATE")
            result = work(conn)
            conn.execute("COMMIT")
            return result
        except BaseException as error:
            if conn.in_transaction:
                with contextlib.suppress(sqlite3.Error):
                    conn.execute("ROLLBACK")
            if isinstance(error, sqlite3.Error):
                raise _map_sqlite(error, self.filename) from error
            raise

    def claim(self, keys: tuple[AgentStepKey, ...], now: str) -> tuple[AgentStepKey, _Row] | None:
        """The first existing record among ``keys``, or None after committing an intent under every key
        (one transaction: the effect is claimed for all of them or for none)."""

        def work(conn: sqlite3.Connection) -> tuple[AgentStepKey, _Row] | None:
            for key in keys:
                row = conn.execute(_SELECT, key).fetchone()
                if row is not None:
                    return key, row
            conn.executemany(
                f"INSERT INTO {STEP_EFFECTS_TABLE} (conversation_id, run_id, effect_name, state, intent_at) "
                "VALUES (?, ?, ?, 'intent', ?)",
                [(*key, now) for key in keys],
            )
            return None

        return self._transaction(work)

    def accept(self, keys: tuple[AgentStepKey, ...], text: str, now: str, reconciled: bool) -> _Row | None:
        def work(conn: sqlite3.Connection) -> _Row | None:
            update = (
                f"UPDATE {STEP_EFFECTS_TABLE} SET state = 'accepted', value = ?, accepted_at = ?, reconciled = ? "
                f"WHERE {_WHERE_KEY} AND state = 'intent'"
            )
            updated = conn.execute(update, (text, now, int(reconciled), *keys[0])).rowcount
            if updated != 1:
                return conn.execute(_SELECT, keys[0]).fetchone()
            for key in keys[1:]:
                conn.execute(update, (text, now, int(reconciled), *key))
            return None

        return self._transaction(work)

    def read(self, key: AgentStepKey) -> _Row | None:
        return self._transaction(lambda conn: conn.execute(_SELECT, key).fetchone())

    def purge(self, conversation_id: str) -> int:
        return self._transaction(
            lambda conn: (
                conn.execute(f"DELETE FROM {STEP_EFFECTS_TABLE} WHERE conversation_id = ?", (conversation_id,)).rowcount
            )
        )

    def close(self) -> None:
        conn, self.conn = self.conn, None
        if conn is not None:
            conn.close()


class _StoreLedger:
    """Records as ``durability/effect`` events in the conversation store's ledger
    (:mod:`threadline.store.effects`). Every method is one store transaction, committed when it returns."""

    def __init__(self, store: AgentRuntimeStore) -> None:
        self.store = store

    @staticmethod
    def _row(effect: Any) -> _Row:
        intent, accepted = effect.intent, effect.accepted
        opened = intent if intent is not None else accepted
        if accepted is None:
            return ("intent", None, opened.occurred_at.isoformat(), None, 0)
        payload = accepted.payload if isinstance(accepted.payload, dict) else {}
        return (
            "accepted",
            payload.get("value_json"),
            opened.occurred_at.isoformat(),
            accepted.occurred_at.isoformat(),
            int(bool(payload.get("reconciled"))),
        )

    async def claim(self, keys: tuple[AgentStepKey, ...], now: str) -> tuple[AgentStepKey, _Row] | None:
        from .store.effects import claim_step_effect

        cid, name = keys[0].conversation_id, keys[0].effect_name
        found = await claim_step_effect(
            self.store, conversation_id=cid, run_ids=[k.run_id for k in keys], effect_name=name
        )
        return None if found is None else (AgentStepKey(cid, found.run_id, name), self._row(found))

    async def accept(self, keys: tuple[AgentStepKey, ...], text: str, now: str, reconciled: bool) -> _Row | None:
        from .store.effects import accept_step_effect

        found = await accept_step_effect(
            self.store,
            conversation_id=keys[0].conversation_id,
            run_ids=[k.run_id for k in keys],
            effect_name=keys[0].effect_name,
            value_json=text,
            reconciled=reconciled,
        )
        return None if found is None else self._row(found)

    async def read(self, key: AgentStepKey) -> _Row | None:
        from .store.effects import read_step_effect

        found = await read_step_effect(
            self.store, conversation_id=key.conversation_id, run_id=key.run_id, effect_name=key.effect_name
        )
        return None if found is None else self._row(found)

    def purge(self, conversation_id: str) -> int:
        return 0  # ledger events leave only with the conversation (purge_conversation)

    def close(self) -> None:
        pass  # the store is the application's to close


def _now() -> str:
    return datetime.now(UTC).isoformat()


class LocalStepDurability:
    """The step ledger of :func:`create_local_step_durability`: process memory, one SQLite file, or the
    conversation store's event ledger.

    Give it to the runtime (every tool call's ``ctx.step`` then goes through it), or call :meth:`step`
    directly. Also an async context manager that closes it.
    """

    def __init__(
        self,
        filename: str | os.PathLike[str] | None = None,
        *,
        store: AgentRuntimeStore | None = None,
        synchronous: str = "NORMAL",
        busy_timeout: float = 5.0,
    ) -> None:
        self.filename = os.fspath(filename) if filename is not None else None
        self.store = store
        self._inflight: dict[AgentStepKey, asyncio.Future[None]] = {}
        self._closed = False
        self._executor: ThreadPoolExecutor | None = None
        self._ledger: _MemoryLedger | _SqliteLedger | _StoreLedger
        if store is not None:
            self._ledger = _StoreLedger(_ledger_store(store, filename))
            return
        if self.filename is None:
            self._ledger = _MemoryLedger()
            return
        if synchronous not in ("NORMAL", "FULL"):
            raise AgentRuntimeUsageError(f"synchronous is 'NORMAL' or 'FULL', got {synchronous!r}")
        ledger = _SqliteLedger(self.filename, synchronous, busy_timeout)
        executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="threadline-steps")
        try:
            executor.submit(ledger.open).result()  # opened on its own thread, like the SQLite store
        except BaseException:
            executor.shutdown(wait=True)
            raise
        self._ledger, self._executor = ledger, executor

    async def _run(self, fn: Callable[..., Any], *args: Any) -> Any:
        if self._closed:
            raise AgentStoreUnavailableError("the step ledger is closed")
        if self._executor is None:
            result = fn(*args)
            return await result if inspect.isawaitable(result) else result  # the store's are coroutines
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def _record(self, key: AgentStepKey, row: _Row) -> AgentStepRecord:
        state, text, intent_at, accepted_at, reconciled = row
        where = f"step record {tuple(key)!r}"
        if state not in ("intent", "accepted") or (state == "accepted") != (text is not None):
            raise AgentStoreCorruptRecordError(f"state {state!r} does not match its value", where=where)
        try:
            intent = datetime.fromisoformat(intent_at)
            accepted = datetime.fromisoformat(accepted_at) if accepted_at is not None else None
        except (TypeError, ValueError) as error:
            raise AgentStoreCorruptRecordError("a timestamp is malformed", where=where) from error
        return AgentStepRecord(
            conversation_id=key.conversation_id,
            run_id=key.run_id,
            effect_name=key.effect_name,
            state=state,
            value=_decode(text, where) if text is not None else None,
            intent_at=intent,
            accepted_at=accepted,
            reconciled=bool(reconciled),
        )

    async def step(
        self,
        conversation_id: str,
        run_id: str,
        effect_name: str,
        body: StepBody,
        *,
        reconcile: StepReconcile | None = None,
        joined_run_ids: tuple[str, ...] = (),
    ) -> Any:
        """Run ``body`` at most once for this key and return its lossless-JSON value (a detached copy).

        ``joined_run_ids``: queued runs whose injected inputs this run answers too. The intent and the proof
        are then recorded under their keys as well (``(conversation_id, joined_run_id, effect_name)``), and a
        record under any of them counts: when such a run later executes itself and calls the same step, it
        gets this proof (or this uncertainty) and the body does not run again.

        New key: commit the intent, run the body, check its value (:class:`AgentStepValueError` after the
        body ran; the intent stays), commit the proof, return. Accepted key: return the proof without
        running the body. Bare intent: ``reconcile(record)`` (sync or async) returns the proof, which is
        committed as accepted and returned, or ``None``; without ``reconcile`` or with ``None`` →
        :class:`AgentStepUncertainError`. An exception from the body or ``reconcile`` propagates and
        leaves the intent: the effect's outcome is unknown, so the key is uncertain from then on.

        Cancellation: before the intent is committed, nothing happened. While the body runs, the body is
        cancelled and the intent stays (uncertain later). After the body returned, the proof's write is
        shielded: it is committed even though the call raises ``CancelledError``. Safe to call from
        several tasks of one event loop: same-key calls wait for the first one and then see its record.
        """
        _check_name("conversation id", conversation_id)
        _check_name("run id", run_id)
        _check_name("effect name", effect_name)
        _check_callable(effect_name, body, "the body")
        if reconcile is not None:
            _check_callable(effect_name, reconcile, "reconcile")
        for joined in joined_run_ids:
            _check_name("joined run id", joined)
        keys = tuple(dict.fromkeys(AgentStepKey(conversation_id, r, effect_name) for r in (run_id, *joined_run_ids)))
        while (running := next((f for k in keys if (f := self._inflight.get(k)) is not None), None)) is not None:
            await asyncio.shield(running)
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        for k in keys:
            self._inflight[k] = done
        try:
            return await self._step(keys, body, reconcile)
        finally:
            for k in keys:
                del self._inflight[k]
            done.set_result(None)

    async def _step(self, keys: tuple[AgentStepKey, ...], body: StepBody, reconcile: StepReconcile | None) -> Any:
        found = await self._run(self._ledger.claim, keys, _now())
        if found is None:  # the intent is committed: this call owns the effect
            copied, text = _lossless(await _call(body), keys[0].effect_name)
            return await self._accept(keys, copied, text, reconciled=False)
        record = self._record(*found)
        if record.state == "accepted":
            return record.value
        if reconcile is None:
            raise AgentStepUncertainError(record, reconcile_attempted=False)
        proof = await _call(reconcile, record)
        if proof is None:
            raise AgentStepUncertainError(record, reconcile_attempted=True)
        copied, text = _lossless(proof, record.effect_name)
        return await self._accept((found[0],), copied, text, reconciled=True)

    async def _accept(self, keys: tuple[AgentStepKey, ...], copied: Any, text: str, *, reconciled: bool) -> Any:
        write = asyncio.ensure_future(self._run(self._ledger.accept, keys, text, _now(), reconciled))
        current = await asyncio.shield(write)
        if current is not None and current[0] == "accepted":  # another process accepted it first
            return self._record(keys[0], current).value
        return copied  # accepted now (or the conversation was purged meanwhile)

    async def read(self, conversation_id: str, run_id: str, effect_name: str) -> AgentStepRecord | None:
        """The record for this key (``intent`` or ``accepted``, with a detached proof), or ``None``.

        Cancellation: a read; cancelling has no effect on the ledger.
        """
        key = AgentStepKey(conversation_id, run_id, effect_name)
        row = await self._run(self._ledger.read, key)
        return None if row is None else self._record(key, row)

    async def purge(self, conversation_id: str) -> int:
        """Delete every record of the conversation (call it when the conversation is purged); returns how
        many were deleted. A step of that conversation still in flight returns its value, unrecorded.
        With ``store=`` the records are the conversation's ledger events: the store's
        ``purge_conversation`` removes them with the conversation, and this deletes nothing (returns 0).

        Cancellation: the delete is one transaction; cancelled before it starts, nothing is deleted.
        """
        _check_name("conversation id", conversation_id)
        return await self._run(self._ledger.purge, conversation_id)

    async def close(self) -> None:
        """Close the ledger (its SQLite connection and thread). Idempotent; later calls raise
        :class:`~threadline.errors.AgentStoreUnavailableError`.

        Cancellation: the connection is closed on its thread even if the caller is cancelled.
        """
        if self._closed:
            return
        self._closed = True
        executor, self._executor = self._executor, None
        if executor is None:
            self._ledger.close()
            return
        try:
            await asyncio.shield(asyncio.get_running_loop().run_in_executor(executor, self._ledger.close))
        finally:
            executor.shutdown(wait=False)

    async def __aenter__(self) -> LocalStepDurability:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()


def _ledger_store(store: Any, filename: object) -> AgentRuntimeStore:
    from .store.aggregate import AgentRuntimeStore

    if filename is not None:
        raise AgentRuntimeUsageError("give create_local_step_durability a filename or a store, not both")
    if not isinstance(store, AgentRuntimeStore):
        raise AgentRuntimeUsageError(
            "store is an AgentRuntimeStore (for SQLite and PostgreSQL: the handle's .store), "
            f"got {type(store).__name__}"
        )
    if not store.ledger:
        raise AgentStoreCapabilityError(
            "ledger",
            f"the store's driver ({type(store.driver).__name__}) keeps no event ledger, so it cannot keep durable "
            "steps; use create_local_step_durability(filename) instead",
        )
    return store


def create_local_step_durability(
    filename: str | os.PathLike[str] | None = None,
    *,
    store: AgentRuntimeStore | None = None,
    synchronous: Literal["NORMAL", "FULL"] = "NORMAL",
    busy_timeout: float = 5.0,
) -> LocalStepDurability:
    """A step ledger keyed by ``(conversation_id, run_id, effect_name)``.

    ``store=``: the conversation store's own event ledger (``durability/effect`` events; the store's
    durability, and its processes, are the records'): they survive compaction, travel with export and
    import, and leave with ``purge_conversation``. A store whose driver keeps no ledger is refused
    (:class:`~threadline.errors.AgentStoreCapabilityError`). Closing the durability leaves the store open.

    ``filename=None`` (and no store): process-local memory (lost with the process; replays within it). A
    filename: its own SQLite file (WAL, table ``threadline_step_effects``; not the runtime store's file,
    which is refused), opened here on the ledger's dedicated thread; every write commits before ``step``
    proceeds. ``synchronous='NORMAL'`` survives process crashes, ``'FULL'`` also power loss.
    ``busy_timeout`` (seconds) bounds the wait for another process's write lock, then
    :class:`~threadline.errors.AgentStoreBusyError`.
    """
    return LocalStepDurability(filename, store=store, synchronous=synchronous, busy_timeout=busy_timeout)
