"""One transaction on one pooled connection: the row primitives a store operation asks for, batched into
as few round trips as the operation allows (:class:`PostgresRows`)."""

from __future__ import annotations

import contextlib
import json
import select
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import psycopg
from psycopg.pq import TransactionStatus

from ...ledger.events import AgentStoreEvent, event_key
from ...records import AdmissionReceipt, ConversationHead, Message, Run, SeedRecord
from ..codec import RecordCache, decode, encode_event, foreign
from ..driver import (
    Access,
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
    Request,
    ScanActiveRuns,
    Write,
)
from ._hints import Guard, Hint, Hints
from ._statements import (
    BEGIN_READ,
    BEGIN_WRITE,
    COMMIT,
    GENERIC_PLANS_LOCAL,
    PURGE_ORDER,
    Statements,
    Wire,
    clamp,
    cursor_shape,
)


class Alone(Exception):
    """A write in a batch needs the server before its commit (a row the hints cannot vouch for): it leaves
    the batch and runs in a transaction of its own."""


class Restart(Exception):
    """What the operation was answered from moved (a read's second snapshot found the conversation
    changed, or a guard of a write failed): run the operation again, without that shortcut."""


# the tables a request's rows come from (first column: the row's id), for what a write knows exists
_ROW_TABLE: dict[type, str] = {
    **dict.fromkeys((LoadRuns, ListActiveRuns, LoadAllRuns, LoadRunsSince), "run"),
    **dict.fromkeys(
        (LoadMessages, LoadSettledRange, LoadHistory, LoadMessagesSince, LoadUnsettled, PageSettled), "message"
    ),
}

_ANCHOR = object()  # the result slot of a continued read's head check
_RAW = object()  # the result slot of a raw statement (left current on the cursor)
_NONE = object()


