"""A run's abort reaches the coding tools through the runtime (a real runtime, memory store, scripted model):
a host callback the tool is waiting on is cancelled, and ``run_command`` aborted before launch returns the
seeds' ``cancelled`` outcome without spawning."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Any

import pytest
from pydantic_ai.messages import ModelRequest, ToolReturnPart
from pydantic_ai.models.function import DeltaToolCall, FunctionModel

from threadline import (
    create_agent_runtime,
    create_memory_agent_runtime_store,
    define_agent_protocol,
    define_model_registry,
)
from threadline.coding import create_agent_coding_tools


def one_call(name: str, arguments: dict[str, Any]):
    """A model that calls one tool, then answers."""

    async def stream(messages, info):
        answered = any(isinstance(p, ToolReturnPart) for m in messages if isinstance(m, ModelRequest) for p in m.parts)
        if answered:
            yield "done"
        else:
            yield {0: DeltaToolCall(name=name, json_args=json.dumps(arguments), tool_call_id="call-1")}

    return FunctionModel(stream_function=stream)


def runtime_with(tools: list, model: FunctionModel, events: list) -> Any:
    registry = define_model_registry(models={"m": {"model": model}})
    return create_agent_runtime(
        protocol=define_agent_protocol(),
        store=create_memory_agent_runtime_store(),
        models={"resolve": lambda: registry.resolve("m")},
        tools=tools,
        publish=events.append,
    )


def submit(runtime: Any) -> Any:
    return runtime.submit(
        conversation_id="c1", idempotency_key="k1", context={}, parts=[{"type": "text", "text": "go"}]
    )


async def test_stopping_the_run_cancels_a_path_decision_the_search_is_waiting_on(workspace: Path) -> None:
    deciding = asyncio.Event()
    cancelled: list[str] = []

    async def authorize_path(payload: dict[str, Any]) -> bool:
        if payload["path"] == "src":
            deciding.set()
            try:
                await asyncio.Event().wait()  # a policy that never answers; only the abort ends it
            except asyncio.CancelledError:
                cancelled.append(payload["path"])
                raise
        return True

    tools = create_agent_coding_tools(
        root=workspace,
        authorize=lambda payload: True,
        authorize_path=authorize_path,
        limits={"search_timeout": 3_600},  # the deadline is out of reach: the abort is what stops it
    )
    events: list[Any] = []
    runtime = runtime_with(tools, one_call("search_files", {"query": "hello"}), events)
    try:
        ticket = submit(runtime)
        await asyncio.wait_for(deciding.wait(), 10)
        assert runtime.stop("c1", "cancel")
        result = await asyncio.wait_for(ticket.result, 10)
    finally:
        await runtime.close()
    assert result.terminal_reason == "cancelled"
    assert cancelled == ["src"]


@pytest.mark.subprocess
async def test_a_run_stopped_by_the_hosts_callback_gets_cancelled_and_nothing_is_spawned(
    workspace: Path, tmp_path: Path
) -> None:
    marker = tmp_path / "spawned"
    holder: dict[str, Any] = {}

    def authorize(payload: dict[str, Any]) -> bool:
        if payload["operation"] == "shell":
            holder["runtime"].stop("c1", "cancel")  # the host aborts the run, then its callback returns
        return True

    tools = create_agent_coding_tools(root=workspace, authorize=authorize, executables={"py": sys.executable})
    arguments = {"executable": "py", "args": ["-c", f"open({str(marker)!r}, 'w')"]}
    events: list[Any] = []
    runtime = holder["runtime"] = runtime_with(tools, one_call("run_command", arguments), events)
    try:
        result = await asyncio.wait_for(submit(runtime).result, 10)
    finally:
        await runtime.close()
    assert result.terminal_reason == "cancelled"
    outputs = [e.output for e in events if e.type == "tool-status" and e.status == "completed"]
    assert outputs == [
        {"executable": "py", "exit_code": None, "signal": None, "stdout": "", "stderr": "", "outcome": "cancelled"}
    ]
    assert not marker.exists()
