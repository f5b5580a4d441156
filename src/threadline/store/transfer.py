"""Export, import and branch: a conversation leaves a store as archive bytes and comes back, under its own
identity (import) or as a new, independent conversation (branch).

- :func:`export_conversation` reads every row of the conversation in one read transaction and encodes it
  (:mod:`threadline.ledger.archive`). Export → import → export is byte-identical on every driver.
- :func:`import_conversation` validates the whole archive before writing anything — the format checks of
  :func:`~threadline.ledger.archive.decode_archive`, then *snapshot agreement*: replaying the journal's
  transitions through the reducer (:mod:`threadline.store.replay`) must give exactly the snapshot, and
  every provider request must be consistent with the bodies before it — and then writes every row in one
  transaction, only where the conversation does not exist. Normalized state, admission receipts (an
  idempotent retry keeps working), queue order and the journal come back as they were.
- :func:`branch_conversation` copies a settled prefix into a new conversation id with new engine
  identities (see its docstring).
"""

from __future__ import annotations

import contextlib
import functools
import gc
import hashlib
import logging
from collections.abc import Callable, Iterator, Mapping
from datetime import datetime
from typing import Any, Literal, Protocol

import rfc8785
from pydantic import BaseModel, ConfigDict
from pydantic_core import to_jsonable_python

from ..errors import (
    AgentArchiveRejectedError,
    AgentBranchRefusedError,
    AgentIdempotencyConflictError,
    AgentRecordNotFoundError,
    AgentRecordValidationError,
)
from ..ledger.archive import MAX_ARCHIVE_BYTES, ArchiveContent, decode_archive, encode_archive
from ..ledger.digests import check_provider_requests
from ..ledger.events import (
    OBSERVED_KINDS,
    RUNTIME_KINDS,
    AgentBranchReceipt,
    AgentStoreEvent,
    AgentStoreEventPage,
    BaselineRecord,
    payload_record,
)
from ..records import STORAGE, ApprovalRequestPart, ApprovalResponsePart, InputJoinedPart, Message, Part, Run, evolve
from . import reducer
from .driver import Access
from .ids import new_id
from .replay import Replayed, replay_events, verify_snapshot


class AgentRuntimeStore(Protocol):
    """What the transfers use of :class:`threadline.store.aggregate.AgentRuntimeStore` (named structurally:
    the store calls into this module, so this module does not import it)."""

    _clock: Callable[[], datetime]

    async def _run(self, name: str, operation: Callable[[], Any], access: Access) -> Any: ...
    async def read_events(
        self, *, conversation_id: str, from_seq: int = 1, to_seq: int | None = None, limit: int = ...
    ) -> AgentStoreEventPage: ...
    async def list_active_runs(self, *, conversation_id: str) -> Any: ...


logger = logging.getLogger("threadline.store.transfer")

__all__ = [
    "AgentBranchResult",
    "AgentImportResult",
    "branch_conversation",
    "export_conversation",
    "import_conversation",
]


class AgentImportResult(BaseModel):
    model_config = ConfigDict(frozen=True)

    conversation_id: str
    events: int


class AgentBranchResult(BaseModel):
    model_config = ConfigDict(frozen=True)

    outcome: Literal["created", "duplicate"]
    receipt: AgentBranchReceipt


# ------------------------------------------------------------------------------------ export / import


