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
A token given to the page as ``?access_token=`` is sent as the bearer token.
"""

from __future__ import annotations

import json
from importlib import resources

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from ...delivery import REASONING_SEPARATOR
from ...events import DURABLE_EVENT_TYPES
from ...records import ACTIVE_RUN_STATES, INPUT_POLICIES, RUN_STATE_FOR_REASON

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

    return [Route("/", index, methods=["GET"]), Route("/inspector/{name}", asset, methods=["GET"])]
