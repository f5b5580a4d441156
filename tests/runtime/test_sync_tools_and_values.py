"""Plain ``def`` tools run on a worker thread (the event loop keeps running, an abort stops waiting for them
and never accepts their result), and every tool result is lossless JSON at the tool boundary: what the model
saw, what ``tool-status`` showed and what the store keeps are the same value — a ``nan`` is refused the same
way live and stored."""

from __future__ import annotations

import asyncio
import dataclasses
import math
import threading
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from pydantic import BaseModel
from pydantic_ai.messages import ToolReturnPart
from pydantic_ai.models.function import DeltaToolCall

from threadline import (
    AgentToolContext,
    AgentToolValueError,
    create_sqlite_agent_runtime_store,
    define_agent_tool,
)

from .conftest import Script, make_runtime, submit

WAIT = 10


def calls(tool: str, args: str = "{}") -> Any:
    async def handler(i: int, messages: list[Any], info: Any) -> AsyncIterator[Any]:
        if i == 0:
            yield {0: DeltaToolCall(name=tool, json_args=args, tool_call_id="call-1")}
        else:
            yield "done"

    return handler


def returned(script: Script) -> list[Any]:
    """What the model was shown as tool results, in its second request."""
    return [p.content for m in script.calls[1] for p in getattr(m, "parts", ()) if isinstance(p, ToolReturnPart)]


async def test_a_plain_function_tool_runs_on_a_worker_thread(store: Any) -> None:
    loop_thread = threading.get_ident()
    seen: dict[str, Any] = {}

    @define_agent_tool
    def read_file(ctx: AgentToolContext, path: str) -> str:
        """Reads a file (blocking I/O is fine here)."""
        seen["thread"] = threading.get_ident()
        seen["run"] = ctx.run_id
        return f"contents of {path}"

    script = Script(calls("read_file", '{"path": "a.txt"}'))
    runtime = make_runtime(store, script, tools=[read_file])
    result = await asyncio.wait_for(submit(runtime, "k", "read").result, WAIT)
    await runtime.close()
    assert result.terminal_reason == "success"
    assert seen["thread"] != loop_thread and seen["run"] == result.run.id
    assert returned(script) == ["contents of a.txt"]
    assert read_file.definition().parameters_json_schema["required"] == ["path"]


async def test_a_blocking_tool_never_blocks_the_event_loop_and_an_interrupt_does_not_wait_for_it(
    store: Any,
) -> None:
    release = threading.Event()
    started = threading.Event()
    finished = threading.Event()

    @define_agent_tool
    def slow_export() -> str:
        """Blocks until released."""
        started.set()
        release.wait(WAIT)
        finished.set()
        return "exported"

    events: list[Any] = []
    script = Script(calls("slow_export"))
    runtime = make_runtime(store, script, tools=[slow_export], publish=events.append)
    ticket = submit(runtime, "k", "export")
    # the loop goes on while the tool blocks its thread (on the loop's thread, nothing below could run)
    await asyncio.wait_for(asyncio.to_thread(started.wait, WAIT), WAIT)
    admission = await ticket.admission
    await runtime.interrupt(conversation_id="c1", run_id=admission.run_id)
    result = await asyncio.wait_for(ticket.result, WAIT)  # settles while the thread is still blocked
    assert not finished.is_set()
    release.set()
    await asyncio.wait_for(asyncio.to_thread(finished.wait, WAIT), WAIT)
    await runtime.close()
    assert result.terminal_reason == "interrupted"
    assert not [p for p in result.assistant.parts if p.type == "tool-result"], "an aborted call's result is dropped"
    assert len(script.calls) == 1
    assert not [e for e in events if e.type == "tool-status" and e.status == "completed"]


async def run_and_reopen(tmp_path: Path, script: Script, tool: Any) -> tuple[Any, list[Any], Any]:
    """Run one turn on a SQLite file, then read the run back from the reopened file."""
    events: list[Any] = []
    async with create_sqlite_agent_runtime_store(tmp_path / "t.db") as handle:
        runtime = make_runtime(handle.store, script, tools=[tool], publish=events.append)
        result = await asyncio.wait_for(submit(runtime, "k", "go").result, WAIT)
        await runtime.close()
    async with create_sqlite_agent_runtime_store(tmp_path / "t.db") as handle:
        stored = await handle.store.load_run(conversation_id="c1", run_id=result.run.id)
    return result, events, stored


class Reading(BaseModel):
    sensor: str
    at: datetime
    values: tuple[float, ...]


@dataclasses.dataclass
class Point:
    x: int
    y: int


async def test_models_dataclasses_and_datetimes_become_json_and_are_stored_as_the_model_saw_them(
    tmp_path: Path,
) -> None:
    @define_agent_tool
    async def measure() -> dict[str, Any]:
        """Measures."""
        return {
            "reading": Reading(sensor="s1", at=datetime(2030, 1, 1, tzinfo=UTC), values=(1.5, 2.0)),
            "point": Point(1, 2),
        }

    expected = {
        "reading": {"sensor": "s1", "at": "2030-01-01T00:00:00Z", "values": [1.5, 2.0]},
        "point": {"x": 1, "y": 2},
    }
    script = Script(calls("measure"))
    _result, events, stored = await run_and_reopen(tmp_path, script, measure)
    assert returned(script) == [expected]
    [live] = [e.output for e in events if e.type == "tool-status" and e.status == "completed"]
    assert live == expected
    assert stored is not None and stored.assistant is not None
    [kept] = [p.output for p in stored.assistant.parts if p.type == "tool-result"]
    assert kept == expected


async def test_a_nan_is_refused_the_same_way_live_and_stored(tmp_path: Path) -> None:
    ran: list[str] = []

    @define_agent_tool
    async def score() -> dict[str, Any]:
        """Scores."""
        ran.append("effect")
        return {"name": "x", "scores": [1.0, math.nan]}

    script = Script(calls("score"))
    result, events, stored = await run_and_reopen(tmp_path, script, score)
    assert ran == ["effect"] and result.terminal_reason == "success"
    [seen] = returned(script)
    assert seen["error"] == "TOOL_VALUE_REFUSED" and seen["details"] == {"path": "$.scores[1]"}
    assert "nan is not a finite JSON number" in seen["message"]
    [live] = [e.error for e in events if e.type == "tool-status" and e.status == "failed"]
    assert dict(live) == seen
    assert stored is not None and stored.assistant is not None
    [kept] = [p for p in stored.assistant.parts if p.type == "tool-result"]
    assert (kept.outcome, kept.output) == ("error", seen)


async def test_the_value_error_is_an_app_error_a_tool_can_catch_by_type(store: Any) -> None:
    @define_agent_tool
    async def infinite() -> float:
        """Returns infinity."""
        return math.inf

    script = Script(calls("infinite"))
    runtime = make_runtime(store, script, tools=[infinite])
    await asyncio.wait_for(submit(runtime, "k", "go").result, WAIT)
    await runtime.close()
    [seen] = returned(script)
    assert seen["error"] == AgentToolValueError("t", "$", "r").code == "TOOL_VALUE_REFUSED"
    assert seen["details"] == {"path": "$"} and seen["retryable"] is False
