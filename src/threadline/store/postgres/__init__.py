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
  the driver last saw (``_hints.Hints``) foresees which requests follow the one asked now; they go in the
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

*Group commit* (``_group_commit``): a write that could answer from hints and finds every connection busy
waits in a queue; one task at a time waits for the next free connection and commits what is queued then
in one transaction and one round trip: each write's lock, guard and statements in turn, in conversation
order, at most one write per conversation, then one ``COMMIT`` (and one WAL flush) for all. A write that
needs the server before its commit leaves the batch; a batch that fails before its ``COMMIT`` has written
nothing, and each of its writes runs again alone.

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

try:
    import psycopg
    import psycopg_pool  # noqa: F401
except ImportError as _missing:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "threadline.store.postgres needs psycopg 3 and psycopg-pool; install them with: "
        "pip install 'threadline[postgres]'"
    ) from _missing

from collections.abc import Callable
from datetime import datetime
from types import TracebackType
from typing import Any

from psycopg.conninfo import conninfo_to_dict
from psycopg_pool import AsyncConnectionPool

from ...errors import AgentRecordValidationError
from ..aggregate import AgentConversationReader, AgentRuntimeStore, create_agent_runtime_store
from ._driver import PostgresStoreDriver
from ._schema import DEFAULT_SCHEMA, POSTGRES_SCHEMA_VERSION, migrate, validate_schema
from ._statements import notification_channel

__all__ = [
    "POSTGRES_SCHEMA_VERSION",
    "PostgresAgentRuntimeStoreHandle",
    "PostgresStoreDriver",
    "create_postgres_agent_runtime_store",
    "migrate",
    "notification_channel",
]


class PostgresAgentRuntimeStoreHandle:
    """A PostgreSQL store: ``store`` (the :class:`AgentRuntimeStore`), ``conversations`` (its paged
    reader), ``driver``, :meth:`open` and :meth:`aclose`. As an async context manager it opens on enter
    and closes on exit. ``create_agent_runtime(store=handle)`` takes the handle itself."""

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

    async def aclose(self) -> None:
        """Let operations in flight finish, then close the pool if the handle created it (a pool passed in
        stays open). Later calls raise :class:`~threadline.errors.AgentStoreUnavailableError`. Idempotent.
        ``async with`` closes the same way on exit; ``close()`` is the same call."""
        await self.store.aclose()

    async def close(self) -> None:
        """:meth:`aclose` (kept as a second spelling)."""
        await self.store.aclose()

    async def __aenter__(self) -> PostgresAgentRuntimeStoreHandle:
        try:
            return await self.open()
        except BaseException:
            await self.aclose()
            raise

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    def __repr__(self) -> str:
        return f"<PostgresAgentRuntimeStoreHandle {self.driver.where} schema={self.schema!r}>"


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
    validate_schema(schema)
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
