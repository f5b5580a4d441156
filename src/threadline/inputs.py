"""What an admitted input may carry: checked before anything is written.

``parts`` is a list of parts — records (``TextPart(text=...)``) or dicts (``{"type": "text", "text": ...}``)
— and a plain ``str`` stands for one text part: ``parts="hello"`` is ``parts=[{"type": "text", "text":
"hello"}]``, and so is a ``str`` inside the list. A part of a type an input cannot carry is refused naming
the types it can. An input larger than ``runs.max_input_bytes`` (its parts and metadata as stored JSON) is
refused too.

A user input must give the model something to read: a text part with more than whitespace, or a file. Parts
only the runtime writes are refused by name: ``input-joined`` markers, and approval responses (those are
written by ``respond_to_approval``, never by ``submit``). An ``approval-request`` part is accepted only with a
signature this runtime's ``loop.tool_approval_secret`` made, so an input cannot forge a request a later
response would then execute.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import ValidationError

from .approvals import verify_tool_call
from .errors import AgentRecordValidationError
from .records import PARTS_ADAPTER, Part, TextPart, validate_parts

RECEIVABLE = ("text", "file")
"""Part types a model can receive in a user input (text only when it is not blank)."""
INPUT_PART_TYPES = ("text", "file", "source")
"""Part types an input may carry (``approval-request`` and ``approval-response`` are the runtime's own)."""
_KNOWN = frozenset({*INPUT_PART_TYPES, "approval-request", "approval-response", "input-joined"})
_SPELLING = "{'type': 'text', 'text': '...'} or {'type': 'file', 'reference': '...', 'media_type': '...'}"


def input_parts(parts: Any) -> list[Part]:
    """``parts`` as part records (a ``str`` is one text part, in the list or instead of it). Refuses, with an
    :class:`AgentRecordValidationError` naming the part, anything that is not a part an input may carry."""
    if isinstance(parts, str):
        return [TextPart(text=parts)]
    if isinstance(parts, Mapping) or not isinstance(parts, Sequence):
        raise AgentRecordValidationError(
            f"parts is a list of parts such as [{_SPELLING}] (or one str: its text), got {type(parts).__name__}",
            field="parts",
        )
    values = [TextPart(text=p) if isinstance(p, str) else p for p in parts]
    try:
        return validate_parts(values)
    except ValidationError:
        pass
    for index, value in enumerate(values):  # name the first part that is wrong, and how
        where = f"parts[{index}]"
        kind = value.get("type") if isinstance(value, Mapping) else getattr(value, "type", None)
        if kind not in _KNOWN:
            shown = f"type {kind!r}" if kind is not None else f"a {type(value).__name__} without a type"
            raise AgentRecordValidationError(
                f"{where} is {shown}; an input carries parts of type {', '.join(map(repr, INPUT_PART_TYPES))}, "
                f"e.g. {_SPELLING}",
                field=where,
            )
        try:
            PARTS_ADAPTER.validate_python([value])
        except ValidationError as error:
            first = error.errors()[0]
            inner = ".".join(str(p) for p in first["loc"][2:])  # past the list index and the type tag
            field = f"{where}.{inner}" if inner else where
            raise AgentRecordValidationError(f"{field}: {first['msg']} (a {kind!r} part)", field=field) from None
    raise AssertionError("unreachable: the list failed validation but no part did")


def check_input_size(parts: Sequence[Part], metadata: Any, limit: int) -> None:
    """Refuse an input whose parts and metadata take more than ``limit`` bytes of stored JSON. Text is
    bounded by its length first (a character is at most six bytes of JSON), so an ordinary input is never
    encoded here; only one near the limit is measured exactly."""
    extra = len(json.dumps(metadata, ensure_ascii=False, default=str).encode()) if metadata else 2
    bound = extra
    for part in parts:
        if type(part) is TextPart:
            bound += 6 * len(part.text) + 64
        else:
            bound += len(PARTS_ADAPTER.dump_json([part]))
    if bound <= limit:
        return
    size = len(PARTS_ADAPTER.dump_json(list(parts))) + extra
    if size > limit:
        raise AgentRecordValidationError(
            f"the input is {size} bytes of JSON; runs.max_input_bytes allows {limit}: send large content as a "
            "file part (a reference your application resolves), or raise runs.max_input_bytes",
            field="parts",
        )


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
