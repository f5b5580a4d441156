"""Compaction: fold the oldest whole turns of a conversation into one ``summary`` message.

:func:`select_compactable_history` is the selection alone — no store, no version, no runtime — for an
application that keeps its own history. :func:`structured_compaction` uses the same function and adds
the part that needs the store: writing the summary back under the snapshot's version.

The units (``turn``, ``seed``, ``summary``, ``lead``, ``system``) and what makes a turn incomplete are
defined in :mod:`threadline.history.selection`. Here an incomplete turn is a **barrier**: nothing at or
after it is compactable, because half a turn hands the provider a call with no result, an approval
with no answer, or an input with no reply; a failed turn is a barrier unless the evidence policy opts
failed assistants in (``AgentHistoryEvidencePolicy(failed_assistant='assistant-marked')``) — then the
summariser must say the turn failed.

A superseded turn is never summarised and never counted, but it is no barrier: its answer was never
spoken, so it is neither handed to the summariser nor replaced (the record is kept, excluded from the
projection), and the input it would have answered goes with the turn that did answer it. The replaced
range is then contiguous in active settled history but for those superseded records, which stay where
they are, before the summary.

The summary replaces, it never stacks: a leading summary (the first history message after the ``lead``
band) is handed to ``summarize`` as the previous summary and is part of the replaced range. Stored
statuses never change; replaced messages stay readable with
``conversations.messages(..., include_compacted=True)``.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from ..errors import AgentRuntimeUsageError
from ..records import Message
from ..store.aggregate import new_id
from .projection import AgentHistoryEvidencePolicy
from .selection import AgentHistoryTurn, split_agent_history_turns

__all__ = (
    "AgentCompactableHistory",
    "AgentCompactionBarrier",
    "AgentCompactionHook",
    "AgentCompactionOutcome",
    "select_compactable_history",
    "structured_compaction",
    "summary_text",
)

Summarize = Callable[[list[Message], "str | None"], "str | Awaitable[str]"]
"""``summarize(eligible_messages, previous_summary) -> text``: the raw compactable messages (not provider
messages: project them with the same evidence policy before sending them to a model) and the previous
summary's text (or None)."""
ReadPreviousSummary = Callable[[Message], "str | Awaitable[str | None] | None"]


@dataclass(frozen=True)
class AgentCompactionBarrier:
    """The incomplete unit that stopped the compactable prefix: its first message and why."""

    message_id: str
    reason: str


@dataclass(frozen=True)
class AgentCompactableHistory:
    """``leading_summary`` + ``compactable`` + ``superseded`` + ``retained`` is a partition of the input,
    each in input order. ``compactable`` directly follows ``leading_summary`` (or the lead band) and is
    contiguous but for ``superseded``: the superseded answers that sit among it, which are never
    summarised and never replaced. ``retained`` is everything else: its first ``prefix`` messages (the
    ``lead`` band, and superseded answers an earlier compaction left) come before them, so ``ordered()``
    is the input again."""

    leading_summary: Message | None
    compactable: tuple[Message, ...]
    retained: tuple[Message, ...]
    barrier: AgentCompactionBarrier | None = None
    """Set when an incomplete turn, not ``keep_recent_turns``, ended the compactable prefix."""
    turns: int = 0
    """How many answered turns (``turn`` and ``seed`` units) ``compactable`` holds."""
    prefix: int = 0
    """How many ``retained`` messages (the ``lead`` band, ``system``, superseded answers an earlier
    compaction left) come before the leading summary."""
    superseded: tuple[Message, ...] = ()
    """Superseded answers inside the compacted span. Each record is kept as it is (active, excluded from
    the projection): never handed to the summariser, never in ``replaced_message_ids``. The input it
    would have answered is compacted with the turn that did answer it."""

    @property
    def replaced_message_ids(self) -> tuple[str, ...]:
        """What a summary replaces: the leading summary (if any) and every compactable message."""
        lead = (self.leading_summary.id,) if self.leading_summary is not None else ()
        return (*lead, *(m.id for m in self.compactable))

    def with_summary(self, summary: Message) -> list[Message]:
        """The history after replacement, as the store orders it: the retained prefix, the superseded
        answers of the span, ``summary`` (at the place of the last message it replaced), the rest."""
        return [*self.retained[: self.prefix], *self.superseded, summary, *self.retained[self.prefix :]]

    def ordered(self) -> list[Message]:
        """The input again: ``retained[:prefix]``, the leading summary, the span, the rest."""
        lead = [self.leading_summary] if self.leading_summary is not None else []
        span = self.compactable
        if self.superseded:  # every message of the span is settled: its causal order is its sort key
            span = tuple(sorted((*self.compactable, *self.superseded), key=lambda m: m.sort_key))
        return [*self.retained[: self.prefix], *lead, *span, *self.retained[self.prefix :]]


