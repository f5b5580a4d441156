"""What an admitted input may carry: checked before anything is written.

A user input must give the model something to read: a text part with more than whitespace, or a file. Parts
only the runtime writes are refused by name: ``input-joined`` markers, and approval responses (those are
written by ``respond_to_approval``, never by ``submit``). An ``approval-request`` part is accepted only with a
signature this runtime's ``loop.tool_approval_secret`` made, so an input cannot forge a request a later
response would then execute.
"""

from __future__ import annotations

from collections.abc import Sequence

from .approvals import verify_tool_call
from .errors import AgentRecordValidationError
from .records import Part

RECEIVABLE = ("text", "file")
"""Part types a model can receive in a user input (text only when it is not blank)."""


def check_input_parts(parts: Sequence[Part], role: str, approval_secret: str | bytes | None) -> None:
    """Refuse, with an :class:`AgentRecordValidationError` naming the part, an input no model could answer or
    one carrying parts only the runtime writes. Nothing has been written when it raises."""
    for index, part in enumerate(parts):
        where = f"parts[{index}]"
        if part.type == "input-joined":
            raise AgentRecordValidationError(
                f"{where}: 'input-joined' parts are written by the runtime, not submitted", field=where
            )
        if part.type == "approval-response" and role != "tool":
            raise AgentRecordValidationError(
                f"{where}: an approval response is written by runtime.respond_to_approval(...), not submitted",
                field=where,
            )
        if part.type == "approval-request" and (approval_secret is None or not verify_tool_call(approval_secret, part)):
            raise AgentRecordValidationError(
                f"{where}: this approval request carries no signature this runtime made "
                "(loop.tool_approval_secret); inputs cannot carry approval requests of their own",
                field=where,
            )
    if role != "user":
        return
    if not any(p.type == "file" or (p.type == "text" and p.text.strip()) for p in parts):
        kinds = [f"{p.type} (blank)" if p.type == "text" else p.type for p in parts] or ["nothing"]
        raise AgentRecordValidationError(
            f"parts: the input holds nothing a model can receive ({', '.join(kinds)}); "
            "send a text part with some text, or a file",
            field="parts",
        )
