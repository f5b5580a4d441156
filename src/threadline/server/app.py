"""``create_agent_harness_app``: the Starlette application over one harness.

Routes live in small modules (``probes``, ``conversations``, ``control_socket``, ``sse``, ``vercel``) and
reach the harness through :class:`~threadline.server.state.ServerState` (``request.app.state.threadline``).
More routes (a static page, say) are added with ``routes=``; events reach every route through the harness's
event hub, the one seam a cross-process relay would feed too.

The app never closes the harness: whoever created the harness closes it (``threadline serve`` does after
the server stopped). On shutdown the app closes the control server it created, which detaches every client.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Sequence

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.routing import BaseRoute

from ..errors import AgentConfigError
from ..harness import AgentHarnessControlServer, HeadlessAgentHarness, create_agent_harness_control_server
from .auth import Authenticate
from .state import AgentServerSettings as AgentServerSettings, ServerState


def create_agent_harness_app(
    harness: HeadlessAgentHarness,
    *,
    authenticate: Authenticate | None = None,
    cors_origins: Sequence[str] = (),
    settings: AgentServerSettings | None = None,
    control: AgentHarnessControlServer | None = None,
    max_pending_attachments: int = 32,
    max_pending_events: int = 128,
    routes: Sequence[BaseRoute] = (),
    inspector: bool = True,
) -> Starlette:
    """The ASGI app serving ``harness``. ``authenticate`` and ``cors_origins`` are shortcuts for the same
    fields of ``settings``. A ``control`` server may be shared with other transports; otherwise one is
    created with ``max_pending_attachments`` and ``max_pending_events`` and closed when the app shuts down.
    ``routes`` are added after the built-in ones. ``inspector`` serves the web inspector at ``/``
    (:mod:`threadline.server.inspector`). Build it inside the running event loop that serves it."""
    from . import control_socket, conversations, probes, sse, vercel
    from .inspector import routes as inspector_routes

    if settings is None:
        settings = AgentServerSettings(authenticate=authenticate, cors_origins=tuple(cors_origins))
    elif authenticate is not None or cors_origins:
        raise AgentConfigError("pass authenticate and cors_origins inside settings, or without it", field="settings")
    owned = control is None
    if control is None:
        control = create_agent_harness_control_server(
            harness, max_pending_attachments=max_pending_attachments, max_pending_events=max_pending_events
        )
    state = ServerState(harness=harness, control=control, settings=settings)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        try:
            yield
        finally:
            if owned:
                control.close()

    middleware = []
    if settings.cors_origins:
        middleware.append(
            Middleware(
                CORSMiddleware,
                allow_origins=list(settings.cors_origins),
                allow_methods=["GET", "POST", "OPTIONS"],
                allow_headers=["authorization", "content-type", "last-event-id"],
                expose_headers=["x-vercel-ai-ui-message-stream"],
                allow_credentials="*" not in settings.cors_origins,
            )
        )
    app = Starlette(
        routes=[
            *probes.routes(),
            *conversations.routes(),
            *control_socket.routes(),
            *sse.routes(),
            *vercel.routes(settings.chat_path),
            *(inspector_routes() if inspector else ()),
            *routes,
        ],
        middleware=middleware,
        lifespan=lifespan,
    )
    app.state.threadline = state
    return app
