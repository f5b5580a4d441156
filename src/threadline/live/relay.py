"""``create_agent_live_relay``: a store's live relay — the publisher a process's runtime hands its delivery
events to, and the subscription that re-publishes other processes' events into this process's seam."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections import deque
from types import TracebackType
from typing import Any

from pydantic import BaseModel, ConfigDict

from ..errors import AgentRuntimeUsageError
from ..events import AGENT_RUNTIME_EVENT_ADAPTER
from ..store.aggregate import AgentRuntimeStore
from .frames import MAX_EVENT_BYTES, MAX_LISTED_CONVERSATIONS, OutgoingFrame, lost_frame, pack_frames
from .subscription import MAX_PENDING_FRAMES, AgentLiveSubscription

_log = logging.getLogger("threadline.live")

DEFAULT_CAPACITY = 4096
"""Events a publisher holds before sending; beyond it events are dropped, and their conversations reported
lost so subscribers heal them."""
DEFAULT_MAX_ROWS = 10_000
"""Relay table rows kept at most (the oldest go first)."""
DEFAULT_MAX_AGE = 60.0
"""Seconds a relay table row is kept at most: the relay carries live frames, not history."""
DEFAULT_POLL_INTERVAL = 0.02
"""Seconds between two polls of the SQLite relay (a poll reads ``PRAGMA data_version`` only, unless
another process wrote)."""
MAX_BATCH_EVENTS = 512
"""Events one send takes at most (one transaction on SQLite, one pipelined round trip on PostgreSQL)."""
_BACKOFF_START, _BACKOFF_MAX = 0.05, 2.0


class AgentLiveRelayStatus(BaseModel):
    """Counters of a relay's publisher: ``published`` events accepted, ``sent_events`` of them sent in
    ``sent_frames`` frames (``table_frames`` through the relay table), ``dropped`` events lost (full queue,
    too large, a failed send: their conversations were reported lost), ``send_failures`` failed sends,
    ``pruned`` relay rows deleted, ``pending`` events waiting."""

    model_config = ConfigDict(frozen=True)

    origin: str
    published: int
    sent_events: int
    sent_frames: int
    table_frames: int
    dropped: int
    send_failures: int
    pruned: int
    pending: int
    closed: bool


class AgentLiveRelay:
    """Live delivery between processes sharing one store. Build it with :func:`create_agent_live_relay`,
    open it (``await relay.open()`` or ``async with``), then:

    - in a process that executes runs: ``create_agent_runtime(..., publish=relay.publish)`` (or the
      harness's ``publish=``). :meth:`publish` never blocks and never raises; events leave in order on the
      relay's own task.
    - in a process whose subscribers should see them: ``await relay.subscribe(harness)`` (or an
      :class:`~threadline.harness.AgentEventHub`, or any callable taking one event).

    A process may do both with one relay: its subscription skips the frames its own publisher sent (its
    own events already reached its seam)."""

    def __init__(self, *, store: AgentRuntimeStore, backend: Any, capacity: int) -> None:
        self.store = store
        self.origin = uuid.uuid4().hex
        self._backend = backend
        self.capacity = capacity
        self._queue: deque[Any] = deque()
        self._lost: set[str] = set()
        self._lost_all = False
        self._seq = 0
        self._wakeup = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._task: asyncio.Task[None] | None = None
        self._opened = False
        self._closed = False
        self._subscriptions: set[AgentLiveSubscription] = set()
        self._rows_since_prune = 0
        self._last_prune = 0.0
        self.published = self.sent_events = self.sent_frames = self.table_frames = 0
        self.dropped = self.send_failures = self.pruned = 0

    @property
    def where(self) -> str:
        return str(self._backend.where)

    # ----------------------------------------------------------------------------------- lifecycle

    async def open(self) -> AgentLiveRelay:
        """Create the relay table if it does not exist yet (idempotently, from any number of processes) and
        start sending. Raises :class:`~threadline.errors.AgentStoreUnavailableError` when the database
        cannot be reached. Idempotent."""
        if self._closed:
            raise AgentRuntimeUsageError("this live relay was closed; create another")
        if not self._opened:
            await self._backend.open()
            self._opened = True
            self._last_prune = asyncio.get_running_loop().time()
        self._ensure_sender()
        return self

    async def __aenter__(self) -> AgentLiveRelay:
        return await self.open()

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    async def aclose(self, timeout: float | None = 5.0) -> AgentLiveRelayStatus:
        """Stop accepting events, send what is queued (for at most ``timeout`` seconds; what is left then
        is dropped), close the subscriptions and the connections. Idempotent."""
        if not self._closed:
            self._closed = True
            self._wakeup.set()
            for subscription in list(self._subscriptions):
                await subscription.close()
            self._subscriptions.clear()
            if self._task is not None:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(asyncio.shield(self._idle.wait()), timeout)
                task, self._task = self._task, None
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
            self.dropped += len(self._queue)
            self._queue.clear()
            await self._backend.aclose()
        return self.status()

    def status(self) -> AgentLiveRelayStatus:
        return AgentLiveRelayStatus(
            origin=self.origin,
            published=self.published,
            sent_events=self.sent_events,
            sent_frames=self.sent_frames,
            table_frames=self.table_frames,
            dropped=self.dropped,
            send_failures=self.send_failures,
            pruned=self.pruned,
            pending=len(self._queue),
            closed=self._closed,
        )

    # ------------------------------------------------------------------------------------- publish

    def __call__(self, event: Any) -> None:
        self.publish(event)

    def publish(self, event: Any) -> None:
        """Queue one delivery event for the other processes. Never blocks, never raises; call it on the
        event loop's thread (it is the runtime's ``publish=`` callback). A full queue drops the event and
        reports its conversation lost, so subscribers heal it from the store."""
        if self._closed:
            self.dropped += 1
            return
        for subscription in self._subscriptions:
            if subscription.emitting:
                return  # another process's event this relay's subscription is delivering here: sent already
        try:
            if not isinstance(event, BaseModel):
                event = AGENT_RUNTIME_EVENT_ADAPTER.validate_python(event)
        except Exception:
            self.dropped += 1
            _log.warning("a live event that is not a delivery event was dropped", exc_info=True)
            return
        self.published += 1
        if len(self._queue) >= self.capacity:
            self.dropped += 1
            self._lose(event.conversation_id)
        else:
            self._queue.append(event)
        self._idle.clear()
        self._wakeup.set()
        self._ensure_sender()

    def _lose(self, conversation_id: str | None) -> None:
        if conversation_id is None or len(self._lost) >= MAX_LISTED_CONVERSATIONS:
            self._lost_all = True
        else:
            self._lost.add(conversation_id)

    def _ensure_sender(self) -> None:
        if not self._opened or self._closed or (self._task is not None and not self._task.done()):
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        self._task = loop.create_task(self._send_loop(), name="threadline-live-relay")

    async def _send_loop(self) -> None:
        backoff = _BACKOFF_START
        while True:
            if not self._queue and not self._lost and not self._lost_all:
                self._idle.set()
                if self._closed:
                    return
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            batch = [self._queue.popleft() for _ in range(min(len(self._queue), MAX_BATCH_EVENTS))]
            owed = (set(self._lost), self._lost_all)
            frames = self._frames(batch)
            try:
                rows = await self._backend.send(self.origin, frames) if frames else 0
            except asyncio.CancelledError:
                raise
            except Exception:
                self.send_failures += 1
                self.dropped += len(batch)
                for event in batch:
                    self._lose(event.conversation_id)
                self._lost.update(owed[0])  # the lost frame that was not sent is owed again
                self._lost_all = self._lost_all or owed[1]
                _log.warning("sending live frames to %s failed; retrying in %.2f s", self.where, backoff, exc_info=True)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, _BACKOFF_MAX)
                continue
            backoff = _BACKOFF_START
            self.sent_events += len(batch)
            self.sent_frames += len(frames)
            self.table_frames += rows
            self._rows_since_prune += rows
            await self._maybe_prune()

    def _frames(self, batch: list[Any]) -> list[OutgoingFrame]:
        encoded: list[tuple[str, str]] = []
        for event in batch:
            text = event.model_dump_json()
            if len(text) > MAX_EVENT_BYTES:
                self.dropped += 1
                self._lose(event.conversation_id)
                _log.warning("a %d-byte live event was not relayed (limit %d)", len(text), MAX_EVENT_BYTES)
                continue
            encoded.append((event.conversation_id, text))
        frames = pack_frames(self.origin, self._seq + 1, encoded, inline_limit=self._backend.inline_limit)
        if self._lost or self._lost_all:
            lost = None if self._lost_all else sorted(self._lost)
            frames.append(lost_frame(self.origin, self._seq + 1 + len(frames), lost))
            self._lost, self._lost_all = set(), False
        if frames:
            self._seq = frames[-1].seq
        return frames

    async def _maybe_prune(self) -> None:
        if not self._rows_since_prune:
            return
        backend = self._backend
        now = asyncio.get_running_loop().time()
        if self._rows_since_prune < max(1, backend.max_rows // 4) and now - self._last_prune < backend.max_age / 2:
            return
        try:
            self.pruned += await backend.prune()
        except asyncio.CancelledError:
            raise
        except Exception:
            _log.warning("pruning the live relay at %s failed", self.where, exc_info=True)
            return
        self._rows_since_prune = 0
        self._last_prune = now

    async def flush(self) -> None:
        """Wait until every event published so far was sent (or dropped). Bound it with a timeout."""
        while self._queue or self._lost or self._lost_all or not self._idle.is_set():
            self._ensure_sender()
            await self._idle.wait()

    # ----------------------------------------------------------------------------------- subscribe

    async def subscribe(self, target: Any, *, max_pending_frames: int = MAX_PENDING_FRAMES) -> AgentLiveSubscription:
        """Re-publish the delivery events other processes send through this store's relay into ``target``
        from now on, healing gaps from the store. ``target`` is a runtime or a harness (through
        :meth:`~threadline.runtime.AgentRuntime.relayed_delivery`: its ``publish=`` callback — for a
        harness, its event hub — and the followers of ``ticket.events()`` receive them), an
        :class:`~threadline.harness.AgentEventHub`, or a callable taking one event. Frames sent before this
        returns may be missed (reload the snapshot on attach, as always). Opens the relay if needed."""
        await self.open()
        subscription = AgentLiveSubscription(
            store=self.store, target=target, fetch=self._backend.fetch, max_pending_frames=max_pending_frames
        )
        try:
            stop = await self._backend.listen(subscription.receive, own_origin=self.origin)
        except BaseException:
            await subscription.close()
            raise
        subscription._start(stop)
        self._subscriptions.add(subscription)
        return subscription


def _store_of(store: Any) -> AgentRuntimeStore:
    inner = getattr(store, "store", None)
    if isinstance(inner, AgentRuntimeStore):
        return inner  # a store handle
    if isinstance(store, AgentRuntimeStore):
        return store
    raise AgentRuntimeUsageError(
        f"store is an AgentRuntimeStore or a store handle (create_sqlite_agent_runtime_store, "
        f"create_postgres_agent_runtime_store), got {type(store).__name__}"
    )


def _positive(name: str, value: Any, *, integer: bool = False) -> None:
    kind = int if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kind) or not value > 0:
        raise AgentRuntimeUsageError(f"{name} is a positive {'integer' if integer else 'number'}, got {value!r}")


def create_agent_live_relay(
    store: Any,
    *,
    capacity: int = DEFAULT_CAPACITY,
    max_rows: int = DEFAULT_MAX_ROWS,
    max_age: float = DEFAULT_MAX_AGE,
    poll_interval: float = DEFAULT_POLL_INTERVAL,
) -> AgentLiveRelay:
    """The live relay of a SQLite or PostgreSQL store (an :class:`~threadline.AgentRuntimeStore` or its
    handle). Nothing is opened yet: ``await relay.open()`` or ``async with``.

    On PostgreSQL frames travel over LISTEN/NOTIFY, those too large for a payload through the relay table
    ``<schema>.live_relay``; on SQLite through the relay table of the file ``<store file>-live``, polled
    every ``poll_interval`` seconds. Relay rows are pruned beyond ``max_rows`` or ``max_age`` seconds (a
    subscriber that had not read them heals from the store). ``capacity`` bounds the events a publisher
    holds. The memory store lives in one process and has no relay
    (:class:`~threadline.errors.AgentRuntimeUsageError`)."""
    inner = _store_of(store)
    _positive("capacity", capacity, integer=True)
    _positive("max_rows", max_rows, integer=True)
    _positive("max_age", max_age)
    _positive("poll_interval", poll_interval)
    driver = inner.driver
    kind = type(driver).__name__
    backend: Any
    if kind == "SqliteStoreDriver":
        from .sqlite import SqliteLiveBackend

        backend = SqliteLiveBackend(
            driver.filename, max_rows=max_rows, max_age=float(max_age), poll_interval=float(poll_interval)
        )
    elif kind == "PostgresStoreDriver":
        from .postgres import PostgresLiveBackend

        backend = PostgresLiveBackend(driver, max_rows=max_rows, max_age=float(max_age))
    else:
        raise AgentRuntimeUsageError(
            f"live delivery across processes needs a SQLite or PostgreSQL store; this one's driver is {kind} "
            "(the memory store lives in one process: subscribe to its runtime's publish instead)"
        )
    return AgentLiveRelay(store=inner, backend=backend, capacity=capacity)
