"""What the driver last saw of each recent conversation (:class:`Hints`), and the claims a write answered
from them makes the server check (:class:`Guard`)."""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from pydantic import BaseModel

from ...records import ConversationHead, Run
from ..codec import RecordCache
from ..driver import (
    HeadState,
    ListActiveRuns,
    LoadHead,
    LoadMessages,
    LoadReceipt,
    LoadReceiptByInput,
    LoadRuns,
    LoadRunsByAssistant,
    LoadSeed,
    Request,
)

if TYPE_CHECKING:
    from ._statements import Statements


M = TypeVar("M", bound=BaseModel)


HINT_CONVERSATIONS = 4096
_HINT_ROWS = 16  # runs, and messages, per conversation
_HINT_MAX_BODY = 64 * 1024  # characters: a larger message is not remembered
_HINT_MESSAGE_BUDGET = 16 * 1024 * 1024  # characters of message bodies remembered per driver

Body = tuple[str, str]  # a row's stored JSON and its digest (:func:`digest`)


def digest(body: str) -> str:
    """What a guard compares: ``sha256(convert_to(body, 'UTF8'))`` on the server (whatever its encoding)."""
    return hashlib.sha256(body.encode()).hexdigest()


class Hint:
    __slots__ = ("active", "head", "message_chars", "messages", "purged", "runs")

    def __init__(self) -> None:
        self.head: Body | None = None
        self.purged = False
        self.runs: dict[str, Body] = {}
        self.messages: dict[str, Body] = {}
        self.message_chars = 0
        self.active: dict[str, None] | None = None  # the ids of exactly the active runs, when known


class Hints:
    """The rows this driver last read or committed of each recent conversation: its head, its recent runs
    and messages (stored JSON and digest), which runs are active. Bounded: recent conversations, recent rows
    each, a budget of message text.

    They serve twice, never as a plain answer: a *probe* of an operation is answered from them to foresee
    its next requests (:meth:`PostgresStoreDriver._predict`), and a write may answer from them *under
    guard* (:meth:`PostgresRows._speculate`): the digest of each row it was given is checked by the server,
    under the conversation lock, in the round trip that carries the writes. A wrong hint costs time only.
    """

    def __init__(self, cache: RecordCache) -> None:
        self.by_conversation: OrderedDict[str, Hint] = OrderedDict()
        self.cache = cache
        self.message_chars = 0

    def get(self, cid: str) -> Hint | None:
        return self.by_conversation.get(cid)

    def forget(self, cid: str) -> None:
        self._drop(cid)

    def forget_all(self) -> None:
        self.by_conversation.clear()
        self.message_chars = 0

    def _get(self, cid: str) -> Hint:
        hint = self.by_conversation.get(cid)
        if hint is None:
            hint = self.by_conversation[cid] = Hint()
            if len(self.by_conversation) > HINT_CONVERSATIONS:
                self._drop(next(iter(self.by_conversation)))
        else:
            self.by_conversation.move_to_end(cid)
        return hint

    def _drop(self, cid: str) -> None:
        hint = self.by_conversation.pop(cid, None)
        if hint is not None:
            self.message_chars -= hint.message_chars

    @staticmethod
    def _put(table: dict[str, Body], key: str, value: Body) -> Body | None:
        table.pop(key, None)
        table[key] = value
        if len(table) > _HINT_ROWS:
            return table.pop(next(iter(table)))
        return None

    def _message(self, hint: Hint, key: str, value: Body) -> None:
        old = hint.messages.pop(key, None)
        if old is not None:
            hint.message_chars -= len(old[0])
            self.message_chars -= len(old[0])
        if len(value[0]) > _HINT_MAX_BODY:
            return
        evicted = self._put(hint.messages, key, value)
        hint.message_chars += len(value[0]) - (len(evicted[0]) if evicted else 0)
        self.message_chars += len(value[0]) - (len(evicted[0]) if evicted else 0)
        while self.message_chars > _HINT_MESSAGE_BUDGET and self.by_conversation:
            self._drop(next(iter(self.by_conversation)))

    # ------------------------------------------------------------------------------------ learning

    def saw(self, r: Request, rows: list[tuple[Any, ...]]) -> None:
        """Remember the rows the server answered ``r`` with (read under the lock, or in a snapshot)."""
        kind = type(r)
        if kind is LoadHead:
            hint = self._get(r.conversation_id)  # type: ignore[attr-defined]
            body, purged = rows[0]
            hint.head = (body, digest(body)) if isinstance(body, str) else None
            hint.purged = bool(purged)
        elif kind is LoadRuns or kind is ListActiveRuns:
            hint = self._get(r.conversation_id)  # type: ignore[attr-defined]
            for run_id, body in rows:
                if isinstance(body, str):
                    self._put(hint.runs, run_id, (body, digest(body)))
            if kind is ListActiveRuns:
                hint.active = dict.fromkeys(run_id for run_id, _ in rows)
        elif kind is LoadMessages:
            hint = self._get(r.conversation_id)  # type: ignore[attr-defined]
            for message_id, body in rows:
                if isinstance(body, str):
                    self._message(hint, message_id, (body, digest(body)))

    def wrote(self, cid: str, written: list[tuple[str, str, str, bool]]) -> None:
        """Remember the rows of a committed write: ``(table, id, body, active)``; table ``head``, ``run``,
        ``message`` or ``purge``."""
        hint = self._get(cid)
        for table, key, body, active in written:
            if table == "purge":
                self._drop(cid)
                return
            value = (body, digest(body))
            if table == "head":
                hint.head, hint.purged = value, False
            elif table == "run":
                self._put(hint.runs, key, value)
                if hint.active is not None:
                    if active:
                        hint.active[key] = None
                    else:
                        hint.active.pop(key, None)
            else:
                self._message(hint, key, value)

    # ------------------------------------------------------------------------------------- probing

    def answer(self, r: Request) -> Any:
        """A plausible answer to ``r`` for a probe: the remembered rows, else nothing found."""
        kind = type(r)
        if kind in (LoadReceipt, LoadReceiptByInput, LoadSeed):
            return None
        if kind is LoadRunsByAssistant:
            return []
        hint = self.by_conversation.get(getattr(r, "conversation_id", ""))
        if kind is LoadHead:
            if hint is None or hint.head is None:
                return HeadState(None, purged=hint.purged if hint is not None else False)
            return HeadState(self._decode(ConversationHead, hint.head[0]), purged=hint.purged)
        if hint is None:
            return []
        if kind is LoadRuns:
            runs = hint.runs
            return [self._decode(Run, runs[i][0]) for i in r.run_ids if i in runs]  # type: ignore[attr-defined]
        if kind is ListActiveRuns and hint.active is not None:
            runs = hint.runs
            return [self._decode(Run, runs[i][0]) for i in sorted(hint.active) if i in runs]
        return []

    def _decode(self, model: type[M], body: str) -> M:
        return self.cache.get(model, body, lambda: "a remembered row")