def _check_keep(keep_recent_turns: int) -> None:
    if isinstance(keep_recent_turns, bool) or not isinstance(keep_recent_turns, int) or keep_recent_turns < 0:
        raise AgentRuntimeUsageError(f"keep_recent_turns is a non-negative integer, got {keep_recent_turns!r}")


def _passable(unit: AgentHistoryTurn) -> bool:
    """A turn whose only defect is a superseded answer: never summarised, but not a barrier either."""
    return unit.is_turn and bool(unit.problems) and all(p == "superseded" for p in unit.problems)


def _spoken(message: Message) -> bool:
    return not (message.role == "assistant" and message.status == "superseded")


def _answered(unit: AgentHistoryTurn) -> bool:
    """A complete turn, or a passable one that still holds an answer that was spoken."""
    if unit.complete:
        return True
    return _passable(unit) and any(m.role == "assistant" and _spoken(m) for m in unit.messages)


def _leftover(unit: AgentHistoryTurn) -> bool:
    """Superseded answers alone: what an earlier compaction left of a superseded turn."""
    return _passable(unit) and not any(_spoken(m) for m in unit.messages)


def _answered_by_then(units: Sequence[AgentHistoryTurn], start: int, end: int) -> int:
    """``end``, or earlier: the input of a superseded turn is compacted only with a later turn that
    answered it, so the range stops before one that no answered turn in it follows."""
    waiting: int | None = None
    for n in range(start, end):
        if _answered(units[n]):
            waiting = None
        elif _passable(units[n]) and waiting is None:
            waiting = n
    return end if waiting is None else waiting


def select_compactable_history(
    messages: Sequence[Message],
    keep_recent_turns: int,
    *,
    evidence_policy: AgentHistoryEvidencePolicy | None = None,
) -> AgentCompactableHistory:
    """Select the oldest whole complete turns after the leading summary, keeping the
    ``keep_recent_turns`` most recent complete turns.

    Scanning from the start: the ``lead`` band and ``system`` messages stay; a ``summary`` right after
    them is the ``leading_summary``; then complete turns (and any further summaries) are compactable up
    to the first barrier — an incomplete turn (see :mod:`threadline.history.selection`), or a ``lead`` /
    ``system`` message out of place — and never into the ``keep_recent_turns`` most recent complete
    turns (counted over the whole history). With fewer complete turns than that, nothing is compactable.

    A superseded turn is neither a barrier nor counted: the scan goes past it. Its answer stays where it
    is (``superseded``) and its input goes with the turn after it, which answered it — so a superseded
    turn at the end of the range stays, with its input, until the turn after it is compactable too.
    """
    _check_keep(keep_recent_turns)
    units = split_agent_history_turns(messages, evidence_policy=evidence_policy)
    start = 0
    while start < len(units) and (units[start].kind in ("lead", "system") or _leftover(units[start])):
        start += 1
    leading: AgentHistoryTurn | None = None
    if start < len(units) and units[start].kind == "summary":
        leading = units[start]
        start += 1

    stop = start
    barrier: AgentCompactionBarrier | None = None
    while stop < len(units):
        unit = units[stop]
        if unit.kind in ("lead", "system"):
            barrier = AgentCompactionBarrier(unit.messages[0].id, f"{unit.kind}-out-of-place")
            break
        if unit.is_turn and unit.problem is not None and not _passable(unit):
            barrier = AgentCompactionBarrier(unit.messages[0].id, unit.problem)
            break
        stop += 1

    answered = [n for n, u in enumerate(units) if _answered(u)]
    if keep_recent_turns == 0:
        cutoff = len(units)
    elif len(answered) >= keep_recent_turns:
        cutoff = answered[-keep_recent_turns]
    else:
        cutoff = 0
    if barrier is not None and cutoff <= stop:
        barrier = None  # the recent turns ended the prefix first
    end = _answered_by_then(units, start, max(start, min(stop, cutoff)))

    chosen = units[start:end]
    span = [m for u in chosen for m in u.messages]
    before = [m for u in units[: start - (1 if leading is not None else 0)] for m in u.messages]
    after = [m for u in units[end:] for m in u.messages]
    return AgentCompactableHistory(
        leading_summary=leading.messages[0] if leading is not None else None,
        compactable=tuple(m for m in span if _spoken(m)),
        retained=(*before, *after),
        barrier=barrier,
        turns=sum(1 for u in chosen if _answered(u)),
        prefix=len(before),
        superseded=tuple(m for m in span if not _spoken(m)),
    )


