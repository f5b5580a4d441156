"""Delivering events: cursors that classify what arrives, bounded failure-isolated sinks, and a pure
control-view reducer a UI can render from.

Cursors (:func:`advance_agent_runtime_event_cursor`, :func:`advance_agent_multi_session_cursor`) classify
each event as ``fresh``, ``duplicate`` or ``gap``:

- a **transient** event is a ``gap`` when its run's ``sequence`` skipped (numbered from 1 per run and
  runtime epoch, one per published event), a ``duplicate`` when it did not advance;
- a **durable** event is never a ``gap``: its ``version`` is the conversation's, which advances on many
  mutations that publish nothing. It is a ``duplicate`` when its ``event_id`` was already seen at that
  version or its version is older than the cursor's. A lost durable event is not detectable from a
  cursor: reload the snapshot on reconnect.

A ``gap`` means: reload the canonical snapshot (:func:`reduce_agent_control_snapshot`) and go on.

Sinks (:func:`create_agent_runtime_event_sink`, :func:`create_agent_operator_sink`) are usable directly as
the runtime's ``publish=`` callback: ``publish`` never blocks and never raises; delivery runs on the
sink's own asyncio task from a bounded queue; a full queue drops (and counts) further events; a failing
``deliver`` is reported to ``on_publish_error`` and delivery goes on. A sink is not an outbox.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

from ._logging import ThrottledLog
from .errors import AgentRuntimeUsageError
from .events import (
    AGENT_RUN_EVENT_ADAPTER,
    AGENT_RUNTIME_EVENT_ADAPTER,
    DURABLE_EVENT_TYPES,
    AgentRunTerminalEvent,
    ToolProgressEvent,
)
from .records import ACTIVE_RUN_STATES, RUN_STATE_FOR_REASON, ConversationSnapshot, Message, RunOperation

_log = logging.getLogger("threadline.events")

CursorClassification = Literal["fresh", "duplicate", "gap"]

# ------------------------------------------------------------------------------------------- cursors


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True)


class AgentTransientCursor(_Frozen):
    """The last transient ``sequence`` seen for one run in one runtime epoch. ``runtime_epoch`` None is a
    baseline (the run was already streaming when a snapshot was loaded): its next event is accepted as is."""

    runtime_epoch: str | None = None
    sequence: int = Field(default=0, ge=0)


class AgentRuntimeEventCursor(_Frozen):
    """Delivery position in one conversation's event stream."""

    version: int | None = None
    """The newest durable version seen."""
    durable_event_ids: tuple[str, ...] = ()
    """The durable event ids seen at ``version`` (several events share one version)."""
    runs: dict[str, AgentTransientCursor] = Field(default_factory=dict)
    """Transient position per run."""


class AgentMultiSessionCursor(_Frozen):
    """Delivery position over several conversations: durable versions per conversation, transient
    sequences per run."""

    conversations: dict[str, AgentRuntimeEventCursor] = Field(default_factory=dict)


def _delivery_event(event: Any) -> Any:
    return event if isinstance(event, BaseModel) else AGENT_RUNTIME_EVENT_ADAPTER.validate_python(event)


def advance_agent_runtime_event_cursor(
    cursor: AgentRuntimeEventCursor | None, event: Any
) -> tuple[AgentRuntimeEventCursor, CursorClassification]:
    """Classify one delivery event of one conversation and return the advanced cursor (unchanged for a
    duplicate). Pure. ``event`` may be an event model or its JSON-like dict."""
    cursor = cursor or AgentRuntimeEventCursor()
    event = _delivery_event(event)
    if event.type in DURABLE_EVENT_TYPES:
        previous = cursor.version
        seen = cursor.durable_event_ids if previous == event.version else ()
        if (previous is not None and event.version < previous) or event.event_id in seen:
            return cursor, "duplicate"
        advanced = cursor.model_copy(update={"version": event.version, "durable_event_ids": (*seen, event.event_id)})
        return advanced, "fresh"
    run = cursor.runs.get(event.run_id)
    if run is not None and run.runtime_epoch is None:
        classification: CursorClassification = "fresh"  # baseline after a snapshot: accept where it is
    elif run is not None and run.runtime_epoch == event.runtime_epoch:
        if event.sequence <= run.sequence:
            return cursor, "duplicate"
        classification = "fresh" if event.sequence == run.sequence + 1 else "gap"
    else:  # a run not seen yet, or a new runtime epoch: numbering starts at 1
        classification = "fresh" if event.sequence == 1 else "gap"
    runs = {
        **cursor.runs,
        event.run_id: AgentTransientCursor(runtime_epoch=event.runtime_epoch, sequence=event.sequence),
    }
    return cursor.model_copy(update={"runs": runs}), classification


