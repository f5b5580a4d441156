"""Canonical records: what threadline stores and what crosses a process boundary.

Every durable record carries ``schema_version`` (currently ``1``). A record with any other version is
refused with :class:`~threadline.errors.AgentRecordSchemaVersionError` rather than guessed at.
Records are frozen: a change is a new record, decided by the store reducer.

Causal order (DESIGN §4): a message gets a settled ``position`` when its run reaches a terminal state.
Seeded ``lead`` messages live in a band before everything else. Messages of runs still active have no
position and are ordered after the settled ones by run execution order.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Annotated, Any, Literal, TypeAlias, get_args

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    JsonValue,
    SerializationInfo,
    SerializerFunctionWrapHandler,
    TypeAdapter,
    field_serializer,
    field_validator,
    model_validator,
)

from ._evolve import build as build, evolve as evolve
from .errors import AgentRecordSchemaVersionError, AgentRecordValidationError
from .usage import AgentUsage, stored_usage

STORAGE = object()
"""The serialization ``context`` of a record's stored JSON (``threadline.store.codec``): a run row keeps its
usage in a compact form that reads back to the same record."""

SCHEMA_VERSION = 1
"""The schema version every record written by this threadline carries."""

Timestamp: TypeAlias = datetime
"""Timestamps are timezone-aware UTC datetimes, passed into the reducer as arguments."""

TEMPLATE_TIME: Timestamp = datetime(1970, 1, 1, tzinfo=UTC)
"""The placeholder time of template records (the reducer copies templates with :func:`evolve` rather than
validate what it built itself; it reads no clock)."""


# -------------------------------------------------------------------------------------------------- ids

ID_MAX_LENGTH = 512
"""Characters: the longest id (conversation, run, message, idempotency key, seed key, owner) accepted."""
_ID_FORBIDDEN = re.compile(r"[\x00-\x1f\x7f]")


def id_problem(value: object) -> str | None:
    """Why ``value`` is not an id, or None. **The id rule**, the same for conversation ids, run ids, message
    ids, idempotency keys, seed keys and owner ids, on every store: a ``str`` of 1 to :data:`ID_MAX_LENGTH`
    characters holding no control character (U+0000–U+001F and U+007F: NUL included, which PostgreSQL
    cannot store). Any other Unicode is allowed; case matters and nothing is trimmed. The ids threadline
    draws itself (``run_…``, ``msg_…``) follow it."""
    if type(value) is not str:
        return f"an id is a str, got {type(value).__name__}"
    if not value:
        return "an id is not empty"
    if len(value) > ID_MAX_LENGTH:
        return f"an id has at most {ID_MAX_LENGTH} characters, got {len(value)}"
    found = _ID_FORBIDDEN.search(value)
    if found is not None:
        return f"an id holds no control character, got {found.group()!r} at index {found.start()}"
    return None


def check_id(value: object, field: str) -> None:
    """Refuse ``value`` unless it follows the id rule (:func:`id_problem`): an
    :class:`~threadline.errors.AgentRecordValidationError` naming ``field``."""
    if type(value) is str and 0 < len(value) <= ID_MAX_LENGTH and _ID_FORBIDDEN.search(value) is None:
        return  # the usual case, in one expression: this runs for every id of every store operation
    problem = id_problem(value)
    if problem is not None:
        shown = value if not isinstance(value, str) or len(value) <= 80 else value[:80] + "…"
        raise AgentRecordValidationError(f"{field}: {problem} ({shown!r})", field=field)


class _Record(BaseModel):
    model_config = ConfigDict(
        frozen=True,
        extra="forbid",
        populate_by_name=True,
        json_schema_serialization_defaults_required=True,
        defer_build=True,
    )


class _Durable(_Record):
    schema_version: int = SCHEMA_VERSION

    # A field validator, not a model "before" validator: that would make every JSON read build a Python
    # dict first (about half the cost of decoding a record). The field comes first, so an unknown version
    # is reported before anything else about the record.
    @field_validator("schema_version")
    @classmethod
    def _known_schema_version(cls, version: int) -> int:
        if version != SCHEMA_VERSION:
            raise AgentRecordSchemaVersionError(cls.__name__, version, SCHEMA_VERSION)
        return version


# ----------------------------------------------------------------------------------------------- parts


class ProviderEnvelope(_Record):
    """Opaque provider metadata, sent back only to the provider that produced it."""

    version: Literal[1] = 1
    provider: str = Field(min_length=1)
    data: JsonValue = None


class TextPart(_Record):
    type: Literal["text"] = "text"
    text: str
    envelope: ProviderEnvelope | None = Field(default=None, exclude_if=lambda envelope: envelope is None)
    """What the provider attached to the text (an item id, a Gemini thought signature), sent back only to
    that provider. Left out of the JSON when None: plain text keeps the shape it always had."""


class ReasoningPart(_Record):
    type: Literal["reasoning"] = "reasoning"
    text: str = ""
    envelope: ProviderEnvelope | None = None


class ToolCallPart(_Record):
    type: Literal["tool-call"] = "tool-call"
    call_id: str = Field(min_length=1)
    tool_name: str = Field(min_length=1)
    input: JsonValue = None
    envelope: ProviderEnvelope | None = None


class ToolResultPart(_Record):
    type: Literal["tool-result"] = "tool-result"
    call_id: str = Field(min_length=1)
    tool_name: str = Field(min_length=1)
    outcome: Literal["success", "error"] = "success"
    output: JsonValue = None


class FilePart(_Record):
    """A storage-neutral reference to a file the application keeps; never inline bytes."""

    type: Literal["file"] = "file"
    reference: str = Field(min_length=1)
    media_type: str = Field(min_length=1)
    filename: str | None = None


class SourcePart(_Record):
    type: Literal["source"] = "source"
    source_id: str = Field(min_length=1)
    url: str | None = None
    title: str | None = None
    media_type: str | None = None


class ProviderPart(_Record):
    type: Literal["provider"] = "provider"
    envelope: ProviderEnvelope


class ApprovalRequestPart(_Record):
    type: Literal["approval-request"] = "approval-request"
    approval_id: str = Field(min_length=1)
    call_id: str = Field(min_length=1)
    tool_name: str = Field(min_length=1)
    input: JsonValue = None
    signature: str | None = None


class ApprovalResponsePart(_Record):
    type: Literal["approval-response"] = "approval-response"
    approval_id: str = Field(min_length=1)
    call_id: str = Field(min_length=1)
    approved: bool
    reason: str | None = None


class ControlPart(_Record):
    """A control marker; ``interrupted`` notes where a turn was cut off."""

    type: Literal["control"] = "control"
    marker: Literal["interrupted"] = "interrupted"


class InputJoinedPart(_Record):
    """Notes, on an assistant draft, the step boundary where injected input joined the run."""

    type: Literal["input-joined"] = "input-joined"
    run_id: str = Field(min_length=1)
    message_ids: tuple[str, ...] = Field(min_length=1)
    step: int = Field(ge=0)


Part = Annotated[
    TextPart
    | ReasoningPart
    | ToolCallPart
    | ToolResultPart
    | FilePart
    | SourcePart
    | ProviderPart
    | ApprovalRequestPart
    | ApprovalResponsePart
    | ControlPart
    | InputJoinedPart,
    Field(discriminator="type"),
]
PARTS_ADAPTER: TypeAdapter[list[Part]] = TypeAdapter(list[Part], config=ConfigDict(defer_build=True))
_PART_TYPES = frozenset(get_args(get_args(Part)[0]))


def validate_parts(values: Sequence[Any]) -> list[Part]:
    """``values`` as part records. Part records are returned as they are (exactly what validation returns:
    records are never revalidated), so the common case costs one type check per part; anything else goes
    through ``PARTS_ADAPTER`` (and may raise its ``ValidationError``)."""
    parts = list(values)
    if all(type(p) in _PART_TYPES for p in parts):
        return parts
    return PARTS_ADAPTER.validate_python(parts)


# --------------------------------------------------------------------------------------------- messages

Role = Literal["user", "assistant", "tool", "system", "summary"]
MessageStatus = Literal["committed", "streaming", "completed", "interrupted", "superseded", "failed"]
Band = Literal["lead", "history"]

ASSISTANT_STATUSES: frozenset[str] = frozenset({"streaming", "completed", "interrupted", "superseded", "failed"})


class Message(_Durable):
    """One canonical message.

    ``position`` is set when the message is settled (its run ended, or it was seeded); ``band`` ``lead``
    sorts before all history. ``active`` is false once compaction replaced it; ``compacted_by`` then names
    the summary. ``seq`` is the per-conversation insertion number, used only to break ties.
    """

    id: str = Field(min_length=1)
    conversation_id: str = Field(min_length=1)
    role: Role
    status: MessageStatus
    parts: tuple[Part, ...] = ()
    run_id: str | None = None
    metadata: dict[str, JsonValue] = Field(default_factory=dict)
    created_at: Timestamp
    position: int | None = None
    band: Band = "history"
    active: bool = True
    compacted_by: str | None = None
    seq: int = Field(ge=0)
    version: int = Field(default=0, ge=0)
    """The conversation version that last wrote this row (lets a reader fetch only what changed)."""

    @model_validator(mode="after")
    def _status_fits_role(self) -> Message:
        if self.role == "assistant":
            if self.status not in ASSISTANT_STATUSES:
                raise ValueError(f"assistant message status must be one of {sorted(ASSISTANT_STATUSES)}")
        elif self.status != "committed":
            raise ValueError(f"a {self.role} message has status 'committed', not {self.status!r}")
        if self.band == "lead" and self.position is None:
            raise ValueError("a lead message has a position")
        if not self.active and self.compacted_by is None:
            raise ValueError("an inactive message names the summary that replaced it (compacted_by)")
        return self

    @property
    def settled(self) -> bool:
        return self.position is not None

    @property
    def sort_key(self) -> tuple[int, int, int, int]:
        """Order of settled messages: band, position, summaries after what they replaced, insertion."""
        f = self.__dict__  # (one pydantic attribute hook, not four: the view sorts by it)
        assert f["position"] is not None, "only settled messages have a sort key"
        return (0 if f["band"] == "lead" else 1, f["position"], 1 if f["role"] == "summary" else 0, f["seq"])


class MessageDraft(_Record):
    """What a caller proposes for a new message; the store assigns position, sequence and time."""

    id: str = Field(min_length=1)
    role: Role = "user"
    parts: tuple[Part, ...] = Field(min_length=1)
    metadata: dict[str, JsonValue] = Field(default_factory=dict)


# ------------------------------------------------------------------------------------------------- runs

RunState = Literal[
    "queued",
    "running",
    "interrupt_requested",
    "completed",
    "interrupted",
    "superseded",
    "failed",
    "cancelled",
    "abandoned",
]
ACTIVE_RUN_STATES: frozenset[str] = frozenset({"queued", "running", "interrupt_requested"})
ACQUIRED_RUN_STATES: frozenset[str] = frozenset({"running", "interrupt_requested"})

TerminalReason = Literal[
    "success",
    "provider_stop",
    "policy_stop",
    "interrupted",
    "superseded",
    "absorbed",
    "cancelled",
    "shutdown",
    "timeout",
    "context_overflow",
    "storage_conflict",
    "output_rejected",
    "runtime_failure",
    "provider_failure",
    "abandoned",
]

RUN_STATE_FOR_REASON: dict[str, str] = {
    "success": "completed",
    "provider_stop": "completed",
    "policy_stop": "completed",
    "interrupted": "interrupted",
    "shutdown": "interrupted",
    "superseded": "superseded",
    "absorbed": "superseded",
    "cancelled": "cancelled",
    "timeout": "cancelled",
    "abandoned": "abandoned",
    "context_overflow": "failed",
    "storage_conflict": "failed",
    "output_rejected": "failed",
    "runtime_failure": "failed",
    "provider_failure": "failed",
}
"""The run state each terminal reason implies; a record whose state and reason disagree is refused."""


def run_state_for_terminal_reason(reason: str) -> str:
    """The run state a terminal reason ends a run in (``"interrupted"`` -> ``"interrupted"``,
    ``"timeout"`` -> ``"cancelled"``, ``"policy_stop"`` -> ``"completed"``); the same table the record
    check uses, so a run built from it is always accepted. An unknown reason is a ``ValueError``."""
    try:
        return RUN_STATE_FOR_REASON[reason]
    except (KeyError, TypeError):
        raise ValueError(f"unknown terminal reason {reason!r}; known: {sorted(RUN_STATE_FOR_REASON)}") from None


ASSISTANT_STATUS_FOR_REASON: dict[str, str] = {
    "success": "completed",
    "provider_stop": "completed",
    "policy_stop": "completed",
    "superseded": "superseded",
    "interrupted": "interrupted",
    "cancelled": "interrupted",
    "shutdown": "interrupted",
}
"""Assistant status per terminal reason; every reason not listed gives ``failed`` (absorbed gives none)."""


def assistant_status_for(reason: str) -> str:
    return ASSISTANT_STATUS_FOR_REASON.get(reason, "failed")


INPUT_POLICIES = ("queue", "inject", "interrupt", "interrupt-next", "supersede")
"""What a newly admitted input does to the run in flight (``Run.input_policy``; see ``runs.input_policy``)."""

Priority = Literal["ordinary", "urgent"]
OperationKind = Literal["model-request", "compaction", "retry"]
OperationPhase = Literal["scheduled", "started", "first-output", "completed", "failed", "cancelled"]


class RunOperation(_Record):
    """The durable ``last_operation`` of a run, with the original wall-clock observations."""

    kind: OperationKind
    phase: OperationPhase
    operation_id: str = Field(min_length=1)
    step: int | None = None
    attempt: int | None = None
    started_at: Timestamp
    first_output_at: Timestamp | None = None
    finished_at: Timestamp | None = None
    detail: str | None = None


FailureOrigin = Literal["provider", "runtime", "storage", "tool", "policy"]
FAILURE_SUMMARY_MAX = 300
"""Characters: a failure's summary is cut to this length."""


