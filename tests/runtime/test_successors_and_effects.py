"""Successors, dropped runs and repeated effects (issue 17 §6): a lane that loses an acquisition race looks
again, the runtime that ends a run starts what is queued behind it, a run acquired again resumes from its
durable draft, a durable step stands for the injected inputs it answered, and a tool can fence the outside
system with the execution's owner and token."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
from pydantic_ai.messages import ModelRequest, ToolReturnPart
from pydantic_ai.models.function import DeltaToolCall

from threadline import AgentRunOwnershipConflictError, AgentRunUnsettledError, AgentToolContext, define_agent_tool
from threadline.durability import create_local_step_durability

from .conftest import Script, answer_text, last_user_text, make_runtime, submit

WAIT = 5


def returns_in(messages: list[Any]) -> list[ToolReturnPart]:
    last = messages[-1]
    return [p for p in last.parts if isinstance(p, ToolReturnPart)] if isinstance(last, ModelRequest) else []


async def wait(awaitable: Any) -> Any:
    return await asyncio.wait_for(awaitable, WAIT)


# --------------------------------------------------------------------- a refused acquisition looks again


@pytest.mark.parametrize("newcomer", ["interrupt-next", "coalesce"])
async def test_a_lane_whose_acquisition_is_refused_looks_again_and_answers_everything(
    store: Any, newcomer: str
) -> None:
    """The lane reads the next queued run; before it acquires it, an interrupt-next input (or one that
    coalesces into that run) commits, so the acquisition is refused. The lane must look again — never drop
    the run and leave it (and every later input) unanswered."""
    release = asyncio.Event()

    async def handler(i: int, messages: list[Any], info: Any) -> AsyncIterator[Any]:
        if i == 0:
            await release.wait()
        yield f"answer to: {last_user_text(messages)}"

    script = Script(handler)
    runs = {"coalesce_pending": True} if newcomer == "coalesce" else {}
    runtime = make_runtime(store, script, runs=runs)
    first = submit(runtime, "k1", "first")
    await wait(script.wait_entered(0))
    second = submit(runtime, "k2", "second")
    queued = (await wait(second.admission)).run
    late: list[Any] = []
    acquire = store.acquire_run

    async def racing_acquire(**kwargs: Any) -> Any:
        if kwargs["run_id"] == queued.id and not late:
            policy = "interrupt-next" if newcomer == "interrupt-next" else "queue"
            late.append(
                runtime.submit(
                    conversation_id="c1",
                    idempotency_key="k3",
                    context={"user_id": "u1"},
                    parts=[{"type": "text", "text": "third"}],
                )
                if policy == "queue"
                else runtime._submit_input(
                    conversation_id="c1",
                    idempotency_key="k3",
                    context={"user_id": "u1"},
                    parts=[{"type": "text", "text": "third"}],
                    role="user",
                    policy=policy,
                )
            )
            await wait(late[0].admission)
        return await acquire(**kwargs)

    store.acquire_run = racing_acquire
    release.set()
    results = [await wait(first.result), await wait(second.result)]
    results.append(await wait(late[0].result))
    assert [r.terminal_reason for r in results] == ["success"] * 3
    active = await store.list_active_runs(conversation_id="c1")
    assert active.runs == ()
    if newcomer == "interrupt-next":
        # the urgent input ran before the ordinary one it overtook
        assert [last_user_text(c) for c in script.calls[1:]] == ["third", "second"]
    else:
        assert results[1].run.id == results[2].run.id and results[1].run.input_message_ids == (
            (await second.admission).input.id,
            (await late[0].admission).input.id,
        )
    await runtime.close()


# ------------------------------------------------------------------- the terminal committer's successor


async def test_the_runtime_that_ends_a_run_starts_the_next_queued_run_whoever_admitted_it(store: Any) -> None:
    """Two runtimes on one store (two chat windows on one conversation): the first executes, the second
    admits an input queued behind it. When the first run ends, the runtime that committed its terminal runs
    the queued input too, so nothing is left queued with nobody running it."""
    release = asyncio.Event()

    async def handler(i: int, messages: list[Any], info: Any) -> AsyncIterator[Any]:
        if i == 0:
            await release.wait()
        yield f"answer to: {last_user_text(messages)}"

    script = Script(handler)
    ended: dict[str, asyncio.Event] = {}

    def on_event(event: Any) -> None:
        if event.type == "terminal":
            ended.setdefault(event.run_id, asyncio.Event()).set()

    one = make_runtime(store, script, runs={"resolve_context": lambda run: {"user_id": "u1"}}, publish=on_event)
    two = make_runtime(store, Script())
    first = submit(one, "k1", "from window one")
    await wait(script.wait_entered(0))
    second = submit(two, "k2", "from window two")
    queued = (await wait(second.admission)).run
    assert queued.state == "queued"
    with pytest.raises(AgentRunUnsettledError):  # its own runtime cannot run it behind another executor
        await wait(second.result)
    release.set()
    assert (await wait(first.result)).terminal_reason == "success"
    await wait(ended.setdefault(queued.id, asyncio.Event()).wait())
    loaded = await store.load_run(conversation_id="c1", run_id=queued.id)
    assert (loaded.run.terminal_reason, loaded.run.owner_id) == ("success", one.owner_id)
    assert answer_text(loaded) == "answer to: from window two"
    await one.close()
    await two.close()


async def test_without_runs_resolve_context_the_last_recover_resolver_is_used(store: Any) -> None:
    release = asyncio.Event()

    async def handler(i: int, messages: list[Any], info: Any) -> AsyncIterator[Any]:
        if i == 0:
            await release.wait()
        yield f"answer to: {last_user_text(messages)}"

    script = Script(handler)
    one = make_runtime(store, script)
    assert await one.recover(resolve_context=lambda run: {"user_id": "u1"}) == []  # nothing to recover yet
    first = submit(one, "k1", "one")
    await wait(script.wait_entered(0))
    queued = (
        await store.accept_input_and_assign_run(
            conversation_id="c1", idempotency_key="k2", input={"parts": [{"type": "text", "text": "elsewhere"}]}
        )
    ).run
    release.set()
    await wait(first.result)
    for _ in range(200):  # bounded: the successor runs right after the terminal, in this runtime's lane
        loaded = await store.load_run(conversation_id="c1", run_id=queued.id)
        if loaded.run.terminal:
            break
        await asyncio.sleep(0.01)
    assert loaded.run.terminal_reason == "success" and answer_text(loaded) == "answer to: elsewhere"
    await one.close()


# ----------------------------------------------------------------- a run acquired again resumes its draft


async def test_a_requeued_run_keeps_its_completed_tool_rounds_and_replays_only_the_step_in_progress(
    store: Any,
) -> None:
    effects: list[int] = []
    stall = asyncio.Event()

    @define_agent_tool
    async def record(n: int) -> str:
        effects.append(n)
        return f"recorded {n}"

    async def handler(i: int, messages: list[Any], info: Any) -> AsyncIterator[Any]:
        seen = returns_in(messages)
        if not seen:
            yield {0: DeltaToolCall(name="record", json_args='{"n": 1}', tool_call_id=f"call-{i}")}
            return
        if i == 1:  # the first execution dies while its second step streams
            yield "half an ans"
            stall.set()
            await asyncio.Event().wait()
        yield f"done after {seen[-1].content}"

    script = Script(handler)
    crashed = make_runtime(store, script, tools=[record], loop={"checkpoint_every_events": 1})
    ticket = submit(crashed, "k", "go")
    run_id = (await wait(ticket.admission)).run.id
    await wait(stall.wait())
    lane = crashed.lanes["c1"]
    lane.task.cancel()  # the process dies: nothing more is committed
    with pytest.raises(asyncio.CancelledError):
        await lane.task
    stored = await store.load_run(conversation_id="c1", run_id=run_id)
    assert stored.run.state == "running" and stored.run.usage.steps == 1  # step 0's spend was committed

    survivor = make_runtime(store, script, tools=[record])
    outcomes = await survivor.recover(
        resolve_context=lambda run: {"user_id": "u1"},
        policy=lambda run: {"action": "requeue", "replay_safe": True},
    )
    assert [o.outcome for o in outcomes] == ["requeued"]
    result = await wait(outcomes[0].result)
    assert result.terminal_reason == "success"
    assert effects == [1], "the completed tool round was kept, not executed again"
    assert len(script.calls) == 3, "only the step in progress was replayed"
    assert [p.content for p in returns_in(script.calls[2])] == ["recorded 1"]
    kinds = [p.type for p in result.assistant.parts]
    assert kinds == ["tool-call", "tool-result", "text"] and answer_text(result) == "done after recorded 1"
    # the run's spend: step 0 (first execution, committed) and the replayed step (the lost one is not)
    assert result.run.usage.steps == 2 and result.usage == result.run.usage
    await survivor.close()


async def test_a_run_requeued_during_its_tool_call_replays_that_step(store: Any) -> None:
    """The at-least-once boundary that stays: a tool whose result was not checkpointed runs again."""
    effects: list[int] = []
    inside = asyncio.Event()

    @define_agent_tool
    async def record(n: int) -> str:
        effects.append(n)
        if len(effects) == 1:
            inside.set()
            await asyncio.Event().wait()  # the process dies inside the tool, after its effect
        return f"recorded {n}"

    async def handler(i: int, messages: list[Any], info: Any) -> AsyncIterator[Any]:
        seen = returns_in(messages)
        if not seen:
            yield {0: DeltaToolCall(name="record", json_args='{"n": 1}', tool_call_id=f"call-{i}")}
        else:
            yield f"done after {seen[-1].content}"

    script = Script(handler)
    crashed = make_runtime(store, script, tools=[record])
    ticket = submit(crashed, "k", "go")
    await wait(ticket.admission)
    await wait(inside.wait())
    crashed.lanes["c1"].task.cancel()
    survivor = make_runtime(store, script, tools=[record])
    outcomes = await survivor.recover(
        resolve_context=lambda run: {"user_id": "u1"},
        policy=lambda run: {"action": "requeue", "replay_safe": True},
    )
    result = await wait(outcomes[0].result)
    assert result.terminal_reason == "success" and effects == [1, 1]
    assert [p.type for p in result.assistant.parts] == ["tool-call", "tool-result", "text"]
    await survivor.close()


# ------------------------------------------------------------ inject: a step stands for the joined input


@pytest.mark.parametrize("kept", ["memory", "ledger"])
async def test_a_durable_step_runs_once_for_an_injected_input_whose_absorbing_run_was_interrupted(
    store: Any, kept: str
) -> None:
    """Run A takes B's injected input and calls a durable step on its behalf; A is then interrupted, so B's
    own run answers B and calls the same step: it gets A's proof and the body does not run again. The same
    with the steps kept in process memory and in the conversation's ledger."""
    charges: list[str] = []
    paused = asyncio.Event()
    b_admitted = asyncio.Event()

    async def charge_body() -> str:
        charges.append("charged")
        return "receipt-1"

    @define_agent_tool
    async def charge(ctx: AgentToolContext) -> str:
        return await ctx.step("charge:order-7", charge_body)

    @define_agent_tool
    async def look() -> str:
        await b_admitted.wait()  # B arrives while A's first step runs
        return "looked"

    async def handler(i: int, messages: list[Any], info: Any) -> AsyncIterator[Any]:
        seen = returns_in(messages)
        text = last_user_text(messages)
        if "second" not in repr(messages):  # A before B joined
            yield {0: DeltaToolCall(name="look", json_args="{}", tool_call_id=f"look-{i}")}
        elif not any(r.tool_name == "charge" for r in seen):
            yield {0: DeltaToolCall(name="charge", json_args="{}", tool_call_id=f"charge-{i}")}
        elif i == 2:  # A, after the charge: stopped here by an interrupt
            paused.set()
            await asyncio.Event().wait()
        else:
            yield f"charged for: {text}"

    script = Script(handler)
    durability = create_local_step_durability(store=store) if kept == "ledger" else create_local_step_durability()
    runtime = make_runtime(
        store, script, tools=[charge, look], runs={"input_policy": "inject"}, loop={"step_durability": durability}
    )
    first = submit(runtime, "k1", "first")
    a = (await wait(first.admission)).run
    await wait(script.wait_entered(0))
    second = submit(runtime, "k2", "second")
    b = (await wait(second.admission)).run
    b_admitted.set()
    await wait(paused.wait())
    assert charges == ["charged"]
    await runtime.interrupt(conversation_id="c1", run_id=a.id)
    assert (await wait(first.result)).terminal_reason == "interrupted"
    result = await wait(second.result)
    assert result.terminal_reason == "success" and result.run.id == b.id
    assert charges == ["charged"], "B's own run got A's proof: the charge ran once"
    record = await durability.read("c1", b.id, "charge:order-7")
    assert record is not None and record.value == "receipt-1"
    if kept == "ledger":  # A's intent and proof stand for B too, in the conversation's own journal
        page = await store.read_events(conversation_id="c1")
        steps = [(e.payload["run_id"], e.payload["status"]) for e in page.items if e.kind == "durability/effect"]
        assert steps == [(a.id, "intent"), (b.id, "intent"), (a.id, "accepted"), (b.id, "accepted")]
    await runtime.close()
    await durability.close()


