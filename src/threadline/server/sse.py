"""``GET /conversations/{id}/events``: one conversation's delivery events as Server-Sent Events.

The stream opens with ``event: snapshot`` (the canonical snapshot), then one SSE event per delivery event
(``event:`` is its ``type``, ``data:`` its JSON). Each carries an ``id``: the conversation version the stream
has reached, and for a transient event also its position (``<version>:<run_id>:<runtime_epoch>:<sequence>``).

Resume: a client reconnecting with ``Last-Event-ID`` (EventSource does it by itself) gets no snapshot when
it missed nothing — the conversation is still at that version and every running run is still at that
position — and the stream simply goes on; otherwise the snapshot comes first, and the client resets its
view to it (:func:`threadline.reduce_agent_control_snapshot`). Transient events are never stored, so this
is the only correct resume: the durable snapshot, then live events.

Events that were waiting together (published in one turn of the event loop, or queued while the reader's
socket was full) go out in one write of several SSE events. A client that falls ``max_pending_events``
behind gets ``event: resync-required`` when it can still be written, and the stream ends; its reconnection
brings the snapshot. Attach capacity is the control server's: beyond it the route answers 503 with
``Retry-After``.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from ..events import DURABLE_EVENT_TYPES
from ..records import ConversationSnapshot
from .auth import identify
from .responses import error_response, unauthorized
from .state import server_state

RESYNC_WRITE_TIMEOUT = 5.0
"""Seconds the ``resync-required`` notice of a reader that fell behind may wait for its socket."""
SSE_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}


def sse_frame(kind: str, data: str, event_id: str | None = None) -> str:
    head = f"id: {event_id}\n" if event_id is not None else ""
    return f"{head}event: {kind}\ndata: {data}\n\n"


def _parse_last_event_id(value: str | None) -> tuple[int, tuple[str, str, int] | None] | None:
    if not value:
        return None
    fields = value.split(":")
    try:
        version = int(fields[0])
        if len(fields) == 1:
            return version, None
        if len(fields) == 4:
            return version, (fields[1], fields[2], int(fields[3]))
    except ValueError:
        return None
    return None


def missed_nothing(
    last: tuple[int, tuple[str, str, int] | None] | None, snapshot: ConversationSnapshot, hub: Any
) -> bool:
    """Whether a reader at ``last`` has seen everything the snapshot and the live runs hold."""
    if last is None or last[0] != snapshot.version:
        return False
    position = last[1]
    for run in snapshot.runs:
        if not run.acquired:
            continue
        live = hub.transient_position(run.id)
        if live is None:
            continue  # nothing streamed by that run here yet
        if position is None or position[0] != run.id or (position[1], position[2]) != live:
            return False
    return True


def _encode(batch: Any, snapshot_version: int, version: int) -> tuple[str, int]:
    """A batch as SSE text for a stream that began at ``snapshot_version`` and has reached ``version``, and
    the version reached after it. Durable events the snapshot holds are left out."""
    frames = []
    for item in batch:
        event = item.event
        if event.type in DURABLE_EVENT_TYPES:
            if event.version > snapshot_version:  # else the snapshot (or the resumed reader) has it
                version = max(version, event.version)
                frames.append(sse_frame(event.type, item.event_json(), str(version)))
        else:
            event_id = f"{version}:{event.run_id}:{event.runtime_epoch}:{event.sequence}"
            frames.append(sse_frame(event.type, item.event_json(), event_id))
    return "".join(frames), version


class _EventStream(Response):
    """The stream of one SSE reader. The control server hands it batches (:meth:`deliver`), each written at
    once as one chunk of the response body through the ASGI ``send`` — no queue and no task per event; a
    batch whose write must wait (the reader's socket is full) holds the next one back, which the control
    server bounds (``max_pending_events``, then ``resync-required``). Keepalive comments and the final
    notice go through the same serialized writer."""

    media_type = "text/event-stream"

    def __init__(self, keepalive: float) -> None:
        # no body yet, so no content-length: the body is streamed until the reader leaves
        self.status_code = 200
        self.background = None
        self.init_headers(SSE_HEADERS)
        self._keepalive = keepalive
        self._lock = asyncio.Lock()
        self._send: Any = None
        self._started: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._stop = asyncio.Event()
        self._connection: Any = None
        self._snapshot: ConversationSnapshot | None = None
        self._resume = False
        self.version = 0

    def begin(self, connection: Any, snapshot: ConversationSnapshot, resume: bool) -> None:
        self._connection, self._snapshot, self._resume = connection, snapshot, resume
        self.version = snapshot.version

    def deliver(self, batch: Any) -> Any:
        if not self._started.done():
            return self._deliver_later(batch)  # before the response began: the control server holds the rest
        return self._write_batch(batch)

    async def _deliver_later(self, batch: Any) -> None:
        await self._started
        await self._write_batch(batch)

    async def _write_batch(self, batch: Any) -> None:
        assert self._snapshot is not None
        # streams at the same position share one encoding of the batch
        began, reached = self._snapshot.version, self.version
        text, self.version = batch.encoded(("sse", began, reached), lambda b: _encode(b, began, reached))
        if text:
            await self._write(text)

    def overflow(self, delivery: Any) -> None:
        self._stop.set()  # synchronous, while a write may be blocked: the stream ends on its own task

    async def _write(self, text: str) -> None:
        async with self._lock:
            await self._send({"type": "http.response.body", "body": text.encode(), "more_body": True})

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        assert self._snapshot is not None and self._connection is not None
        self._send = send
        disconnected = asyncio.ensure_future(_disconnect(receive))
        stopping = asyncio.ensure_future(self._stop.wait())
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            if not self._resume:
                await self._write(sse_frame("snapshot", self._snapshot.model_dump_json(), str(self._snapshot.version)))
            self._started.set_result(None)
            while True:
                done, _ = await asyncio.wait(
                    {disconnected, stopping}, timeout=self._keepalive, return_when=asyncio.FIRST_COMPLETED
                )
                if disconnected in done:
                    return
                if stopping in done:
                    with contextlib.suppress(Exception):
                        await asyncio.wait_for(
                            self._write(sse_frame("resync-required", '{"reason":"overflow"}')), RESYNC_WRITE_TIMEOUT
                        )
                    break
                await self._write(": keepalive\n\n")
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            self._connection.close()
            disconnected.cancel()
            stopping.cancel()
            if not self._started.done():
                self._started.cancel()


async def _disconnect(receive: Any) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def conversation_events(request: Request) -> Response:
    state = server_state(request.app)
    caller = await identify(state.settings.authenticate, request, allow_query=True)
    if caller is None:
        return unauthorized()
    conversation_id = request.path_params["conversation_id"]
    last = _parse_last_event_id(request.headers.get("last-event-id") or request.query_params.get("last_event_id"))
    stream = _EventStream(state.settings.keepalive)
    connection = state.control.connect(
        id=f"sse-{uuid.uuid4().hex}", deliver_batch=stream.deliver, on_overflow=stream.overflow
    )
    attached = await connection.request(
        {"request_id": "sse", "operation": "attach", "conversation_id": conversation_id, "access": "observe"}
    )
    if attached.outcome == "error":
        connection.close()
        if attached.error.code == "ATTACHMENT_CAPACITY":
            return error_response(503, attached.error.code, attached.error.message, **{"Retry-After": "1"})
        return error_response(400, attached.error.code, attached.error.message, field=attached.error.field)
    snapshot = attached.snapshot
    assert snapshot is not None
    stream.begin(connection, snapshot, resume=missed_nothing(last, snapshot, state.harness.events))
    return stream


def routes() -> list[Route]:
    return [Route("/conversations/{conversation_id}/events", conversation_events, methods=["GET"])]