class AgentRunFailure(_Record):
    """Why a run failed, in words safe to store and to show an operator: ``Run.failure`` and
    ``AgentRuntimeResult.error``. Never a request body, a response body or a credential.

    ``origin`` is where it happened: ``provider`` (the provider's stream or its silence), ``storage`` (a store
    mutation refused or failing), ``tool`` (tool approval or a tool hook outside the model's envelope),
    ``policy`` (a stop policy, the protocol's terminal acceptance, structured output the model could not give)
    or ``runtime`` (the application's callbacks and anything else). ``exception_type`` is the qualified name
    of the exception (None when nothing raised: a refusal by the protocol), ``status_code`` the HTTP status
    when the provider answered with one, ``summary`` at most :data:`FAILURE_SUMMARY_MAX` characters."""

    origin: FailureOrigin
    exception_type: str | None = None
    status_code: int | None = None
    summary: str = Field(max_length=FAILURE_SUMMARY_MAX)


class Run(_Durable):
    """One execution of a model turn for one or more inputs."""

    id: str = Field(min_length=1)
    conversation_id: str = Field(min_length=1)
    state: RunState
    revision: int = Field(ge=1)
    input_message_ids: tuple[str, ...] = Field(min_length=1)
    assistant_message_id: str = Field(min_length=1)
    priority: Priority = "ordinary"
    input_policy: str = "queue"
    admission_sequence: int = Field(ge=1)
    execution_sequence: int | None = None
    owner_id: str | None = None
    fencing_token: int = Field(default=0, ge=0)
    lease_expires_at: Timestamp | None = None
    terminal_reason: TerminalReason | None = None
    policy_name: str | None = None
    absorbed_into_run_id: str | None = None
    absorbed_run_ids: tuple[str, ...] = ()
    last_operation: RunOperation | None = None
    failure: AgentRunFailure | None = Field(default=None, exclude_if=lambda failure: failure is None)
    """Why the run failed (set by its terminal commit for ``provider_failure``, ``runtime_failure``,
    ``storage_conflict``, ``context_overflow``, ``output_rejected`` and ``timeout``); None otherwise. Left out
    of the JSON when None: rows written before it existed read back unchanged, and so do runs without one."""
    usage: AgentUsage = AgentUsage()
    """What the run spent so far, cumulative over every attempt and execution (a run requeued after a crash
    keeps what its earlier executions committed) and every compaction invocation's reported spend, with the
    per-field provenance of :mod:`threadline.usage`. Written with the checkpoints and the terminal commit the
    run makes anyway; spend after the last commit of a crashed execution is lost with it."""
    created_at: Timestamp
    updated_at: Timestamp
    acquired_at: Timestamp | None = None
    terminal_at: Timestamp | None = None
    version: int = Field(default=0, ge=0)
    """The conversation version that last wrote this row."""

    @field_serializer("usage", mode="wrap")
    def _usage_json(  # type: ignore[no-untyped-def]  # no return annotation: the JSON schema stays the usage's
        self, usage: AgentUsage, handler: SerializerFunctionWrapHandler, info: SerializationInfo
    ):
        if info.context is STORAGE:
            return stored_usage(usage)  # what differs from the defaults; validates back to an equal usage
        return usage  # serialized as itself, as without this serializer (``handler`` would cost a round trip)

    @model_validator(mode="after")
    def _consistent(self) -> Run:
        problem = run_invariant_problem(self)
        if problem:
            raise ValueError(problem)
        return self

    @property
    def active(self) -> bool:
        return self.state in ACTIVE_RUN_STATES

    @property
    def acquired(self) -> bool:
        return self.state in ACQUIRED_RUN_STATES

    @property
    def terminal(self) -> bool:
        return self.state not in ACTIVE_RUN_STATES

    @property
    def execution_order_key(self) -> tuple[int, int, int]:
        """Durable execution order of active runs: work that started (by execution sequence), then urgent
        queued runs FIFO, then ordinary queued runs FIFO. Never ids or timestamps."""
        if self.execution_sequence is not None:
            return (0, self.execution_sequence, 0)
        return (1 if self.priority == "urgent" else 2, self.admission_sequence, 0)


