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
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = ("AGENT_TICKET_EVENTS_MAX", "Followers", "ResyncEvent", "RunFollower")

AGENT_TICKET_EVENTS_MAX = 1024
"""Events a ticket's follower holds for a slow consumer before it drops some (and says so)."""


class ResyncEvent(BaseModel):
    """In place of events a slow consumer lost: ``dropped`` of them (never the ``terminal``). Reload the
    run's state from the store to catch up; the events after this one are complete again."""

    model_config = ConfigDict(frozen=True)

    type: Literal["resync"] = "resync"
    conversation_id: str
    run_id: str
    dropped: int = Field(ge=1)


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
        done.add_done_callback(lambda _: self._wake())

    def push(self, event: Any) -> None:
        """Take one event; never blocks. Beyond capacity it is dropped and counted (a ``terminal`` never)."""
        if self._closed:
            return
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
                if isinstance(item, list):  # a resync marker
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
