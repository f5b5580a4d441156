"""Event schemas: the delivery events a transport or UI receives through ``publish``, and the separate
operator events an observability sink receives.

**Delivery** (:data:`AgentRuntimeEvent`, discriminated on ``type``):

- durable — ``admission``, ``run-state``, ``assistant-checkpoint``, ``run-operation``, ``terminal`` —
  are published only after their transaction committed ("durable before visible") and carry an
  ``event_id`` derived from (run id, event type, snapshot version), one per ``run-operation`` phase
  (:func:`durable_event_id`). ``version`` is the *conversation's* version, which also advances on
  mutations that publish nothing, so consecutive durable events are routinely several versions apart;
- transient — ``assistant-delta``, ``reasoning-start``/``-delta``/``-end``, ``tool-status``,
  ``tool-progress``, ``attempt-reset`` — carry ``(run_id, runtime_epoch, sequence)``: ``sequence`` is
  numbered from 1 per run and per runtime epoch, one per published event, so a cursor sees a gap only
  when an event was lost (:mod:`threadline.delivery`).

These are post-commit notifications, not an outbox: a process can crash between a commit and its
``publish``. Reconnect by loading the canonical snapshot; exactly-once delivery is an application outbox
keyed by ``event_id`` or ``(runtime_epoch, sequence)``.

**Operator** (:data:`AgentRunEvent`): ``run-started``, ``step-finished`` (one step's provider-reported
usage and the provider's response identity) and ``run-terminal``. Only the executor that applied the
terminal CAS publishes the delivery ``terminal``; *every* executor, a CAS loser included, publishes its
own ``run-terminal`` with its own spend, because it ran and it spent. ``run-terminal.cause`` is the
internal cause, redacted by :func:`threadline.delivery.create_agent_operator_sink` unless an
operator-only sink opts in.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Annotated, Any, Literal, NotRequired

from pydantic import BaseModel, ConfigDict, Field, JsonValue, TypeAdapter, field_validator, model_validator
from typing_extensions import TypedDict

from .records import Message, Part, ProviderEnvelope, Run, RunOperation, evolve
from .usage import AgentUsage

AGENT_TOOL_PROGRESS_MESSAGE_MAX = 280
"""``tool-progress`` messages longer than this many characters are cut."""

DURABLE_EVENT_TYPES = frozenset({"admission", "run-state", "assistant-checkpoint", "run-operation", "terminal"})
TRANSIENT_EVENT_TYPES = frozenset(
    {
        "assistant-delta",
        "reasoning-start",
        "reasoning-delta",
        "reasoning-end",
        "tool-status",
        "tool-progress",
        "attempt-reset",
    }
)
OPERATOR_EVENT_TYPES = frozenset({"run-started", "step-finished", "run-terminal"})


def _now() -> datetime:
    return datetime.now(UTC)


class _Event(BaseModel):
    model_config = ConfigDict(frozen=True, populate_by_name=True, json_schema_serialization_defaults_required=True)

    conversation_id: str = Field(min_length=1)
    run_id: str = Field(min_length=1)
    emitted_at: datetime = Field(default_factory=_now)


class _Durable(_Event):
    event_id: str = Field(min_length=1)
    version: int = Field(ge=0)
    """The conversation's snapshot version this event's commit produced."""

    @property
    def durable(self) -> bool:
        return True

    @property
    def identity(self) -> str:
        """A stable key for an outbox or a dedup set."""
        return self.event_id


class _Transient(_Event):
    runtime_epoch: str = Field(min_length=1)
    sequence: int = Field(ge=1)
    """Numbered from 1 per run (within one runtime epoch), one per published transient event."""

    @property
    def durable(self) -> bool:
        return False

    @property
    def identity(self) -> str:
        return f"{self.run_id}:{self.runtime_epoch}:{self.sequence}"


def delivered_parts(parts: Sequence[Part]) -> tuple[Part, ...]:
    """``parts`` as product delivery shows them: provider metadata stays in the store (it goes back only
    to the provider that produced it), so envelopes are removed and opaque provider parts left out."""
    if not any(p.type == "provider" or getattr(p, "envelope", None) is not None for p in parts):
        return parts if isinstance(parts, tuple) else tuple(parts)
    return tuple(
        evolve(p, {"envelope": None}) if getattr(p, "envelope", None) is not None else p
        for p in parts
        if p.type != "provider"
    )


def delivered_message(message: Message | None) -> Message | None:
    """A message as product delivery shows it (:func:`delivered_parts`)."""
    if message is None:
        return None
    parts = delivered_parts(message.parts)
    return message if parts is message.parts else evolve(message, {"parts": parts})


def durable_event_id(run_id: str, event_type: str, version: int, phase: str | None = None) -> str:
    """Stable identity of a post-commit event: (run id, event type, snapshot version), plus the phase
    for ``run-operation`` (so each phase of one operation has its own id)."""
    return f"{run_id}:{event_type}{':' + phase if phase else ''}:{version}"


# ------------------------------------------------------------------------------------------ delivery


class AdmissionEvent(_Durable):
    type: Literal["admission"] = "admission"
    outcome: Literal["accepted", "duplicate"]
    input: Message
    run: Run
    assistant_message_id: str
    coalesced: bool = False


class RunStateEvent(_Durable):
    type: Literal["run-state"] = "run-state"
    state: str
    terminal_reason: str | None = None


class AssistantCheckpointEvent(_Durable):
    """The draft as committed, without provider envelopes (:func:`delivered_parts`)."""

    type: Literal["assistant-checkpoint"] = "assistant-checkpoint"
    message_id: str
    parts: tuple[Part, ...]


class RunOperationEvent(_Durable):
    """``operation`` is the run's durable ``last_operation`` — ``model-request`` or ``compaction`` — in
    phase ``started``, ``first-output``, ``completed``, ``failed`` or ``cancelled``, with its original
    timestamps (wall-clock observations: order phases by ``version``, never by subtracting them)."""

    type: Literal["run-operation"] = "run-operation"
    operation: RunOperation


class AssistantDeltaEvent(_Transient):
    type: Literal["assistant-delta"] = "assistant-delta"
    delta: str


class ReasoningStartEvent(_Transient):
    """A reasoning block begins. Provider metadata stays inside the canonical ``envelope``."""

    type: Literal["reasoning-start"] = "reasoning-start"
    envelope: ProviderEnvelope | None = None


class ReasoningDeltaEvent(_Transient):
    """The current reasoning fragment only (never the accumulated text)."""

    type: Literal["reasoning-delta"] = "reasoning-delta"
    delta: str


class ReasoningEndEvent(_Transient):
    type: Literal["reasoning-end"] = "reasoning-end"
    envelope: ProviderEnvelope | None = None


class ToolFailureEnvelope(TypedDict):
    """The safe ``{error, retryable, message?, details?, _hint?, status?}`` envelope of a failed call (the same
    one the model and the durable tool result see). Unknown keys are dropped, so no internal cause can ride along."""

    __pydantic_config__ = ConfigDict(extra="ignore")  # type: ignore[misc]

    error: str
    retryable: bool
    message: NotRequired[str]
    details: NotRequired[JsonValue]
    _hint: NotRequired[str]
    status: NotRequired[int]


class ToolStatusEvent(_Transient):
    """Lifecycle of one tool call: JSON-safe ``input`` on ``started``, ``output`` on ``completed``; on
    ``failed`` the failure envelope, the same as the stored tool result's ``output``, as both ``output``
    and ``error``."""

    type: Literal["tool-status"] = "tool-status"
    call_id: str
    tool_name: str
    status: Literal["started", "completed", "failed", "interrupted"]
    input: JsonValue = None
    output: JsonValue = None
    error: ToolFailureEnvelope | None = None


class ToolProgressEvent(_Transient):
    """What a running tool reported (``message``, ``progress``, ``total`` — the fields an MCP host
    receives). Never enters the model's input or the durable history; the call's terminal
    ``tool-status`` has the final word. ``message`` is cut at :data:`AGENT_TOOL_PROGRESS_MESSAGE_MAX`."""

    type: Literal["tool-progress"] = "tool-progress"
    call_id: str
    tool_name: str
    message: str | None = None
    progress: float | None = None
    total: float | None = None

    @field_validator("message", mode="before")
    @classmethod
    def _cut(cls, value: Any) -> Any:
        if isinstance(value, str) and len(value) > AGENT_TOOL_PROGRESS_MESSAGE_MAX:
            return value[:AGENT_TOOL_PROGRESS_MESSAGE_MAX]
        return value


class AttemptResetEvent(_Transient):
    """A retried provider stream starts a new attempt: everything the run streamed in the failed attempt
    is withdrawn (drop it from the screen). Published before the new attempt's first delta."""

    type: Literal["attempt-reset"] = "attempt-reset"
    step: int | None = None
    attempt: int | None = None


