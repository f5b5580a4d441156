"""The control protocol's wire records: correlated requests, their responses, and deliveries.

Every record is JSON with snake_case fields (like threadline's events) and ``schema_version`` 1.

Requests (discriminated on ``operation``): ``attach`` (``access`` ``observe`` or ``control``), ``detach``,
``snapshot``, ``submit``, ``interrupt``, ``respond-approval``. A response echoes ``request_id`` with
``outcome`` ``ok`` (and the conversation's ``snapshot``, plus ``run_id`` for ``submit`` and
``respond-approval``) or ``error`` with one of :data:`AGENT_CONTROL_ERROR_CODES`. Deliveries (discriminated
on ``type``): ``event`` carries one delivery event of an attached conversation; ``resync-required`` says the
connection fell too far behind and was detached.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, TypeAdapter, ValidationError

from ..events import AgentRuntimeEvent
from ..records import ConversationSnapshot, Part

AgentControlErrorCode = Literal[
    "ATTACH_IN_PROGRESS",
    "ATTACHMENT_CAPACITY",
    "CONNECTION_CLOSED",
    "FORBIDDEN",
    "LEASE_CONFLICT",
    "LEASE_REQUIRED",
    "NOT_ATTACHED",
    "REQUEST_CAPACITY",
    "REQUEST_REJECTED",
]
"""``ATTACH_IN_PROGRESS``: this connection's attach of the conversation has not settled yet.
``ATTACHMENT_CAPACITY``: too many attach snapshots are being read on this server (``max_pending_attachments``).
``CONNECTION_CLOSED``: the connection was closed (by its transport, an overflow, or the server closing).
``FORBIDDEN``: the transport's authentication refused the caller.
``LEASE_CONFLICT``: another connection holds the conversation's controller lease.
``LEASE_REQUIRED``: the operation needs this connection's controller lease (attach with ``control``).
``NOT_ATTACHED``: attach the conversation first.
``REQUEST_CAPACITY``: too many requests of this transport connection are in flight.
``REQUEST_REJECTED``: the request is malformed or the operation failed (the message says why)."""

AGENT_CONTROL_ERROR_CODES: tuple[str, ...] = AgentControlErrorCode.__args__  # type: ignore[attr-defined]


class _Wire(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    schema_version: Literal[1] = 1


class _Request(_Wire):
    request_id: str = Field(min_length=1)
    conversation_id: str = Field(min_length=1)


class AttachRequest(_Request):
    """Receive the conversation's events from now on and get its snapshot. ``control`` also takes the
    conversation's one controller lease (needed by ``submit``, ``interrupt`` and ``respond-approval``)."""

    operation: Literal["attach"] = "attach"
    access: Literal["observe", "control"]


class DetachRequest(_Request):
    """Stop receiving the conversation's events; a held lease is released."""

    operation: Literal["detach"] = "detach"


class SnapshotRequest(_Request):
    """The conversation's canonical snapshot (after a ``resync-required`` or a gap)."""

    operation: Literal["snapshot"] = "snapshot"


class SubmitRequest(_Request):
    """Admit one input (the runtime's ``submit``); the response carries the run id once it is durable."""

    operation: Literal["submit"] = "submit"
    idempotency_key: str = Field(min_length=1)
    context: Any = None
    parts: tuple[Part, ...] = Field(min_length=1)
    input_metadata: Any = None


class InterruptRequest(_Request):
    """Durably interrupt one run."""

    operation: Literal["interrupt"] = "interrupt"
    run_id: str = Field(min_length=1)


class RespondApprovalRequest(_Request):
    """Answer one pending approval; the response carries the run that continues."""

    operation: Literal["respond-approval"] = "respond-approval"
    approval_id: str = Field(min_length=1)
    approved: bool
    reason: str | None = Field(default=None, min_length=1)
    context: Any = None


AgentControlRequest = Annotated[
    AttachRequest | DetachRequest | SnapshotRequest | SubmitRequest | InterruptRequest | RespondApprovalRequest,
    Field(discriminator="operation"),
]
AGENT_CONTROL_REQUEST_ADAPTER: TypeAdapter[AgentControlRequest] = TypeAdapter(AgentControlRequest)