# ------------------------------------------------------------------ fencing the outside system


async def test_a_tool_sees_its_owner_token_and_a_stable_key_and_a_takeover_during_it_is_never_accepted(
    store: Any,
) -> None:
    seen: list[AgentToolContext] = []
    release = asyncio.Event()

    @define_agent_tool
    async def effect(ctx: AgentToolContext) -> str:
        seen.append(ctx)
        await release.wait()
        return "applied"

    async def handler(i: int, messages: list[Any], info: Any) -> AsyncIterator[Any]:
        if not returns_in(messages):
            yield {0: DeltaToolCall(name="effect", json_args="{}", tool_call_id="call-1")}
        else:
            yield "done"

    script = Script(handler)
    runtime = make_runtime(store, script, tools=[effect])
    ticket = submit(runtime, "k", "go")
    run = (await wait(ticket.admission)).run
    while not seen:
        await wait(asyncio.sleep(0.001))
    ctx = seen[0]
    assert (ctx.owner_id, ctx.fencing_token, ctx.run_id, ctx.call_id) == (runtime.owner_id, 1, run.id, "call-1")
    assert ctx.idempotency_key.startswith("tl-") and len(ctx.idempotency_key) > 20
    # the process pauses inside the tool; another executor takes the run over meanwhile
    current = await store.load_run(conversation_id="c1", run_id=run.id)
    requeued = await store.recover_run(
        conversation_id="c1",
        run_id=run.id,
        expected_revision=current.run.revision,
        action="requeue",
        replay_safe=True,
    )
    taken = await store.acquire_run(
        conversation_id="c1", run_id=run.id, expected_revision=requeued.run.revision, owner_id="executor-b"
    )
    assert taken.run.fencing_token == 2  # what the outside system sees from the new owner
    release.set()
    with pytest.raises(AgentRunOwnershipConflictError):
        await wait(ticket.result)
    assert len(script.calls) == 1, "the stale result was never handed to the model"
    snapshot = await store.load_snapshot(conversation_id="c1")
    draft = next(m for m in snapshot.messages if m.id == run.assistant_message_id)
    assert not any(p.type == "tool-result" for p in draft.parts)
    await runtime.close()