def summary_text(message: Message) -> str:
    """The text of a summary (its text parts joined by newlines): the default previous summary."""
    return "\n".join(p.text for p in message.parts if p.type == "text" and p.text)


@dataclass(frozen=True)
class AgentCompactionOutcome:
    """What :func:`structured_compaction` did.

    - ``applied``: ``summary`` (id ``summary_id``) replaced ``replaced_message_ids`` at ``version``;
    - ``not_needed``: nothing is compactable (too few turns beyond ``keep_recent_turns``);
    - ``barrier``: nothing is compactable because an incomplete turn (``barrier``) comes first;
    - ``conflict``: every one of ``attempts`` lost to a concurrent write (such as a new input); nothing was
      written, the stale summary is not applied. With the default ``max_attempts=1`` the first conflict
      is the outcome; a larger ``max_attempts`` recovers from conflicts, a bounded number of times.

    ``summarize_calls`` counts the summaries computed (one per attempt that reached the store).
    """

    outcome: Literal["applied", "not_needed", "barrier", "conflict"]
    attempts: int
    summarize_calls: int
    version: int
    """The conversation version after the write, or the last one seen."""
    summary_id: str | None = None
    summary: Message | None = None
    replaced_message_ids: tuple[str, ...] = ()
    barrier: AgentCompactionBarrier | None = None


async def _maybe_await(value: Any) -> Any:
    if inspect.isawaitable(value):
        return await value
    return value


async def structured_compaction(
    store: Any,
    conversation_id: str,
    *,
    summarize: Summarize,
    keep_recent_turns: int,
    previous_summary: str | None = None,
    read_previous_summary: ReadPreviousSummary | None = None,
    evidence_policy: AgentHistoryEvidencePolicy | None = None,
    max_attempts: int = 1,
) -> AgentCompactionOutcome:
    """Summarise the compactable prefix of a stored conversation and replace it with one summary.

    Each attempt loads the snapshot, selects with :func:`select_compactable_history`, calls
    ``summarize(eligible_messages, previous_summary)`` outside any store transaction (it may be a slow
    model call), then ``store.replace_compacted_range`` at the snapshot's exact version with the leading
    summary (if any) and the compactable messages as the replaced range (superseded answers among them
    are neither summarised nor replaced). A conflict (anything was written to the conversation
    meanwhile, such as a new input) is the outcome ``conflict`` and writes nothing: the stale summary is
    never applied. Set ``max_attempts`` above 1 (the default) for bounded conflict recovery: each further
    attempt reloads, reselects and re-summarises; a stale summary is never retried.

    The previous summary: ``previous_summary`` when given (a direct call that holds it; used only while
    the leading summary is the one the first attempt saw), else ``read_previous_summary(leading)`` (for
    structured summaries the application parses), else the leading summary's text.

    Cancellation: cancelling while ``summarize`` runs writes nothing. Once the replace call is handed to
    the store it commits or rolls back as a whole; read back to tell which. Safe to run concurrently with
    admissions and runs of the same conversation (the version check decides); two compactions of one
    conversation race harmlessly — one of them conflicts.
    """
    _check_keep(keep_recent_turns)
    if previous_summary is not None and read_previous_summary is not None:
        raise AgentRuntimeUsageError("pass previous_summary or read_previous_summary, not both")
    if isinstance(max_attempts, bool) or not isinstance(max_attempts, int) or max_attempts < 1:
        raise AgentRuntimeUsageError(f"max_attempts is a positive integer, got {max_attempts!r}")
    if not callable(summarize):
        raise AgentRuntimeUsageError("summarize is a callable (eligible_messages, previous_summary) -> text")

    first_leading: str | bool | None = False  # False: not seen yet
    calls = 0
    version = 0
    for attempt in range(1, max_attempts + 1):
        snapshot = await store.load_snapshot(conversation_id=conversation_id)
        version = snapshot.version
        selection = select_compactable_history(snapshot.messages, keep_recent_turns, evidence_policy=evidence_policy)
        if not selection.compactable:
            outcome = "barrier" if selection.barrier is not None else "not_needed"
            return AgentCompactionOutcome(outcome, attempt, calls, version, barrier=selection.barrier)  # type: ignore[arg-type]
        leading = selection.leading_summary
        leading_id = leading.id if leading is not None else None
        if first_leading is False:
            first_leading = leading_id
        if previous_summary is not None and leading_id == first_leading:
            previous: str | None = previous_summary
        elif leading is None:
            previous = None
        elif read_previous_summary is not None:
            previous = await _maybe_await(read_previous_summary(leading))
        else:
            previous = summary_text(leading) or None
        text = await _maybe_await(summarize(list(selection.compactable), previous))
        calls += 1
        if not isinstance(text, str) or not text:
            raise AgentRuntimeUsageError(f"summarize returns the summary as non-empty text, got {text!r}")
        summary_id = new_id("summary")
        result = await store.replace_compacted_range(
            conversation_id=conversation_id,
            expected_version=snapshot.version,
            replaced_message_ids=selection.replaced_message_ids,
            summary={"id": summary_id, "role": "summary", "parts": [{"type": "text", "text": text}]},
        )
        version = result.version
        if result.outcome == "applied":
            return AgentCompactionOutcome(
                "applied",
                attempt,
                calls,
                version,
                summary_id=summary_id,
                summary=result.summary,
                replaced_message_ids=tuple(result.replaced_message_ids),
                barrier=selection.barrier,
            )
    return AgentCompactionOutcome("conflict", max_attempts, calls, version)


