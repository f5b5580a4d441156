"""Turns of a conversation, and ``select_agent_history``: the non-destructive context-window selector.

**What a turn is.** :func:`split_agent_history_turns` cuts a sequence of messages in causal order
(``ConversationSnapshot.messages``, or any list in that order) into units:

- ``lead``: one message of the ``lead`` band (seeded instructions before everything);
- ``system``: one ``system`` message; ``summary``: one ``summary`` message (a compaction result);
- ``turn``: the messages of one run, grouped by ``run_id`` — its user input(s) (one or more consecutive
  user messages: an input and the inputs coalesced into the same run), then its assistant, plus any
  ``tool`` message of that run (the input of a run queued by an approval response is its ``tool``
  message). Inputs a completed run absorbed from another run (its assistant carries
  an ``input-joined`` part naming that run) belong to the absorbing run's turn; that is where the store
  settles them, between the absorbing run's inputs and its assistant;
- a run with no user input — the run an approval response queued (its input is a ``tool`` message)
  — continues the ``turn`` or ``seed`` right before it and belongs to that unit: alone it would reach
  the model as an answer to nothing. A unit then holds several runs (``run_ids``) and each run's
  problem counts (``problems``);
- ``seed``: history no run owns (``seed_conversation_input(placement='after-settled')``, no ``run_id``):
  consecutive run-less user messages and the run-less assistant right after them. A seeded exchange is
  settled and nothing will ever answer it, so a seed unit is complete even without an assistant.

A ``turn`` or ``seed`` unit is *complete* when ``problem`` is None. Otherwise ``problem`` says why not:

- ``unsettled``: a message has no position yet (its run is still queued or running);
- ``out-of-order``: the run's messages are not contiguous, it has two assistants, or an input follows
  its assistant;
- ``unanswered-input``: a run's inputs with no assistant;
- ``crash-draft``: the assistant is still ``streaming``;
- ``superseded``: the assistant was superseded (its answer is never spoken);
- ``failed``: the assistant failed and the evidence policy omits failed assistants (the default);
  with ``AgentHistoryEvidencePolicy(failed_assistant='assistant-marked')`` a failed turn is complete;
- ``dangling-tool-call``: a tool call with no result in its step (also in an interrupted or failed
  assistant: a call whose result never arrived);
- ``invalid-tool-chronology``: a result that answers no call of its step (or names another tool than its
  call), or a repeated call id;
- ``unresolved-approval``: an approval request no settled ``tool`` message answers with an approval
  response. A response whose run has not settled yet does not count: that run still reads the signed
  request from history before it executes the call. Once it has settled (it recorded the call again,
  with its result or the denial), the requesting turn is complete: its suspended call is not dangling.

**Selecting for a context window.** :func:`select_agent_history` keeps the input in order and removes
only whole oldest complete turns until the counted history fits ``budget_tokens``. It never removes a
``lead``, ``system`` or ``summary`` message, an incomplete turn (``unsettled``, ``out-of-order``,
``unanswered-input``, ``crash-draft``, ``unresolved-approval``) or one of the ``keep_recent_turns`` most
recent complete turns. A turn whose only defect is its tool chronology is removable: it is settled and
answered, and the projection drops what cannot be paired. Superseded assistants — and failed ones when
the evidence policy omits them — never reach the model, so they are removed (reason ``superseded`` /
``failed``) and never counted; the inputs they would have answered join the next turn (the answer the
model actually gave them) and share its fate, or stay ``incomplete`` when no turn follows.

Every message gets one :class:`AgentHistorySelectionDecision` with its reason and its token count and
provenance: ``measured`` with ``count_tokens``, ``estimated`` with :func:`estimate_message_tokens`,
``unavailable`` when neither can count it. Unavailable counts (or an unknown ``budget_tokens``) make the
decision ``unavailable``: nothing is removed for the budget and no arithmetic is invented. A protected
remainder that cannot fit is ``oversized`` (every removable turn is removed by then).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

from ..errors import AgentRuntimeUsageError
from ..records import Message
from .projection import AgentHistoryEvidencePolicy
from .prompt import TokenProvenance, estimate_tokens

__all__ = (
    "AgentHistorySelection",
    "AgentHistorySelectionDecision",
    "AgentHistoryTurn",
    "estimate_message_tokens",
    "select_agent_history",
    "split_agent_history_turns",
)

TurnKind = Literal["lead", "system", "summary", "turn", "seed"]
TurnProblem = Literal[
    "unsettled",
    "out-of-order",
    "unanswered-input",
    "crash-draft",
    "superseded",
    "failed",
    "dangling-tool-call",
    "invalid-tool-chronology",
    "unresolved-approval",
]
SelectionReason = Literal[
    "lead",
    "system",
    "summary",
    "incomplete",
    "recent",
    "within-budget",
    "unavailable",
    "budget",
    "superseded",
    "failed",
]
SelectionDecision = Literal["fits", "trimmed", "oversized", "unavailable"]

_PROTECTING_PROBLEMS = frozenset(
    {"unsettled", "out-of-order", "unanswered-input", "crash-draft", "unresolved-approval"}
)


@dataclass(frozen=True)
class AgentHistoryTurn:
    """One unit of history (see the module docstring). ``indices`` are positions in the input."""

    kind: TurnKind
    messages: tuple[Message, ...]
    indices: tuple[int, ...]
    run_id: str | None = None
    """The run the unit belongs to (the absorbing run for absorbed inputs); None for other kinds."""
    problem: TurnProblem | None = None
    """Why a ``turn``/``seed`` is not complete (the first reason); always None for ``lead``, ``system``
    and ``summary``."""
    problems: tuple[TurnProblem, ...] = ()
    """Every reason, one per run of the unit that has one."""
    run_ids: tuple[str, ...] = ()
    """The runs of the unit: its own, then any continuation runs."""

    @property
    def is_turn(self) -> bool:
        return self.kind in ("turn", "seed")

    @property
    def complete(self) -> bool:
        return self.is_turn and self.problem is None


@dataclass
class _Builder:
    kind: TurnKind
    run_id: str | None = None
    items: list[tuple[int, Message]] = field(default_factory=list)
    interleaved: bool = False

    @property
    def has_assistant(self) -> bool:
        return any(m.role == "assistant" for _, m in self.items)


def _tool_chronology(assistant: Message) -> TurnProblem | None:
    """Mirror of the projection's step pairing: a call is answered in its own step, once. A call that
    asked for approval (and has no result here) is suspended, not dangling: the run that carries the
    approval response records it again with its result."""
    pending: dict[str, str] = {}
    seen: set[str] = set()
    closed = False
    answered = {p.call_id for p in assistant.parts if p.type == "tool-result"}
    suspended = {p.call_id for p in assistant.parts if p.type == "approval-request"} - answered
    for part in assistant.parts:
        if part.type == "tool-call" and part.call_id in suspended:
            continue
        if part.type in ("text", "reasoning", "tool-call") and closed:
            if pending:
                return "dangling-tool-call"
            closed = False
        if part.type == "tool-call":
            if part.call_id in seen:
                return "invalid-tool-chronology"
            seen.add(part.call_id)
            pending[part.call_id] = part.tool_name
        elif part.type == "tool-result":
            closed = True
            if pending.get(part.call_id) != part.tool_name:  # no call of its step, or another tool's call
                return "invalid-tool-chronology"
            del pending[part.call_id]
        elif part.type == "input-joined" and assistant.status == "completed":
            closed = True
    return "dangling-tool-call" if pending else None


def _problem(b: _Builder, policy: AgentHistoryEvidencePolicy, resolved: set[str]) -> TurnProblem | None:
    messages = [m for _, m in b.items]
    if any(m.position is None for m in messages):
        return "unsettled"
    if b.interleaved:
        return "out-of-order"
    assistants = [m for m in messages if m.role == "assistant"]
    if len(assistants) > 1:
        return "out-of-order"
    if not assistants:
        return None if b.kind == "seed" else "unanswered-input"
    answer = assistants[0]
    if any(m.role == "user" for m in messages[messages.index(answer) + 1 :]):
        return "out-of-order"
    if answer.status == "streaming":
        return "crash-draft"
    if answer.status == "superseded":
        return "superseded"
    if answer.status == "failed" and policy.failed_assistant == "omit":
        return "failed"
    for m in messages:  # before chronology: a call waiting for approval has no result yet
        for part in m.parts:
            if part.type == "approval-request" and part.approval_id not in resolved:
                return "unresolved-approval"
    return _tool_chronology(answer)


def split_agent_history_turns(
    messages: Sequence[Message], *, evidence_policy: AgentHistoryEvidencePolicy | None = None
) -> list[AgentHistoryTurn]:
    """Cut ``messages`` (causal order) into units, each with its problem; see the module docstring.

    Every input message is in exactly one unit, and the units concatenated are the input in order.
    """
    policy = evidence_policy or AgentHistoryEvidencePolicy()
    alias: dict[str, str] = {}
    resolved: set[str] = set()
    for m in messages:
        for part in m.parts:
            if part.type == "approval-response" and m.role == "tool" and m.position is not None:
                resolved.add(part.approval_id)
            elif (
                part.type == "input-joined"
                and m.role == "assistant"
                and m.status == "completed"
                and m.run_id is not None
                and part.run_id != m.run_id
            ):
                alias.setdefault(part.run_id, m.run_id)

    builders: list[_Builder] = []
    by_run: dict[str, _Builder] = {}
    current: _Builder | None = None
    for i, m in enumerate(messages):
        if m.band == "lead" or m.role in ("system", "summary"):
            kind: TurnKind = "lead" if m.band == "lead" else m.role  # type: ignore[assignment]
            builders.append(_Builder(kind, items=[(i, m)]))
            current = None
        elif m.run_id is not None:
            key = alias.get(m.run_id, m.run_id)
            if current is None or current.kind != "turn" or current.run_id != key:
                current = _Builder("turn", key)
                earlier = by_run.get(key)
                if earlier is not None:  # the run's messages are not contiguous
                    earlier.interleaved = current.interleaved = True
                by_run[key] = current
                builders.append(current)
            current.items.append((i, m))
        else:  # history no run owns: a seed
            joins = current is not None and (
                (m.role == "tool" and current.kind in ("turn", "seed"))
                or (current.kind == "seed" and not current.has_assistant)
            )
            if current is None or not joins:
                current = _Builder("seed")
                builders.append(current)
            current.items.append((i, m))

    # a run with no user input (the run an approval response queued, whose input is a ``tool`` message)
    # continues the turn before it: alone it would reach the model as an answer to nothing
    groups: list[list[_Builder]] = []
    for builder in builders:
        continues = builder.kind == "turn" and not any(m.role == "user" for _, m in builder.items)
        if continues and groups and groups[-1][0].kind in ("turn", "seed"):
            groups[-1].append(builder)
        else:
            groups.append([builder])

    turns = []
    for group in groups:
        first = group[0]
        problems: tuple[TurnProblem, ...] = ()
        if first.kind in ("turn", "seed"):
            problems = tuple(p for p in (_problem(b, policy, resolved) for b in group) if p is not None)
        turns.append(
            AgentHistoryTurn(
                kind=first.kind,
                messages=tuple(m for b in group for _, m in b.items),
                indices=tuple(i for b in group for i, _ in b.items),
                run_id=first.run_id,
                problem=problems[0] if problems else None,
                problems=problems,
                run_ids=tuple(b.run_id for b in group if b.run_id is not None),
            )
        )
    return turns


# ------------------------------------------------------------------------------------------ counting


def estimate_message_tokens(message: Message) -> int:
    """:func:`~threadline.history.prompt.estimate_tokens` over what a message can send: text, reasoning
    text, tool calls (name and arguments), tool results (name and output), file placeholders and approval
    requests. An estimate (provenance ``estimated``), never a measurement."""
    pieces: list[str] = []
    for part in message.parts:
        if part.type in ("text", "reasoning"):
            pieces.append(part.text)
        elif part.type in ("tool-call", "approval-request"):
            pieces.append(f"{part.tool_name} {json.dumps(part.input, default=str)}")
        elif part.type == "tool-result":
            pieces.append(f"{part.tool_name} {json.dumps(part.output, default=str)}")
        elif part.type == "file":
            pieces.append(f"[attachment: {part.filename or part.media_type}]")
        elif part.type == "approval-response" and part.reason:
            pieces.append(part.reason)
    return estimate_tokens("\n".join(pieces))


MessageCounter = Callable[[Message], "int | None"]


@dataclass(frozen=True)
class AgentHistorySelectionDecision:
    """What :func:`select_agent_history` did with one message, and why."""

    message_id: str
    action: Literal["kept", "removed"]
    reason: SelectionReason
    tokens: int | None
    """Its count; None when not counted (superseded/failed-omitted) or when it could not be counted."""
    provenance: TokenProvenance | None
    """None for messages that are never counted (superseded, failed under the ``omit`` policy)."""
    unit: int | None
    """Index of the selection unit (a turn with the inputs it carries, or one protected message); None
    for a message that is never counted."""


@dataclass(frozen=True)
class AgentHistorySelection:
    """The selected history and the arithmetic behind it.

    When counts are available: ``total_tokens`` counts every counted message, ``kept_tokens +
    removed_tokens == total_tokens``, ``protected_tokens <= kept_tokens``, and ``total_tokens -
    protected_tokens`` is what removal could ever free (``removable_history_tokens`` for
    :func:`~threadline.history.prompt.decide_prompt_budget`). ``fits``: nothing removed for the budget;
    ``trimmed``: oldest turns removed and ``kept_tokens <= budget_tokens``; ``oversized``: every
    removable turn removed and ``kept_tokens > budget_tokens``. ``unavailable``: the token fields that
    would need a missing number are None and nothing is removed for the budget.
    """

    decision: SelectionDecision
    messages: tuple[Message, ...]
    """The kept messages, in input order."""
    decisions: tuple[AgentHistorySelectionDecision, ...]
    """One per input message, in input order."""
    budget_tokens: int | None
    provenance: TokenProvenance
    total_tokens: int | None
    kept_tokens: int | None
    removed_tokens: int | None
    protected_tokens: int | None
    removed_turns: int = 0

    @property
    def removable_tokens(self) -> int | None:
        if self.total_tokens is None or self.protected_tokens is None:
            return None
        return self.total_tokens - self.protected_tokens


@dataclass
class _Unit:
    items: list[tuple[int, Message]]
    protect: SelectionReason | None
    answered: bool = False


def select_agent_history(
    messages: Sequence[Message],
    *,
    budget_tokens: int | None,
    keep_recent_turns: int = 1,
    count_tokens: MessageCounter | None = None,
    estimate: bool = True,
    evidence_policy: AgentHistoryEvidencePolicy | None = None,
) -> AgentHistorySelection:
    """Remove whole oldest complete turns until ``messages`` fit ``budget_tokens`` (see the module
    docstring for what is protected and why).

    ``budget_tokens`` is what the request leaves for history (``AgentPromptBudget.available_history_tokens``;
    it may be negative). ``count_tokens(message)`` measures a message for the selected model (``None`` from
    it: unavailable); without it counts are estimated unless ``estimate=False``. ``evidence_policy`` is
    the one the projection uses, so failed assistants are counted exactly when they are sent.
    """
    if isinstance(keep_recent_turns, bool) or not isinstance(keep_recent_turns, int) or keep_recent_turns < 0:
        raise AgentRuntimeUsageError(f"keep_recent_turns is a non-negative integer, got {keep_recent_turns!r}")
    if budget_tokens is not None and (isinstance(budget_tokens, bool) or not isinstance(budget_tokens, int)):
        raise AgentRuntimeUsageError(f"budget_tokens is an integer or None, got {budget_tokens!r}")
    policy = evidence_policy or AgentHistoryEvidencePolicy()
    turns = split_agent_history_turns(messages, evidence_policy=policy)

    uncounted: dict[int, SelectionReason] = {}
    units: list[_Unit] = []
    carry: list[tuple[int, Message]] = []

    def flush_carry() -> None:
        if carry:
            units.append(_Unit(list(carry), "incomplete"))
            carry.clear()

    for turn in turns:
        if not turn.is_turn:
            flush_carry()
            reason: SelectionReason = "system" if turn.messages[0].role == "system" else turn.kind  # type: ignore[assignment]
            units.append(_Unit(list(zip(turn.indices, turn.messages, strict=True)), reason))
            continue
        rest: list[tuple[int, Message]] = []
        for i, m in zip(turn.indices, turn.messages, strict=True):
            if m.role == "assistant" and m.status == "superseded":
                uncounted[i] = "superseded"
            elif m.role == "assistant" and m.status == "failed" and policy.failed_assistant == "omit":
                uncounted[i] = "failed"
            else:
                rest.append((i, m))
        if not any(m.role == "assistant" for _, m in rest) and {"superseded", "failed"} & set(turn.problems):
            carry.extend(rest)  # answered by whichever turn follows
            continue
        protecting = _PROTECTING_PROBLEMS & set(turn.problems)
        protect: SelectionReason | None = "incomplete" if protecting else None
        units.append(_Unit([*carry, *rest], protect, answered=protect is None))
        carry.clear()
    flush_carry()

    if keep_recent_turns:
        answered = [u for u in units if u.answered]
        for u in answered[-keep_recent_turns:]:
            u.protect = "recent"

    # ---- counting
    mode: TokenProvenance = "measured" if count_tokens is not None else "estimated"
    counts: dict[int, int | None] = {}
    for u in units:
        for i, m in u.items:
            if count_tokens is not None:
                value = count_tokens(m)
                if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
                    raise AgentRuntimeUsageError(f"count_tokens returned {value!r} for {m.id!r}; use an int >= 0")
                counts[i] = value
            else:
                counts[i] = estimate_message_tokens(m) if estimate else None
    known = (count_tokens is not None or estimate) and all(v is not None for v in counts.values())
    provenance: TokenProvenance = mode if known else "unavailable"

    unit_of: dict[int, int] = {i: n for n, u in enumerate(units) for i, _ in u.items}
    removed_units: set[int] = set()
    unit_tokens: list[int] = []
    total: int | None = None
    kept: int | None = None
    removed: int | None = None
    protected: int | None = None
    if known:
        unit_tokens = [sum(counts[i] or 0 for i, _ in u.items) for u in units]
        total = kept = sum(unit_tokens)
        protected = sum(t for u, t in zip(units, unit_tokens, strict=True) if u.protect is not None)
        removed = 0
    if kept is None or budget_tokens is None:
        decision: SelectionDecision = "unavailable"
    else:
        for n, u in enumerate(units):
            if kept <= budget_tokens:
                break
            if u.protect is None:
                removed_units.add(n)
                kept -= unit_tokens[n]
        if not removed_units and kept <= budget_tokens:
            decision = "fits"
        else:
            decision = "trimmed" if kept <= budget_tokens else "oversized"
        removed = sum(unit_tokens[n] for n in removed_units)

    decisions: list[AgentHistorySelectionDecision] = []
    kept_messages: list[Message] = []
    for i, m in enumerate(messages):
        if i in uncounted:
            decisions.append(AgentHistorySelectionDecision(m.id, "removed", uncounted[i], None, None, None))
            continue
        n = unit_of[i]
        unit = units[n]
        if n in removed_units:
            action, why = "removed", "budget"
        else:
            action = "kept"
            why = unit.protect or ("within-budget" if decision != "unavailable" else "unavailable")
            kept_messages.append(m)
        counted: TokenProvenance = mode if counts[i] is not None else "unavailable"
        decisions.append(AgentHistorySelectionDecision(m.id, action, why, counts[i], counted, n))  # type: ignore[arg-type]
    return AgentHistorySelection(
        decision=decision,
        messages=tuple(kept_messages),
        decisions=tuple(decisions),
        budget_tokens=budget_tokens,
        provenance=provenance,
        total_tokens=total,
        kept_tokens=kept,
        removed_tokens=removed,
        protected_tokens=protected,
        removed_turns=len(removed_units),
    )
