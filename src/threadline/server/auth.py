"""Authentication: a hook that receives the caller's bearer token and returns the caller's run context.

``authenticate(token)`` (sync or async) gets the token of ``Authorization: Bearer <token>`` — or, for the
WebSocket and SSE routes, whose browser APIs cannot set headers, the ``access_token`` query parameter — or
None when there is none. It returns the context every run this caller submits carries (the protocol's
context model validates it), or None to refuse (401). With a hook configured, a context in the request body
is ignored: the server never lets a caller choose its own identity. Without a hook every caller is
accepted and the body's ``context`` is used: for a server on loopback only.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from starlette.requests import HTTPConnection

from ..coordinator import call_maybe_async

_log = logging.getLogger("threadline.server")

Authenticate = Callable[[str | None], "Any | Awaitable[Any]"]
"""``authenticate(token) -> context | None`` (see the module docstring)."""


@dataclass(frozen=True)
class Caller:
    """Who is calling: ``authenticated`` callers carry the context the hook returned."""

    authenticated: bool
    context: Any = None

    def run_context(self, from_body: Any) -> Any:
        """The context a submission runs with: the hook's; without a hook what the body carried, ``{}`` when
        it carried none (the protocol's context model fills its defaults)."""
        if self.authenticated:
            return self.context
        return {} if from_body is None else from_body


def bearer_token(connection: HTTPConnection, *, allow_query: bool) -> str | None:
    header = connection.headers.get("authorization")
    if header is not None:
        scheme, _, value = header.partition(" ")
        if scheme.lower() == "bearer" and value.strip():
            return value.strip()
        return None
    if allow_query:
        return connection.query_params.get("access_token") or None
    return None


async def identify(
    authenticate: Authenticate | None, connection: HTTPConnection, *, allow_query: bool = False
) -> Caller | None:
    """The caller, or None when the hook refused (or failed: logged, and refused)."""
    if authenticate is None:
        return Caller(authenticated=False)
    token = bearer_token(connection, allow_query=allow_query)
    try:
        context = await call_maybe_async(authenticate, token)
    except Exception:
        _log.warning("the authenticate hook failed; the caller is refused", exc_info=True)
        return None
    if context is None:
        return None
    return Caller(authenticated=True, context=context)


def static_bearer_token(token: str, context: Any = None) -> Authenticate:
    """A hook accepting exactly ``token`` (compared in constant time) and giving its callers ``context``
    (``{}`` when None). What ``threadline serve --token`` uses."""
    if not isinstance(token, str) or not token:
        raise ValueError("a bearer token is a non-empty string")
    expected = token.encode()
    granted = {} if context is None else context

    def authenticate(presented: str | None) -> Any:
        if presented is not None and hmac.compare_digest(presented.encode(), expected):
            return granted
        return None

    return authenticate
