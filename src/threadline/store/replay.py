"""Rebuild a conversation from its ledger by replaying every ``runtime/transition`` command through the same
pure reducer, each at its ``occurred_at``, from its ``runtime/baseline`` when it has one.

Import uses it to prove an archive's events and snapshot agree; branch, to rebuild the state at an exact
earlier boundary. A checkpoint's draft is in the journal as a digest only: the replayed draft is empty and
remembered as that digest (``Replayed.digests``) until a terminal or an abandon, which carry the full
assistant, settle its content.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from ..errors import AgentArchiveRejectedError, ThreadlineError
from ..ledger.events import AgentStoreEvent, BaselineRecord, parts_digest, payload_record
from ..records import AdmissionReceipt, ConversationHead, Message, Run, SeedRecord, evolve
from . import reducer
from ._memory_rows import _Conversation, _Rows
from .driver import Mutation, Write, drive_sync
from .reducer import AbsorbClaim

__all__ = ["Replayed", "replay_events", "verify_snapshot"]


@dataclass
class Replayed:
    """The conversation as the replayed journal leaves it."""

    conversation_id: str
    head: ConversationHead | None = None
    runs: dict[str, Run] = field(default_factory=dict)
    messages: dict[str, Message] = field(default_factory=dict)
    receipts: dict[str, AdmissionReceipt] = field(default_factory=dict)
    seeds: dict[str, SeedRecord] = field(default_factory=dict)
    digests: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Drafts whose content the journal holds only as a checkpoint digest, by message id."""
    ended_at: dict[str, int] = field(default_factory=dict)
    """Per run, the seq of the transition that ended it (a terminal, an abandon, or its absorber's terminal)."""
    baseline: BaselineRecord | None = None
    through: int = 0

    @property
    def active_runs(self) -> list[Run]:
        return [r for r in self.runs.values() if r.active]


def _fail(message: str, seq: int) -> AgentArchiveRejectedError:
    return AgentArchiveRejectedError("ARCHIVE_SNAPSHOT", message, where=f"events[{seq - 1}]")


def _operation(cid: str, kind: str, command: Any, now: Any) -> Any:
    c = command
    if kind == "accept":
        fresh = frozenset({c.input.id, c.run_id, c.assistant_message_id})
        return reducer.accept_input_and_assign_run(
            conversation_id=cid,
            idempotency_key=c.idempotency_key,
            input=c.input,
            run_id=c.run_id,
            assistant_message_id=c.assistant_message_id,
            priority=c.priority,
            input_policy=c.input_policy,
            coalesce=c.coalesce,
            start_for=c.start_for,
            lease_expires_at=c.lease_expires_at,
            operation=c.operation,
            now=now,
            fresh_ids=fresh,
        )
    if kind == "compact":
        return reducer.replace_compacted_range(
            conversation_id=cid,
            expected_version=c.expected_version,
            replaced_message_ids=c.replaced_message_ids,
            summary=c.summary,
            now=now,
        )
    if kind == "seed":
        return reducer.seed_conversation_input(
            conversation_id=cid, seed_key=c.seed_key, inputs=c.inputs, placement=c.placement, now=now
        )
    owned = {"conversation_id": cid, "run_id": c.run_id, "expected_revision": c.expected_revision, "now": now}
    if kind == "acquire":
        return reducer.acquire_run(
            **owned, owner_id=c.owner_id, lease_expires_at=c.lease_expires_at, operation=c.operation
        )
    if kind in ("checkpoint", "operation", "lease", "terminal"):
        owned.update(owner_id=c.owner_id, fencing_token=c.fencing_token)
    if kind == "checkpoint":
        return reducer.checkpoint_run_assistant(**owned, parts=(), operation=c.operation, usage=c.usage)
    if kind == "operation":
        return reducer.record_run_operation(**owned, operation=c.operation, usage=c.usage)
    if kind == "lease":
        return reducer.renew_run_lease(**owned, lease_expires_at=c.lease_expires_at)
    if kind == "interrupt":
        return reducer.request_run_interrupt(
            conversation_id=cid, run_id=c.run_id, expected_revision=c.expected_revision, now=now
        )
    if kind == "recover":
        return reducer.recover_run(
            **owned, action=c.action, replay_safe=c.replay_safe, stale_owner=c.stale_owner, parts=c.parts
        )
    if kind == "terminal":
        return reducer.commit_run_terminal(
            **owned,
            terminal_reason=c.terminal_reason,
            parts=c.parts,
            policy_name=c.policy_name,
            absorb=[AbsorbClaim(a.run_id, a.expected_revision, a.input_message_ids) for a in c.absorb],
            operation=c.operation,
            usage=c.usage,
            failure=c.failure,
        )
    raise AssertionError(f"no replay for transition {kind!r}")


