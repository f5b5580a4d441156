"""A subscription: frames from other processes, re-published into this process's seam, with gaps healed.

What it receives is handled in order, one item at a time, on one task:

1. **Relay gaps** — frames pruned before they were read, a publisher's frame numbers skipping, a dropped
   LISTEN connection, a relay row gone, a publisher's ``lost`` frame, this subscription's own queue full —
   mark the conversations concerned (or all it follows, plus every conversation with an active run) for
   healing.
2. **Events** go through a cursor (:func:`threadline.delivery.advance_agent_runtime_event_cursor`) per
   conversation that also sees what this process published itself (when the target is an event hub):
   ``fresh`` events are re-published; a transient ``gap`` is re-published and its conversation healed; a
   durable event older than one the seam already delivered — which every cursor downstream would drop as
   a duplicate — is not re-published, its conversation is healed instead.
3. **Healing** reads the store (what changed since the last version this subscription knows, plus the runs
   it saw active; the snapshot when it knows no version) and publishes the durable facts as events
   (:mod:`threadline.live.heal`), stamped with the version read, so downstream cursors accept them.

Consumers downstream need nothing new: their own cursors see the transient gap, if any, and reload the
snapshot, as they would after any loss.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict

from ..delivery import AgentRuntimeEventCursor, AgentTransientCursor, advance_agent_runtime_event_cursor
from ..errors import AgentRuntimeUsageError
from ..events import DURABLE_EVENT_TYPES
from ..store.aggregate import AgentRuntimeStore
from .frames import IncomingFrame, RelayGap, decode_body
from .heal import healing_events

_log = logging.getLogger("threadline.live")

MAX_PENDING_FRAMES = 1024
"""Frames a subscription holds before handling them; beyond it they are dropped and everything followed
is healed (a subscriber that cannot keep up never grows without bound)."""
MAX_FOLLOWED_CONVERSATIONS = 1024
"""Conversations a subscription keeps a cursor for (the least recently seen is forgotten first)."""
MAX_TRACKED_RUNS = 64
"""Active runs, and recently ended runs, a subscription remembers per conversation."""
MAX_HEAL_CONVERSATIONS = 1000
"""Conversations one heal of "everything" reads at most (followed ones first, then those with active runs)."""
_HEAL_RETRY = 1.0  # seconds before a heal that failed (the store was away) is tried again
_HEAL_ATTEMPTS = 3  # reads of one heal when the seam keeps moving past what was read

_FLOOR = object()  # heal from the last version this subscription knows


class AgentLiveSubscriptionStatus(BaseModel):
    """Counters of a subscription. ``frames``/``events`` received from other processes; ``delivered``
    events re-published; ``gaps`` relay gaps and transient sequence gaps found; ``late`` durable events
    that arrived after newer ones; ``heals`` conversations healed and ``healed_events`` the events that
    published; ``heal_failures`` heals that could not read the store (retried); ``dropped_frames`` frames
    lost to a full queue."""

    model_config = ConfigDict(frozen=True)

    frames: int
    events: int
    delivered: int
    gaps: int
    late: int
    heals: int
    healed_events: int
    heal_failures: int
    dropped_frames: int
    pending: int
    closed: bool


@dataclass
class _Followed:
    """What a subscription knows of one conversation."""

    cursor: AgentRuntimeEventCursor = field(default_factory=AgentRuntimeEventCursor)
    floor: int | None = None
    """The newest durable version of this conversation received from other processes or healed."""
    healed_through: int = -1
    """Durable events at or below this version are covered by the last heal."""
    active: OrderedDict[str, None] = field(default_factory=OrderedDict)
    ended: OrderedDict[str, None] = field(default_factory=OrderedDict)


def _remember(runs: OrderedDict[str, None], run_id: str) -> None:
    runs[run_id] = None
    runs.move_to_end(run_id)
    if len(runs) > MAX_TRACKED_RUNS:
        runs.popitem(last=False)


@dataclass
class _Target:
    """Where a subscription re-publishes: ``publish`` one event; ``lost`` tells the target events of a
    conversation (all: None) were lost, when it can use that; ``subscribe`` (an event hub's) lets the
    subscription see what this process publishes itself; ``close`` releases the target's seam."""

    publish: Callable[[Any], Any]
    lost: Callable[[str | None], Any] | None = None
    subscribe: Callable[..., Any] | None = None
    close: Callable[[], Any] | None = None


def _resolve_target(target: Any) -> _Target:
    relayed = getattr(target, "relayed_delivery", None)
    if callable(relayed):
        # a runtime or a harness: through the runtime, so tickets' followers receive the events too
        delivery = relayed()
        hub = getattr(target, "events", None)
        subscribe = getattr(hub, "subscribe", None)
        return _Target(delivery.publish, delivery.lost, subscribe if callable(subscribe) else None, delivery.close)
    publish = getattr(target, "publish", None)
    if callable(publish):
        subscribe = getattr(target, "subscribe", None)
        return _Target(publish, subscribe=subscribe if callable(subscribe) else None)
    if callable(target):
        return _Target(target)
    raise AgentRuntimeUsageError(
        f"target is a runtime, a harness, an event hub or a callable taking one event, got {type(target).__name__}"
    )


class AgentLiveSubscription:
    """Receives another process's delivery events and re-publishes them into this process's seam. Made by
    :meth:`AgentLiveRelay.subscribe <threadline.live.AgentLiveRelay.subscribe>`; stop it with
    :meth:`close`."""

    def __init__(
        self,
        *,
        store: AgentRuntimeStore,
        target: Any,
        fetch: Callable[[int], Awaitable[str | None]],
        max_pending_frames: int = MAX_PENDING_FRAMES,
    ) -> None:
        self._store = store
        self._target = _resolve_target(target)
        self._publish = self._target.publish
        self._fetch = fetch
        self._max_pending = max_pending_frames
        self._queue: deque[IncomingFrame | RelayGap] = deque()
        self._wakeup = asyncio.Event()
        self._followed: OrderedDict[str, _Followed] = OrderedDict()
        self._origins: OrderedDict[str, int] = OrderedDict()
        self._heal: dict[str, Any] = {}
        self._heal_everything = False
        self._heal_retry_at = 0.0
        self._emitting = False
        self._told_lost: set[str] = set()  # conversations whose loss the target heard of, until healed
        self._closed = False
        self._stop_listening: Callable[[], Awaitable[None]] | None = None
        subscribe = self._target.subscribe
        self._unobserve = subscribe(self._observe) if subscribe is not None else None
        self._task: asyncio.Task[None] | None = None
        self._idle = asyncio.Event()
        self._idle.set()
        self.frames = self.events = self.delivered = 0
        self.gaps = self.late = self.heals = self.healed_events = self.heal_failures = self.dropped_frames = 0

    @property
    def emitting(self) -> bool:
        """Whether this subscription is handing an event on right now (its relay does not send it again)."""
        return self._emitting

    def _start(self, stop_listening: Callable[[], Awaitable[None]]) -> None:
        self._stop_listening = stop_listening
        self._task = asyncio.ensure_future(self._run())

    # ------------------------------------------------------------------------------------ intake

    def receive(self, item: IncomingFrame | RelayGap) -> None:
        """Take one frame (or gap) from the backend. Synchronous, never blocks: a full queue drops the frame
        and heals everything instead."""
        if self._closed:
            return
        if len(self._queue) >= self._max_pending:
            self.dropped_frames += 1
            self._heal_everything = True
        else:
            self._queue.append(item)
        self._idle.clear()
        self._wakeup.set()

    def _observe(self, event: Any) -> None:
        """What this process's seam delivered that did not come from this subscription (its own runtime's
        events): the cursors must know the seam moved."""
        if self._emitting or self._closed:
            return
        with contextlib.suppress(Exception):
            followed = self._follow(event.conversation_id)
            cursor = advance_agent_runtime_event_cursor(followed.cursor, event)[0]
            if event.type == "terminal":  # its transient position is no longer needed: stay bounded
                cursor = cursor.model_copy(update={"runs": {k: v for k, v in cursor.runs.items() if k != event.run_id}})
            followed.cursor = cursor

    def _follow(self, conversation_id: str) -> _Followed:
        followed = self._followed.get(conversation_id)
        if followed is None:
            followed = self._followed[conversation_id] = _Followed()
            if len(self._followed) > MAX_FOLLOWED_CONVERSATIONS:
                self._followed.popitem(last=False)
        else:
            self._followed.move_to_end(conversation_id)
        return followed

    # ------------------------------------------------------------------------------------ the task

    async def _run(self) -> None:
        while not self._closed:
            while self._queue:
                item = self._queue.popleft()
                try:
                    await self._handle(item)
                except asyncio.CancelledError:
                    raise
                except Exception:
                    _log.warning("a live frame could not be handled; healing instead", exc_info=True)
                    self._heal_everything = True
                await self._heal_pending()
            await self._heal_pending()
            if self._queue:
                continue
            self._idle.set()
            self._wakeup.clear()
            if self._heal or self._heal_everything:  # a heal failed: try again a little later
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wakeup.wait(), _HEAL_RETRY)
            else:
                await self._wakeup.wait()
            self._idle.clear()

    async def _handle(self, item: IncomingFrame | RelayGap) -> None:
        if isinstance(item, RelayGap):
            self.gaps += 1
            self._wants(item.conversations)
            return
        self.frames += 1
        last = self._origins.get(item.origin)
        self._origins[item.origin] = item.seq
        self._origins.move_to_end(item.origin)
        if len(self._origins) > MAX_FOLLOWED_CONVERSATIONS:
            self._origins.popitem(last=False)
        if last is not None and item.seq != last + 1:
            self.gaps += 1  # the publisher's frames in between never arrived: what they held is unknown
            self._heal_everything = True
        if item.lost or item.lost_all:
            self.gaps += 1
            self._wants(None if item.lost_all else item.lost)
            return
        events = item.events
        if item.row is not None:
            body = await self._fetch(item.row)
            if body is None:  # pruned before it was read
                self.gaps += 1
                self._wants(item.conversations)
                return
            events = decode_body(body).events
        for event in events:
            self.events += 1
            self._relay(event)

    def _wants(self, conversations: tuple[str, ...] | None, since: Any = _FLOOR) -> None:
        if conversations is None:
            self._heal_everything = True
            return
        for conversation_id in conversations:
            previous = self._heal.get(conversation_id, _FLOOR)
            if since is _FLOOR:
                self._heal.setdefault(conversation_id, _FLOOR)
            elif previous is _FLOOR or previous is None or (since is not None and since < previous):
                self._heal[conversation_id] = since

    def _relay(self, event: Any) -> None:
        followed = self._follow(event.conversation_id)
        kind, run_id = event.type, event.run_id
        durable = kind in DURABLE_EVENT_TYPES
        if not durable and run_id in followed.ended:
            return  # a settled run streams nothing more (a heal settled it before its last deltas came)
        advanced, classification = advance_agent_runtime_event_cursor(followed.cursor, event)
        if classification == "duplicate":
            if durable and event.version > followed.healed_through and event.event_id not in advanced.durable_event_ids:
                # older than what the seam delivered already: every cursor downstream would drop it
                self.late += 1
                self._wants((event.conversation_id,), since=max(event.version - 1, 0))
            return
        if classification == "gap":
            self.gaps += 1
            self._wants((event.conversation_id,))
            self._lose(event.conversation_id)  # before the event that shows the loss
        if durable:
            followed.floor = event.version if followed.floor is None else max(followed.floor, event.version)
        if kind == "terminal" or (kind == "run-state" and event.terminal_reason == "absorbed"):
            # (the terminal of an ordinary run follows its terminal run-state: until it came, it is owed)
            followed.active.pop(run_id, None)
            _remember(followed.ended, run_id)
            runs = {k: v for k, v in advanced.runs.items() if k != run_id}
            advanced = advanced.model_copy(update={"runs": runs})
        elif run_id not in followed.ended:
            _remember(followed.active, run_id)
        followed.cursor = advanced
        self._emit(event)

    def _lose(self, conversation_id: str) -> None:
        """Tell the target (a runtime's followers) that events of the conversation were lost, once per
        loss: the marker stands before the gap's event or the healed events."""
        if self._target.lost is None or conversation_id in self._told_lost:
            return
        self._told_lost.add(conversation_id)
        try:
            self._target.lost(conversation_id)
        except Exception:
            _log.warning("telling the target of a live gap failed; delivery goes on", exc_info=True)

    def _emit(self, event: Any) -> None:
        self._emitting = True
        try:
            self._publish(event)
            self.delivered += 1
        except Exception:
            _log.warning("re-publishing a live event failed; delivery goes on", exc_info=True)
        finally:
            self._emitting = False

    # ------------------------------------------------------------------------------------- healing

    async def _heal_pending(self) -> None:
        loop = asyncio.get_running_loop()
        if (not self._heal and not self._heal_everything) or loop.time() < self._heal_retry_at:
            return
        try:
            await self._heal_now()
        except asyncio.CancelledError:
            raise
        except Exception:
            self.heal_failures += 1
            self._heal_retry_at = loop.time() + _HEAL_RETRY
            _log.warning("healing from the store failed; trying again in %s s", _HEAL_RETRY, exc_info=True)

    async def _heal_now(self) -> None:
        if self._heal_everything:
            for conversation_id in await self._everything():
                self._heal.setdefault(conversation_id, _FLOOR)
            self._heal_everything = False
        while self._heal and not self._closed:
            conversation_id, since = next(iter(self._heal.items()))
            await self._heal_one(conversation_id, since)
            self._heal.pop(conversation_id, None)

    async def _everything(self) -> list[str]:
        """Followed conversations, then those with an active run, up to :data:`MAX_HEAL_CONVERSATIONS`."""
        chosen = dict.fromkeys(reversed(self._followed))
        cursor: str | None = None
        while len(chosen) < MAX_HEAL_CONVERSATIONS:
            page = await self._store.scan_recoverable(cursor=cursor, limit=100)
            for run in page.runs:
                chosen.setdefault(run.conversation_id, None)
            cursor = page.next_cursor
            if cursor is None:
                break
        return list(chosen)[:MAX_HEAL_CONVERSATIONS]

    async def _heal_one(self, conversation_id: str, since_request: Any) -> None:
        followed = self._follow(conversation_id)
        # several events share a version (a terminal run-state and its terminal): having received one says
        # nothing of the others, so the newest version received is read again
        floor = None if followed.floor is None else max(followed.floor - 1, 0)
        since = floor if since_request is _FLOOR else since_request
        if since is not None and floor is not None:
            since = min(since, floor)
        for _attempt in range(_HEAL_ATTEMPTS):
            version, runs, messages, since_used = await self._read(conversation_id, since, followed)
            seam = followed.cursor.version
            if seam is None or version >= seam:
                break
        events = healing_events(conversation_id, version, runs, messages, since=since_used)
        self._lose(conversation_id)
        self._told_lost.discard(conversation_id)
        for event in events:
            advanced, classification = advance_agent_runtime_event_cursor(followed.cursor, event)
            if classification == "duplicate":
                continue
            followed.cursor = advanced
            self._emit(event)
        cursor = followed.cursor
        baseline = dict(cursor.runs)
        for run in runs:
            if run.active:
                _remember(followed.active, run.id)
                if run.acquired:  # streaming now: accept its next transient event wherever it is
                    baseline[run.id] = AgentTransientCursor()
            else:
                followed.active.pop(run.id, None)
                _remember(followed.ended, run.id)
                baseline.pop(run.id, None)
        followed.cursor = cursor.model_copy(update={"runs": baseline})
        followed.floor = version if followed.floor is None else max(followed.floor, version)
        followed.healed_through = max(followed.healed_through, version)
        self.heals += 1
        self.healed_events += len(events)

    async def _read(
        self, conversation_id: str, since: int | None, followed: _Followed
    ) -> tuple[int, list[Any], list[Any], int | None]:
        """The runs and messages to heal from: the changes since ``since`` plus the runs seen active, or,
        without a version, the snapshot's active runs and the runs seen active."""
        store = self._store
        if since is not None:
            changes = await store.load_changes(conversation_id=conversation_id, since_version=since)
            if not changes.reset:
                runs, messages, version = list(changes.runs), list(changes.messages), changes.version
                changed = {run.id for run in runs}
                for run_id in [r for r in followed.active if r not in changed]:
                    loaded = await store.load_run(conversation_id=conversation_id, run_id=run_id)
                    if loaded is None:
                        continue
                    runs.append(loaded.run)
                    if loaded.assistant is not None:
                        messages.append(loaded.assistant)
                    version = max(version, loaded.version)
                return version, runs, messages, since
        snapshot = await store.load_snapshot(conversation_id=conversation_id)
        runs = [run for run in snapshot.runs if run.active or run.id in followed.active]
        return snapshot.version, runs, list(snapshot.messages), None

    # ----------------------------------------------------------------------------------- lifecycle

    async def drain(self) -> None:
        """Wait until everything received so far was handled (heals included). Bound it with a timeout."""
        while self._queue or not self._idle.is_set():
            await self._idle.wait()

    def status(self) -> AgentLiveSubscriptionStatus:
        return AgentLiveSubscriptionStatus(
            frames=self.frames,
            events=self.events,
            delivered=self.delivered,
            gaps=self.gaps,
            late=self.late,
            heals=self.heals,
            healed_events=self.healed_events,
            heal_failures=self.heal_failures,
            dropped_frames=self.dropped_frames,
            pending=len(self._queue),
            closed=self._closed,
        )

    async def close(self) -> None:
        """Stop receiving (frames not yet handled are dropped) and stop the task. Idempotent; nothing durable
        is involved, so cancelling it leaves nothing half-done."""
        if self._closed:
            return
        self._closed = True
        self._queue.clear()
        if self._unobserve is not None:
            self._unobserve()
        if self._target.close is not None:
            self._target.close()
        stop, self._stop_listening = self._stop_listening, None
        if stop is not None:
            await stop()
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._idle.set()
