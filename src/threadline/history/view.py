"""A cached view of one conversation that a runtime keeps current by reading only what changed.

Every stored message and run carries the conversation version that last wrote it, so
``store.load_changes(since_version=v)`` returns just the rows newer than the view. Settled history is
append-mostly (positions are handed out in order), so the view appends in O(1) and re-sorts only when
compaction or a ``lead`` seed changes the past. The projection of settled history is kept too and only
extended; each request forks it and projects the live tail. A step therefore costs the tail, not the
conversation — the full snapshot is read once, when the view is built.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence

from ..records import ACTIVE_RUN_STATES, Message, Run
from ..store.driver import Purge, Write
from ..store.results import ConversationChanges
from .projection import AgentHistoryProjectionOptions, _Projector


class ConversationView:
    """Active history of one conversation in causal order, refreshed incrementally."""

    def __init__(self, conversation_id: str) -> None:
        self.conversation_id = conversation_id
        self.version = 0
        self.generation = 0
        """Bumped whenever settled history changed other than by appending (compaction, lead seeds)."""
        self._settled: list[Message] = []
        self._keys: list[tuple[int, ...]] = []
        self._unsettled: dict[str, Message] = {}
        self._by_id: dict[str, Message] = {}
        self._runs: dict[str, Run] = {}
        self._projector: _Projector | None = None
        self._projected = 0
        self._projected_generation = -1
        self._projected_options: AgentHistoryProjectionOptions | None = None
        self.ledger_state: object = None
        """Kept here for the loop: what this process knows of the conversation's ledger (the digests of
        the settled projection's messages for provider request records; ``threadline.ledger.digests``)."""

    async def refresh(self, store: object) -> None:
        """Catch up with the store (one bounded read of what changed since ``version``)."""
        changes = await store.load_changes(conversation_id=self.conversation_id, since_version=self.version)  # type: ignore[attr-defined]
        self.apply(changes)

    def apply(self, changes: ConversationChanges) -> None:
        self._apply(changes.version, changes.messages, changes.runs, changes.reset)

    def _apply(self, version: int, messages: Sequence[Message], runs: Sequence[Run], reset: bool = False) -> None:
        if reset:
            self._settled, self._keys, self._unsettled, self._by_id, self._runs = [], [], {}, {}, {}
            self.generation += 1
        # (fields read from the records' ``__dict__``: a pydantic attribute costs a hook call each time)
        for run in runs:
            fields = run.__dict__
            if fields["state"] in ACTIVE_RUN_STATES:
                self._runs[fields["id"]] = run
            else:
                self._runs.pop(fields["id"], None)
        for message in messages if len(messages) < 2 else sorted(messages, key=_arrival):
            fields = message.__dict__
            message_id = fields["id"]
            self._remove(message_id)
            if not fields["active"]:
                continue
            self._by_id[message_id] = message
            if fields["position"] is None:
                self._unsettled[message_id] = message
                continue
            key = message.sort_key
            if self._keys and key < self._keys[-1]:
                self.generation += 1
                index = bisect_left(self._keys, key)
                self._keys.insert(index, key)
                self._settled.insert(index, message)
            else:
                self._keys.append(key)
                self._settled.append(message)
        self.version = version

    def observe(self, write: Write | Purge) -> None:
        """Apply a write this process committed, without reading it back, when it is the very next version
        (anything else leaves the view as it is: ``refresh`` reads what it missed)."""
        if isinstance(write, Purge):
            if write.conversation_id == self.conversation_id:
                self._apply(0, (), (), reset=True)
            return
        m = write.mutation
        if m.head is None or m.head.conversation_id != self.conversation_id or m.head.version != self.version + 1:
            return
        self._apply(m.head.version, m.messages, m.runs)

    def _remove(self, message_id: str) -> None:
        old = self._by_id.pop(message_id, None)
        if old is None:
            return
        if old.position is None:
            self._unsettled.pop(message_id, None)
            return
        index = bisect_left(self._keys, old.sort_key)
        if index < len(self._keys) and self._settled[index].id == message_id:
            del self._keys[index], self._settled[index]
            self.generation += 1

    @property
    def settled(self) -> Sequence[Message]:
        return self._settled

    def message(self, message_id: str) -> Message | None:
        """The active message with this id, if the view holds it."""
        return self._by_id.get(message_id)

    @property
    def active_runs(self) -> list[Run]:
        runs = list(self._runs.values())
        if len(runs) > 1:
            runs.sort(key=lambda r: r.execution_order_key)
        return runs

    def tail(self, up_to_run_id: str | None = None) -> list[Message]:
        """Unsettled messages in execution order (inputs before the assistant inside a run), up to and
        including run ``up_to_run_id`` when given."""
        out: list[Message] = []
        for run in self.active_runs:
            run_id = run.id
            mine = [m for m in self._unsettled.values() if m.__dict__["run_id"] == run_id]
            if len(mine) > 1:
                mine.sort(key=lambda m: (m.__dict__["role"] == "assistant", m.__dict__["seq"]))
            out.extend(mine)
            if run_id == up_to_run_id:
                break
        return out

    def messages_of(self, run_ids: set[str]) -> list[Message]:
        return sorted((m for m in self._unsettled.values() if m.run_id in run_ids), key=lambda m: m.seq)

    def projector(self, options: AgentHistoryProjectionOptions) -> _Projector:
        """The projection of settled history, extended to the newest settled message. Fork it per request."""
        if (
            self._projector is None
            or self._projected_generation != self.generation
            or self._projected_options is not options
        ):
            self._projector = _Projector(options)
            self._projected = 0
            self._projected_generation = self.generation
            self._projected_options = options
        if self._projected < len(self._settled):
            self._projector.extend(self._settled[self._projected :])
            self._projected = len(self._settled)
        return self._projector


def _arrival(message: Message) -> tuple[int, ...]:
    # settled messages in causal order so appends stay appends; unsettled ones after
    return (0, *message.sort_key) if message.position is not None else (1, message.seq)