class PostgresRows:
    """The :class:`~threadline.store.driver.AsyncRows` primitives over one connection inside one transaction.

    Statements that need no answer (``BEGIN``, the conversation lock, writes) wait in ``pending`` and go to
    the server in front of the next statement that needs an answer, or in front of ``COMMIT``: one
    simple-protocol query string, one round trip. A request that needs an answer goes together with the
    requests the operation is predicted to make next (``predict``: the driver's probe); their rows wait in
    ``known`` until the operation asks. In a write transaction the first statement naming a conversation
    is preceded by that conversation's advisory lock.

    A read whose requests were all foreseen ends its snapshot (``COMMIT``) in the same round trip. Should
    it ask for more, a new snapshot is opened and the conversation head read again: every committed write
    of a conversation rewrites its head (a higher version) or deletes it (purge), so an unchanged head means
    no commit in between, and the two snapshots agree on that conversation. A moved head is
    :class:`Restart`.
    """

    def __init__(
        self,
        conn: psycopg.AsyncConnection[Any],
        q: Statements,
        cache: RecordCache,
        access: Access,
        wire: Wire,
        hints: Hints,
    ) -> None:
        self.conn = conn
        self.cur = conn.cursor()
        self.q = q
        self.cache = cache
        self.wire = wire
        self.hints = hints
        self.writable = access == "write"
        self.speculate = False  # a write may answer from hints under guard
        self.unverified = False  # guards of answers given are pending
        self.round_trips = 0  # batches answered
        self.sent = 0  # batches sent (answered or failed)
        self.wrote: list[tuple[str, str, str, bool]] = []  # (table, id, body, active) for the hints
        self.pending: list[str | bytes | Guard] = [BEGIN_WRITE if self.writable else BEGIN_READ]
        self.begin_settings: tuple[bytes, ...] = () if wire.session_settings else (GENERIC_PLANS_LOCAL,)
        self.pending.extend(self.begin_settings)
        self.guard: Guard | None = None  # the guard gathering claims, already in ``pending``
        self.open = True  # a transaction is open (or opens with what is pending)
        self.locked: set[str] = set()
        self.written: list[str] = []
        # (table, conversation, id) of the rows this write transaction knows exist: read under the lock,
        # vouched for by its guard, or written by it. Only a purge deletes rows, and it takes the same lock.
        self.present: set[tuple[str, str, str]] = set()
        self.known: dict[Request, list[tuple[Any, ...]]] = {}
        self.predict: Callable[[Request], tuple[list[Request], bool]] | None = None
        self.anchor_request: LoadHead | None = None  # a read's first request, when it may end its snapshot early
        self.anchor: tuple[str, tuple[Any, ...]] | None = None
        self._binder: psycopg.AsyncClientCursor[Any] | None = None
        self.deferred = False  # a member of a batch: it sends nothing, and a request needing the server is Alone

    # ------------------------------------------------------------------------ statements and batches

    def _x(self, name: str, *values: object) -> bytes:
        literal = self.wire.literal
        return self.q.execute[name] + b", ".join([literal(v) for v in values]) + b")"

    def _bind(self, statement: str, params: Sequence[object] | dict[str, object]) -> bytes:
        if self._binder is None:
            self._binder = psycopg.AsyncClientCursor(self.conn)
        return self._binder.mogrify(statement, params).encode(self.wire.encoding)

    def _statement(self, r: Request) -> bytes | None:
        """The statement answering ``r`` (``None``: the answer is empty without asking)."""
        kind = type(r)
        x = self._x
        if kind is LoadHead:
            return x("head", r.conversation_id)  # type: ignore[attr-defined]
        if kind is LoadRuns:
            assert isinstance(r, LoadRuns)
            ids = list(dict.fromkeys(r.run_ids))
            if not ids:
                return None
            return x("run", r.conversation_id, ids[0]) if len(ids) == 1 else x("runs_any", r.conversation_id, ids)
        if kind is LoadMessages:
            assert isinstance(r, LoadMessages)
            ids = list(dict.fromkeys(r.message_ids))
            if not ids:
                return None
            if len(ids) == 1:
                return x("message", r.conversation_id, ids[0])
            return x("messages_any", r.conversation_id, ids)
        if kind is LoadRunsByAssistant:
            assert isinstance(r, LoadRunsByAssistant)
            return x("runs_by_assistant", r.conversation_id, list(dict.fromkeys(r.message_ids)))
        if kind is ListActiveRuns:
            return x("active_runs", r.conversation_id)  # type: ignore[attr-defined]
        if kind is LoadReceipt:
            assert isinstance(r, LoadReceipt)
            return x("receipt", r.conversation_id, r.idempotency_key)
        if kind is LoadReceiptByInput:
            assert isinstance(r, LoadReceiptByInput)
            return x("receipt_by_input", r.conversation_id, r.input_message_id)
        if kind is LoadMessagesSince:
            assert isinstance(r, LoadMessagesSince)
            name = "messages_since" if r.include_inactive else "active_messages_since"
            return x(name, r.conversation_id, clamp(r.version))
        if kind is LoadRunsSince:
            assert isinstance(r, LoadRunsSince)
            return x("runs_since", r.conversation_id, clamp(r.version))
        if kind is LoadAllRuns:
            return x("all_runs", r.conversation_id)  # type: ignore[attr-defined]
        if kind is LoadSettledRange:
            assert isinstance(r, LoadSettledRange)
            return x("settled_range", r.conversation_id, clamp(r.lo), clamp(r.hi))
        if kind is LoadSeed:
            assert isinstance(r, LoadSeed)
            return x("seed", r.conversation_id, r.seed_key)
        if kind is LoadHistory:
            return x("history", r.conversation_id)  # type: ignore[attr-defined]
        if kind is LoadUnsettled:
            return x("unsettled", r.conversation_id)  # type: ignore[attr-defined]
        if kind is PageSettled:
            assert isinstance(r, PageSettled)
            params: list[object] = [r.conversation_id]
            if r.cursor is None:
                statement = self.q.page(r.include_inactive, r.direction, 0, "")
            else:
                arity, op, values = cursor_shape(r.cursor, r.direction)
                statement = self.q.page(r.include_inactive, r.direction, arity, op)
                params.extend(values)
            params.append(r.limit)
            return self._bind(statement, params)
        if kind is ScanActiveRuns:
            assert isinstance(r, ScanActiveRuns)
            if r.after is None:
                return x("scan_first", r.limit)
            return x("scan_after", r.after[0], r.after[1], r.limit)
        if kind is ListConversations:
            assert isinstance(r, ListConversations)
            return x("conversations_first", r.limit) if r.after is None else x("conversations_after", r.after, r.limit)
        if kind is LoadEvents:
            assert isinstance(r, LoadEvents)
            return x("events", r.conversation_id, clamp(r.from_seq), clamp(r.to_seq), r.limit)
        if kind is LoadEventKeys:
            assert isinstance(r, LoadEventKeys)
            if not r.keys:
                return None
            return x("event_keys", r.conversation_id, list(dict.fromkeys(r.keys)))
        if kind is LoadAllReceipts:
            return x("all_receipts", r.conversation_id)  # type: ignore[attr-defined]
        if kind is LoadAllSeeds:
            return x("all_seeds", r.conversation_id)  # type: ignore[attr-defined]
        raise AssertionError(f"no statement answers {kind.__name__}")

    def _lock(self, conversation_id: str, into: list[bytes | str | Guard] | None = None) -> None:
        if self.writable and conversation_id not in self.locked:
            self.locked.add(conversation_id)
            (self.pending if into is None else into).append(self._x("lock", self.q.lock_prefix + conversation_id))

    async def _send(self, requests: Sequence[Request] = (), ends: bool = False, raw: bytes | None = None) -> None:
        """One round trip: what is pending, then a statement for each of ``requests`` (rows into ``known``),
        then ``raw`` (its result left current on the cursor). A read ends its snapshot here when ``ends``."""
        if self.deferred:
            raise Alone
        statements: list[str | bytes | Guard] = []
        slots: list[object] = []
        if not self.open:  # a read continuing after its snapshot ended: a new one, checked against the first
            assert self.anchor is not None
            statements += [BEGIN_READ, *self.begin_settings, self._x("head", self.anchor[0])]
            slots += [None] * (1 + len(self.begin_settings)) + [_ANCHOR]
            self.open = True
        statements += self.pending
        slots += [None] * len(self.pending)
        self.pending = []
        scope = getattr(requests[0], "conversation_id", None) if requests else None
        for i, r in enumerate(requests):
            cid = getattr(r, "conversation_id", None)
            if i and self.writable and cid != scope:
                continue  # a write locks the one conversation it touches, never a foreseen other
            statement = self._statement(r)
            if statement is None:
                self.known[r] = []
                continue
            if cid is not None:
                self._lock(cid, statements)
                slots += [None] * (len(statements) - len(slots))
            statements.append(statement)
            slots.append(r)
        if raw is not None:
            statements.append(raw)
            slots.append(_RAW)
        elif (
            ends
            and not self.writable
            and (self.anchor is not None or (self.anchor_request is not None and self.anchor_request in requests))
        ):
            statements.append(COMMIT)
            slots.append(None)
            self.open = False
        wire = self.wire
        encoding = wire.encoding
        cur = self.cur
        self.guard = None
        rendered: list[bytes] = []
        for s in statements:
            if isinstance(s, Guard):
                prepare, execute = s.statement(self.q, wire.literal)
                if prepare not in wire.guards:  # a shape new to this connection: prepared on its own
                    self.sent += 1
                    try:
                        await cur.execute(prepare, prepare=False)
                    except BaseException:  # prepared or not: unknown; the pool replaces a closed connection
                        with contextlib.suppress(Exception):
                            await self.conn.close()
                        raise
                    wire.guards.add(prepare)
                rendered.append(execute)
            else:
                rendered.append(s if isinstance(s, bytes) else s.encode(encoding))
        text = b"; ".join(rendered)
        self.sent += 1
        try:
            await cur.execute(text, prepare=False)
        except psycopg.errors.DivisionByZero as error:
            if self.unverified:  # a guard failed: a hint the operation was answered from is stale
                raise Restart from error
            raise
        self.round_trips += 1
        self.unverified = False
        saw = self.hints.saw
        for i, slot in enumerate(slots):
            if i and not cur.nextset():
                raise AssertionError("a statement of the batch returned no result")
            if slot is None or slot is _RAW:
                continue
            rows = await cur.fetchall()
            if slot is _ANCHOR:
                assert self.anchor is not None
                if rows[0] != self.anchor[1]:
                    raise Restart
                continue
            self.known[slot] = rows  # type: ignore[index]
            saw(slot, rows)  # type: ignore[arg-type]
            if slot is self.anchor_request and self.anchor is None:
                self.anchor = (self.anchor_request.conversation_id, rows[0])

    async def _rows(self, r: Request) -> list[tuple[Any, ...]]:
        rows = self.known.pop(r, _NONE)
        if rows is _NONE and self.speculate:
            rows = self._speculate(r)
        if rows is _NONE:
            requests, ends = self.predict(r) if self.predict is not None else ([r], False)
            await self._send(requests, ends)
            rows = self.known.pop(r)
        if self.writable:
            kind = type(r)
            cid: str = getattr(r, "conversation_id", "")
            if kind is LoadHead:
                if rows[0][0] is not None:  # type: ignore[index]
                    self.present.add(("head", cid, cid))
            else:
                table = _ROW_TABLE.get(kind)
                if table is not None:
                    self.present.update((table, cid, row[0]) for row in rows)  # type: ignore[union-attr]
        return rows  # type: ignore[return-value]

    def _speculate(self, r: Request) -> Any:
        """The rows answering ``r`` as the hints remember them — or, for an id never seen, no row — with
        what they claim added to the guard that the next round trip carries (after the lock): the server
        fails the transaction unless it holds exactly those rows. ``_NONE``: no claim worth making."""
        cid: str = getattr(r, "conversation_id", "")
        hint = self.hints.get(cid)
        if hint is None or hint.head is None or hint.purged:
            return _NONE  # a conversation this driver has not seen live: read it
        guard = self.guard
        if guard is None:
            guard = Guard(cid)
        elif guard.cid != cid:
            return _NONE
        kind = type(r)
        rows: list[tuple[Any, ...]] = []
        if kind is LoadHead:
            if guard.head not in (None, hint.head[1]):
                return _NONE
            guard.head = hint.head[1]
            rows = [(hint.head[0], False)]
        elif kind is LoadRuns or kind is LoadMessages:
            messages = kind is LoadMessages
            ids = list(dict.fromkeys(r.message_ids if messages else r.run_ids))  # type: ignore[attr-defined]
            table, present, absent = (
                (hint.messages, guard.messages, guard.absent_messages)
                if messages
                else (hint.runs, guard.runs, guard.absent_runs)
            )
            inputs = self._inputs(hint) if messages and any(i not in table for i in ids) else ()
            for i in ids:
                body = table.get(i)
                if body is None:
                    if i in present or i in inputs:  # an input of a run: it exists, written elsewhere
                        return _NONE
                elif i in absent or present.get(i, body[1]) != body[1]:
                    return _NONE
            for i in ids:
                body = table.get(i)
                if body is None:
                    absent[i] = None
                else:
                    present[i] = body[1]
                    rows.append((i, body[0]))
        elif kind is ListActiveRuns:
            if hint.active is None or any(i not in hint.runs for i in hint.active):
                return _NONE
            active = {i: hint.runs[i][1] for i in sorted(hint.active)}
            if guard.active is not None and guard.active != active:
                return _NONE
            guard.active = active
            rows = [(i, hint.runs[i][0]) for i in active]
        elif kind is LoadReceipt:
            guard.absent_keys[r.idempotency_key] = None  # type: ignore[attr-defined]
        elif kind is LoadReceiptByInput:
            guard.absent_inputs[r.input_message_id] = None  # type: ignore[attr-defined]
        elif kind is LoadEventKeys:
            # a body a request carries, a step's key, is usually new to the conversation: claimed absent,
            # checked by the guard
            guard.absent_event_keys.update(dict.fromkeys(r.keys))  # type: ignore[attr-defined]
        elif kind is LoadRunsByAssistant:
            ids = r.message_ids  # type: ignore[attr-defined]
            if any(run.assistant_message_id in ids for run in self._remembered_runs(hint)):
                return _NONE  # a remembered run has one of these answer ids: read the runs
            guard.absent_answers.update(dict.fromkeys(ids))
        else:
            return _NONE
        if self.guard is None:
            self._lock(cid)
            self.pending.append(guard)
            self.guard = guard
        self.unverified = True
        return rows

    def _inputs(self, hint: Hint) -> set[str]:
        """The input message ids of the runs the hints remember (they exist, though maybe never seen)."""
        out: set[str] = set()
        for run in self._remembered_runs(hint):
            out.update(run.input_message_ids)
        return out

    def _remembered_runs(self, hint: Hint) -> list[Run]:
        return [self.cache.get(Run, body, lambda: "a remembered run") for body, _ in hint.runs.values()]

    async def _execute(self, statement: str, params: Sequence[object] | dict[str, object]) -> None:
        """Run ``statement`` (after whatever is pending) and leave its result current on ``cur``."""
        await self._send(raw=self._bind(statement, params))

    async def _fetch(self, statement: str, params: Sequence[object]) -> list[tuple[Any, ...]]:
        await self._execute(statement, params)
        return await self.cur.fetchall()

    async def commit(self) -> None:
        """Send what is pending, then ``COMMIT``, in one round trip. A read that ended its snapshot early
        only makes sure its connection is still there (as a ``COMMIT`` would have)."""
        if self.open or self.pending:
            self.pending.append(COMMIT)
            await self._send()
            self.open = False
        else:
            await self._check_alive()

    async def _check_alive(self) -> None:
        """Raise ``OperationalError`` if the server dropped this idle connection: an idle socket that is
        readable holds a notice or the server's goodbye; a round trip tells which."""
        try:
            ready = bool(select.select([self.conn.pgconn.socket], [], [], 0)[0])
        except (OSError, ValueError, psycopg.Error):
            ready = True
        if ready:
            self.sent += 1
            await self.cur.execute(b"SELECT 1", prepare=False)

    # ------------------------------------------------------------------ decoding rows of one table

    def _runs(self, conversation_id: str, rows: Iterable[tuple[Any, ...]]) -> list[Run]:
        out = []
        get = self.cache.get
        for run_id, body in rows:
            run = get(Run, body, lambda r=run_id: f"threadline_runs conversation_id={conversation_id} run_id={r}")
            if run.id != run_id or run.conversation_id != conversation_id:
                where = f"threadline_runs conversation_id={conversation_id} run_id={run_id}"
                raise foreign("Run", where, f"{conversation_id}/{run_id}", f"{run.conversation_id}/{run.id}")
            out.append(run)
        return out

    def _messages(self, conversation_id: str, rows: Iterable[tuple[Any, ...]]) -> list[Message]:
        out = []
        for message_id, body in rows:
            where = f"threadline_messages conversation_id={conversation_id} message_id={message_id}"
            message = decode(Message, body, where)
            if message.id != message_id or message.conversation_id != conversation_id:
                raise foreign(
                    "Message", where, f"{conversation_id}/{message_id}", f"{message.conversation_id}/{message.id}"
                )
            out.append(message)
        return out

    def _head(self, conversation_id: str, body: object) -> ConversationHead:
        def where() -> str:
            return f"threadline_conversations conversation_id={conversation_id}"

        head = self.cache.get(ConversationHead, body, where)
        if head.conversation_id != conversation_id:
            raise foreign("ConversationHead", where(), conversation_id, head.conversation_id)
        return head

    def _receipt(self, conversation_id: str, rows: list[tuple[Any, ...]]) -> AdmissionReceipt | None:
        if not rows:
            return None
        key, body = rows[0]
        where = f"threadline_admissions conversation_id={conversation_id} idempotency_key={key}"
        receipt = decode(AdmissionReceipt, body, where)
        if receipt.conversation_id != conversation_id or receipt.idempotency_key != key:
            raise foreign(
                "AdmissionReceipt",
                where,
                f"{conversation_id}/{key}",
                f"{receipt.conversation_id}/{receipt.idempotency_key}",
            )
        return receipt

    # ------------------------------------------------------------------------------- the primitives

    async def load_head(self, r: LoadHead) -> HeadState:
        cid = r.conversation_id
        rows = await self._rows(r)
        if not rows:  # pragma: no cover - a scalar SELECT always answers one row
            raise AssertionError("the head query returned no row")
        body, purged = rows[0]
        return HeadState(self._head(cid, body) if body is not None else None, purged=bool(purged))

    async def load_runs(self, r: LoadRuns) -> list[Run]:
        if not r.run_ids:
            return []
        found = {run.id: run for run in self._runs(r.conversation_id, await self._rows(r))}
        return [found[i] for i in r.run_ids if i in found]

    async def load_runs_by_assistant(self, r: LoadRunsByAssistant) -> list[Run]:
        return self._runs(r.conversation_id, await self._rows(r)) if r.message_ids else []

    async def list_active_runs(self, r: ListActiveRuns) -> list[Run]:
        return self._runs(r.conversation_id, await self._rows(r))

    async def load_all_runs(self, r: LoadAllRuns) -> list[Run]:
        return self._runs(r.conversation_id, await self._rows(r))

    async def load_receipt(self, r: LoadReceipt) -> AdmissionReceipt | None:
        return self._receipt(r.conversation_id, await self._rows(r))

    async def load_receipt_by_input(self, r: LoadReceiptByInput) -> AdmissionReceipt | None:
        return self._receipt(r.conversation_id, await self._rows(r))

    async def load_messages(self, r: LoadMessages) -> list[Message]:
        if not r.message_ids:
            return []
        found = {m.id: m for m in self._messages(r.conversation_id, await self._rows(r))}
        return [found[i] for i in dict.fromkeys(r.message_ids) if i in found]

    async def load_settled_range(self, r: LoadSettledRange) -> list[Message]:
        return self._messages(r.conversation_id, await self._rows(r))

    async def load_seed(self, r: LoadSeed) -> SeedRecord | None:
        rows = await self._rows(r)
        if not rows:
            return None
        key, body = rows[0]
        where = f"threadline_seeds conversation_id={r.conversation_id} seed_key={key}"
        seed = self.cache.get(SeedRecord, body, lambda: where)
        if seed.conversation_id != r.conversation_id or seed.seed_key != r.seed_key:
            raise foreign(
                "SeedRecord", where, f"{r.conversation_id}/{r.seed_key}", f"{seed.conversation_id}/{seed.seed_key}"
            )
        return seed

    async def load_history(self, r: LoadHistory) -> list[Message]:
        return self._messages(r.conversation_id, await self._rows(r))

    async def load_messages_since(self, r: LoadMessagesSince) -> list[Message]:
        return self._messages(r.conversation_id, await self._rows(r))

    async def load_runs_since(self, r: LoadRunsSince) -> list[Run]:
        return self._runs(r.conversation_id, await self._rows(r))

    async def load_unsettled(self, r: LoadUnsettled) -> list[Message]:
        return self._messages(r.conversation_id, await self._rows(r))

    async def page_settled(self, r: PageSettled) -> list[Message]:
        return self._messages(r.conversation_id, await self._rows(r))

    async def scan_active_runs(self, r: ScanActiveRuns) -> list[Run]:
        out: list[Run] = []
        for cid, run_id, body in await self._rows(r):
            out.extend(self._runs(cid, ((run_id, body),)))
        return out

    async def list_conversations(self, r: ListConversations) -> list[ConversationHead]:
        return [self._head(cid, body) for cid, body in await self._rows(r)]

    async def load_events(self, r: LoadEvents) -> list[AgentStoreEvent]:
        cid = r.conversation_id
        out = []
        for seq, body in await self._rows(r):
            where = f"threadline_events conversation_id={cid} seq={seq}"
            event = decode(AgentStoreEvent, body, where)
            if event.conversation_id != cid or event.seq != seq:
                raise foreign("AgentStoreEvent", where, f"{cid}/{seq}", f"{event.conversation_id}/{event.seq}")
            out.append(event)
        return out

    async def load_event_keys(self, r: LoadEventKeys) -> list[tuple[str, int]]:
        return [(key, int(seq)) for key, seq in await self._rows(r)] if r.keys else []

    async def load_all_receipts(self, r: LoadAllReceipts) -> list[AdmissionReceipt]:
        out = []
        for row in await self._rows(r):
            receipt = self._receipt(r.conversation_id, [row])
            assert receipt is not None
            out.append(receipt)
        return out

    async def load_all_seeds(self, r: LoadAllSeeds) -> list[SeedRecord]:
        out = []
        for key, body in await self._rows(r):
            where = f"threadline_seeds conversation_id={r.conversation_id} seed_key={key}"
            out.append(self.cache.get(SeedRecord, body, lambda where=where: where))
        return out

    async def write(self, r: Write) -> None:
        if not self.writable:
            raise AssertionError("a read operation wrote")
        m = r.mutation
        if m.head is None:
            raise AssertionError("every mutation writes the conversation head")
        cid = m.head.conversation_id
        self._lock(cid)
        self.written.append(cid)
        self.known.clear()  # rows read ahead predate this write
        x, encode, pending, wrote = self._x, self.cache.encode, self.pending, self.wrote
        # one statement per row, so a row written twice in one mutation keeps its last version, as in memory
        body = encode(m.head)
        pending.append(x(self._verb("head", cid, cid) + "_head", cid, m.head.version, body))
        wrote.append(("head", cid, body, True))
        for run in m.runs:
            body = encode(run)
            verb = self._verb("run", run.conversation_id, run.id)
            pending.append(
                x(verb + "_run", run.conversation_id, run.id, run.active, run.version, body, run.assistant_message_id)
            )
            wrote.append(("run", run.id, body, run.active))
            if run.state in ("interrupt_requested", "queued"):
                # delivered at COMMIT: executors learn of a durable interrupt at once, workers of new work
                event = "interrupt" if run.state == "interrupt_requested" else "queued"
                payload = json.dumps({"event": event, "conversation_id": run.conversation_id, "run_id": run.id})
                pending.append(x("notify", self.q.channel, payload))
        for msg in m.messages:
            body = encode(msg)
            pending.append(
                x(
                    self._verb("message", msg.conversation_id, msg.id) + "_message",
                    msg.conversation_id,
                    msg.id,
                    0 if msg.band == "lead" else 1,
                    msg.position,
                    1 if msg.role == "summary" else 0,
                    msg.seq,
                    msg.active,
                    msg.version,
                    body,
                )
            )
            wrote.append(("message", msg.id, body, msg.active))
        for rc in m.receipts:
            pending.append(x("insert_receipt", rc.conversation_id, rc.idempotency_key, rc.input.id, encode(rc)))
        for seed in m.seeds:
            pending.append(x("insert_seed", seed.conversation_id, seed.seed_key, encode(seed)))
        for event in m.events:
            pending.append(x("insert_event", cid, event.seq, event.kind, event_key(event), encode_event(event)))

    def _verb(self, table: str, cid: str, key: str) -> str:
        """``update`` for a row known to exist, else ``upsert``; either way the row exists afterwards."""
        row = (table, cid, key)
        if row in self.present:
            return "update"
        self.present.add(row)
        return "upsert"

    async def purge(self, r: Purge) -> None:
        if not self.writable:
            raise AssertionError("a read operation purged")
        cid = r.conversation_id
        self._lock(cid)
        self.written.append(cid)
        self.known.clear()
        self.pending.extend(self._x(name, cid) for name in PURGE_ORDER)
        self.wrote.append(("purge", cid, "", False))


def idle_and_quiet(conn: psycopg.AsyncConnection[Any]) -> bool:
    """Whether nothing waits to be read on this idle connection (one ``select``, no round trip). A server
    that dropped the connection (restart, ``pg_terminate_backend``, idle timeout) has sent its goodbye."""
    try:
        return not select.select([conn.pgconn.socket], [], [], 0)[0]
    except (OSError, ValueError, psycopg.Error):
        return False


async def rollback(conn: psycopg.AsyncConnection[Any]) -> int:
    """End a failed transaction; a broken connection is left to the pool, which discards it. Returns the
    round trips it took (0 or 1)."""
    if conn.closed or conn.info.transaction_status not in (TransactionStatus.INTRANS, TransactionStatus.INERROR):
        return 0
    with contextlib.suppress(psycopg.Error):
        await conn.execute("ROLLBACK", prepare=False)
    return 1
