"""``/control``: the control protocol (:mod:`threadline.harness.control_schema`) over one WebSocket.

Client → server: one request per text message. Server → client: ``{"type": "response", ...}`` answering a
request (same ``request_id``), and the control server's deliveries, ``{"type": "event", "event": ...}`` —
one per message, or, when several were waiting for this socket (events published together, or a client
that fell behind), a JSON array of them in order in one message. A client parses each message and, when
it is an array, handles its elements in order.
Requests run concurrently (an ``attach`` may wait for its snapshot while a ``submit`` goes on), at most
``max_pending_requests`` at once (then ``REQUEST_CAPACITY``); frames are written one at a time.

A client that falls ``max_pending_events`` behind is disconnected with close code 4008 and reason
``resync-required``: reconnect, attach again and render the fresh snapshots. Authentication happens before
the socket is accepted (a refused caller gets HTTP 403); with an ``authenticate`` hook, the ``context`` of
``submit`` and ``respond-approval`` is the hook's, whatever the message says.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import uuid
from typing import Any

from starlette.routing import WebSocketRoute
from starlette.websockets import WebSocket, WebSocketDisconnect, WebSocketState

from ..harness.control_schema import control_error
from .auth import Caller, identify
from .state import server_state

_log = logging.getLogger("threadline.server")

RESYNC_CLOSE_CODE = 4008
"""The close code of a connection detached for falling behind (reason ``resync-required``)."""
RESYNC_CLOSE_TIMEOUT = 5.0
"""Seconds a detached socket has to take its close frame before the server stops serving it."""
_CONTEXT_OPERATIONS = ("submit", "respond-approval")


def _response_frame(response: Any) -> str:
    # one JSON object: the response's own fields with "type" first
    return '{"type":"response",' + response.model_dump_json()[1:]


class _Socket:
    def __init__(self, websocket: WebSocket) -> None:
        self.websocket = websocket
        self.lock = asyncio.Lock()
        self.closed = False

    async def send(self, text: str) -> None:
        async with self.lock:
            if self.closed:
                raise ConnectionError("the socket is closed")
            await self.websocket.send_text(text)

    async def close(self, code: int, reason: str, *, timeout: float = 5.0) -> None:
        if self.closed:
            return
        self.closed = True
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.websocket.close(code=code, reason=reason), timeout)


def _with_context(text: str, caller: Caller) -> Any:
    """The request to hand the control server: parsed, with the context it runs with (the caller's)."""
    try:
        raw = json.loads(text)
    except ValueError:
        return text  # the control server answers REQUEST_REJECTED
    if isinstance(raw, dict) and raw.get("operation") in _CONTEXT_OPERATIONS:
        raw["context"] = caller.run_context(raw.get("context"))
    return raw


async def control_socket(websocket: WebSocket) -> None:
    state = server_state(websocket.app)
    caller = await identify(state.settings.authenticate, websocket, allow_query=True)
    if caller is None:
        await websocket.close(code=1008)  # before accept: the client sees HTTP 403
        return
    await websocket.accept()
    socket = _Socket(websocket)
    in_flight: set[asyncio.Task[None]] = set()
    closing: list[asyncio.Future[None]] = []
    limit = state.settings.max_pending_requests

    async def deliver(batch: Any) -> None:
        # the batch's text is encoded once for every socket it goes to; a frame is written whole by the
        # server, so a delivery needs no lock against a response (only the close must come last)
        if socket.closed:
            raise ConnectionError("the socket is closed")
        await websocket.send({"type": "websocket.send", "text": batch.json_text()})

    async def answer(raw: Any) -> None:
        response = await connection.request(raw)
        with contextlib.suppress(Exception):
            await socket.send(_response_frame(response))

    async def receive() -> None:
        while True:
            message = await websocket.receive()
            if message["type"] == "websocket.disconnect":
                return
            text = message.get("text")
            if text is None:
                text = (message.get("bytes") or b"").decode("utf-8", errors="replace")
            if len(text) > state.settings.max_body_bytes:
                await socket.send(
                    _response_frame(control_error("unknown", "REQUEST_REJECTED", "a message is too large"))
                )
                continue
            raw = _with_context(text, caller)
            if len(in_flight) >= limit:
                request_id = raw.get("request_id") if isinstance(raw, dict) else None
                refused = control_error(
                    request_id if isinstance(request_id, str) and request_id else "unknown",
                    "REQUEST_CAPACITY",
                    f"{limit} requests of this connection are in flight; wait for their responses",
                )
                await socket.send(_response_frame(refused))
                continue
            task = asyncio.ensure_future(answer(raw))
            in_flight.add(task)
            task.add_done_callback(in_flight.discard)

    receiving = asyncio.ensure_future(receive())

    async def resync() -> None:
        # a peer that reads nothing more may never take the close frame: stop serving it after a bound
        await socket.close(RESYNC_CLOSE_CODE, "resync-required", timeout=RESYNC_CLOSE_TIMEOUT)
        receiving.cancel()

    def on_overflow(delivery: Any) -> None:
        # called while a send may be blocked: never write a frame here, close the transport instead
        closing.append(asyncio.ensure_future(resync()))

    try:
        connection = state.control.connect(id=f"ws-{uuid.uuid4().hex}", deliver_batch=deliver, on_overflow=on_overflow)
    except Exception:  # the control server closed: the app is shutting down
        receiving.cancel()
        await socket.close(1001, "shutting down")
        return
    try:
        await asyncio.wait({receiving})
        if not receiving.cancelled() and receiving.exception() is not None:
            error = receiving.exception()
            if not isinstance(error, WebSocketDisconnect | ConnectionError | RuntimeError):
                _log.warning("the control socket failed", exc_info=error)
    finally:
        receiving.cancel()
        connection.close()
        for task in in_flight:
            task.cancel()
        if websocket.client_state == WebSocketState.CONNECTED and not socket.closed:
            await socket.close(1000, "bye")


def routes() -> list[WebSocketRoute]:
    return [WebSocketRoute("/control", control_socket)]
