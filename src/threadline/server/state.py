"""What every route of the app shares: the harness, its control server and the settings
(``request.app.state.threadline``). Its own module so routes and the app factory import it, not each other."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..errors import AgentConfigError
from ..harness import AgentHarnessControlServer, HeadlessAgentHarness
from ..store.aggregate import AgentConversationReader
from .auth import Authenticate


@dataclass(frozen=True)
class AgentServerSettings:
    """What the routes share. Every bound has a default."""

    authenticate: Authenticate | None = None
    """See :mod:`threadline.server.auth`."""
    cors_origins: tuple[str, ...] = ()
    """Origins allowed to call from a browser (``("*",)`` for any; credentials are then not allowed)."""
    max_pending_requests: int = 32
    """Requests one WebSocket may have in flight; beyond it they answer ``REQUEST_CAPACITY``."""
    max_body_bytes: int = 1_048_576
    """The largest request body or WebSocket message read."""
    keepalive: float = 15.0
    """Seconds of silence after which an SSE stream sends a comment (proxies drop idle streams)."""
    chat_path: str = "/api/chat"
    """Where the Vercel AI SDK UI message stream endpoint listens (``useChat``'s default)."""

    def __post_init__(self) -> None:
        for name in ("max_pending_requests", "max_body_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise AgentConfigError(f"{name} is a positive integer, got {value!r}", field=name)
        if not (isinstance(self.keepalive, int | float) and self.keepalive > 0):
            raise AgentConfigError(
                f"keepalive is a positive number of seconds, got {self.keepalive!r}", field="keepalive"
            )
        if not self.chat_path.startswith("/"):
            raise AgentConfigError(f"chat_path starts with '/', got {self.chat_path!r}", field="chat_path")


@dataclass
class ServerState:
    harness: HeadlessAgentHarness
    control: AgentHarnessControlServer
    settings: AgentServerSettings
    conversations: AgentConversationReader = field(init=False)

    def __post_init__(self) -> None:
        self.conversations = AgentConversationReader(self.harness.store)


def server_state(app: Any) -> ServerState:
    return app.state.threadline