def run_invariant_problem(run: Run) -> str | None:
    """Why ``run`` is not a consistent record, or None. Shared by the schema and the reducer (which checks
    every run it changes: the fields are read from ``__dict__``, cheaper than pydantic's attribute hook)."""
    f = run.__dict__
    state, reason = f["state"], f["terminal_reason"]
    if state in ACTIVE_RUN_STATES:
        if reason is not None:
            return f"an active run ({state}) has no terminal_reason"
        if state in ACQUIRED_RUN_STATES and (f["owner_id"] is None or f["execution_sequence"] is None):
            return f"a {state} run has an owner_id and an execution_sequence"
        return None
    if reason is None:
        return f"a terminal run ({state}) has a terminal_reason"
    expected = RUN_STATE_FOR_REASON[reason]
    if expected != state:
        return f"terminal_reason {reason!r} implies state {expected!r}, not {state!r}"
    if (reason == "absorbed") != (f["absorbed_into_run_id"] is not None):
        return "absorbed_into_run_id is set exactly when terminal_reason is 'absorbed'"
    if reason == "policy_stop" and not f["policy_name"]:
        return "a policy_stop run names its policy_name"
    return None


# ------------------------------------------------------------------------------ heads, receipts, snapshot


class ConversationHead(_Durable):
    """The per-conversation row every mutation reads: a monotonic version and the counters that assign
    positions and sequences without reading history."""

    conversation_id: str = Field(min_length=1)
    version: int = Field(ge=0)
    settled_position: int = Field(default=0, ge=0)
    lead_position: int = Field(default=0, ge=0)
    message_seq: int = Field(default=0, ge=0)
    admission_seq: int = Field(default=0, ge=0)
    execution_seq: int = Field(default=0, ge=0)
    event_seq: int = Field(default=0, ge=0)
    """The ``seq`` of the conversation's last ledger event (every mutation appends after it)."""
    created_at: Timestamp
    updated_at: Timestamp