@contextlib.contextmanager
def _collector_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector while an archive is encoded or decoded and checked.

    Those phases build millions of containers (the parsed JSON, the records, the replayed conversation)
    that all live until the phase ends and form no garbage cycles; left running, the collector traverses
    them again and again, which doubled the time of a 50 MB archive. Only synchronous work runs inside
    (no ``await``: no other task of the loop runs meanwhile); the collector is resumed, and catches up,
    when it ends, also when it raises. Nested or overlapping pauses resume it once the one that paused it
    ends."""
    paused = gc.isenabled()
    if paused:
        gc.disable()
    try:
        yield
    finally:
        if paused:
            gc.enable()


async def export_conversation(store: AgentRuntimeStore, conversation_id: str) -> bytes:
    """See :meth:`AgentRuntimeStore.export_conversation`."""
    if not isinstance(conversation_id, str) or not conversation_id:
        raise AgentRecordValidationError("conversation_id is a non-empty string", field="conversation_id")
    rows = await store._run(
        "export_conversation",
        functools.partial(reducer.load_conversation_rows, conversation_id=conversation_id),
        "read",
    )
    with _collector_paused():
        return encode_archive(
            ArchiveContent(
                conversation_id=conversation_id,
                events=rows.events,
                head=rows.head,
                messages=rows.messages,
                runs=rows.runs,
                receipts=rows.receipts,
                seeds=rows.seeds,
            )
        )


def validated_archive(data: bytes, *, max_bytes: int = MAX_ARCHIVE_BYTES) -> tuple[ArchiveContent, Replayed]:
    """The archive's content once every check passed, and its replay (see the module docstring)."""
    with _collector_paused():
        content = decode_archive(data, max_bytes=max_bytes)
        replayed = replay_events(content.conversation_id, content.events)
        verify_snapshot(replayed, content.head, content.messages, content.runs, content.receipts, content.seeds)
        problems = check_provider_requests(content.events)
    if problems:
        raise AgentArchiveRejectedError("ARCHIVE_DIGEST", f"provider records do not check: {problems[0]}")
    return content, replayed


async def import_conversation(
    store: AgentRuntimeStore, data: bytes, *, max_bytes: int = MAX_ARCHIVE_BYTES
) -> AgentImportResult:
    """See :meth:`AgentRuntimeStore.import_conversation`."""
    try:
        content, _ = validated_archive(data, max_bytes=max_bytes)
    except AgentArchiveRejectedError as error:
        logger.warning("import refused, nothing written: %s (at %s)", error, error.where or "the archive")
        raise
    rows = reducer.ConversationRows(
        head=content.head,
        messages=content.messages,
        runs=content.runs,
        receipts=content.receipts,
        seeds=content.seeds,
        events=content.events,
    )
    try:
        await store._run("import_conversation", functools.partial(reducer.restore_conversation, rows=rows), "write")
    except AgentIdempotencyConflictError as error:
        logger.warning("import of %r refused: the conversation exists in this store", content.conversation_id)
        raise AgentArchiveRejectedError(
            "IMPORT_TARGET_EXISTS",
            f"conversation {content.conversation_id!r} exists in this store; import into a store without it, "
            "or branch it into a new conversation id",
        ) from error
    return AgentImportResult(conversation_id=content.conversation_id, events=len(content.events))


# ---------------------------------------------------------------------------------------------- branch


def _canonical_sha(value: Any) -> str:
    return hashlib.sha256(rfc8785.dumps(value)).hexdigest()


