"""Control-server contract (issue 21 item 3): every error code and race, decided by events the test opens.

Codes: NOT_ATTACHED, LEASE_REQUIRED, LEASE_CONFLICT, ATTACH_IN_PROGRESS, ATTACHMENT_CAPACITY,
CONNECTION_CLOSED, REQUEST_REJECTED. Races: attach registers before its snapshot, a failed attach rolls back,
closing mid-attach, a slow consumer is detached through the synchronous ``on_overflow`` without slowing the
run, delivery is serialized, and closing a connection or the server never closes the harness."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

import pytest

from threadline import AgentConfigError, define_agent_tool
from threadline.events import AssistantDeltaEvent
from threadline.harness import (
    AgentControlDeliveryBatch,
    AgentControlEventDelivery,
    AgentControlResyncDelivery,
    HeadlessAgentHarness,
    create_agent_harness_control_server,
)
from threadline.harness.fanout import start_delivery
from threadline.store import purge_agent_conversation

from .conftest import SECRET, WAIT, Scripted, make_harness, submit, text, wait_for


class Client:
    """A transport stand-in: collects deliveries and overflow notices."""

    def __init__(self, server: Any, id: str, deliver: Callable[[Any], Any] | None = None) -> None:
        self.deliveries: list[AgentControlEventDelivery] = []
        self.overflows: list[AgentControlResyncDelivery] = []
        self.connection = server.connect(
            id=id, deliver=deliver or self.deliveries.append, on_overflow=self.overflows.append
        )
        self._n = 0

    async def request(self, operation: str, conversation_id: str = "c1", **fields: Any) -> Any:
        self._n += 1
        raw = {"request_id": f"r{self._n}", "operation": operation, "conversation_id": conversation_id, **fields}
        return await asyncio.wait_for(self.connection.request(raw), WAIT)

    def types(self) -> list[str]:
        return [d.event.type for d in self.deliveries]


def code(response: Any) -> str:
    return response.error.code if response.outcome == "error" else "ok"


def gate_snapshots(harness: HeadlessAgentHarness) -> tuple[asyncio.Event, asyncio.Event]:
    """Make ``harness.snapshot`` wait for ``release`` (``entered`` is set when a read starts)."""
    original = harness.snapshot
    entered, release = asyncio.Event(), asyncio.Event()

    async def snapshot(conversation_id: str) -> Any:
        entered.set()
        await release.wait()
        return await original(conversation_id)

    harness.snapshot = snapshot  # type: ignore[method-assign]
    return entered, release


@pytest.fixture
def harness(scripted: Scripted) -> HeadlessAgentHarness:
    return make_harness(scripted)


# ------------------------------------------------------------------------------------ the basic codes


async def test_attach_observe_delivers_events_and_detach_stops_them(harness: HeadlessAgentHarness) -> None:
    server = create_agent_harness_control_server(harness)
    client, watcher, other = Client(server, "a"), Client(server, "w"), Client(server, "b")
    attached = await client.request("attach", access="observe")
    assert attached.outcome == "ok" and attached.snapshot.version == 0
    await watcher.request("attach", access="observe")
    await other.request("attach", "c2", access="observe")
    result = await asyncio.wait_for(submit(harness, "k1", "hello").result, WAIT)
    await wait_for(lambda: "terminal" in client.types(), "the terminal delivery")
    assert client.types()[0] == "admission" and "assistant-delta" in client.types()
    assert all(d.event.run_id == result.run.id for d in client.deliveries)
    assert code(await client.request("detach")) == "ok"
    before = len(client.deliveries)
    await asyncio.wait_for(submit(harness, "k2", "again").result, WAIT)
    await wait_for(lambda: watcher.types().count("terminal") == 2, "the watcher's second terminal")
    assert len(client.deliveries) == before, "nothing is delivered after detach"
    assert other.deliveries == [], "events of conversations not attached are not delivered"
    await harness.close()


@pytest.mark.parametrize(
    ("operation", "fields"),
    [
        ("snapshot", {}),
        ("submit", {"idempotency_key": "k", "parts": text("hi")}),
        ("interrupt", {"run_id": "run-1"}),
        ("respond-approval", {"approval_id": "a1", "approved": True}),
    ],
)
async def test_requests_before_attach_answer_not_attached(
    harness: HeadlessAgentHarness, operation: str, fields: dict[str, Any]
) -> None:
    client = Client(create_agent_harness_control_server(harness), "a")
    response = await client.request(operation, **fields)
    assert code(response) == "NOT_ATTACHED" and response.request_id == "r1"


@pytest.mark.parametrize(
    ("operation", "fields"),
    [
        ("submit", {"idempotency_key": "k", "parts": text("hi")}),
        ("interrupt", {"run_id": "run-1"}),
        ("respond-approval", {"approval_id": "a1", "approved": True}),
    ],
)
async def test_an_observer_needs_the_lease_to_mutate(
    harness: HeadlessAgentHarness, operation: str, fields: dict[str, Any]
) -> None:
    client = Client(create_agent_harness_control_server(harness), "a")
    await client.request("attach", access="observe")
    assert code(await client.request(operation, **fields)) == "LEASE_REQUIRED"
    assert code(await client.request("snapshot")) == "ok", "an observer may read"


async def test_one_controller_per_conversation(harness: HeadlessAgentHarness) -> None:
    server = create_agent_harness_control_server(harness)
    first, second = Client(server, "a"), Client(server, "b")
    assert code(await first.request("attach", access="control")) == "ok"
    assert code(await second.request("attach", access="control")) == "LEASE_CONFLICT"
    assert code(await second.request("attach", access="observe")) == "ok", "observing is shared"
    assert code(await second.request("attach", "c2", access="control")) == "ok", "leases are per conversation"
    assert server.controller_of("c1") == "a"

    assert code(await first.request("attach", access="observe")) == "ok"  # downgrade releases the lease
    assert server.controller_of("c1") is None
    assert code(await second.request("attach", access="control")) == "ok"
    assert code(await first.request("attach", access="control")) == "LEASE_CONFLICT"
    assert code(await second.request("detach")) == "ok"
    assert code(await first.request("attach", access="control")) == "ok"
    first.connection.close()
    assert server.controller_of("c1") is None, "closing a connection releases its leases"
    assert code(await second.request("attach", access="control")) == "ok"


async def test_the_controller_submits_interrupts_and_answers_approvals() -> None:
    effects: list[int] = []

    @define_agent_tool
    async def charge(amount: int) -> str:
        effects.append(amount)
        return f"charged {amount}"

    scripted = Scripted(tool="charge", tool_args='{"amount": 7}')
    harness = make_harness(scripted, tools=[charge], loop={"tool_approval": ["charge"], "tool_approval_secret": SECRET})
    client = Client(create_agent_harness_control_server(harness), "a")
    await client.request("attach", access="control")
    submitted = await client.request("submit", idempotency_key="k1", context={"user_id": "u1"}, parts=text("pay"))
    assert submitted.outcome == "ok" and submitted.run_id
    await wait_for(lambda: "terminal" in client.types(), "the paused run's terminal")
    [pending] = await harness.pending_approvals("c1")
    answered = await client.request(
        "respond-approval", approval_id=pending.approval_id, approved=True, context={"user_id": "u1"}
    )
    assert answered.outcome == "ok" and answered.run_id != submitted.run_id
    await wait_for(lambda: client.types().count("terminal") == 2, "the successor's terminal")
    assert effects == [7]

    unknown = await client.request("respond-approval", approval_id="nope", approved=True, context={"user_id": "u1"})
    assert code(unknown) == "REQUEST_REJECTED" and "AgentApprovalError" in unknown.error.message

    gated = Scripted()
    gated.gate(0)
    other = make_harness(gated)
    controller = Client(create_agent_harness_control_server(other), "x")
    await controller.request("attach", access="control")
    running = await controller.request("submit", idempotency_key="k1", context={"user_id": "u1"}, parts=text("go"))
    await gated.wait_entered(0)
    interrupted = await controller.request("interrupt", run_id=running.run_id)
    assert interrupted.outcome == "ok"
    await wait_for(lambda: "terminal" in controller.types(), "the interrupted terminal")
    assert controller.deliveries[-1].event.terminal_reason == "interrupted"
    await harness.close()
    await other.close()


@pytest.mark.parametrize(
    ("raw", "field"),
    [
        ({"request_id": "r", "operation": "attach", "conversation_id": "c1", "access": "write"}, "access"),
        ({"request_id": "r", "operation": "explode", "conversation_id": "c1"}, "operation"),
        ({"request_id": "r", "operation": "submit", "conversation_id": "c1", "idempotency_key": "k"}, "parts"),
        ({"request_id": "r", "operation": "snapshot", "conversation_id": ""}, "conversation_id"),
        ({"request_id": "r", "operation": "snapshot", "conversation_id": "c1", "schema_version": 2}, "schema_version"),
        ({"request_id": "r", "operation": "snapshot", "conversation_id": "c1", "surprise": 1}, "surprise"),
    ],
)
async def test_malformed_requests_are_rejected_naming_the_field(
    harness: HeadlessAgentHarness, raw: dict[str, Any], field: str
) -> None:
    connection = create_agent_harness_control_server(harness).connect(
        id="a", deliver=lambda d: None, on_overflow=lambda d: None
    )
    response = await connection.request(raw)
    assert code(response) == "REQUEST_REJECTED" and response.error.field == field and response.request_id == "r"
    assert code(await connection.request("{not json")) == "REQUEST_REJECTED"


async def test_a_failing_operation_is_rejected_with_its_typed_reason(harness: HeadlessAgentHarness) -> None:
    client = Client(create_agent_harness_control_server(harness), "a")
    await client.request("attach", access="control")
    bad_part = await client.request(
        "submit",
        idempotency_key="k",
        context={"user_id": "u1"},
        parts=[{"type": "approval-response", "approval_id": "x", "call_id": "c", "approved": True}],
    )
    assert code(bad_part) == "REQUEST_REJECTED"


def test_bad_configuration_and_duplicate_connections_are_refused(harness: HeadlessAgentHarness) -> None:
    for bad in ({"max_pending_events": 0}, {"max_pending_attachments": -1}, {"max_pending_events": True}):
        with pytest.raises(AgentConfigError):
            create_agent_harness_control_server(harness, **bad)


async def test_duplicate_ids_and_connecting_after_close_are_refused(harness: HeadlessAgentHarness) -> None:
    server = create_agent_harness_control_server(harness)
    server.connect(id="a", deliver=lambda d: None, on_overflow=lambda d: None)
    with pytest.raises(AgentConfigError):
        server.connect(id="a", deliver=lambda d: None, on_overflow=lambda d: None)
    server.close()
    with pytest.raises(AgentConfigError):
        server.connect(id="b", deliver=lambda d: None, on_overflow=lambda d: None)


# ------------------------------------------------------------------------------------------- races


async def test_attach_registers_before_reading_its_snapshot(harness: HeadlessAgentHarness) -> None:
    client = Client(create_agent_harness_control_server(harness), "a")
    entered, release = gate_snapshots(harness)
    attaching = asyncio.ensure_future(client.request("attach", access="observe"))
    await asyncio.wait_for(entered.wait(), WAIT)
    ticket = submit(harness, "k1", "published while the snapshot is read")
    await asyncio.wait_for(ticket.admission, WAIT)
    await wait_for(lambda: "admission" in client.types(), "the admission delivered mid-attach")
    release.set()
    response = await attaching
    assert response.outcome == "ok"
    assert response.snapshot.version >= client.deliveries[0].event.version, "the snapshot read came after"
    await asyncio.wait_for(ticket.result, WAIT)
    await harness.close()


async def test_attach_in_progress_blocks_a_second_attach_and_other_requests(harness: HeadlessAgentHarness) -> None:
    client = Client(create_agent_harness_control_server(harness), "a")
    entered, release = gate_snapshots(harness)
    attaching = asyncio.ensure_future(client.request("attach", access="control"))
    await asyncio.wait_for(entered.wait(), WAIT)
    assert code(await client.request("attach", access="observe")) == "ATTACH_IN_PROGRESS"
    assert code(await client.request("snapshot")) == "ATTACH_IN_PROGRESS"
    assert code(await client.request("detach")) == "ATTACH_IN_PROGRESS"
    release.set()
    assert (await attaching).outcome == "ok"
    assert code(await client.request("snapshot")) == "ok"


async def test_attachment_capacity_bounds_concurrent_snapshot_reads(harness: HeadlessAgentHarness) -> None:
    server = create_agent_harness_control_server(harness, max_pending_attachments=1)
    first, second = Client(server, "a"), Client(server, "b")
    entered, release = gate_snapshots(harness)
    attaching = asyncio.ensure_future(first.request("attach", access="observe"))
    await asyncio.wait_for(entered.wait(), WAIT)
    refused = await second.request("attach", "c2", access="observe")
    assert code(refused) == "ATTACHMENT_CAPACITY"
    release.set()
    assert (await attaching).outcome == "ok"
    assert code(await second.request("attach", "c2", access="observe")) == "ok", "capacity is given back"


async def test_a_failed_attach_rolls_back_registration_and_lease(harness: HeadlessAgentHarness) -> None:
    server = create_agent_harness_control_server(harness)
    client = Client(server, "a")

    async def broken(conversation_id: str) -> Any:
        raise OSError("store away")

    original = harness.snapshot
    harness.snapshot = broken  # type: ignore[method-assign]
    assert code(await client.request("attach", access="control")) == "REQUEST_REJECTED"
    assert server.controller_of("c1") is None and client.connection.attached == {}
    harness.snapshot = original  # type: ignore[method-assign]
    assert code(await client.request("snapshot")) == "NOT_ATTACHED"
    assert code(await client.request("attach", access="control")) == "ok", "nothing was left half-attached"


async def test_a_failed_upgrade_keeps_the_previous_access(harness: HeadlessAgentHarness) -> None:
    server = create_agent_harness_control_server(harness)
    client = Client(server, "a")
    await client.request("attach", access="observe")

    async def broken(conversation_id: str) -> Any:
        raise OSError("store away")

    harness.snapshot = broken  # type: ignore[method-assign]
    assert code(await client.request("attach", access="control")) == "REQUEST_REJECTED"
    assert client.connection.attached == {"c1": "observe"} and server.controller_of("c1") is None


async def test_closing_mid_attach_answers_connection_closed(harness: HeadlessAgentHarness) -> None:
    server = create_agent_harness_control_server(harness)
    client = Client(server, "a")
    entered, release = gate_snapshots(harness)
    attaching = asyncio.ensure_future(client.request("attach", access="control"))
    await asyncio.wait_for(entered.wait(), WAIT)
    client.connection.close()
    release.set()
    assert code(await attaching) == "CONNECTION_CLOSED"
    assert server.controller_of("c1") is None
    assert code(await client.request("snapshot")) == "CONNECTION_CLOSED"


async def test_a_slow_consumer_is_detached_through_on_overflow_and_the_run_is_not_slowed() -> None:
    scripted = Scripted()
    harness = make_harness(scripted)
    server = create_agent_harness_control_server(harness, max_pending_events=8)
    stuck = asyncio.Event()  # never set: this consumer never finishes a delivery
    entered: list[Any] = []

    async def blocked(delivery: Any) -> None:
        entered.append(delivery)
        await stuck.wait()

    slow = Client(server, "slow", deliver=blocked)
    fast = Client(server, "fast")
    await slow.request("attach", access="control")
    await fast.request("attach", access="observe")
    result = await asyncio.wait_for(
        submit(harness, "k1", "a long enough answer to stream many words to everyone").result, WAIT
    )
    assert result.terminal_reason == "success", "the run finished although one consumer never read"
    assert [o.model_dump() for o in slow.overflows] == [
        {"schema_version": 1, "type": "resync-required", "conversation_id": "c1", "reason": "overflow"}
    ]
    assert len(entered) == 1, "no second delivery was started while the first was blocked"
    await wait_for(lambda: "terminal" in fast.types(), "the fast consumer's terminal")
    assert fast.overflows == []
    assert code(await slow.request("snapshot")) == "CONNECTION_CLOSED"
    assert server.controller_of("c1") is None, "the detached connection's lease is released"
    assert code(await fast.request("attach", access="control")) == "ok"
    await harness.close()


async def test_delivery_is_serialized_and_in_publish_order(harness: HeadlessAgentHarness) -> None:
    server = create_agent_harness_control_server(harness)
    published: list[Any] = []
    harness.subscribe(published.append)
    active, most = 0, 0
    delivered: list[Any] = []

    async def deliver(delivery: Any) -> None:
        nonlocal active, most
        active += 1
        most = max(most, active)
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        delivered.append(delivery.event)
        active -= 1

    client = Client(server, "a", deliver=deliver)
    await client.request("attach", access="observe")
    await asyncio.wait_for(submit(harness, "k1", "one two three four five").result, WAIT)
    await wait_for(lambda: len(delivered) == len(published), "every event delivered")
    assert most == 1 and delivered == published


async def test_closing_connections_or_the_server_never_closes_the_harness(harness: HeadlessAgentHarness) -> None:
    server = create_agent_harness_control_server(harness)
    client = Client(server, "a")
    await client.request("attach", access="control")
    entered, release = gate_snapshots(harness)
    pending = asyncio.ensure_future(client.request("snapshot"))
    await asyncio.wait_for(entered.wait(), WAIT)
    server.close()
    release.set()
    assert code(await pending) == "CONNECTION_CLOSED"
    assert server.connection_count == 0 and not harness.closing
    result = await asyncio.wait_for(submit(harness, "k1", "still here").result, WAIT)
    assert result.terminal_reason == "success"
    server.close()  # idempotent
    await harness.close()


# ------------------------------------------------------------------------------------ batches


def delta(n: int, conversation_id: str = "c1") -> AssistantDeltaEvent:
    return AssistantDeltaEvent(
        conversation_id=conversation_id, run_id="r1", runtime_epoch="e1", sequence=n, delta=f"w{n} "
    )


async def attach(connection: Any, conversation_id: str = "c1") -> None:
    request = {"request_id": "r", "operation": "attach", "conversation_id": conversation_id, "access": "observe"}
    assert (await asyncio.wait_for(connection.request(request), WAIT)).outcome == "ok"


async def test_events_published_together_reach_each_connection_as_one_shared_batch(
    harness: HeadlessAgentHarness,
) -> None:
    server = create_agent_harness_control_server(harness)
    one: list[AgentControlDeliveryBatch] = []
    two: list[AgentControlDeliveryBatch] = []
    await attach(server.connect(id="a", deliver_batch=one.append, on_overflow=lambda d: None))
    await attach(server.connect(id="b", deliver_batch=two.append, on_overflow=lambda d: None))
    for n in (1, 2, 3):
        harness.events.publish(delta(n))
    harness.events.publish(delta(1, "elsewhere"))  # not attached: goes nowhere
    await wait_for(lambda: one and two, "the batch")
    assert len(one) == 1 and one[0] is two[0], "one batch object, shared"
    assert [d.event.sequence for d in one[0]] == [1, 2, 3] and len(one[0]) == 3
    text = one[0].json_text()
    assert text is two[0].json_text(), "encoded once"
    assert [item["event"]["delta"] for item in json.loads(text)] == ["w1 ", "w2 ", "w3 "]
    harness.events.publish(delta(4))
    await wait_for(lambda: len(one) == 2, "the next batch")
    assert json.loads(one[1].json_text())["event"]["sequence"] == 4, "a batch of one is the delivery itself"


async def test_what_arrives_during_a_blocked_write_follows_as_one_batch_and_never_overlaps(
    harness: HeadlessAgentHarness,
) -> None:
    server = create_agent_harness_control_server(harness, max_pending_events=8)
    release = asyncio.Event()
    batches: list[list[int]] = []
    active = 0
    most = 0

    async def write(batch: AgentControlDeliveryBatch) -> None:
        nonlocal active, most
        active += 1
        most = max(most, active)
        batches.append([d.event.sequence for d in batch])
        if len(batches) == 1:
            await release.wait()  # the socket is full: this write waits
        active -= 1

    await attach(server.connect(id="a", deliver_batch=write, on_overflow=lambda d: None))
    seen: list[int] = []  # a viewer that keeps up shows when each hand-over happened
    await attach(server.connect(id="w", deliver=lambda d: seen.append(d.event.sequence), on_overflow=print))
    harness.events.publish(delta(1))
    await wait_for(lambda: batches == [[1]], "the first write, which waits")
    for n in (2, 3, 4):  # one at a time, each handed over while the first write still waits
        harness.events.publish(delta(n))
        await wait_for(lambda n=n: n in seen, f"event {n} handed over")
    assert batches == [[1]]
    release.set()
    await wait_for(lambda: len(batches) == 2, "the waiting events, as one batch")
    assert batches == [[1], [2, 3, 4]] and most == 1
    harness.events.publish(delta(5))
    await wait_for(lambda: len(batches) == 3, "the next batch")
    assert batches[-1] == [5]


async def test_a_blocked_batch_writer_is_detached_past_max_pending_events(harness: HeadlessAgentHarness) -> None:
    server = create_agent_harness_control_server(harness, max_pending_events=4)
    overflows: list[Any] = []
    entered, cancelled = asyncio.Event(), asyncio.Event()

    async def stuck(batch: AgentControlDeliveryBatch) -> None:
        entered.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.set()
            raise

    connection = server.connect(id="a", deliver_batch=stuck, on_overflow=overflows.append)
    await attach(connection)
    harness.events.publish(delta(1))
    await asyncio.wait_for(entered.wait(), WAIT)
    for n in range(2, 6):  # 4 waiting: at the bound, still attached
        harness.events.publish(delta(n))
    seen: list[int] = []
    await attach(server.connect(id="w", deliver=lambda d: seen.append(d.event.sequence), on_overflow=print))
    harness.events.publish(delta(6))  # a 5th waiting: one more than the bound
    await wait_for(lambda: overflows, "the overflow")
    assert [o.type for o in overflows] == ["resync-required"] and connection.closed
    await asyncio.wait_for(cancelled.wait(), WAIT)  # the blocked write was cancelled
    assert server.connection_count == 1


async def test_connect_takes_exactly_one_way_to_deliver(harness: HeadlessAgentHarness) -> None:
    server = create_agent_harness_control_server(harness)
    for ways in ({}, {"deliver": print, "deliver_batch": print}):
        with pytest.raises(AgentConfigError) as refused:
            server.connect(id="a", on_overflow=print, **ways)
        assert refused.value.field == "deliver"
    assert server.connection_count == 0


async def test_on_overflow_is_required_and_synchronous(harness: HeadlessAgentHarness) -> None:
    server = create_agent_harness_control_server(harness)

    async def closes_later(delivery: Any) -> None:
        pass

    class AsyncCallable:
        async def __call__(self, delivery: Any) -> None:
            pass

    for bad in (
        {},
        {"on_overflow": None},
        {"on_overflow": "close"},
        {"on_overflow": closes_later},
        {"on_overflow": AsyncCallable()},
    ):
        with pytest.raises(AgentConfigError) as refused:
            server.connect(id="a", deliver=print, **bad)
        assert refused.value.field == "on_overflow"
    assert server.connection_count == 0
    server.connect(id="a", deliver=print, on_overflow=lambda delivery: None)
    assert server.connection_count == 1


async def test_start_delivery_runs_a_write_that_need_not_wait_at_once_and_continues_one_that_must() -> None:
    steps: list[str] = []

    async def quick() -> None:
        steps.append("quick")

    assert start_delivery(quick()) is None and steps == ["quick"]  # done before start_delivery returned

    gate = asyncio.Event()

    async def waits() -> str:
        steps.append("before")
        await gate.wait()
        steps.append("after")
        return "written"

    task = start_delivery(waits())
    assert task is not None and steps[-1] == "before" and not task.done()
    gate.set()
    assert await asyncio.wait_for(task, WAIT) == "written" and steps[-1] == "after"

    async def cancelled() -> None:
        try:
            await asyncio.Event().wait()
        finally:
            steps.append("cleaned up")

    task = start_delivery(cancelled())
    assert task is not None
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, WAIT)
    assert steps[-1] == "cleaned up", "the cancellation reached the suspended write"


async def test_an_attached_controller_cannot_recreate_a_purged_conversation() -> None:
    scripted = Scripted()
    harness = make_harness(scripted)
    server = create_agent_harness_control_server(harness)
    connection = server.connect(id="controller", deliver=lambda _: None, on_overflow=lambda _: None)

    async def request(operation: str, **fields: Any) -> Any:
        raw = {"request_id": operation, "operation": operation, "conversation_id": "target", **fields}
        return await asyncio.wait_for(connection.request(raw), WAIT)

    try:
        assert (await request("attach", access="control")).outcome == "ok"
        purged = await purge_agent_conversation(harness.runtime.store, conversation_id="target")
        assert purged.outcome == "purged"
        late = await request("submit", idempotency_key="late", context={"user_id": "u1"}, parts=text("late"))
        assert late.outcome == "error"
        assert "AgentConversationPurgedError" in late.error.message
        assert (await harness.snapshot("target")).messages == ()
        assert scripted.calls == []
    finally:
        server.close()
        await harness.close()