def replay_events(
    conversation_id: str, events: Iterable[AgentStoreEvent], *, through_seq: int | None = None
) -> Replayed:
    """Replay ``events`` (in ``seq`` order) through ``through_seq`` (all when None). A transition that the
    reducer refuses, or whose conversation version differs from the one recorded, is
    :class:`~threadline.errors.AgentArchiveRejectedError` (``ARCHIVE_SNAPSHOT``): the journal does not
    describe a conversation this store could have written."""
    tables: dict[str, _Conversation] = {}
    rows = _Rows(tables, set())
    out = Replayed(conversation_id)
    for event in events:
        if through_seq is not None and event.seq > through_seq:
            break
        out.through = event.seq
        if event.kind == "runtime/baseline":
            if event.seq != 1:
                raise _fail("a runtime/baseline is the first event of a journal", event.seq)
            base: BaselineRecord = payload_record(event.kind, event.payload)
            out.baseline = base
            baseline = Mutation(
                # the replay numbers only the events it writes (the baseline, then each transition): a
                # branch's baseline head also counts the copied records that follow it
                head=evolve(base.head, {"event_seq": 1}),
                runs=base.runs,
                messages=base.messages,
                receipts=base.receipts,
                seeds=base.seeds,
                events=(event,),
            )
            rows.staged.append(Write(baseline))
            rows.commit()
            rows.staged.clear()
            continue
        if event.kind != "runtime/transition":
            if conversation_id not in tables:  # a journal opened by append_event: its head, at version 0
                rows.staged.append(Write(Mutation(head=reducer.new_head(conversation_id, event.occurred_at))))
                rows.commit()
                rows.staged.clear()
            continue
        record = payload_record(event.kind, event.payload)
        try:
            drive_sync(_operation(conversation_id, record.type, record.input, event.occurred_at), rows)
        except ThreadlineError as error:
            raise _fail(f"transition {record.type!r} does not replay: {error}", event.seq) from None
        if len(rows.staged) != 1:
            raise _fail(f"transition {record.type!r} wrote nothing when replayed", event.seq)
        mutation = rows.staged[0].mutation  # type: ignore[union-attr]
        rows.commit()
        rows.staged.clear()
        assert mutation.head is not None
        if mutation.head.version != record.version:
            raise _fail(
                f"transition {record.type!r} replays to version {mutation.head.version}, recorded {record.version}",
                event.seq,
            )
        if record.type == "checkpoint":
            out.digests[record.input.assistant.id] = record.input.assistant.model_dump(exclude_none=True)
        for message in mutation.messages:
            if message.status != "streaming":
                out.digests.pop(message.id, None)
        for run in mutation.runs:
            if run.terminal and run.id not in out.ended_at:
                out.ended_at[run.id] = event.seq
    conv = tables.get(conversation_id)
    if conv is not None:
        out.head = conv.head
        out.runs = dict(conv.runs)
        out.messages = dict(conv.messages)
        out.receipts = dict(conv.receipts)
        out.seeds = dict(conv.seeds)
    return out


def verify_snapshot(
    replayed: Replayed,
    head: ConversationHead,
    messages: Iterable[Message],
    runs: Iterable[Run],
    receipts: Iterable[AdmissionReceipt],
    seeds: Iterable[SeedRecord],
) -> None:
    """Whether a snapshot is exactly what the journal replays to (a draft known only by its digest must
    hash to it). Raises ``ARCHIVE_SNAPSHOT`` naming the first disagreement."""

    def disagree(what: str) -> AgentArchiveRejectedError:
        return AgentArchiveRejectedError(
            "ARCHIVE_SNAPSHOT", f"the snapshot disagrees with the events: {what}", where="snapshot"
        )

    if replayed.head is None:
        raise disagree("the events describe no conversation")
    if evolve(replayed.head, {"event_seq": head.event_seq}) != head:
        raise disagree("the head")
    messages = list(messages)
    if {m.id for m in messages} != set(replayed.messages):
        raise disagree("the set of messages")
    for message in messages:
        expected = replayed.messages[message.id]
        digest = replayed.digests.get(message.id)
        if digest is not None:
            sha = parts_digest(message.parts)[0]
            if sha != digest.get("sha256", digest.get("source_sha256")):
                raise disagree(f"draft {message.id!r} does not hash to its checkpoint digest")
            message = evolve(message, {"parts": expected.parts})
        if message != expected:
            raise disagree(f"message {message.id!r}")
    runs = list(runs)
    if {r.id for r in runs} != set(replayed.runs) or any(r != replayed.runs[r.id] for r in runs):
        raise disagree("the runs")
    receipts = list(receipts)
    if {r.idempotency_key for r in receipts} != set(replayed.receipts) or any(
        r != replayed.receipts[r.idempotency_key] for r in receipts
    ):
        raise disagree("the admission receipts")
    seeds = list(seeds)
    if {s.seed_key for s in seeds} != set(replayed.seeds) or any(s != replayed.seeds[s.seed_key] for s in seeds):
        raise disagree("the seeds")
