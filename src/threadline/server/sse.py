"""``GET /conversations/{id}/events``: one conversation's delivery events as Server-Sent Events.

The stream opens with ``event: snapshot`` (the canonical snapshot), then one SSE event per delivery event
(``event:`` is its ``type``, ``data:`` its JSON). Each carries an ``id``: the conversation version the stream
has reached, and for a transient event also its position (``<version>:<run_id>:<runtime_epoch>:<sequence>``).

Resume: a client reconnecting with ``Last-Event-ID`` (EventSource does it by itself) gets no snapshot when
it missed nothing — the conversation is still at that version and every running run is still at that
position — and the stream simply goes on; otherwise the snapshot comes first, and the client resets its
view to it (:func:`threadline.reduce_agent_control_snapshot`). Transient events are never stored, so this
is the only correct resume: the durable snapshot, then live events.

A client that falls ``max_pending_events`` behind gets ``event: resync-required`` when it can still be
written, and the stream ends; its reconnection brings the snapshot. Attach capacity is the control
server's: beyond it the route answers 503 with ``Retry-After``.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from ..events import DURABLE_EVENT_TYPES
from ..records import ConversationSnapshot
from .auth import identify
from .responses import error_response, unauthorized
from .state import server_state

STREAM_QUEUE = 16
"""Deliveries handed from the control connection to the response writer at once (the control server's
``max_pending_events`` bounds the rest)."""
_OVERFLOW = object()
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


async def conversation_events(request: Request) -> Response:
    state = server_state(request.app)
    caller = await identify(state.settings.authenticate, request, allow_query=True)
    if caller is None:
        return unauthorized()
    conversation_id = request.path_params["conversation_id"]
    last = _parse_last_event_id(request.headers.get("last-event-id") or request.query_params.get("last_event_id"))
    queue: asyncio.Queue[Any] = asyncio.Queue(STREAM_QUEUE)

    overflowed = asyncio.Event()  # the marker below may not fit a full queue; the reader also checks this

    def on_overflow(delivery: Any) -> None:
        overflowed.set()
        with contextlib.suppress(asyncio.QueueFull):
            queue.put_nowait(_OVERFLOW)

    connection = state.control.connect(id=f"sse-{uuid.uuid4().hex}", deliver=queue.put, on_overflow=on_overflow)
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
    resume = missed_nothing(last, snapshot, state.harness.events)

    async def stream() -> AsyncIterator[str]:
        version = snapshot.version
        try:
            if not resume:
                yield sse_frame("snapshot", snapshot.model_dump_json(), str(version))
            while True:
                if overflowed.is_set() and queue.empty():
                    item = _OVERFLOW
                else:
                    try:
                        item = await asyncio.wait_for(queue.get(), state.settings.keepalive)
                    except TimeoutError:
                        yield ": keepalive\n\n"
                        continue
                if item is _OVERFLOW:
                    yield sse_frame("resync-required", '{"reason":"overflow"}')
                    return
                # everything already waiting goes out in one write (a reader that fell behind catches up in
                # fewer, larger writes)
                frames = []
                while item is not None and item is not _OVERFLOW:
                    event = item.event
                    if event.type in DURABLE_EVENT_TYPES:
                        if event.version > snapshot.version:  # else the snapshot (or the resumed reader) has it
                            version = max(version, event.version)
                            frames.append(sse_frame(event.type, item.event_json(), str(version)))
                    else:
                        event_id = f"{version}:{event.run_id}:{event.runtime_epoch}:{event.sequence}"
                        frames.append(sse_frame(event.type, item.event_json(), event_id))
                    item = queue.get_nowait() if not queue.empty() else None
                if frames:
                    yield "".join(frames)
                if item is _OVERFLOW:
                    yield sse_frame("resync-required", '{"reason":"overflow"}')
                    return
        finally:
            connection.close()

    return StreamingResponse(stream(), media_type="text/event-stream", headers=SSE_HEADERS)


def routes() -> list[Route]:
    return [Route("/conversations/{conversation_id}/events", conversation_events, methods=["GET"])]
