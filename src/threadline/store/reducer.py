"""The one place that decides store transitions and revision arithmetic.

Every store operation is a pure generator: it yields the row requests of :mod:`threadline.store.driver`,
receives their answers and returns a result or raises a typed error — it never performs I/O, reads a
clock or makes an id (ids and ``now`` are arguments). Drivers run these generators inside their own
transaction, so memory, SQLite and PostgreSQL stores share this logic and nothing else decides.

**Constant work per mutation.** A mutation reads the conversation head, the runs it touches (or the
active runs), the receipt for its key and the messages it changes — never the whole history. Only
:func:`load_snapshot` reads everything, for composing a prompt or compacting.

Causal order: a message gets a settled position from the head's counter when its run ends (the run's
inputs, absorbed inputs, then its answer); ``lead`` seeds take positions in a band before everything.
Unsettled messages (of active runs) follow the settled ones in run execution order.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from pydantic_core import to_jsonable_python

from ..errors import (
    AgentConversationPurgedError,
    AgentIdempotencyConflictError,
    AgentRecordNotFoundError,
    AgentRecordValidationError,
    AgentRunOrderConflictError,
    AgentRunOwnershipConflictError,
    AgentRunRevisionConflictError,
    AgentRunStateConflictError,
    AgentStoreConflictError,
)
from ..ledger.events import (
    AgentStoreEvent,
    AgentStoreEventDraft,
    AgentStoreEventPage,
    durability_effect_key,
    parts_digest,
)
from ..records import (
    ACQUIRED_RUN_STATES,
    RUN_STATE_FOR_REASON,
    STORAGE,
    TEMPLATE_TIME,
    AdmissionReceipt,
    AgentRunFailure,
    ConversationHead,
    ConversationSnapshot,
    Message,
    MessageDraft,
    Part,
    Priority,
    Run,
    RunOperation,
    SeedRecord,
    Timestamp,
    assistant_status_for,
    build,
    evolve,
    run_invariant_problem,
)
from ..usage import AgentUsage, stored_usage
from .driver import (
    HeadState,
    ListActiveRuns,
    ListConversations,
    LoadAllReceipts,
    LoadAllRuns,
    LoadAllSeeds,
    LoadEventKeys,
    LoadEvents,
    LoadHead,
    LoadHistory,
    LoadMessages,
    LoadMessagesSince,
    LoadReceipt,
    LoadReceiptByInput,
    LoadRuns,
    LoadRunsByAssistant,
    LoadRunsSince,
    LoadSeed,
    LoadSettledRange,
    LoadUnsettled,
    Mutation,
    Operation,
    PageSettled,
    Purge,
    ScanActiveRuns,
    SortKey,
    Write,
)
from .results import (
    AcceptResult,
    ActiveRuns,
    CompactionResult,
    ConversationChanges,
    ConversationPage,
    InterruptResult,
    LoadedRun,
    MessagePage,
    PurgeResult,
    RecoverablePage,
    RecoverResult,
    RunResult,
    SeedResult,
    TerminalResult,
)

MAX_PAGE_SIZE = 1000
"""Upper bound of every paged read; larger requests are refused rather than silently clamped."""

NON_COMMIT_REASONS = frozenset({"absorbed", "abandoned"})
"""Reasons only the store itself assigns: absorption happens inside an absorbing terminal, abandonment
through :func:`recover_run`."""


@dataclass(frozen=True, slots=True)
class AbsorbClaim:
    """An absorbing run's claim on a queued run whose inputs it answered (``inject``). The claim holds only
    if that run is still queued, unstarted, at ``expected_revision`` and carries exactly these inputs."""

    run_id: str
    expected_revision: int
    input_message_ids: tuple[str, ...]


# ------------------------------------------------------------------------------------------- helpers

# A record built from values the reducer vouches for (its own arithmetic and choices, ids and records that
# were validated on the way in) is a copy of a template (``build``), not a validated construction: that
# costs about three times as much, several times a turn. Each template names exactly the fields its
# construction names, so a copy reports the same fields as set. A value that did not arrive validated (a
# caller's run id, say) takes the validated construction instead, which refuses it as before.
_T = TEMPLATE_TIME
_QUEUED_RUN = Run(
    id="-",
    conversation_id="-",
    state="queued",
    revision=1,
    input_message_ids=("-",),
    assistant_message_id="-",
    priority="ordinary",
    input_policy="queue",
    admission_sequence=1,
    version=0,
    created_at=_T,
    updated_at=_T,
)
_INPUT = Message(
    id="-",
    conversation_id="-",
    role="user",
    status="committed",
    parts=(),
    run_id="-",
    metadata={},
    created_at=_T,
    position=None,
    band="history",
    seq=0,
    version=0,
)
_DRAFT = Message(
    id="-",
    conversation_id="-",
    role="assistant",
    status="streaming",
    parts=(),
    run_id="-",
    created_at=_T,
    seq=0,
    version=0,
)
_RECEIPT = AdmissionReceipt(
    conversation_id="-",
    idempotency_key="-",
    input=_INPUT,
    run_id="-",
    assistant_message_id="-",
    version=1,
    created_at=_T,
)
_ACCEPTED = AcceptResult(outcome="accepted", receipt=_RECEIPT, run=_QUEUED_RUN, version=1, coalesced=False)
_RUN_RESULT = RunResult(run=_QUEUED_RUN, version=1)
_RUN_RESULT_WITH_ASSISTANT = RunResult(run=_QUEUED_RUN, version=1, assistant=None)
_COMMITTED = TerminalResult(
    outcome="committed", run=_QUEUED_RUN, assistant=None, version=1, absorbed_runs=(), absorption_cancelled=()
)
_LOADED = LoadedRun(run=_QUEUED_RUN, version=1, assistant=None)


def _plain(*values: object) -> bool:
    """Whether every value is a non-empty ``str`` exactly (what the records' id fields hold once validated)."""
    return all(type(v) is str and v for v in values)


def _evolve(record: Run, version: int, **changes: object) -> Run:
    """``record`` with ``changes``, stamped with the head ``version`` its mutation produces (one copy)."""
    run = evolve(record, {**changes, "version": version})
    problem = run_invariant_problem(run)
    if problem:  # a reducer bug, never user input: fail loudly before anything is written
        raise AssertionError(f"reducer produced an inconsistent run {run.id}: {problem}")
    return run


def _bump(head: ConversationHead, now: Timestamp, **changes: int) -> ConversationHead:
    return evolve(head, {"version": head.version + 1, "updated_at": now, **changes})


def _stamp(mutation: Mutation) -> Mutation:
    """Stamp every written run and message with the head version this mutation produces. Records built
    with that version already (the usual case) are kept as they are; only the others are copied."""
    assert mutation.head is not None
    v = mutation.head.version
    for record in (*mutation.runs, *mutation.messages):
        if record.__dict__["version"] != v:  # (not ``.version``: pydantic's attribute hook, per record)
            break
    else:
        return mutation
    return Mutation(
        head=mutation.head,
        runs=tuple(r if r.version == v else evolve(r, {"version": v}) for r in mutation.runs),
        messages=tuple(m if m.version == v else evolve(m, {"version": v}) for m in mutation.messages),
        receipts=mutation.receipts,
        seeds=mutation.seeds,
    )


# ------------------------------------------------------------------------------------------- the ledger

_EVENT = AgentStoreEvent(
    event_id="-", conversation_id="-", seq=1, kind="runtime/transition", occurred_at=_T, payload=None
)

MAX_EVENT_PAGE = 10_000
"""The largest page :func:`read_events` returns; larger requests are refused rather than clamped."""
DEFAULT_EVENT_PAGE = 1000


def _json(value: Any) -> Any:
    """A record (or records) as the JSON a ledger payload holds: fields left at None are left out."""
    return to_jsonable_python(value, exclude_none=True)


def event_id_for(conversation_id: str, seq: int) -> str:
    """The id of an event whose operation was given none (a reducer driven by hand): derived, not drawn."""
    return "evt_" + hashlib.sha256(f"{conversation_id}\x00{seq}".encode()).hexdigest()[:32]


def _events(
    head: ConversationHead,
    now: Timestamp,
    event_id: str,
    entries: Sequence[tuple[str, Any, bool | None]],
) -> tuple[ConversationHead, tuple[AgentStoreEvent, ...]]:
    """``entries`` (kind, payload, ignorable) as the conversation's next events, all at ``now``, and the
    head that counts them. The first takes ``event_id``, the others ``event_id.k``."""
    cid = head.conversation_id
    seq = head.event_seq
    out = []
    for k, (kind, payload, ignorable) in enumerate(entries):
        seq += 1
        eid = (event_id if k == 0 else f"{event_id}.{k}") if event_id else event_id_for(cid, seq)
        values = {
            "event_id": eid,
            "conversation_id": cid,
            "seq": seq,
            "kind": kind,
            "occurred_at": now,
            "payload": payload,
        }
        if ignorable:
            values["ignorable"] = True
        out.append(build(_EVENT, values))
    return evolve(head, {"event_seq": seq}), tuple(out)


def _recorded(
    mutation: Mutation,
    now: Timestamp,
    event_id: str,
    kind: str,
    command: dict[str, Any],
    declared: Sequence[AgentStoreEventDraft] = (),
) -> Mutation:
    """``mutation`` with its ledger events: the ``declared`` ones, then its ``runtime/transition``
    record (``kind`` is the transition's ``type``, ``command`` its ``input``). The head counts them."""
    assert mutation.head is not None
    transition = {"type": kind, "input": command, "version": mutation.head.version}
    entries = [(d.kind, d.payload, d.ignorable) for d in declared]
    entries.append(("runtime/transition", transition, None))
    head, events = _events(mutation.head, now, event_id, entries)
    return Mutation(
        head=head,
        runs=mutation.runs,
        messages=mutation.messages,
        receipts=mutation.receipts,
        seeds=mutation.seeds,
        events=events,
    )


def _owned_command(run_id: str, expected_revision: int, owner_id: str, fencing_token: int) -> dict[str, Any]:
    return {
        "run_id": run_id,
        "expected_revision": expected_revision,
        "owner_id": owner_id,
        "fencing_token": fencing_token,
    }


def _with_spend(command: dict[str, Any], operation: RunOperation | None, usage: AgentUsage | None) -> None:
    if operation is not None:
        command["operation"] = _json(operation)
    if usage is not None:
        command["usage"] = stored_usage(usage)


def _declared(conversation_id: str, drafts: Sequence[AgentStoreEventDraft]) -> Operation[list[AgentStoreEventDraft]]:
    """The declared events to append: a ``provider/message`` body the conversation's ledger holds already
    (or that appears twice here) is written once, the first time (one indexed read of those digests)."""
    if not drafts:
        return []
    shas = tuple(dict.fromkeys(d.payload["sha256"] for d in drafts if d.kind == "provider/message"))  # type: ignore[index,call-overload]
    found: list[tuple[str, int]] = (yield LoadEventKeys(conversation_id, shas)) if shas else []
    present = {sha for sha, _ in found}
    out = []
    for d in drafts:
        if d.kind == "provider/message":
            sha = d.payload["sha256"]  # type: ignore[index,call-overload]
            if sha in present:
                continue
            present.add(sha)
        out.append(d)
    return out


def new_head(conversation_id: str, now: Timestamp) -> ConversationHead:
    """A conversation's head before its first transition (version 0, created ``now``)."""
    return ConversationHead(conversation_id=conversation_id, version=0, created_at=now, updated_at=now)


def _require_page_size(limit: int) -> None:
    if not 1 <= limit <= MAX_PAGE_SIZE:
        raise AgentRecordValidationError(
            f"limit must be between 1 and {MAX_PAGE_SIZE}, got {limit}; page through larger reads", field="limit"
        )


def _live_head(state: HeadState, conversation_id: str) -> ConversationHead:
    if state.purged:
        raise AgentConversationPurgedError(conversation_id)
    if state.head is None:
        raise AgentRecordNotFoundError(f"unknown conversation {conversation_id!r}")
    return state.head


def _not_purged(state: HeadState, conversation_id: str) -> None:
    if state.purged:
        raise AgentConversationPurgedError(conversation_id)


def _one_run(runs: list[Run], conversation_id: str, run_id: str) -> Run:
    for run in runs:
        if run.id == run_id:
            return run
    raise AgentRecordNotFoundError(f"conversation {conversation_id!r} has no run {run_id!r}")


def _by_id(messages: Iterable[Message]) -> dict[str, Message]:
    return {m.id: m for m in messages}


def _check_owned(run: Run, expected_revision: int, owner_id: str, fencing_token: int, action: str) -> None:
    """An owned mutation needs an acquired run, the same owner and token, and the expected revision."""
    error: type[AgentStoreConflictError]
    f = run.__dict__  # every owned mutation checks these: read without pydantic's attribute hook
    if f["state"] not in ACQUIRED_RUN_STATES:
        error, why = AgentRunStateConflictError, f"it is {run.state}"
    elif f["owner_id"] != owner_id or f["fencing_token"] != fencing_token:
        error = AgentRunOwnershipConflictError
        why = f"owned by {run.owner_id!r} with fencing token {run.fencing_token}, not {owner_id!r} with {fencing_token}"
    elif f["revision"] != expected_revision:
        error, why = AgentRunRevisionConflictError, f"expected revision {expected_revision}, store has {run.revision}"
    else:
        return
    raise error(
        f"cannot {action} run {run.id!r}: {why}",
        conversation_id=run.conversation_id,
        run_id=run.id,
        actual_revision=run.revision,
        run=run,
    )


def _same_input(stored: Message, proposed: MessageDraft) -> bool:
    return stored.role == proposed.role and stored.parts == proposed.parts and stored.metadata == proposed.metadata


def _message(
    draft: MessageDraft,
    conversation_id: str,
    *,
    status: str,
    seq: int,
    now: Timestamp,
    run_id: str | None = None,
    position: int | None = None,
    band: str = "history",
) -> Message:
    return Message.model_validate(
        {
            "id": draft.id,
            "conversation_id": conversation_id,
            "role": draft.role,
            "status": status,
            "parts": draft.parts,
            "run_id": run_id,
            "metadata": draft.metadata,
            "created_at": now,
            "position": position,
            "band": band,
            "seq": seq,
        }
    )


def execution_order(runs: Iterable[Run]) -> list[Run]:
    """Active runs in durable execution order (see :attr:`Run.execution_order_key`)."""
    return sorted((r for r in runs if r.active), key=lambda r: r.execution_order_key)


def order_recoverable(runs: Iterable[Run]) -> list[list[Run]]:
    """Group scanned runs by conversation and restore each conversation's execution order.

    Pages of :func:`scan_recoverable` come in paging order; this is the order work must resume in:
    started work by execution sequence, then urgent (``interrupt-next``) queued runs FIFO, then ordinary
    queued runs FIFO — never by id, timestamp or page boundary.
    """
    groups: dict[str, list[Run]] = {}
    for run in runs:
        groups.setdefault(run.conversation_id, []).append(run)
    return [execution_order(groups[cid]) for cid in sorted(groups)]


def _unsettled_key(message: Message, rank: dict[str, tuple[int, int, int]]) -> SortKey:
    order = rank.get(message.run_id or "", (9, 0, 0))
    return (2, order[0], order[1], 1 if message.role == "assistant" else 0, message.seq)


def causal_order(messages: Iterable[Message], active_runs: Iterable[Run]) -> list[Message]:
    """Messages in causal order: settled ones by position, then those of active runs by execution order
    (inside a run, inputs before the assistant)."""
    rank = {run.id: run.execution_order_key for run in active_runs if run.active}
    settled, unsettled = [], []
    for m in messages:
        (settled if m.position is not None else unsettled).append(m)
    settled.sort(key=lambda m: m.sort_key)
    unsettled.sort(key=lambda m: _unsettled_key(m, rank))
    return settled + unsettled


def _settle(position: int, messages: Sequence[Message], version: int) -> tuple[int, list[Message]]:
    """Give ``messages`` the settled positions after ``position``, in the order given, stamped with the head
    ``version`` their mutation produces; returns the last position taken and the messages."""
    settled = []
    for m in messages:
        if m.position is not None:
            settled.append(m if m.version == version else evolve(m, {"version": version}))
            continue
        position += 1
        settled.append(evolve(m, {"position": position, "version": version}))
    return position, settled


# ---------------------------------------------------------------------------------------- admission


def accept_input_and_assign_run(
    *,
    conversation_id: str,
    idempotency_key: str,
    input: MessageDraft,
    run_id: str,
    assistant_message_id: str,
    priority: Priority = "ordinary",
    input_policy: str = "queue",
    coalesce: bool = False,
    now: Timestamp,
    fresh_ids: frozenset[str] = frozenset(),
    start_for: str | None = None,
    lease_expires_at: Timestamp | None = None,
    operation: RunOperation | None = None,
    event_id: str = "",
) -> Operation[AcceptResult]:
    """Commit the input, its admission receipt and its queued run — or coalesce the input into the single
    queued ordinary successor — in one transaction. A repeated key returns the original receipt.

    ``fresh_ids``: ids the caller has just drawn at random (128 bits): none can exist yet, so the reads
    that look for an earlier use of them are skipped.

    ``start_for`` (an owner id): when the new run is the conversation's only active run, nothing queued or
    running before it, the same commit also acquires it for that owner, exactly as :func:`acquire_run`
    would (``lease_expires_at``; with ``operation``, the empty draft and the first request's admission).
    The result's run is then ``running``; otherwise it is queued as usual."""
    if input.role not in ("user", "tool"):
        raise AgentRecordValidationError(
            "an admitted input has role 'user' (or 'tool' for an approval response)", field="input.role"
        )
    state: HeadState = yield LoadHead(conversation_id)
    _not_purged(state, conversation_id)
    receipt: AdmissionReceipt | None = yield LoadReceipt(conversation_id, idempotency_key)
    if receipt is not None:
        if not _same_input(receipt.input, input):
            raise AgentIdempotencyConflictError(
                f"idempotency key {idempotency_key!r} was already used for different input; use a new key",
                conversation_id=conversation_id,
            )
        assert state.head is not None
        return (yield from _duplicate(receipt, state.head.version))
    if input.id not in fresh_ids and (
        (yield LoadReceiptByInput(conversation_id, input.id)) is not None
        or (yield LoadMessages(conversation_id, (input.id,)))
    ):
        raise AgentIdempotencyConflictError(
            f"input message id {input.id!r} already exists under another idempotency key; reuse that key or a new id",
            conversation_id=conversation_id,
        )
    head = state.head or new_head(conversation_id, now)
    active: list[Run] = yield ListActiveRuns(conversation_id)
    target = None
    if coalesce and priority == "ordinary":
        candidates = [
            r for r in active if r.state == "queued" and r.priority == "ordinary" and r.execution_sequence is None
        ]
        target = max(candidates, key=lambda r: r.admission_sequence, default=None)
    # caller-chosen ids are checked against the runs' answer ids (one a run will write, wrote, or — absorbed —
    # never writes: each names exactly one answer), in one indexed read; drawn ids cannot collide
    chosen_answer = target is None and assistant_message_id not in fresh_ids and assistant_message_id != input.id
    wanted = (*((input.id,) if input.id not in fresh_ids else ()), *((assistant_message_id,) if chosen_answer else ()))
    taken: list[Run] = (yield LoadRunsByAssistant(conversation_id, wanted)) if wanted else []
    clash = next((r for r in taken if r.assistant_message_id == input.id), None)
    if clash is not None:
        raise AgentIdempotencyConflictError(
            f"input message id {input.id!r} is the assistant message id of run {clash.id!r}; choose another "
            "input id (or omit it and let the store draw one)",
            conversation_id=conversation_id,
        )
    if target is None and run_id not in fresh_ids and (yield LoadRuns(conversation_id, (run_id,))):
        raise AgentIdempotencyConflictError(
            f"run id {run_id!r} already exists in conversation {conversation_id!r}", conversation_id=conversation_id
        )
    # a caller-chosen assistant id names exactly one answer: not the input, not a stored message, not another
    # run's answer
    if (
        target is None
        and assistant_message_id not in fresh_ids
        and (
            assistant_message_id == input.id
            or any(r.assistant_message_id == assistant_message_id for r in taken)
            or (yield LoadMessages(conversation_id, (assistant_message_id,)))
        )
    ):
        raise AgentIdempotencyConflictError(
            f"assistant message id {assistant_message_id!r} is already used in conversation "
            f"{conversation_id!r}; choose a new id or let the store draw one",
            conversation_id=conversation_id,
        )

    seq = head.message_seq + 1
    admission_seq = head.admission_seq + (target is None)
    head = _bump(head, now, message_seq=seq, admission_seq=admission_seq)
    if target is not None:
        run = _evolve(
            target,
            head.version,
            revision=target.revision + 1,
            input_message_ids=(*target.input_message_ids, input.id),
            updated_at=now,
        )
    else:
        fields = {
            "id": run_id,
            "conversation_id": conversation_id,
            "state": "queued",
            "revision": 1,
            "input_message_ids": (input.id,),
            "assistant_message_id": assistant_message_id,
            "priority": priority,
            "input_policy": input_policy,
            "admission_sequence": head.admission_seq,
            "version": head.version,
            "created_at": now,
            "updated_at": now,
        }
        plain = _plain(run_id, conversation_id, assistant_message_id, priority) and type(input_policy) is str
        run = build(_QUEUED_RUN, fields) if plain else Run(**fields)  # type: ignore[arg-type]
    if input.metadata or type(conversation_id) is not str:  # metadata is copied by validation; none is common
        message = _message(input, conversation_id, status="committed", seq=seq, now=now, run_id=run.id)
        message = evolve(message, {"version": head.version})
    else:
        message = build(
            _INPUT,
            {
                "id": input.id,
                "conversation_id": conversation_id,
                "role": input.role,
                "parts": input.parts,
                "run_id": run.id,
                "metadata": {},
                "created_at": now,
                "seq": seq,
                "version": head.version,
            },
        )
    receipt = {
        "conversation_id": conversation_id,
        "idempotency_key": idempotency_key,
        "input": message,
        "run_id": run.id,
        "assistant_message_id": run.assistant_message_id,
        "version": head.version,
        "created_at": now,
    }
    plain = type(idempotency_key) is str and type(conversation_id) is str
    new_receipt = build(_RECEIPT, receipt) if plain else AdmissionReceipt(**receipt)  # type: ignore[arg-type]
    messages: tuple[Message, ...] = (message,)
    if start_for is not None and target is None and not active:
        head, run, drafts = yield from _start(head, run, start_for, lease_expires_at, operation, now, fresh_ids)
        messages += drafts
    command: dict[str, Any] = {
        "idempotency_key": idempotency_key,
        "input": _json(input),
        "run_id": run_id,
        "assistant_message_id": assistant_message_id,
    }
    if priority != "ordinary":
        command["priority"] = priority
    if input_policy != "queue":
        command["input_policy"] = input_policy
    if coalesce:
        command["coalesce"] = True
    if start_for is not None:
        command["start_for"] = start_for
        if lease_expires_at is not None:
            command["lease_expires_at"] = _json(lease_expires_at)
        if operation is not None:
            command["operation"] = _json(operation)
    w = _stamp(Mutation(head=head, runs=(run,), messages=messages, receipts=(new_receipt,)))
    w = _recorded(w, now, event_id, "accept", command)
    yield Write(w)
    return build(
        _ACCEPTED, {"receipt": new_receipt, "run": w.runs[0], "version": head.version, "coalesced": target is not None}
    )


def _duplicate(receipt: AdmissionReceipt, version: int) -> Operation[AcceptResult]:
    loaded = yield from _load_answer(receipt.conversation_id, receipt.run_id)
    if loaded is None:  # a receipt always has its run; a missing one is a damaged store
        raise AgentRecordNotFoundError(f"receipt names run {receipt.run_id!r}, which the store does not hold")
    run, answer = loaded
    return AcceptResult(
        outcome="duplicate",
        receipt=receipt,
        run=run,
        version=version,
        answer=answer,
        answered_by_run_id=run.absorbed_into_run_id or (run.id if answer is not None else None),
    )


def _load_answer(conversation_id: str, run_id: str) -> Operation[tuple[Run, Message | None] | None]:
    runs: list[Run] = yield LoadRuns(conversation_id, (run_id,))
    if not runs:
        return None
    run = runs[0]
    if not run.terminal:
        return run, None
    answering = run
    if run.absorbed_into_run_id is not None:
        found: list[Run] = yield LoadRuns(conversation_id, (run.absorbed_into_run_id,))
        if not found:
            return run, None
        answering = found[0]
    messages: list[Message] = yield LoadMessages(conversation_id, (answering.assistant_message_id,))
    return run, (messages[0] if messages else None)


# ----------------------------------------------------------------------------------- owned mutations


def acquire_run(
    *,
    conversation_id: str,
    run_id: str,
    expected_revision: int,
    owner_id: str,
    now: Timestamp,
    lease_expires_at: Timestamp | None = None,
    operation: RunOperation | None = None,
    event_id: str = "",
) -> Operation[RunResult]:
    """Take ownership of a queued run: verifies no other run is acquired and that this run is first in
    execution order, then increments its revision and fencing token.

    With ``operation`` (the first model request, ``started``) the same commit also does what the run's
    first checkpoint would: an empty streaming assistant draft and ``last_operation``."""
    head = _live_head((yield LoadHead(conversation_id)), conversation_id)
    active: list[Run] = yield ListActiveRuns(conversation_id)
    ordered = execution_order(active)
    run = next((r for r in ordered if r.id == run_id), None)
    if run is None:
        run = _one_run((yield LoadRuns(conversation_id, (run_id,))), conversation_id, run_id)
    ctx = {"conversation_id": conversation_id, "run_id": run_id, "actual_revision": run.revision, "run": run}
    if run.state != "queued":
        raise AgentRunStateConflictError(f"cannot acquire run {run_id!r}: it is {run.state}", **ctx)
    if run.revision != expected_revision:
        raise AgentRunRevisionConflictError(
            f"cannot acquire run {run_id!r}: expected revision {expected_revision}, store has {run.revision}", **ctx
        )
    blocking = next((r for r in ordered if r.acquired), None) or ordered[0]
    if blocking.id != run_id:
        raise AgentRunOrderConflictError(
            f"cannot acquire run {run_id!r}: run {blocking.id!r} ({blocking.state}) goes first", **ctx
        )
    head, acquired, drafts = yield from _start(_bump(head, now), run, owner_id, lease_expires_at, operation, now)
    command: dict[str, Any] = {"run_id": run_id, "expected_revision": expected_revision, "owner_id": owner_id}
    if lease_expires_at is not None:
        command["lease_expires_at"] = _json(lease_expires_at)
    if operation is not None:
        command["operation"] = _json(operation)
    w = _recorded(_stamp(Mutation(head=head, runs=(acquired,), messages=drafts)), now, event_id, "acquire", command)
    yield Write(w)
    return build(
        _RUN_RESULT_WITH_ASSISTANT,
        {"run": w.runs[0], "version": head.version, "assistant": w.messages[0] if drafts else None},
    )


def _start(
    head: ConversationHead,
    run: Run,
    owner_id: str,
    lease_expires_at: Timestamp | None,
    operation: RunOperation | None,
    now: Timestamp,
    fresh_ids: frozenset[str] = frozenset(),
) -> Operation[tuple[ConversationHead, Run, tuple[Message, ...]]]:
    """The acquisition of ``run`` (checked by the caller) inside a change whose head is bumped already:
    its execution sequence, owner, fencing token and lease, and with ``operation`` the empty draft."""
    execution_sequence = run.execution_sequence
    counters: dict[str, int] = {}
    if execution_sequence is None:
        execution_sequence = counters["execution_seq"] = head.execution_seq + 1
    drafts: tuple[Message, ...] = ()
    if operation is not None:
        # a run acquired again (requeued after a crash) keeps the draft its earlier execution checkpointed:
        # the loop resumes from it
        fresh = run.assistant_message_id in fresh_ids
        head, draft = yield from _draft(head, run, None, now, fresh=fresh, counters=counters)
        drafts = (draft,)
    elif counters:
        head = evolve(head, counters)
    acquired = _evolve(
        run,
        head.version,
        state="running",
        revision=run.revision + 1,
        fencing_token=run.fencing_token + 1,
        owner_id=owner_id,
        execution_sequence=execution_sequence,
        lease_expires_at=lease_expires_at,
        acquired_at=now,
        updated_at=now,
        **({"last_operation": operation} if operation is not None else {}),
    )
    return head, acquired, drafts


def _draft(
    head: ConversationHead,
    run: Run,
    parts: Sequence[Part] | None,
    now: Timestamp,
    fresh: bool = False,
    counters: dict[str, int] | None = None,
) -> Operation[tuple[ConversationHead, Message]]:
    """The run's streaming assistant draft holding ``parts`` (None: the parts it holds already, or none), and
    the head that writes it (bumped; the caller has bumped it already when this is part of a larger change,
    so only ``message_seq`` moves, with the caller's other ``counters`` in the same copy). ``fresh``: the
    draft's id was just drawn at random, so no such message can exist yet."""
    existing: list[Message] = [] if fresh else (yield LoadMessages(run.conversation_id, (run.assistant_message_id,)))
    if existing:
        kept = existing[0].parts if parts is None else tuple(parts)
        if counters:
            head = evolve(head, counters)
        return head, evolve(existing[0], {"parts": kept, "status": "streaming", "version": head.version})
    head = evolve(head, {**(counters or {}), "message_seq": head.message_seq + 1})
    draft = build(
        _DRAFT,
        {
            "id": run.assistant_message_id,
            "conversation_id": run.conversation_id,
            "parts": tuple(parts or ()),
            "run_id": run.id,
            "metadata": {},
            "created_at": now,
            "seq": head.message_seq,
            "version": head.version,
        },
    )
    return head, draft


def checkpoint_run_assistant(
    *,
    conversation_id: str,
    run_id: str,
    expected_revision: int,
    owner_id: str,
    fencing_token: int,
    parts: Sequence[Part],
    now: Timestamp,
    operation: RunOperation | None = None,
    usage: AgentUsage | None = None,
    event_id: str = "",
    events: Sequence[AgentStoreEventDraft] = (),
) -> Operation[RunResult]:
    """Write the run's streaming assistant draft (and, when given, its ``last_operation`` and cumulative
    ``usage`` in the same transaction). Verifies owner, fencing token and revision."""
    head = _live_head((yield LoadHead(conversation_id)), conversation_id)
    run = _one_run((yield LoadRuns(conversation_id, (run_id,))), conversation_id, run_id)
    _check_owned(run, expected_revision, owner_id, fencing_token, "checkpoint")
    head, draft = yield from _draft(_bump(head, now), run, parts, now)
    changes: dict[str, object] = {"last_operation": operation} if operation is not None else {}
    if usage is not None:
        changes["usage"] = usage
    updated = _evolve(run, head.version, revision=run.revision + 1, updated_at=now, **changes)
    declared = yield from _declared(conversation_id, events)
    sha, count, size = parts_digest(draft.parts)
    command = _owned_command(run_id, expected_revision, owner_id, fencing_token)
    command["assistant"] = {"id": draft.id, "status": "streaming", "sha256": sha, "parts": count, "bytes": size}
    _with_spend(command, operation, usage)
    w = _stamp(Mutation(head=head, runs=(updated,), messages=(draft,)))
    yield Write(_recorded(w, now, event_id, "checkpoint", command, declared))
    return build(_RUN_RESULT_WITH_ASSISTANT, {"run": w.runs[0], "version": head.version, "assistant": w.messages[0]})


def record_run_operation(
    *,
    conversation_id: str,
    run_id: str,
    expected_revision: int,
    owner_id: str,
    fencing_token: int,
    operation: RunOperation,
    now: Timestamp,
    usage: AgentUsage | None = None,
    event_id: str = "",
    events: Sequence[AgentStoreEventDraft] = (),
) -> Operation[RunResult]:
    """Durably record the run's ``last_operation`` phase (a model request is admitted by this write), and
    its cumulative ``usage`` when given."""
    head = _live_head((yield LoadHead(conversation_id)), conversation_id)
    run = _one_run((yield LoadRuns(conversation_id, (run_id,))), conversation_id, run_id)
    _check_owned(run, expected_revision, owner_id, fencing_token, "record an operation on")
    head = _bump(head, now)
    spent = {"usage": usage} if usage is not None else {}
    updated = _evolve(run, head.version, revision=run.revision + 1, last_operation=operation, updated_at=now, **spent)
    declared = yield from _declared(conversation_id, events)
    command = _owned_command(run_id, expected_revision, owner_id, fencing_token)
    _with_spend(command, operation, usage)
    w = _recorded(_stamp(Mutation(head=head, runs=(updated,))), now, event_id, "operation", command, declared)
    yield Write(w)
    return build(_RUN_RESULT, {"run": w.runs[0], "version": head.version})


def renew_run_lease(
    *,
    conversation_id: str,
    run_id: str,
    expected_revision: int,
    owner_id: str,
    fencing_token: int,
    lease_expires_at: Timestamp,
    now: Timestamp,
    event_id: str = "",
) -> Operation[RunResult]:
    """Extend the owner's lease on an acquired run."""
    head = _live_head((yield LoadHead(conversation_id)), conversation_id)
    run = _one_run((yield LoadRuns(conversation_id, (run_id,))), conversation_id, run_id)
    _check_owned(run, expected_revision, owner_id, fencing_token, "renew the lease of")
    head = _bump(head, now)
    updated = _evolve(run, head.version, revision=run.revision + 1, lease_expires_at=lease_expires_at, updated_at=now)
    command = _owned_command(run_id, expected_revision, owner_id, fencing_token)
    command["lease_expires_at"] = _json(lease_expires_at)
    w = _recorded(_stamp(Mutation(head=head, runs=(updated,))), now, event_id, "lease", command)
    yield Write(w)
    return build(_RUN_RESULT, {"run": w.runs[0], "version": head.version})


def request_run_interrupt(
    *, conversation_id: str, run_id: str, expected_revision: int | None = None, now: Timestamp, event_id: str = ""
) -> Operation[InterruptResult]:
    """Durably ask an acquired run to stop (``running`` -> ``interrupt_requested``). Its executor commits
    the terminal; a queued or terminal run is reported, not changed."""
    head = _live_head((yield LoadHead(conversation_id)), conversation_id)
    run = _one_run((yield LoadRuns(conversation_id, (run_id,))), conversation_id, run_id)
    if run.terminal:
        return InterruptResult(outcome="terminal", run=run, version=head.version)
    if expected_revision is not None and run.revision != expected_revision:
        raise AgentRunRevisionConflictError(
            f"cannot interrupt run {run_id!r}: expected revision {expected_revision}, store has {run.revision}",
            conversation_id=conversation_id,
            run_id=run_id,
            actual_revision=run.revision,
            run=run,
        )
    if run.state == "queued":
        return InterruptResult(outcome="queued", run=run, version=head.version)
    if run.state == "interrupt_requested":
        return InterruptResult(outcome="already_requested", run=run, version=head.version)
    head = _bump(head, now)
    updated = _evolve(run, head.version, state="interrupt_requested", revision=run.revision + 1, updated_at=now)
    command: dict[str, Any] = {"run_id": run_id}
    if expected_revision is not None:
        command["expected_revision"] = expected_revision
    w = _recorded(_stamp(Mutation(head=head, runs=(updated,))), now, event_id, "interrupt", command)
    yield Write(w)
    return InterruptResult(outcome="requested", run=w.runs[0], version=head.version)


def commit_run_terminal(
    *,
    conversation_id: str,
    run_id: str,
    expected_revision: int,
    owner_id: str,
    fencing_token: int,
    terminal_reason: str,
    now: Timestamp,
    parts: Sequence[Part] | None = None,
    policy_name: str | None = None,
    absorb: Sequence[AbsorbClaim] = (),
    operation: RunOperation | None = None,
    usage: AgentUsage | None = None,
    event_id: str = "",
    events: Sequence[AgentStoreEventDraft] = (),
    failure: AgentRunFailure | None = None,
) -> Operation[TerminalResult]:
    """The terminal CAS: writes the final assistant and the terminal reason, settles the run's messages,
    and — only for a completed run — absorbs the claimed queued runs in the same transaction. ``failure``
    (why a failed run failed) is kept on the run record.

    ``parts=None`` keeps the last checkpointed draft. ``operation``, when given, becomes the run's
    ``last_operation`` in the same commit (the last step's completion needs no checkpoint of its own).
    A run that is already terminal is returned as ``already_terminal`` (the caller lost; it must not
    publish a terminal event). A claim whose queued run moved (for example an input coalesced into it
    after the last step boundary) is cancelled and reported in ``absorption_cancelled``: that run will
    answer its inputs itself.
    """
    if terminal_reason in NON_COMMIT_REASONS:
        raise AgentRecordValidationError(
            f"terminal_reason {terminal_reason!r} is assigned by the store; use recover_run to abandon",
            field="terminal_reason",
        )
    if terminal_reason not in RUN_STATE_FOR_REASON:
        raise AgentRecordValidationError(f"unknown terminal_reason {terminal_reason!r}", field="terminal_reason")
    if terminal_reason == "policy_stop" and not policy_name:
        raise AgentRecordValidationError("a policy_stop terminal names its policy_name", field="policy_name")
    claim_ids = [claim.run_id for claim in absorb]
    if len(set(claim_ids)) != len(claim_ids):
        raise AgentRecordValidationError("absorb names each run at most once", field="absorb")
    head = _live_head((yield LoadHead(conversation_id)), conversation_id)
    run = _one_run((yield LoadRuns(conversation_id, (run_id,))), conversation_id, run_id)
    if run.terminal:
        loaded = yield from _load_answer(conversation_id, run_id)
        assert loaded is not None
        return TerminalResult(outcome="already_terminal", run=loaded[0], assistant=loaded[1], version=head.version)
    _check_owned(run, expected_revision, owner_id, fencing_token, "commit the terminal of")

    state = RUN_STATE_FOR_REASON[terminal_reason]
    claims = list(absorb) if state == "completed" else []
    claimed: list[Run] = (yield LoadRuns(conversation_id, tuple(c.run_id for c in claims))) if claims else []
    claimed_by_id = {r.id: r for r in claimed}
    absorbed: list[Run] = []
    cancelled: list[str] = [c.run_id for c in absorb] if state != "completed" else []
    for claim in claims:
        target = claimed_by_id.get(claim.run_id)
        if (
            target is None
            or target.state != "queued"
            or target.execution_sequence is not None
            or target.revision != claim.expected_revision
            or target.input_message_ids != claim.input_message_ids
        ):
            cancelled.append(claim.run_id)
        else:
            absorbed.append(target)

    absorbed.sort(key=lambda r: r.admission_sequence)  # the run answered them in admission order
    absorbed_inputs = tuple(mid for r in absorbed for mid in r.input_message_ids)
    absorbed_ids = {r.id for r in absorbed}
    wanted = (*run.input_message_ids, *absorbed_inputs, run.assistant_message_id)
    found = _by_id((yield LoadMessages(conversation_id, wanted)))
    seq = head.message_seq
    assistant = found.get(run.assistant_message_id)
    status = assistant_status_for(terminal_reason)
    final_parts = tuple(parts) if parts is not None else (assistant.parts if assistant else ())
    # a join marker stands only for an absorption that holds
    final_parts = tuple(p for p in final_parts if p.type != "input-joined" or p.run_id in absorbed_ids)
    inputs = [found[mid] for mid in (*run.input_message_ids, *absorbed_inputs) if mid in found]
    position, settled = _settle(head.settled_position, inputs, head.version + 1)
    if assistant is None:
        seq += 1
        assistant = Message(
            id=run.assistant_message_id,
            conversation_id=conversation_id,
            role="assistant",
            status=status,  # type: ignore[arg-type]
            parts=final_parts,
            run_id=run.id,
            created_at=now,
            seq=seq,
        )
        position, (assistant,) = _settle(position, [assistant], head.version + 1)
    else:  # the answer settles last: its final state and its position in one copy
        changes: dict[str, object] = {"status": status, "parts": final_parts, "version": head.version + 1}
        if assistant.position is None:
            position = changes["position"] = position + 1
        assistant = evolve(assistant, changes)
    settled.append(assistant)
    head = _bump(head, now, message_seq=seq, settled_position=position)
    final = _evolve(
        run,
        head.version,
        **({"last_operation": operation} if operation is not None else {}),
        **({"usage": usage} if usage is not None else {}),
        **({"failure": failure} if failure is not None else {}),
        state=state,
        terminal_reason=terminal_reason,
        policy_name=policy_name,
        revision=run.revision + 1,
        # an absorbing run answered the absorbed inputs too: its own inputs, then theirs
        input_message_ids=(*run.input_message_ids, *absorbed_inputs),
        absorbed_run_ids=tuple(r.id for r in absorbed),
        lease_expires_at=None,
        terminal_at=now,
        updated_at=now,
    )
    absorbed_final = tuple(
        _evolve(
            r,
            head.version,
            state="superseded",
            terminal_reason="absorbed",
            absorbed_into_run_id=run.id,
            revision=r.revision + 1,
            terminal_at=now,
            updated_at=now,
        )
        for r in absorbed
    )
    declared = yield from _declared(conversation_id, events)
    command = _owned_command(run_id, expected_revision, owner_id, fencing_token)
    command["terminal_reason"] = terminal_reason
    command["parts"] = _json(final_parts)  # the full final assistant, however the caller passed it
    if policy_name is not None:
        command["policy_name"] = policy_name
    if absorb:
        command["absorb"] = [
            {
                "run_id": c.run_id,
                "expected_revision": c.expected_revision,
                "input_message_ids": list(c.input_message_ids),
            }
            for c in absorb
        ]
    _with_spend(command, operation, usage)
    if failure is not None:
        command["failure"] = _json(failure)
    w = _stamp(Mutation(head=head, runs=(final, *absorbed_final), messages=tuple(settled)))
    w = _recorded(w, now, event_id, "terminal", command, declared)
    yield Write(w)
    return build(
        _COMMITTED,
        {
            "run": w.runs[0],
            "assistant": w.messages[-1],
            "version": head.version,
            "absorbed_runs": w.runs[1:],
            "absorption_cancelled": tuple(cancelled),
        },
    )


def recover_run(
    *,
    conversation_id: str,
    run_id: str,
    expected_revision: int,
    action: Literal["requeue", "abandon"],
    now: Timestamp,
    replay_safe: bool = False,
    stale_owner: bool = False,
    event_id: str = "",
    parts: Sequence[Part] | None = None,
) -> Operation[RecoverResult]:
    """Settle an orphaned run with explicit evidence: ``requeue`` an acquired run (needs ``replay_safe``)
    so it runs again first in order, or ``abandon`` an active run (needs ``stale_owner``): the run ends
    ``abandoned`` with a failed assistant, removed from recovery.

    ``parts`` (replay only: :mod:`threadline.store.replay`) is the failed assistant's content as the
    abandon recorded it, for a draft whose content the journal holds only as a digest."""
    if action == "requeue" and not replay_safe:
        raise AgentRecordValidationError("requeue needs replay_safe=True evidence", field="replay_safe")
    if action == "abandon" and not stale_owner:
        raise AgentRecordValidationError("abandon needs stale_owner=True evidence", field="stale_owner")
    if action not in ("requeue", "abandon"):
        raise AgentRecordValidationError(f"unknown recovery action {action!r}", field="action")
    head = _live_head((yield LoadHead(conversation_id)), conversation_id)
    run = _one_run((yield LoadRuns(conversation_id, (run_id,))), conversation_id, run_id)
    ctx = {"conversation_id": conversation_id, "run_id": run_id, "actual_revision": run.revision, "run": run}
    if run.terminal or (action == "requeue" and not run.acquired):
        raise AgentRunStateConflictError(f"cannot {action} run {run_id!r}: it is {run.state}", **ctx)
    if run.revision != expected_revision:
        raise AgentRunRevisionConflictError(
            f"cannot {action} run {run_id!r}: expected revision {expected_revision}, store has {run.revision}", **ctx
        )
    if action == "requeue":
        head = _bump(head, now)
        requeued = _evolve(
            run,
            head.version,
            state="queued",
            owner_id=None,
            lease_expires_at=None,
            revision=run.revision + 1,
            updated_at=now,
        )
        command: dict[str, Any] = {
            "run_id": run_id,
            "expected_revision": expected_revision,
            "action": action,
            "replay_safe": replay_safe,
        }
        w = _recorded(_stamp(Mutation(head=head, runs=(requeued,))), now, event_id, "recover", command)
        yield Write(w)
        return RecoverResult(outcome="requeued", run=w.runs[0], assistant=None, version=head.version)

    found = _by_id((yield LoadMessages(conversation_id, (*run.input_message_ids, run.assistant_message_id))))
    seq = head.message_seq
    assistant = found.get(run.assistant_message_id)
    if assistant is None:
        seq += 1
        assistant = Message(
            id=run.assistant_message_id,
            conversation_id=conversation_id,
            role="assistant",
            status="failed",
            run_id=run.id,
            created_at=now,
            seq=seq,
        )
    else:
        assistant = evolve(assistant, {"status": "failed"})
    if parts is not None:
        assistant = evolve(assistant, {"parts": tuple(parts)})
    inputs = [found[mid] for mid in run.input_message_ids if mid in found]
    position, settled = _settle(head.settled_position, [*inputs, assistant], head.version + 1)
    head = _bump(head, now, message_seq=seq, settled_position=position)
    final = _evolve(
        run,
        head.version,
        state="abandoned",
        terminal_reason="abandoned",
        revision=run.revision + 1,
        lease_expires_at=None,
        terminal_at=now,
        updated_at=now,
    )
    command = {
        "run_id": run_id,
        "expected_revision": expected_revision,
        "action": action,
        "stale_owner": stale_owner,
        "parts": _json(settled[-1].parts),  # the full failed assistant, kept with the abandon
    }
    w = _recorded(
        _stamp(Mutation(head=head, runs=(final,), messages=tuple(settled))), now, event_id, "recover", command
    )
    yield Write(w)
    return RecoverResult(outcome="abandoned", run=w.runs[0], assistant=w.messages[-1], version=head.version)


# ------------------------------------------------------------------------------ history no run owns


def replace_compacted_range(
    *,
    conversation_id: str,
    expected_version: int,
    replaced_message_ids: Sequence[str],
    summary: MessageDraft,
    now: Timestamp,
    event_id: str = "",
) -> Operation[CompactionResult]:
    """Replace one contiguous range of settled, active history with a ``summary`` message at the exact
    snapshot version. A moved version is a ``conflict`` outcome and nothing is written."""
    ids = tuple(replaced_message_ids)
    if not ids or len(set(ids)) != len(ids):
        raise AgentRecordValidationError(
            "replaced_message_ids is a non-empty list of distinct ids", field="replaced_message_ids"
        )
    if summary.role != "summary":
        raise AgentRecordValidationError("the replacement message has role 'summary'", field="summary.role")
    head = _live_head((yield LoadHead(conversation_id)), conversation_id)
    if head.version != expected_version:
        return CompactionResult(outcome="conflict", version=head.version)
    found = _by_id((yield LoadMessages(conversation_id, (*ids, summary.id))))
    if summary.id in found:
        raise AgentIdempotencyConflictError(
            f"summary id {summary.id!r} already exists; use a new id", conversation_id=conversation_id
        )
    taken: list[Run] = yield LoadRunsByAssistant(conversation_id, (summary.id,))
    if taken:
        raise AgentIdempotencyConflictError(
            f"summary id {summary.id!r} is the assistant message id of {taken[0].state} run {taken[0].id!r}; "
            "use a new id",
            conversation_id=conversation_id,
        )
    missing = [mid for mid in ids if mid not in found]
    if missing:
        raise AgentRecordNotFoundError(f"conversation {conversation_id!r} has no messages {missing}")
    replaced = [found[mid] for mid in ids]
    for m in replaced:
        if not m.active or m.position is None or m.band != "history":
            raise AgentRecordValidationError(
                f"message {m.id!r} is not active settled history (compacted, still in an active run, or a lead seed)",
                field="replaced_message_ids",
            )
        if m.status in ("superseded", "streaming"):
            raise AgentRecordValidationError(
                f"message {m.id!r} is {m.status}; superseded and unfinished turns are never compacted",
                field="replaced_message_ids",
            )
    lo = min(m.position for m in replaced)  # type: ignore[type-var]
    hi = max(m.position for m in replaced)  # type: ignore[type-var]
    between: list[Message] = yield LoadSettledRange(conversation_id, lo, hi)
    # a superseded answer inside the range stays as it is (kept, never summarised): it is not a gap
    if {m.id for m in between if not (m.role == "assistant" and m.status == "superseded")} != set(ids):
        raise AgentRecordValidationError(
            "replaced_message_ids is not one contiguous range of active settled history", field="replaced_message_ids"
        )
    seq = head.message_seq + 1
    head = _bump(head, now, message_seq=seq)
    written = _message(summary, conversation_id, status="committed", seq=seq, now=now, position=hi)
    inactive = tuple(evolve(m, {"active": False, "compacted_by": written.id}) for m in replaced)
    command = {"expected_version": expected_version, "replaced_message_ids": list(ids), "summary": _json(summary)}
    w = _recorded(_stamp(Mutation(head=head, messages=(*inactive, written))), now, event_id, "compact", command)
    yield Write(w)
    return CompactionResult(outcome="applied", version=head.version, summary=w.messages[-1], replaced_message_ids=ids)


def seed_conversation_input(
    *,
    conversation_id: str,
    seed_key: str,
    inputs: Sequence[MessageDraft],
    now: Timestamp,
    placement: Literal["lead", "after-settled"] = "lead",
    event_id: str = "",
) -> Operation[SeedResult]:
    """Write messages no run owns, exactly once per ``seed_key``. ``lead``: user/system instructions before
    the whole conversation. ``after-settled``: a user/assistant exchange that happened without a model,
    placed after settled history and before any active run's messages."""
    allowed = {"lead": {"user", "system"}, "after-settled": {"user", "assistant"}}.get(placement)
    if allowed is None:
        raise AgentRecordValidationError(
            f"unknown placement {placement!r}; use 'lead' or 'after-settled'", field="placement"
        )
    if not inputs:
        raise AgentRecordValidationError("inputs is a non-empty list of messages", field="inputs")
    for i, draft in enumerate(inputs):
        if draft.role not in allowed:
            raise AgentRecordValidationError(
                f"a {placement} seed holds {sorted(allowed)} messages, not {draft.role!r}", field=f"inputs[{i}].role"
            )
    ids = tuple(d.id for d in inputs)
    if len(set(ids)) != len(ids):
        raise AgentRecordValidationError("seeded message ids are distinct", field="inputs")
    state: HeadState = yield LoadHead(conversation_id)
    _not_purged(state, conversation_id)
    seed: SeedRecord | None = yield LoadSeed(conversation_id, seed_key)
    if seed is not None:
        assert state.head is not None
        return SeedResult(outcome="duplicate", version=state.head.version, message_ids=seed.message_ids)
    if (yield LoadMessages(conversation_id, ids)):
        raise AgentIdempotencyConflictError(
            f"a seeded message id already exists in {conversation_id!r}", conversation_id=conversation_id
        )
    head = state.head or new_head(conversation_id, now)
    seq, counter = head.message_seq, head.lead_position if placement == "lead" else head.settled_position
    messages = []
    for draft in inputs:
        seq += 1
        counter += 1
        status = "completed" if draft.role == "assistant" else "committed"
        band = "lead" if placement == "lead" else "history"
        messages.append(_message(draft, conversation_id, status=status, seq=seq, now=now, position=counter, band=band))
    counters = {"lead_position" if placement == "lead" else "settled_position": counter}
    head = _bump(head, now, message_seq=seq, **counters)
    record = SeedRecord(
        conversation_id=conversation_id,
        seed_key=seed_key,
        placement=placement,
        message_ids=ids,
        version=head.version,
        created_at=now,
    )
    command = {"seed_key": seed_key, "inputs": _json(list(inputs)), "placement": placement}
    w = _stamp(Mutation(head=head, messages=tuple(messages), seeds=(record,)))
    yield Write(_recorded(w, now, event_id, "seed", command))
    return SeedResult(outcome="seeded", version=head.version, message_ids=ids)


def purge_conversation(*, conversation_id: str, expected_version: int | None = None) -> Operation[PurgeResult]:
    """Delete everything the conversation owns and keep a permanent tombstone, unless a run is active or
    ``expected_version`` is stale. An unknown id is tombstoned too, so it can never be created later."""
    state: HeadState = yield LoadHead(conversation_id)
    if state.purged:
        return PurgeResult(outcome="already_purged")
    version = state.head.version if state.head else 0
    if expected_version is not None and expected_version != version:
        return PurgeResult(outcome="conflict", actual_version=version)
    if state.head is not None:
        active: list[Run] = yield ListActiveRuns(conversation_id)
        if active:
            return PurgeResult(outcome="active", run_ids=tuple(r.id for r in execution_order(active)))
    yield Purge(conversation_id)
    return PurgeResult(outcome="purged")


# -------------------------------------------------------------------------------------------- reads


def load_snapshot(*, conversation_id: str) -> Operation[ConversationSnapshot]:
    """The whole active history in causal order and every run. Unbounded: use it to compose a prompt or
    to compact, not to look one run up."""
    state: HeadState = yield LoadHead(conversation_id)
    if state.head is None:
        return ConversationSnapshot(conversation_id=conversation_id)
    messages: list[Message] = yield LoadHistory(conversation_id)
    runs: list[Run] = yield LoadAllRuns(conversation_id)
    return ConversationSnapshot(
        conversation_id=conversation_id,
        version=state.head.version,
        messages=tuple(causal_order(messages, runs)),
        runs=tuple(causal_run_order(runs)),
    )


def causal_run_order(runs: Iterable[Run]) -> list[Run]:
    """Runs in causal order, never admission order: every run that started, by execution sequence (an
    absorbed run right after the run that answered it; one that ended without starting after the last run
    that started before it was admitted), then the queued runs in execution order (urgent ``interrupt-next``
    runs FIFO before ordinary ones FIFO)."""
    runs = list(runs)
    started = sorted((r for r in runs if r.execution_sequence is not None), key=lambda r: r.admission_sequence)
    sequence_of = {r.id: r.execution_sequence for r in started}

    def key(run: Run) -> tuple[int, int, int, int]:
        if run.active and run.execution_sequence is None:
            return (1, *run.execution_order_key)
        if run.execution_sequence is not None:
            return (0, run.execution_sequence, 0, 0)
        if run.absorbed_into_run_id is not None and run.absorbed_into_run_id in sequence_of:
            return (0, sequence_of[run.absorbed_into_run_id] or 0, 1, run.admission_sequence)
        # ended before it started (abandoned while queued): after what ran before it was admitted
        before = [r.execution_sequence or 0 for r in started if r.admission_sequence < run.admission_sequence]
        return (0, max(before, default=0), 2, run.admission_sequence)

    return sorted(runs, key=key)


def load_changes(*, conversation_id: str, since_version: int = 0) -> Operation[ConversationChanges]:
    """The rows written after ``since_version``: what a reader holding the conversation as of that version
    needs to catch up. Bounded by the change, not by the conversation (``since_version=0`` reads it all)."""
    state: HeadState = yield LoadHead(conversation_id)
    if state.head is None:
        return ConversationChanges(conversation_id=conversation_id, version=0, reset=True)
    version = state.head.version
    if since_version > version or since_version < 0:
        since_version, reset = 0, True
    else:
        reset = since_version == 0
    if since_version == version:
        return ConversationChanges(conversation_id=conversation_id, version=version)
    messages: list[Message] = yield LoadMessagesSince(conversation_id, since_version, since_version > 0)
    runs: list[Run] = yield LoadRunsSince(conversation_id, since_version)
    return ConversationChanges(
        conversation_id=conversation_id, version=version, messages=tuple(messages), runs=tuple(runs), reset=reset
    )


def load_run(*, conversation_id: str, run_id: str) -> Operation[LoadedRun | None]:
    """One run, the version it was read at and, once terminal, its answer. Bounded: reads no history."""
    state: HeadState = yield LoadHead(conversation_id)
    if state.head is None:
        return None
    loaded = yield from _load_answer(conversation_id, run_id)
    if loaded is None:
        return None
    return build(_LOADED, {"run": loaded[0], "version": state.head.version, "assistant": loaded[1]})


def list_active_runs(*, conversation_id: str) -> Operation[ActiveRuns]:
    """The runs of one conversation that have not ended, in execution order. Bounded."""
    state: HeadState = yield LoadHead(conversation_id)
    if state.head is None:
        return ActiveRuns(conversation_id=conversation_id, version=0, runs=())
    runs: list[Run] = yield ListActiveRuns(conversation_id)
    return ActiveRuns(conversation_id=conversation_id, version=state.head.version, runs=tuple(execution_order(runs)))


def _decode_cursor(cursor: str | None, arity: int, what: str) -> list[object] | None:
    if cursor is None:
        return None
    try:
        value = json.loads(cursor)
    except ValueError:
        value = None
    if not isinstance(value, list) or len(value) < arity:
        raise AgentRecordValidationError(
            f"malformed {what} cursor {cursor!r}; pass back a cursor the store returned", field="cursor"
        )
    return value


def scan_recoverable(*, cursor: str | None = None, limit: int = 100) -> Operation[RecoverablePage]:
    """One bounded page of active runs across conversations (purged ones excluded). Paging order only:
    restore execution order with :func:`order_recoverable` before acquiring anything."""
    _require_page_size(limit)
    after = _decode_cursor(cursor, 2, "recovery")
    runs: list[Run] = yield ScanActiveRuns((str(after[0]), str(after[1])) if after else None, limit)
    next_cursor = json.dumps([runs[-1].conversation_id, runs[-1].id]) if len(runs) == limit else None
    return RecoverablePage(runs=tuple(runs), next_cursor=next_cursor)


def list_conversations(*, cursor: str | None = None, limit: int = 100) -> Operation[ConversationPage]:
    _require_page_size(limit)
    after = _decode_cursor(cursor, 1, "conversation")
    heads: list[ConversationHead] = yield ListConversations(str(after[0]) if after else None, limit)
    next_cursor = json.dumps([heads[-1].conversation_id]) if len(heads) == limit else None
    return ConversationPage(items=tuple(heads), next_cursor=next_cursor)


def page_messages(
    *,
    conversation_id: str,
    limit: int = 50,
    direction: Literal["after", "before"] = "after",
    cursor: str | None = None,
    include_compacted: bool = False,
) -> Operation[MessagePage]:
    """One page of history in the order it happened. ``after`` pages forward from the cursor (from the
    start when None); ``before`` pages backward (from the newest when None); items are always in causal
    order. Settled history pages stably; the live tail of active runs follows it. With
    ``include_compacted`` the replaced messages are included and named in ``compacted``."""
    _require_page_size(limit)
    if direction not in ("after", "before"):
        raise AgentRecordValidationError("direction is 'after' or 'before'", field="direction")
    raw = _decode_cursor(cursor, 1, "message")
    if raw is not None and not all(type(x) is int for x in raw):
        raise AgentRecordValidationError(
            f"malformed message cursor {cursor!r}; pass back a cursor the store returned", field="cursor"
        )
    key: SortKey | None = tuple(raw) if raw is not None else None  # type: ignore[arg-type]
    state: HeadState = yield LoadHead(conversation_id)
    if state.head is None:
        return MessagePage(items=())

    def tail() -> Operation[list[tuple[SortKey, Message]]]:
        messages: list[Message] = yield LoadUnsettled(conversation_id)
        if not messages:
            return []
        runs: list[Run] = yield ListActiveRuns(conversation_id)
        rank = {r.id: r.execution_order_key for r in runs}
        return sorted(((_unsettled_key(m, rank), m) for m in messages), key=lambda pair: pair[0])

    items: list[tuple[SortKey, Message]]
    if direction == "after":
        items = []
        if key is None or key[0] < 2:
            settled: list[Message] = yield PageSettled(conversation_id, "after", key, limit + 1, include_compacted)
            items = [(m.sort_key, m) for m in settled]
        if len(items) <= limit:
            items += [(k, m) for k, m in (yield from tail()) if key is None or k > key]
        page = items[:limit]
        more = len(items) > limit
    else:
        items = [(k, m) for k, m in (yield from tail()) if key is None or k < key]
        items.reverse()
        if len(items) <= limit:
            settled_cursor = key if key is not None and key[0] < 2 else None
            older: list[Message] = yield PageSettled(
                conversation_id, "before", settled_cursor, limit + 1, include_compacted
            )
            items += [(m.sort_key, m) for m in older]
        page = list(reversed(items[:limit]))
        more = len(items) > limit
    next_key = (page[-1][0] if direction == "after" else page[0][0]) if page and more else None
    return MessagePage(
        items=tuple(m for _, m in page),
        compacted=tuple(m.id for _, m in page if not m.active),
        next_cursor=json.dumps(list(next_key)) if next_key is not None else None,
    )


# ------------------------------------------------------------------------------------------- the ledger


def read_events(
    *, conversation_id: str, from_seq: int = 1, to_seq: int | None = None, limit: int = DEFAULT_EVENT_PAGE
) -> Operation[AgentStoreEventPage]:
    """One page of the ledger from ``from_seq`` (through ``to_seq`` when given), bounded by the head's last
    ``seq``: ``next_seq`` names where the next page starts, only when more events remain in the range."""
    if type(from_seq) is not int or from_seq < 1:
        raise AgentRecordValidationError(f"from_seq is an integer >= 1, got {from_seq!r}", field="from_seq")
    if to_seq is not None and (type(to_seq) is not int or to_seq < from_seq):
        raise AgentRecordValidationError(
            f"to_seq is an integer >= from_seq ({from_seq}), got {to_seq!r}", field="to_seq"
        )
    if type(limit) is not int or not 1 <= limit <= MAX_EVENT_PAGE:
        raise AgentRecordValidationError(
            f"limit must be between 1 and {MAX_EVENT_PAGE}, got {limit!r}; page with next_seq", field="limit"
        )
    state: HeadState = yield LoadHead(conversation_id)
    if state.head is None:
        return AgentStoreEventPage()
    last = state.head.event_seq if to_seq is None else min(to_seq, state.head.event_seq)
    if from_seq > last:
        return AgentStoreEventPage()
    events: list[AgentStoreEvent] = yield LoadEvents(conversation_id, from_seq, last, limit)
    more = bool(events) and events[-1].seq < last
    return AgentStoreEventPage(items=tuple(events), next_seq=events[-1].seq + 1 if more else None)


def append_event(
    *,
    conversation_id: str,
    draft: AgentStoreEventDraft,
    now: Timestamp,
    occurred_at: Timestamp | None = None,
    event_id: str = "",
) -> Operation[AgentStoreEvent]:
    """Append one declared event after the conversation's last (its head counts it; the conversation
    version does not move: no message or run changed). A ``provider/message`` body the ledger holds is not
    written again; its first event is the answer."""
    state: HeadState = yield LoadHead(conversation_id)
    _not_purged(state, conversation_id)
    at = occurred_at or now
    head = state.head or new_head(conversation_id, at)  # created at its first event: a replay rebuilds it
    if draft.kind == "provider/message":
        sha = draft.payload["sha256"]  # type: ignore[index,call-overload]
        found: list[tuple[str, int]] = yield LoadEventKeys(conversation_id, (sha,))
        if found:
            (existing,) = yield LoadEvents(conversation_id, found[0][1], found[0][1], 1)
            return existing
    head, (event,) = _events(head, at, event_id, [(draft.kind, draft.payload, draft.ignorable)])
    yield Write(Mutation(head=head, events=(event,)))
    return event


# ---------------------------------------------------------------------------------- durable steps


@dataclass(frozen=True, slots=True)
class StepEffect:
    """A durable step's events under one key: its intent and, once accepted, its proof."""

    run_id: str
    intent: AgentStoreEvent | None
    accepted: AgentStoreEvent | None


def _effect_keys(run_ids: Sequence[str], effect_name: str) -> list[tuple[str, str, str]]:
    """(run id, intent key, proof key) of each run id."""
    return [
        (r, durability_effect_key(r, effect_name, "intent"), durability_effect_key(r, effect_name, "accepted"))
        for r in run_ids
    ]


def _found_keys(conversation_id: str, keys: list[tuple[str, str, str]]) -> Operation[dict[str, int]]:
    """The seq of each of these keys the ledger holds: one indexed read, never a scan."""
    found: list[tuple[str, int]] = yield LoadEventKeys(conversation_id, tuple(k for _, *pair in keys for k in pair))
    return dict(found)


def _step_effect(conversation_id: str, key: tuple[str, str, str], at: dict[str, int]) -> Operation[StepEffect | None]:
    """The events of one key (at most two point reads), or None when it holds none."""
    run_id, *pair = key
    if not any(k in at for k in pair):
        return None
    events: list[AgentStoreEvent | None] = []
    for k in pair:
        seq = at.get(k)
        events.append((yield LoadEvents(conversation_id, seq, seq, 1))[0] if seq is not None else None)
    return StepEffect(run_id, events[0], events[1])


def claim_step_effect(
    *, conversation_id: str, run_ids: Sequence[str], effect_name: str, now: Timestamp, event_id: str = ""
) -> Operation[StepEffect | None]:
    """The recorded step of the first of ``run_ids`` that has one — or ``None`` after appending a
    ``durability/effect`` intent under every run id (one commit: the effect is claimed for all or none).
    Constant work: the keys are looked up by index, the conversation is never scanned."""
    state: HeadState = yield LoadHead(conversation_id)
    _not_purged(state, conversation_id)
    keys = _effect_keys(run_ids, effect_name)
    at = yield from _found_keys(conversation_id, keys)
    for key in keys:
        existing = yield from _step_effect(conversation_id, key, at)
        if existing is not None:
            return existing
    entries = [
        ("durability/effect", {"run_id": run_id, "effect_name": effect_name, "status": "intent"}, None)
        for run_id in run_ids
    ]
    head, events = _events(state.head or new_head(conversation_id, now), now, event_id, entries)
    yield Write(Mutation(head=head, events=events))
    return None


def accept_step_effect(
    *,
    conversation_id: str,
    run_ids: Sequence[str],
    effect_name: str,
    value_json: str,
    reconciled: bool,
    now: Timestamp,
    event_id: str = "",
) -> Operation[StepEffect | None]:
    """Append the accepted proof under each of ``run_ids`` whose key holds a bare intent, and return None.
    When the first key was accepted already (by another process), nothing is written and that step is
    returned; when it holds nothing (the conversation was purged meanwhile), nothing is written either."""
    state: HeadState = yield LoadHead(conversation_id)
    if state.head is None or state.purged:
        return None
    keys = _effect_keys(run_ids, effect_name)
    at = yield from _found_keys(conversation_id, keys)
    _, intent, accepted = keys[0]
    if accepted in at:
        return (yield from _step_effect(conversation_id, keys[0], at))
    if intent not in at:
        return None
    payload = {"effect_name": effect_name, "status": "accepted", "value_json": value_json, "reconciled": reconciled}
    entries = [
        ("durability/effect", {"run_id": run_id, **payload}, None)
        for run_id, intent, accepted in keys
        if intent in at and accepted not in at
    ]
    head, events = _events(state.head, now, event_id, entries)
    yield Write(Mutation(head=head, events=events))
    return None


def read_step_effect(*, conversation_id: str, run_id: str, effect_name: str) -> Operation[StepEffect | None]:
    """The step recorded under one key, or None."""
    keys = _effect_keys((run_id,), effect_name)
    at = yield from _found_keys(conversation_id, keys)
    return (yield from _step_effect(conversation_id, keys[0], at))


@dataclass(frozen=True, slots=True)
class ConversationRows:
    """Everything a conversation owns, as one read transaction saw it (export) or as an import writes it."""

    head: ConversationHead
    messages: tuple[Message, ...]
    runs: tuple[Run, ...]
    receipts: tuple[AdmissionReceipt, ...]
    seeds: tuple[SeedRecord, ...]
    events: tuple[AgentStoreEvent, ...]


def load_conversation_rows(*, conversation_id: str) -> Operation[ConversationRows]:
    """Every row of the conversation, compacted messages and the whole ledger included (export: unbounded
    by design, read in pages of the largest event page inside one transaction)."""
    state: HeadState = yield LoadHead(conversation_id)
    head = _live_head(state, conversation_id)
    messages: list[Message] = yield LoadMessagesSince(conversation_id, -1, True)
    runs: list[Run] = yield LoadAllRuns(conversation_id)
    receipts: list[AdmissionReceipt] = yield LoadAllReceipts(conversation_id)
    seeds: list[SeedRecord] = yield LoadAllSeeds(conversation_id)
    events: list[AgentStoreEvent] = []
    while len(events) < head.event_seq:
        page: list[AgentStoreEvent] = yield LoadEvents(conversation_id, len(events) + 1, head.event_seq, MAX_EVENT_PAGE)
        if not page:
            break
        events += page
    return ConversationRows(
        head=head,
        messages=tuple(sorted(messages, key=lambda m: m.seq)),
        runs=tuple(sorted(runs, key=lambda r: r.admission_sequence)),
        receipts=tuple(sorted(receipts, key=lambda r: (r.version, r.idempotency_key))),
        seeds=tuple(sorted(seeds, key=lambda s: (s.version, s.seed_key))),
        events=tuple(events),
    )


def restore_conversation(*, rows: ConversationRows) -> Operation[None]:
    """Write a whole conversation (validated by the caller) where none exists: an existing or purged
    conversation of that id is refused, and nothing is written."""
    cid = rows.head.conversation_id
    state: HeadState = yield LoadHead(cid)
    _not_purged(state, cid)
    if state.head is not None:
        raise AgentIdempotencyConflictError(
            f"conversation {cid!r} already exists in this store; import only into a store without it "
            "(or branch into a new conversation id)",
            conversation_id=cid,
        )
    yield Write(
        Mutation(
            head=rows.head,
            runs=rows.runs,
            messages=rows.messages,
            receipts=rows.receipts,
            seeds=rows.seeds,
            events=rows.events,
        )
    )


def baseline_rows(
    *,
    head: ConversationHead,
    messages: Sequence[Message],
    runs: Sequence[Run],
    receipts: Sequence[AdmissionReceipt],
    seeds: Sequence[SeedRecord],
    now: Timestamp,
    event_id: str = "",
) -> tuple[ConversationHead, AgentStoreEvent]:
    """A conversation that predates the ledger (a database migrated to it) as one ``runtime/baseline``
    event at seq 1, dated ``now`` (the migration), ``as_of`` the last message it describes, naming the
    compacted messages; and its head, which counts that event. New transitions continue after it."""
    if head.event_seq:
        raise AssertionError(f"conversation {head.conversation_id!r} has a ledger already")
    head = evolve(head, {"event_seq": 1})
    as_of = max((m.created_at for m in messages), default=None)
    payload: dict[str, Any] = {
        "compacted": [m.id for m in messages if not m.active],
        "head": _json(head),
        "messages": _json(list(messages)),
        "runs": [_json_run(r) for r in runs],
        "receipts": _json(list(receipts)),
        "seeds": _json(list(seeds)),
    }
    if as_of is not None:
        payload["as_of"] = _json(as_of)
    _, (event,) = _events(evolve(head, {"event_seq": 0}), now, event_id, [("runtime/baseline", payload, None)])
    return head, event


def _json_run(run: Run) -> Any:
    return to_jsonable_python(run, exclude_none=True, context=STORAGE)