class AgentControlError(BaseModel):
    """Why a request failed. ``field`` names the request field at fault, when one is."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    code: AgentControlErrorCode
    message: str = Field(min_length=1)
    field: str | None = None


class AgentControlOkResponse(_Wire):
    request_id: str = Field(min_length=1)
    outcome: Literal["ok"] = "ok"
    snapshot: ConversationSnapshot | None = None
    run_id: str | None = None


class AgentControlErrorResponse(_Wire):
    request_id: str = Field(min_length=1)
    outcome: Literal["error"] = "error"
    error: AgentControlError


AgentControlResponse = Annotated[AgentControlOkResponse | AgentControlErrorResponse, Field(discriminator="outcome")]
AGENT_CONTROL_RESPONSE_ADAPTER: TypeAdapter[AgentControlResponse] = TypeAdapter(AgentControlResponse)


class AgentControlEventDelivery(_Wire):
    """One delivery event of an attached conversation. One instance is shared by every connection the
    event goes to, so a transport encodes it once (:meth:`json_text`)."""

    type: Literal["event"] = "event"
    event: AgentRuntimeEvent
    _event_json: str | None = PrivateAttr(default=None)
    _json: str | None = PrivateAttr(default=None)

    # the cache is read from ``__pydantic_private__`` directly: a private attribute read through pydantic's
    # ``__getattr__`` costs more than the rest of a delivery to one viewer

    def event_json(self) -> str:
        """The event as JSON text, encoded once for every connection."""
        private = self.__pydantic_private__
        text = private.get("_event_json")  # type: ignore[union-attr]
        if text is None:
            text = private["_event_json"] = self.event.model_dump_json()  # type: ignore[index]
        return text  # type: ignore[no-any-return]

    def json_text(self) -> str:
        """This delivery as JSON text, encoded once for every connection."""
        private = self.__pydantic_private__
        text = private.get("_json")  # type: ignore[union-attr]
        if text is None:
            text = private["_json"] = '{"schema_version":1,"type":"event","event":' + self.event_json() + "}"  # type: ignore[index]
        return text  # type: ignore[no-any-return]


class AgentControlResyncDelivery(_Wire):
    """The connection fell ``max_pending_events`` behind and was detached: reconnect, attach again and
    render the fresh snapshot."""

    type: Literal["resync-required"] = "resync-required"
    conversation_id: str = Field(min_length=1)
    reason: Literal["overflow"] = "overflow"


AgentControlDelivery = Annotated[AgentControlEventDelivery | AgentControlResyncDelivery, Field(discriminator="type")]
AGENT_CONTROL_DELIVERY_ADAPTER: TypeAdapter[AgentControlDelivery] = TypeAdapter(AgentControlDelivery)


_TAG_FIELDS = ("type", "operation", "trigger")


def validation_field(error: ValidationError, raw: Any) -> tuple[str, str]:
    """The first error of ``error`` as (field path, message). The path follows ``raw`` (the parsed input),
    so a discriminated union's tag, which pydantic puts in the location, is left out:
    ``parts.0.text``, not ``parts.0.text.text``."""
    first = error.errors()[0]
    names: list[str] = []
    current: Any = raw
    tagged: Any = None  # the object whose union tag was already passed
    for item in first["loc"]:
        if isinstance(current, dict):
            if item in current:
                names.append(str(item))
                current = current[item]
                continue
            if current is not tagged and isinstance(item, str) and any(current.get(t) == item for t in _TAG_FIELDS):
                tagged = current
                continue  # the union's tag, not a field
        elif isinstance(current, list | tuple) and isinstance(item, int) and 0 <= item < len(current):
            names.append(str(item))
            current = current[item]
            continue
        names.append(str(item))
        current = None
    if first["type"] in ("union_tag_not_found", "union_tag_invalid"):
        names.append(str((first.get("ctx") or {}).get("discriminator", "")).strip("'"))
    return ".".join(n for n in names if n), first["msg"]


def parse_control_request(raw: Any) -> AgentControlRequest | AgentControlErrorResponse:
    """``raw`` (a dict, JSON text or bytes, or a request record) as a request, or the ``REQUEST_REJECTED``
    response naming the first field at fault."""
    if isinstance(raw, _Request):
        return raw  # type: ignore[return-value]
    if isinstance(raw, BaseModel):
        raw = raw.model_dump()
    if isinstance(raw, str | bytes | bytearray):
        try:
            raw = json.loads(raw)
        except ValueError as error:
            return control_error("unknown", "REQUEST_REJECTED", f"a request is one JSON object: {error}")
    try:
        return AGENT_CONTROL_REQUEST_ADAPTER.validate_python(raw)
    except ValidationError as error:
        where, message = validation_field(error, raw)
        where = where or "operation"
        value = raw.get("request_id") if isinstance(raw, dict) else None
        request_id = value if isinstance(value, str) and value else "unknown"
        return control_error(request_id, "REQUEST_REJECTED", f"{where}: {message}", field=where)


def control_error(
    request_id: str, code: AgentControlErrorCode, message: str, *, field: str | None = None
) -> AgentControlErrorResponse:
    return AgentControlErrorResponse(
        request_id=request_id, error=AgentControlError(code=code, message=message, field=field)
    )
