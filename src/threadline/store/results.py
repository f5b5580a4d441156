"""What store operations return. Each result carries the conversation ``version`` it was read or written at."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict

from ..records import AdmissionReceipt, ConversationHead, Message, Run


class _Result(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", defer_build=True)


class AcceptResult(_Result):
    """``accepted``: the input, its receipt and its run were committed together. ``duplicate``: the key was
    seen before and nothing was written; ``receipt`` is the original. ``coalesced`` says the input was
    appended to an existing queued run. ``answer`` is the answering assistant once the run is terminal
    (for an absorbed run, the absorbing run's answer, and ``answered_by_run_id`` names that run)."""

    outcome: Literal["accepted", "duplicate"]
    receipt: AdmissionReceipt
    run: Run
    version: int
    coalesced: bool = False
    answer: Message | None = None
    answered_by_run_id: str | None = None


class RunResult(_Result):
    """A run after an owned mutation (acquire, checkpoint, operation record) and the version written."""

    run: Run
    version: int
    assistant: Message | None = None


class InterruptResult(_Result):
    """``requested``: the run is now ``interrupt_requested``. ``already_requested``: it already was.
    ``queued``: the run has not started; nothing was written. ``terminal``: it already ended."""

    outcome: Literal["requested", "already_requested", "queued", "terminal"]
    run: Run
    version: int


class TerminalResult(_Result):
    """``committed``: this call applied the terminal CAS (only its caller publishes the terminal event).
    ``already_terminal``: another execution won; ``run`` and ``assistant`` are the canonical winner."""

    outcome: Literal["committed", "already_terminal"]
    run: Run
    assistant: Message | None
    version: int
    absorbed_runs: tuple[Run, ...] = ()
    absorption_cancelled: tuple[str, ...] = ()


class RecoverResult(_Result):
    outcome: Literal["requeued", "abandoned"]
    run: Run
    assistant: Message | None
    version: int


class CompactionResult(_Result):
    """``applied`` with the summary written, or ``conflict`` with the version the store actually holds."""

    outcome: Literal["applied", "conflict"]
    version: int
    summary: Message | None = None
    replaced_message_ids: tuple[str, ...] = ()


class SeedResult(_Result):
    outcome: Literal["seeded", "duplicate"]
    version: int
    message_ids: tuple[str, ...]


class PurgeResult(_Result):
    outcome: Literal["purged", "already_purged", "active", "conflict", "unsupported"]
    run_ids: tuple[str, ...] = ()
    actual_version: int | None = None


class LoadedRun(_Result):
    """A run, the version it was read at, and its answer once terminal (absorbed: the absorbing answer)."""

    run: Run
    version: int
    assistant: Message | None = None


class ActiveRuns(_Result):
    conversation_id: str
    version: int
    runs: tuple[Run, ...]


class RecoverablePage(_Result):
    """One bounded page of active runs. ``next_cursor`` is None on the last page. Page order is not
    execution order: use :func:`threadline.store.reducer.order_recoverable`."""

    runs: tuple[Run, ...]
    next_cursor: str | None


class MessagePage(_Result):
    """Messages in the order they happened; ``compacted`` names those the model no longer sees."""

    items: tuple[Message, ...]
    compacted: tuple[str, ...] = ()
    next_cursor: str | None = None


class ConversationPage(_Result):
    items: tuple[ConversationHead, ...]
    next_cursor: str | None = None


class ConversationChanges(_Result):
    """What changed in a conversation after ``since_version``: the messages (inactive ones included, so a
    reader can drop what compaction replaced) and runs written since. ``reset`` means the reader must
    start over (the conversation is unknown, purged, or ``since_version`` is ahead of the store)."""

    conversation_id: str
    version: int
    messages: tuple[Message, ...] = ()
    runs: tuple[Run, ...] = ()
    reset: bool = False
