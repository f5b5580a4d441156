"""``AgentRuntimeStore``: the runtime-facing aggregate over one :class:`StoreDriver`.

Each method validates its arguments, stamps ``now`` and fresh ids, and runs one reducer operation in one
driver transaction. When a mutation returns, it is committed (durable as far as the driver is durable);
when it raises, nothing it attempted was written. Cancelling the awaiting task does not cancel a
transaction already handed to the driver's thread: it either commits or rolls back as a whole, and the
caller cannot tell which — read back (``load_run``) or retry with the same identity.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Mapping, Sequence
from datetime import UTC, datetime
from typing import Any, Literal, Protocol, TypeVar

from pydantic import BaseModel, ConfigDict, TypeAdapter, ValidationError

from ..errors import AgentRecordValidationError, AgentStoreCapabilityError
from ..ledger.events import (
    STORE_WRITTEN_KINDS,
    AgentStoreEvent,
    AgentStoreEventDraft,
    AgentStoreEventPage,
    RuntimeEventDraft,
    payload_record,
)
from ..records import (
    AgentRunFailure,
    ConversationSnapshot,
    MessageDraft,
    Part,
    Priority,
    RunOperation,
    check_id,
    validate_parts,
)
from ..usage import AgentUsage
from . import reducer
from .driver import Access, Operation, OperationStats, Purge, StoreDriver, Write
from .ids import new_id as new_id
from .reducer import AbsorbClaim
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

T = TypeVar("T")
M = TypeVar("M", bound=BaseModel)
_CLAIMS = TypeAdapter(list[AbsorbClaim], config=ConfigDict(defer_build=True))


def _utcnow() -> datetime:
    return datetime.now(UTC)


def _validated(model: type[M], value: M | Mapping[str, Any], field: str) -> M:
    if isinstance(value, model):
        return value
    try:
        return model.model_validate(value)
    except ValidationError as error:
        first = error.errors()[0]
        where = ".".join(str(p) for p in (field, *first["loc"]) if p != "")
        raise AgentRecordValidationError(f"{where}: {first['msg']}", field=where) from error


def _parts(value: Sequence[Part | Mapping[str, Any]] | None, field: str) -> tuple[Part, ...] | None:
    if value is None:
        return None
    try:
        return tuple(validate_parts(value))
    except ValidationError as error:
        first = error.errors()[0]
        where = ".".join(str(p) for p in (field, *first["loc"]))
        raise AgentRecordValidationError(f"{where}: {first['msg']}", field=where) from error


def _usage(value: object) -> AgentUsage | None:
    if value is None or type(value) is AgentUsage:
        return value  # type: ignore[return-value]
    return _validated(AgentUsage, value, "usage")  # type: ignore[arg-type]


def _draft(value: AgentStoreEventDraft | Mapping[str, Any], at: str) -> AgentStoreEventDraft:
    """One declared ledger record, checked: a declared kind the store does not reserve, and a payload that
    is that kind's typed record (``at`` prefixes the field an error names). The runtime's own drafts
    (:func:`~threadline.ledger.events.runtime_draft`) pass as they are."""
    if type(value) is RuntimeEventDraft:
        return value
    draft = _validated(AgentStoreEventDraft, value, at.rstrip("."))
    if draft.kind in STORE_WRITTEN_KINDS:
        raise AgentRecordValidationError(
            f"{at}kind {draft.kind!r} is written by the store itself (durable steps: through "
            "create_local_step_durability(store=...)); declare another kind",
            field=f"{at}kind",
        )
    payload_record(draft.kind, draft.payload, where=f"{at}payload")
    try:  # JSON has no spelling for NaN or infinity: refused here rather than stored as something else
        json.dumps(draft.payload, allow_nan=False)
    except ValueError as error:
        raise AgentRecordValidationError(
            f"{at}payload holds a float JSON cannot spell (NaN or infinity): {error}; send a number or a string",
            field=f"{at}payload",
        ) from error
    return draft


def _drafts(values: Sequence[AgentStoreEventDraft | Mapping[str, Any]]) -> tuple[AgentStoreEventDraft, ...]:
    return tuple(_draft(value, f"events[{i}].") for i, value in enumerate(values))


def _ids(conversation_id: object, run_id: object = "-") -> None:
    """The id rule (:func:`threadline.records.id_problem`) for the ids an operation names."""
    check_id(conversation_id, "conversation_id")
    check_id(run_id, "run_id")


class AgentRuntimeStore:
    """The eleven operations of the runtime store, plus seeding, operation records, leases and purge.

    Every mutation carries an expected revision or version (or an idempotency identity); a conflict is a
    typed error or outcome, never a silent overwrite. ``metrics`` accumulates rows read and written per
    operation name.
    """

    def __init__(self, driver: StoreDriver, *, clock: Callable[[], datetime] = _utcnow) -> None:
        self.driver = driver
        self._clock = clock
        self.metrics: dict[str, OperationStats] = {}
        self.conversations = AgentConversationReader(self)
        self._observers: list[Callable[[Write | Purge], None]] = []

    def observe(self, observer: Callable[[Write | Purge], None]) -> Callable[[], None]:
        """Call ``observer`` with every write this store object commits (after the commit, on the event
        loop, in order). Returns a function that stops observing. An observer that raises is ignored: it
        can never change a committed write. Writes by other processes or store objects are not seen."""
        self._observers.append(observer)
        return lambda: self._observers.remove(observer) if observer in self._observers else None

    async def _run(self, name: str, operation: Callable[[], Operation[T]], access: Access) -> T:
        stats = OperationStats(calls=1)
        try:
            result = await self.driver.run(operation, access=access, stats=stats)
            for write in stats.writes:
                for observer in tuple(self._observers):
                    try:
                        observer(write)
                    except Exception:
                        continue
            return result
        finally:
            total = self.metrics.get(name)
            if total is None:
                total = self.metrics[name] = OperationStats()
            total.calls += 1
            total.rows_read += stats.rows_read
            total.rows_written += stats.rows_written
            for key, n in stats.by_request.items():
                total.by_request[key] = total.by_request.get(key, 0) + n

    async def aclose(self) -> None:
        """Close the driver (its connections, its thread). Idempotent; later operations raise
        :class:`~threadline.errors.AgentStoreUnavailableError`."""
        await self.driver.aclose()

    @property
    def ledger(self) -> bool:
        """Whether the driver keeps the event ledger (``driver.ledger``; the built-in drivers do). Without
        it the ledger's methods raise :class:`~threadline.errors.AgentStoreCapabilityError`."""
        return bool(getattr(self.driver, "ledger", False))

    def _require_ledger(self) -> None:
        if not self.ledger:
            raise AgentStoreCapabilityError(
                "ledger",
                f"the store's driver ({type(self.driver).__name__}) does not keep the event ledger; implement "
                "its row primitives (load_events, load_event_keys, load_all_receipts, load_all_seeds, and "
                "the events of Write) and set driver.ledger = True",
            )

    async def __aenter__(self) -> AgentRuntimeStore:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    # ---------------------------------------------------------------------------------- mutations

    async def accept_input_and_assign_run(
        self,
        *,
        conversation_id: str,
        idempotency_key: str,
        input: MessageDraft | Mapping[str, Any],
        run_id: str | None = None,
        assistant_message_id: str | None = None,
        priority: Priority = "ordinary",
        input_policy: str = "queue",
        coalesce: bool = False,
        start_for: str | None = None,
        lease_expires_at: datetime | None = None,
        operation: RunOperation | Mapping[str, Any] | None = None,
    ) -> AcceptResult:
        """Commit an input with its receipt and queued run (or coalesce it into the queued successor).

        Durable on return. Retrying with the same ``idempotency_key`` returns the original receipt. An
        ``input`` without an ``id``, like an omitted ``run_id`` or ``assistant_message_id``, gets a fresh
        random one (``msg_…``, ``run_…``).

        ``start_for`` (an owner id) admits and starts in one commit when nothing is queued or running in
        the conversation: the new run is acquired for that owner as :meth:`acquire_run` would do it (with
        ``lease_expires_at`` and ``operation``), and the result's run is ``running``. Otherwise the run is
        queued as usual and the caller acquires it later.
        """
        check_id(conversation_id, "conversation_id")
        check_id(idempotency_key, "idempotency_key")
        if priority not in ("ordinary", "urgent"):
            raise AgentRecordValidationError(f"priority is 'ordinary' or 'urgent', got {priority!r}", field="priority")
        fresh: list[str] = []
        if isinstance(input, Mapping) and input.get("id") is None:
            fresh.append(new_id("msg"))
            input = {**input, "id": fresh[-1]}
        draft = _validated(MessageDraft, input, "input")
        check_id(draft.id, "input.id")
        if run_id is None:
            run_id = new_id("run")
            fresh.append(run_id)
        else:
            check_id(run_id, "run_id")
        if assistant_message_id is None:
            assistant_message_id = new_id("msg")
            fresh.append(assistant_message_id)
        else:
            check_id(assistant_message_id, "assistant_message_id")
        if start_for is not None:
            check_id(start_for, "start_for")
        op = functools.partial(
            reducer.accept_input_and_assign_run,
            event_id=new_id("evt"),
            conversation_id=conversation_id,
            idempotency_key=idempotency_key,
            input=draft,
            run_id=run_id,
            assistant_message_id=assistant_message_id,
            priority=priority,
            input_policy=input_policy,
            coalesce=coalesce,
            now=self._clock(),
            fresh_ids=frozenset(fresh),
            start_for=start_for,
            lease_expires_at=lease_expires_at,
            operation=_validated(RunOperation, operation, "operation") if operation is not None else None,
        )
        return await self._run("accept_input_and_assign_run", op, "write")

    async def acquire_run(
        self,
        *,
        conversation_id: str,
        run_id: str,
        expected_revision: int,
        owner_id: str,
        lease_expires_at: datetime | None = None,
        operation: RunOperation | Mapping[str, Any] | None = None,
    ) -> RunResult:
        """Take ownership of the queued run that is next in execution order; increments the fencing token.

        With ``operation`` (the first model request's admission) the same commit also writes an empty
        streaming assistant draft and records the operation as ``last_operation``: the acquisition is the
        run's first checkpoint too (``result.assistant`` is that draft)."""
        _ids(conversation_id, run_id)
        check_id(owner_id, "owner_id")
        op = functools.partial(
            reducer.acquire_run,
            event_id=new_id("evt"),
            conversation_id=conversation_id,
            run_id=run_id,
            expected_revision=expected_revision,
            owner_id=owner_id,
            lease_expires_at=lease_expires_at,
            operation=_validated(RunOperation, operation, "operation") if operation is not None else None,
            now=self._clock(),
        )
        return await self._run("acquire_run", op, "write")

    async def checkpoint_run_assistant(
        self,
        *,
        conversation_id: str,
        run_id: str,
        expected_revision: int,
        owner_id: str,
        fencing_token: int,
        parts: Sequence[Part | Mapping[str, Any]],
        operation: RunOperation | Mapping[str, Any] | None = None,
        usage: AgentUsage | None = None,
        events: Sequence[AgentStoreEventDraft | Mapping[str, Any]] = (),
    ) -> RunResult:
        """Write the streaming assistant draft of an owned run; with ``operation``, record its
        ``last_operation`` phase in the same transaction (one commit for both), and with ``usage`` the run's
        cumulative spend (:attr:`threadline.records.Run.usage`). ``events`` are ledger records of declared
        kinds the same commit appends before its transition (a provider request, say)."""
        _ids(conversation_id, run_id)
        op = functools.partial(
            reducer.checkpoint_run_assistant,
            event_id=new_id("evt"),
            conversation_id=conversation_id,
            run_id=run_id,
            expected_revision=expected_revision,
            owner_id=owner_id,
            fencing_token=fencing_token,
            parts=_parts(parts, "parts") or (),
            operation=_validated(RunOperation, operation, "operation") if operation is not None else None,
            usage=_usage(usage),
            events=_drafts(events),
            now=self._clock(),
        )
        return await self._run("checkpoint_run_assistant", op, "write")

    async def record_run_operation(
        self,
        *,
        conversation_id: str,
        run_id: str,
        expected_revision: int,
        owner_id: str,
        fencing_token: int,
        operation: RunOperation | Mapping[str, Any],
        usage: AgentUsage | None = None,
        events: Sequence[AgentStoreEventDraft | Mapping[str, Any]] = (),
    ) -> RunResult:
        """Durably record the run's ``last_operation`` phase (before the provider is called); with ``usage``,
        the run's cumulative spend in the same commit, with ``events`` ledger records of declared kinds."""
        _ids(conversation_id, run_id)
        op = functools.partial(
            reducer.record_run_operation,
            event_id=new_id("evt"),
            conversation_id=conversation_id,
            run_id=run_id,
            expected_revision=expected_revision,
            owner_id=owner_id,
            fencing_token=fencing_token,
            operation=_validated(RunOperation, operation, "operation"),
            usage=_usage(usage),
            events=_drafts(events),
            now=self._clock(),
        )
        return await self._run("record_run_operation", op, "write")

    async def renew_run_lease(
        self,
        *,
        conversation_id: str,
        run_id: str,
        expected_revision: int,
        owner_id: str,
        fencing_token: int,
        lease_expires_at: datetime,
    ) -> RunResult:
        """Extend the owner's lease on an acquired run."""
        _ids(conversation_id, run_id)
        op = functools.partial(
            reducer.renew_run_lease,
            event_id=new_id("evt"),
            conversation_id=conversation_id,
            run_id=run_id,
            expected_revision=expected_revision,
            owner_id=owner_id,
            fencing_token=fencing_token,
            lease_expires_at=lease_expires_at,
            now=self._clock(),
        )
        return await self._run("renew_run_lease", op, "write")

    async def request_run_interrupt(
        self, *, conversation_id: str, run_id: str, expected_revision: int | None = None
    ) -> InterruptResult:
        """Durably mark an acquired run ``interrupt_requested``."""
        _ids(conversation_id, run_id)
        op = functools.partial(
            reducer.request_run_interrupt,
            event_id=new_id("evt"),
            conversation_id=conversation_id,
            run_id=run_id,
            expected_revision=expected_revision,
            now=self._clock(),
        )
        return await self._run("request_run_interrupt", op, "write")

    async def commit_run_terminal(
        self,
        *,
        conversation_id: str,
        run_id: str,
        expected_revision: int,
        owner_id: str,
        fencing_token: int,
        terminal_reason: str,
        parts: Sequence[Part | Mapping[str, Any]] | None = None,
        policy_name: str | None = None,
        absorb: Sequence[AbsorbClaim | Mapping[str, Any]] = (),
        operation: RunOperation | Mapping[str, Any] | None = None,
        usage: AgentUsage | None = None,
        events: Sequence[AgentStoreEventDraft | Mapping[str, Any]] = (),
        failure: AgentRunFailure | Mapping[str, Any] | None = None,
    ) -> TerminalResult:
        """The terminal CAS of an owned run (see :func:`threadline.store.reducer.commit_run_terminal`); with
        ``operation``, its ``last_operation`` phase is recorded in the same commit, with ``usage`` the run's
        cumulative spend, with ``failure`` why it failed (kept as ``Run.failure``)."""
        _ids(conversation_id, run_id)
        try:
            claims = _CLAIMS.validate_python(list(absorb)) if absorb else []
        except ValidationError as error:
            raise AgentRecordValidationError(f"absorb: {error.errors()[0]['msg']}", field="absorb") from error
        op = functools.partial(
            reducer.commit_run_terminal,
            event_id=new_id("evt"),
            conversation_id=conversation_id,
            run_id=run_id,
            expected_revision=expected_revision,
            owner_id=owner_id,
            fencing_token=fencing_token,
            terminal_reason=terminal_reason,
            parts=_parts(parts, "parts"),
            policy_name=policy_name,
            absorb=claims,
            operation=_validated(RunOperation, operation, "operation") if operation is not None else None,
            usage=_usage(usage),
            events=_drafts(events),
            failure=_validated(AgentRunFailure, failure, "failure") if failure is not None else None,
            now=self._clock(),
        )
        return await self._run("commit_run_terminal", op, "write")

    async def recover_run(
        self,
        *,
        conversation_id: str,
        run_id: str,
        expected_revision: int,
        action: Literal["requeue", "abandon"],
        replay_safe: bool = False,
        stale_owner: bool = False,
    ) -> RecoverResult:
        """Requeue (with replay-safe evidence) or abandon (with stale-owner evidence) an orphaned run."""
        _ids(conversation_id, run_id)
        op = functools.partial(
            reducer.recover_run,
            event_id=new_id("evt"),
            conversation_id=conversation_id,
            run_id=run_id,
            expected_revision=expected_revision,
            action=action,
            replay_safe=replay_safe,
            stale_owner=stale_owner,
            now=self._clock(),
        )
        return await self._run("recover_run", op, "write")

    async def replace_compacted_range(
        self,
        *,
        conversation_id: str,
        expected_version: int,
        replaced_message_ids: Sequence[str],
        summary: MessageDraft | Mapping[str, Any],
    ) -> CompactionResult:
        """Replace a contiguous settled range with one summary, at exactly ``expected_version``."""
        _ids(conversation_id)
        draft = _validated(MessageDraft, summary, "summary")
        check_id(draft.id, "summary.id")
        op = functools.partial(
            reducer.replace_compacted_range,
            event_id=new_id("evt"),
            conversation_id=conversation_id,
            expected_version=expected_version,
            replaced_message_ids=list(replaced_message_ids),
            summary=draft,
            now=self._clock(),
        )
        return await self._run("replace_compacted_range", op, "write")

    async def seed_conversation_input(
        self,
        *,
        conversation_id: str,
        seed_key: str,
        inputs: Sequence[MessageDraft | Mapping[str, Any]],
        placement: Literal["lead", "after-settled"] = "lead",
    ) -> SeedResult:
        """Write history no run owns, exactly once per ``seed_key``."""
        check_id(conversation_id, "conversation_id")
        check_id(seed_key, "seed_key")
        drafts = [_validated(MessageDraft, d, f"inputs[{i}]") for i, d in enumerate(inputs)]
        for i, draft in enumerate(drafts):
            check_id(draft.id, f"inputs[{i}].id")
        op = functools.partial(
            reducer.seed_conversation_input,
            event_id=new_id("evt"),
            conversation_id=conversation_id,
            seed_key=seed_key,
            inputs=drafts,
            placement=placement,
            now=self._clock(),
        )
        return await self._run("seed_conversation_input", op, "write")

    async def purge_conversation(self, *, conversation_id: str, expected_version: int | None = None) -> PurgeResult:
        """Delete the conversation and keep a permanent tombstone (see :func:`purge_agent_conversation`)."""
        check_id(conversation_id, "conversation_id")
        op = functools.partial(
            reducer.purge_conversation, conversation_id=conversation_id, expected_version=expected_version
        )
        return await self._run("purge_conversation", op, "write")

    # ------------------------------------------------------------------------------------ the ledger

    async def read_events(
        self,
        *,
        conversation_id: str,
        from_seq: int = 1,
        to_seq: int | None = None,
        limit: int = reducer.DEFAULT_EVENT_PAGE,
    ) -> AgentStoreEventPage:
        """One page of the conversation's ledger, in ``seq`` order from ``from_seq`` (through ``to_seq``
        when given). ``limit`` is 1..10,000 (default 1,000); ``next_seq`` is set only when more events
        remain in the range. Bounded and indexed: a page costs its rows wherever it starts. An unknown or
        purged conversation has no events."""
        check_id(conversation_id, "conversation_id")
        self._require_ledger()
        op = functools.partial(
            reducer.read_events, conversation_id=conversation_id, from_seq=from_seq, to_seq=to_seq, limit=limit
        )
        return await self._run("read_events", op, "read")

    async def append_event(
        self,
        *,
        conversation_id: str,
        kind: str,
        payload: Any = None,
        occurred_at: datetime | None = None,
        ignorable: bool | None = None,
    ) -> AgentStoreEvent:
        """Append one event of a declared kind (not one the store reserves: ``runtime/*``) and return it
        with its ``seq``. Durable on return. ``payload`` must be that kind's typed record (as JSON); a
        ``provider/message`` body the ledger holds already is not written again: its first event is
        returned. Creates the conversation's head when it has none (version 0); a purged conversation is
        refused. Cancelling the caller does not withdraw a write already handed to the driver."""
        check_id(conversation_id, "conversation_id")
        self._require_ledger()
        draft = _draft({"kind": kind, "payload": payload, **({"ignorable": True} if ignorable else {})}, "")
        if occurred_at is not None and (not isinstance(occurred_at, datetime) or occurred_at.tzinfo is None):
            raise AgentRecordValidationError(
                f"occurred_at is a timezone-aware datetime, got {occurred_at!r}", field="occurred_at"
            )
        op = functools.partial(
            reducer.append_event,
            conversation_id=conversation_id,
            draft=draft,
            occurred_at=occurred_at,
            now=self._clock(),
            event_id=new_id("evt"),
        )
        return await self._run("append_event", op, "write")

    async def export_conversation(self, conversation_id: str) -> bytes:
        """The conversation as archive bytes (:mod:`threadline.ledger.archive`), read in one transaction:
        its events, its runtime snapshot (head, runs, messages with the compacted ones, admission receipts,
        seeds) and companion projection envelopes, as RFC 8785 canonical JSON. Reads only."""
        from .transfer import export_conversation

        self._require_ledger()

        return await export_conversation(self, conversation_id)

    async def import_conversation(self, data: bytes) -> Any:
        """Restore an exported conversation under its own identity into this store, where that conversation
        does not exist. The whole archive is validated first (see :mod:`threadline.store.transfer`);
        anything wrong is :class:`~threadline.errors.AgentArchiveRejectedError` naming the offence, and
        nothing is written. Durable on return: one transaction writes it all."""
        from .transfer import import_conversation

        self._require_ledger()

        return await import_conversation(self, data)

    async def branch_conversation(
        self,
        *,
        request_key: str,
        destination_conversation_id: str,
        source: Mapping[str, Any],
        artifact_authorization: Any = None,
    ) -> Any:
        """Copy a settled prefix of a conversation (or an archive) into a new, independent conversation
        with new engine identities (see :func:`threadline.store.transfer._branch`). Durable on return (one
        transaction); a cancelled call either wrote the whole copy or nothing: retry with the same
        ``request_key`` to learn which (a retry of a created branch is ``duplicate``)."""
        from .transfer import branch_conversation

        self._require_ledger()

        return await branch_conversation(
            self,
            request_key=request_key,
            destination_conversation_id=destination_conversation_id,
            source=source,
            artifact_authorization=artifact_authorization,
        )

    # -------------------------------------------------------------------------------------- reads

    async def load_snapshot(self, *, conversation_id: str) -> ConversationSnapshot:
        """Every active message in causal order and every run. Unbounded; see :meth:`load_run`."""
        _ids(conversation_id)
        return await self._run(
            "load_snapshot", functools.partial(reducer.load_snapshot, conversation_id=conversation_id), "read"
        )

    async def load_changes(self, *, conversation_id: str, since_version: int = 0) -> ConversationChanges:
        """The messages and runs written after ``since_version``; bounded by the change. Keeps a cached
        view of a conversation current without reading it whole (see ``threadline.history.view``)."""
        _ids(conversation_id)
        op = functools.partial(reducer.load_changes, conversation_id=conversation_id, since_version=since_version)
        return await self._run("load_changes", op, "read")

    async def load_run(self, *, conversation_id: str, run_id: str) -> LoadedRun | None:
        """One run with the version it was read at and, once terminal, its answer. Bounded."""
        _ids(conversation_id, run_id)
        return await self._run(
            "load_run", functools.partial(reducer.load_run, conversation_id=conversation_id, run_id=run_id), "read"
        )

    async def list_active_runs(self, *, conversation_id: str) -> ActiveRuns:
        """The conversation's runs that have not ended, in execution order. Bounded."""
        _ids(conversation_id)
        return await self._run(
            "list_active_runs", functools.partial(reducer.list_active_runs, conversation_id=conversation_id), "read"
        )

    async def scan_recoverable(self, *, cursor: str | None = None, limit: int = 100) -> RecoverablePage:
        """One bounded page of active runs across conversations, in paging (not execution) order."""
        return await self._run(
            "scan_recoverable", functools.partial(reducer.scan_recoverable, cursor=cursor, limit=limit), "read"
        )


