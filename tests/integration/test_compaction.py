"""``structured_compaction`` against real stores (memory reference driver and a SQLite file).

Pins: the summary replaces the compactable prefix at the snapshot's exact version; a concurrent input
makes the write conflict and the attempt is redone from a fresh snapshot — re-selected and
re-summarised, the stale summary never lands — up to ``max_attempts`` (then ``conflict`` with nothing
written; by default one attempt, so the first conflict is the outcome); a leading summary is merged
(``previous_summary`` / ``read_previous_summary``) and replaced, never stacked; barriers (failed,
dangling tool call) give ``barrier`` and the
``assistant-marked`` evidence policy lets a failed turn be summarised; a superseded turn is no barrier, is
never summarised and its record stays (``test_a_superseded_turn_inside_the_range_stays_and_is_skipped``
FAILS until the reducer accepts it, see there); the projection afterwards carries
the summary on the system channel; a running run is untouched and still commits; the runtime hook
compacts only when ``should_compact(context_usage)`` says so. On a SQLite file, reading back with
``include_compacted`` gives the whole sequence in order, ``compacted`` naming the replaced ids and each
summary right after the last message it replaced.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel
from pydantic_ai.messages import ModelRequest, ToolReturnPart, UserPromptPart
from pydantic_ai.models.function import AgentInfo, DeltaToolCall, FunctionModel

from threadline import create_agent_runtime, define_agent_protocol, define_agent_tool, define_model_registry
from threadline.errors import AgentRuntimeUsageError
from threadline.history.compaction import (
    AgentCompactionHook,
    select_compactable_history,
    structured_compaction,
    summary_text,
)
from threadline.history.projection import (
    AgentHistoryEvidencePolicy,
    AgentHistoryProjectionOptions,
    project_agent_history_detailed,
)
from threadline.records import Message
from threadline.store import AgentRuntimeStore, create_memory_agent_runtime_store
from threadline.store.sqlite import create_sqlite_agent_runtime_store

OWNER = "owner-1"
CID = "c"


def text(t: str) -> list[dict[str, str]]:
    return [{"type": "text", "text": t}]


class Clock:
    def __init__(self) -> None:
        self.now = datetime(2030, 1, 1, tzinfo=UTC)

    def __call__(self) -> datetime:
        self.now += timedelta(seconds=1)
        return self.now


async def start(store: AgentRuntimeStore, n: str) -> Any:
    """Admit and acquire run ``n``; returns the running run."""
    accepted = await store.accept_input_and_assign_run(
        conversation_id=CID,
        idempotency_key=f"key-{n}",
        input={"id": f"{n}:in", "parts": text(f"question {n}")},
        run_id=f"{n}:run",
        assistant_message_id=f"{n}:out",
    )
    acquired = await store.acquire_run(
        conversation_id=CID, run_id=accepted.run.id, expected_revision=accepted.run.revision, owner_id=OWNER
    )
    return acquired.run


async def turn(store: AgentRuntimeStore, n: str, reason: str = "success", parts: list[Any] | None = None) -> None:
    run = await start(store, n)
    await store.commit_run_terminal(
        conversation_id=CID,
        run_id=run.id,
        expected_revision=run.revision,
        owner_id=OWNER,
        fencing_token=run.fencing_token,
        terminal_reason=reason,
        parts=parts if parts is not None else text(f"answer {n}"),
    )


async def admit(store: AgentRuntimeStore, n: str) -> None:
    await store.accept_input_and_assign_run(
        conversation_id=CID, idempotency_key=f"key-{n}", input={"id": f"{n}:in", "parts": text(f"late {n}")}
    )


class Summarizer:
    """Records every call; the text names the call number and what it summarised."""

    def __init__(self, during: Any = None) -> None:
        self.calls: list[tuple[list[str], str | None]] = []
        self.during = during

    async def __call__(self, eligible: list[Message], previous: str | None) -> str:
        self.calls.append(([m.id for m in eligible], previous))
        if self.during is not None:
            await self.during(len(self.calls))
        return f"summary #{len(self.calls)} of {len(eligible)} messages"


async def snapshot_ids(store: AgentRuntimeStore) -> list[str]:
    return [m.id for m in (await store.load_snapshot(conversation_id=CID)).messages]


async def everything(store: AgentRuntimeStore) -> list[Message]:
    page = await store.conversations.messages(CID, include_compacted=True, limit=1000)
    return list(page.items)


@pytest.fixture
def store() -> AgentRuntimeStore:
    return create_memory_agent_runtime_store()


# -------------------------------------------------------------------------------------- memory store


async def test_compacts_the_prefix_and_projects_the_summary_as_system(store: AgentRuntimeStore) -> None:
    await store.seed_conversation_input(
        conversation_id=CID, seed_key="lead", inputs=[{"id": "sys", "role": "system", "parts": text("Be brief.")}]
    )
    for n in ("t1", "t2", "t3", "t4"):
        await turn(store, n)
    summarize = Summarizer()
    outcome = await structured_compaction(store, CID, summarize=summarize, keep_recent_turns=2)
    assert outcome.outcome == "applied" and (outcome.attempts, outcome.summarize_calls) == (1, 1)
    assert outcome.replaced_message_ids == ("t1:in", "t1:out", "t2:in", "t2:out")
    assert summarize.calls == [(["t1:in", "t1:out", "t2:in", "t2:out"], None)]
    assert outcome.summary is not None and outcome.summary.id == outcome.summary_id
    assert await snapshot_ids(store) == ["sys", outcome.summary_id, "t3:in", "t3:out", "t4:in", "t4:out"]

    snapshot = await store.load_snapshot(conversation_id=CID)
    assert outcome.version == snapshot.version
    projection = project_agent_history_detailed(snapshot.messages)
    assert projection.system == ["Be brief.", "summary #1 of 4 messages"]
    decisions = {d.message_id: (d.action, d.reason) for d in projection.decisions}
    assert decisions[outcome.summary_id] == ("projected", "system-channel")  # type: ignore[index]
    assert len(projection.messages) == 4  # t3 and t4 only: request, response, request, response

    again = await structured_compaction(store, CID, summarize=summarize, keep_recent_turns=2)
    assert (again.outcome, again.summarize_calls) == ("not_needed", 0)


async def test_conflict_with_a_concurrent_input_resummarises_and_never_applies_the_stale_summary(
    store: AgentRuntimeStore,
) -> None:
    for n in ("t1", "t2", "t3"):
        await turn(store, n)

    async def concurrent_input(call: int) -> None:
        if call == 1:
            await admit(store, "late")  # moves the version while the first summary is being written

    summarize = Summarizer(during=concurrent_input)
    outcome = await structured_compaction(store, CID, summarize=summarize, keep_recent_turns=1, max_attempts=3)
    assert (outcome.outcome, outcome.attempts, outcome.summarize_calls) == ("applied", 2, 2)
    assert len(summarize.calls) == 2  # re-summarised from the reloaded snapshot
    assert summarize.calls[0][0] == summarize.calls[1][0] == ["t1:in", "t1:out", "t2:in", "t2:out"]
    texts = [summary_text(m) for m in await everything(store) if m.role == "summary"]
    assert texts == ["summary #2 of 4 messages"]  # the stale summary #1 never landed
    assert await snapshot_ids(store) == [outcome.summary_id, "t3:in", "t3:out", "late:in"]


async def test_a_concurrent_input_is_a_conflict_by_default_and_the_stale_summary_is_not_applied(
    store: AgentRuntimeStore,
) -> None:
    for n in ("t1", "t2", "t3"):
        await turn(store, n)
    before = await snapshot_ids(store)

    async def concurrent_input(call: int) -> None:
        await admit(store, "late")

    summarize = Summarizer(during=concurrent_input)
    outcome = await structured_compaction(store, CID, summarize=summarize, keep_recent_turns=1)
    assert (outcome.outcome, outcome.attempts, outcome.summarize_calls) == ("conflict", 1, 1)
    assert outcome.summary_id is None and outcome.replaced_message_ids == ()
    assert await snapshot_ids(store) == [*before, "late:in"]
    assert not [m for m in await everything(store) if m.role == "summary"]


async def test_conflicts_exhaust_the_attempts_and_write_nothing(store: AgentRuntimeStore) -> None:
    for n in ("t1", "t2", "t3"):
        await turn(store, n)
    before = await snapshot_ids(store)

    async def always(call: int) -> None:
        await admit(store, f"late{call}")

    summarize = Summarizer(during=always)
    outcome = await structured_compaction(store, CID, summarize=summarize, keep_recent_turns=1, max_attempts=3)
    assert (outcome.outcome, outcome.attempts, outcome.summarize_calls) == ("conflict", 3, 3)
    assert outcome.summary_id is None and outcome.replaced_message_ids == ()
    assert await snapshot_ids(store) == [*before, "late1:in", "late2:in", "late3:in"]
    assert not [m for m in await everything(store) if m.role == "summary"]


async def test_a_leading_summary_is_merged_and_replaced_not_stacked(store: AgentRuntimeStore) -> None:
    for n in ("t1", "t2", "t3"):
        await turn(store, n)
    summarize = Summarizer()
    first = await structured_compaction(store, CID, summarize=summarize, keep_recent_turns=1)
    for n in ("t4", "t5"):
        await turn(store, n)
    second = await structured_compaction(store, CID, summarize=summarize, keep_recent_turns=1)
    assert second.outcome == "applied"
    assert summarize.calls[1] == (["t3:in", "t3:out", "t4:in", "t4:out"], "summary #1 of 4 messages")
    assert second.replaced_message_ids == (first.summary_id, "t3:in", "t3:out", "t4:in", "t4:out")
    assert await snapshot_ids(store) == [second.summary_id, "t5:in", "t5:out"]
    active = [m for m in (await store.load_snapshot(conversation_id=CID)).messages if m.role == "summary"]
    assert [m.id for m in active] == [second.summary_id]
    old = next(m for m in await everything(store) if m.id == first.summary_id)
    assert (old.active, old.compacted_by) == (False, second.summary_id)

    # a structured summary: the application reads its own previous summary back
    await turn(store, "t6")
    seen: list[str] = []

    def read_previous(leading: Message) -> str:
        seen.append(leading.id)
        return json.dumps({"merged": summary_text(leading)})

    third = await structured_compaction(
        store, CID, summarize=summarize, keep_recent_turns=1, read_previous_summary=read_previous
    )
    assert third.outcome == "applied" and seen == [second.summary_id]
    assert summarize.calls[2][1] == json.dumps({"merged": "summary #2 of 4 messages"})

    # a direct call passes the previous summary itself
    await turn(store, "t7")
    fourth = await structured_compaction(
        store, CID, summarize=summarize, keep_recent_turns=1, previous_summary="held by the app"
    )
    assert fourth.outcome == "applied" and summarize.calls[3][1] == "held by the app"
    assert [m.role for m in (await store.load_snapshot(conversation_id=CID)).messages].count("summary") == 1


@pytest.mark.parametrize(
    ("reason", "parts", "barrier"),
    [
        ("provider_failure", text("half an answer"), "failed"),
        ("success", [{"type": "tool-call", "call_id": "c1", "tool_name": "lookup", "input": {}}], "dangling-tool-call"),
    ],
)
async def test_barriers(store: AgentRuntimeStore, reason: str, parts: list[Any], barrier: str) -> None:
    await turn(store, "x", reason=reason, parts=parts)
    for n in ("t1", "t2"):
        await turn(store, n)
    summarize = Summarizer()
    outcome = await structured_compaction(store, CID, summarize=summarize, keep_recent_turns=1)
    assert outcome.outcome == "barrier" and summarize.calls == []
    assert outcome.barrier is not None and (outcome.barrier.message_id, outcome.barrier.reason) == ("x:in", barrier)


async def test_a_superseded_turn_before_the_recent_turns_waits_with_them(store: AgentRuntimeStore) -> None:
    for n, reason in (("t1", "success"), ("x", "superseded"), ("t2", "success"), ("t3", "success")):
        await turn(store, n, reason=reason, parts=text("SUPERSEDED draft") if reason == "superseded" else None)
    summarize = Summarizer()
    outcome = await structured_compaction(store, CID, summarize=summarize, keep_recent_turns=2)
    # t2 answered x's input, and t2 is recent: x stays whole, and it did not stop the prefix
    assert outcome.outcome == "applied" and outcome.barrier is None
    assert outcome.replaced_message_ids == ("t1:in", "t1:out")


async def test_a_superseded_turn_inside_the_range_stays_and_is_skipped(store: AgentRuntimeStore) -> None:
    """NEEDS A REDUCER CHANGE — fails until ``replace_compacted_range`` accepts it.

    The selection skips the superseded answer (never summarised, never in ``replaced_message_ids``) and
    compacts the turns after it. The range it replaces is then contiguous in active settled history but
    for that record, which sits between replaced messages. The reducer must accept an active superseded
    assistant inside ``[lo, hi]`` that is not in ``replaced_message_ids`` and leave it untouched (still
    active, no ``compacted_by``); today it refuses with "not one contiguous range"."""
    for n, reason in (("t1", "success"), ("x", "superseded"), ("t2", "success"), ("t3", "success")):
        await turn(store, n, reason=reason, parts=text("SUPERSEDED draft") if reason == "superseded" else None)
    summarize = Summarizer()
    outcome = await structured_compaction(store, CID, summarize=summarize, keep_recent_turns=1)
    replaced = ("t1:in", "t1:out", "x:in", "t2:in", "t2:out")  # x's input goes with t2, which answered it
    assert summarize.calls == [(list(replaced), None)]  # the discarded text never reaches the summariser
    assert outcome.outcome == "applied" and outcome.replaced_message_ids == replaced
    assert await snapshot_ids(store) == ["x:out", outcome.summary_id, "t3:in", "t3:out"]
    kept = next(m for m in await everything(store) if m.id == "x:out")
    assert (kept.status, kept.active, kept.compacted_by) == ("superseded", True, None)  # the record is kept
    snapshot = await store.load_snapshot(conversation_id=CID)
    projected = project_agent_history_detailed(snapshot.messages)
    assert {d.message_id: d.reason for d in projected.decisions}["x:out"] == "superseded"
    # and the next compaction finds the leading summary behind it
    await turn(store, "t4")
    again = await structured_compaction(store, CID, summarize=summarize, keep_recent_turns=1)
    assert again.replaced_message_ids == (outcome.summary_id, "t3:in", "t3:out")


async def test_failed_evidence_opted_in_is_summarised(store: AgentRuntimeStore) -> None:
    await turn(store, "t1")
    await turn(store, "bad", reason="provider_failure", parts=text("half an answer"))
    await turn(store, "t2")
    await turn(store, "t3")
    policy = AgentHistoryEvidencePolicy(failed_assistant="assistant-marked")
    default = await structured_compaction(store, CID, summarize=Summarizer(), keep_recent_turns=1)
    assert default.replaced_message_ids == ("t1:in", "t1:out")  # the failed turn stops the prefix
    reasons: dict[str, str] = {}

    def summarize(eligible: list[Message], previous: str | None) -> str:
        # as the guide says: project the raw eligible messages with the same policy before a model sees them
        projected = project_agent_history_detailed(eligible, AgentHistoryProjectionOptions(evidence_policy=policy))
        reasons.update({d.message_id: d.reason for d in projected.decisions})
        return "t1 answered; the next turn FAILED with partial output; t2 answered"

    outcome = await structured_compaction(store, CID, summarize=summarize, keep_recent_turns=1, evidence_policy=policy)
    assert outcome.outcome == "applied"
    assert outcome.replaced_message_ids == (default.summary_id, "bad:in", "bad:out", "t2:in", "t2:out")
    assert reasons["bad:out"] == "failed-evidence"  # the failure reaches the summariser marked
    failed = [m for m in await everything(store) if m.id == "bad:out"]
    assert (failed[0].status, failed[0].active) == ("failed", False)  # stored statuses never change


async def test_a_running_run_is_a_barrier_and_still_commits(store: AgentRuntimeStore) -> None:
    for n in ("t1", "t2"):
        await turn(store, n)
    running = await start(store, "live")
    checkpoint = await store.checkpoint_run_assistant(
        conversation_id=CID,
        run_id=running.id,
        expected_revision=running.revision,
        owner_id=OWNER,
        fencing_token=running.fencing_token,
        parts=text("thinking"),
    )
    outcome = await structured_compaction(store, CID, summarize=Summarizer(), keep_recent_turns=1)
    assert outcome.replaced_message_ids == ("t1:in", "t1:out")
    run = checkpoint.run
    done = await store.commit_run_terminal(
        conversation_id=CID,
        run_id=run.id,
        expected_revision=run.revision,
        owner_id=OWNER,
        fencing_token=run.fencing_token,
        terminal_reason="success",
        parts=text("answer live"),
    )
    assert done.outcome == "committed"
    assert await snapshot_ids(store) == [outcome.summary_id, "t2:in", "t2:out", "live:in", "live:out"]


async def test_not_needed_and_argument_errors(store: AgentRuntimeStore) -> None:
    empty = await structured_compaction(store, CID, summarize=Summarizer(), keep_recent_turns=0)
    assert (empty.outcome, empty.version) == ("not_needed", 0)
    await turn(store, "t1")
    assert (await structured_compaction(store, CID, summarize=Summarizer(), keep_recent_turns=1)).outcome == (
        "not_needed"
    )
    with pytest.raises(AgentRuntimeUsageError):
        await structured_compaction(
            store, CID, summarize=Summarizer(), keep_recent_turns=0, previous_summary="a", read_previous_summary=str
        )
    with pytest.raises(AgentRuntimeUsageError):
        await structured_compaction(store, CID, summarize=Summarizer(), keep_recent_turns=0, max_attempts=0)
    with pytest.raises(AgentRuntimeUsageError):
        await structured_compaction(store, CID, summarize=lambda e, p: "", keep_recent_turns=0)
    assert await snapshot_ids(store) == ["t1:in", "t1:out"]


async def test_a_summariser_that_raises_propagates_and_leaves_history_as_it_was(store: AgentRuntimeStore) -> None:
    for n in ("t1", "t2"):
        await turn(store, n)
    before = await store.load_snapshot(conversation_id=CID)

    async def unavailable(eligible: list[Message], previous: str | None) -> str:
        raise RuntimeError("summary unavailable")

    with pytest.raises(RuntimeError, match="summary unavailable"):
        await structured_compaction(store, CID, summarize=unavailable, keep_recent_turns=1)
    after = await store.load_snapshot(conversation_id=CID)
    assert (after.version, [m.id for m in after.messages]) == (before.version, [m.id for m in before.messages])
    assert not [m for m in await everything(store) if m.role == "summary"]


async def test_runtime_hook_compacts_when_the_application_decides(store: AgentRuntimeStore) -> None:
    for n in ("t1", "t2", "t3"):
        await turn(store, n)
    usages: list[Any] = []

    def should_compact(usage: Any) -> bool:
        usages.append(usage)
        return usage is not None and usage["input_tokens"] / usage["context_window"] >= 0.8

    hook = AgentCompactionHook.parse(
        {"should_compact": should_compact, "summarize": Summarizer(), "keep_recent_turns": 1}
    )
    assert await hook.before_step(store, CID, None) is None
    assert await hook.before_step(store, CID, {"input_tokens": 70, "context_window": 100}) is None
    outcome = await hook.before_step(store, CID, {"input_tokens": 80, "context_window": 100})
    assert outcome is not None and outcome.outcome == "applied"
    assert outcome.replaced_message_ids == ("t1:in", "t1:out", "t2:in", "t2:out")
    with pytest.raises(AgentRuntimeUsageError):
        AgentCompactionHook.parse({"summarize": Summarizer(), "keep_recent_turns": 1, "threshold": 0.8})
    with pytest.raises(AgentRuntimeUsageError):
        AgentCompactionHook.parse({"summarize": Summarizer(), "keep_recent_turns": 1})


# --------------------------------------------------------------------------------------- the runtime


class RuntimeContext(BaseModel):
    user_id: str = "u1"


def last_user_text(messages: list[Any]) -> str:
    for message in reversed(messages):
        if isinstance(message, ModelRequest):
            texts = [p.content for p in message.parts if isinstance(p, UserPromptPart) and isinstance(p.content, str)]
            if texts:
                return " | ".join(texts)
    return ""


async def test_the_runtime_hook_compacts_before_steps_and_waits_for_an_approval_in_flight(tmp_path: Path) -> None:
    """Every step starts with the hook. A turn whose approval is answered by a run that has not settled
    is a barrier (that run reads the signed request from history), and the approved run continues the
    turn that asked, so they are folded together once it settled."""
    effects: list[str] = []
    infos: list[Any] = []
    seen: list[list[Any]] = []

    @define_agent_tool
    async def charge(amount: int) -> str:
        effects.append(f"charged {amount}")
        return f"charged {amount}"

    async def stream(messages: list[Any], info: AgentInfo) -> AsyncIterator[Any]:
        seen.append(messages)
        infos.append(info)
        last = messages[-1]
        returns = [p for p in last.parts if isinstance(p, ToolReturnPart)] if isinstance(last, ModelRequest) else []
        if returns:
            yield f"the tool said: {returns[0].content}"
        elif "charge" in last_user_text(messages):
            yield {0: DeltaToolCall(name="charge", json_args='{"amount": 5}', tool_call_id=f"call-{len(seen)}")}
        else:
            yield f"answer to: {last_user_text(messages)}"

    summaries: list[tuple[list[tuple[str, str]], str | None]] = []

    def summarize(eligible: list[Message], previous: str | None) -> str:
        summaries.append(([(m.role, m.run_id or "") for m in eligible], previous))
        return f"SUMMARY {len(summaries)}"

    model = FunctionModel(stream_function=stream, model_name="scripted")
    registry = define_model_registry(models={"m": {"model": model, "context_window": 100_000}})
    usages: list[Any] = []

    def should_compact(usage: Any) -> bool:
        usages.append(usage)
        return True  # the application's threshold; here: always

    hook = AgentCompactionHook(should_compact=should_compact, summarize=summarize, keep_recent_turns=0)
    async with create_sqlite_agent_runtime_store(filename=tmp_path / "runtime.db") as sqlite:
        runtime = create_agent_runtime(
            protocol=define_agent_protocol(context=RuntimeContext),
            store=sqlite.store,
            models={"preflight": lambda: registry.preflight("m"), "resolve": lambda: registry.resolve("m")},
            tools=[charge],
            loop={"tool_approval": {"charge"}, "tool_approval_secret": "s3cret"},
            history={"compaction": hook},
        )

        async def ask(key: str, words: str) -> Any:
            ticket = runtime.submit(
                conversation_id=CID, idempotency_key=key, context={"user_id": "u1"}, parts=text(words)
            )
            return await ticket.result

        first = await ask("k0", "hello 0")
        assert first.terminal_reason == "success" and summaries == []  # nothing settled yet to compact
        await ask("k1", "hello 1")
        assert [roles for roles, _ in summaries] == [[("user", first.run.id), ("assistant", first.run.id)]]
        assert infos[-1].instructions == "SUMMARY 1" and last_user_text(seen[-1]) == "hello 1"
        assert "hello 0" not in repr(seen[-1])

        paused = await ask("k2", "charge me 5")
        assert paused.terminal_reason == "provider_stop" and effects == []
        assert summaries[-1][1] == "SUMMARY 1"  # merged into the next summary, which replaced it
        request = next(p for p in paused.assistant.parts if p.type == "approval-request")

        ticket = await runtime.respond_to_approval(
            conversation_id=CID, approval_id=request.approval_id, approved=True, context={"user_id": "u1"}
        )
        approved = await ticket.result
        assert approved.terminal_reason == "success" and effects == ["charged 5"]
        assert len(summaries) == 2  # the asking turn was a barrier while its approval ran
        assert last_user_text(seen[-1]) == "charge me 5"

        last = await ask("k3", "hello 3")
        assert last.terminal_reason == "success"
        folded = summaries[-1][0]
        assert [role for role, _ in folded] == ["user", "assistant", "tool", "assistant"]
        assert {run for _, run in folded} == {paused.run.id, approved.run.id}
        assert infos[-1].instructions == "SUMMARY 3" and last_user_text(seen[-1]) == "hello 3"
        snapshot = await sqlite.store.load_snapshot(conversation_id=CID)
        assert [(m.role, m.run_id) for m in snapshot.messages] == [
            ("summary", None),
            ("user", last.run.id),
            ("assistant", last.run.id),
        ]
        assert all(u is not None and u.context_window == 100_000 for u in usages)
        await runtime.close()


async def test_an_approval_answered_behind_another_run_is_not_compacted_away(tmp_path: Path) -> None:
    """The response to an approval queues its run behind a run already executing; that run's later step
    compacts before the approval run has read the signed request. The asking turn must survive it."""
    effects: list[str] = []
    entered = asyncio.Event()
    release = asyncio.Event()

    @define_agent_tool
    async def charge(amount: int) -> str:
        effects.append(f"charged {amount}")
        return f"charged {amount}"

    @define_agent_tool
    async def lookup() -> str:
        return "looked up"

    async def stream(messages: list[Any], info: AgentInfo) -> AsyncIterator[Any]:
        last = messages[-1]
        returns = [p for p in last.parts if isinstance(p, ToolReturnPart)] if isinstance(last, ModelRequest) else []
        if returns:
            yield f"the tool said: {returns[0].content}"
        elif "charge" in last_user_text(messages).split(" | ")[-1]:
            yield {0: DeltaToolCall(name="charge", json_args='{"amount": 5}', tool_call_id="call-charge")}
        else:
            entered.set()
            await release.wait()
            yield {0: DeltaToolCall(name="lookup", json_args="{}", tool_call_id="call-lookup")}

    outcomes: list[Any] = []

    async def compact(request: Any) -> None:
        outcomes.append(await hook(request))

    hook = AgentCompactionHook(
        should_compact=lambda usage: True, summarize=lambda eligible, previous: "SUMMARY", keep_recent_turns=0
    )
    registry = define_model_registry(
        models={"m": {"model": FunctionModel(stream_function=stream, model_name="scripted"), "context_window": 1000}}
    )
    async with create_sqlite_agent_runtime_store(filename=tmp_path / "approval.db") as sqlite:
        runtime = create_agent_runtime(
            protocol=define_agent_protocol(context=RuntimeContext),
            store=sqlite.store,
            models={"preflight": lambda: registry.preflight("m"), "resolve": lambda: registry.resolve("m")},
            tools=[charge, lookup],
            loop={"tool_approval": {"charge"}, "tool_approval_secret": "s3cret"},
            history={"compaction": compact},
        )
        ctx = {"user_id": "u1"}
        paused = await runtime.submit(
            conversation_id=CID, idempotency_key="a", context=ctx, parts=text("charge me 5")
        ).result
        request = next(p for p in paused.assistant.parts if p.type == "approval-request")
        busy = runtime.submit(conversation_id=CID, idempotency_key="b", context=ctx, parts=text("look it up"))
        await asyncio.wait_for(entered.wait(), 10)
        answer = await runtime.respond_to_approval(
            conversation_id=CID, approval_id=request.approval_id, approved=True, context=ctx
        )
        release.set()
        assert (await asyncio.wait_for(busy.result, 10)).terminal_reason == "success"
        approved = await asyncio.wait_for(answer.result, 10)
        assert approved.terminal_reason == "success" and effects == ["charged 5"]
        # the lookup run's second step saw the asking turn's approval answered by a queued run: a barrier
        barriers = [o.barrier.reason for o in outcomes if o is not None and o.outcome == "barrier" and o.barrier]
        assert "unresolved-approval" in barriers
        await runtime.close()


# ----------------------------------------------------------------------------------------- SQLite file


async def test_sqlite_reads_back_the_whole_sequence_with_compacted_ids(tmp_path: Path) -> None:
    db = tmp_path / "threadline.db"
    async with create_sqlite_agent_runtime_store(filename=db, clock=Clock()) as sqlite:
        store = sqlite.store
        await store.seed_conversation_input(
            conversation_id=CID, seed_key="lead", inputs=[{"id": "sys", "role": "system", "parts": text("Be brief.")}]
        )
        for n in ("t1", "t2", "t3"):
            await turn(store, n)
        first = await structured_compaction(store, CID, summarize=Summarizer(), keep_recent_turns=1)
        assert first.replaced_message_ids == ("t1:in", "t1:out", "t2:in", "t2:out")
        s1 = first.summary_id
        page = await sqlite.conversations.messages(CID, include_compacted=True)
        assert [m.id for m in page.items] == ["sys", "t1:in", "t1:out", "t2:in", "t2:out", s1, "t3:in", "t3:out"]
        assert page.compacted == first.replaced_message_ids
        visible = await sqlite.conversations.messages(CID)
        assert [m.id for m in visible.items] == ["sys", s1, "t3:in", "t3:out"] and visible.compacted == ()

    # reopen the file: compaction is durable, and the next one replaces the first summary
    async with create_sqlite_agent_runtime_store(filename=db, clock=Clock()) as sqlite:
        store = sqlite.store
        for n in ("t4", "t5"):
            await turn(store, n)
        summarize = Summarizer()
        second = await structured_compaction(store, CID, summarize=summarize, keep_recent_turns=1)
        assert summarize.calls[0][1] == "summary #1 of 4 messages"
        assert second.replaced_message_ids == (s1, "t3:in", "t3:out", "t4:in", "t4:out")
        s2 = second.summary_id
        page = await sqlite.conversations.messages(CID, include_compacted=True)
        assert [m.id for m in page.items] == [
            "sys",
            "t1:in",
            "t1:out",
            "t2:in",
            "t2:out",
            s1,  # right after the last message it replaced
            "t3:in",
            "t3:out",
            "t4:in",
            "t4:out",
            s2,  # right after the last message it replaced
            "t5:in",
            "t5:out",
        ]
        assert page.compacted == ("t1:in", "t1:out", "t2:in", "t2:out", s1, "t3:in", "t3:out", "t4:in", "t4:out")
        by_id = {m.id: m for m in page.items}
        assert {by_id[i].compacted_by for i in ("t1:in", "t2:out")} == {s1}
        assert {by_id[i].compacted_by for i in (s1, "t3:in", "t4:out")} == {s2}
        snapshot = await store.load_snapshot(conversation_id=CID)
        assert [m.id for m in snapshot.messages] == ["sys", s2, "t5:in", "t5:out"]
        assert project_agent_history_detailed(snapshot.messages).system == ["Be brief.", "summary #1 of 4 messages"]
        # the selection the store applied is the published one
        assert select_compactable_history(snapshot.messages, 1).compactable == ()
