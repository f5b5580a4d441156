"""The JSON-lines structured runner in process: a ``close`` line is bounded by default, and the line bound
counts UTF-8 bytes."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from pydantic import BaseModel

from threadline import AgentConfigError, define_agent_tool
from threadline.harness import HEADLESS_AGENT_RUNNER_MAX_LINE_BYTES, run_headless_agent_runner
from threadline.harness.runner import DEFAULT_CLOSE_FORCE_TIMEOUT

from .conftest import WAIT, Scripted, make_harness


class NoArgs(BaseModel):
    pass


def lines_from(queue: asyncio.Queue[Any]) -> AsyncIterator[Any]:
    async def read() -> AsyncIterator[Any]:
        while (line := await queue.get()) is not None:
            yield line

    return read()


def submit_line(request_id: str, key: str) -> str:
    return json.dumps(
        {
            "type": "submit",
            "request_id": request_id,
            "conversation_id": "c1",
            "idempotency_key": key,
            "context": {"user_id": "u1"},
            "parts": [{"type": "text", "text": "go"}],
        }
    )


async def test_a_close_line_without_budgets_is_bounded_by_the_runners_defaults() -> None:
    assert 0 < DEFAULT_CLOSE_FORCE_TIMEOUT < float("inf")
    entered, finish = asyncio.Event(), asyncio.Event()

    async def stubborn() -> str:
        """A tool that ignores the abort: only a bounded close returns while it runs."""
        entered.set()
        while True:
            try:
                await finish.wait()
                return "done"
            except asyncio.CancelledError:
                continue

    harness = make_harness(Scripted(tool="stubborn"), tools=[define_agent_tool(stubborn, args=NoArgs)])
    queue: asyncio.Queue[Any] = asyncio.Queue()
    out: list[dict[str, Any]] = []
    runner = asyncio.ensure_future(
        run_headless_agent_runner(harness, input=lines_from(queue), write=out.append, close_force_timeout=0.05)
    )
    try:
        await queue.put(submit_line("s1", "k1"))
        await asyncio.wait_for(entered.wait(), WAIT)
        await queue.put(json.dumps({"type": "close", "request_id": "bye"}))
        await asyncio.wait_for(runner, WAIT)
        [closed] = [o for o in out if o["type"] == "closed"]
        assert closed["request_id"] == "bye"
        assert closed["result"]["timed_out"] is True and closed["result"]["remaining"] == 1
    finally:
        finish.set()
        runner.cancel()

    async def settled() -> None:
        while any(r.state in ("queued", "running", "interrupt_requested") for r in (await harness.snapshot("c1")).runs):
            await asyncio.sleep(0.01)

    await asyncio.wait_for(settled(), WAIT)  # the aborted run ends once its tool returns


@pytest.mark.parametrize(
    "budget", [{"close_force_timeout": -1}, {"close_grace_period": float("nan")}, {"close_force_timeout": True}]
)
async def test_bad_close_budgets_are_refused_before_reading(budget: dict[str, Any]) -> None:
    async def nothing() -> AsyncIterator[Any]:
        raise AssertionError("read")
        yield

    with pytest.raises(AgentConfigError) as refused:
        await run_headless_agent_runner(make_harness(Scripted()), input=nothing(), write=print, **budget)
    assert refused.value.field == next(iter(budget))


async def test_the_line_bound_counts_utf8_bytes_and_the_loop_goes_on() -> None:
    harness = make_harness(Scripted())
    characters = HEADLESS_AGENT_RUNNER_MAX_LINE_BYTES // 2 + 1  # fewer characters than the bound, more bytes
    long_line = json.dumps(
        {"type": "snapshot", "request_id": "big", "conversation_id": "é" * characters}, ensure_ascii=False
    )
    assert len(long_line) < HEADLESS_AGENT_RUNNER_MAX_LINE_BYTES < len(long_line.encode())
    out: list[dict[str, Any]] = []

    async def lines() -> AsyncIterator[Any]:
        yield long_line
        yield json.dumps({"type": "snapshot", "request_id": "small", "conversation_id": "c1"})

    await asyncio.wait_for(run_headless_agent_runner(harness, input=lines(), write=out.append), WAIT)
    refused, answered = out
    assert refused["type"] == "error" and refused["code"] == "REQUEST_REJECTED"
    assert f"at most {HEADLESS_AGENT_RUNNER_MAX_LINE_BYTES} bytes" in refused["message"]
    assert answered["type"] == "snapshot" and answered["request_id"] == "small"