def _source_selector(source: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
    if not isinstance(source, Mapping):
        raise AgentRecordValidationError("source is a mapping with a 'kind'", field="source")
    kind = source.get("kind")
    if kind == "conversation":
        extra = set(source) - {"kind", "conversation_id", "through_run_id"}
        cid, through = source.get("conversation_id"), source.get("through_run_id")
        if (
            extra
            or not isinstance(cid, str)
            or not cid
            or (through is not None and (not isinstance(through, str) or not through))
        ):
            raise AgentRecordValidationError(
                "source is {'kind': 'conversation', 'conversation_id': str, 'through_run_id'?: str}", field="source"
            )
        return kind, {"kind": kind, "conversation_id": cid, **({"through_run_id": through} if through else {})}
    if kind == "archive":
        data, through = source.get("bytes"), source.get("through_run_id")
        if (
            set(source) - {"kind", "bytes", "through_run_id"}
            or not isinstance(data, bytes | bytearray)
            or (through is not None and (not isinstance(through, str) or not through))
        ):
            raise AgentRecordValidationError(
                "source is {'kind': 'archive', 'bytes': bytes, 'through_run_id'?: str}", field="source"
            )
        selector = {"kind": kind, "sha256": hashlib.sha256(bytes(data)).hexdigest()}
        if through is not None:
            selector["through_run_id"] = through
        return kind, selector
    raise AgentRecordValidationError(f"source kind is 'conversation' or 'archive', got {kind!r}", field="source.kind")


async def branch_conversation(
    store: AgentRuntimeStore,
    *,
    request_key: str,
    destination_conversation_id: str,
    source: Mapping[str, Any],
    artifact_authorization: Any = None,
) -> AgentBranchResult:
    """See :func:`_branch` (a refusal is logged, and raised)."""
    try:
        return await _branch(
            store,
            request_key=request_key,
            destination_conversation_id=destination_conversation_id,
            source=source,
            artifact_authorization=artifact_authorization,
        )
    except AgentBranchRefusedError as error:
        logger.warning("branch into %r refused, nothing written: %s", destination_conversation_id, error)
        raise


async def _branch(
    store: AgentRuntimeStore,
    *,
    request_key: str,
    destination_conversation_id: str,
    source: Mapping[str, Any],
    artifact_authorization: Any = None,
) -> AgentBranchResult:
    """Copy a settled prefix of a conversation (``source={"kind": "conversation", "conversation_id",
    "through_run_id"?}``) or of an archive (``{"kind": "archive", "bytes"}``) into
    ``destination_conversation_id`` as an independent conversation. The host authorizes the caller first.

    ``through_run_id`` selects that run's ending (its terminal, or its abandon); omitted, the settled tip
    (compaction recorded after the last run included). The selected prefix must hold no queued or acquired
    run (``BRANCH_RUN_ACTIVE``); a later active run does not stop an earlier prefix. No provider or tool
    runs. The copy gets new engine identities (runs, messages, operations, approvals); owners, fencing tokens and
    approval signatures are removed; its journal starts with one ``runtime/baseline`` holding the copied
    state and the :class:`AgentBranchReceipt`, then the source's provider records (bodies unchanged,
    run ids rekeyed) and, as inert ``runtime/branch-observation`` records, its state, schedule, child,
    retry, approval-rejection and durability facts, which never repopulate state. Selected history with
    spills needs ``artifact_authorization``. Message metadata is copied as it is, so metadata holding a key
    that names an engine identity (:data:`RUNTIME_REFERENCE_KEYS`) is refused (``BRANCH_METADATA_REFERENCE``)
    rather than carry a source identity into the copy.

    Idempotent: the same ``request_key``, destination and selector return the original receipt
    (``duplicate``), even after the source or the destination moved on; any other request for that
    destination is refused (``BRANCH_REQUEST_CONFLICT`` / ``BRANCH_DESTINATION_EXISTS``), and nothing is
    overwritten. Every refusal happens before any write; the write is one transaction. The next ordinary
    ``submit`` to the destination continues the copied history."""
    if not isinstance(request_key, str) or not request_key:
        raise AgentRecordValidationError("request_key is a non-empty string", field="request_key")
    if not isinstance(destination_conversation_id, str) or not destination_conversation_id:
        raise AgentRecordValidationError(
            "destination_conversation_id is a non-empty string", field="destination_conversation_id"
        )
    kind, selector = _source_selector(source)
    try:
        authorization = to_jsonable_python(artifact_authorization)
        fingerprint = _canonical_sha(
            {
                "request_key": request_key,
                "destination_conversation_id": destination_conversation_id,
                "source": selector,
                "artifact_authorization": authorization,
            }
        )
    except Exception as error:
        raise AgentRecordValidationError(
            f"artifact_authorization is JSON data: {error}", field="artifact_authorization"
        ) from error

    existing = await _existing_branch(store, destination_conversation_id)
    if existing is not None:
        if existing.request_key == request_key and existing.request_fingerprint == fingerprint:
            return AgentBranchResult(outcome="duplicate", receipt=existing)
        if existing.request_key == request_key:
            raise AgentBranchRefusedError(
                "BRANCH_REQUEST_CONFLICT",
                f"request_key {request_key!r} already created {destination_conversation_id!r} from another "
                "request; use a new key and destination",
            )
    if existing is not None or await _exists(store, destination_conversation_id):
        raise AgentBranchRefusedError(
            "BRANCH_DESTINATION_EXISTS",
            f"conversation {destination_conversation_id!r} exists; a branch never overwrites: choose a new id",
        )

    if kind == "conversation":
        try:
            rows = await store._run(
                "branch_conversation.read",
                functools.partial(reducer.load_conversation_rows, conversation_id=selector["conversation_id"]),
                "read",
            )
        except AgentRecordNotFoundError as error:
            raise AgentBranchRefusedError(
                "BRANCH_SOURCE_UNKNOWN", f"conversation {selector['conversation_id']!r} does not exist"
            ) from error
        source_cid, events = rows.head.conversation_id, rows.events
        replay_all = None
    else:
        try:
            content, replay_all = validated_archive(bytes(source["bytes"]))
        except AgentArchiveRejectedError as error:
            raise AgentBranchRefusedError("BRANCH_SOURCE_INVALID", str(error)) from error
        source_cid, events = content.conversation_id, content.events
    through = selector.get("through_run_id")
    full = replay_all or replay_events(source_cid, events)
    if through is not None:
        boundary = full.ended_at.get(through)
        if boundary is None:
            if through in full.runs:
                raise AgentBranchRefusedError(
                    "BRANCH_RUN_ACTIVE", f"run {through!r} has not ended; branch through a run that has"
                )
            where = " (a migrated baseline has no per-run boundary: omit through_run_id)" if full.baseline else ""
            raise AgentBranchRefusedError("BRANCH_RUN_UNKNOWN", f"the source has no run {through!r}{where}")
        state = replay_events(source_cid, events, through_seq=boundary)
    else:
        boundary, state = full.through, full
    active = [r.id for r in state.active_runs]
    if active:
        raise AgentBranchRefusedError(
            "BRANCH_RUN_ACTIVE",
            f"the selected prefix still has active runs {active}; branch through an earlier run, or settle them",
        )
    selected = [e for e in events if e.seq <= boundary]
    if kind == "conversation":  # an archive's provider records were checked with the rest of it
        with _collector_paused():
            problems = check_provider_requests(selected)
        if problems:  # records appended by hand that an import of the copy would refuse
            raise AgentBranchRefusedError(
                "BRANCH_SOURCE_INVALID",
                f"the source's provider records do not check: {problems[0]}; a copy could not be imported",
            )
    _refuse_runtime_references(state)
    if any(e.kind == "spill/created" for e in selected) and artifact_authorization is None:
        raise AgentBranchRefusedError(
            "BRANCH_ARTIFACTS", "the selected history has spills: pass an explicit artifact_authorization"
        )
    assert state.head is not None
    now = store._clock()
    source_digest = _canonical_sha(
        {
            "events": [to_jsonable_python(e) for e in selected],
            "snapshot": _snapshot_json(state),
        }
    )
    receipt = AgentBranchReceipt(
        request_key=request_key,
        destination_conversation_id=destination_conversation_id,
        source_kind=kind,  # type: ignore[arg-type]
        source_conversation_id=source_cid,
        through_run_id=through,
        source_seq=boundary,
        source_version=state.head.version,
        source_digest=source_digest,
        request_fingerprint=fingerprint,
        created_at=now,
    )
    rows = _rekeyed(state, selected, destination_conversation_id, receipt, now)
    try:
        await store._run("branch_conversation", functools.partial(reducer.restore_conversation, rows=rows), "write")
    except AgentIdempotencyConflictError:
        again = await _existing_branch(store, destination_conversation_id)
        if again is not None and again.request_key == request_key and again.request_fingerprint == fingerprint:
            return AgentBranchResult(outcome="duplicate", receipt=again)  # a concurrent retry won
        raise AgentBranchRefusedError(
            "BRANCH_DESTINATION_EXISTS", f"conversation {destination_conversation_id!r} was created meanwhile"
        ) from None
    return AgentBranchResult(outcome="created", receipt=receipt)


RUNTIME_REFERENCE_KEYS = frozenset(
    {
        *("conversation_id", "run_id", "message_id", "assistant_message_id", "input_message_ids"),
        *("operation_id", "approval_id", "event_id", "spill_id", "owner_id", "fencing_token"),
        *("conversationId", "runId", "messageId", "assistantMessageId", "inputMessageIds"),
        *("operationId", "approvalId", "eventId", "spillId", "ownerId", "fencingToken"),
    }
)
"""Keys that name an engine identity. Message metadata is opaque data a branch copies as it is, so such a
key there would carry a source identity into the copy unchanged (every typed reference gets a new id):
:func:`branch_conversation` refuses it (``BRANCH_METADATA_REFERENCE``) instead. threadline itself never
writes one into metadata."""


def _refuse_runtime_references(state: Replayed) -> None:
    """``BRANCH_METADATA_REFERENCE`` when the metadata of a copied message (or of an admitted input), or the
    provider metadata of one of its parts (``parts[i].envelope.data``: reasoning, tool-call, text and provider
    parts), holds a :data:`RUNTIME_REFERENCE_KEYS` key at any depth, naming the message and the path."""
    owners = [*state.messages.values(), *(r.input for r in state.receipts.values())]
    for message in owners:
        stack: list[tuple[str, Any]] = [("metadata", message.metadata)]
        for index, part in enumerate(message.parts):
            envelope = getattr(part, "envelope", None)
            if envelope is not None:
                stack.append((f"parts[{index}].envelope.data", envelope.data))
        while stack:
            path, value = stack.pop()
            if isinstance(value, dict):
                for key, item in value.items():
                    if key in RUNTIME_REFERENCE_KEYS:
                        raise AgentBranchRefusedError(
                            "BRANCH_METADATA_REFERENCE",
                            f"message {message.id!r} has the runtime reference key {key!r} at {path}: metadata "
                            "is copied as it is and would carry a source identity into the branch; move it out "
                            "of the metadata (or rename the key) before branching",
                        )
                    stack.append((f"{path}.{key}", item))
            elif isinstance(value, list):
                stack.extend((f"{path}[{i}]", item) for i, item in enumerate(value))


async def _exists(store: AgentRuntimeStore, conversation_id: str) -> bool:
    page = await store.read_events(conversation_id=conversation_id, from_seq=1, limit=1)
    if page.items:
        return True
    snapshot = await store.list_active_runs(conversation_id=conversation_id)
    return snapshot.version > 0


async def _existing_branch(store: AgentRuntimeStore, conversation_id: str) -> AgentBranchReceipt | None:
    page = await store.read_events(conversation_id=conversation_id, from_seq=1, to_seq=1, limit=1)
    if not page.items or page.items[0].kind != "runtime/baseline":
        return None
    payload = page.items[0].payload
    branch = payload.get("branch") if isinstance(payload, dict) else None
    return AgentBranchReceipt.model_validate(branch) if branch is not None else None


def _snapshot_json(state: Replayed) -> dict[str, Any]:
    def dump(records: Any) -> list[Any]:
        return [to_jsonable_python(r, context=STORAGE) for r in records]

    return {
        "head": to_jsonable_python(state.head, context=STORAGE),
        "messages": dump(sorted(state.messages.values(), key=lambda m: m.seq)),
        "runs": dump(sorted(state.runs.values(), key=lambda r: r.admission_sequence)),
        "receipts": dump(sorted(state.receipts.values(), key=lambda r: (r.version, r.idempotency_key))),
        "seeds": dump(sorted(state.seeds.values(), key=lambda s: (s.version, s.seed_key))),
    }


def _rekeyed(
    state: Replayed,
    selected: list[AgentStoreEvent],
    destination: str,
    receipt: AgentBranchReceipt,
    now: datetime,
) -> reducer.ConversationRows:
    """The copy: every engine identity new, no owner, fence or approval signature; its journal."""

    run_ids = {rid: new_id("run") for rid in state.runs}
    message_ids = {mid: new_id("msg") for mid in state.messages}
    for r in state.runs.values():  # an absorbed run's answer id names no stored message
        message_ids.setdefault(r.assistant_message_id, new_id("msg"))
    for receipt_record in state.receipts.values():
        message_ids.setdefault(receipt_record.input.id, new_id("msg"))

    approval_ids: dict[str, str] = {}

    def approval(approval_id: str) -> str:
        """One new id per source approval id: a request and its response still match in the copy."""
        return approval_ids.setdefault(approval_id, new_id("apr"))

    def part(p: Part) -> Part:
        if isinstance(p, InputJoinedPart):
            return evolve(
                p,
                {
                    "run_id": run_ids.get(p.run_id, p.run_id),
                    "message_ids": tuple(message_ids.get(m, m) for m in p.message_ids),
                },
            )
        if isinstance(p, ApprovalRequestPart):  # a new approval id, and no signature
            return evolve(p, {"approval_id": approval(p.approval_id), "signature": None})
        if isinstance(p, ApprovalResponsePart):
            return evolve(p, {"approval_id": approval(p.approval_id)})
        return p

    def message(m: Message) -> Message:
        return evolve(
            m,
            {
                "id": message_ids[m.id],
                "conversation_id": destination,
                "run_id": run_ids.get(m.run_id) if m.run_id else None,
                "compacted_by": message_ids.get(m.compacted_by) if m.compacted_by else None,
                "parts": tuple(part(p) for p in m.parts),
            },
        )

    def run(r: Run) -> Run:
        operation = r.last_operation
        if operation is not None:
            operation = evolve(operation, {"operation_id": new_id()})
        return evolve(
            r,
            {
                "id": run_ids[r.id],
                "conversation_id": destination,
                "input_message_ids": tuple(message_ids[m] for m in r.input_message_ids),
                "assistant_message_id": message_ids[r.assistant_message_id],
                "absorbed_into_run_id": run_ids.get(r.absorbed_into_run_id) if r.absorbed_into_run_id else None,
                "absorbed_run_ids": tuple(run_ids[x] for x in r.absorbed_run_ids),
                "owner_id": None,
                "fencing_token": 0,
                "lease_expires_at": None,
                "last_operation": operation,
            },
        )

    messages = tuple(message(m) for m in sorted(state.messages.values(), key=lambda m: m.seq))
    runs = tuple(run(r) for r in sorted(state.runs.values(), key=lambda r: r.admission_sequence))
    receipts = tuple(
        evolve(
            r,
            {
                "conversation_id": destination,
                "input": message(r.input) if r.input.id in message_ids else r.input,
                "run_id": run_ids[r.run_id],
                "assistant_message_id": message_ids[r.assistant_message_id],
            },
        )
        for r in sorted(state.receipts.values(), key=lambda r: (r.version, r.idempotency_key))
    )
    seeds = tuple(
        evolve(s, {"conversation_id": destination, "message_ids": tuple(message_ids[m] for m in s.message_ids)})
        for s in sorted(state.seeds.values(), key=lambda s: (s.version, s.seed_key))
    )
    entries: list[tuple[str, Any]] = []
    for event in selected:
        if event.kind in RUNTIME_KINDS:
            continue
        payload = event.payload
        if event.kind in ("provider/request", "provider/response") and isinstance(payload, dict):
            payload = {**payload, "run_id": run_ids.get(payload.get("run_id", ""), payload.get("run_id"))}
            entries.append((event.kind, payload))
        elif event.kind == "provider/message":
            entries.append((event.kind, payload))
        elif event.kind in OBSERVED_KINDS:
            if isinstance(payload, dict) and isinstance(payload.get("run_id"), str):
                payload = {**payload, "run_id": run_ids.get(payload["run_id"], payload["run_id"])}
            if isinstance(payload, dict) and payload.get("approval_id") in approval_ids:
                payload = {**payload, "approval_id": approval_ids[payload["approval_id"]]}
            observation = {
                "source_conversation_id": receipt.source_conversation_id,
                "source_seq": event.seq,
                "kind": event.kind,
                "occurred_at": to_jsonable_python(event.occurred_at),
                "payload": payload,
            }
            entries.append(("runtime/branch-observation", observation))
    assert state.head is not None
    head = evolve(state.head, {"conversation_id": destination, "event_seq": 1 + len(entries), "updated_at": now})
    baseline = BaselineRecord(
        as_of=max((m.created_at for m in messages), default=None),
        compacted=tuple(m.id for m in messages if not m.active),
        head=head,
        messages=messages,
        runs=runs,
        receipts=receipts,
        seeds=seeds,
        branch=receipt,
    )
    baseline_json = to_jsonable_python(baseline, exclude_none=True, context=STORAGE)
    events = [
        AgentStoreEvent(
            event_id=new_id("evt"),
            conversation_id=destination,
            seq=seq,
            kind=kind,
            occurred_at=now,
            payload=payload,
        )
        for seq, (kind, payload) in enumerate([("runtime/baseline", baseline_json), *entries], start=1)
    ]
    for event in events:
        payload_record(event.kind, event.payload)  # every copied record still reads as its kind
    return reducer.ConversationRows(
        head=head, messages=messages, runs=runs, receipts=receipts, seeds=seeds, events=tuple(events)
    )
