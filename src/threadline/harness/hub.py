"""The one seam where delivery events meet their subscribers.

Today a harness feeds :meth:`AgentEventHub.publish` from its runtime's ``publish`` callback (events of runs
this process executes or admits). A relay that carries another process's events (a worker's deltas, say)
feeds the same method, so the control server, SSE streams and the Vercel AI endpoint never learn where an
event came from.

``publish`` is synchronous and never raises: a listener must only hand the event on (append it to its own
bounded queue); its failure is logged and isolated. The hub also remembers, per running run, the last
transient position it published (runtime epoch and sequence, bounded), so a reconnecting reader can tell
whether it missed anything (:meth:`AgentEventHub.transient_position`).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from ..events import DURABLE_EVENT_TYPES

_log = logging.getLogger("threadline.harness")

Listener = Callable[[Any], Any]

MAX_TRACKED_RUNS = 4096
"""Runs whose last transient position the hub remembers; the oldest is forgotten beyond it (a reader
asking about it then reloads the snapshot, which is always correct)."""


def _swallow(task: asyncio.Future[Any]) -> None:
    if not task.cancelled() and task.exception() is not None:
        _log.warning("an event listener failed", exc_info=task.exception())


class AgentEventHub:
    """Fan delivery events out to listeners, all of them or those of one conversation."""

    def __init__(self, *, max_tracked_runs: int = MAX_TRACKED_RUNS) -> None:
        self._all: tuple[Listener, ...] = ()
        self._by_conversation: dict[str, tuple[Listener, ...]] = {}
        self._positions: OrderedDict[str, tuple[str, int]] = OrderedDict()
        self._max_tracked_runs = max_tracked_runs

    def subscribe(self, listener: Listener, *, conversation_id: str | None = None) -> Callable[[], None]:
        """Call ``listener(event)`` for every event published from now on (of ``conversation_id`` only, when
        given). Returns the function that unsubscribes; calling it twice is harmless."""
        if not callable(listener):
            raise TypeError("a listener is a callable taking one event")
        if conversation_id is None:
            self._all = (*self._all, listener)
        else:
            self._by_conversation[conversation_id] = (*self._by_conversation.get(conversation_id, ()), listener)

        def unsubscribe() -> None:
            if conversation_id is None:
                self._all = tuple(x for x in self._all if x is not listener)
                return
            remaining = tuple(x for x in self._by_conversation.get(conversation_id, ()) if x is not listener)
            if remaining:
                self._by_conversation[conversation_id] = remaining
            else:
                self._by_conversation.pop(conversation_id, None)

        return unsubscribe

    def publish(self, event: Any) -> None:
        """Hand ``event`` to every interested listener, in subscription order. Never raises."""
        kind = event.type
        if kind == "terminal":
            self._positions.pop(event.run_id, None)
        elif kind not in DURABLE_EVENT_TYPES:
            positions = self._positions
            positions[event.run_id] = (event.runtime_epoch, event.sequence)
            positions.move_to_end(event.run_id)
            if len(positions) > self._max_tracked_runs:
                positions.popitem(last=False)
        for listener in self._all:
            self._call(listener, event)
        for listener in self._by_conversation.get(event.conversation_id, ()):
            self._call(listener, event)

    @staticmethod
    def _call(listener: Listener, event: Any) -> None:
        try:
            outcome = listener(event)
        except Exception:
            _log.warning("an event listener failed", exc_info=True)
            return
        if inspect.isawaitable(outcome):
            asyncio.ensure_future(outcome).add_done_callback(_swallow)

    def transient_position(self, run_id: str) -> tuple[str, int] | None:
        """The (runtime epoch, sequence) of the last transient event published for a running run, or None
        (nothing streamed yet, the run ended, or it was forgotten)."""
        return self._positions.get(run_id)

    @property
    def listener_count(self) -> int:
        return len(self._all) + sum(len(v) for v in self._by_conversation.values())