@dataclass(frozen=True)
class AgentCompactionHook:
    """Runtime-managed compaction before a step, when the application decides so from context usage.

    Configure it as ``create_agent_runtime(..., history={"compaction": AgentCompactionHook(...)})``: the
    loop calls it before every step with an ``AgentCompactionRequest`` and records the call as a
    ``compaction`` run operation.

    ``should_compact(context_usage)`` (sync or async) gets the step's ``AgentContextUsage`` (the last
    step's prompt size beside the model's window; ``input_tokens`` None before the first step) and
    returns whether to compact now — the threshold is the application's. The rest are the arguments of
    :func:`structured_compaction`.
    """

    should_compact: Callable[[Any], bool | Awaitable[bool]]
    summarize: Summarize
    keep_recent_turns: int
    read_previous_summary: ReadPreviousSummary | None = None
    evidence_policy: AgentHistoryEvidencePolicy | None = None
    max_attempts: int = 1

    def __post_init__(self) -> None:
        if not callable(self.should_compact) or not callable(self.summarize):
            raise AgentRuntimeUsageError("compaction needs callable should_compact and summarize")
        _check_keep(self.keep_recent_turns)

    @classmethod
    def parse(cls, value: AgentCompactionHook | Mapping[str, Any]) -> AgentCompactionHook:
        """Accept a hook or a mapping of its fields (for ``history={"compaction": {...}}``)."""
        if isinstance(value, cls):
            return value
        if not isinstance(value, Mapping):
            raise AgentRuntimeUsageError("compaction is an AgentCompactionHook or a mapping of its fields")
        unknown = set(value) - set(cls.__dataclass_fields__)
        if unknown:
            raise AgentRuntimeUsageError(f"compaction has unknown keys {sorted(unknown)}")
        try:
            return cls(**value)
        except TypeError as error:
            raise AgentRuntimeUsageError(f"compaction: {error}") from error

    async def __call__(self, request: Any) -> AgentCompactionOutcome | None:
        """The runtime's ``history={"compaction": hook}`` callback: ``request`` is the loop's
        ``AgentCompactionRequest`` (``store``, ``conversation_id``, ``context_usage``)."""
        return await self.before_step(request.store, request.conversation_id, request.context_usage)

    async def before_step(self, store: Any, conversation_id: str, context_usage: Any) -> AgentCompactionOutcome | None:
        """Compact when ``should_compact(context_usage)`` says so; None when it does not.

        Call it before loading the step's history. An ``applied`` outcome changed settled history: a
        view that follows this store object's writes picks it up; otherwise refresh before projecting.
        """
        if not await _maybe_await(self.should_compact(context_usage)):
            return None
        return await structured_compaction(
            store,
            conversation_id,
            summarize=self.summarize,
            keep_recent_turns=self.keep_recent_turns,
            read_previous_summary=self.read_previous_summary,
            evidence_policy=self.evidence_policy,
            max_attempts=self.max_attempts,
        )
