"""Turns, ``select_agent_history`` and ``select_compactable_history`` (pure, on handmade records).

Pins: the turn definition (runs grouped by ``run_id``, coalesced and absorbed inputs, seeds, lead,
summaries, interleaving); every barrier reason; the budget selector's protections, reasons, token
provenance (measured / estimated / unavailable) and arithmetic, ``oversized`` and ``unavailable``;
superseded assistants removed and never counted; the compactable prefix with ``keep_recent_turns`` and
both evidence policies. Two hypothesis properties over random canonical histories (users, assistants of
every status, tool calls with and without results, approvals, absorbed inputs, seeds, summaries, an
active tail): compaction never splits a turn, never reaches a barrier and partitions the input in order;
selection never removes a protected message, removes whole oldest turns only, and its arithmetic adds up.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from threadline.errors import AgentRuntimeUsageError
from threadline.history.compaction import select_compactable_history
from threadline.history.projection import AgentHistoryEvidencePolicy
from threadline.history.prompt import decide_prompt_budget, estimate_tokens
from threadline.history.selection import (
    estimate_message_tokens,
    select_agent_history,
    split_agent_history_turns,
)
from threadline.records import (
    ApprovalRequestPart,
    ApprovalResponsePart,
    InputJoinedPart,
    Message,
    TextPart,
    ToolCallPart,
    ToolResultPart,
)

NOW = datetime(2026, 1, 1, tzinfo=UTC)
MARKED = AgentHistoryEvidencePolicy(failed_assistant="assistant-marked")


class History:
    """Builds canonical histories in causal order: settled messages get increasing positions."""

    def __init__(self) -> None:
        self.messages: list[Message] = []
        self.position = 0
        self.lead = 0
        self.seq = 0

    def add(
        self, id: str, role: str, *parts: Any, status: str | None = None, settled: bool = True, **kw: Any
    ) -> Message:
        self.seq += 1
        if kw.get("band") == "lead":
            self.lead += 1
            kw["position"] = self.lead
        elif settled:
            self.position += 1
            kw["position"] = self.position
        m = Message(
            id=id,
            conversation_id="c",
            role=role,  # type: ignore[arg-type]
            status=status or ("completed" if role == "assistant" else "committed"),  # type: ignore[arg-type]
            parts=parts or (TextPart(text=f"text of {id}"),),
            created_at=NOW,
            seq=self.seq,
            **kw,
        )
        self.messages.append(m)
        return m

    def turn(self, run: str, *answer: Any, status: str = "completed", users: int = 1, settled: bool = True) -> None:
        for u in range(users):
            self.add(f"{run}:in{u}", "user", run_id=run, settled=settled)
        if status != "none":
            self.add(f"{run}:out", "assistant", *answer, status=status, run_id=run, settled=settled)


def ids(messages: Sequence[Message]) -> list[str]:
    return [m.id for m in messages]


def call(cid: str) -> ToolCallPart:
    return ToolCallPart(call_id=cid, tool_name="lookup", input={"q": cid})


def result(cid: str, tool: str = "lookup") -> ToolResultPart:
    return ToolResultPart(call_id=cid, tool_name=tool, output="ok")


# ------------------------------------------------------------------------------------------------ turns


def test_turns_group_runs_seeds_lead_and_summaries() -> None:
    h = History()
    h.add("sys", "system", band="lead")
    h.add("note", "user", band="lead")
    h.add("sum", "summary")
    h.turn("r1", users=2)  # coalesced inputs: one turn
    h.add("seed:in", "user")
    h.add("seed:out", "assistant")
    h.add("seed2:in", "user")
    # r2 absorbed r3's input at a step boundary: the store settles it between r2's input and answer
    h.add("r2:in0", "user", run_id="r2")
    h.add("r3:in0", "user", run_id="r3")
    h.add(
        "r2:out",
        "assistant",
        TextPart(text="a"),
        InputJoinedPart(run_id="r3", message_ids=("r3:in0",), step=1),
        TextPart(text="b"),
        run_id="r2",
    )
    h.turn("r4", settled=False, status="none")
    units = split_agent_history_turns(h.messages)
    assert [(u.kind, ids(u.messages), u.problem) for u in units] == [
        ("lead", ["sys"], None),
        ("lead", ["note"], None),
        ("summary", ["sum"], None),
        ("turn", ["r1:in0", "r1:in1", "r1:out"], None),
        ("seed", ["seed:in", "seed:out"], None),
        ("seed", ["seed2:in"], None),
        ("turn", ["r2:in0", "r3:in0", "r2:out"], None),
        ("turn", ["r4:in0"], "unsettled"),
    ]
    assert [i for u in units for i in u.indices] == list(range(len(h.messages)))


@pytest.mark.parametrize(
    ("build", "problem"),
    [
        (lambda h: h.turn("r", status="none"), "unanswered-input"),
        (lambda h: h.turn("r", settled=False), "unsettled"),
        (lambda h: h.turn("r", status="streaming"), "crash-draft"),
        (lambda h: h.turn("r", status="superseded"), "superseded"),
        (lambda h: h.turn("r", status="failed"), "failed"),
        (lambda h: h.turn("r", call("c1")), "dangling-tool-call"),
        (lambda h: h.turn("r", call("c1"), TextPart(text="x"), status="interrupted"), "dangling-tool-call"),
        (lambda h: h.turn("r", call("c1"), result("c1"), call("c2"), TextPart(text="t")), "dangling-tool-call"),
        (lambda h: h.turn("r", result("c1")), "invalid-tool-chronology"),
        (lambda h: h.turn("r", call("c1"), result("c1"), call("c1"), result("c1")), "invalid-tool-chronology"),
        (lambda h: h.turn("r", call("c1"), result("c1"), TextPart(text="x"), result("c1")), "invalid-tool-chronology"),
        (lambda h: h.turn("r", call("c1"), result("c1", tool="other")), "invalid-tool-chronology"),
        (
            lambda h: h.turn("r", ApprovalRequestPart(approval_id="a1", call_id="c1", tool_name="pay")),
            "unresolved-approval",
        ),
        (
            lambda h: (
                h.add("r:in", "user", run_id="r"),
                h.add("r:out", "assistant", run_id="r"),
                h.add("r:late", "user", run_id="r"),
            ),
            "out-of-order",
        ),
        (lambda h: (h.turn("r"), h.add("r:again", "assistant", run_id="r")), "out-of-order"),
    ],
)
def test_turn_problems(build: Callable[[History], Any], problem: str) -> None:
    h = History()
    build(h)
    units = split_agent_history_turns(h.messages)
    assert units[0].problem == problem


def approval_request() -> tuple[Any, ...]:
    """A call that asked for approval: the run stores the call and the request and stops."""
    return (call("c9"), ApprovalRequestPart(approval_id="a1", call_id="c9", tool_name="lookup"))


def test_complete_turns_with_tools_approvals_and_marked_failures() -> None:
    h = History()
    h.turn("ok", call("c1"), call("c2"), result("c1"), result("c2"), TextPart(text="done"))
    h.turn("asks", TextPart(text="may I?"), *approval_request())
    # the approval response is the input of the next run, which records the call again with its result
    h.add("resp", "tool", ApprovalResponsePart(approval_id="a1", call_id="c9", approved=True), run_id="approved")
    h.add("approved:out", "assistant", call("c9"), result("c9"), TextPart(text="paid"), run_id="approved")
    h.turn("cut", TextPart(text="partial"), status="interrupted")
    h.turn("broke", status="failed")
    units = split_agent_history_turns(h.messages)
    assert [u.problem for u in units] == [None, None, None, "failed"]
    assert [u.problem for u in split_agent_history_turns(h.messages, evidence_policy=MARKED)] == [None] * 4
    # the approved run has no user input: it continues the turn that asked, as one unit
    assert ids(units[1].messages) == ["asks:in0", "asks:out", "resp", "approved:out"]
    assert units[1].run_ids == ("asks", "approved")
    # so compaction keeps or folds them together, and the retained history never starts with an answer
    assert ids(select_compactable_history(h.messages, 2).compactable) == ["ok:in0", "ok:out"]
    assert ids(select_compactable_history(h.messages, 1).compactable)[-2:] == ["resp", "approved:out"]


def test_an_approval_answered_by_a_run_not_yet_settled_is_still_unresolved() -> None:
    """The queued run re-reads the signed request from history before it executes the call: the
    requesting turn may not be compacted away until that run has settled."""
    h = History()
    h.turn("t0")
    h.turn("asks", *approval_request())
    h.turn("t1")
    h.add(
        "resp",
        "tool",
        ApprovalResponsePart(approval_id="a1", call_id="c9", approved=True),
        run_id="next",
        settled=False,
    )
    units = split_agent_history_turns(h.messages)
    assert [(u.run_ids, u.problems) for u in units] == [
        (("t0",), ()),
        (("asks",), ("unresolved-approval",)),
        (("t1", "next"), ("unsettled",)),  # the queued approval run continues the last turn
    ]
    sel = select_compactable_history(h.messages, 0)
    assert ids(sel.compactable) == ["t0:in0", "t0:out"]
    assert sel.barrier is not None and sel.barrier.reason == "unresolved-approval"


def test_interleaved_run_is_out_of_order_in_both_places() -> None:
    h = History()
    h.add("a:in", "user", run_id="a")
    h.add("b:in", "user", run_id="b")  # no join marker: b's input does not belong to a
    h.add("a:out", "assistant", run_id="a")
    units = split_agent_history_turns(h.messages)
    assert [(ids(u.messages), u.problems) for u in units] == [
        (["a:in"], ("out-of-order",)),
        (["b:in", "a:out"], ("unanswered-input", "out-of-order")),  # an answer alone continues a turn
    ]


# ---------------------------------------------------------------------------------------- selection


def four_turns() -> History:
    h = History()
    h.add("sys", "system", band="lead")
    h.add("sum", "summary")
    for n in range(1, 5):
        h.turn(f"t{n}")
    return h


def ten(_: Message) -> int:
    return 10


def test_selection_fits_without_removing() -> None:
    h = four_turns()
    sel = select_agent_history(h.messages, budget_tokens=100, count_tokens=ten)
    assert sel.decision == "fits" and sel.provenance == "measured"
    assert ids(sel.messages) == ids(h.messages)
    assert (sel.total_tokens, sel.kept_tokens, sel.removed_tokens, sel.protected_tokens) == (100, 100, 0, 40)
    assert [d.reason for d in sel.decisions] == ["system", "summary", *["within-budget"] * 6, "recent", "recent"]
    assert all(d.provenance == "measured" and d.tokens == 10 for d in sel.decisions)


def test_selection_removes_whole_oldest_turns_only() -> None:
    h = four_turns()
    sel = select_agent_history(h.messages, budget_tokens=79, count_tokens=ten, keep_recent_turns=1)
    assert sel.decision == "trimmed" and sel.removed_turns == 2
    assert ids(sel.messages) == ["sys", "sum", "t3:in0", "t3:out", "t4:in0", "t4:out"]
    assert (sel.total_tokens, sel.kept_tokens, sel.removed_tokens) == (100, 60, 40)
    by_id = {d.message_id: d for d in sel.decisions}
    assert [by_id[i].reason for i in ("t1:in0", "t1:out", "t2:in0", "t2:out")] == ["budget"] * 4
    assert by_id["t4:out"].reason == "recent" and by_id["t3:out"].reason == "within-budget"
    # exact equality fits: 80 fits in 80 after removing one turn
    assert select_agent_history(h.messages, budget_tokens=80, count_tokens=ten).removed_turns == 1


def test_an_answered_approval_and_its_continuation_are_removed_together_as_the_oldest_turn() -> None:
    h = History()
    h.turn("asks", TextPart(text="may I?"), *approval_request())
    h.add("resp", "tool", ApprovalResponsePart(approval_id="a1", call_id="c9", approved=True), run_id="approved")
    h.add("approved:out", "assistant", call("c9"), result("c9"), TextPart(text="done"), run_id="approved")
    h.turn("next")
    sel = select_agent_history(h.messages, budget_tokens=20, count_tokens=ten, keep_recent_turns=1)
    # the request, the approval and the run that carried the call out go as one unit, never split
    assert sel.decision == "trimmed" and sel.removed_turns == 1
    assert ids(sel.messages) == ["next:in0", "next:out"]
    removed = [d.message_id for d in sel.decisions if d.action == "removed"]
    assert removed == ["asks:in0", "asks:out", "resp", "approved:out"]


def test_selection_oversized_when_protected_turns_cannot_fit() -> None:
    h = four_turns()
    sel = select_agent_history(h.messages, budget_tokens=30, count_tokens=ten, keep_recent_turns=2)
    assert sel.decision == "oversized"
    assert ids(sel.messages) == ["sys", "sum", "t3:in0", "t3:out", "t4:in0", "t4:out"]
    assert sel.kept_tokens == sel.protected_tokens == 60 > 30
    # a negative budget (even the fixed prompt overflows): oversized, even for an empty history
    empty = select_agent_history([], budget_tokens=-1)
    assert (empty.decision, empty.total_tokens, empty.kept_tokens) == ("oversized", 0, 0)
    assert select_agent_history([], budget_tokens=0).decision == "fits"


def test_selection_protects_incomplete_and_keeps_order() -> None:
    h = History()
    h.turn("t1")
    h.turn("pending", *approval_request())
    h.turn("t2")
    h.turn("t3")
    h.turn("live", settled=False, status="streaming")
    sel = select_agent_history(h.messages, budget_tokens=0, count_tokens=ten, keep_recent_turns=1)
    by_id = {d.message_id: (d.action, d.reason) for d in sel.decisions}
    assert by_id["pending:out"] == ("kept", "incomplete") and by_id["live:out"] == ("kept", "incomplete")
    assert by_id["t1:out"] == by_id["t2:out"] == ("removed", "budget")
    assert by_id["t3:out"] == ("kept", "recent")
    assert ids(sel.messages) == ["pending:in0", "pending:out", "t3:in0", "t3:out", "live:in0", "live:out"]
    assert sel.decision == "oversized"


def test_superseded_and_omitted_failed_assistants_are_removed_and_never_counted() -> None:
    h = History()
    h.turn("t1")
    h.turn("gone", TextPart(text="SUPERSEDED " * 500), status="superseded")
    h.turn("t2")
    h.turn("bad", TextPart(text="half"), status="failed")
    h.turn("t3")
    counted: list[str] = []

    def count(m: Message) -> int:
        counted.append(m.id)
        return 10

    sel = select_agent_history(h.messages, budget_tokens=1000, count_tokens=count, keep_recent_turns=0)
    assert "gone:out" not in counted and "bad:out" not in counted
    by_id = {d.message_id: d for d in sel.decisions}
    assert (by_id["gone:out"].action, by_id["gone:out"].reason, by_id["gone:out"].tokens) == (
        "removed",
        "superseded",
        None,
    )
    assert (by_id["bad:out"].action, by_id["bad:out"].reason, by_id["bad:out"].provenance) == (
        "removed",
        "failed",
        None,
    )
    assert sel.total_tokens == 80 and sel.decision == "fits"
    # the superseded turn's input joins the next turn (t2 answered it) and leaves with it
    assert by_id["gone:in0"].unit == by_id["t2:out"].unit
    tight = select_agent_history(h.messages, budget_tokens=50, count_tokens=count, keep_recent_turns=0)
    assert ids(tight.messages) == ["bad:in0", "t3:in0", "t3:out"]
    # with failed evidence opted in, the failed assistant is counted and its turn is an ordinary turn
    marked = select_agent_history(h.messages, budget_tokens=1000, count_tokens=count, evidence_policy=MARKED)
    assert marked.total_tokens == 90 and "bad:out" in ids(marked.messages)


def test_token_provenance_estimated_and_unavailable() -> None:
    h = four_turns()
    estimated = select_agent_history(h.messages, budget_tokens=10_000)
    assert estimated.provenance == "estimated" and estimated.decision == "fits"
    assert [d.tokens for d in estimated.decisions] == [estimate_message_tokens(m) for m in h.messages]
    assert estimate_message_tokens(h.messages[0]) == estimate_tokens("text of sys")

    # no way to count: unavailable, nothing removed, no totals invented
    none = select_agent_history(h.messages, budget_tokens=1, estimate=False)
    assert (none.decision, none.provenance, none.total_tokens, none.kept_tokens) == (
        "unavailable",
        "unavailable",
        None,
        None,
    )
    assert ids(none.messages) == ids(h.messages)
    assert [d.reason for d in none.decisions][:3] == ["system", "summary", "unavailable"]

    # one message the counter cannot count makes the whole decision unavailable
    partial = select_agent_history(h.messages, budget_tokens=1, count_tokens=lambda m: None if m.id == "t1:out" else 5)
    assert partial.decision == "unavailable" and partial.removed_tokens is None
    by_id = {d.message_id: d for d in partial.decisions}
    assert (by_id["t1:out"].tokens, by_id["t1:out"].provenance) == (None, "unavailable")
    assert (by_id["t2:out"].tokens, by_id["t2:out"].provenance) == (5, "measured")

    # an unknown budget: counts are real, the decision is not
    unknown = select_agent_history(h.messages, budget_tokens=None, count_tokens=ten)
    assert (unknown.decision, unknown.total_tokens, unknown.removed_tokens) == ("unavailable", 100, 0)


def test_selection_feeds_the_prompt_budget() -> None:
    h = four_turns()
    sel = select_agent_history(h.messages, budget_tokens=50, count_tokens=ten, keep_recent_turns=1)
    budget = decide_prompt_budget(
        context_window=100,
        instructions_tokens=50,
        history_tokens=sel.total_tokens,
        removable_history_tokens=sel.removable_tokens,
    )
    assert (sel.decision, budget.decision) == ("trimmed", "compact")
    assert sel.kept_tokens is not None and sel.kept_tokens <= budget.available_history_tokens  # type: ignore[operator]


def test_selection_argument_errors() -> None:
    with pytest.raises(AgentRuntimeUsageError):
        select_agent_history([], budget_tokens=1, keep_recent_turns=-1)
    with pytest.raises(AgentRuntimeUsageError):
        select_agent_history([], budget_tokens=1.5)  # type: ignore[arg-type]
    h = four_turns()
    with pytest.raises(AgentRuntimeUsageError):
        select_agent_history(h.messages, budget_tokens=1, count_tokens=lambda m: -1)


# ------------------------------------------------------------------------------------ compactable


def test_compactable_prefix_after_leading_summary() -> None:
    h = four_turns()
    sel = select_compactable_history(h.messages, 2)
    assert sel.leading_summary is not None and sel.leading_summary.id == "sum"
    assert ids(sel.compactable) == ["t1:in0", "t1:out", "t2:in0", "t2:out"]
    assert ids(sel.retained) == ["sys", "t3:in0", "t3:out", "t4:in0", "t4:out"]
    assert sel.replaced_message_ids == ("sum", "t1:in0", "t1:out", "t2:in0", "t2:out")
    assert (sel.turns, sel.barrier, sel.prefix) == (2, None, 1)
    assert ids(sel.ordered()) == ids(h.messages)
    new = h.messages[1].model_copy(update={"id": "sum2"})
    assert ids(sel.with_summary(new)) == ["sys", "sum2", "t3:in0", "t3:out", "t4:in0", "t4:out"]
    # keep every turn, or more than there are: nothing to compact
    assert select_compactable_history(h.messages, 4).compactable == ()
    assert select_compactable_history(h.messages, 9).compactable == ()
    assert len(select_compactable_history(h.messages, 0).compactable) == 8


@pytest.mark.parametrize(
    ("status", "parts", "reason"),
    [
        ("completed", (call("c1"),), "dangling-tool-call"),
        ("completed", (ApprovalRequestPart(approval_id="a", call_id="c", tool_name="pay"),), "unresolved-approval"),
        ("failed", (), "failed"),
        ("none", (), "unanswered-input"),
    ],
)
def test_barrier_stops_the_prefix(status: str, parts: tuple[Any, ...], reason: str) -> None:
    h = History()
    h.turn("t1")
    h.turn("x", *parts, status=status)
    h.turn("t2")
    h.turn("t3")
    sel = select_compactable_history(h.messages, 1)
    assert ids(sel.compactable) == ["t1:in0", "t1:out"]
    assert sel.barrier is not None and (sel.barrier.message_id, sel.barrier.reason) == ("x:in0", reason)
    first = History()
    first.turn("x", *parts, status=status)
    first.turn("t1")
    first.turn("t2")
    blocked = select_compactable_history(first.messages, 1)
    assert blocked.compactable == () and blocked.barrier is not None


def test_a_superseded_turn_is_skipped_never_summarised_and_not_a_barrier() -> None:
    h = History()
    h.turn("t1")
    h.turn("x", TextPart(text="SUPERSEDED draft"), status="superseded")
    h.turn("t2")
    h.turn("t3")
    sel = select_compactable_history(h.messages, 1)
    # the turns after it stay compactable; its input goes with t2, the turn that answered it
    assert ids(sel.compactable) == ["t1:in0", "t1:out", "x:in0", "t2:in0", "t2:out"]
    assert sel.replaced_message_ids == ("t1:in0", "t1:out", "x:in0", "t2:in0", "t2:out")
    assert ids(sel.superseded) == ["x:out"] and sel.barrier is None
    assert sel.turns == 2  # it is not counted as a turn
    assert ids(sel.retained) == ["t3:in0", "t3:out"]
    assert ids(sel.ordered()) == ids(h.messages)
    summary = h.messages[0].model_copy(update={"id": "sum", "role": "summary", "run_id": None, "position": 5})
    # as the store keeps it: the superseded record stays, before the summary placed after what it replaced
    assert ids(sel.with_summary(summary)) == ["x:out", "sum", "t3:in0", "t3:out"]

    # with the turn that answered it kept as recent, its input stays with that turn
    recent = select_compactable_history(h.messages, 2)
    assert ids(recent.compactable) == ["t1:in0", "t1:out"] and recent.superseded == ()
    assert recent.barrier is None and ids(recent.ordered()) == ids(h.messages)
    # and it never counts toward keep_recent_turns: three answered turns, so keeping three compacts nothing
    assert select_compactable_history(h.messages, 3).compactable == ()


def test_a_superseded_answer_left_by_an_earlier_compaction_stays_before_the_leading_summary() -> None:
    h = History()
    h.add("x:out", "assistant", TextPart(text="SUPERSEDED"), status="superseded", run_id="x")
    h.add("sum", "summary")
    h.turn("t1")
    h.turn("t2")
    sel = select_compactable_history(h.messages, 1)
    assert sel.leading_summary is not None and sel.leading_summary.id == "sum"
    assert sel.replaced_message_ids == ("sum", "t1:in0", "t1:out")
    assert ids(sel.retained[: sel.prefix]) == ["x:out"] and sel.superseded == ()
    assert ids(sel.ordered()) == ids(h.messages)


def test_a_superseded_turn_after_a_barrier_or_at_the_end_stays() -> None:
    h = History()
    h.turn("t1")
    h.turn("t2")
    h.turn("x", status="superseded")
    h.turn("live", settled=False, status="none")
    sel = select_compactable_history(h.messages, 0)
    assert ids(sel.compactable) == ["t1:in0", "t1:out", "t2:in0", "t2:out"] and sel.superseded == ()
    assert sel.barrier is not None and sel.barrier.message_id == "live:in0"
    # nothing answered its input yet (a summary is no answer): it waits, and what follows it with it
    unanswered = History()
    unanswered.turn("t1")
    unanswered.turn("x", status="superseded")
    unanswered.add("sum", "summary")
    sel = select_compactable_history(unanswered.messages, 0)
    assert ids(sel.compactable) == ["t1:in0", "t1:out"] and ids(sel.retained) == ["x:in0", "x:out", "sum"]


def test_failed_turn_is_compactable_with_assistant_marked_evidence() -> None:
    h = History()
    h.turn("t1")
    h.turn("bad", TextPart(text="partial"), status="failed")
    h.turn("t2")
    h.turn("t3")
    assert ids(select_compactable_history(h.messages, 1).compactable) == ["t1:in0", "t1:out"]
    marked = select_compactable_history(h.messages, 1, evidence_policy=MARKED)
    assert ids(marked.compactable) == ["t1:in0", "t1:out", "bad:in0", "bad:out", "t2:in0", "t2:out"]
    assert marked.barrier is None


def test_recent_turns_count_complete_turns_only() -> None:
    h = History()
    h.turn("t1")
    h.turn("t2")
    h.turn("live", settled=False, status="none")
    sel = select_compactable_history(h.messages, 1)
    assert ids(sel.compactable) == ["t1:in0", "t1:out"]
    assert sel.barrier is None  # the recent turn ended the prefix before the live run did


def test_compactable_argument_errors() -> None:
    with pytest.raises(AgentRuntimeUsageError):
        select_compactable_history([], -1)
    with pytest.raises(AgentRuntimeUsageError):
        select_compactable_history([], True)


# ------------------------------------------------------------------------------------- properties


@dataclass
class Spec:
    messages: list[Message]
    bad_runs: dict[str, set[str]]
    """Effective run keys of incomplete turns (under the default evidence policy), with why."""
    failed_runs: set[str]
    alias: dict[str, str]


ASSISTANT_STATUSES = ["completed", "completed", "interrupted", "failed", "superseded"]


@st.composite
def histories(draw: st.DrawFn) -> Spec:
    h = History()
    bad: dict[str, set[str]] = {}
    failed: set[str] = set()
    alias: dict[str, str] = {}
    for n in range(draw(st.integers(0, 2))):
        h.add(f"lead{n}", draw(st.sampled_from(["system", "user"])), band="lead")
    if draw(st.booleans()):
        h.add("sum0", "summary")
    for t in range(draw(st.integers(0, 8))):
        kind = draw(st.sampled_from(["run", "run", "run", "run", "seed", "summary", "absorb", "unanswered"]))
        run = f"r{t}"
        if kind == "summary":
            h.add(f"sum{t + 1}", "summary")
            continue
        if kind == "seed":
            h.add(f"{run}:seed-in", "user")
            h.add(f"{run}:seed-out", "assistant")
            continue
        if kind == "unanswered":
            h.turn(run, status="none", users=draw(st.integers(1, 2)))
            bad.setdefault(run, set()).add("unanswered")
            continue
        status = "completed" if kind == "absorb" else draw(st.sampled_from(ASSISTANT_STATUSES))
        parts: list[Any] = [TextPart(text=f"answer {run}")]
        for c in range(draw(st.integers(0, 2))):
            parts.append(call(f"{run}-c{c}"))
            if draw(st.integers(0, 4)):
                parts.append(result(f"{run}-c{c}"))
            else:
                bad.setdefault(run, set()).add("dangling")
        # only a run that paused for it (completed, provider_stop) carries an approval request
        approval = draw(st.sampled_from(["none", "none", "resolved", "open"])) if status == "completed" else "none"
        if approval != "none":  # the call waits for approval: suspended, no result in this run
            parts.append(call(f"{run}-ac"))
            parts.append(ApprovalRequestPart(approval_id=f"{run}-a", call_id=f"{run}-ac", tool_name="lookup"))
            if approval == "open":
                bad.setdefault(run, set()).add("approval")
        if kind == "absorb":
            h.add(f"{run}:in0", "user", run_id=run)
            h.add(f"{run}b:in0", "user", run_id=f"{run}b")
            parts.append(InputJoinedPart(run_id=f"{run}b", message_ids=(f"{run}b:in0",), step=0))
            parts.append(TextPart(text="after join"))
            alias[f"{run}b"] = run
            h.add(f"{run}:out", "assistant", *parts, status=status, run_id=run)
        else:
            h.turn(run, *parts, status=status, users=draw(st.integers(1, 2)))
        if approval == "resolved":  # the response queued a run that recorded the call with its result
            response = ApprovalResponsePart(approval_id=f"{run}-a", call_id=f"{run}-ac", approved=True)
            h.add(f"{run}x:approval", "tool", response, run_id=f"{run}x")
            h.add(f"{run}x:out", "assistant", call(f"{run}-ac"), result(f"{run}-ac"), run_id=f"{run}x")
            alias[f"{run}x"] = run  # a run without user input continues the turn before it
        if status == "superseded":
            bad.setdefault(run, set()).add("superseded")
        if status == "failed":
            failed.add(run)
    for a in range(draw(st.integers(0, 2))):
        run = f"live{a}"
        bad.setdefault(run, set()).add("live")
        h.turn(run, settled=False, status="streaming" if a == 0 and draw(st.booleans()) else "none")
    return Spec(h.messages, bad, failed, alias)


def key(spec: Spec, m: Message) -> str | None:
    return spec.alias.get(m.run_id, m.run_id) if m.run_id else None


def complete_answers(spec: Spec, marked: bool, removable: bool = False) -> list[str]:
    """Ids of the assistants of complete turns (run or seed), in order. ``removable``: the selector's
    notion, where a settled answered turn whose only defect is a dangling call is a turn too."""
    out: dict[str, str] = {}  # one per turn: its last assistant
    for m in spec.messages:
        if m.role != "assistant" or m.band == "lead":
            continue
        k = key(spec, m)
        reasons = spec.bad_runs.get(k, set()) if k else set()
        if removable:
            reasons = reasons - {"dangling"}
        if k is None or (not reasons and (marked or k not in spec.failed_runs)):
            out[k or m.id] = m.id
    return list(out.values())


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec=histories(), keep=st.integers(0, 3), marked=st.booleans())
def test_property_compactable_never_splits_a_turn_nor_crosses_a_barrier(spec: Spec, keep: int, marked: bool) -> None:
    messages = spec.messages
    policy = MARKED if marked else None
    sel = select_compactable_history(messages, keep, evidence_policy=policy)
    index = {m.id: i for i, m in enumerate(messages)}

    # a partition of the input, in order
    assert ids(sel.ordered()) == ids(messages)
    # never half a turn: every message of a compacted run (absorbed inputs included) is compacted, but a
    # superseded answer, which is never summarised and stays in place
    chosen = set(ids(sel.compactable))
    skipped = set(ids(sel.superseded))
    assert all(m.role == "assistant" and m.status == "superseded" for m in sel.superseded)
    for m in messages:
        k = key(spec, m)
        if k is not None and any(key(spec, c) == k for c in sel.compactable):
            assert m.id in chosen | skipped, (m.id, ids(sel.compactable))
    # nothing at or after a barrier; a superseded turn is none
    superseded_runs = {run for run, why in spec.bad_runs.items() if "superseded" in why}
    bad = (set(spec.bad_runs) - superseded_runs) | (set() if marked else spec.failed_runs)
    barrier_at = min((index[m.id] for m in messages if key(spec, m) in bad), default=len(messages))
    assert all(index[m.id] < barrier_at for m in sel.compactable)
    # only settled history, never the lead band, never superseded or unfinished records
    for m in sel.compactable:
        assert m.position is not None and m.band == "history"
        assert m.status not in ("superseded", "streaming")
    # a superseded turn's input is compacted only with a later turn that answered it
    for m in sel.compactable:
        if key(spec, m) in superseded_runs and m.role == "user":
            later = [c for c in sel.compactable if index[c.id] > index[m.id] and key(spec, c) != key(spec, m)]
            assert any(c.role == "assistant" for c in later), (m.id, ids(sel.compactable))
    # the most recent complete turns stay
    answers = complete_answers(spec, marked)
    recent = answers[-keep:] if keep else []
    assert not chosen & set(recent)
    if len(answers) < keep:
        assert sel.compactable == ()
    # the leading summary is the first history message, and only then
    if sel.leading_summary is not None:
        assert sel.leading_summary.role == "summary"
        assert all(m.band == "lead" for m in sel.retained[: sel.prefix])
    # maximal: the range stops only at a barrier, at the recent turns, or at the end (superseded turns
    # just before them wait with them)
    end = sel.prefix + (1 if sel.leading_summary is not None else 0) + len(sel.compactable) + len(sel.superseded)

    def group(m: Message) -> str:
        return key(spec, m) or m.id.split(":")[0]

    waited = False  # a superseded turn no answered turn followed in the range, and what came after it
    while end < len(messages) and (
        group(messages[end]) in superseded_runs or (waited and messages[end].role == "summary")
    ):
        waited = waited or group(messages[end]) in superseded_runs
        end += 1
    if end < len(messages):
        nxt = messages[end]
        members = [m.id for m in messages if group(m) == group(nxt)]
        assert group(nxt) in bad or set(members) & set(recent) or len(answers) < keep, (nxt.id, ids(sel.compactable))
    # the replaced range is contiguous in causal order, but for the superseded answers kept inside it
    replaced = [index[i] for i in sel.replaced_message_ids]
    if replaced:
        span = sorted([*replaced, *(index[m.id] for m in sel.superseded)])
        assert span == list(range(span[0], span[0] + len(span)))
        assert all(min(replaced) < index[m.id] < max(replaced) for m in sel.superseded)
    else:
        assert sel.superseded == ()


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    spec=histories(),
    keep=st.integers(0, 3),
    budget=st.one_of(st.none(), st.integers(-5, 400)),
    sizes=st.dictionaries(st.text(min_size=1, max_size=12), st.integers(0, 40)),
    blind=st.sampled_from([None, None, None, "r0:out", "lead0"]),
    marked=st.booleans(),
)
def test_property_selection_protects_and_adds_up(
    spec: Spec, keep: int, budget: int | None, sizes: dict[str, int], blind: str | None, marked: bool
) -> None:
    messages = spec.messages

    def count(m: Message) -> int | None:
        return None if m.id == blind else sizes.get(m.id, len(m.id))

    policy = MARKED if marked else None
    sel = select_agent_history(
        messages, budget_tokens=budget, keep_recent_turns=keep, count_tokens=count, evidence_policy=policy
    )
    decisions = {d.message_id: d for d in sel.decisions}
    assert list(decisions) == ids(messages)
    assert ids(sel.messages) == [m.id for m in messages if decisions[m.id].action == "kept"]

    # superseded (and omitted failed) assistants: removed, never counted
    for m in messages:
        d = decisions[m.id]
        if m.role == "assistant" and (m.status == "superseded" or (m.status == "failed" and not marked)):
            assert (d.action, d.tokens, d.provenance) == ("removed", None, None)
            assert d.reason == ("superseded" if m.status == "superseded" else "failed")
        elif d.action == "removed":
            assert d.reason == "budget"

    # protected messages are never removed
    for m in messages:
        if m.band == "lead" or m.role in ("system", "summary") or m.position is None:
            assert decisions[m.id].action == "kept", m.id
    answers = complete_answers(spec, marked, removable=True)
    for aid in answers[-keep:] if keep else []:
        assert decisions[aid].action == "kept"

    # whole turns only, oldest first
    removed_runs = {key(spec, m) for m in messages if decisions[m.id].reason == "budget"}
    for m in messages:
        if key(spec, m) in removed_runs - {None} and decisions[m.id].reason not in ("superseded", "failed"):
            assert decisions[m.id].reason == "budget", m.id
    removed_at = [i for i, m in enumerate(messages) if decisions[m.id].reason == "budget"]
    free_at = [i for i, m in enumerate(messages) if decisions[m.id].reason == "within-budget"]
    if removed_at and free_at:
        assert max(removed_at) < min(free_at)

    counted = [d for d in sel.decisions if d.provenance is not None]
    if blind is not None and any(d.message_id == blind for d in counted):
        assert sel.decision == "unavailable" and sel.provenance == "unavailable"
        assert sel.total_tokens is None and not removed_at
        return
    assert sel.provenance == "measured"
    assert sel.total_tokens == sum(d.tokens or 0 for d in counted)
    assert sel.kept_tokens == sum(d.tokens or 0 for d in counted if d.action == "kept")
    assert sel.removed_tokens == sum(d.tokens or 0 for d in counted if d.action == "removed")
    assert sel.kept_tokens + sel.removed_tokens == sel.total_tokens  # type: ignore[operator]
    assert sel.protected_tokens is not None and sel.protected_tokens <= sel.kept_tokens  # type: ignore[operator]
    if budget is None:
        assert sel.decision == "unavailable" and not removed_at
    elif sel.decision == "fits":
        assert not removed_at and sel.total_tokens <= budget  # type: ignore[operator]
    elif sel.decision == "trimmed":
        assert removed_at and sel.kept_tokens <= budget  # type: ignore[operator]
    else:
        assert sel.decision == "oversized"
        assert sel.kept_tokens == sel.protected_tokens and sel.protected_tokens > budget  # type: ignore[operator]