def advance_agent_multi_session_cursor(
    cursor: AgentMultiSessionCursor | None, event: Any
) -> tuple[AgentMultiSessionCursor, CursorClassification]:
    """:func:`advance_agent_runtime_event_cursor` scoped per conversation (durable versions) and per run
    (transient sequences). Pure."""
    cursor = cursor or AgentMultiSessionCursor()
    event = _delivery_event(event)
    current = cursor.conversations.get(event.conversation_id)
    advanced, classification = advance_agent_runtime_event_cursor(current, event)
    if classification == "duplicate":
        return cursor, classification
    conversations = {**cursor.conversations, event.conversation_id: advanced}
    return cursor.model_copy(update={"conversations": conversations}), classification


# --------------------------------------------------------------------------------------------- sinks


class AgentEventSinkStatus(_Frozen):
    """Counters of a sink. ``dropped`` counts events lost to a full queue or to closing; ``failed`` counts
    events whose ``deliver`` (or ``project``, or validation) raised; ``duplicates`` durable ids already
    accepted; ``filtered`` events ``project`` turned into None."""

    pending: int
    delivered: int
    dropped: int
    failed: int
    duplicates: int
    filtered: int
    closed: bool


def _swallow(task: asyncio.Future[Any]) -> None:
    if not task.cancelled():
        task.exception()