class TerminalEvent(_Durable):
    """Published only by the executor whose terminal CAS won. Always carries ``usage``: a run that ended
    before any provider reported anything carries every field ``unavailable``. ``assistant`` is the
    stored answer without provider envelopes (:func:`delivered_message`)."""

    type: Literal["terminal"] = "terminal"
    terminal_reason: str
    policy_name: str | None = None
    assistant: Message | None = None
    usage: AgentUsage


AgentRuntimeEvent = Annotated[
    AdmissionEvent
    | AssistantDeltaEvent
    | ReasoningStartEvent
    | ReasoningDeltaEvent
    | ReasoningEndEvent
    | AssistantCheckpointEvent
    | RunStateEvent
    | RunOperationEvent
    | ToolStatusEvent
    | ToolProgressEvent
    | AttemptResetEvent
    | TerminalEvent,
    Field(discriminator="type"),
]
"""One delivery event, discriminated on ``type``."""

DurableAgentRuntimeEvent = AdmissionEvent | RunStateEvent | AssistantCheckpointEvent | RunOperationEvent | TerminalEvent
TransientAgentRuntimeEvent = (
    AssistantDeltaEvent
    | ReasoningStartEvent
    | ReasoningDeltaEvent
    | ReasoningEndEvent
    | ToolStatusEvent
    | ToolProgressEvent
    | AttemptResetEvent
)

