"""Human approval of tool calls, derived from canonical history (no in-memory registry).

A call that needs approval is not executed: the run stores an ``approval-request`` part (signed with
HMAC-SHA256 over the exact call id, tool name and input) on its assistant and ends ``provider_stop``.
``respond_to_approval`` writes one ``tool`` message with the ``approval-response`` and queues a
successor run; that run re-verifies the signature, the call and the input before the original tool runs
behind its fence (or records the denial), then lets the model continue. Everything lives in the store,
so pending approvals survive a restart or a reopened SQLite file.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from .errors import ThreadlineError
from .records import ApprovalRequestPart, ApprovalResponsePart, Message


class AgentApprovalError(ThreadlineError):
    """An approval response was refused: ``reason`` is ``unknown``, ``duplicate`` or ``mismatch``."""

    def __init__(self, message: str, *, reason: str, approval_id: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.approval_id = approval_id


class AgentApprovalInvalidError(ThreadlineError):
    """A queued approval response does not match a valid signed request (private diagnostic: the run
    fails ``runtime_failure``; nothing is executed)."""


def _key(secret: str | bytes) -> bytes:
    return secret.encode() if isinstance(secret, str) else secret


def _canonical(call_id: str, tool_name: str, input: Any) -> bytes:
    return json.dumps([call_id, tool_name, input], sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def sign_tool_call(secret: str | bytes, call_id: str, tool_name: str, input: Any) -> str:
    """The HMAC-SHA256 signature of exactly this call (id, tool name and JSON input)."""
    return hmac.new(_key(secret), _canonical(call_id, tool_name, input), hashlib.sha256).hexdigest()


def verify_tool_call(secret: str | bytes, request: ApprovalRequestPart) -> bool:
    if not request.signature:
        return False
    expected = sign_tool_call(secret, request.call_id, request.tool_name, request.input)
    return hmac.compare_digest(expected, request.signature)


@dataclass(frozen=True)
class AgentPendingApproval:
    """An approval request nobody answered yet."""

    approval_id: str
    call_id: str
    tool_name: str
    input: Any
    run_id: str | None
    message_id: str
    signature: str | None = None
    """The request's signature as stored (``None`` for a request recorded without one): the successor run
    re-verifies it before the tool runs."""


def approval_state(
    messages: Iterable[Message],
) -> tuple[dict[str, tuple[ApprovalRequestPart, Message]], dict[str, ApprovalResponsePart]]:
    """Every approval request (with its assistant message) and every response, by approval id."""
    requests: dict[str, tuple[ApprovalRequestPart, Message]] = {}
    responses: dict[str, ApprovalResponsePart] = {}
    for message in messages:
        for part in message.parts:
            if part.type == "approval-request" and message.role == "assistant":
                requests.setdefault(part.approval_id, (part, message))
            elif part.type == "approval-response" and message.role == "tool":
                responses.setdefault(part.approval_id, part)
    return requests, responses


def pending_approvals(messages: Iterable[Message]) -> list[AgentPendingApproval]:
    requests, responses = approval_state(messages)
    return [
        AgentPendingApproval(req.approval_id, req.call_id, req.tool_name, req.input, msg.run_id, msg.id, req.signature)
        for approval_id, (req, msg) in requests.items()
        if approval_id not in responses
    ]