class _BoundedSink:
    _adapter: TypeAdapter[Any]

    def __init__(
        self,
        *,
        deliver: Callable[[Any], Any],
        capacity: int,
        project: Callable[[Any], Any] | None,
        on_publish_error: Callable[[BaseException, Any], Any] | None,
        on_drop: Callable[[Any, str], Any] | None,
        deduplicate: bool,
        dedupe_window: int,
    ) -> None:
        if not callable(deliver):
            raise AgentRuntimeUsageError("a sink needs a callable deliver(event)")
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise AgentRuntimeUsageError("a sink's capacity is an int of at least 1")
        if dedupe_window < 1:
            raise AgentRuntimeUsageError("a sink's dedupe_window is at least 1")
        self._deliver = deliver
        self.capacity = capacity
        self._project = project
        self._on_publish_error = on_publish_error
        self._failure_log = ThrottledLog(_log)
        self._on_drop = on_drop
        self._deduplicate = deduplicate
        self._seen: set[str] = set()
        self._seen_order: deque[str] = deque()
        self._dedupe_window = dedupe_window
        self._queue: deque[Any] = deque()
        self._wakeup = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._task: asyncio.Task[None] | None = None
        self._current: Any = None
        self._delivering = False
        self._closed = False
        self.delivered = 0
        self.dropped = 0
        self.failed = 0
        self.duplicates = 0
        self.filtered = 0

    # ------------------------------------------------------------------------------------- publish

    def __call__(self, event: Any) -> None:
        self.publish(event)

    def publish(self, event: Any) -> None:
        """Accept one event for delivery. Never blocks, never raises; call it on the event loop's thread."""
        try:
            self._accept(event)
        except Exception as error:
            self.failed += 1
            self._report_now(error, event)

    def _accept(self, event: Any) -> None:
        if self._closed:
            self._drop(event, "closed")
            return
        if not isinstance(event, BaseModel):
            event = self._adapter.validate_python(event)
        key = self._dedupe_key(event) if self._deduplicate else None
        if key is not None and key in self._seen:
            self.duplicates += 1
            return
        outgoing = self._prepare(event)
        if self._project is not None:
            outgoing = self._project(outgoing)
            if outgoing is None:
                self.filtered += 1
                return
        if len(self._queue) >= self.capacity:
            self._drop(outgoing, "capacity")
            return
        self._queue.append(outgoing)
        if key is not None:
            self._remember(key)
        self._idle.clear()
        self._wakeup.set()
        self._ensure_worker()

    def _dedupe_key(self, event: Any) -> str | None:
        raise NotImplementedError

    def _prepare(self, event: Any) -> Any:
        return event

    def _remember(self, key: str) -> None:
        self._seen.add(key)
        self._seen_order.append(key)
        if len(self._seen_order) > self._dedupe_window:
            self._seen.discard(self._seen_order.popleft())

    def _drop(self, event: Any, reason: str) -> None:
        self.dropped += 1
        if self._on_drop is not None:
            self._call_quietly(self._on_drop, event, reason)

    def _report_now(self, error: BaseException, event: Any) -> None:
        if self._on_publish_error is not None:
            self._call_quietly(self._on_publish_error, error, event)
        else:
            self._unhandled(error, event)

    def _unhandled(self, error: BaseException, event: Any) -> None:
        """A failure no ``on_publish_error`` hook takes: the log (``threadline.events``) says so."""
        self._failure_log.failed(
            "%s failed on a %s event", type(self).__name__, getattr(event, "type", "?"), error=error
        )

    @staticmethod
    def _call_quietly(fn: Callable[..., Any], *args: Any) -> None:
        """Call a hook from synchronous code: its failure is swallowed, a returned awaitable scheduled."""
        try:
            outcome = fn(*args)
        except Exception:
            return
        if inspect.isawaitable(outcome):
            try:
                asyncio.ensure_future(outcome).add_done_callback(_swallow)
            except RuntimeError:  # no running loop: nothing can await it
                if inspect.iscoroutine(outcome):
                    outcome.close()

    # -------------------------------------------------------------------------------------- worker

    def _ensure_worker(self) -> None:
        if self._task is not None and not self._task.done():
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return  # started by the next publish on a running loop, or by drain()/aclose()
        self._task = loop.create_task(self._run(), name=f"threadline-{type(self).__name__}")

    async def _run(self) -> None:
        while True:
            while self._queue:
                event = self._queue.popleft()
                self._current, self._delivering = event, True
                try:
                    outcome = self._deliver(event)
                    if inspect.isawaitable(outcome):
                        await outcome
                    self.delivered += 1
                except asyncio.CancelledError:
                    raise
                except Exception as error:
                    self.failed += 1
                    await self._report(error, event)
                finally:
                    self._current, self._delivering = None, False
            self._idle.set()
            if self._closed:
                return
            self._wakeup.clear()
            await self._wakeup.wait()

    async def _report(self, error: BaseException, event: Any) -> None:
        if self._on_publish_error is None:
            self._unhandled(error, event)
            return
        try:
            outcome = self._on_publish_error(error, event)
            if inspect.isawaitable(outcome):
                await outcome
        except asyncio.CancelledError:
            raise
        except Exception:
            pass

    # ---------------------------------------------------------------------------------- lifecycle

    @property
    def pending(self) -> int:
        return len(self._queue) + (1 if self._delivering else 0)

    @property
    def closed(self) -> bool:
        return self._closed

    def status(self) -> AgentEventSinkStatus:
        return AgentEventSinkStatus(
            pending=self.pending,
            delivered=self.delivered,
            dropped=self.dropped,
            failed=self.failed,
            duplicates=self.duplicates,
            filtered=self.filtered,
            closed=self._closed,
        )

    async def drain(self) -> None:
        """Wait until every accepted event was delivered (or failed). With a stalled ``deliver`` this
        waits as long as it stalls: bound it with ``asyncio.timeout`` or use ``aclose(timeout=...)``."""
        while self._queue or self._delivering:
            self._ensure_worker()
            await self._idle.wait()

    async def aclose(self, timeout: float | None = None) -> AgentEventSinkStatus:
        """Stop accepting (later events are dropped as ``closed``), deliver what is queued, stop the task.
        With ``timeout`` (seconds), whatever is still queued or in flight then is dropped."""
        self._closed = True
        self._wakeup.set()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.drain(), timeout)
        task, self._task = self._task, None
        if task is not None and not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._current is not None:
            self._drop(self._current, "closed")
            self._current, self._delivering = None, False
        while self._queue:
            self._drop(self._queue.popleft(), "closed")
        self._idle.set()
        return self.status()


