"""The cheap path from one published event to many connections.

With hundreds of viewers of one conversation, what each event costs *per viewer* decides whether a server
keeps up: a queue hop, a task step, the transport's send path and a socket write, for every event and every
viewer, is tens of microseconds times viewers times events. The control server therefore:

- buffers the events of a conversation published in one turn of the event loop and hands them to every
  viewer at once, as one :class:`AgentControlDeliveryBatch` (one object shared by all viewers, so its wire
  encoding is made once: :meth:`AgentControlDeliveryBatch.json_text`);
- a viewer still writing its previous batch (its socket's buffer is full) collects what arrives meanwhile
  and takes it as one batch when the write finished — a viewer that falls behind catches up in fewer,
  larger writes — until it holds ``max_pending_events``, when it is detached with ``resync-required``;
- starts each viewer's write on the spot (:func:`start_delivery`): an ``async`` send that completes without
  waiting (the usual case: the socket takes the bytes) costs no task at all; one that must wait continues
  on a task of its own, and that viewer's next batch waits for it.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Generator, Iterator, Sequence
from typing import Any

from .control_schema import AgentControlEventDelivery


class AgentControlDeliveryBatch:
    """Deliveries of one conversation handed to a connection at once, in publish order. One batch is shared
    by every connection that takes it, so an encoding is made once (:meth:`json_text`, or :meth:`encoded`
    for a transport's own)."""

    __slots__ = ("_encoded", "_json", "deliveries")

    def __init__(self, deliveries: Sequence[AgentControlEventDelivery]) -> None:
        self.deliveries = tuple(deliveries)
        self._json: str | None = None
        self._encoded: dict[Any, Any] | None = None

    def __iter__(self) -> Iterator[AgentControlEventDelivery]:
        return iter(self.deliveries)

    def __len__(self) -> int:
        return len(self.deliveries)

    def json_text(self) -> str:
        """The batch as one WebSocket message: the delivery object itself when the batch holds one, else a
        JSON array of the deliveries in order."""
        if self._json is None:
            texts = [d.json_text() for d in self.deliveries]
            self._json = texts[0] if len(texts) == 1 else "[" + ",".join(texts) + "]"
        return self._json

    def encoded(self, key: Any, encode: Any) -> Any:
        """``encode(self)``, made once per ``key`` (a transport's encoding that depends on a little state of
        the stream, such as the SSE ids, keys it by that state)."""
        if self._encoded is None:
            self._encoded = {}
        found = self._encoded.get(key)
        if found is None:
            found = self._encoded[key] = encode(self)
        return found


def start_delivery(outcome: Awaitable[Any]) -> asyncio.Future[Any] | None:
    """Run ``outcome`` (what a ``deliver`` returned) until it first has to wait. Returns None when it
    completed (its exception, if any, is raised here), or the task that continues it."""
    if not inspect.iscoroutine(outcome):
        return asyncio.ensure_future(outcome)
    try:
        waits_for = outcome.send(None)
    except StopIteration:
        return None
    return asyncio.ensure_future(_finish(_Resumed(outcome, waits_for)))


async def _finish(resumed: _Resumed) -> Any:
    return await resumed


class _Resumed:
    """The rest of a coroutine that suspended on its first step, driven by a task: what the coroutine yielded
    (the future it waits on) goes to the task, and what the task sends or throws back (the wake-up, a
    cancellation) goes to the coroutine — the protocol ``await`` itself follows."""

    __slots__ = ("_coroutine", "_waits_for")

    def __init__(self, coroutine: Any, waits_for: Any) -> None:
        self._coroutine = coroutine
        self._waits_for = waits_for

    def __await__(self) -> Generator[Any, Any, Any]:
        coroutine, waits_for = self._coroutine, self._waits_for
        while True:
            try:
                sent = yield waits_for
            except BaseException as error:  # thrown by the task: a cancellation, or the future's exception
                try:
                    waits_for = coroutine.throw(error)
                except StopIteration as stop:
                    return stop.value
            else:
                try:
                    waits_for = coroutine.send(sent)
                except StopIteration as stop:
                    return stop.value
