"""``create_agent_harness_control_server``: transport-neutral control of a harness.

A transport (a WebSocket, an SSE stream, a test) calls :meth:`AgentHarnessControlServer.connect` once per
client with two callbacks, then passes each client request to :meth:`AgentHarnessControlConnection.request`
and sends back the response it returns (the schema is in :mod:`threadline.harness.control_schema`).

Rules, and why:

- **Attach registers before it reads the snapshot.** Events of the conversation published while the
  snapshot is being read already reach the connection, so nothing falls between the snapshot and the first
  event (the reverse order would lose whatever is published during the read). A reader applies the snapshot
  when the response arrives; its cursor treats older durable events as duplicates.
- **One controller lease per conversation.** ``attach`` with ``control`` takes it (``LEASE_CONFLICT`` when
  another connection holds it); ``submit``, ``interrupt`` and ``respond-approval`` need it
  (``LEASE_REQUIRED``); ``detach``, an ``observe`` re-attach or closing the connection releases it. The
  lease coordinates interactive controllers of this server; it is not a durable lock.
- **Bounded, serialized delivery.** Each connection takes its events in order, one delivery at a time
  through ``deliver`` or everything waiting at once through ``deliver_batch`` (an
  :class:`~threadline.harness.fanout.AgentControlDeliveryBatch`: what a transport writes as one frame), sync
  or async, never two at once. Events published in one turn of the event loop are handed to every
  connection together after it (see :mod:`threadline.harness.fanout`); what arrives while a connection is
  still delivering waits, at most ``max_pending_events`` of it. A connection that falls that far behind is
  detached at once: ``on_overflow`` (synchronous, required) receives ``resync-required`` and must close or
  abort the transport — it is called while a delivery may still be blocked, so it must not write a second
  frame — and the client reconnects and attaches again. Publishing never waits for a consumer, so a slow
  client never slows a run.
- **Bounded attach reads.** At most ``max_pending_attachments`` attach snapshots are read at once on the
  server (``ATTACHMENT_CAPACITY``); one connection attaches a conversation once at a time
  (``ATTACH_IN_PROGRESS``, also for its other requests on that conversation meanwhile).
- **Closing a connection or the server never closes the harness.** Requests in flight then answer
  ``CONNECTION_CLOSED``; the harness runs on.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

from ..errors import AgentConfigError, ThreadlineError
from .control_schema import (
    AgentControlErrorResponse,
    AgentControlEventDelivery,
    AgentControlOkResponse,
    AgentControlResponse,
    AgentControlResyncDelivery,
    AttachRequest,
    DetachRequest,
    InterruptRequest,
    RespondApprovalRequest,
    SnapshotRequest,
    SubmitRequest,
    control_error,
    parse_control_request,
)
from .fanout import AgentControlDeliveryBatch, start_delivery
from .harness import HeadlessAgentHarness

_log = logging.getLogger("threadline.harness.control")

DEFAULT_MAX_PENDING_ATTACHMENTS = 32
DEFAULT_MAX_PENDING_EVENTS = 128

Access = Literal["observe", "control"]


def _positive(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise AgentConfigError(f"{name} is a positive integer, got {value!r}", field=name)
    return value


@dataclass(eq=False)
class _Connection:
    id: str
    deliver: Callable[[AgentControlDeliveryBatch], Any]
    on_overflow: Callable[[AgentControlResyncDelivery], Any]
    attached: dict[str, Access] = field(default_factory=dict)
    attaching: set[str] = field(default_factory=set)
    overflowed: bool = False
    closed: bool = False
    writing: asyncio.Future[Any] | None = None
    """The delivery that had to wait (its transport's buffer was full); the next one starts after it."""
    backlog: list[AgentControlEventDelivery] = field(default_factory=list)
    """What arrived while ``writing``: delivered as one batch once it is done."""


def _one_at_a_time(deliver: Callable[[AgentControlEventDelivery], Any], connection_id: str) -> Callable[..., Any]:
    """A batch handed to a ``deliver`` that takes one delivery per call, in order, each failure isolated."""

    def start_next(items: Iterator[AgentControlEventDelivery]) -> Any:
        """Deliver until one delivery returns an awaitable (returned), or none is left (None)."""
        for delivery in items:
            try:
                outcome = deliver(delivery)
            except Exception as error:
                _delivery_failed(connection_id, error)
                continue
            if inspect.isawaitable(outcome):
                return outcome
        return None

    async def rest(outcome: Any, items: Iterator[AgentControlEventDelivery]) -> None:
        while outcome is not None:
            try:
                await outcome
            except Exception as error:
                _delivery_failed(connection_id, error)
            outcome = start_next(items)

    def deliver_batch(batch: AgentControlDeliveryBatch) -> Any:
        items = iter(batch.deliveries)
        outcome = start_next(items)
        return None if outcome is None else rest(outcome, items)

    return deliver_batch


def _delivery_failed(connection_id: str, error: BaseException) -> None:
    _log.debug("delivery to control connection %s failed", connection_id, exc_info=error)


class AgentHarnessControlConnection:
    """One client's connection. Use :meth:`request` for every client request and :meth:`close` when the
    transport goes away."""

    def __init__(self, server: AgentHarnessControlServer, state: _Connection) -> None:
        self._server = server
        self._state = state

    @property
    def id(self) -> str:
        return self._state.id

    @property
    def closed(self) -> bool:
        return self._state.closed

    @property
    def attached(self) -> dict[str, Access]:
        """The conversations this connection receives events of, with its access (a copy)."""
        return dict(self._state.attached)

    async def request(self, raw: Any) -> AgentControlResponse:
        """Handle one request (a dict, JSON text, or a request record) and return its response; never
        raises for a bad request or a failed operation (the response says ``error``). Safe to call
        concurrently. Cancelling it cancels the operation where it is (an admission already sent may have
        committed: ``submit`` again with the same idempotency key to find out)."""
        return await self._server._handle(self._state, raw)

    def close(self) -> None:
        """Detach this client: its lease is released, undelivered events are dropped, requests still in
        flight answer ``CONNECTION_CLOSED``. Idempotent; never closes the harness."""
        self._server._detach(self._state)


class AgentHarnessControlServer:
    """Correlated control requests, shared observers and controller leases over one harness. Build it with
    :func:`create_agent_harness_control_server`."""

    def __init__(
        self,
        harness: HeadlessAgentHarness,
        *,
        max_pending_attachments: int = DEFAULT_MAX_PENDING_ATTACHMENTS,
        max_pending_events: int = DEFAULT_MAX_PENDING_EVENTS,
    ) -> None:
        self.harness = harness
        self.max_pending_attachments = _positive("max_pending_attachments", max_pending_attachments)
        self.max_pending_events = _positive("max_pending_events", max_pending_events)
        self._connections: dict[str, _Connection] = {}
        self._observers: dict[str, set[_Connection]] = {}
        self._controllers: dict[str, str] = {}
        self._pending_attachments = 0
        self._closed = False
        self._published: dict[str, list[AgentControlEventDelivery]] = {}  # this loop turn's, by conversation
        self._handing: asyncio.Handle | None = None
        self._rest_until = 0.0  # loop time before which the next hand-over does not start
        self._unsubscribe = harness.subscribe(self._on_event)

    # ------------------------------------------------------------------------------------ surface

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def connection_count(self) -> int:
        return len(self._connections)

    def controller_of(self, conversation_id: str) -> str | None:
        """The id of the connection holding the conversation's controller lease, if any."""
        return self._controllers.get(conversation_id)

    def connect(
        self,
        *,
        id: str,
        deliver: Callable[[AgentControlEventDelivery], Any] | None = None,
        on_overflow: Callable[[AgentControlResyncDelivery], None] | None = None,
        deliver_batch: Callable[[AgentControlDeliveryBatch], Any] | None = None,
    ) -> AgentHarnessControlConnection:
        """Register one client, with one of two ways to receive its events: ``deliver(delivery)`` (sync or
        async) takes them one at a time; ``deliver_batch(batch)`` (sync or async) takes everything waiting
        at once (:class:`~threadline.harness.fanout.AgentControlDeliveryBatch`, in order) — what a transport
        writes as one frame. ``on_overflow(delivery)`` is called synchronously, once, when the client fell
        ``max_pending_events`` behind (see the module docstring); it is required and synchronous. Raises
        :class:`~threadline.errors.AgentConfigError` for a duplicate ``id``, both or neither of ``deliver``
        and ``deliver_batch``, a missing or ``async`` ``on_overflow`` (``field`` names it), or after
        :meth:`close`."""
        if self._closed:
            raise AgentConfigError("the control server is closed; it accepts no connection", field="connect")
        if not isinstance(id, str) or not id:
            raise AgentConfigError("a connection id is a non-empty string", field="id")
        if id in self._connections:
            raise AgentConfigError(f"connection id {id!r} is already connected", field="id")
        if (deliver is None) == (deliver_batch is None):
            raise AgentConfigError("connect takes one of deliver and deliver_batch", field="deliver")
        receive = deliver_batch if deliver is None else deliver
        if not callable(receive):
            raise AgentConfigError("connect needs a callable deliver or deliver_batch", field="deliver")
        if on_overflow is None or not callable(on_overflow):
            raise AgentConfigError(
                "connect needs on_overflow: a synchronous callable that closes or aborts the transport",
                field="on_overflow",
            )
        if inspect.iscoroutinefunction(on_overflow) or inspect.iscoroutinefunction(type(on_overflow).__call__):
            raise AgentConfigError(
                "on_overflow is synchronous: it is called while a delivery may be blocked and must close or "
                "abort the transport at once (schedule any async work from it yourself)",
                field="on_overflow",
            )
        batches = deliver_batch if deliver is None else _one_at_a_time(deliver, id)
        state = _Connection(id=id, deliver=batches, on_overflow=on_overflow)  # type: ignore[arg-type]
        self._connections[id] = state
        return AgentHarnessControlConnection(self, state)

    def close(self) -> None:
        """Detach every connection and stop listening. Idempotent; the harness is left running."""
        if self._closed:
            return
        self._closed = True
        self._unsubscribe()
        for state in list(self._connections.values()):
            self._detach(state)

    # ------------------------------------------------------------------------------------ delivery

    def _on_event(self, event: Any) -> None:
        # constant work per event, whatever the number of viewers: they are handed this loop turn's events
        # together, after it (_hand_over)
        if event.conversation_id not in self._observers:
            return
        delivery = AgentControlEventDelivery.model_construct(event=event)
        object.__setattr__(delivery, "__pydantic_private__", {"_event_json": None, "_json": None})  # the encoding cache
        published = self._published.get(event.conversation_id)
        if published is None:
            self._published[event.conversation_id] = [delivery]
        else:
            published.append(delivery)
        if self._handing is None:
            loop = asyncio.get_running_loop()
            if self._rest_until > loop.time():
                self._handing = loop.call_at(self._rest_until, self._hand_over)
            else:
                self._handing = loop.call_soon(self._hand_over)

    def _hand_over(self) -> None:
        loop = asyncio.get_running_loop()
        began = loop.time()
        try:
            self._hand_over_now()
        finally:
            # the next hand-over waits as long as this one took: writing to many viewers never takes more
            # than half of the event loop (a run executing in this process keeps the rest), and what is
            # published meanwhile goes out together, in fewer writes
            self._handing = None
            ended = loop.time()
            self._rest_until = ended + (ended - began)

    def _hand_over_now(self) -> None:
        published, self._published = self._published, {}
        for conversation_id, deliveries in published.items():
            observers = self._observers.get(conversation_id)
            if not observers:
                continue
            batch = AgentControlDeliveryBatch(deliveries)  # one per conversation: encoded once for everyone
            for state in tuple(observers):
                if state.overflowed or state.closed:
                    continue
                if state.writing is None:
                    self._deliver(state, batch)
                    continue
                state.backlog.extend(batch.deliveries)
                if len(state.backlog) > self.max_pending_events:
                    self._overflow(state, conversation_id)

    def _deliver(self, state: _Connection, batch: AgentControlDeliveryBatch) -> None:
        try:
            outcome = state.deliver(batch)
            waiting = start_delivery(outcome) if inspect.isawaitable(outcome) else None
        except Exception as error:
            _delivery_failed(state.id, error)
            return
        if waiting is not None:
            state.writing = waiting
            waiting.add_done_callback(lambda done: self._delivered(state, done))

    def _delivered(self, state: _Connection, done: asyncio.Future[Any]) -> None:
        state.writing = None
        if not done.cancelled() and done.exception() is not None:
            _delivery_failed(state.id, done.exception())  # type: ignore[arg-type]
        if state.closed or not state.backlog:
            return
        backlog, state.backlog = state.backlog, []
        self._deliver(state, AgentControlDeliveryBatch(backlog))

    def _overflow(self, state: _Connection, conversation_id: str) -> None:
        state.overflowed = True
        resync = AgentControlResyncDelivery(conversation_id=conversation_id)
        _log.info("control connection %s fell %d events behind; detached", state.id, self.max_pending_events)
        try:
            outcome = state.on_overflow(resync)
        except Exception:
            _log.warning("on_overflow of control connection %s failed", state.id, exc_info=True)
        else:
            if inspect.isawaitable(outcome):
                # on_overflow is synchronous: an awaitable it returns is not run (nothing may wait here)
                if inspect.iscoroutine(outcome):
                    outcome.close()
                _log.warning("on_overflow of control connection %s returned an awaitable; it is not awaited", state.id)
        self._detach(state)

    def _detach(self, state: _Connection) -> None:
        if state.closed:
            return
        state.closed = True
        for conversation_id in state.attached:
            self._unobserve(state, conversation_id)
        state.attached.clear()
        if self._connections.get(state.id) is state:
            del self._connections[state.id]
        state.backlog.clear()
        writing, state.writing = state.writing, None
        if writing is not None:
            writing.cancel()  # a delivery blocked on a transport that is going away

    def _observe(self, state: _Connection, conversation_id: str, access: Access) -> None:
        state.attached[conversation_id] = access
        self._observers.setdefault(conversation_id, set()).add(state)

    def _unobserve(self, state: _Connection, conversation_id: str) -> None:
        if self._controllers.get(conversation_id) == state.id:
            del self._controllers[conversation_id]
        observers = self._observers.get(conversation_id)
        if observers is not None:
            observers.discard(state)
            if not observers:
                del self._observers[conversation_id]

    # ------------------------------------------------------------------------------------ requests

    def _live(self, state: _Connection) -> bool:
        return not self._closed and not state.closed and self._connections.get(state.id) is state

    async def _handle(self, state: _Connection, raw: Any) -> AgentControlResponse:
        request = parse_control_request(raw)
        if isinstance(request, AgentControlErrorResponse):
            return request
        rid = request.request_id
        if not self._live(state):
            return control_error(rid, "CONNECTION_CLOSED", "the connection is closed; reconnect and attach again")
        try:
            if isinstance(request, AttachRequest):
                return await self._attach(state, request)
            cid = request.conversation_id
            if cid in state.attaching:
                return control_error(
                    rid, "ATTACH_IN_PROGRESS", "wait for this connection's attach of the conversation to settle"
                )
            if isinstance(request, DetachRequest):
                if cid in state.attached:
                    self._unobserve(state, cid)
                    del state.attached[cid]
                return AgentControlOkResponse(request_id=rid)
            if cid not in state.attached:
                return control_error(rid, "NOT_ATTACHED", f"attach conversation {cid!r} before this request")
            if isinstance(request, SnapshotRequest):
                response: AgentControlResponse = AgentControlOkResponse(
                    request_id=rid, snapshot=await self.harness.snapshot(cid)
                )
            elif state.attached.get(cid) != "control" or self._controllers.get(cid) != state.id:
                return control_error(
                    rid, "LEASE_REQUIRED", "this operation needs the controller lease: attach with access 'control'"
                )
            else:
                response = await self._controlled(request)
            if not self._live(state):
                return control_error(rid, "CONNECTION_CLOSED", "the connection closed while the request ran")
            return response
        except Exception as error:
            return self._rejected(rid, error)

    async def _attach(self, state: _Connection, request: AttachRequest) -> AgentControlResponse:
        rid, cid, access = request.request_id, request.conversation_id, request.access
        if cid in state.attaching:
            return control_error(rid, "ATTACH_IN_PROGRESS", "wait for this connection's attach of the conversation")
        if self._pending_attachments >= self.max_pending_attachments:
            return control_error(
                rid,
                "ATTACHMENT_CAPACITY",
                f"{self.max_pending_attachments} attach snapshots are being read on this server; retry shortly",
            )
        owner = self._controllers.get(cid)
        if access == "control" and owner is not None and owner != state.id:
            return control_error(rid, "LEASE_CONFLICT", f"another connection controls conversation {cid!r}")
        previous_access = state.attached.get(cid)
        previous_owner = owner
        self._pending_attachments += 1
        state.attaching.add(cid)
        # register first: events published while the snapshot is read already reach this connection. An
        # existing attachment keeps its access until the new snapshot is in.
        if previous_access is None:
            self._observe(state, cid, access)
        if access == "control":
            self._controllers[cid] = state.id
        try:
            snapshot = await self.harness.snapshot(cid)
        except BaseException:
            if self._live(state):
                if previous_access is None:
                    self._unobserve(state, cid)
                    state.attached.pop(cid, None)
                if access == "control" and self._controllers.get(cid) == state.id:
                    if previous_owner is None:
                        del self._controllers[cid]
                    else:
                        self._controllers[cid] = previous_owner
            raise
        finally:
            self._pending_attachments -= 1
            state.attaching.discard(cid)
        if not self._live(state):
            return control_error(rid, "CONNECTION_CLOSED", "the connection closed while attaching")
        state.attached[cid] = access
        if access == "observe" and self._controllers.get(cid) == state.id:
            del self._controllers[cid]  # re-attached as an observer: the lease is released
        return AgentControlOkResponse(request_id=rid, snapshot=snapshot)

    async def _controlled(self, request: Any) -> AgentControlResponse:
        harness, rid, cid = self.harness, request.request_id, request.conversation_id
        if isinstance(request, InterruptRequest):
            await harness.interrupt(conversation_id=cid, run_id=request.run_id)
            return AgentControlOkResponse(request_id=rid, snapshot=await harness.snapshot(cid))
        if isinstance(request, RespondApprovalRequest):
            ticket = await harness.respond_to_approval(
                conversation_id=cid,
                approval_id=request.approval_id,
                approved=request.approved,
                reason=request.reason,
                context=request.context,
            )
        else:
            assert isinstance(request, SubmitRequest)
            ticket = harness.submit(
                conversation_id=cid,
                idempotency_key=request.idempotency_key,
                context=request.context,
                parts=list(request.parts),
                input_metadata=request.input_metadata,
            )
        admission = await ticket.admission
        return AgentControlOkResponse(request_id=rid, run_id=admission.run_id, snapshot=await harness.snapshot(cid))

    @staticmethod
    def _rejected(request_id: str, error: Exception) -> AgentControlErrorResponse:
        if isinstance(error, ThreadlineError):
            # threadline's own errors are written for the caller (a bad part, an unknown approval, a closed
            # runtime): the message and the field go back
            return control_error(
                request_id,
                "REQUEST_REJECTED",
                f"{type(error).__name__}: {error}" if str(error) else type(error).__name__,
                field=getattr(error, "field", None),
            )
        _log.warning("a control request failed", exc_info=error)
        return control_error(request_id, "REQUEST_REJECTED", "the request failed; see the server log")


def create_agent_harness_control_server(
    harness: HeadlessAgentHarness,
    *,
    max_pending_attachments: int = DEFAULT_MAX_PENDING_ATTACHMENTS,
    max_pending_events: int = DEFAULT_MAX_PENDING_EVENTS,
) -> AgentHarnessControlServer:
    """A control server over ``harness`` (see :mod:`threadline.harness.control`). ``max_pending_attachments``
    bounds concurrent attach snapshot reads on the server; ``max_pending_events`` bounds each connection's
    undelivered events. Call from a running event loop; close with :meth:`AgentHarnessControlServer.close`."""
    return AgentHarnessControlServer(
        harness, max_pending_attachments=max_pending_attachments, max_pending_events=max_pending_events
    )