AGENT_RUNTIME_EVENT_ADAPTER: TypeAdapter[AgentRuntimeEvent] = TypeAdapter(AgentRuntimeEvent)


# ------------------------------------------------------------------------------------------ operator


def agent_operator_event_id(
    run_id: str, event_type: str, runtime_epoch: str, fencing_token: int | None, step: int | None = None
) -> str:
    """Stable identity of an operator event: one per executor (runtime epoch + fencing token) and run,
    and per step for ``step-finished``. A CAS loser and the winner therefore never share an id."""
    execution = f"{runtime_epoch}:{fencing_token if fencing_token is not None else '-'}"
    return f"{run_id}:{event_type}:{execution}{f':{step}' if step is not None else ''}"


class AgentProviderResponse(BaseModel):
    """The identity a provider gave one response; ``provider`` is the upstream that served it when the
    model's ``resolve_response_provider`` names one (:mod:`threadline.models`), else absent."""

    model_config = ConfigDict(frozen=True)

    id: str = Field(min_length=1)
    provider: str | None = None

    @classmethod
    def from_response(cls, response: Any, *, provider: str | None = None) -> AgentProviderResponse | None:
        """From a pydantic-ai ``ModelResponse`` and the provider name its model's resolver gave (the runtime
        reads no gateway metadata itself); None when the provider returned no response id."""
        response_id = getattr(response, "provider_response_id", None)
        if not response_id:
            return None
        return cls(id=response_id, provider=provider or None)