class AgentRuntimeEventSink(_BoundedSink):
    """A bounded, failure-isolated delivery sink; pass it as ``publish=``. Durable events are
    deduplicated by ``event_id`` (within the last ``dedupe_window`` accepted ids)."""

    _adapter = AGENT_RUNTIME_EVENT_ADAPTER

    def _dedupe_key(self, event: Any) -> str | None:
        if getattr(event, "type", None) in DURABLE_EVENT_TYPES:
            return getattr(event, "event_id", None)
        return None


class AgentOperatorEventSink(_BoundedSink):
    """A bounded, failure-isolated operator sink. Every operator event is deduplicated by ``event_id``;
    ``run-terminal.cause`` is redacted unless ``include_internal_cause``."""

    _adapter = AGENT_RUN_EVENT_ADAPTER

    def __init__(self, *, include_internal_cause: bool = False, **options: Any) -> None:
        super().__init__(**options)
        self.include_internal_cause = include_internal_cause

    def _dedupe_key(self, event: Any) -> str | None:
        return getattr(event, "event_id", None)

    def _prepare(self, event: Any) -> Any:
        if not self.include_internal_cause and isinstance(event, AgentRunTerminalEvent) and event.cause is not None:
            return event.model_copy(update={"cause": None})
        return event


def create_agent_runtime_event_sink(
    *,
    deliver: Callable[[Any], Any],
    capacity: int = 1024,
    project: Callable[[Any], Any] | None = None,
    on_publish_error: Callable[[BaseException, Any], Any] | None = None,
    on_drop: Callable[[Any, str], Any] | None = None,
    deduplicate: bool = True,
    dedupe_window: int = 10_000,
) -> AgentRuntimeEventSink:
    """A delivery sink usable as the runtime's ``publish=`` callback.

    ``deliver(event)`` (sync or async) runs on the sink's own task, one event at a time, in order. At most
    ``capacity`` events wait; further ones are dropped and counted in ``dropped`` (a consumer that then
    sees a transient ``gap`` reloads the snapshot). ``project(event)`` runs inside ``publish`` (keep it
    cheap): it returns the event to deliver — a projection or a redacted copy — or None to drop it.
    Dropping transient events there leaves gaps in their ``sequence`` for a downstream cursor.
    ``on_publish_error(error, event)`` receives every failure of ``deliver``/``project``;
    ``on_drop(event, reason)`` every drop (``'capacity'`` or ``'closed'``). Close with ``aclose()``.
    """
    return AgentRuntimeEventSink(
        deliver=deliver,
        capacity=capacity,
        project=project,
        on_publish_error=on_publish_error,
        on_drop=on_drop,
        deduplicate=deduplicate,
        dedupe_window=dedupe_window,
    )


def create_agent_operator_sink(
    *,
    deliver: Callable[[Any], Any],
    capacity: int = 1024,
    include_internal_cause: bool = False,
    project: Callable[[Any], Any] | None = None,
    on_publish_error: Callable[[BaseException, Any], Any] | None = None,
    on_drop: Callable[[Any, str], Any] | None = None,
    deduplicate: bool = True,
    dedupe_window: int = 10_000,
) -> AgentOperatorEventSink:
    """An operator sink (``run-started``, ``step-finished``, ``run-terminal``), with the same lifecycle as
    :func:`create_agent_runtime_event_sink`. ``run-terminal.cause`` is removed before ``project`` and
    delivery unless ``include_internal_cause`` — set it only on an operator-only sink that owns the
    retention of what a cause may contain."""
    return AgentOperatorEventSink(
        include_internal_cause=include_internal_cause,
        deliver=deliver,
        capacity=capacity,
        project=project,
        on_publish_error=on_publish_error,
        on_drop=on_drop,
        deduplicate=deduplicate,
        dedupe_window=dedupe_window,
    )


