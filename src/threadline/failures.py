"""Why a run failed, in words safe to store: the :class:`~threadline.records.AgentRunFailure` of a terminal.

A failure is described from the exception that caused it and where it happened, never from its text alone:
the exception's qualified type name, the HTTP status when a provider answered with one, and a summary cut to
:data:`~threadline.records.FAILURE_SUMMARY_MAX` characters. The summary of a provider error is the
provider's own error message (``body["error"]["message"]``), never the body itself: an error body can echo
the request. Credentials that slip into any text (``Bearer …``, ``api_key=…``, ``sk-…`` keys, a password in
a URL) are masked. The full cause, traceback included, goes only to the log (``threadline.runtime``) and to
the operator ``run-terminal`` event of a sink that opts in.
"""

from __future__ import annotations

import re
from typing import Any

from .errors import AgentStoreError
from .records import FAILURE_SUMMARY_MAX, AgentRunFailure, FailureOrigin

__all__ = ("FAILURE_REASONS", "describe_run_failure", "safe_summary")

ORIGIN_FOR_REASON: dict[str, FailureOrigin] = {
    "provider_failure": "provider",
    "timeout": "provider",
    "storage_conflict": "storage",
    "runtime_failure": "runtime",
    "context_overflow": "runtime",
    "output_rejected": "policy",
}
FAILURE_REASONS = frozenset(ORIGIN_FOR_REASON)
"""Terminal reasons that are failures: a run ending with one carries ``failure``."""

_SCAN_MAX = 4 * FAILURE_SUMMARY_MAX  # what is read of a text at all: the patterns below run on bounded input
_SECRETS = (
    (re.compile(r"(\w+://)[^\s/@:]+:[^\s/@]+@"), r"\1***@"),  # user:password@ in a URL
    (re.compile(r"(?i)\bbearer\s+[\w.~+/=-]+"), "Bearer ***"),
    (
        re.compile(
            r"(?i)\b(api[_-]?key|x-api-key|authorization|access[_-]?token|refresh[_-]?token|token|secret|"
            r"client[_-]?secret|password|passwd|pwd)(\W{0,3}?[:=]\s*['\"]?)[^\s'\",;&}]+"
        ),
        r"\1\2***",
    ),
    (re.compile(r"\b(sk|pk|rk)-[\w-]{8,}"), r"\1-***"),  # OpenAI / Anthropic / Stripe style keys
    (re.compile(r"\bAIza[\w-]{20,}"), "AIza***"),  # Google API keys
    (re.compile(r"\b(gh[pousr]|xox[abprs])[-_][\w-]{8,}"), r"\1-***"),  # GitHub, Slack tokens
)


def safe_summary(text: str) -> str:
    """``text`` on one line, credentials masked, cut to :data:`FAILURE_SUMMARY_MAX` characters."""
    text = " ".join(text[:_SCAN_MAX].split())
    for pattern, replacement in _SECRETS:
        text = pattern.sub(replacement, text)
    if len(text) > FAILURE_SUMMARY_MAX:
        text = text[: FAILURE_SUMMARY_MAX - 1] + "…"
    return text


def _provider_message(body: Any) -> str | None:
    """The provider's error message inside an error body (``{"error": {"message": ...}}`` or
    ``{"message": ...}``), or None: the rest of a body is never kept."""
    if not isinstance(body, dict):
        return None
    error = body.get("error")
    if isinstance(error, dict) and isinstance(error.get("message"), str):
        return error["message"]
    if isinstance(error, str):
        return error
    message = body.get("message")
    return message if isinstance(message, str) else None


def _summary(cause: BaseException, status: int | None) -> str:
    model = getattr(cause, "model_name", None)
    if status is not None:  # pydantic-ai's ModelHTTPError: its str() is the whole body
        said = _provider_message(getattr(cause, "body", None))
        head = f"HTTP {status}" + (f" from {model}" if isinstance(model, str) and model else "")
        return f"{head}: {said}" if said else head
    message = getattr(cause, "message", None)  # pydantic-ai errors keep the message apart from any body
    text = message if isinstance(message, str) else str(cause)
    if isinstance(cause, TimeoutError) and not text:
        return "no event from the provider within loop.idle_timeout"
    return text or type(cause).__name__


def describe_run_failure(
    reason: str, cause: BaseException | None, origin: FailureOrigin | None = None, summary: str | None = None
) -> AgentRunFailure:
    """The failure record of a run ending ``reason`` because of ``cause`` (None when nothing raised: say
    why in ``summary``). ``origin`` defaults by the reason; a store error is always ``storage``."""
    if isinstance(cause, AgentStoreError):
        origin = "storage"
    origin = origin or ORIGIN_FOR_REASON.get(reason, "runtime")
    if cause is None:
        return AgentRunFailure(origin=origin, summary=safe_summary(summary or reason))
    kind = type(cause)
    status = getattr(cause, "status_code", None)
    status = status if type(status) is int and 100 <= status <= 599 else None
    return AgentRunFailure(
        origin=origin,
        exception_type=f"{kind.__module__}.{kind.__qualname__}",
        status_code=status,
        summary=safe_summary(summary or _summary(cause, status)),
    )