async def test_a_stop_policy_never_sees_a_result_of_a_tool_during_which_the_run_was_taken_over(store: Any) -> None:
    """Application code that would see a tool's result before the run's next commit gets it only after the
    fence read the run again: a stale executor's result reaches no stop policy."""
    release, inside = asyncio.Event(), asyncio.Event()
    seen: list[Any] = []

    @define_agent_tool
    async def effect() -> str:
        inside.set()
        await release.wait()
        return "applied"

    async def handler(i: int, messages: list[Any], info: Any) -> AsyncIterator[Any]:
        if not returns_in(messages):
            yield {0: DeltaToolCall(name="effect", json_args="{}", tool_call_id="call-1")}
        else:
            yield "done"

    policy = {"name": "watch", "should_stop": lambda ctx: seen.append(ctx.parts) or False}
    runtime = make_runtime(store, Script(handler), tools=[effect], loop={"stop_policies": [policy]})
    ticket = submit(runtime, "k", "go")
    run = (await wait(ticket.admission)).run
    await wait(inside.wait())
    current = await store.load_run(conversation_id="c1", run_id=run.id)
    requeued = await store.recover_run(
        conversation_id="c1", run_id=run.id, expected_revision=current.run.revision, action="requeue", replay_safe=True
    )
    await store.acquire_run(
        conversation_id="c1", run_id=run.id, expected_revision=requeued.run.revision, owner_id="executor-b"
    )
    release.set()
    with pytest.raises(AgentRunOwnershipConflictError):
        await wait(ticket.result)
    assert seen == [], "the stop policy never saw the stale result"
    await runtime.close()