class AdmissionReceipt(_Durable):
    """The idempotency record of one accepted input: kept for the life of the conversation, also after
    compaction, so a retry with the same key resolves to the same run."""

    conversation_id: str = Field(min_length=1)
    idempotency_key: str = Field(min_length=1)
    input: Message
    run_id: str = Field(min_length=1)
    assistant_message_id: str = Field(min_length=1)
    version: int = Field(ge=1)
    created_at: Timestamp


class SeedRecord(_Durable):
    conversation_id: str = Field(min_length=1)
    seed_key: str = Field(min_length=1)
    placement: Literal["lead", "after-settled"]
    message_ids: tuple[str, ...]
    version: int = Field(ge=1)
    created_at: Timestamp


class ConversationSnapshot(_Record):
    """The whole active history in causal order, with every run. ``version`` 0 and nothing else for an
    unknown or purged conversation."""

    conversation_id: str
    version: int = 0
    messages: tuple[Message, ...] = ()
    runs: tuple[Run, ...] = ()

    def visible_to(self, run_id: str) -> tuple[Message, ...]:
        """The messages a run may see: settled history and active runs up to and including ``run_id``."""
        active = sorted((r for r in self.runs if r.active), key=lambda r: r.execution_order_key)
        hidden: set[str] = set()
        seen = False
        for run in active:
            if seen:
                hidden.add(run.id)
            elif run.id == run_id:
                seen = True
        return tuple(m for m in self.messages if m.run_id not in hidden or m.position is not None)


RECORD_MODELS: dict[str, type[BaseModel]] = {
    "ConversationHead": ConversationHead,
    "Message": Message,
    "Run": Run,
    "AdmissionReceipt": AdmissionReceipt,
    "SeedRecord": SeedRecord,
    "ConversationSnapshot": ConversationSnapshot,
}


def export_json_schemas() -> dict[str, Any]:
    """JSON Schema (draft 2020-12) of every canonical record, keyed by record name, for non-Python clients."""
    return {name: model.model_json_schema(mode="serialization") for name, model in RECORD_MODELS.items()}