# ----------------------------------------------------------------------------------- control view

REASONING_SEPARATOR = "\n\n"


class AgentTransientRunView(_Frozen):
    """What a run has streamed and not yet settled: text and reasoning since its last checkpoint on top of
    that checkpoint's, and the last progress report of each running tool call."""

    text: str = ""
    reasoning: str = ""
    reasoning_active: bool = False
    tools: dict[str, ToolProgressEvent] = Field(default_factory=dict)
    finished_calls: frozenset[str] = frozenset()


class AgentConversationView(_Frozen):
    """One conversation as a UI renders it: settled ``messages`` (from the snapshot, plus admitted inputs
    and terminal answers), run states, the last durable operation of each active run, and the
    transient state of running runs. ``resync_required`` asks for :func:`reduce_agent_control_snapshot`."""

    version: int = 0
    resync_required: bool = False
    messages: tuple[Message, ...] = ()
    run_states: dict[str, str] = Field(default_factory=dict)
    operations: dict[str, RunOperation] = Field(default_factory=dict)
    transient_by_run: dict[str, AgentTransientRunView] = Field(default_factory=dict)


class AgentControlView(_Frozen):
    cursor: AgentMultiSessionCursor = Field(default_factory=AgentMultiSessionCursor)
    conversations: dict[str, AgentConversationView] = Field(default_factory=dict)


def create_agent_control_view() -> AgentControlView:
    return AgentControlView()


def _texts(parts: Iterable[Any]) -> tuple[str, str]:
    text = "".join(p.text for p in parts if p.type == "text")
    reasoning = REASONING_SEPARATOR.join(p.text for p in parts if p.type == "reasoning" and p.text)
    return text, reasoning


def _upsert(messages: tuple[Message, ...], message: Message) -> tuple[Message, ...]:
    for index, existing in enumerate(messages):
        if existing.id == message.id:
            return (*messages[:index], message, *messages[index + 1 :])
    return (*messages, message)


def reduce_agent_control_snapshot(
    snapshot: ConversationSnapshot, state: AgentControlView | None = None
) -> AgentControlView:
    """Reset one conversation of ``state`` (or of a new view) to a canonical snapshot: clears
    ``resync_required``, seeds each running run's streamed text from its checkpointed draft, and sets the
    cursor to the snapshot's version (older durable events are then duplicates). A run that is streaming
    now is accepted from whatever transient sequence arrives next. Pure."""
    state = state or create_agent_control_view()
    active = {run.id: run for run in snapshot.runs if run.active}
    drafts = {run.assistant_message_id: run.id for run in active.values()}
    transient: dict[str, AgentTransientRunView] = {}
    messages: list[Message] = []
    for message in snapshot.messages:
        run_id = drafts.get(message.id)
        if run_id is not None and message.status == "streaming":
            text, reasoning = _texts(message.parts)
            transient[run_id] = AgentTransientRunView(text=text, reasoning=reasoning)
        else:
            messages.append(message)
    conversation = AgentConversationView(
        version=snapshot.version,
        messages=tuple(messages),
        run_states={run.id: run.state for run in snapshot.runs},
        operations={run.id: run.last_operation for run in active.values() if run.last_operation is not None},
        transient_by_run=transient,
    )
    previous = state.cursor.conversations.get(snapshot.conversation_id) or AgentRuntimeEventCursor()
    runs = dict(previous.runs)
    for run_id, run in active.items():
        if run.acquired and run_id not in runs:
            runs[run_id] = AgentTransientCursor()  # baseline: it was streaming before we looked
    cursor = AgentRuntimeEventCursor(version=snapshot.version, runs=runs)
    return AgentControlView(
        cursor=state.cursor.model_copy(
            update={"conversations": {**state.cursor.conversations, snapshot.conversation_id: cursor}}
        ),
        conversations={**state.conversations, snapshot.conversation_id: conversation},
    )