class _OperatorEvent(BaseModel):
    model_config = ConfigDict(frozen=True, populate_by_name=True, json_schema_serialization_defaults_required=True)

    schema_version: Literal[1] = 1
    event_id: str = Field(min_length=1)
    """Derived by :func:`agent_operator_event_id` when omitted."""
    conversation_id: str = Field(min_length=1)
    run_id: str = Field(min_length=1)
    runtime_epoch: str = Field(min_length=1)
    """The executing runtime (with ``fencing_token``: the execution) that reports this event."""
    owner_id: str | None = None
    fencing_token: int | None = None
    model_id: str | None = None
    emitted_at: datetime = Field(default_factory=_now)

    @model_validator(mode="before")
    @classmethod
    def _derive_id(cls, data: Any) -> Any:
        if isinstance(data, dict) and not data.get("event_id") and "type" in cls.model_fields:
            run_id, epoch = data.get("run_id"), data.get("runtime_epoch")
            if isinstance(run_id, str) and isinstance(epoch, str):
                event_type = data.get("type") or cls.model_fields["type"].default
                event_id = agent_operator_event_id(
                    run_id, event_type, epoch, data.get("fencing_token"), data.get("step")
                )
                data = {**data, "event_id": event_id}
        return data


class AgentRunStartedEvent(_OperatorEvent):
    """An executor acquired the run and starts executing it."""

    type: Literal["run-started"] = "run-started"
    queue_wait: float | None = Field(default=None, ge=0)
    """Seconds the run waited between admission and this acquisition."""


class AgentStepFinishedEvent(_OperatorEvent):
    """One provider call finished: what that call reported (``provider-reported`` figures, not a sum)
    and the provider's identity of the response."""

    type: Literal["step-finished"] = "step-finished"
    step: int = Field(ge=0)
    attempt: int | None = None
    usage: AgentUsage
    response: AgentProviderResponse | None = None
    finish_reason: str | None = None
    ttft: float | None = Field(default=None, ge=0)
    """Seconds from the request to its first output."""


class AgentRunTerminalEvent(_OperatorEvent):
    """How this executor's execution ended, with this executor's own spend. ``outcome`` says whether it
    applied the terminal (``committed``), lost the run or the CAS to another writer (``lost``), or could
    not settle it (``unsettled``). ``cause`` is internal (see :func:`describe_internal_cause`) and is
    redacted by the operator sink unless it sets ``include_internal_cause``."""

    type: Literal["run-terminal"] = "run-terminal"
    outcome: Literal["committed", "lost", "unsettled"] = "committed"
    terminal_reason: str | None = None
    policy_name: str | None = None
    steps: int = Field(default=0, ge=0)
    usage: AgentUsage
    """Required: what this execution spent; ``unavailable`` fields when nothing was reported."""
    cause: JsonValue = None


AgentRunEvent = Annotated[
    AgentRunStartedEvent | AgentStepFinishedEvent | AgentRunTerminalEvent,
    Field(discriminator="type"),
]
"""One operator event, discriminated on ``type``."""

AGENT_RUN_EVENT_ADAPTER: TypeAdapter[AgentRunEvent] = TypeAdapter(AgentRunEvent)


def describe_internal_cause(error: BaseException | None) -> JsonValue:
    """A JSON-safe description of an internal cause (type and message, following ``__cause__``), for
    ``AgentRunTerminalEvent.cause``. Operator-only: it may carry provider or infrastructure details."""
    chain: list[JsonValue] = []
    seen: set[int] = set()
    current = error
    while current is not None and id(current) not in seen and len(chain) < 8:
        seen.add(id(current))
        kind = type(current)
        chain.append({"type": f"{kind.__module__}.{kind.__qualname__}", "message": str(current)})
        current = current.__cause__ or current.__context__
    if not chain:
        return None
    return {**chain[0], "chain": chain[1:]} if len(chain) > 1 else chain[0]  # type: ignore[dict-item]


def export_event_json_schemas() -> dict[str, Any]:
    """JSON Schema (draft 2020-12) of the delivery union (``AgentRuntimeEvent``) and the operator union
    (``AgentRunEvent``), both discriminated on ``type``, for non-Python clients."""
    return {
        "AgentRuntimeEvent": AGENT_RUNTIME_EVENT_ADAPTER.json_schema(mode="serialization"),
        "AgentRunEvent": AGENT_RUN_EVENT_ADAPTER.json_schema(mode="serialization"),
    }
