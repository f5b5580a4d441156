"""The web inspector: a page served at ``/`` by :func:`threadline.server.create_agent_harness_app`.

Plain HTML, CSS and JavaScript shipped as package data in this folder (no build step): ``index.html``,
``app.js`` (the page), ``reducer.js`` (the control-view rules of :mod:`threadline.delivery` in JavaScript)
and ``style.css``. ``/inspector/constants.js`` is generated from the Python constants the rules use (run
states, terminal reasons, durable event types, input policies), so the two sides cannot drift apart.

The page lists conversations (``GET /conversations``), and shows one live over the control WebSocket
(``/control``): it attaches with the controller lease (an observer when another controller holds it),
renders the snapshot, applies events, asks for a fresh snapshot on a transient gap, and reconnects after
a ``resync-required`` close. Its composer submits with ``input_metadata.policy`` set from the policy
selector (``threadline serve`` admits with that policy); interrupt and approve/deny go over the same socket.
Its ledger timeline reads ``GET /conversations/{id}/ledger`` (served here too).
A token given to the page as ``?access_token=`` is sent as the bearer token.
"""

from __future__ import annotations

import json
from importlib import resources
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ...delivery import REASONING_SEPARATOR
from ...errors import AgentStoreCapabilityError, ThreadlineError
from ...events import DURABLE_EVENT_TYPES
from ...records import ACTIVE_RUN_STATES, INPUT_POLICIES, RUN_STATE_FOR_REASON
from ..auth import identify
from ..conversations import threadline_error
from ..responses import error_response, unauthorized
from ..state import server_state

LEDGER_PAGE = 200
"""Ledger events one ``GET /conversations/{id}/ledger`` returns at most."""

_FILES = {
    "app.js": "text/javascript; charset=utf-8",
    "reducer.js": "text/javascript; charset=utf-8",
    "style.css": "text/css; charset=utf-8",
}
_HEADERS = {"cache-control": "no-cache", "x-content-type-options": "nosniff"}


def _read(name: str) -> bytes:
    return resources.files(__package__).joinpath(name).read_bytes()


def constants_script() -> str:
    """The constants the page's rules need, as a script defining ``window.ThreadlineConstants``."""
    constants = {
        "active_run_states": sorted(ACTIVE_RUN_STATES),
        "durable_event_types": sorted(DURABLE_EVENT_TYPES),
        "input_policies": list(INPUT_POLICIES),
        "reasoning_separator": REASONING_SEPARATOR,
        "run_state_for_reason": RUN_STATE_FOR_REASON,
    }
    return f'"use strict";\nwindow.ThreadlineConstants = Object.freeze({json.dumps(constants, sort_keys=True)});\n'


def _summary(payload: Any) -> str:
    """What a ledger event's payload is about, in a few words (its command, run and version): the page shows
    a timeline, not the payloads."""
    if not isinstance(payload, dict):
        return ""
    words = [str(payload["type"])] if isinstance(payload.get("type"), str) else []
    given = payload.get("input")
    run_id = given.get("run_id") if isinstance(given, dict) else None
    if isinstance(run_id, str):
        words.append(f"run {run_id}")
    if isinstance(payload.get("version"), int):
        words.append(f"version {payload['version']}")
    return " · ".join(words)


async def ledger(request: Request) -> Response:
    """``GET /conversations/{id}/ledger?from_seq=&limit=``: one page of the conversation's event ledger as
    a timeline (``seq``, ``kind``, ``occurred_at``, a short ``summary``), ``next_seq`` when more remain.
    501 ``LEDGER_UNAVAILABLE`` when the store keeps no ledger."""
    state = server_state(request.app)
    if await identify(state.settings.authenticate, request) is None:
        return unauthorized()
    raw_from, raw_limit = request.query_params.get("from_seq", "1"), request.query_params.get("limit", "100")
    if not raw_from.isdigit() or int(raw_from) < 1:
        return error_response(422, "REQUEST_REJECTED", "from_seq is an integer of at least 1", field="from_seq")
    if not raw_limit.isdigit() or not 1 <= int(raw_limit) <= LEDGER_PAGE:
        return error_response(422, "REQUEST_REJECTED", f"limit is an integer from 1 to {LEDGER_PAGE}", field="limit")
    try:
        page = await state.harness.store.read_events(
            conversation_id=request.path_params["conversation_id"], from_seq=int(raw_from), limit=int(raw_limit)
        )
    except AgentStoreCapabilityError as error:
        return error_response(501, "LEDGER_UNAVAILABLE", str(error))
    except ThreadlineError as error:
        return threadline_error(error)
    items = [
        {"seq": e.seq, "kind": e.kind, "occurred_at": e.occurred_at.isoformat(), "summary": _summary(e.payload)}
        for e in page.items
    ]
    return JSONResponse({"items": items, "next_seq": page.next_seq})


def routes() -> list[Route]:
    """``/`` (the page) and ``/inspector/<file>``. The files are read once, when the routes are built."""
    page = _read("index.html")
    files = {name: (_read(name), media) for name, media in _FILES.items()}
    files["constants.js"] = (constants_script().encode(), "text/javascript; charset=utf-8")

    async def index(request: Request) -> Response:
        # the page holds no data: conversations are read with the caller's token by the page itself
        return Response(page, media_type="text/html; charset=utf-8", headers=_HEADERS)

    async def asset(request: Request) -> Response:
        found = files.get(request.path_params["name"])
        if found is None:
            return Response("not found", status_code=404, media_type="text/plain")
        body, media = found
        return Response(body, media_type=media, headers=_HEADERS)

    return [
        Route("/", index, methods=["GET"]),
        Route("/inspector/{name}", asset, methods=["GET"]),
        Route("/conversations/{conversation_id}/ledger", ledger, methods=["GET"]),
    ]