def reduce_agent_control_event(state: AgentControlView | None, event: Any) -> AgentControlView:
    """Apply one delivery event. Pure: returns a new view, never touches its input.

    A duplicate changes nothing. A transient gap marks the conversation ``resync_required`` (the event is
    still applied; a later checkpoint or snapshot heals the text). ``assistant-delta``/``reasoning-delta``
    append; ``attempt-reset`` withdraws what the run streamed; ``assistant-checkpoint`` replaces the
    streamed text by the checkpoint's; ``tool-progress`` keeps the last report per running call until
    its ``completed``/``failed``/``interrupted`` status; ``terminal`` clears the run's transient state and
    records its answer. Transient events of a run already settled are ignored.
    """
    state = state or create_agent_control_view()
    event = _delivery_event(event)
    cursor, classification = advance_agent_multi_session_cursor(state.cursor, event)
    if classification == "duplicate":
        return state
    conversation = state.conversations.get(event.conversation_id) or AgentConversationView()
    if classification == "gap":
        conversation = conversation.model_copy(update={"resync_required": True})
    conversation = _apply(conversation, event)
    return AgentControlView(cursor=cursor, conversations={**state.conversations, event.conversation_id: conversation})


def _apply(view: AgentConversationView, event: Any) -> AgentConversationView:
    kind = event.type
    if kind in DURABLE_EVENT_TYPES:
        view = view.model_copy(update={"version": max(view.version, event.version)})
    run_id = event.run_id
    if kind == "admission":
        return view.model_copy(
            update={
                "messages": _upsert(view.messages, event.input),
                "run_states": {**view.run_states, event.run.id: event.run.state},
            }
        )
    if kind == "run-state":
        return view.model_copy(update={"run_states": {**view.run_states, run_id: event.state}})
    if kind == "run-operation":
        return view.model_copy(update={"operations": {**view.operations, run_id: event.operation}})
    if kind == "terminal":
        transient = {k: v for k, v in view.transient_by_run.items() if k != run_id}
        operations = {k: v for k, v in view.operations.items() if k != run_id}
        state = RUN_STATE_FOR_REASON.get(event.terminal_reason, view.run_states.get(run_id, "completed"))
        messages = _upsert(view.messages, event.assistant) if event.assistant is not None else view.messages
        return view.model_copy(
            update={
                "transient_by_run": transient,
                "operations": operations,
                "run_states": {**view.run_states, run_id: state},
                "messages": messages,
            }
        )
    known_state = view.run_states.get(run_id)
    if known_state is not None and known_state not in ACTIVE_RUN_STATES:
        return view  # a settled run streams nothing more
    run = view.transient_by_run.get(run_id) or AgentTransientRunView()
    run = _apply_to_run(run, event)
    return view.model_copy(update={"transient_by_run": {**view.transient_by_run, run_id: run}})


def _apply_to_run(run: AgentTransientRunView, event: Any) -> AgentTransientRunView:
    kind = event.type
    if kind == "assistant-checkpoint":
        text, reasoning = _texts(event.parts)
        return run.model_copy(update={"text": text, "reasoning": reasoning})
    if kind == "assistant-delta":
        return run.model_copy(update={"text": run.text + event.delta})
    if kind == "reasoning-start":
        reasoning = run.reasoning + REASONING_SEPARATOR if run.reasoning else run.reasoning
        return run.model_copy(update={"reasoning": reasoning, "reasoning_active": True})
    if kind == "reasoning-delta":
        return run.model_copy(update={"reasoning": run.reasoning + event.delta})
    if kind == "reasoning-end":
        return run.model_copy(update={"reasoning_active": False})
    if kind == "attempt-reset":
        return run.model_copy(update={"text": "", "reasoning": "", "reasoning_active": False, "tools": {}})
    if kind == "tool-progress":
        if event.call_id in run.finished_calls:
            return run  # the call's terminal status had the final word
        return run.model_copy(update={"tools": {**run.tools, event.call_id: event}})
    if kind == "tool-status" and event.status != "started":
        tools = {k: v for k, v in run.tools.items() if k != event.call_id}
        return run.model_copy(update={"tools": tools, "finished_calls": run.finished_calls | {event.call_id}})
    return run