class AgentConversationReader:
    """Paged reads for people and tools: the catalog of conversations and the history of one."""

    def __init__(self, store: AgentRuntimeStore) -> None:
        self._store = store

    async def messages(
        self,
        conversation_id: str,
        *,
        limit: int = 50,
        direction: Literal["after", "before"] = "after",
        cursor: str | None = None,
        include_compacted: bool = False,
    ) -> MessagePage:
        """One page of history in causal order (see :func:`threadline.store.reducer.page_messages`)."""
        check_id(conversation_id, "conversation_id")
        op = functools.partial(
            reducer.page_messages,
            conversation_id=conversation_id,
            limit=limit,
            direction=direction,
            cursor=cursor,
            include_compacted=include_compacted,
        )
        return await self._store._run("conversations.messages", op, "read")

    async def list(self, *, limit: int = 100, cursor: str | None = None) -> ConversationPage:
        """One page of conversation heads ordered by id; purged conversations are absent."""
        return await self._store._run(
            "conversations.list", functools.partial(reducer.list_conversations, cursor=cursor, limit=limit), "read"
        )


class _Purgeable(Protocol):
    async def purge_conversation(self, *, conversation_id: str, expected_version: int | None = None) -> PurgeResult: ...


async def purge_agent_conversation(
    store: object, *, conversation_id: str, expected_version: int | None = None
) -> PurgeResult:
    """Purge through any store: ``unsupported`` when it cannot purge (it never pretends deletion happened).

    Outcomes: ``purged``, ``already_purged``, ``active`` (``run_ids`` must settle first), ``conflict``
    (``actual_version``: make a fresh decision, do not blindly retry) or ``unsupported``.
    """
    purge = getattr(store, "purge_conversation", None)
    if purge is None:
        return PurgeResult(outcome="unsupported")
    return await purge(conversation_id=conversation_id, expected_version=expected_version)


def create_agent_runtime_store(driver: StoreDriver, *, clock: Callable[[], datetime] = _utcnow) -> AgentRuntimeStore:
    """Compose the reducer with a driver. ``clock`` (UTC-aware) is injectable for tests."""
    return AgentRuntimeStore(driver, clock=clock)
