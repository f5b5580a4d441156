"""Owned writes of one execution run one at a time, in the order they were asked for; one that waits and is
cancelled never leaves the others stuck; a failing store call is retried, a decision is not."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from threadline.errors import AgentConversationPurgedError
from threadline.loop import RunControl, _Failure, _OwnedRun


def owned() -> _OwnedRun:
    run = SimpleNamespace(conversation_id="c", id="r", revision=1, fencing_token=1)
    return _OwnedRun(SimpleNamespace(owner_id="me"), run, RunControl("r"))  # type: ignore[arg-type]


class Store:
    """A store call that waits for its gate and logs when it starts and ends."""

    def __init__(self) -> None:
        self.log: list[str] = []
        self.gates: dict[str, asyncio.Event] = {}

    def call(self, name: str) -> Any:
        gate = self.gates[name] = asyncio.Event()

        async def mutate(**fields: Any) -> Any:
            self.log.append(f"start {name}")
            await gate.wait()
            self.log.append(f"end {name}")
            return SimpleNamespace(run=SimpleNamespace(conversation_id="c", id="r", revision=2, fencing_token=1))

        return mutate


def three_writes(writes: _OwnedRun, store: Store) -> list[asyncio.Future[Any]]:
    """Owned writes ``a``, ``b`` and ``c`` asked for in that order (``a`` runs, the others wait)."""
    return [asyncio.ensure_future(writes._owned(store.call(name))) for name in ("a", "b", "c")]


async def test_owned_writes_run_one_at_a_time_in_order() -> None:
    writes, store = owned(), Store()
    tasks = three_writes(writes, store)
    await asyncio.sleep(0)
    assert store.log == ["start a"]
    for name in ("a", "b", "c"):
        store.gates[name].set()
        await asyncio.sleep(0)
        await asyncio.sleep(0)
    await asyncio.gather(*tasks)
    assert store.log == ["start a", "end a", "start b", "end b", "start c", "end c"]
    assert not writes._busy


async def test_a_cancelled_waiter_leaves_no_one_stuck() -> None:
    writes, store = owned(), Store()
    first, second, third = three_writes(writes, store)
    await asyncio.sleep(0)
    second.cancel()
    store.gates["a"].set()
    await asyncio.sleep(0)
    second.cancel()  # and again after the turn may have been handed to it
    store.gates["c"].set()
    await asyncio.wait_for(asyncio.gather(first, third), 5)
    with pytest.raises(asyncio.CancelledError):
        await second
    assert "start b" not in store.log
    assert not writes._busy and not writes._waiting


async def test_a_failing_store_call_is_retried_and_a_decision_is_not() -> None:
    writes = owned()
    calls: list[str] = []

    async def flaky(**fields: Any) -> Any:
        calls.append("flaky")
        if len(calls) < 3:
            raise OSError("disk hiccup")
        return SimpleNamespace(run=writes.run)

    await writes._owned(flaky)
    assert calls == ["flaky"] * 3

    async def purged(**fields: Any) -> Any:
        calls.append("purged")
        raise AgentConversationPurgedError("c")

    with pytest.raises(_Failure) as failure:
        await writes._owned(purged)
    assert failure.value.reason == "runtime_failure"
    assert calls.count("purged") == 1
    assert not writes._busy


async def test_a_waiter_cancelled_after_its_turn_came_hands_the_turn_on() -> None:
    writes, store = owned(), Store()
    first, second, third = three_writes(writes, store)
    await asyncio.sleep(0)
    handed = writes._pass_turn

    def hand_then_cancel() -> None:  # the turn reaches ``second``, which is cancelled before it wakes
        handed()
        if not second.done():
            second.cancel()

    writes._pass_turn = hand_then_cancel  # type: ignore[method-assign]
    store.gates["a"].set()
    store.gates["c"].set()
    await asyncio.wait_for(asyncio.gather(first, third), 5)
    with pytest.raises(asyncio.CancelledError):
        await second
    assert store.log == ["start a", "end a", "start c", "end c"]
    assert not writes._busy and not writes._waiting
