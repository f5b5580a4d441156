"""Following one run from its ticket: ``async for event in ticket.events():``.

A follower receives the delivery events of one run executing in this process — ``admission``, deltas,
reasoning, ``tool-status`` and ``tool-progress``, checkpoints, ``run-operation``, ``run-state``,
``attempt-reset`` and ``terminal`` — in the order the runtime publishes them, and ends once the ticket's
result is settled and every event before it was read. It is bounded: it holds at most ``capacity`` events
(:data:`AGENT_TICKET_EVENTS_MAX` by default). A consumer that falls that far behind loses the events that do
not fit and reads one :class:`ResyncEvent` in their place (``dropped`` counts them), then the events that
came after; the run never waits for a consumer. The ``terminal`` event is always kept. After a resync,
reload what was missed from the store (``store.load_run``) or from the result.

The global ``publish=`` callback of the runtime is unchanged and independent: a follower sees the same
events whether or not the runtime has one.

Runs another process executes (``runs={"execute": False}``) have events here only when a live relay feeds
them in (:meth:`AgentRuntime.relayed_delivery <threadline.runtime.AgentRuntime.relayed_delivery>`, which
``threadline.live``'s ``relay.subscribe(runtime)`` uses): the worker's events then reach the ticket's
followers in the worker's order. Whatever the relay lost (frames pruned before they were read, a dropped
connection, a skipped ``sequence``) is marked by a :class:`ResyncEvent` with ``reason`` ``relay-gap``
where it was noticed, followed by what the relay heals from the store (the checkpoint, the terminal). Once
the store shows the run ended, a follower waits at most :data:`RELAYED_TERMINAL_GRACE` for the relayed
``terminal``; a relay that lost it unseen (the worker stopped between its commit and its publish) ends the
iteration with a resync marker and the terminal read from the store.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import OrderedDict, deque
from collections.abc import AsyncIterator, Callable
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from .events import TerminalEvent, delivered_message, durable_event_id

__all__ = (
    "AGENT_TICKET_EVENTS_MAX",
    "RELAYED_TERMINAL_GRACE",
    "AgentRelayedDelivery",
    "Followers",
    "ResyncEvent",
    "RunFollower",
)

AGENT_TICKET_EVENTS_MAX = 1024
"""Events a ticket's follower holds for a slow consumer before it drops some (and says so)."""
RELAYED_TERMINAL_GRACE = 2.0
"""Seconds a follower of a run another process executes waits for the relayed ``terminal`` once the store
shows the run ended (a relay delivers it within milliseconds; only a loss nobody saw waits this long)."""
_MAX_SEEN_DURABLE = 1024  # durable event ids a follower remembers to drop a relay's repeats
_MAX_RELAYED_TERMINALS = 4096  # runs whose relayed terminal is remembered until their watcher settles them


class ResyncEvent(BaseModel):
    """Where events were lost: ``overflow`` — a slow consumer lost ``dropped`` events (never the
    ``terminal``); ``relay-gap`` — the live relay that brings another process's events lost some (how many
    is unknown; the events the relay heals from the store follow). Reload the run's state from the store
    (``store.load_run``) to catch up; the events after this one are complete again."""

    model_config = ConfigDict(frozen=True)

    type: Literal["resync"] = "resync"
    conversation_id: str
    run_id: str
    reason: Literal["overflow", "relay-gap"] = "overflow"
    dropped: int | None = Field(default=None, ge=1)


class RunFollower:
    """One consumer's bounded queue of one run's events (what ``ticket.events()`` returns)."""

    def __init__(self, done: asyncio.Future[Any], capacity: int, on_close: Any = None) -> None:
        self._queue: deque[Any] = deque()
        self._capacity = capacity
        self._done = done
        self._wakeup: asyncio.Future[None] | None = None
        self._on_close = on_close
        self._closed = False
        self._resync: list[Any] | None = None  # [conversation_id, run_id, dropped] while a resync is pending
        self._seen: OrderedDict[str, None] = OrderedDict()  # durable event ids taken, newest last
        self.conversation_id: str | None = None
        self.ended = False
        """Whether the run's ``terminal`` reached this follower."""
        done.add_done_callback(lambda _: self._wake())

    def push(self, event: Any) -> None:
        """Take one event; never blocks. Beyond capacity it is dropped and counted (a ``terminal`` never).
        Nothing follows the run's terminal, and a durable event already taken (by ``event_id``: a relay
        that healed from the store repeats facts) is not taken twice."""
        if self._closed or self.ended:
            return
        self.conversation_id = event.conversation_id
        if event.durable:
            seen = self._seen
            if event.event_id in seen:
                return
            seen[event.event_id] = None
            if len(seen) > _MAX_SEEN_DURABLE:
                seen.popitem(last=False)
        if event.type == "terminal":
            self.ended = True
        if len(self._queue) >= self._capacity and event.type != "terminal":
            if self._resync is None:
                self._resync = [event.conversation_id, event.run_id, 0]
                self._queue.append(self._resync)  # the marker stands where the lost events would be
            self._resync[2] += 1
            return
        if self._resync is not None and self._queue and self._queue[-1] is self._resync:
            self._resync = None  # room again: later events follow the marker
        self._queue.append(event)
        self._wake()

    def lost(self, run_id: str) -> None:
        """The relay feeding this follower lost events: a ``relay-gap`` marker goes next (one for several
        losses in a row). Never blocks; the marker takes no capacity of its own beyond one slot."""
        if self._closed or self.ended or self.conversation_id is None:
            return
        if self._queue and isinstance(self._queue[-1], ResyncEvent):
            return
        self._resync = None  # an overflow marker pending before this one stays where it is
        self._queue.append(ResyncEvent(conversation_id=self.conversation_id, run_id=run_id, reason="relay-gap"))
        self._wake()

    def _wake(self) -> None:
        wakeup, self._wakeup = self._wakeup, None
        if wakeup is not None and not wakeup.done():
            wakeup.set_result(None)

    def __aiter__(self) -> AsyncIterator[Any]:
        return self

    async def __anext__(self) -> Any:
        while True:
            if self._queue:
                item = self._queue.popleft()
                if isinstance(item, list):  # an overflow marker
                    if item is self._resync:
                        self._resync = None
                    return ResyncEvent(conversation_id=item[0], run_id=item[1], dropped=item[2])
                return item
            if self._done.done() or self._closed:
                self.close()
                raise StopAsyncIteration
            self._wakeup = asyncio.get_running_loop().create_future()
            await self._wakeup

    def close(self) -> None:
        """Stop following (the iterator ends once what it holds was read)."""
        if not self._closed:
            self._closed = True
            self._wake()
            if self._on_close is not None:
                self._on_close(self)

    async def aclose(self) -> None:
        self._queue.clear()
        self.close()


