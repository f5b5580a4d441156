"""The memory driver's tables and row primitives (also what the ledger's replay folds a journal into)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TypeVar

from ..ledger.events import AgentStoreEvent, event_key
from ..records import AdmissionReceipt, ConversationHead, Message, Run, SeedRecord
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
    PageSettled,
    Purge,
    ScanActiveRuns,
    Write,
)

T = TypeVar("T")


@dataclass
class _Conversation:
    head: ConversationHead
    runs: dict[str, Run] = field(default_factory=dict)
    active: set[str] = field(default_factory=set)
    messages: dict[str, Message] = field(default_factory=dict)
    receipts: dict[str, AdmissionReceipt] = field(default_factory=dict)
    receipt_by_input: dict[str, str] = field(default_factory=dict)
    seeds: dict[str, SeedRecord] = field(default_factory=dict)
    events: list[AgentStoreEvent] = field(default_factory=list)  # events[k] has seq k + 1
    keys: dict[str, int] = field(default_factory=dict)  # event_key (provider/message digest, step key) -> seq


class _Rows:
    """Row primitives over the tables; writes are staged and applied only when the operation succeeds."""

    def __init__(self, tables: dict[str, _Conversation], tombstones: set[str]) -> None:
        self.tables = tables
        self.tombstones = tombstones
        self.staged: list[Write | Purge] = []

    def _conv(self, conversation_id: str) -> _Conversation | None:
        return self.tables.get(conversation_id)

    def load_head(self, r: LoadHead) -> HeadState:
        conv = self._conv(r.conversation_id)
        return HeadState(conv.head if conv else None, purged=r.conversation_id in self.tombstones)

    def load_runs(self, r: LoadRuns) -> list[Run]:
        conv = self._conv(r.conversation_id)
        return [conv.runs[i] for i in r.run_ids if conv and i in conv.runs]

    def load_runs_by_assistant(self, r: LoadRunsByAssistant) -> list[Run]:
        conv = self._conv(r.conversation_id)
        wanted = set(r.message_ids)
        # the reference driver scans; the database drivers use an index
        return [run for run in conv.runs.values() if run.assistant_message_id in wanted] if conv else []

    def list_active_runs(self, r: ListActiveRuns) -> list[Run]:
        conv = self._conv(r.conversation_id)
        return [conv.runs[i] for i in sorted(conv.active)] if conv else []

    def load_all_runs(self, r: LoadAllRuns) -> list[Run]:
        conv = self._conv(r.conversation_id)
        return list(conv.runs.values()) if conv else []

    def load_receipt(self, r: LoadReceipt) -> AdmissionReceipt | None:
        conv = self._conv(r.conversation_id)
        return conv.receipts.get(r.idempotency_key) if conv else None

    def load_receipt_by_input(self, r: LoadReceiptByInput) -> AdmissionReceipt | None:
        conv = self._conv(r.conversation_id)
        if conv is None or r.input_message_id not in conv.receipt_by_input:
            return None
        return conv.receipts[conv.receipt_by_input[r.input_message_id]]

    def load_messages(self, r: LoadMessages) -> list[Message]:
        conv = self._conv(r.conversation_id)
        return [conv.messages[i] for i in dict.fromkeys(r.message_ids) if conv and i in conv.messages]

    def load_settled_range(self, r: LoadSettledRange) -> list[Message]:
        conv = self._conv(r.conversation_id)
        if conv is None:
            return []
        return [
            m
            for m in conv.messages.values()
            if m.active and m.band == "history" and m.position is not None and r.lo <= m.position <= r.hi
        ]

    def load_seed(self, r: LoadSeed) -> SeedRecord | None:
        conv = self._conv(r.conversation_id)
        return conv.seeds.get(r.seed_key) if conv else None

    def load_history(self, r: LoadHistory) -> list[Message]:
        conv = self._conv(r.conversation_id)
        return [m for m in conv.messages.values() if m.active] if conv else []

    def load_messages_since(self, r: LoadMessagesSince) -> list[Message]:
        conv = self._conv(r.conversation_id)
        if conv is None:
            return []
        return [m for m in conv.messages.values() if m.version > r.version and (m.active or r.include_inactive)]

    def load_runs_since(self, r: LoadRunsSince) -> list[Run]:
        conv = self._conv(r.conversation_id)
        return [run for run in conv.runs.values() if run.version > r.version] if conv else []

    def load_unsettled(self, r: LoadUnsettled) -> list[Message]:
        conv = self._conv(r.conversation_id)
        return [m for m in conv.messages.values() if m.position is None] if conv else []

    def page_settled(self, r: PageSettled) -> list[Message]:
        conv = self._conv(r.conversation_id)
        if conv is None:
            return []
        rows = [m for m in conv.messages.values() if m.position is not None and (m.active or r.include_inactive)]
        if r.direction == "after":
            rows = sorted((m for m in rows if r.cursor is None or m.sort_key > r.cursor), key=lambda m: m.sort_key)
        else:
            rows = sorted(
                (m for m in rows if r.cursor is None or m.sort_key < r.cursor), key=lambda m: m.sort_key, reverse=True
            )
        return rows[: r.limit]

    def scan_active_runs(self, r: ScanActiveRuns) -> list[Run]:
        keys = sorted(
            (cid, rid) for cid, conv in self.tables.items() if cid not in self.tombstones for rid in conv.active
        )
        if r.after is not None:
            keys = [k for k in keys if k > r.after]
        return [self.tables[cid].runs[rid] for cid, rid in keys[: r.limit]]

    def list_conversations(self, r: ListConversations) -> list[ConversationHead]:
        ids = sorted(cid for cid in self.tables if r.after is None or cid > r.after)
        return [self.tables[cid].head for cid in ids[: r.limit]]

    def load_events(self, r: LoadEvents) -> list[AgentStoreEvent]:
        conv = self._conv(r.conversation_id)
        if conv is None or r.to_seq < r.from_seq:
            return []
        lo = max(r.from_seq, 1) - 1
        return conv.events[lo : min(r.to_seq, lo + r.limit)]

    def load_event_keys(self, r: LoadEventKeys) -> list[tuple[str, int]]:
        conv = self._conv(r.conversation_id)
        return [(key, conv.keys[key]) for key in dict.fromkeys(r.keys) if key in conv.keys] if conv else []

    def load_all_receipts(self, r: LoadAllReceipts) -> list[AdmissionReceipt]:
        conv = self._conv(r.conversation_id)
        return list(conv.receipts.values()) if conv else []

    def load_all_seeds(self, r: LoadAllSeeds) -> list[SeedRecord]:
        conv = self._conv(r.conversation_id)
        return list(conv.seeds.values()) if conv else []

    def write(self, r: Write) -> None:
        self.staged.append(r)

    def purge(self, r: Purge) -> None:
        self.staged.append(r)

    def commit(self) -> None:
        for change in self.staged:
            if isinstance(change, Purge):
                self.tables.pop(change.conversation_id, None)
                self.tombstones.add(change.conversation_id)
                continue
            m = change.mutation
            assert m.head is not None, "every mutation writes the conversation head"
            conv = self.tables.get(m.head.conversation_id)
            if conv is None:
                conv = self.tables[m.head.conversation_id] = _Conversation(head=m.head)
            conv.head = m.head
            for run in m.runs:
                conv.runs[run.id] = run
                (conv.active.add if run.active else conv.active.discard)(run.id)
            for message in m.messages:
                conv.messages[message.id] = message
            for receipt in m.receipts:
                conv.receipts[receipt.idempotency_key] = receipt
                conv.receipt_by_input[receipt.input.id] = receipt.idempotency_key
            for seed in m.seeds:
                conv.seeds[seed.seed_key] = seed
            for event in m.events:
                # the reducer numbers events from the head: a gap or a repeat is a bug, never input
                assert event.seq == len(conv.events) + 1, f"event seq {event.seq} after {len(conv.events)}"
                conv.events.append(event)
                key = event_key(event)
                if key is not None:
                    # a unique index in the database drivers; the reducer never writes a key twice
                    assert conv.keys.setdefault(key, event.seq) == event.seq, f"event key {key} written twice"
