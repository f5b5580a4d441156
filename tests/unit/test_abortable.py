"""Abortable work inside one execution: an abort cancels what is in flight and the run stops; cancelling
the executing task cancels the work too and stays a cancellation; work that finished first keeps its
result."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from threadline.loop import RunControl, _Aborted, _Execution


def abortable(control: RunControl, work: Any) -> Any:
    # _abortable uses only the execution's control
    return _Execution._abortable(SimpleNamespace(control=control), work)  # type: ignore[arg-type]


class Slow:
    """Work that waits long, says when it started and whether it was cancelled."""

    def __init__(self) -> None:
        self.started, self.cancelled = asyncio.Event(), asyncio.Event()

    async def work(self) -> None:
        self.started.set()
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            self.cancelled.set()
            raise


async def test_work_that_finishes_returns_its_result() -> None:
    control = RunControl("r")

    async def work() -> int:
        await asyncio.sleep(0)
        return 7

    assert await abortable(control, work()) == 7
    assert await abortable(control, work()) == 7  # and again: nothing is left over from the first


async def test_an_abort_cancels_the_work_and_stops_the_run() -> None:
    control = RunControl("r")
    slow = Slow()
    waiting = asyncio.ensure_future(abortable(control, slow.work()))
    await slow.started.wait()
    control.abort("interrupted")
    with pytest.raises(_Aborted):
        await waiting
    assert slow.cancelled.is_set()


async def test_an_abort_before_the_work_starts_cancels_it_at_once() -> None:
    control = RunControl("r")
    control.abort("shutdown")
    ran = []

    async def work() -> None:
        ran.append(True)

    with pytest.raises(_Aborted):
        await abortable(control, work())
    assert ran == []


async def test_work_that_ignores_the_abort_still_ends_the_run_aborted() -> None:
    control = RunControl("r")
    started, release = asyncio.Event(), asyncio.Event()

    async def stubborn() -> str:
        started.set()
        while True:
            try:
                await release.wait()
                return "finished anyway"
            except asyncio.CancelledError:
                continue  # swallows the cancellation

    waiting = asyncio.ensure_future(abortable(control, stubborn()))
    await started.wait()
    control.abort("interrupted")
    await asyncio.sleep(0)
    assert not waiting.done()  # it waits for the work to end: nothing is left running behind the run
    release.set()
    with pytest.raises(_Aborted):
        await waiting


async def test_cancelling_the_caller_cancels_the_work_and_is_not_an_abort() -> None:
    control = RunControl("r")
    slow = Slow()
    waiting = asyncio.ensure_future(abortable(control, slow.work()))
    await slow.started.wait()
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert slow.cancelled.is_set() and not control.aborted


async def test_a_gathered_batch_is_cancelled_as_a_whole() -> None:
    control = RunControl("r")
    started = asyncio.Event()
    cancelled: list[int] = []

    async def tool(n: int) -> None:
        started.set()
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.append(n)
            raise

    waiting = asyncio.ensure_future(abortable(control, asyncio.gather(tool(1), tool(2))))
    await started.wait()
    await asyncio.sleep(0)
    control.abort("interrupted")
    with pytest.raises(_Aborted):
        await waiting
    assert sorted(cancelled) == [1, 2]


async def test_an_abort_from_inside_the_work_leaves_no_cancellation_behind() -> None:
    # the work aborts its own run and returns without waiting again: the abort's cancellation never
    # reached it, and must not reach whatever the run does next (its terminal commit)
    control = RunControl("r")

    async def work() -> str:
        await asyncio.sleep(0)
        control.abort("interrupted")
        return "done"

    async def run() -> str:
        with pytest.raises(_Aborted):
            await abortable(control, work())
        await asyncio.sleep(0.01)  # the run's next await (its terminal commit) is not cancelled
        return "terminal committed"

    task = asyncio.ensure_future(run())
    assert await task == "terminal committed"
    assert task.cancelling() == 0


async def test_an_abort_from_inside_the_work_cancels_its_next_wait() -> None:
    control = RunControl("r")
    cancelled = asyncio.Event()

    async def work() -> None:
        await asyncio.sleep(0)
        control.abort("interrupted")
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    with pytest.raises(_Aborted):
        await asyncio.wait_for(abortable(control, work()), 5)
    assert cancelled.is_set()


async def test_an_abort_and_a_cancellation_of_the_caller_together_stay_a_cancellation() -> None:
    control = RunControl("r")
    slow = Slow()
    waiting = asyncio.ensure_future(abortable(control, slow.work()))
    await slow.started.wait()
    control.abort("interrupted")
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
