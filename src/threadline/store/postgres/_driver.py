"""The :class:`~threadline.store.driver.StoreDriver` over a psycopg pool: transactions, retries,
prefetch, notifications (:class:`PostgresStoreDriver`)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
import random
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import psycopg
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict
from psycopg.pq import TransactionStatus
from psycopg_pool import AsyncConnectionPool, PoolClosed, PoolTimeout

from ...errors import (
    AgentConversationPurgedError,
    AgentStoreBusyError,
    AgentStoreSchemaError,
    AgentStoreUnavailableError,
)
from ..codec import RecordCache
from ..driver import (
    _SYNC_DISPATCH,
    Access,
    LoadHead,
    Operation,
    OperationStats,
    Purge,
    Request,
    Write,
    _count_write,
)
from ._group_commit import GroupCommit
from ._hints import HINT_CONVERSATIONS, Hints
from ._rows import PostgresRows, Restart, idle_and_quiet, rollback
from ._schema import DEFAULT_SCHEMA, PURGED_SQLSTATE, migrate
from ._statements import Statements, Wire, prepared_wire

T = TypeVar("T")
_RETRY_SQLSTATES = frozenset({"40001", "40P01"})  # serialization_failure, deadlock_detected
_UNPREPARED_SQLSTATE = "26000"  # invalid_sql_statement_name: a prepared statement is gone
_SCHEMA_SQLSTATES = frozenset({"42P01", "3F000", "42883"})  # undefined table, schema, function
_MAX_ATTEMPTS = 10
_CACHE_BUDGET = 4 * 1024 * 1024  # characters of JSON kept decoded per driver
_MAX_PREDICTED = 8


class _Attempt:
    """What one transaction attempt got to: whether the operation received an answer (after which a
    generator cannot be rewound) and whether the commit was under way (after which the outcome of a
    lost connection is unknown)."""

    __slots__ = ("answered", "committing", "connected", "rows")

    def __init__(self) -> None:
        self.connected = False
        self.answered = False
        self.committing = False
        self.rows: PostgresRows | None = None


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


class PostgresStoreDriver:
    """A :class:`~threadline.store.driver.StoreDriver` over a psycopg async connection pool.

    ``run`` takes a zero-argument factory of the operation (the protocol) and retries serialization
    failures and deadlocks by calling it again; a bare generator is accepted, but is retried only when it
    failed before receiving its first answer, and takes none of the round-trip shortcuts (they need to run
    the operation again). ``retries`` counts transactions run again.
    """

    ledger = True
    """This driver keeps the event ledger (``threadline_events``)."""

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
        self._q = Statements(schema)
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
        self._hints = Hints(self._cache)
        self._own_backends: set[int] = set()  # server pids of this driver's connections
        self.rows_wrapper: Callable[[PostgresRows], Any] | None = None
        """Testing seam: wraps the row primitives of every transaction (for fault injection)."""
        self.batch_writes = True
        """Group commit: writes of different conversations that find every connection busy are committed
        together, in one transaction and one round trip (see :class:`GroupCommit`)."""
        self.batches = 0
        """Transactions that committed more than one write."""
        self._group_commit = GroupCommit(self)

    @property
    def pool(self) -> AsyncConnectionPool[Any] | None:
        return self._pool

    async def listen(
        self, callback: Callable[[dict[str, Any]], None], *, channel: str | None = None
    ) -> Callable[[], Awaitable[None]]:
        """Deliver this store's notifications (``{"event": "interrupt" | "queued", "conversation_id",
        "run_id"}``, sent by other processes' commits) to ``callback`` on the event loop, over one
        dedicated connection, until the returned ``stop()`` is awaited. A notification is a hint to look
        now; the durable record stays the authority (a missed one is caught by the next CAS or sweep).
        One from another process also makes the driver forget what it last saw of that conversation, so
        its next write reads the rows instead of guarding stale ones.

        ``channel``: listen on another channel of the same server instead (a leaf's own, such as the live
        relay's); its JSON payloads go to ``callback`` as they are and the driver's memory is left alone.

        Raises :class:`~threadline.errors.AgentStoreUnavailableError` when the first connection cannot
        listen. A connection lost later (a server restart, ``pg_terminate_backend``) is replaced: the
        driver connects again, backing off from 50 ms to 2 s while the server is away, and then delivers
        ``{"event": "resync"}``: notifications sent in between were missed, so look at the durable state."""
        own = channel is None
        conn = await self._listening_connection(channel)

        async def pump() -> None:
            nonlocal conn
            delay = 0.05
            while True:
                try:
                    async for notify in conn.notifies():
                        delay = 0.05
                        try:
                            note = json.loads(notify.payload)
                            if own and notify.pid not in self._own_backends:  # another process wrote it
                                self._hints.forget(str(note.get("conversation_id")))
                            callback(note)
                        except Exception:
                            continue
                except psycopg.Error:
                    pass  # the connection went: listen again on a new one
                with contextlib.suppress(Exception):
                    await conn.close()
                while True:
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, 2.0)
                    try:
                        conn = await self._listening_connection(channel)
                        break
                    except AgentStoreUnavailableError:
                        continue
                if own:
                    self._hints.forget_all()  # writes of other processes went unheard meanwhile
                with contextlib.suppress(Exception):
                    callback({"event": "resync"})

        task = asyncio.ensure_future(pump())

        async def stop() -> None:
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
            with contextlib.suppress(Exception):
                await conn.close()

        return stop

    async def connect(self, *, what: str = "connect") -> psycopg.AsyncConnection[Any]:
        """A new autocommit connection to this store's server, outside the pool (a dedicated connection for
        listening, or for a leaf such as the live relay); the caller closes it. Raises
        :class:`~threadline.errors.AgentStoreUnavailableError` (naming ``what`` was being done) when the
        server cannot be reached within the driver's ``timeout``."""
        conninfo = self._dsn if self._dsn is not None else (self._pool.conninfo if self._pool is not None else "")
        try:
            return await psycopg.AsyncConnection.connect(conninfo, autocommit=True, connect_timeout=self._timeout)
        except psycopg.Error as error:
            raise AgentStoreUnavailableError(f"cannot {what} on {self.where}: {error}") from error

    async def _listening_connection(self, channel: str | None = None) -> psycopg.AsyncConnection[Any]:
        conn = await self.connect(what="listen")
        try:
            await conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(channel or self._q.channel)))
        except psycopg.Error as error:
            with contextlib.suppress(Exception):
                await conn.close()
            raise AgentStoreUnavailableError(f"cannot listen on {self.where}: {error}") from error
        except BaseException:  # cancelled (a runtime closing right after it began to listen): not left open
            with contextlib.suppress(Exception):
                await conn.close()
            raise
        return conn

    def _own_backend(self, pid: int) -> None:
        if len(self._own_backends) >= HINT_CONVERSATIONS:
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
            if factory is not None and access == "write" and self._group_commit.accepts(request):
                outcome = await self._group_commit.run(op, request)
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
                except Restart:
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

    def _map(self, error: psycopg.Error, access: Access, attempt: _Attempt) -> Exception:
        state = _sqlstate(error)
        if state == PURGED_SQLSTATE:
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
        ``first`` and what follows answered from :class:`Hints`, up to its first write. Also whether the
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
        try:
            await self._take_slot()
        except TimeoutError:
            raise PoolTimeout(f"no connection free within {self._timeout} s") from None
        try:
            return await self._on_connection(pool, op, request, access, stats, attempt, factory, shortcuts)
        finally:
            self._gate.release()

    async def _take_slot(self) -> None:
        """One of the pool's slots (release it on ``_gate``), waiting in FIFO order; ``TimeoutError`` after
        ``timeout`` seconds."""
        gate = self._gate
        if gate.locked():
            async with asyncio.timeout(self._timeout):
                await gate.acquire()
        else:
            await gate.acquire()

    async def _session(self, conn: psycopg.AsyncConnection[Any]) -> tuple[Wire, bool]:
        """Ready a pooled connection for a transaction: autocommit on (a pool passed in may hand out
        connections without it: the flag returned says to restore it), the server's goodbye not waiting
        (``OperationalError``: use another connection), this schema's statements prepared."""
        restore = not conn.autocommit
        if restore:
            await conn.set_autocommit(True)
        if not idle_and_quiet(conn):
            await conn.close()
            raise psycopg.OperationalError("the pooled connection was closed by the server")
        return await prepared_wire(conn, self._q, self), restore

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
            restore = False
            try:
                wire, restore = await self._session(conn)
                rows = attempt.rows = PostgresRows(conn, self._q, self._cache, access, wire, self._hints)
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
                    self.round_trips += await rollback(conn)
                    if rows.unverified and not isinstance(error, psycopg.Error | Restart):
                        # the operation gave up on answers not yet verified: they may be stale
                        raise Restart from error
                    raise
                except BaseException:
                    self.round_trips += await rollback(conn)
                    raise
            finally:
                if attempt.rows is not None:
                    self.round_trips += attempt.rows.sent
                if restore and not conn.closed and conn.info.transaction_status == TransactionStatus.IDLE:
                    await conn.set_autocommit(False)
        if rows.wrote:
            self._hints.wrote(rows.written[0], rows.wrote)
        return result
