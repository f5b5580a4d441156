"""The ledger's vocabulary: the envelope every event has, the declared kinds and their typed payloads.

One append-only journal per conversation, numbered by ``seq`` from 1 without gaps. The store's reducer
decides every event a mutation appends (its ``runtime/transition`` record and the records the caller
declared for the same commit); drivers only insert and select rows. The envelope keeps the payload as
JSON exactly as written, so a journal read back, exported and imported is the same bytes; the typed
records here are how a reader interprets a payload (:func:`decode_agent_store_event`).

A ``runtime/transition`` payload is the *command* of one store mutation (``type`` and ``input``, as
stitchkit records it), plus the conversation ``version`` it produced. Replaying the commands through the
same pure reducer, each at its ``occurred_at``, rebuilds the conversation (:mod:`threadline.store.replay`).
Two inputs are recorded other than as given, so a checkpoint never copies the growing draft into the
journal and every terminal stands on its own:

- a checkpoint's draft is a digest, ``{id, status: 'streaming', sha256, parts, bytes}`` (historical
  evidence, never an executable checkpoint input);
- a terminal (and an abandon) carries the full final assistant parts, whatever the caller passed.
"""

from __future__ import annotations

import hashlib
import json
from datetime import datetime
from typing import Annotated, Any, Literal, TypeAlias, get_args

from pydantic import (
    AwareDatetime,
    BaseModel,
    ConfigDict,
    Field,
    JsonValue,
    TypeAdapter,
    ValidationError,
    model_validator,
)

from ..errors import AgentRecordValidationError
from ..records import (
    PARTS_ADAPTER,
    AdmissionReceipt,
    AgentRunFailure,
    ConversationHead,
    Message,
    MessageDraft,
    Part,
    Run,
    RunOperation,
    SeedRecord,
)
from ..usage import AgentUsage

__all__ = [
    "AGENT_STORE_EVENT_KINDS",
    "EVENT_SCHEMA_VERSION",
    "AgentBranchReceipt",
    "AgentStoreEvent",
    "AgentStoreEventDraft",
    "AgentStoreEventKind",
    "AgentStoreEventPage",
    "AgentStoreTransitionRecord",
    "AssistantDigest",
    "BaselineRecord",
    "BranchObservationRecord",
    "ProviderMessageRecord",
    "ProviderRequestRecord",
    "ProviderResponseRecord",
    "decode_agent_store_event",
    "parts_digest",
]

EVENT_SCHEMA_VERSION = 1
"""The envelope version this threadline writes and reads; any other is refused unless ``ignorable``."""

AgentStoreEventKind = Literal[
    "runtime/baseline",
    "runtime/transition",
    "runtime/branch-observation",
    "provider/request",
    "provider/response",
    "provider/message",
    "state/set",
    "spill/created",
    "spill/deleted",
    "schedule/set",
    "schedule/fired",
    "schedule/cancelled",
    "schedule/late",
    "schedule/failed",
    "child/spawned",
    "child/state",
    "retry/scheduled",
    "retry/started",
    "sandbox/probed",
    "approval/response-rejected",
    "durability/effect",
    "durability/park",
    "durability/event",
]
AGENT_STORE_EVENT_KINDS: frozenset[str] = frozenset(get_args(AgentStoreEventKind))

RUNTIME_KINDS = frozenset({"runtime/baseline", "runtime/transition", "runtime/branch-observation"})
"""Kinds only the store writes (the reducer, migration and branch), never copied by a branch."""
STORE_WRITTEN_KINDS = RUNTIME_KINDS | {"durability/effect"}
"""Kinds ``append_event`` refuses: the store's own, and durable steps (written by their own store
operations, which keep at most one intent and one proof per key)."""
PROVIDER_KINDS = frozenset({"provider/request", "provider/response", "provider/message"})
OBSERVED_KINDS = AGENT_STORE_EVENT_KINDS - RUNTIME_KINDS - PROVIDER_KINDS
"""Facts a branch keeps only as inert ``runtime/branch-observation`` records (state, spills, schedules,
children, retries, the sandbox, approval rejections, durability)."""


