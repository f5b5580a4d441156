"""One contract suite every store driver must pass: ``run_agent_store_conformance(factory)``.

A driver author wraps their store in a factory — a zero-argument callable returning an async context
manager that yields a *fresh, empty* :class:`~threadline.store.aggregate.AgentRuntimeStore` — and calls::

    from contextlib import asynccontextmanager
    from threadline.store.conformance import run_agent_store_conformance

    @asynccontextmanager
    async def factory():
        store = create_my_store(...)
        try:
            yield store
        finally:
            await store.aclose()

    async def test_my_driver_conforms():
        await run_agent_store_conformance(factory)

Every case in :data:`CONFORMANCE_CASES` runs on its own fresh store and drives only the public
``AgentRuntimeStore`` facade, so the suite checks what the driver actually stores and returns, not how.
A case raises :class:`AssertionError` (explicit raises, so ``python -O`` does not disable it) naming the
contract it saw violated; any other exception escaping a case is a failure too.

Cases that need concurrency use one store and :func:`asyncio.gather`: a driver must serialize the
writes of one conversation itself.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta
from typing import Any

from ..errors import (
    AgentConversationPurgedError,
    AgentIdempotencyConflictError,
    AgentRecordNotFoundError,
    AgentRecordValidationError,
    AgentRunOrderConflictError,
    AgentRunOwnershipConflictError,
    AgentRunRevisionConflictError,
    AgentRunStateConflictError,
    AgentStoreConflictError,
)
from ..records import PARTS_ADAPTER, Run, validate_parts
from ..usage import AgentUsage, UsageFigure
from ._conformance_kit import (
    _FIRST_REQUEST,
    _T0,
    CONFORMANCE_CASES as CONFORMANCE_CASES,
    AgentStoreConformanceError as AgentStoreConformanceError,
    C as C,
    ConformanceCase as ConformanceCase,
    ConformanceFailure as ConformanceFailure,
    ConformanceReport as ConformanceReport,
    E as E,
    StoreFactory as StoreFactory,
    _case,
    _Conv,
    _equal,
    _expect,
    _raises,
    _refused,
    _text,
    _texts,
    _writes_nothing,
    run_agent_store_conformance as run_agent_store_conformance,
)
from .aggregate import AgentRuntimeStore, purge_agent_conversation
from .reducer import AbsorbClaim, order_recoverable
from .results import AcceptResult, TerminalResult

__all__ = [
    "CONFORMANCE_CASES",
    "AgentStoreConformanceError",
    "ConformanceCase",
    "ConformanceFailure",
    "ConformanceReport",
    "StoreFactory",
    "run_agent_store_conformance",
]

# ----------------------------------------------------------------------------------------------- cases


@_case("duplicate_admission")
async def case_duplicate_admission(store: AgentRuntimeStore) -> None:
    """Idempotent admission: a repeated key with the same input returns the original receipt and run and
    writes nothing; the same key with different input, or the same input id under another key, is an
    AgentIdempotencyConflictError that writes nothing; a run id is never reused, and neither is an assistant
    message id (a stored message's, or the answer an active run will write)."""
    c = _Conv(store, "conv-dup")
    first = await c.admit("a")
    _equal(first.outcome, "accepted", "first admission outcome")
    _equal(first.coalesced, False, "first admission coalesced")
    _equal(first.run.id, c.run("a"), "admitted run id")
    _equal(first.run.state, "queued", "admitted run state")
    _equal(first.run.input_message_ids, (c.inp("a"),), "admitted run inputs")
    _equal(first.receipt.run_id, c.run("a"), "receipt run id")
    _equal(first.receipt.assistant_message_id, c.out("a"), "receipt assistant id")
    _equal(first.receipt.input.id, c.inp("a"), "receipt input id")
    _equal(first.receipt.idempotency_key, c.key("a"), "receipt key")
    _equal(first.version, await c.version(), "admission version is the stored version")

    again = await _writes_nothing(
        store, c.cid, "duplicate admission", c.admit, "a", run_id=c.run("other"), assistant_message_id=c.out("other")
    )
    _equal(again.outcome, "duplicate", "repeated key, same input")
    _equal(again.receipt, first.receipt, "duplicate returns the original receipt")
    _equal(again.run.id, c.run("a"), "duplicate names the original run")
    _equal(again.answer, None, "a duplicate of an unfinished run has no answer yet")
    _equal(again.answered_by_run_id, None, "a duplicate of an unfinished run is answered by nobody yet")
    _equal(await store.load_run(conversation_id=c.cid, run_id=c.run("other")), None, "no new run for a duplicate")
    _equal(await c.active(), [c.run("a")], "active runs after a duplicate")

    await _refused(
        store, c.cid, AgentIdempotencyConflictError, "same key, different input", c.admit, "a", text="something else"
    )
    await _refused(
        store,
        c.cid,
        AgentIdempotencyConflictError,
        "same input id under another key",
        store.accept_input_and_assign_run,
        conversation_id=c.cid,
        idempotency_key=c.key("b"),
        input=c.draft("a"),
    )
    await _refused(
        store,
        c.cid,
        AgentIdempotencyConflictError,
        "a new input reusing an existing run id",
        c.admit,
        "b",
        run_id=c.run("a"),
    )
    for what, taken in (
        ("the answer a queued run will write", c.out("a")),
        ("a stored input's id", c.inp("a")),
        ("its own input's id", c.inp("b")),
    ):
        await _refused(
            store,
            c.cid,
            AgentIdempotencyConflictError,
            f"a new input whose assistant message id is {what}",
            c.admit,
            "b",
            assistant_message_id=taken,
        )
    await _refused(
        store,
        c.cid,
        AgentRecordValidationError,
        "an admitted input with role 'assistant'",
        store.accept_input_and_assign_run,
        conversation_id=c.cid,
        idempotency_key=c.key("c"),
        input={"id": c.inp("c"), "role": "assistant", "parts": _text("x")},
    )

    run = await c.acquire(first.run)
    done = await c.finish(run, text="the answer")
    after = await _writes_nothing(store, c.cid, "duplicate after the terminal", c.admit, "a")
    _equal(after.outcome, "duplicate", "repeated key after the terminal")
    _equal(after.run, done.run, "duplicate after the terminal returns the terminal run")
    _equal(after.answer, done.assistant, "duplicate after the terminal carries the answer")
    _equal(after.answered_by_run_id, c.run("a"), "answered_by_run_id")
    await _refused(
        store,
        c.cid,
        AgentIdempotencyConflictError,
        "a new input whose assistant message id is a settled answer's",
        c.admit,
        "b",
        assistant_message_id=c.out("a"),
    )


@_case("drawn_ids")
async def case_drawn_ids(store: AgentRuntimeStore) -> None:
    """Ids left out are drawn by the store: an input without ``id``, an omitted run id and assistant
    message id each get a fresh random one; a repeat of the key (also without ids) is a duplicate of the
    first admission; every drawn id is new."""
    cid = "conv-drawn"

    async def admit(key: str, text: str) -> AcceptResult:
        return await store.accept_input_and_assign_run(
            conversation_id=cid, idempotency_key=key, input={"parts": _text(text)}
        )

    first = await admit("a", "first")
    _equal(first.outcome, "accepted", "admission without ids")
    ids = (first.receipt.input.id, first.run.id, first.receipt.assistant_message_id)
    _expect(ids[0].startswith("msg_") and ids[1].startswith("run_") and ids[2].startswith("msg_"), f"drawn ids {ids}")
    snapshot = await store.load_snapshot(conversation_id=cid)
    _equal([m.id for m in snapshot.messages], [ids[0]], "the input is stored under its drawn id")
    again = await _writes_nothing(store, cid, "repeat without ids", admit, "a", "first")
    _equal((again.outcome, again.receipt), ("duplicate", first.receipt), "a repeated key is a duplicate")
    second = await admit("b", "second")
    drawn = {*ids, second.receipt.input.id, second.run.id, second.receipt.assistant_message_id}
    _equal(len(drawn), 6, "every drawn id is new")
    _equal(await _active_ids(store, cid), [first.run.id, second.run.id], "both runs are queued in order")


async def _active_ids(store: AgentRuntimeStore, cid: str) -> list[str]:
    return [r.id for r in (await store.list_active_runs(conversation_id=cid)).runs]


@_case("coalesced_admission")
async def case_coalesced_admission(store: AgentRuntimeStore) -> None:
    """Coalescing: while a run is running, coalescing inputs land in ONE queued ordinary successor, in
    admission order, each receipt naming it; the running run is never mutated; urgent inputs never
    coalesce (neither into the ordinary successor nor with each other)."""
    c = _Conv(store, "conv-coalesce")
    a = await c.acquire((await c.admit("a")).run)

    b1 = await c.admit("b1", coalesce=True)
    _equal((b1.outcome, b1.coalesced), ("accepted", False), "first coalescing input opens the successor")
    successor = b1.run
    revisions = [successor.revision]
    for n in ("b2", "b3"):
        res = await c.admit(n, coalesce=True)
        _equal((res.outcome, res.coalesced), ("accepted", True), f"{n} coalesces")
        _equal(res.run.id, successor.id, f"{n} joins the successor")
        _equal(res.receipt.run_id, successor.id, f"{n} receipt names the successor")
        _equal(res.receipt.assistant_message_id, successor.assistant_message_id, f"{n} receipt assistant id")
        _equal(res.receipt.input.run_id, successor.id, f"{n} input message belongs to the successor")
        _expect(res.run.revision > revisions[-1], f"{n}: coalescing must advance the successor's revision")
        revisions.append(res.run.revision)
        _equal(await store.load_run(conversation_id=c.cid, run_id=c.run(n)), None, f"{n} created no run of its own")
    loaded = await c.load(successor.id)
    _equal(loaded.input_message_ids, (c.inp("b1"), c.inp("b2"), c.inp("b3")), "successor inputs in order")
    _equal(loaded.state, "queued", "successor state")
    _equal(await c.load(a.id), a, "the running run is never mutated by coalescing")

    u1 = await c.admit("u1", priority="urgent", coalesce=True)
    u2 = await c.admit("u2", priority="urgent", coalesce=True)
    for res, n in ((u1, "u1"), (u2, "u2")):
        _equal(res.coalesced, False, f"urgent {n} never coalesces")
        _equal(res.run.id, c.run(n), f"urgent {n} gets its own run")
        _equal(res.run.priority, "urgent", f"urgent {n} priority")
        _equal(res.run.input_message_ids, (c.inp(n),), f"urgent {n} inputs")
    _equal((await c.load(successor.id)).input_message_ids, loaded.input_message_ids, "urgent inputs left B alone")

    b4 = await c.admit("b4", coalesce=True)
    _equal((b4.coalesced, b4.run.id), (True, successor.id), "an ordinary input after urgent ones still coalesces")
    dup = await c.admit("b2", coalesce=True)
    _equal((dup.outcome, dup.run.id), ("duplicate", successor.id), "a coalesced input's duplicate names the successor")
    plain = await c.admit("p")
    _equal((plain.coalesced, plain.run.id), (False, c.run("p")), "coalesce=False always opens a run")

    _equal(await c.active(), [a.id, u1.run.id, u2.run.id, successor.id, c.run("p")], "execution order")
    _equal(
        await c.order(),
        ["a:in", "u1:in", "u2:in", "b1:in", "b2:in", "b3:in", "b4:in", "p:in"],
        "snapshot order of the coalesced inputs",
    )
    _equal(await c.load(a.id), a, "the running run is never mutated by admissions")


@_case("stale_checkpoint")
async def case_stale_checkpoint(store: AgentRuntimeStore) -> None:
    """Fencing: a write with a stale revision is AgentRunRevisionConflictError; after a requeue and a
    re-acquire by another owner, every write of the old owner (stale fencing token) is
    AgentRunOwnershipConflictError — checkpoint, operation record, lease and terminal — and nothing is
    written."""
    c = _Conv(store, "conv-fence")
    run_a = await c.acquire((await c.admit("a")).run, owner="owner-a")
    _equal((run_a.state, run_a.owner_id), ("running", "owner-a"), "acquired run")
    _expect(run_a.fencing_token >= 1, f"an acquired run has a fencing token >= 1, got {run_a.fencing_token}")
    fresh = await c.checkpoint(run_a, "one")
    _equal(fresh.revision, run_a.revision + 1, "a checkpoint increments the revision")

    err = await _refused(
        store,
        c.cid,
        AgentRunRevisionConflictError,
        "checkpoint with a stale revision",
        c.checkpoint,
        run_a,
        "stale",
    )
    _equal(err.actual_revision, fresh.revision, "conflict reports the actual revision")
    await _refused(store, c.cid, AgentRunRevisionConflictError, "terminal with a stale revision", c.finish, run_a)

    queued = await c.requeue(fresh)
    _equal((queued.state, queued.owner_id), ("queued", None), "requeued run")
    await _refused(
        store,
        c.cid,
        AgentRunStateConflictError,
        "old owner's checkpoint on the requeued (queued) run",
        store.checkpoint_run_assistant,
        conversation_id=c.cid,
        run_id=queued.id,
        expected_revision=queued.revision,
        owner_id="owner-a",
        fencing_token=run_a.fencing_token,
        parts=_text("late"),
    )
    run_b = await c.acquire(queued, owner="owner-b")
    _expect(
        run_b.fencing_token > run_a.fencing_token,
        f"re-acquire must raise the fencing token: {run_a.fencing_token} -> {run_b.fencing_token}",
    )
    owned = {"conversation_id": c.cid, "run_id": run_b.id, "expected_revision": run_b.revision}
    for owner, token, what in (
        ("owner-a", run_a.fencing_token, "old owner and token"),
        ("owner-b", run_a.fencing_token, "new owner with the old token"),
        ("owner-a", run_b.fencing_token, "old owner with the new token"),
    ):
        await _refused(
            store,
            c.cid,
            AgentRunOwnershipConflictError,
            f"checkpoint by {what}",
            store.checkpoint_run_assistant,
            **owned,
            owner_id=owner,
            fencing_token=token,
            parts=_text("zombie"),
        )
    stale = {**owned, "owner_id": "owner-a", "fencing_token": run_a.fencing_token}
    await _refused(
        store,
        c.cid,
        AgentRunOwnershipConflictError,
        "operation record by the old owner",
        store.record_run_operation,
        **stale,
        operation={"kind": "model-request", "phase": "started", "operation_id": "op-z", "started_at": _T0},
    )
    await _refused(
        store,
        c.cid,
        AgentRunOwnershipConflictError,
        "lease renewal by the old owner",
        store.renew_run_lease,
        **stale,
        lease_expires_at=_T0,
    )
    await _refused(
        store,
        c.cid,
        AgentRunOwnershipConflictError,
        "terminal by the old owner",
        store.commit_run_terminal,
        **stale,
        terminal_reason="success",
        parts=_text("zombie answer"),
    )
    run_b = await c.checkpoint(run_b, "b's draft")
    done = await c.finish(run_b, text="b's answer")
    _equal((done.outcome, done.run.owner_id), ("committed", "owner-b"), "the current owner commits")
    _equal(_texts(done.assistant), "b's answer", "the current owner's answer")


@_case("terminal_race")
async def case_terminal_race(store: AgentRuntimeStore) -> None:
    """Exactly one terminal: two concurrent terminal commits of one run (same owner, token, revision)
    give exactly one ``committed``; the other is ``already_terminal`` and carries the winner's run and
    assistant. Later terminal calls stay ``already_terminal`` and write nothing."""
    c = _Conv(store, "conv-race")
    run = await c.checkpoint(await c.acquire((await c.admit("a")).run), "draft")
    results = await asyncio.gather(
        c.finish(run, "success", text="success answer"),
        c.finish(run, "interrupted", text="interrupted answer"),
        return_exceptions=True,
    )
    for r in results:
        if isinstance(r, BaseException):
            raise AssertionError(f"a racing terminal raised {type(r).__name__}: {r}") from r
    outcomes = sorted(r.outcome for r in results)  # type: ignore[union-attr]
    _equal(outcomes, ["already_terminal", "committed"], "outcomes of two racing terminals")
    winner = next(r for r in results if r.outcome == "committed")  # type: ignore[union-attr]
    loser = next(r for r in results if r.outcome == "already_terminal")  # type: ignore[union-attr]
    assert isinstance(winner, TerminalResult) and isinstance(loser, TerminalResult)
    _equal(loser.run, winner.run, "the loser sees the winner's run")
    _equal(loser.assistant, winner.assistant, "the loser sees the winner's assistant")
    expected_state = "completed" if winner.run.terminal_reason == "success" else "interrupted"
    _equal(winner.run.state, expected_state, "the winner's state matches its reason")
    loaded = await store.load_run(conversation_id=c.cid, run_id=run.id)
    assert loaded is not None
    _equal(loaded.run, winner.run, "the stored run is the winner's")
    _equal(loaded.assistant, winner.assistant, "the stored assistant is the winner's")
    late = await _writes_nothing(store, c.cid, "a late terminal", c.finish, run, "provider_failure", text="late")
    _equal((late.outcome, late.run), ("already_terminal", winner.run), "a late terminal")
    snap = await c.snapshot()
    _equal([c.short(m.id) for m in snap.messages], ["a:in", "a:out"], "one input and one answer")
    _expect(all(m.position is not None for m in snap.messages), "a terminal run's messages are settled")


@_case("interrupt_then_terminal")
async def case_interrupt_then_terminal(store: AgentRuntimeStore) -> None:
    """Durable interrupt: request_run_interrupt moves a running run to ``interrupt_requested`` with
    revision+1 (so the executor's next CAS with the old revision conflicts); the executor commits
    ``interrupted`` with the fresh revision; a queued run reports ``queued`` and a terminal one
    ``terminal``, both writing nothing."""
    c = _Conv(store, "conv-interrupt")
    run = await c.checkpoint(await c.acquire((await c.admit("a")).run), "partial")
    queued = (await c.admit("b")).run

    res = await _writes_nothing(
        store, c.cid, "interrupt of a queued run", store.request_run_interrupt, conversation_id=c.cid, run_id=queued.id
    )
    _equal((res.outcome, res.run), ("queued", queued), "interrupt of a queued run")

    version = await c.version()
    res = await store.request_run_interrupt(conversation_id=c.cid, run_id=run.id, expected_revision=run.revision)
    _equal(res.outcome, "requested", "interrupt of a running run")
    _equal(res.run.state, "interrupt_requested", "interrupted run state")
    _equal(res.run.revision, run.revision + 1, "an interrupt request increments the revision")
    _equal(res.version, version + 1, "an interrupt request advances the conversation version")
    _equal(res.run.owner_id, run.owner_id, "the owner keeps the run until it commits")
    requested = res.run
    res = await _writes_nothing(
        store, c.cid, "a second interrupt", store.request_run_interrupt, conversation_id=c.cid, run_id=run.id
    )
    _equal(res.outcome, "already_requested", "a second interrupt")
    await _refused(
        store,
        c.cid,
        AgentRunRevisionConflictError,
        "interrupt with a stale expected revision",
        store.request_run_interrupt,
        conversation_id=c.cid,
        run_id=run.id,
        expected_revision=run.revision,
    )
    await _refused(
        store, c.cid, AgentRunRevisionConflictError, "checkpoint after the interrupt", c.checkpoint, run, "x"
    )
    await _refused(
        store, c.cid, AgentRunRevisionConflictError, "terminal with the pre-interrupt revision", c.finish, run
    )

    done = await c.finish(requested, "interrupted")
    _equal(done.outcome, "committed", "terminal with the fresh revision")
    _equal((done.run.state, done.run.terminal_reason), ("interrupted", "interrupted"), "interrupted run")
    assert done.assistant is not None
    _equal(done.assistant.status, "interrupted", "interrupted assistant status")
    _equal(_texts(done.assistant), "partial", "parts=None keeps the last checkpointed draft")
    res = await _writes_nothing(
        store, c.cid, "interrupt of a terminal run", store.request_run_interrupt, conversation_id=c.cid, run_id=run.id
    )
    _equal((res.outcome, res.run), ("terminal", done.run), "interrupt of a terminal run")
    _equal(await c.active(), [queued.id], "the queued run is next")


@_case("compaction_conflict")
async def case_compaction_conflict(store: AgentRuntimeStore) -> None:
    """Compaction is a CAS on the conversation version: a moved version is a ``conflict`` outcome with the
    actual version and writes nothing; at the current version one contiguous range of active settled
    history becomes one summary at its place. Non-contiguous ranges, unsettled (active-run), already
    compacted and lead messages are refused with AgentRecordValidationError; a reused summary id is an
    idempotency conflict; unknown ids are not found."""
    c = _Conv(store, "conv-compact")
    for n in ("t1", "t2", "t3"):
        await c.turn(n)
    v = (await c.snapshot()).version
    replaced = ["t1:in", "t1:out", "t2:in", "t2:out"]
    summary = {"id": c.mid("s1"), "role": "summary", "parts": _text("summary of t1 and t2")}
    queued = (await c.admit("t4")).run
    moved = await c.version()
    _expect(moved > v, "an admission advances the conversation version")

    res = await _writes_nothing(
        store,
        c.cid,
        "compaction at a stale version",
        store.replace_compacted_range,
        conversation_id=c.cid,
        expected_version=v,
        replaced_message_ids=[c.mid(n) for n in replaced],
        summary=summary,
    )
    _equal((res.outcome, res.version, res.summary), ("conflict", moved, None), "stale compaction")

    compact = {"conversation_id": c.cid, "expected_version": moved, "summary": summary}
    refusals: list[tuple[list[str], str]] = [
        (["t1:in", "t2:in"], "a non-contiguous range"),
        (["t1:in", "t1:out", "t3:in"], "a range with a hole"),
        (["t4:in"], "an input of a queued run"),
        (["t3:out", "t4:in"], "settled history plus an unsettled input"),
    ]
    for names, what in refusals:
        err = await _refused(
            store,
            c.cid,
            AgentRecordValidationError,
            f"compaction of {what}",
            store.replace_compacted_range,
            **compact,
            replaced_message_ids=[c.mid(n) for n in names],
        )
        _equal(err.field, "replaced_message_ids", f"compaction of {what}: error field")
    await _refused(
        store,
        c.cid,
        AgentRecordNotFoundError,
        "compaction of an unknown message",
        store.replace_compacted_range,
        **compact,
        replaced_message_ids=[c.mid("t1:in"), c.mid("nope")],
    )
    await _refused(
        store,
        c.cid,
        AgentRecordValidationError,
        "a replacement whose role is not 'summary'",
        store.replace_compacted_range,
        **{**compact, "summary": {**summary, "role": "user"}},
        replaced_message_ids=[c.mid("t1:in")],
    )

    res = await store.replace_compacted_range(**compact, replaced_message_ids=[c.mid(n) for n in replaced])
    _equal(res.outcome, "applied", "compaction at the current version")
    _equal(res.version, moved + 1, "compaction advances the version by one")
    _equal(res.replaced_message_ids, tuple(c.mid(n) for n in replaced), "replaced ids")
    assert res.summary is not None
    _equal((res.summary.id, res.summary.role), (c.mid("s1"), "summary"), "the summary record")
    snap = await c.snapshot()
    _equal([c.short(m.id) for m in snap.messages], ["s1", "t3:in", "t3:out", "t4:in"], "snapshot after compaction")
    _equal(snap.messages[0].role, "summary", "the summary comes first")

    page = await store.conversations.messages(c.cid, limit=100, include_compacted=True)
    _equal(
        [c.short(m.id) for m in page.items],
        [*replaced, "s1", "t3:in", "t3:out", "t4:in"],
        "history with compacted messages",
    )
    _equal(sorted(c.short(i) for i in page.compacted), sorted(replaced), "compacted ids")
    for m in page.items:
        if c.short(m.id) in replaced:
            _equal((m.active, m.compacted_by), (False, c.mid("s1")), f"{m.id} is replaced by the summary")

    now = await c.version()
    compact = {"conversation_id": c.cid, "expected_version": now}
    await _refused(
        store,
        c.cid,
        AgentRecordValidationError,
        "compaction of already compacted messages",
        store.replace_compacted_range,
        **compact,
        replaced_message_ids=[c.mid("t1:in")],
        summary={"id": c.mid("s2"), "role": "summary", "parts": _text("again")},
    )
    await _refused(
        store,
        c.cid,
        AgentIdempotencyConflictError,
        "a summary id that already exists",
        store.replace_compacted_range,
        **compact,
        replaced_message_ids=[c.mid("t3:in")],
        summary=summary,
    )
    run = await c.checkpoint(await c.acquire(queued), "draft")
    await _refused(
        store,
        c.cid,
        AgentRecordValidationError,
        "compaction of an active run's draft",
        store.replace_compacted_range,
        conversation_id=c.cid,
        expected_version=await c.version(),
        replaced_message_ids=[c.mid("t4:out")],
        summary={"id": c.mid("s2"), "role": "summary", "parts": _text("draft")},
    )
    await c.finish(run)
    res = await c.compact(["s1", "t3:in", "t3:out"], "s3")
    _equal(res.outcome, "applied", "a summary can itself be compacted")
    _equal(await c.order(), ["s3", "t4:in", "t4:out"], "snapshot after the second compaction")


@_case("idempotent_retry_after_compaction")
async def case_idempotent_retry_after_compaction(store: AgentRuntimeStore) -> None:
    """Receipts outlive compaction: a retry of a key whose turn was compacted is still ``duplicate`` with
    the original run and its (now inactive) answer; reusing the key or input id differently still
    conflicts."""
    c = _Conv(store, "conv-retry")
    first = await c.turn("t1")
    await c.turn("t2")
    res = await c.compact(["t1:in", "t1:out"], "s1")
    _equal(res.outcome, "applied", "compaction of turn t1")
    _equal(await c.order(), ["s1", "t2:in", "t2:out"], "snapshot after compaction")

    dup = await _writes_nothing(store, c.cid, "retry of a compacted turn", c.admit, "t1")
    _equal(dup.outcome, "duplicate", "retry of a compacted turn")
    _equal(dup.run, first.run, "the original run")
    _equal(dup.receipt.run_id, c.run("t1"), "the original receipt")
    assert dup.answer is not None, "a retry of a compacted turn still returns its answer"
    _equal(dup.answer.id, c.out("t1"), "the original answer")
    _equal(_texts(dup.answer), "answer t1", "the original answer's text")
    _equal((dup.answer.active, dup.answer.compacted_by), (False, c.mid("s1")), "the answer is compacted")
    _equal(dup.answered_by_run_id, c.run("t1"), "answered_by_run_id")
    loaded = await store.load_run(conversation_id=c.cid, run_id=c.run("t1"))
    assert loaded is not None and loaded.assistant is not None
    _equal(loaded.assistant.id, c.out("t1"), "load_run returns the compacted answer")
    await _refused(
        store, c.cid, AgentIdempotencyConflictError, "compacted key, different input", c.admit, "t1", text="x"
    )
    await _refused(
        store,
        c.cid,
        AgentIdempotencyConflictError,
        "compacted input id under a new key",
        store.accept_input_and_assign_run,
        conversation_id=c.cid,
        idempotency_key=c.key("new"),
        input=c.draft("t1"),
    )


@_case("absorption")
async def case_absorption(store: AgentRuntimeStore) -> None:
    """Absorption: a completed terminal with a valid claim supersedes the claimed queued run
    (``absorbed``, ``absorbed_into_run_id``), settles its inputs between the absorber's inputs and answer,
    and a retry of its key is answered by the absorber. A claim on a run that moved is cancelled and the
    run stays queued; a non-completed terminal never absorbs."""
    c = _Conv(store, "conv-absorb")
    a = await c.checkpoint(await c.acquire((await c.admit("a")).run), "draft")
    b = (await c.admit("b", coalesce=True)).run
    claim = AbsorbClaim(run_id=b.id, expected_revision=b.revision, input_message_ids=(c.inp("b"),))
    res = await c.finish(a, text="answer for a and b", absorb=[claim])
    _equal(res.outcome, "committed", "absorbing terminal")
    _equal(res.run.absorbed_run_ids, (b.id,), "absorbed_run_ids")
    _equal(res.run.input_message_ids, (c.inp("a"), c.inp("b")), "the absorber lists the inputs it answered")
    _equal(res.absorption_cancelled, (), "no claim cancelled")
    _equal([r.id for r in res.absorbed_runs], [b.id], "absorbed runs")
    absorbed = await c.load(b.id)
    _equal(
        (absorbed.state, absorbed.terminal_reason, absorbed.absorbed_into_run_id),
        ("superseded", "absorbed", a.id),
        "the absorbed run",
    )
    _equal(res.absorbed_runs[0], absorbed, "the returned absorbed run is the stored one")
    loaded_b = await store.load_run(conversation_id=c.cid, run_id=b.id)
    assert loaded_b is not None
    _equal(loaded_b.assistant, res.assistant, "load_run of the absorbed run returns the absorber's answer")
    dup = await _writes_nothing(store, c.cid, "retry of the absorbed input", c.admit, "b", coalesce=True)
    _equal((dup.outcome, dup.run.id), ("duplicate", b.id), "retry of the absorbed input")
    _equal(dup.answer, res.assistant, "the absorbed input is answered by the absorber's assistant")
    _equal(dup.answered_by_run_id, a.id, "answered_by_run_id names the absorber")
    _equal(await c.active(), [], "nothing active after absorption")
    snap = await c.snapshot()
    _equal([c.short(m.id) for m in snap.messages], ["a:in", "b:in", "a:out"], "absorbed input sits before the answer")
    _expect(all(m.position is not None for m in snap.messages), "absorbed inputs are settled")

    # A claim taken before another input coalesced into the run is cancelled.
    c2 = _Conv(store, "conv-absorb-moved")
    a2 = await c2.acquire((await c2.admit("a")).run)
    b2 = (await c2.admit("b1", coalesce=True)).run
    claim2 = AbsorbClaim(run_id=b2.id, expected_revision=b2.revision, input_message_ids=(c2.inp("b1"),))
    joined = await c2.admit("b2", coalesce=True)
    _equal((joined.coalesced, joined.run.id), (True, b2.id), "b2 coalesces into the claimed run")
    res2 = await c2.finish(a2, text="answer a", absorb=[claim2])
    _equal(res2.outcome, "committed", "terminal with a stale claim")
    _equal(res2.absorption_cancelled, (b2.id,), "the stale claim is cancelled")
    _equal((res2.absorbed_runs, res2.run.absorbed_run_ids), ((), ()), "nothing absorbed")
    kept = await c2.load(b2.id)
    _equal((kept.state, kept.input_message_ids), ("queued", (c2.inp("b1"), c2.inp("b2"))), "the claimed run stays")
    _equal(await c2.order(), ["a:in", "a:out", "b1:in", "b2:in"], "the cancelled claim's inputs stay queued")
    again = await c2.admit("b1", coalesce=True)
    _equal((again.answer, again.answered_by_run_id), (None, None), "a cancelled claim answers nothing")

    # A claim whose inputs differ from the run's is cancelled.
    c3 = _Conv(store, "conv-absorb-inputs")
    a3 = await c3.acquire((await c3.admit("a")).run)
    b3 = (await c3.admit("b")).run
    res3 = await c3.finish(
        a3, absorb=[AbsorbClaim(run_id=b3.id, expected_revision=b3.revision, input_message_ids=(c3.inp("zzz"),))]
    )
    _equal(res3.absorption_cancelled, (b3.id,), "a claim with other inputs is cancelled")
    _equal((await c3.load(b3.id)).state, "queued", "its run stays queued")

    # An interrupted terminal never absorbs, even with a valid claim.
    c4 = _Conv(store, "conv-absorb-interrupted")
    a4 = await c4.acquire((await c4.admit("a")).run)
    b4 = (await c4.admit("b")).run
    res4 = await c4.finish(
        a4,
        "interrupted",
        absorb=[AbsorbClaim(run_id=b4.id, expected_revision=b4.revision, input_message_ids=(c4.inp("b"),))],
    )
    _equal(res4.outcome, "committed", "interrupted terminal")
    _equal(res4.absorption_cancelled, (b4.id,), "an interrupted terminal cancels its claims")
    _equal((res4.absorbed_runs, res4.run.absorbed_run_ids), ((), ()), "an interrupted terminal absorbs nothing")
    _equal((await c4.load(b4.id)).state, "queued", "the claimed run stays queued")
    _equal(await c4.order(), ["a:in", "a:out", "b:in"], "b's input stays after the interrupted turn")


@_case("absorb_claims_deduplicated")
async def case_absorb_claims_deduplicated(store: AgentRuntimeStore) -> None:
    """A run named twice in ``absorb`` is absorbed at most once: either the terminal is refused with
    AgentRecordValidationError (nothing written) or it records the run once in ``absorbed_run_ids``,
    returns it once in ``absorbed_runs`` and settles its input once."""
    c = _Conv(store, "conv-absorb-twice")
    a = await c.acquire((await c.admit("a")).run)
    b = (await c.admit("b")).run
    claim = AbsorbClaim(run_id=b.id, expected_revision=b.revision, input_message_ids=(c.inp("b"),))
    before = await c.snapshot()
    try:
        res = await c.finish(a, text="answer", absorb=[claim, claim])
    except AgentRecordValidationError:
        _equal(await c.snapshot(), before, "a refused duplicate claim writes nothing")
        return
    _equal(res.run.absorbed_run_ids, (b.id,), "absorbed_run_ids names the run once")
    _equal([r.id for r in res.absorbed_runs], [b.id], "absorbed_runs holds the run once")
    snap = await c.snapshot()
    _equal([c.short(m.id) for m in snap.messages], ["a:in", "b:in", "a:out"], "snapshot order")
    positions = [m.position for m in snap.messages]
    _equal(positions, sorted({p for p in positions if p is not None}), "each message settled once, no gap")
    _equal(positions, list(range(positions[0] or 0, (positions[0] or 0) + 3)), "consecutive settled positions")


@_case("recovery_execution_order")
async def case_recovery_execution_order(store: AgentRuntimeStore) -> None:
    """Recovery order: pages of scan_recoverable (any page size) cover every active run exactly once, and
    order_recoverable restores each conversation's execution order — requeued started work first, then
    urgent runs FIFO, then ordinary runs FIFO — never by id. acquire_run of anything but the head of that
    order is AgentRunOrderConflictError; acquiring in that order succeeds."""
    convs = [_Conv(store, "conv-order-b"), _Conv(store, "conv-order-a")]
    plan = [("o1", "ordinary"), ("o2", "ordinary"), ("u1", "urgent"), ("o3", "ordinary"), ("u2", "urgent")]
    # Run ids sort in REVERSE order of admission, and conversations are admitted interleaved.
    run_ids = {c.cid: {n: f"{c.cid}:run-{9 - i}" for i, (n, _) in enumerate(plan)} for c in convs}
    runs: dict[tuple[str, str], Run] = {}
    for i, (n, priority) in enumerate(plan):
        for c in convs:
            res = await c.admit(n, priority=priority, run_id=run_ids[c.cid][n])
            runs[c.cid, n] = res.run
        if i == 0:
            for c in convs:
                started = await c.checkpoint(await c.acquire(runs[c.cid, "o1"]), "partial")
                runs[c.cid, "o1"] = started
    for c in convs:
        runs[c.cid, "o1"] = await c.requeue(runs[c.cid, "o1"])
    done = _Conv(store, "conv-order-done")
    await done.turn("t1")

    expected_names = ["o1", "u1", "u2", "o2", "o3"]
    expected = {c.cid: [run_ids[c.cid][n] for n in expected_names] for c in convs}
    for c in convs:
        _equal(await c.active(), expected[c.cid], f"list_active_runs order of {c.cid}")

    all_ids = sorted(rid for ids in expected.values() for rid in ids)
    for limit in (1, 2, 3, 1000):
        seen: list[Run] = []
        cursor: str | None = None
        for _ in range(len(all_ids) + 2):
            page = await store.scan_recoverable(cursor=cursor, limit=limit)
            _expect(len(page.runs) <= limit, f"scan_recoverable(limit={limit}) returned {len(page.runs)} runs")
            seen.extend(page.runs)
            cursor = page.next_cursor
            if cursor is None:
                break
        else:
            raise AssertionError(f"scan_recoverable(limit={limit}) did not finish paging")
        ids = [r.id for r in seen]
        _equal(sorted(ids), all_ids, f"scan_recoverable(limit={limit}) covers each active run exactly once")
        ordered = order_recoverable(seen)
        _equal(
            [[r.id for r in group] for group in ordered],
            [expected[cid] for cid in sorted(expected)],
            f"order_recoverable of the limit={limit} scan",
        )

    for c in convs:
        current = {r.id: r for r in (await store.list_active_runs(conversation_id=c.cid)).runs}
        for position, rid in enumerate(expected[c.cid]):
            for later in expected[c.cid][position + 1 :]:
                await _refused(
                    store,
                    c.cid,
                    AgentRunOrderConflictError,
                    f"acquire {later} before {rid}",
                    store.acquire_run,
                    conversation_id=c.cid,
                    run_id=later,
                    expected_revision=current[later].revision,
                    owner_id="owner-x",
                )
            acquired = await c.acquire(current[rid], owner="owner-x")
            if position + 1 < len(expected[c.cid]):
                nxt = expected[c.cid][position + 1]
                await _refused(
                    store,
                    c.cid,
                    AgentRunOrderConflictError,
                    f"acquire {nxt} while {rid} runs",
                    store.acquire_run,
                    conversation_id=c.cid,
                    run_id=nxt,
                    expected_revision=current[nxt].revision,
                    owner_id="owner-x",
                )
            result = await c.finish(acquired, text=f"answer {rid}")
            _equal(result.outcome, "committed", f"terminal of {rid}")
        _equal(await c.active(), [], f"{c.cid} drained")
    page = await store.scan_recoverable(limit=10)
    _equal(page.runs, (), "nothing recoverable after every run finished")


@_case("purge")
async def case_purge(store: AgentRuntimeStore) -> None:
    """Purge: refused (``active``, naming the runs) while a run is active; ``conflict`` with the actual
    version for a stale expected_version; ``purged`` after the terminal and ``already_purged`` after that.
    An unknown id is tombstoned. After a purge every mutation raises AgentConversationPurgedError and
    every read is empty; other conversations are untouched. A store without purge is ``unsupported``."""
    c = _Conv(store, "conv-purge")
    other = _Conv(store, "conv-purge-other")
    await other.turn("t1")
    other_queued = (await other.admit("q")).run
    queued = (await c.admit("a")).run

    res = await _writes_nothing(
        store, c.cid, "purge with a queued run", store.purge_conversation, conversation_id=c.cid
    )
    _equal((res.outcome, res.run_ids), ("active", (queued.id,)), "purge with a queued run")
    run = await c.checkpoint(await c.acquire(queued), "draft")
    res = await store.purge_conversation(conversation_id=c.cid)
    _equal((res.outcome, res.run_ids), ("active", (run.id,)), "purge with a running run")
    done = await c.finish(run)
    version = await c.version()
    res = await _writes_nothing(
        store,
        c.cid,
        "purge at a stale version",
        store.purge_conversation,
        conversation_id=c.cid,
        expected_version=version - 1,
    )
    _equal((res.outcome, res.actual_version), ("conflict", version), "purge at a stale version")

    res = await purge_agent_conversation(store, conversation_id=c.cid, expected_version=version)
    _equal(res.outcome, "purged", "purge after the terminal")
    _equal((await store.purge_conversation(conversation_id=c.cid)).outcome, "already_purged", "a repeated purge")
    _equal((await purge_agent_conversation(store, conversation_id=c.cid)).outcome, "already_purged", "purge via helper")

    ghost = _Conv(store, "conv-purge-never-existed")
    _equal((await store.purge_conversation(conversation_id=ghost.cid)).outcome, "purged", "purge of an unknown id")
    await _raises(AgentConversationPurgedError, "admission into a tombstoned id", ghost.admit, "a")
    await _raises(
        AgentConversationPurgedError,
        "seed into a tombstoned id",
        store.seed_conversation_input,
        conversation_id=ghost.cid,
        seed_key="s",
        inputs=[{"id": ghost.mid("s"), "role": "user", "parts": _text("s")}],
    )

    for cv in (c, ghost):
        owned = {
            "conversation_id": cv.cid,
            "run_id": done.run.id,
            "expected_revision": done.run.revision,
            "owner_id": "owner-a",
            "fencing_token": done.run.fencing_token,
        }
        mutations: list[tuple[str, Callable[..., Awaitable[Any]], dict[str, Any]]] = [
            ("accept", cv.admit, {"n": "b"}),
            ("accept of the old key", cv.admit, {"n": "a"}),
            (
                "seed",
                store.seed_conversation_input,
                {
                    "conversation_id": cv.cid,
                    "seed_key": "k",
                    "inputs": [{"id": cv.mid("seed"), "role": "user", "parts": _text("s")}],
                },
            ),
            (
                "acquire",
                store.acquire_run,
                {k: owned[k] for k in ("conversation_id", "run_id", "expected_revision", "owner_id")},
            ),
            ("checkpoint", store.checkpoint_run_assistant, {**owned, "parts": _text("x")}),
            (
                "operation record",
                store.record_run_operation,
                {
                    **owned,
                    "operation": {"kind": "model-request", "phase": "started", "operation_id": "o", "started_at": _T0},
                },
            ),
            ("lease renewal", store.renew_run_lease, {**owned, "lease_expires_at": _T0}),
            ("terminal", store.commit_run_terminal, {**owned, "terminal_reason": "success"}),
            ("interrupt", store.request_run_interrupt, {"conversation_id": cv.cid, "run_id": done.run.id}),
            (
                "recover",
                store.recover_run,
                {
                    "conversation_id": cv.cid,
                    "run_id": done.run.id,
                    "expected_revision": done.run.revision,
                    "action": "abandon",
                    "stale_owner": True,
                },
            ),
            (
                "compaction",
                store.replace_compacted_range,
                {
                    "conversation_id": cv.cid,
                    "expected_version": version,
                    "replaced_message_ids": [c.inp("a")],
                    "summary": {"id": cv.mid("s"), "role": "summary", "parts": _text("s")},
                },
            ),
        ]
        for what, fn, kwargs in mutations:
            await _raises(AgentConversationPurgedError, f"{what} after purge of {cv.cid}", fn, **kwargs)

        snap = await cv.snapshot()
        _equal((snap.version, snap.messages, snap.runs), (0, (), ()), f"snapshot of purged {cv.cid}")
        _equal(await store.load_run(conversation_id=cv.cid, run_id=done.run.id), None, f"load_run in {cv.cid}")
        active = await store.list_active_runs(conversation_id=cv.cid)
        _equal((active.version, active.runs), (0, ()), f"list_active_runs of purged {cv.cid}")
        page = await store.conversations.messages(cv.cid, include_compacted=True)
        _equal(page.items, (), f"messages of purged {cv.cid}")
        for direction in ("after", "before"):
            page = await store.conversations.messages(cv.cid, direction=direction)  # type: ignore[arg-type]
            _equal(page.items, (), f"messages ({direction}) of purged {cv.cid}")

    listed = await store.conversations.list(limit=100)
    _equal([h.conversation_id for h in listed.items], [other.cid], "conversations.list after purges")
    scanned = await store.scan_recoverable(limit=100)
    _equal([r.id for r in scanned.runs], [other_queued.id], "scan_recoverable after purges")
    _equal(await other.order(), ["t1:in", "t1:out", "q:in"], "the other conversation is untouched")
    _equal(
        (await purge_agent_conversation(object(), conversation_id="anything")).outcome,
        "unsupported",
        "purge through a store without purge",
    )


@_case("bounded_pages")
async def case_bounded_pages(store: AgentRuntimeStore) -> None:
    """Bounded reads: conversations.messages walks the whole history forward and backward with every page
    size, in causal order (settled history, then the live tail of active runs), without duplicates or
    gaps, compacted messages only on request; scan_recoverable and conversations.list pages hold at most
    ``limit`` items; limits outside 1..1000 and malformed cursors are AgentRecordValidationError."""
    c = _Conv(store, "conv-pages")
    await store.seed_conversation_input(
        conversation_id=c.cid, seed_key="lead", inputs=[{"id": c.mid("lead"), "role": "system", "parts": _text("be")}]
    )
    for n in ("t1", "t2", "t3"):
        await c.turn(n)
    _equal((await c.compact(["t1:in", "t1:out"], "s1")).outcome, "applied", "compaction")
    a = await c.checkpoint(await c.acquire((await c.admit("a")).run), "draft a")
    await store.seed_conversation_input(
        conversation_id=c.cid,
        seed_key="imp",
        placement="after-settled",
        inputs=[
            {"id": c.mid("imp-u"), "role": "user", "parts": _text("q")},
            {"id": c.mid("imp-a"), "role": "assistant", "parts": _text("r")},
        ],
    )
    await c.admit("u", priority="urgent")
    await c.admit("b1", coalesce=True)
    await c.admit("b2", coalesce=True)
    expected = [
        "lead",
        "s1",
        "t2:in",
        "t2:out",
        "t3:in",
        "t3:out",
        "imp-u",
        "imp-a",
        "a:in",
        "a:out",
        "u:in",
        "b1:in",
        "b2:in",
    ]
    with_compacted = ["lead", "t1:in", "t1:out", *expected[1:]]
    _equal(await c.order(), expected, "snapshot order")
    _equal(a.state, "running", "a is running during the walk")

    async def walk(limit: int, direction: str, include_compacted: bool) -> list[str]:
        pages: list[list[str]] = []
        cursor: str | None = None
        for _ in range(len(with_compacted) + 2):
            page = await store.conversations.messages(
                c.cid,
                limit=limit,
                direction=direction,  # type: ignore[arg-type]
                cursor=cursor,
                include_compacted=include_compacted,
            )
            what = f"messages(limit={limit}, direction={direction!r}, include_compacted={include_compacted})"
            _expect(len(page.items) <= limit, f"{what} returned {len(page.items)} items")
            _equal(sorted(page.compacted), sorted(m.id for m in page.items if not m.active), f"{what}: compacted ids")
            pages.append([c.short(m.id) for m in page.items])
            cursor = page.next_cursor
            if cursor is None:
                break
        else:
            raise AssertionError(f"messages(limit={limit}, direction={direction!r}) did not finish paging")
        if direction == "before":
            pages.reverse()
        return [name for p in pages for name in p]

    for include_compacted, full in ((False, expected), (True, with_compacted)):
        for limit in range(1, len(full) + 2):
            for direction in ("after", "before"):
                got = await walk(limit, direction, include_compacted)
                _equal(got, full, f"walk limit={limit} direction={direction} include_compacted={include_compacted}")

    for bad in (0, -1, 1001):
        await _refused(
            store,
            c.cid,
            AgentRecordValidationError,
            f"messages limit={bad}",
            store.conversations.messages,
            c.cid,
            limit=bad,
        )
        await _raises(AgentRecordValidationError, f"scan_recoverable limit={bad}", store.scan_recoverable, limit=bad)
        await _raises(
            AgentRecordValidationError, f"conversations.list limit={bad}", store.conversations.list, limit=bad
        )
    await _raises(
        AgentRecordValidationError, "messages direction", store.conversations.messages, c.cid, direction="sideways"
    )
    for cursor in ("not json", "{}", "[]", "null", '"x"', '["x"]', "[null]", '[{"a": 1}]'):
        await _raises(
            AgentRecordValidationError,
            f"messages cursor {cursor!r}",
            store.conversations.messages,
            c.cid,
            cursor=cursor,
        )
    for cursor in ("not json", "{}", "[1]", "null"):
        await _raises(AgentRecordValidationError, f"scan cursor {cursor!r}", store.scan_recoverable, cursor=cursor)
    for cursor in ("not json", "{}", "[]"):
        await _raises(AgentRecordValidationError, f"list cursor {cursor!r}", store.conversations.list, cursor=cursor)

    cids = sorted([c.cid, "conv-pages-x", "conv-pages-y", "conv-pages-0"])
    for extra in cids:
        if extra != c.cid:
            await _Conv(store, extra).admit("q")
    active_total = len((await store.list_active_runs(conversation_id=c.cid)).runs) + 3
    for limit in (1, 2, 3, 1000):
        heads: list[str] = []
        runs: list[tuple[str, str]] = []
        cursor = None
        for _ in range(len(cids) + 2):
            page = await store.conversations.list(limit=limit, cursor=cursor)
            _expect(len(page.items) <= limit, f"conversations.list(limit={limit}) returned {len(page.items)}")
            heads += [h.conversation_id for h in page.items]
            if (cursor := page.next_cursor) is None:
                break
        else:
            raise AssertionError(f"conversations.list(limit={limit}) did not finish paging")
        _equal(heads, cids, f"conversations.list(limit={limit}) pages")
        cursor = None
        for _ in range(active_total + 2):
            scan = await store.scan_recoverable(limit=limit, cursor=cursor)
            _expect(len(scan.runs) <= limit, f"scan_recoverable(limit={limit}) returned {len(scan.runs)}")
            runs += [(r.conversation_id, r.id) for r in scan.runs]
            if (cursor := scan.next_cursor) is None:
                break
        else:
            raise AssertionError(f"scan_recoverable(limit={limit}) did not finish paging")
        _equal(len(runs), active_total, f"scan_recoverable(limit={limit}) run count")
        _equal(len(set(runs)), active_total, f"scan_recoverable(limit={limit}) has no duplicates")
    unknown = await store.conversations.messages("conv-pages-unknown")
    _equal((unknown.items, unknown.next_cursor), ((), None), "messages of an unknown conversation")


@_case("seeds")
async def case_seeds(store: AgentRuntimeStore) -> None:
    """Seeding: exactly once per seed_key (a repeat is ``duplicate`` and writes nothing, whatever it
    carries); ``lead`` messages precede everything even when seeded later; ``after-settled`` messages
    follow settled history and precede active runs' messages; compacted seeds never come back."""
    c = _Conv(store, "conv-seed")
    await c.turn("t1")

    async def seed(key: str, inputs: list[tuple[str, str]], placement: str = "lead") -> Any:
        return await store.seed_conversation_input(
            conversation_id=c.cid,
            seed_key=key,
            inputs=[{"id": c.mid(n), "role": role, "parts": _text(n)} for n, role in inputs],
            placement=placement,  # type: ignore[arg-type]
        )

    res = await seed("sys", [("sys", "system")])
    _equal((res.outcome, res.message_ids), ("seeded", (c.mid("sys"),)), "lead seed")
    _equal(res.version, await c.version(), "seed version")
    dup = await _writes_nothing(store, c.cid, "repeated seed", seed, "sys", [("sys", "system")])
    _equal((dup.outcome, dup.message_ids), ("duplicate", (c.mid("sys"),)), "repeated seed")
    dup = await _writes_nothing(store, c.cid, "repeated seed key, other content", seed, "sys", [("sys-x", "user")])
    _equal((dup.outcome, dup.message_ids), ("duplicate", (c.mid("sys"),)), "repeated seed key with other content")
    _equal(await c.order(), ["sys", "t1:in", "t1:out"], "a lead seed precedes existing history")

    a = await c.checkpoint(await c.acquire((await c.admit("a")).run), "draft")
    await c.admit("b")
    res = await seed("imp", [("imp-u", "user"), ("imp-a", "assistant")], "after-settled")
    _equal(res.outcome, "seeded", "after-settled seed")
    _equal(
        await c.order(),
        ["sys", "t1:in", "t1:out", "imp-u", "imp-a", "a:in", "a:out", "b:in"],
        "after-settled seed lands before active runs",
    )
    imp_a = next(m for m in (await c.snapshot()).messages if m.id == c.mid("imp-a"))
    _equal((imp_a.role, imp_a.position is not None), ("assistant", True), "a seeded assistant is settled")
    await c.finish(a)
    _equal(
        await c.order(),
        ["sys", "t1:in", "t1:out", "imp-u", "imp-a", "a:in", "a:out", "b:in"],
        "a run settling after the seed follows it",
    )
    await seed("sys2", [("sys2", "user")])
    _equal(
        await c.order(),
        ["sys", "sys2", "t1:in", "t1:out", "imp-u", "imp-a", "a:in", "a:out", "b:in"],
        "a later lead seed follows earlier lead seeds and precedes history",
    )

    for what, args, error in (
        ("a lead assistant", ("x1", [("x1", "assistant")], "lead"), AgentRecordValidationError),
        ("an after-settled system message", ("x2", [("x2", "system")], "after-settled"), AgentRecordValidationError),
        ("an unknown placement", ("x3", [("x3", "user")], "middle"), AgentRecordValidationError),
        ("no inputs", ("x4", [], "lead"), AgentRecordValidationError),
        ("repeated ids", ("x5", [("x5", "user"), ("x5", "user")], "lead"), AgentRecordValidationError),
        ("an existing message id", ("x6", [("t1:in", "user")], "lead"), AgentIdempotencyConflictError),
    ):
        await _refused(store, c.cid, error, f"seed of {what}", seed, *args)

    res = await c.compact(["imp-u", "imp-a"], "s-imp")
    _equal(res.outcome, "applied", "compaction of seeded messages")
    dup = await _writes_nothing(
        store,
        c.cid,
        "seed repeated after compaction",
        seed,
        "imp",
        [("imp-u", "user"), ("imp-a", "assistant")],
        "after-settled",
    )
    _equal(dup.outcome, "duplicate", "seed repeated after compaction")
    _equal(
        await c.order(),
        ["sys", "sys2", "t1:in", "t1:out", "s-imp", "a:in", "a:out", "b:in"],
        "compacted seeds never come back",
    )
    await _refused(
        store,
        c.cid,
        AgentRecordValidationError,
        "compaction of a lead seed",
        store.replace_compacted_range,
        conversation_id=c.cid,
        expected_version=await c.version(),
        replaced_message_ids=[c.mid("sys")],
        summary={"id": c.mid("s-lead"), "role": "summary", "parts": _text("s")},
    )
    fresh = _Conv(store, "conv-seed-new")
    res = await store.seed_conversation_input(
        conversation_id=fresh.cid, seed_key="k", inputs=[{"id": fresh.mid("m"), "role": "user", "parts": _text("m")}]
    )
    _equal(res.outcome, "seeded", "seeding creates a conversation")
    _equal(await fresh.order(), ["m"], "the seeded conversation")


_PLAN_LABELS = (
    "accept",
    "acquire",
    "record_operation",
    "checkpoint_first",
    "checkpoint_again",
    "renew_lease",
    "accept_successor",
    "accept_coalesced",
    "interrupt",
    "terminal",
    "accept_duplicate",
    "load_run",
    "list_active_runs",
    "seed_after_settled",
    "compaction",
    "messages_after",
    "messages_before",
    "acquire_successor",
    "recover_requeue",
    "reacquire",
    "terminal_absorbing",
    "recover_abandon",
)


async def _measured_plan(store: AgentRuntimeStore, c: _Conv) -> dict[str, tuple[int, int]]:
    """One fixed sequence of operations; returns rows (read, written) per step."""
    cost: dict[str, tuple[int, int]] = {}

    async def step(label: str, name: str, fn: Callable[..., Awaitable[Any]], /, **kwargs: Any) -> Any:
        before = store.metrics.get(name)
        b = (before.rows_read, before.rows_written) if before else (0, 0)
        result = await fn(**kwargs)
        after = store.metrics[name]
        cost[label] = (after.rows_read - b[0], after.rows_written - b[1])
        return result

    x = (await step("accept", "accept_input_and_assign_run", c.admit, n="x")).run
    x = await step("acquire", "acquire_run", c.acquire, run=x)
    op = {"kind": "model-request", "phase": "started", "operation_id": "op-1", "step": 0, "started_at": _T0}
    owned = {"conversation_id": c.cid, "run_id": x.id, "owner_id": x.owner_id, "fencing_token": x.fencing_token}
    x = (
        await step(
            "record_operation",
            "record_run_operation",
            store.record_run_operation,
            **owned,
            expected_revision=x.revision,
            operation=op,
        )
    ).run
    x = await step("checkpoint_first", "checkpoint_run_assistant", c.checkpoint, run=x, text="d1")
    x = await step("checkpoint_again", "checkpoint_run_assistant", c.checkpoint, run=x, text="d2")
    x = (
        await step(
            "renew_lease",
            "renew_run_lease",
            store.renew_run_lease,
            **owned,
            expected_revision=x.revision,
            lease_expires_at=_T0,
        )
    ).run
    y = (await step("accept_successor", "accept_input_and_assign_run", c.admit, n="y", coalesce=True)).run
    await step("accept_coalesced", "accept_input_and_assign_run", c.admit, n="z", coalesce=True)
    x = (
        await step(
            "interrupt", "request_run_interrupt", store.request_run_interrupt, conversation_id=c.cid, run_id=x.id
        )
    ).run
    await step("terminal", "commit_run_terminal", c.finish, run=x, reason="interrupted")
    await step("accept_duplicate", "accept_input_and_assign_run", c.admit, n="x")
    await step("load_run", "load_run", store.load_run, conversation_id=c.cid, run_id=x.id)
    await step("list_active_runs", "list_active_runs", store.list_active_runs, conversation_id=c.cid)
    await step(
        "seed_after_settled",
        "seed_conversation_input",
        store.seed_conversation_input,
        conversation_id=c.cid,
        seed_key="imp",
        placement="after-settled",
        inputs=[{"id": c.mid("imp"), "role": "user", "parts": _text("imp")}],
    )
    version = await c.version()
    await step(
        "compaction",
        "replace_compacted_range",
        store.replace_compacted_range,
        conversation_id=c.cid,
        expected_version=version,
        replaced_message_ids=[c.inp("x"), c.out("x")],
        summary={"id": c.mid("sx"), "role": "summary", "parts": _text("sx")},
    )
    await step("messages_after", "conversations.messages", store.conversations.messages, conversation_id=c.cid, limit=3)
    await step(
        "messages_before",
        "conversations.messages",
        store.conversations.messages,
        conversation_id=c.cid,
        limit=3,
        direction="before",
    )
    y = (await store.load_run(conversation_id=c.cid, run_id=y.id)).run  # type: ignore[union-attr]
    y = await step("acquire_successor", "acquire_run", c.acquire, run=y)
    y = (
        await step(
            "recover_requeue",
            "recover_run",
            store.recover_run,
            conversation_id=c.cid,
            run_id=y.id,
            expected_revision=y.revision,
            action="requeue",
            replay_safe=True,
        )
    ).run
    y = await step("reacquire", "acquire_run", c.acquire, run=y)
    w = (await c.admit("w")).run
    claim = AbsorbClaim(run_id=w.id, expected_revision=w.revision, input_message_ids=(c.inp("w"),))
    await step("terminal_absorbing", "commit_run_terminal", c.finish, run=y, absorb=[claim])
    v = (await c.admit("v")).run
    await step(
        "recover_abandon",
        "recover_run",
        store.recover_run,
        conversation_id=c.cid,
        run_id=v.id,
        expected_revision=v.revision,
        action="abandon",
        stale_owner=True,
    )
    _equal(tuple(cost), _PLAN_LABELS, "measured steps")
    return cost


@_case("constant_work")
async def case_constant_work(store: AgentRuntimeStore) -> None:
    """Constant work per mutation (DESIGN §4): the rows read and written by every mutation and bounded read
    (``store.metrics``) are identical for a conversation with 2 prior turns and one with 40; and a driver
    reports them (a mutation reads and writes at least one row)."""
    small, large = _Conv(store, "conv-work-small"), _Conv(store, "conv-work-large")
    for conv, turns in ((small, 2), (large, 40)):
        for i in range(turns):
            await conv.turn(f"t{i}")
    small_cost = await _measured_plan(store, small)
    large_cost = await _measured_plan(store, large)
    differing = {
        label: (small_cost[label], large_cost[label])
        for label in _PLAN_LABELS
        if small_cost[label] != large_cost[label]
    }
    _expect(not differing, f"rows (read, written) differ between 2 and 40 prior turns: {differing}")
    for label in ("accept", "acquire", "checkpoint_first", "terminal", "compaction", "recover_abandon"):
        read, written = small_cost[label]
        _expect(read > 0 and written > 0, f"{label}: the driver reported {read} rows read, {written} written")


@_case("causal_snapshot_order")
async def case_causal_snapshot_order(store: AgentRuntimeStore) -> None:
    """Causal order: unsettled messages follow settled ones in run execution order (running, urgent,
    ordinary; inputs before the assistant); a terminal settles the run's input then its answer, and the
    successor's input still follows. ``visible_to`` hides later runs' inputs."""
    c = _Conv(store, "conv-causal")
    a = await c.checkpoint(await c.acquire((await c.admit("a")).run), "draft a")
    b = (await c.admit("b", coalesce=True)).run
    snap = await c.snapshot()
    _equal([c.short(m.id) for m in snap.messages], ["a:in", "a:out", "b:in"], "running, then queued")
    _expect(all(m.position is None for m in snap.messages), "messages of active runs are unsettled")
    draft = snap.messages[1]
    _equal((draft.role, draft.status, _texts(draft)), ("assistant", "streaming", "draft a"), "the draft")
    _equal(sorted(r.id for r in snap.runs), sorted([a.id, b.id]), "the snapshot holds every run")
    _equal([c.short(m.id) for m in snap.visible_to(a.id)], ["a:in", "a:out"], "a sees nothing of b")
    _equal([c.short(m.id) for m in snap.visible_to(b.id)], ["a:in", "a:out", "b:in"], "b sees a")

    await c.admit("u", priority="urgent")
    await c.admit("b2", coalesce=True)
    _equal(await c.order(), ["a:in", "a:out", "u:in", "b:in", "b2:in"], "urgent before ordinary")
    await c.finish(a, text="answer a")
    snap = await c.snapshot()
    _equal([c.short(m.id) for m in snap.messages], ["a:in", "a:out", "u:in", "b:in", "b2:in"], "after a's terminal")
    pa, po = snap.messages[0].position, snap.messages[1].position
    _expect(pa is not None and po is not None and pa < po, f"a's input then answer are settled: {pa}, {po}")
    _expect(all(m.position is None for m in snap.messages[2:]), "queued inputs stay unsettled")
    _equal(await c.active(), [c.run("u"), b.id], "u then b")
    u = await c.acquire(await c.load(c.run("u")))
    await c.finish(u, text="answer u")
    _equal(await c.order(), ["a:in", "a:out", "u:in", "u:out", "b:in", "b2:in"], "after u's terminal")


@_case("recover_run")
async def case_recover_run(store: AgentRuntimeStore) -> None:
    """Recovery needs evidence: requeue needs replay_safe=True, abandon needs stale_owner=True (else
    AgentRecordValidationError); a stale expected_revision is a revision conflict; requeue puts the run
    back first in order with its fencing history; abandon ends it ``abandoned`` with a failed assistant,
    out of list_active_runs and scan_recoverable. Store-assigned terminal reasons are refused."""
    c = _Conv(store, "conv-recover")
    a = await c.checkpoint(await c.acquire((await c.admit("a")).run), "partial")
    b = (await c.admit("b")).run
    base = {"conversation_id": c.cid, "run_id": a.id, "expected_revision": a.revision}
    for what, kwargs in (
        ("requeue without replay_safe", {"action": "requeue"}),
        ("abandon without stale_owner", {"action": "abandon"}),
        ("abandon with only replay_safe", {"action": "abandon", "replay_safe": True}),
    ):
        await _refused(store, c.cid, AgentRecordValidationError, what, store.recover_run, **base, **kwargs)
    stale = {**base, "expected_revision": a.revision - 1}
    await _refused(
        store,
        c.cid,
        AgentRunRevisionConflictError,
        "stale requeue",
        store.recover_run,
        **stale,
        action="requeue",
        replay_safe=True,
    )
    await _refused(
        store,
        c.cid,
        AgentRunRevisionConflictError,
        "stale abandon",
        store.recover_run,
        **stale,
        action="abandon",
        stale_owner=True,
    )
    await _refused(
        store,
        c.cid,
        AgentRunStateConflictError,
        "requeue of a queued run",
        store.recover_run,
        conversation_id=c.cid,
        run_id=b.id,
        expected_revision=b.revision,
        action="requeue",
        replay_safe=True,
    )
    for reason in ("absorbed", "abandoned", "bogus"):
        await _refused(store, c.cid, AgentRecordValidationError, f"terminal reason {reason!r}", c.finish, a, reason)
    await _refused(
        store, c.cid, AgentRecordValidationError, "policy_stop without policy_name", c.finish, a, "policy_stop"
    )

    requeued = await store.recover_run(**base, action="requeue", replay_safe=True)
    _equal(requeued.outcome, "requeued", "requeue outcome")
    _equal((requeued.run.state, requeued.run.owner_id), ("queued", None), "requeued run")
    _equal(requeued.run.revision, a.revision + 1, "requeue increments the revision")
    _equal(await c.active(), [a.id, b.id], "a requeued run stays first")
    again = await c.acquire(requeued.run, owner="owner-b")
    _expect(again.fencing_token > a.fencing_token, "re-acquire raises the fencing token")

    res = await store.recover_run(
        conversation_id=c.cid, run_id=a.id, expected_revision=again.revision, action="abandon", stale_owner=True
    )
    _equal(res.outcome, "abandoned", "abandon outcome")
    _equal((res.run.state, res.run.terminal_reason), ("abandoned", "abandoned"), "abandoned run")
    assert res.assistant is not None
    _equal((res.assistant.id, res.assistant.status), (a.assistant_message_id, "failed"), "abandoned assistant")
    _expect(res.assistant.position is not None, "the abandoned assistant is settled")
    _equal(await c.active(), [b.id], "the abandoned run left list_active_runs")
    scanned = await store.scan_recoverable(limit=100)
    _equal([r.id for r in scanned.runs], [b.id], "the abandoned run left scan_recoverable")
    await _refused(
        store,
        c.cid,
        AgentRunStateConflictError,
        "abandon of a terminal run",
        store.recover_run,
        conversation_id=c.cid,
        run_id=a.id,
        expected_revision=res.run.revision,
        action="abandon",
        stale_owner=True,
    )
    dup = await c.admit("a")
    _equal((dup.outcome, dup.answer), ("duplicate", res.assistant), "a retry of the abandoned input")
    _equal(await c.order(), ["a:in", "a:out", "b:in"], "abandoned turn settles before the queue")

    res = await store.recover_run(
        conversation_id=c.cid, run_id=b.id, expected_revision=b.revision, action="abandon", stale_owner=True
    )
    _equal((res.outcome, res.run.state), ("abandoned", "abandoned"), "abandon of a never-started run")
    assert res.assistant is not None
    _equal(res.assistant.status, "failed", "a never-started abandoned run gets a failed assistant")
    _equal(await c.active(), [], "nothing active")


@_case("unknown_ids")
async def case_unknown_ids(store: AgentRuntimeStore) -> None:
    """Unknown ids and invalid arguments: operations on an unknown conversation or run raise
    AgentRecordNotFoundError; invalid parts or arguments raise AgentRecordValidationError naming the field;
    nothing is written, and a refused first admission creates no conversation."""
    c = _Conv(store, "conv-known")
    ghost = "conv-unknown"
    a = await c.acquire((await c.admit("a")).run)
    for cid, run_id, what in ((ghost, a.id, "unknown conversation"), (c.cid, "run-unknown", "unknown run")):
        owned = {
            "conversation_id": cid,
            "run_id": run_id,
            "expected_revision": a.revision,
            "owner_id": "owner-a",
            "fencing_token": a.fencing_token,
        }
        calls: list[tuple[str, Callable[..., Awaitable[Any]], dict[str, Any]]] = [
            (
                "acquire",
                store.acquire_run,
                {k: owned[k] for k in ("conversation_id", "run_id", "expected_revision", "owner_id")},
            ),
            ("checkpoint", store.checkpoint_run_assistant, {**owned, "parts": _text("x")}),
            ("terminal", store.commit_run_terminal, {**owned, "terminal_reason": "success"}),
            ("lease renewal", store.renew_run_lease, {**owned, "lease_expires_at": _T0}),
            ("interrupt", store.request_run_interrupt, {"conversation_id": cid, "run_id": run_id}),
            (
                "recover",
                store.recover_run,
                {
                    "conversation_id": cid,
                    "run_id": run_id,
                    "expected_revision": 1,
                    "action": "abandon",
                    "stale_owner": True,
                },
            ),
        ]
        for name, fn, kwargs in calls:
            await _refused(store, [c.cid, ghost], AgentRecordNotFoundError, f"{name} on an {what}", fn, **kwargs)
    await _refused(
        store,
        [c.cid, ghost],
        AgentRecordNotFoundError,
        "compaction of an unknown conversation",
        store.replace_compacted_range,
        conversation_id=ghost,
        expected_version=0,
        replaced_message_ids=["m"],
        summary={"id": "s", "role": "summary", "parts": _text("s")},
    )
    _equal(await store.load_run(conversation_id=c.cid, run_id="run-unknown"), None, "load_run of an unknown run")

    bad_inputs: list[tuple[str, dict[str, Any], str]] = [
        ("unknown part type", {"id": "m1", "parts": [{"type": "nope"}]}, "input.parts"),
        ("no parts", {"id": "m1", "parts": []}, "input.parts"),
        ("empty id", {"id": "", "parts": _text("x")}, "input.id"),
        ("unknown role", {"id": "m1", "role": "robot", "parts": _text("x")}, "input.role"),
        ("unknown field", {"id": "m1", "parts": _text("x"), "colour": "red"}, "input"),
        ("a text part without text", {"id": "m1", "parts": [{"type": "text"}]}, "input.parts"),
    ]
    for cid in (ghost, c.cid):
        for what, draft, where in bad_inputs:
            err = await _refused(
                store,
                [c.cid, ghost],
                AgentRecordValidationError,
                f"admission with {what} into {cid}",
                store.accept_input_and_assign_run,
                conversation_id=cid,
                idempotency_key="k-bad",
                input=draft,
            )
            _expect(
                isinstance(err.field, str) and err.field.startswith(where),
                f"admission with {what}: error field {err.field!r} does not name {where!r}",
            )
    for what, kwargs, where in (
        ("empty conversation id", {"conversation_id": ""}, "conversation_id"),
        ("empty idempotency key", {"idempotency_key": ""}, "idempotency_key"),
        ("unknown priority", {"priority": "high"}, "priority"),
    ):
        args = {"conversation_id": ghost, "idempotency_key": "k", "input": {"id": "m", "parts": _text("x")}, **kwargs}
        err = await _refused(
            store,
            [c.cid, ghost],
            AgentRecordValidationError,
            f"admission with {what}",
            store.accept_input_and_assign_run,
            **args,
        )
        _equal(err.field, where, f"admission with {what}: error field")
    err = await _refused(
        store,
        c.cid,
        AgentRecordValidationError,
        "checkpoint with an invalid part",
        store.checkpoint_run_assistant,
        conversation_id=c.cid,
        run_id=a.id,
        expected_revision=a.revision,
        owner_id="owner-a",
        fencing_token=a.fencing_token,
        parts=[{"type": "tool-call", "call_id": "", "tool_name": "t"}],
    )
    _expect(isinstance(err.field, str) and err.field.startswith("parts"), f"checkpoint error field {err.field!r}")
    listed = await store.conversations.list(limit=10)
    _equal([h.conversation_id for h in listed.items], [c.cid], "refused admissions created no conversation")


@_case("conversation_isolation")
async def case_conversation_isolation(store: AgentRuntimeStore) -> None:
    """Ids are scoped by conversation: the same idempotency key, input id, run id, assistant id and seed
    key in two conversations are independent records, and purging one leaves the other intact."""
    same = {"run_id": "run-1", "assistant_message_id": "msg-out-1"}
    draft = {"id": "msg-in-1", "parts": _text("hello")}
    results = []
    for cid in ("conv-iso-1", "conv-iso-2"):
        res = await store.accept_input_and_assign_run(conversation_id=cid, idempotency_key="key-1", input=draft, **same)
        _equal((res.outcome, res.run.conversation_id), ("accepted", cid), f"admission into {cid}")
        await store.seed_conversation_input(
            conversation_id=cid, seed_key="seed-1", inputs=[{"id": "msg-seed-1", "role": "system", "parts": _text(cid)}]
        )
        results.append(res)
    one, two = _Conv(store, "conv-iso-1"), _Conv(store, "conv-iso-2")
    run = await one.acquire(results[0].run)
    await one.finish(run, text="one's answer")
    loaded = await store.load_run(conversation_id="conv-iso-2", run_id="run-1")
    assert loaded is not None
    _equal((loaded.run.state, loaded.assistant), ("queued", None), "the other conversation's run is untouched")
    snap2 = await two.snapshot()
    _equal([m.id for m in snap2.messages], ["msg-seed-1", "msg-in-1"], "the other conversation's messages")
    _equal(_texts(snap2.messages[0]), "conv-iso-2", "each conversation keeps its own seed")
    run2 = await two.acquire(loaded.run)
    await two.finish(run2, text="two's answer")
    res = await store.purge_conversation(conversation_id="conv-iso-1")
    _equal(res.outcome, "purged", "purge of conv-iso-1")
    snap2 = await two.snapshot()
    _equal([m.id for m in snap2.messages], ["msg-seed-1", "msg-in-1", "msg-out-1"], "conv-iso-2 survives the purge")
    dup = await store.accept_input_and_assign_run(conversation_id="conv-iso-2", idempotency_key="key-1", input=draft)
    _equal((dup.outcome, _texts(dup.answer)), ("duplicate", "two's answer"), "conv-iso-2's receipt survives")


@_case("concurrent_writes")
async def case_concurrent_writes(store: AgentRuntimeStore) -> None:
    """Writes of one conversation serialize: concurrent coalescing admissions all land, once each, in one
    successor in receipt-version order; concurrent plain admissions get distinct admission sequences;
    of two concurrent acquires of one run exactly one wins and the other is a store conflict."""
    c = _Conv(store, "conv-concurrent")
    await c.acquire((await c.admit("a")).run)
    names = [f"b{i}" for i in range(8)]
    results = await asyncio.gather(*(c.admit(n, coalesce=True) for n in names))
    successor = {r.run.id for r in results}
    _equal(len(successor), 1, "concurrent coalescing inputs share one successor")
    _equal(sum(not r.coalesced for r in results), 1, "exactly one input opened the successor")
    by_version = sorted(results, key=lambda r: r.version)
    _equal(len({r.version for r in results}), len(results), "each admission has its own version")
    run = await c.load(successor.pop())
    _equal(list(run.input_message_ids), [r.receipt.input.id for r in by_version], "successor inputs in commit order")

    d = _Conv(store, "conv-concurrent-plain")
    plain = await asyncio.gather(*(d.admit(f"p{i}") for i in range(6)))
    _equal(len({r.run.admission_sequence for r in plain}), 6, "distinct admission sequences")
    by_version = sorted(plain, key=lambda r: r.version)
    _equal(await d.active(), [r.run.id for r in by_version], "execution order is commit order")

    head = by_version[0].run
    raced = await asyncio.gather(d.acquire(head, "owner-x"), d.acquire(head, "owner-y"), return_exceptions=True)
    wins = [r for r in raced if isinstance(r, Run)]
    losses = [r for r in raced if isinstance(r, AgentStoreConflictError)]
    _expect(
        len(wins) == 1 and len(losses) == 1,
        f"two concurrent acquires: expected one win and one conflict, got {raced!r}",
    )
    _equal((await d.load(head.id)), wins[0], "the stored run is the winner's")


@_case("owned_mutations")
async def case_owned_mutations(store: AgentRuntimeStore) -> None:
    """Operation records and leases: record_run_operation stores ``last_operation`` and renew_run_lease
    stores ``lease_expires_at``, each incrementing the revision and the version; acquiring a run that is
    not queued is AgentRunStateConflictError; a stale acquire revision is a revision conflict; a terminal
    given an ``operation`` records it as ``last_operation`` in the same commit."""
    c = _Conv(store, "conv-owned")
    queued = (await c.admit("a")).run
    await _refused(
        store,
        c.cid,
        AgentRunRevisionConflictError,
        "acquire with a stale revision",
        store.acquire_run,
        conversation_id=c.cid,
        run_id=queued.id,
        expected_revision=queued.revision + 1,
        owner_id="owner-a",
    )
    lease = datetime(2031, 1, 2, 3, 4, 5, 678901, tzinfo=UTC)
    res = await store.acquire_run(
        conversation_id=c.cid, run_id=queued.id, expected_revision=queued.revision, owner_id="o", lease_expires_at=lease
    )
    run = res.run
    _equal((run.lease_expires_at, run.revision), (lease, queued.revision + 1), "acquire stores the lease")
    _equal(res.version, await c.version(), "acquire result version")
    await _refused(
        store,
        c.cid,
        AgentRunStateConflictError,
        "acquire of a running run",
        store.acquire_run,
        conversation_id=c.cid,
        run_id=run.id,
        expected_revision=run.revision,
        owner_id="o2",
    )
    owned = {"conversation_id": c.cid, "run_id": run.id, "owner_id": "o", "fencing_token": run.fencing_token}
    operation = {
        "kind": "model-request",
        "phase": "first-output",
        "operation_id": "op-7",
        "step": 2,
        "attempt": 1,
        "started_at": _T0,
        "first_output_at": datetime(2030, 1, 1, 0, 0, 1, 250000, tzinfo=UTC),
        "detail": "détail ✓",
    }
    version = await c.version()
    res = await store.record_run_operation(**owned, expected_revision=run.revision, operation=operation)
    _equal(res.run.revision, run.revision + 1, "an operation record increments the revision")
    _equal(res.version, version + 1, "an operation record advances the version")
    assert res.run.last_operation is not None
    _equal(res.run.last_operation.model_dump(exclude_none=True), operation, "the stored operation")
    _equal(await c.load(run.id), res.run, "load_run returns the recorded operation")
    await _refused(
        store,
        c.cid,
        AgentRunRevisionConflictError,
        "a stale operation record",
        store.record_run_operation,
        **owned,
        expected_revision=run.revision,
        operation=operation,
    )
    run = res.run
    later = datetime(2032, 6, 7, 8, 9, 10, 123456, tzinfo=UTC)
    res = await store.renew_run_lease(**owned, expected_revision=run.revision, lease_expires_at=later)
    _equal((res.run.lease_expires_at, res.run.revision), (later, run.revision + 1), "lease renewal")
    _equal(await c.load(run.id), res.run, "load_run returns the renewed lease")
    completed = {**operation, "phase": "completed", "finished_at": datetime(2030, 1, 1, 0, 0, 2, tzinfo=UTC)}
    done = await c.finish(res.run, operation=completed)
    _equal(done.run.lease_expires_at, None, "a terminal releases the lease")
    assert done.run.last_operation is not None
    _equal(done.run.last_operation.model_dump(exclude_none=True), completed, "the terminal records the operation")
    _equal(await c.load(run.id), done.run, "load_run returns the operation the terminal recorded")


@_case("acquire_with_admission")
async def case_acquire_with_admission(store: AgentRuntimeStore) -> None:
    """An acquisition given the first request's ``operation`` is also the run's first checkpoint, in one
    commit: the version advances by one, the run records the operation, and an empty streaming draft is
    written (a requeued run's earlier draft is emptied, keeping its sequence)."""
    c = _Conv(store, "conv-acquire-admission")
    queued = (await c.admit("a")).run
    operation = dict(_FIRST_REQUEST)
    version = await c.version()
    res = await store.acquire_run(
        conversation_id=c.cid, run_id=queued.id, expected_revision=queued.revision, owner_id="o", operation=operation
    )
    _equal(res.version, version + 1, "one commit: acquisition and admission")
    _equal((res.run.state, res.run.revision), ("running", queued.revision + 1), "the run is acquired")
    assert res.run.last_operation is not None
    _equal(res.run.last_operation.model_dump(exclude_none=True), operation, "the acquisition records the operation")
    assert res.assistant is not None
    draft = res.assistant
    _equal(
        (draft.id, draft.role, draft.status, draft.parts, draft.run_id, draft.version),
        (queued.assistant_message_id, "assistant", "streaming", (), queued.id, res.version),
        "the acquisition writes an empty streaming draft",
    )
    _equal(await c.load(queued.id), res.run, "load_run returns the acquired run")
    stored = [m for m in (await c.snapshot()).messages if m.id == draft.id]
    _equal(stored, [draft], "the snapshot holds the draft as returned")
    written = await c.checkpoint(res.run, "partial")
    requeued = await c.requeue(written)
    again = await store.acquire_run(
        conversation_id=c.cid,
        run_id=requeued.id,
        expected_revision=requeued.revision,
        owner_id="o2",
        operation={**operation, "operation_id": "op-again"},
    )
    assert again.assistant is not None and again.run.last_operation is not None
    _equal(
        (again.assistant.parts, again.assistant.seq, again.assistant.status),
        (tuple(validate_parts(_text("partial"))), draft.seq, "streaming"),
        "a re-acquisition keeps the draft its earlier execution checkpointed (the loop resumes from it)",
    )
    _equal(again.run.last_operation.operation_id, "op-again", "and records its own operation")
    plain = (await c.admit("b")).run
    done = await c.finish(again.run, text="answer")
    _equal(done.outcome, "committed", "the terminal of the acquired run")
    res = await store.acquire_run(
        conversation_id=c.cid, run_id=plain.id, expected_revision=plain.revision, owner_id="o"
    )
    _equal((res.assistant, res.run.last_operation), (None, None), "without an operation, no draft and no record")


@_case("admission_starts_an_idle_conversation")
async def case_admission_starts_an_idle_conversation(store: AgentRuntimeStore) -> None:
    """``start_for``: an admission into a conversation with nothing queued or running acquires its run in
    the same commit (one version), exactly as ``acquire_run`` would: running, revision 2, fencing token 1,
    execution sequence, the owner's lease, and with ``operation`` the empty draft after the input. With a
    run active, it only queues; a duplicate or a coalesced input never starts anything."""
    c = _Conv(store, "conv-admit-start")
    operation = dict(_FIRST_REQUEST)
    lease = _T0 + timedelta(minutes=5)
    first = await c.admit("a", start_for="owner-a", lease_expires_at=lease, operation=operation)
    run = first.run
    _equal(first.version, 1, "one commit admits and starts")
    _equal(
        (run.state, run.revision, run.fencing_token, run.owner_id, run.execution_sequence, run.lease_expires_at),
        ("running", 2, 1, "owner-a", 1, lease),
        "the admitted run is acquired",
    )
    assert run.last_operation is not None and run.acquired_at is not None
    _equal(run.last_operation.model_dump(exclude_none=True), operation, "it records the first request's admission")
    _equal(await c.load(run.id), run, "load_run returns the started run")
    snapshot = await c.snapshot()
    _equal(
        [(m.id, m.role, m.status, m.parts, m.seq) for m in snapshot.messages],
        [
            (c.inp("a"), "user", "committed", tuple(first.receipt.input.parts), 1),
            (c.out("a"), "assistant", "streaming", (), 2),
        ],
        "the input, then the empty draft",
    )
    queued = await c.admit("b", start_for="owner-a", lease_expires_at=lease, operation=operation)
    _equal((queued.run.state, queued.run.owner_id, queued.version), ("queued", None, 2), "behind a run, it queues")
    _equal([m.id for m in (await c.snapshot()).messages], [c.inp("a"), c.out("a"), c.inp("b")], "and writes no draft")
    coalesced = await c.admit("c", coalesce=True, start_for="owner-a", operation=operation)
    _equal((coalesced.coalesced, coalesced.run.state), (True, "queued"), "a coalesced input starts nothing")
    again = await _writes_nothing(store, c.cid, "duplicate of a started admission", c.admit, "a", start_for="o2")
    _equal((again.outcome, again.run), ("duplicate", run), "a duplicate returns the run as stored")
    written = await c.checkpoint(run, "partial")
    done = await c.finish(written, text="answer a")
    _equal(done.outcome, "committed", "the started run ends like any acquired run")
    _equal(await c.active(), [queued.run.id], "its successor waits, queued")
    plain = await c.admit("d", start_for="owner-b")
    _equal(plain.run.state, "queued", "still behind the successor")
    other = _Conv(store, "conv-admit-start-plain")
    bare = await other.admit("a", start_for="owner-b")
    _equal((bare.run.state, bare.run.last_operation), ("running", None), "without an operation: acquired only")
    _equal([m.id for m in (await other.snapshot()).messages], [other.inp("a")], "and no draft")


@_case("records_round_trip")
async def case_records_round_trip(store: AgentRuntimeStore) -> None:
    """What is stored is what is read: every part type, nested metadata, unicode and timestamps survive the
    store unchanged, and the records returned by mutations equal the records read back."""
    c = _Conv(store, "conv-round-trip")
    env = {"provider": "openai", "data": {"id": "rs_1", "nested": [1, 2.5, True, None, {"k": "v"}]}}
    input_parts = [
        {"type": "text", "text": 'héllo "world"\n\t✓ 🚀 \\ \u0000 end'},
        {"type": "file", "reference": "s3://bucket/a.pdf", "media_type": "application/pdf", "filename": "a.pdf"},
        {"type": "source", "source_id": "src-1", "url": "https://example.com/?q=1&r=2", "title": "T"},
        {"type": "provider", "envelope": env},
    ]
    metadata = {
        "tags": ["a", "b"],
        "n": 9007199254740993,
        "f": 0.1,
        "ok": False,
        "none": None,
        "deep": {"x": {"y": []}},
    }
    accepted = await store.accept_input_and_assign_run(
        conversation_id=c.cid,
        idempotency_key="k",
        input={"id": c.inp("a"), "parts": input_parts, "metadata": metadata},
        run_id=c.run("a"),
        assistant_message_id=c.out("a"),
        input_policy="interrupt-next",
    )
    _equal(accepted.receipt.input.parts, tuple(PARTS_ADAPTER.validate_python(input_parts)), "input parts")
    _equal(accepted.receipt.input.metadata, metadata, "input metadata")
    _equal(accepted.run.input_policy, "interrupt-next", "input policy")
    snap = await c.snapshot()
    _equal(snap.messages[0], accepted.receipt.input, "the stored input equals the receipt's input")
    _equal(snap.runs, (accepted.run,), "the stored run equals the admitted run")
    _expect(snap.messages[0].created_at.tzinfo is not None, "timestamps are timezone-aware")

    run = await c.acquire(accepted.run)
    assistant_parts = [
        {"type": "reasoning", "text": "thinking…", "envelope": env},
        {"type": "tool-call", "call_id": "call-1", "tool_name": "search", "input": {"q": "x", "n": [1, 2]}},
        {
            "type": "tool-result",
            "call_id": "call-1",
            "tool_name": "search",
            "outcome": "error",
            "output": {"e": "boom"},
        },
        {"type": "approval-request", "approval_id": "ap-1", "call_id": "call-2", "tool_name": "rm", "input": None},
        {"type": "approval-response", "approval_id": "ap-1", "call_id": "call-2", "approved": False, "reason": "no"},
        {"type": "input-joined", "run_id": "run-x", "message_ids": ["m-1", "m-2"], "step": 1},
        {"type": "control", "marker": "interrupted"},
        {"type": "text", "text": "done ✓"},
    ]
    cp = await store.checkpoint_run_assistant(
        conversation_id=c.cid,
        run_id=run.id,
        expected_revision=run.revision,
        owner_id=run.owner_id or "",
        fencing_token=run.fencing_token,
        parts=assistant_parts,
    )
    assert cp.assistant is not None
    _equal(cp.assistant.parts, tuple(PARTS_ADAPTER.validate_python(assistant_parts)), "assistant parts")
    snap = await c.snapshot()
    _equal(snap.messages[1], cp.assistant, "the stored draft equals the checkpoint's")
    _equal(snap.runs, (cp.run,), "the stored run equals the checkpointed run")
    done = await store.commit_run_terminal(
        conversation_id=c.cid,
        run_id=run.id,
        expected_revision=cp.run.revision,
        owner_id=run.owner_id or "",
        fencing_token=run.fencing_token,
        terminal_reason="policy_stop",
        policy_name="max-steps",
    )
    _equal((done.run.state, done.run.policy_name), ("completed", "max-steps"), "policy_stop terminal")
    snap = await c.snapshot()
    _equal(snap.messages[1], done.assistant, "the stored answer equals the terminal's")
    _equal(snap.runs, (done.run,), "the stored run equals the terminal run")
    loaded = await store.load_run(conversation_id=c.cid, run_id=run.id)
    assert loaded is not None
    _equal((loaded.run, loaded.assistant, loaded.version), (done.run, done.assistant, done.version), "load_run")
    dup = await store.accept_input_and_assign_run(
        conversation_id=c.cid, idempotency_key="k", input={"id": c.inp("a"), "parts": input_parts, "metadata": metadata}
    )
    _equal((dup.outcome, dup.receipt), ("duplicate", accepted.receipt), "the stored receipt")
    listed = await store.conversations.list(limit=10)
    _equal(len(listed.items), 1, "one conversation")
    head = listed.items[0]
    _equal((head.conversation_id, head.version), (c.cid, done.version), "the stored head")


@_case("assistant_id_collisions")
async def case_assistant_id_collisions(store: AgentRuntimeStore) -> None:
    """A run's answer id is taken — one a queued or running run will write, and one an absorbed run never
    writes: an input (also one that would coalesce), a caller-chosen answer id or a compaction summary using
    it is refused with nothing written."""
    c = _Conv(store, "conv-ids")
    await c.turn("z")  # settled history to compact
    absorber = await c.acquire((await c.admit("x")).run)
    absorbed = (await c.admit("y")).run
    claim = AbsorbClaim(run_id=absorbed.id, expected_revision=absorbed.revision, input_message_ids=(c.inp("y"),))
    _equal((await c.finish(absorber, text="answer x and y", absorb=[claim])).absorbed_runs[0].id, absorbed.id, "y")
    await _refused(
        store,
        c.cid,
        AgentIdempotencyConflictError,
        "a new run whose answer id is an absorbed run's",
        store.accept_input_and_assign_run,
        conversation_id=c.cid,
        idempotency_key="collide-answer",
        input={"id": "fresh-input", "parts": _text("clash")},
        assistant_message_id=absorbed.assistant_message_id,
    )
    running = await c.acquire((await c.admit("a")).run)
    queued = (await c.admit("b")).run
    for run in (running, queued, absorbed):
        for coalesce in (False, True):
            await _refused(
                store,
                c.cid,
                AgentIdempotencyConflictError,
                f"an input whose id is the answer id of {run.state} run {run.id}",
                store.accept_input_and_assign_run,
                conversation_id=c.cid,
                idempotency_key=f"collide-{run.id}-{coalesce}",
                input={"id": run.assistant_message_id, "parts": _text("clash")},
                coalesce=coalesce,
            )
        await _refused(
            store,
            c.cid,
            AgentIdempotencyConflictError,
            f"a summary whose id is the answer id of {run.state} run {run.id}",
            store.replace_compacted_range,
            conversation_id=c.cid,
            expected_version=await c.version(),
            replaced_message_ids=[c.inp("z"), c.out("z")],
            summary={"id": run.assistant_message_id, "role": "summary", "parts": _text("summary")},
        )


@_case("causal_run_order")
async def case_causal_run_order(store: AgentRuntimeStore) -> None:
    """``load_snapshot().runs`` follows execution, never admission: runs that started by execution
    sequence, then queued runs in execution order (urgent FIFO before ordinary FIFO)."""
    c = _Conv(store, "conv-run-order")
    a = await c.acquire((await c.admit("a")).run)
    b = (await c.admit("b")).run
    u1 = (await c.admit("u1", priority="urgent")).run
    u2 = (await c.admit("u2", priority="urgent")).run
    _equal([r.id for r in (await c.snapshot()).runs], [a.id, u1.id, u2.id, b.id], "queued: urgent FIFO first")
    await c.finish(a, text="answer a")
    for run in (u1, u2, b):
        await c.finish(await c.acquire(run), text="answer")
    _equal([r.id for r in (await c.snapshot()).runs], [a.id, u1.id, u2.id, b.id], "ended: in the order they ran")


@_case("run_usage")
async def case_run_usage(store: AgentRuntimeStore) -> None:
    """A run's cumulative usage is stored with the checkpoint and terminal commits that carry it, and a
    commit without it keeps what the run holds."""
    reported = "provider-reported"
    step = AgentUsage(
        input_tokens=UsageFigure(value=12, provenance=reported),
        output_tokens=UsageFigure(value=3, provenance=reported),
        steps=1,
    )
    c = _Conv(store, "conv-usage")
    run = await c.acquire((await c.admit("a")).run)
    _equal(run.usage, AgentUsage(), "a new run has spent nothing")
    cp = await store.checkpoint_run_assistant(
        conversation_id=c.cid,
        run_id=run.id,
        expected_revision=run.revision,
        owner_id=run.owner_id or "",
        fencing_token=run.fencing_token,
        parts=_text("draft"),
        usage=step,
    )
    _equal((await c.load(run.id)).usage, step, "the checkpoint stored the usage")
    later = await c.checkpoint(cp.run, "more draft")
    _equal(later.usage, step, "a checkpoint without usage keeps it")
    total = step + step
    done = await c.finish(later, text="answer", usage=total)
    _equal(done.run.usage, total, "the terminal stored the total")
    _equal((await c.load(run.id)).usage, total, "read back")


from . import conformance_ledger as _ledger_cases  # noqa: E402  (registers the ledger's cases after these)

del _ledger_cases