class Followers:
    """The runtime's followers, by run id; a ticket's followers wait here until its admission names the run."""

    def __init__(self) -> None:
        self.by_run: dict[str, list[RunFollower]] = {}
        self.relays = 0
        """Live relays feeding this runtime other processes' events (:class:`AgentRelayedDelivery`)."""
        self._relayed_terminals: OrderedDict[str, None] = OrderedDict()
        self._terminal_waiters: dict[str, asyncio.Future[None]] = {}

    def __bool__(self) -> bool:
        return bool(self.by_run)

    def follow(self, run_id: str, follower: RunFollower) -> None:
        self.by_run.setdefault(run_id, []).append(follower)

    def unfollow(self, run_id: str, follower: RunFollower) -> None:
        followers = self.by_run.get(run_id)
        if followers is not None and follower in followers:
            followers.remove(follower)
            if not followers:
                del self.by_run[run_id]

    def deliver(self, event: Any) -> None:
        followers = self.by_run.get(getattr(event, "run_id", None))  # type: ignore[arg-type]
        if followers:
            for follower in tuple(followers):
                follower.push(event)

    # ------------------------------------------------------------------ runs another process executes

    def lost(self, conversation_id: str | None) -> None:
        """A relay lost events of ``conversation_id`` (of every conversation when None)."""
        for run_id, followers in tuple(self.by_run.items()):
            for follower in tuple(followers):
                if conversation_id is None or follower.conversation_id == conversation_id:
                    follower.lost(run_id)

    def relayed_terminal(self, run_id: str) -> None:
        self._relayed_terminals[run_id] = None
        if len(self._relayed_terminals) > _MAX_RELAYED_TERMINALS:
            self._relayed_terminals.popitem(last=False)
        waiter = self._terminal_waiters.pop(run_id, None)
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def wait_relayed_terminal(self, run_id: str, timeout: float) -> bool:
        """Wait at most ``timeout`` seconds for a relay to bring the run's terminal; whether it did."""
        if run_id in self._relayed_terminals:
            return True
        waiter = self._terminal_waiters[run_id] = asyncio.get_running_loop().create_future()
        try:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(waiter, timeout)
        finally:
            if self._terminal_waiters.get(run_id) is waiter:
                del self._terminal_waiters[run_id]
        return run_id in self._relayed_terminals

    def settle_elsewhere(self, run_id: str, loaded: Any) -> None:
        """The store shows the run ended and its watcher settles the ticket. Followers the relay did not
        bring the terminal to read a ``relay-gap`` marker and the stored terminal first."""
        self._relayed_terminals.pop(run_id, None)
        followers = [f for f in self.by_run.get(run_id, ()) if not f.ended]
        if not followers or not self.relays:
            return
        run = loaded.run
        terminal = TerminalEvent(
            event_id=durable_event_id(run.id, "terminal", run.version),
            conversation_id=run.conversation_id,
            run_id=run.id,
            version=loaded.version,
            terminal_reason=run.terminal_reason or "",
            policy_name=run.policy_name,
            assistant=delivered_message(loaded.assistant),
            usage=run.usage,
        )
        for follower in followers:
            follower.conversation_id = run.conversation_id
            follower.lost(run_id)
            follower.push(terminal)


class AgentRelayedDelivery:
    """Where a live relay hands a runtime the delivery events other processes publish (a worker's deltas,
    tool status, terminal): :meth:`publish` delivers one to the runtime's ``publish=`` callback and to the
    followers of its run (``ticket.events()``), exactly as an event this process published; :meth:`lost`
    says events of a conversation were lost (its followers read a ``relay-gap`` marker next). Get it from
    :meth:`AgentRuntime.relayed_delivery <threadline.runtime.AgentRuntime.relayed_delivery>`; :meth:`close`
    it when the relay stops. Events are not re-published to other processes by the relay that delivered
    them (it skips what its own subscription is delivering)."""

    def __init__(self, followers: Followers, publish: Callable[[Any], None]) -> None:
        self._followers = followers
        self._publish = publish
        self._closed = False
        followers.relays += 1

    def publish(self, event: Any) -> None:
        """Deliver one event another process published. Synchronous; never raises for a failing
        publisher (the runtime's publish isolates it)."""
        if self._closed:
            return
        self._publish(event)
        if event.type == "terminal":
            self._followers.relayed_terminal(event.run_id)

    def lost(self, conversation_id: str | None) -> None:
        """Events of ``conversation_id`` (every conversation: None) were lost on the way here."""
        if not self._closed:
            self._followers.lost(conversation_id)

    def close(self) -> None:
        """Stop delivering. Idempotent."""
        if not self._closed:
            self._closed = True
            self._followers.relays -= 1