class Guard:
    """The claims one guard statement checks (its parts: :data:`GUARD_PARTS`), gathered from the answers a write
    was given from hints until the round trip that carries them."""

    __slots__ = (
        "absent_answers",
        "absent_event_keys",
        "absent_inputs",
        "absent_keys",
        "absent_messages",
        "absent_runs",
        "active",
        "cid",
        "head",
        "messages",
        "runs",
    )

    def __init__(self, cid: str) -> None:
        self.cid = cid
        self.head: str | None = None
        self.runs: dict[str, str] = {}
        self.absent_runs: dict[str, None] = {}
        self.active: dict[str, str] | None = None
        self.messages: dict[str, str] = {}
        self.absent_messages: dict[str, None] = {}
        self.absent_keys: dict[str, None] = {}
        self.absent_inputs: dict[str, None] = {}
        self.absent_answers: dict[str, None] = {}
        self.absent_event_keys: dict[str, None] = {}

    def statement(self, q: Statements, literal: Callable[[object], bytes]) -> tuple[bytes, bytes]:
        """The ``PREPARE`` text of this guard's shape and the ``EXECUTE`` that checks its claims."""
        parts: list[str] = []
        values: list[object] = [self.cid]
        for part, claim in (
            ("head", self.head),
            ("runs", self.runs),
            ("no_runs", self.absent_runs),
            ("active", self.active),
            ("messages", self.messages),
            ("no_messages", self.absent_messages),
            ("no_keys", self.absent_keys),
            ("no_inputs", self.absent_inputs),
            ("no_event_keys", self.absent_event_keys),
            ("no_answers", self.absent_answers),
        ):
            if claim is None or (not claim and part != "active"):
                continue
            parts.append(part)
            if isinstance(claim, str):
                values.append(claim)
            elif part in ("runs", "active", "messages"):
                values += [list(claim), list(claim.values())]  # type: ignore[union-attr]
            else:
                values.append(list(claim))
        prepare, execute = q.guard(tuple(parts))
        return prepare, execute + b", ".join([literal(v) for v in values]) + b")"