class _Record(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", defer_build=True)


# ---------------------------------------------------------------------------------------------- envelope


class AgentStoreEvent(_Record):
    """One ledger event. ``payload`` is JSON exactly as written; :func:`decode_agent_store_event` reads it
    as the typed record of its ``kind``. ``ignorable`` marks an event a reader of another version may skip
    (an unknown kind or version without it is refused)."""

    schema_version: int = Field(default=EVENT_SCHEMA_VERSION, ge=1)
    event_id: str = Field(min_length=1)
    conversation_id: str = Field(min_length=1)
    seq: int = Field(ge=1)
    kind: str = Field(min_length=1)
    occurred_at: AwareDatetime
    payload: JsonValue = None
    ignorable: Literal[True] | None = Field(default=None, exclude_if=lambda value: value is None)


class AgentStoreEventDraft(_Record):
    """An event a caller declares for a mutation's commit (or for :meth:`append_event`): the store gives
    it its ``seq``, id, conversation and time."""

    kind: AgentStoreEventKind
    payload: JsonValue = None
    ignorable: Literal[True] | None = None


class RuntimeEventDraft(AgentStoreEventDraft):
    """A draft the runtime builds from its own records (the loop's provider, retry and approval records):
    its payload has its kind's shape by construction, so the store does not validate it again on every
    commit of a turn. Build one with :func:`runtime_draft`; anything else a caller passes is validated."""


def runtime_draft(kind: str, payload: Any) -> AgentStoreEventDraft:
    """A :class:`RuntimeEventDraft` of ``kind`` (not validated: the runtime's own records only)."""
    return RuntimeEventDraft.model_construct(kind=kind, payload=payload)


class AgentStoreEventPage(_Record):
    """One page of :meth:`~threadline.store.AgentRuntimeStore.read_events`; ``next_seq`` only when more
    events remain in the range asked for."""

    items: tuple[AgentStoreEvent, ...] = ()
    next_seq: int | None = None


# ------------------------------------------------------------------------------------ runtime/transition


class AssistantDigest(_Record):
    """A streaming draft as a checkpoint record holds it: evidence of what was checkpointed, not the draft.
    ``parts`` counts parts (it is not a list of them); exactly one of ``sha256`` (this conversation's
    checkpoint) and ``source_sha256`` (the digest a branch copied from its source) is present."""

    id: str = Field(min_length=1)
    status: Literal["streaming"] = "streaming"
    sha256: str | None = None
    source_sha256: str | None = None
    parts: int = Field(ge=0)
    bytes: int = Field(ge=0)

    @model_validator(mode="after")
    def _one_digest(self) -> AssistantDigest:
        if (self.sha256 is None) == (self.source_sha256 is None):
            raise ValueError("exactly one of sha256 and source_sha256 is present")
        return self


def parts_digest(parts: tuple[Part, ...] | list[Part]) -> tuple[str, int, int]:
    """(sha256, part count, bytes) of a draft's parts: the SHA-256 of their JSON as threadline stores it."""
    body = PARTS_ADAPTER.dump_json(list(parts))
    return hashlib.sha256(body).hexdigest(), len(parts), len(body)


class _Owned(_Record):
    run_id: str = Field(min_length=1)
    expected_revision: int
    owner_id: str = Field(min_length=1)
    fencing_token: int


class AcceptInput(_Record):
    idempotency_key: str = Field(min_length=1)
    input: MessageDraft
    run_id: str = Field(min_length=1)
    assistant_message_id: str = Field(min_length=1)
    priority: Literal["ordinary", "urgent"] = "ordinary"
    input_policy: str = "queue"
    coalesce: bool = False
    start_for: str | None = None
    lease_expires_at: datetime | None = None
    operation: RunOperation | None = None


class AcquireInput(_Record):
    run_id: str = Field(min_length=1)
    expected_revision: int
    owner_id: str = Field(min_length=1)
    lease_expires_at: datetime | None = None
    operation: RunOperation | None = None


class CheckpointInput(_Owned):
    assistant: AssistantDigest
    operation: RunOperation | None = None
    usage: AgentUsage | None = None


class OperationInput(_Owned):
    operation: RunOperation
    usage: AgentUsage | None = None


class LeaseInput(_Owned):
    lease_expires_at: datetime


class InterruptInput(_Record):
    run_id: str = Field(min_length=1)
    expected_revision: int | None = None


class RecoverInput(_Record):
    run_id: str = Field(min_length=1)
    expected_revision: int
    action: Literal["requeue", "abandon"]
    replay_safe: bool = False
    stale_owner: bool = False
    parts: tuple[Part, ...] | None = None
    """An abandon: the full failed assistant it settled (its parts)."""


class AbsorbClaimRecord(_Record):
    run_id: str = Field(min_length=1)
    expected_revision: int
    input_message_ids: tuple[str, ...]


class TerminalInput(_Owned):
    terminal_reason: str = Field(min_length=1)
    parts: tuple[Part, ...]
    """The full final assistant (its parts), whatever the caller passed."""
    policy_name: str | None = None
    absorb: tuple[AbsorbClaimRecord, ...] = ()
    operation: RunOperation | None = None
    usage: AgentUsage | None = None
    failure: AgentRunFailure | None = None
    """Why a failed run failed (:attr:`threadline.records.Run.failure`), as the run record keeps it."""


class CompactInput(_Record):
    expected_version: int
    replaced_message_ids: tuple[str, ...]
    summary: MessageDraft


class SeedInput(_Record):
    seed_key: str = Field(min_length=1)
    inputs: tuple[MessageDraft, ...]
    placement: Literal["lead", "after-settled"] = "lead"


class _Transition(_Record):
    version: int = Field(ge=0)
    """The conversation version the transition produced."""


class AcceptTransition(_Transition):
    type: Literal["accept"]
    input: AcceptInput


class AcquireTransition(_Transition):
    type: Literal["acquire"]
    input: AcquireInput


class CheckpointTransition(_Transition):
    type: Literal["checkpoint"]
    input: CheckpointInput


class OperationTransition(_Transition):
    type: Literal["operation"]
    input: OperationInput


class LeaseTransition(_Transition):
    type: Literal["lease"]
    input: LeaseInput


class InterruptTransition(_Transition):
    type: Literal["interrupt"]
    input: InterruptInput


class RecoverTransition(_Transition):
    type: Literal["recover"]
    input: RecoverInput


class TerminalTransition(_Transition):
    type: Literal["terminal"]
    input: TerminalInput


class CompactTransition(_Transition):
    type: Literal["compact"]
    input: CompactInput


class SeedTransition(_Transition):
    type: Literal["seed"]
    input: SeedInput


AgentStoreTransitionRecord: TypeAlias = Annotated[
    AcceptTransition
    | AcquireTransition
    | CheckpointTransition
    | OperationTransition
    | LeaseTransition
    | InterruptTransition
    | RecoverTransition
    | TerminalTransition
    | CompactTransition
    | SeedTransition,
    Field(discriminator="type"),
]
"""The payload of a ``runtime/transition`` event (inspect it with ``TypeAdapter(AgentStoreTransitionRecord)``
or :func:`decode_agent_store_event`)."""


# -------------------------------------------------------------------------------------- runtime/baseline


class AgentBranchReceipt(_Record):
    """What a branch bound: source and destination, the exact source boundary (``source_seq``,
    ``source_version``), the digest of what was copied and the request's fingerprint. Kept in the
    destination's first event, so a retry returns it even after either conversation moved on."""

    request_key: str = Field(min_length=1)
    destination_conversation_id: str = Field(min_length=1)
    source_kind: Literal["conversation", "archive"]
    source_conversation_id: str = Field(min_length=1)
    through_run_id: str | None = None
    source_seq: int = Field(ge=0)
    source_version: int = Field(ge=0)
    source_digest: str = Field(min_length=64, max_length=64)
    request_fingerprint: str = Field(min_length=64, max_length=64)
    created_at: AwareDatetime


class BaselineRecord(_Record):
    """A conversation as it stood when its ledger began, at ``seq`` 1: a database migrated to the ledger,
    or a branch (``branch``: its receipt). Its whole normalized state; ``as_of`` is the time of the last
    message it describes; ``compacted`` names the messages compaction had folded away (they are in
    ``messages``, inactive)."""

    as_of: datetime | None = None
    compacted: tuple[str, ...] = ()
    head: ConversationHead
    messages: tuple[Message, ...] = ()
    runs: tuple[Run, ...] = ()
    receipts: tuple[AdmissionReceipt, ...] = ()
    seeds: tuple[SeedRecord, ...] = ()
    branch: AgentBranchReceipt | None = None


class BranchObservationRecord(_Record):
    """A fact of the source conversation a branch keeps only as inert history (state, schedules, children,
    retries, approval rejections, durability): it never repopulates state or pending effects."""

    source_conversation_id: str = Field(min_length=1)
    source_seq: int = Field(ge=1)
    kind: str = Field(min_length=1)
    occurred_at: AwareDatetime
    payload: JsonValue = None


# ----------------------------------------------------------------------------------------------- provider


class PrefixDigest(_Record):
    """The settled prefix of a request: ``count`` messages whose chained digest is ``sha256``
    (:func:`threadline.ledger.digests.chain`). ``added`` are the digests appended to a prefix an earlier
    request named (the one of ``count - len(added)`` messages; the empty prefix when that is 0), so the
    journal alone orders every body."""

    count: int = Field(ge=0)
    sha256: str = Field(min_length=64, max_length=64)
    added: tuple[str, ...] = ()


class ProviderRequestRecord(_Record):
    """What one provider call was sent, by digest: the effective instructions (after ``prepare_step``),
    the settled prefix (constant size: a chained digest and a count, and the digests added since an
    earlier request's prefix) and the live tail's message digests."""

    run_id: str = Field(min_length=1)
    attempt: int = Field(ge=1)
    step_number: int = Field(ge=0)
    model_id: str | None = None
    instructions_sha256: str
    prefix: PrefixDigest
    message_shas: tuple[str, ...] = ()


class ProviderMessageRecord(_Record):
    """One distinct message body, content-addressed: written once per conversation, the first time a
    request carries it. Binary parts are recorded by hash and size, never bytes."""

    sha256: str = Field(min_length=64, max_length=64)
    message: JsonValue


class ProviderResponseIdentity(_Record):
    id: str = Field(min_length=1)
    provider: str | None = None


class ProviderResponseRecord(_Record):
    """A completed provider response's identity, bound to its run, attempt and step."""

    run_id: str = Field(min_length=1)
    attempt: int = Field(ge=1)
    step_number: int = Field(ge=0)
    response: ProviderResponseIdentity


class RetryScheduledRecord(_Record):
    run_id: str = Field(min_length=1)
    step_number: int = Field(ge=0)
    attempt: int = Field(ge=2)
    """The attempt the retry will make."""
    delay: float = Field(ge=0)
    """Seconds before it starts."""
    reason: str
    error: str | None = None


class RetryStartedRecord(_Record):
    run_id: str = Field(min_length=1)
    step_number: int = Field(ge=0)
    attempt: int = Field(ge=2)


class ApprovalResponseRejectedRecord(_Record):
    run_id: str = Field(min_length=1)
    approval_id: str | None = None
    call_id: str | None = None
    reason: str


class DurabilityEffectRecord(_Record):
    """A durable step (``ctx.step``, :mod:`threadline.durability`) of ``(conversation, run_id,
    effect_name)``: its ``intent``, appended before the body ran, or its ``accepted`` proof, appended after.
    ``value_json`` is the proof's lossless JSON as text (exact: a number no JSON reader may round, a
    string as written); ``reconciled`` when ``reconcile`` rather than the body produced it. A key holds
    at most one of each; a bare intent is an uncertain outcome."""

    run_id: str = Field(min_length=1)
    effect_name: str = Field(min_length=1)
    status: Literal["intent", "accepted"]
    value_json: str | None = None
    reconciled: bool = False

    @model_validator(mode="after")
    def _proof_has_a_value(self) -> DurabilityEffectRecord:
        if (self.status == "accepted") != (self.value_json is not None):
            raise ValueError("an accepted proof has value_json and an intent has none")
        if self.value_json is not None:
            try:
                json.loads(self.value_json)
            except (ValueError, RecursionError) as error:
                raise ValueError(f"value_json is not JSON: {error}") from None
        return self


def durability_effect_key(run_id: str, effect_name: str, status: str) -> str:
    """The ledger's lookup key of a step's ``intent`` or ``accepted`` event (indexed beside provider body
    digests, which are bare hex: the ``status:`` prefix keeps the two apart)."""
    key = json.dumps([run_id, effect_name], ensure_ascii=False).encode("utf-8", "surrogatepass")
    return f"{status}:{hashlib.sha256(key).hexdigest()}"


def event_key(event: AgentStoreEvent) -> str | None:
    """The indexed lookup key of a ledger event: a ``provider/message`` body's ``sha256``, a
    ``durability/effect``'s :func:`durability_effect_key`; None for every other event."""
    payload = event.payload
    if not isinstance(payload, dict):
        return None
    if event.kind == "provider/message":
        sha = payload.get("sha256")
        return sha if isinstance(sha, str) else None
    if event.kind == "durability/effect":
        run_id, name, status = payload.get("run_id"), payload.get("effect_name"), payload.get("status")
        if isinstance(run_id, str) and isinstance(name, str) and status in ("intent", "accepted"):
            return durability_effect_key(run_id, name, status)  # type: ignore[arg-type]
    return None


class _Open(BaseModel):
    """Payload records of companions that live outside the core (state slots, spills, schedules, children,
    the sandbox, durability parks): the fields every producer writes are checked, a companion may add
    its own."""

    model_config = ConfigDict(frozen=True, extra="allow", defer_build=True)


class StateSetRecord(_Open):
    name: str = Field(min_length=1)
    value: JsonValue = None


class SpillCreatedRecord(_Open):
    reference: str = Field(min_length=1)
    bytes: int = Field(ge=0)
    sha256: str


class SpillDeletedRecord(_Open):
    reference: str = Field(min_length=1)


class ScheduleRecord(_Open):
    id: str = Field(min_length=1)


class ChildRecord(_Open):
    child_conversation_id: str = Field(min_length=1)


class OpenRecord(_Open):
    pass


PAYLOAD_RECORDS: dict[str, Any] = {
    "runtime/baseline": BaselineRecord,
    "runtime/transition": TypeAdapter(AgentStoreTransitionRecord, config=ConfigDict(defer_build=True)),
    "runtime/branch-observation": BranchObservationRecord,
    "provider/request": ProviderRequestRecord,
    "provider/response": ProviderResponseRecord,
    "provider/message": ProviderMessageRecord,
    "state/set": StateSetRecord,
    "spill/created": SpillCreatedRecord,
    "spill/deleted": SpillDeletedRecord,
    "schedule/set": ScheduleRecord,
    "schedule/fired": ScheduleRecord,
    "schedule/cancelled": ScheduleRecord,
    "schedule/late": ScheduleRecord,
    "schedule/failed": ScheduleRecord,
    "child/spawned": ChildRecord,
    "child/state": ChildRecord,
    "retry/scheduled": RetryScheduledRecord,
    "retry/started": RetryStartedRecord,
    "sandbox/probed": OpenRecord,
    "approval/response-rejected": ApprovalResponseRejectedRecord,
    "durability/effect": DurabilityEffectRecord,
    "durability/park": OpenRecord,
    "durability/event": OpenRecord,
}
"""The typed record (a model, or a ``TypeAdapter`` for the transition union) of each declared kind."""
assert set(PAYLOAD_RECORDS) == AGENT_STORE_EVENT_KINDS


def payload_record(kind: str, payload: Any, *, where: str = "payload") -> Any:
    """``payload`` validated as the typed record of ``kind``; a mismatch is
    :class:`~threadline.errors.AgentRecordValidationError` naming the first offending field."""
    record = PAYLOAD_RECORDS.get(kind)
    if record is None:
        raise AgentRecordValidationError(
            f"unknown event kind {kind!r}; use one of the declared kinds ({', '.join(sorted(PAYLOAD_RECORDS))})",
            field="kind",
        )
    try:
        if isinstance(record, TypeAdapter):
            return record.validate_python(payload)
        return record.model_validate(payload)
    except ValidationError as error:
        first = error.errors()[0]
        at = ".".join(str(p) for p in (where, *first["loc"]))
        raise AgentRecordValidationError(f"{kind} {at}: {first['msg']}", field=at) from error


def decode_agent_store_event(event: AgentStoreEvent | dict[str, Any]) -> tuple[AgentStoreEvent, Any]:
    """``(event, typed payload)``; ``(event, None)`` for an ``ignorable`` event of an unknown kind or
    version. Without ``ignorable``, an unknown kind or version is refused
    (:class:`~threadline.errors.AgentRecordValidationError`): the vocabulary is never widened silently,
    and ``ignorable`` never turns an extra field of a known envelope into accepted data."""
    if not isinstance(event, AgentStoreEvent):
        try:
            event = AgentStoreEvent.model_validate(event)
        except ValidationError as error:
            first = error.errors()[0]
            at = ".".join(str(p) for p in first["loc"]) or "event"
            raise AgentRecordValidationError(f"event {at}: {first['msg']}", field=at) from error
    known = event.schema_version == EVENT_SCHEMA_VERSION and event.kind in PAYLOAD_RECORDS
    if not known:
        if event.ignorable:
            return event, None
        raise AgentRecordValidationError(
            f"unsupported event {event.conversation_id}:{event.seq} ({event.event_id}): schema_version "
            f"{event.schema_version}, kind {event.kind!r}; only an ignorable event may be unknown",
            field="kind" if event.schema_version == EVENT_SCHEMA_VERSION else "schema_version",
        )
    return event, payload_record(event.kind, event.payload)
