"""Group commit: writes of different conversations that find every pooled connection busy wait in a queue,
and the next free connection commits them together in one transaction and one round trip."""

from __future__ import annotations

import asyncio
from collections import deque
from typing import TYPE_CHECKING, Any, TypeVar

import psycopg
from psycopg.pq import TransactionStatus

from ..driver import (
    _SYNC_DISPATCH,
    Operation,
    OperationStats,
    Purge,
    Request,
    Write,
    _count_write,
)
from ._rows import PostgresRows, Restart, rollback
from ._statements import COMMIT, Wire

if TYPE_CHECKING:
    from ._driver import PostgresStoreDriver

T = TypeVar("T")


BATCH_MAX = 32  # writes committed together in one transaction, at most


class Member:
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


class GroupCommit:
    """The queue of writes waiting for a batch, and the tasks that commit them: at most one task waits for
    a connection at a time; when it gets one it takes what is queued then (:meth:`_take`), lets the next
    task wait for the next connection, and commits its batch (:meth:`_commit_batch`)."""

    def __init__(self, driver: PostgresStoreDriver) -> None:
        self.driver = driver
        self.queue: deque[Member] = deque()  # writes waiting for a batch
        self.leader_waiting = False  # a task waits for a connection to commit the next batch
        self.leaders: set[asyncio.Task[None]] = set()
        self.batching: set[str] = set()  # conversations with a write in a batch in flight

    def accepts(self, request: Request) -> bool:
        """Whether a write whose first request is ``request`` waits for a batch: group commit is on, the
        write can answer from hints under guard (a conversation seen live), and it would wait anyway (no
        connection is free, writes are waiting already, or a write of its conversation is in a batch)."""
        cid = getattr(request, "conversation_id", None)
        if not (self.driver.batch_writes and self.driver.speculate and isinstance(cid, str)):
            return False
        hint = self.driver._hints.get(cid)
        if hint is None or hint.head is None or hint.purged:
            return False
        return self.driver._gate.locked() or bool(self.queue) or cid in self.batching

    async def run(self, op: Operation[T], request: Request) -> tuple[T, OperationStats] | None:
        """Commit the write ``op`` (which asked ``request`` first) together with other writes waiting at the
        same moment: ``(result, stats)``, or ``None`` when it must run alone from the start — it needs the
        server before its commit, or the batch failed before committing (nothing of it was written).

        The batch is one transaction: each write's lock, guard and statements in turn, then ``COMMIT``; it
        commits all of them or none. A batch holds at most one write per conversation, and takes its
        locks in conversation order, so batches cannot deadlock with each other. ``op`` belongs to the batch
        from here on (it closes it). Cancelled while it waits, the write is dropped unwritten; cancelled
        once its batch is on its way, it may commit, like a write whose ``COMMIT`` was sent."""
        done: asyncio.Future[tuple[T, OperationStats] | None] = asyncio.get_running_loop().create_future()
        self.queue.append(Member(op, request, done))
        self._kick()
        return await done

    def _kick(self) -> None:
        """Have a task wait for the next free connection to commit what is queued (one waits at a time)."""
        if self.queue and not self.leader_waiting:
            self.leader_waiting = True
            task = asyncio.ensure_future(self._lead())
            self.leaders.add(task)
            task.add_done_callback(self.leaders.discard)

    async def _lead(self) -> None:
        gate = self.driver._gate
        try:
            await self.driver._take_slot()
        except BaseException as error:
            # no connection came free in time (or the loop is closing): each waiting write goes alone, and
            # waits (and times out) on its own
            self.leader_waiting = False
            while self.queue:
                self.queue.popleft().resolve(None)
            if isinstance(error, TimeoutError):
                return
            raise
        self.leader_waiting = False
        batch = self._take()
        try:
            if batch:
                self._kick()  # what is still queued waits for the next connection that comes free
                await self._commit_batch(batch)
        finally:
            gate.release()
            for member in batch:
                self.batching.discard(member.cid)
            if batch:
                self._kick()  # writes held back for these conversations can go now

    def _take(self) -> list[Member]:
        """The next batch, in queue order: at most one write per conversation, none of a conversation
        whose batch is still in flight (that write is answered from hints the batch will change)."""
        batch: list[Member] = []
        held: list[Member] = []
        queue, batching = self.queue, self.batching
        while queue and len(batch) < BATCH_MAX:
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

    async def _commit_batch(self, batch: list[Member]) -> None:
        """Build each write of ``batch`` on hints, send them with one ``COMMIT``, and answer each write once
        the connection is back in the pool: its result, ``None`` (alone, from the start) or an error."""
        pool = self.driver._pool
        built: list[tuple[Member, PostgresRows, Any, OperationStats]] = []
        outcomes: dict[Member, Any] = {}  # no entry: None
        committing = False
        try:
            if pool is None:
                return
            async with pool.connection(timeout=self.driver._timeout) as conn:
                restore = False
                try:
                    wire, restore = await self.driver._session(conn)  # a connection that fails: all alone
                    for member in sorted(batch, key=lambda m: m.cid):  # one lock order for every batch
                        done = await self._build(conn, wire, member)
                        if done is not None:
                            built.append((member, *done))
                    if not built:
                        return
                    carrier = PostgresRows(conn, self.driver._q, self.driver._cache, "write", wire, self.driver._hints)
                    for _, rows, _, _ in built:
                        carrier.pending += rows.pending[1 + len(rows.begin_settings) :]
                    carrier.pending.append(COMMIT)
                    carrier.unverified = True
                    committing = True
                    try:
                        await carrier._send()
                    except (Restart, psycopg.Error) as error:
                        if isinstance(error, psycopg.OperationalError) and not isinstance(
                            error, psycopg.errors.QueryCanceled
                        ):
                            raise  # the connection went with the COMMIT on its way: unknown
                        committing = False  # a guard or a statement failed: nothing committed
                        self.driver.round_trips += await rollback(conn)
                        return
                    finally:
                        self.driver.round_trips += carrier.sent
                    committing = False
                    if len(built) > 1:
                        self.driver.batches += 1
                    for member, rows, result, part in built:
                        if rows.wrote:
                            self.driver._hints.wrote(rows.written[0], rows.wrote)
                        outcomes[member] = (result, part)
                finally:
                    if restore and not conn.closed and conn.info.transaction_status == TransactionStatus.IDLE:
                        await conn.set_autocommit(False)
        except BaseException as error:
            if not committing:
                if isinstance(error, Exception):
                    return  # no connection, or none that works: each write meets that alone, and reports it
                raise
            unknown = self.driver._unavailable(error, "a batched write failed", unknown_commit=True)
            for member, _, _, _ in built:
                self.driver._hints.forget(member.cid)
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
        self, conn: psycopg.AsyncConnection[Any], wire: Wire, member: Member
    ) -> tuple[PostgresRows, Any, OperationStats] | None:
        """Run ``member``'s operation to its end on hints alone (nothing is sent): its statements wait in
        the rows' ``pending``. None when it needs the server first, or raised (alone, it meets that again,
        or gets past it on the stored rows)."""
        rows = PostgresRows(conn, self.driver._q, self.driver._cache, "write", wire, self.driver._hints)
        rows.deferred = rows.speculate = True
        target: Any = self.driver.rows_wrapper(rows) if self.driver.rows_wrapper is not None else rows
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
