"""The driver seam: one transaction boundary and a handful of row primitives.

A store operation is a *sans-I/O generator* written once in :mod:`threadline.store.reducer`. It yields
row requests (``LoadHead``, ``ListActiveRuns``, ``Write`` …) and receives their answers; it never
touches a database, a clock or a random source. A driver runs that generator inside one transaction:

- a synchronous driver (memory, SQLite) implements :class:`SyncRows` and calls :func:`drive_sync`
  (SQLite: several queued operations sharing one transaction; one that fails after writing rolls it back,
  and those that saw its writes run again from the start in the next);
- an asynchronous driver (PostgreSQL) implements :class:`AsyncRows` and calls :func:`drive_async`.

Because the generator is pure, a driver may run it again from the start after a serialization
failure: nothing it decided depends on anything but the rows it read.

Drivers store and load rows; they never decide a transition. Every request is answered with records
(or ``None``), in the order the request names.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, TypeAlias, TypeVar

from ..ledger.events import AgentStoreEvent
from ..records import AdmissionReceipt, ConversationHead, Message, Run, SeedRecord

T = TypeVar("T")
T_co = TypeVar("T_co", covariant=True)
Access = Literal["read", "write"]
SortKey: TypeAlias = tuple[int, ...]

# ------------------------------------------------------------------------------------------ requests


@dataclass(frozen=True, slots=True)
class HeadState:
    """Answer to :class:`LoadHead`: the head, or ``None``; ``purged`` when a tombstone exists."""

    head: ConversationHead | None
    purged: bool = False


@dataclass(frozen=True, slots=True)
class LoadHead:
    """-> :class:`HeadState`. Reads the head row (and the tombstone when there is no head)."""

    conversation_id: str


@dataclass(frozen=True, slots=True)
class LoadRuns:
    """-> list of the runs found among ``run_ids`` (missing ids are simply absent)."""

    conversation_id: str
    run_ids: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class LoadRunsByAssistant:
    """-> the runs of the conversation whose ``assistant_message_id`` is one of ``message_ids`` (any state:
    an absorbed run's answer id is taken too, though it never writes a message). Indexed."""

    conversation_id: str
    message_ids: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class ListActiveRuns:
    """-> every run of the conversation whose state is queued, running or interrupt_requested."""

    conversation_id: str


@dataclass(frozen=True, slots=True)
class LoadAllRuns:
    """-> every run of the conversation (used only by whole-snapshot reads)."""

    conversation_id: str


@dataclass(frozen=True, slots=True)
class LoadReceipt:
    """-> the admission receipt for ``idempotency_key``, or ``None``."""

    conversation_id: str
    idempotency_key: str


@dataclass(frozen=True, slots=True)
class LoadReceiptByInput:
    """-> the admission receipt whose input message id is ``input_message_id``, or ``None``."""

    conversation_id: str
    input_message_id: str


@dataclass(frozen=True, slots=True)
class LoadMessages:
    """-> the messages found among ``message_ids`` (active or not; missing ids are absent)."""

    conversation_id: str
    message_ids: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class LoadSettledRange:
    """-> the *active* settled ``history``-band messages with ``lo <= position <= hi``."""

    conversation_id: str
    lo: int
    hi: int


@dataclass(frozen=True, slots=True)
class LoadSeed:
    """-> the seed record for ``seed_key``, or ``None``."""

    conversation_id: str
    seed_key: str


@dataclass(frozen=True, slots=True)
class LoadHistory:
    """-> every active message of the conversation, in any order (whole-snapshot reads only)."""

    conversation_id: str


@dataclass(frozen=True, slots=True)
class LoadMessagesSince:
    """-> every message written by a conversation version greater than ``version`` (``Message.version``),
    in any order; inactive ones only when ``include_inactive``."""

    conversation_id: str
    version: int
    include_inactive: bool


@dataclass(frozen=True, slots=True)
class LoadRunsSince:
    """-> every run written by a conversation version greater than ``version`` (``Run.version``)."""

    conversation_id: str
    version: int


@dataclass(frozen=True, slots=True)
class LoadUnsettled:
    """-> every message with no position yet (they belong to active runs), in any order."""

    conversation_id: str


@dataclass(frozen=True, slots=True)
class PageSettled:
    """-> up to ``limit`` settled messages ordered by ``Message.sort_key``.

    ``direction='after'``: ascending, keys strictly greater than ``cursor`` (all when ``None``).
    ``direction='before'``: descending, keys strictly less than ``cursor`` (from the newest when ``None``).
    Inactive (compacted) messages are included only when ``include_inactive``.
    """

    conversation_id: str
    direction: Literal["after", "before"]
    cursor: SortKey | None
    limit: int
    include_inactive: bool


@dataclass(frozen=True, slots=True)
class ScanActiveRuns:
    """-> up to ``limit`` active runs of non-purged conversations, ordered by (conversation_id, run id),
    strictly after ``after`` when given. The order is only a paging order, never execution order."""

    after: tuple[str, str] | None
    limit: int


@dataclass(frozen=True, slots=True)
class ListConversations:
    """-> up to ``limit`` heads ordered by conversation id, strictly after ``after`` when given."""

    after: str | None
    limit: int


@dataclass(frozen=True, slots=True)
class LoadEvents:
    """-> up to ``limit`` ledger events with ``from_seq <= seq <= to_seq``, in ``seq`` order. Indexed by
    (conversation, seq): a page costs its rows, wherever in the journal it starts."""

    conversation_id: str
    from_seq: int
    to_seq: int
    limit: int


@dataclass(frozen=True, slots=True)
class LoadEventKeys:
    """-> ``(key, seq)`` of each lookup key among ``keys`` that an event of the conversation's ledger holds
    (:func:`threadline.ledger.events.event_key`: a ``provider/message`` body's digest, a durable step's
    intent or proof); an index on the key, never a scan of the journal. A key names at most one event."""

    conversation_id: str
    keys: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class LoadAllReceipts:
    """-> every admission receipt of the conversation (export only)."""

    conversation_id: str


@dataclass(frozen=True, slots=True)
class LoadAllSeeds:
    """-> every seed record of the conversation (export only)."""

    conversation_id: str


@dataclass(frozen=True, slots=True)
class Mutation:
    """Rows to write in the current transaction. Head, runs and messages are upserts by id; receipts and
    seeds are inserts (the reducer never rewrites them), and so are ledger ``events``."""

    head: ConversationHead | None = None
    runs: tuple[Run, ...] = ()
    messages: tuple[Message, ...] = ()
    receipts: tuple[AdmissionReceipt, ...] = ()
    seeds: tuple[SeedRecord, ...] = ()
    events: tuple[AgentStoreEvent, ...] = ()

    @property
    def row_count(self) -> int:
        return (
            (1 if self.head else 0)
            + len(self.runs)
            + len(self.messages)
            + len(self.receipts)
            + len(self.seeds)
            + len(self.events)
        )


@dataclass(frozen=True, slots=True)
class Write:
    """-> ``None``. Applies ``mutation`` inside the transaction."""

    mutation: Mutation


@dataclass(frozen=True, slots=True)
class Purge:
    """-> ``None``. Deletes every row the conversation owns (active and compacted messages, runs, receipts,
    seeds, head) and writes a permanent tombstone, all inside the transaction."""

    conversation_id: str


Request: TypeAlias = (
    LoadHead
    | LoadRuns
    | LoadRunsByAssistant
    | ListActiveRuns
    | LoadAllRuns
    | LoadReceipt
    | LoadReceiptByInput
    | LoadMessages
    | LoadSettledRange
    | LoadSeed
    | LoadHistory
    | LoadMessagesSince
    | LoadRunsSince
    | LoadUnsettled
    | PageSettled
    | ScanActiveRuns
    | ListConversations
    | LoadEvents
    | LoadEventKeys
    | LoadAllReceipts
    | LoadAllSeeds
    | Write
    | Purge
)

Operation: TypeAlias = Generator[Request, Any, T]
"""A store operation: yields requests, receives answers, returns its result."""

# ------------------------------------------------------------------------------------------- drivers


class SyncRows(Protocol):
    """Row primitives of a synchronous driver, called inside its open transaction."""

    def load_head(self, r: LoadHead) -> HeadState: ...
    def load_runs(self, r: LoadRuns) -> list[Run]: ...
    def load_runs_by_assistant(self, r: LoadRunsByAssistant) -> list[Run]: ...
    def list_active_runs(self, r: ListActiveRuns) -> list[Run]: ...
    def load_all_runs(self, r: LoadAllRuns) -> list[Run]: ...
    def load_receipt(self, r: LoadReceipt) -> AdmissionReceipt | None: ...
    def load_receipt_by_input(self, r: LoadReceiptByInput) -> AdmissionReceipt | None: ...
    def load_messages(self, r: LoadMessages) -> list[Message]: ...
    def load_settled_range(self, r: LoadSettledRange) -> list[Message]: ...
    def load_seed(self, r: LoadSeed) -> SeedRecord | None: ...
    def load_history(self, r: LoadHistory) -> list[Message]: ...
    def load_messages_since(self, r: LoadMessagesSince) -> list[Message]: ...
    def load_runs_since(self, r: LoadRunsSince) -> list[Run]: ...
    def load_unsettled(self, r: LoadUnsettled) -> list[Message]: ...
    def page_settled(self, r: PageSettled) -> list[Message]: ...
    def scan_active_runs(self, r: ScanActiveRuns) -> list[Run]: ...
    def list_conversations(self, r: ListConversations) -> list[ConversationHead]: ...
    def load_events(self, r: LoadEvents) -> list[AgentStoreEvent]: ...
    def load_event_keys(self, r: LoadEventKeys) -> list[tuple[str, int]]: ...
    def load_all_receipts(self, r: LoadAllReceipts) -> list[AdmissionReceipt]: ...
    def load_all_seeds(self, r: LoadAllSeeds) -> list[SeedRecord]: ...
    def write(self, r: Write) -> None: ...
    def purge(self, r: Purge) -> None: ...


class AsyncRows(Protocol):
    """Row primitives of an asynchronous driver; the same contract as :class:`SyncRows`."""

    async def load_head(self, r: LoadHead) -> HeadState: ...
    async def load_runs(self, r: LoadRuns) -> list[Run]: ...
    async def load_runs_by_assistant(self, r: LoadRunsByAssistant) -> list[Run]: ...
    async def list_active_runs(self, r: ListActiveRuns) -> list[Run]: ...
    async def load_all_runs(self, r: LoadAllRuns) -> list[Run]: ...
    async def load_receipt(self, r: LoadReceipt) -> AdmissionReceipt | None: ...
    async def load_receipt_by_input(self, r: LoadReceiptByInput) -> AdmissionReceipt | None: ...
    async def load_messages(self, r: LoadMessages) -> list[Message]: ...
    async def load_settled_range(self, r: LoadSettledRange) -> list[Message]: ...
    async def load_seed(self, r: LoadSeed) -> SeedRecord | None: ...
    async def load_history(self, r: LoadHistory) -> list[Message]: ...
    async def load_messages_since(self, r: LoadMessagesSince) -> list[Message]: ...
    async def load_runs_since(self, r: LoadRunsSince) -> list[Run]: ...
    async def load_unsettled(self, r: LoadUnsettled) -> list[Message]: ...
    async def page_settled(self, r: PageSettled) -> list[Message]: ...
    async def scan_active_runs(self, r: ScanActiveRuns) -> list[Run]: ...
    async def list_conversations(self, r: ListConversations) -> list[ConversationHead]: ...
    async def load_events(self, r: LoadEvents) -> list[AgentStoreEvent]: ...
    async def load_event_keys(self, r: LoadEventKeys) -> list[tuple[str, int]]: ...
    async def load_all_receipts(self, r: LoadAllReceipts) -> list[AdmissionReceipt]: ...
    async def load_all_seeds(self, r: LoadAllSeeds) -> list[SeedRecord]: ...
    async def write(self, r: Write) -> None: ...
    async def purge(self, r: Purge) -> None: ...


class StoreDriver(Protocol):
    """What :func:`create_agent_runtime_store` needs: run one operation in one transaction.

    ``operation`` is a zero-argument factory returning a fresh operation generator (its ids and ``now``
    are already fixed), so a driver may call it again to retry the whole operation from the start after
    a serialization failure or deadlock (reset ``stats`` rows counts if it does).

    ``access='read'`` may use a read-only snapshot transaction; ``'write'`` must serialize with every
    other write of the same conversation (SQLite ``BEGIN IMMEDIATE``; PostgreSQL an advisory lock per
    conversation at READ COMMITTED). An exception from the operation undoes its writes (the transaction, or its
    savepoint in a shared one; or the shared transaction, the others running again) and propagates.
    ``stats`` receives the rows read and written so benchmarks can count work per operation.
    """

    async def run(self, operation: Callable[[], Operation[T]], *, access: Access, stats: OperationStats) -> T: ...

    async def aclose(self) -> None: ...


@dataclass(slots=True)
class OperationStats:
    """Rows read and written by store operations, accumulated per operation name."""

    calls: int = 0
    rows_read: int = 0
    rows_written: int = 0
    by_request: dict[str, int] = field(default_factory=dict)
    writes: list[Write | Purge] = field(default_factory=list)
    """The writes of one operation, in order (not accumulated into totals); observers learn from them."""

    def read(self, request: Request, answer: object) -> None:
        if isinstance(answer, list):
            n = len(answer)
        elif isinstance(answer, HeadState):
            n = 1
        else:
            n = 0 if answer is None else 1
        self.rows_read += n
        name = type(request).__name__
        self.by_request[name] = self.by_request.get(name, 0) + n


_SYNC_DISPATCH: dict[type, str] = {
    LoadHead: "load_head",
    LoadRuns: "load_runs",
    LoadRunsByAssistant: "load_runs_by_assistant",
    ListActiveRuns: "list_active_runs",
    LoadAllRuns: "load_all_runs",
    LoadReceipt: "load_receipt",
    LoadReceiptByInput: "load_receipt_by_input",
    LoadMessages: "load_messages",
    LoadSettledRange: "load_settled_range",
    LoadSeed: "load_seed",
    LoadHistory: "load_history",
    LoadMessagesSince: "load_messages_since",
    LoadRunsSince: "load_runs_since",
    LoadUnsettled: "load_unsettled",
    PageSettled: "page_settled",
    ScanActiveRuns: "scan_active_runs",
    ListConversations: "list_conversations",
    LoadEvents: "load_events",
    LoadEventKeys: "load_event_keys",
    LoadAllReceipts: "load_all_receipts",
    LoadAllSeeds: "load_all_seeds",
    Write: "write",
    Purge: "purge",
}


def _count_write(request: Write | Purge, stats: OperationStats) -> None:
    stats.writes.append(request)
    if isinstance(request, Write):
        stats.rows_written += request.mutation.row_count
    else:
        stats.rows_written += 1  # the tombstone; deleted rows are not counted as written


_DISPATCH_BY_ROWS: dict[type, dict[type, Callable[[Any, Any], Any]]] = {}


def _dispatch(rows_type: type) -> dict[type, Callable[[Any, Any], Any]]:
    """The row primitives ``rows_type`` defines as methods, per request type, looked up once per class (no
    bound method per request). One it does not define (a proxy's ``__getattr__``) is looked up on the
    object each time."""
    table = _DISPATCH_BY_ROWS.get(rows_type)
    if table is None:
        table = _DISPATCH_BY_ROWS[rows_type] = {
            kind: method for kind, name in _SYNC_DISPATCH.items() if callable(method := getattr(rows_type, name, None))
        }
    return table


def drive_sync(operation: Operation[T], rows: SyncRows, stats: OperationStats | None = None) -> T:
    """Run ``operation`` to completion against synchronous row primitives (inside one transaction)."""
    answer: Any = None
    send = operation.send
    primitives = _dispatch(type(rows))
    try:
        while True:
            request = send(answer)
            kind = type(request)
            primitive = primitives.get(kind)
            answer = primitive(rows, request) if primitive else getattr(rows, _SYNC_DISPATCH[kind])(request)
            if stats is not None:
                if kind is Write or kind is Purge:
                    _count_write(request, stats)
                else:  # OperationStats.read, inline: several reads per operation
                    n = len(answer) if isinstance(answer, list) else (0 if answer is None else 1)
                    stats.rows_read += n
                    by_request = stats.by_request
                    by_request[kind.__name__] = by_request.get(kind.__name__, 0) + n
    except StopIteration as done:
        return done.value  # type: ignore[no-any-return]


async def drive_async(operation: Operation[T], rows: AsyncRows, stats: OperationStats | None = None) -> T:
    """Run ``operation`` to completion against asynchronous row primitives (inside one transaction)."""
    answer: Any = None
    send = operation.send
    try:
        while True:
            request = send(answer)
            kind = type(request)
            answer = await getattr(rows, _SYNC_DISPATCH[kind])(request)
            if stats is not None:
                if kind is Write or kind is Purge:
                    _count_write(request, stats)
                else:
                    stats.read(request, answer)
    except StopIteration as done:
        return done.value  # type: ignore[no-any-return]


def sort_settled(messages: Sequence[Message]) -> list[Message]:
    """Settled messages in causal order (helper for drivers that keep rows unsorted)."""
    return sorted(messages, key=lambda m: m.sort_key)
