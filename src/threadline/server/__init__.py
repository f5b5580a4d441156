"""``threadline serve``'s HTTP side: a Starlette app over a headless harness (``pip install 'threadline[server]'``).

:func:`create_agent_harness_app` builds it: the control protocol over a WebSocket (``/control``), one SSE
stream per conversation with ``Last-Event-ID`` resume (``/conversations/{id}/events``), an endpoint that
speaks the Vercel AI SDK UI message stream (``/api/chat``, what ``useChat`` calls), a small REST surface for
conversations, and health and readiness probes. Authentication is a hook receiving the bearer token.

Importing this package needs Starlette; ``import threadline`` never imports it.
"""

from __future__ import annotations

try:
    import starlette  # noqa: F401
except ImportError as _missing:  # pragma: no cover - exercised by the import-guard test in a bare venv
    raise ImportError("threadline.server needs Starlette and uvicorn: pip install 'threadline[server]'") from _missing

from .app import (
    AgentServerSettings as AgentServerSettings,
    create_agent_harness_app as create_agent_harness_app,
)
from .auth import (
    Authenticate as Authenticate,
    static_bearer_token as static_bearer_token,
)

__all__ = ("AgentServerSettings", "Authenticate", "create_agent_harness_app", "static_bearer_token")
