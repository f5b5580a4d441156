"""The discovery deadline (``search_timeout``) and the caller's cancellation reach the host's callbacks: an async
``authorize`` / ``authorize_path`` still pending at the deadline is cancelled and the call ends — a refusal
(``TIMEOUT``) when nothing was authorized yet, the ``timeout`` coverage reason when the walk had started.
A sync callback cannot be interrupted: the deadline is observed when it returns. Every wait here is
bounded; the hanging callbacks never answer, so only the deadline or the cancellation can end the call."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import Any

import pytest

from threadline.coding import create_agent_coding_tools
from threadline.tools import AgentToolContext, error_envelope

SHORT = {"search_timeout": 0.3}


class Host:
    """Callbacks that hang (forever) on chosen paths or operations and record what was cancelled."""

    def __init__(self, *, hang_paths: tuple[str, ...] = (), hang_operations: tuple[str, ...] = ()) -> None:
        self.hang_paths = hang_paths
        self.hang_operations = hang_operations
        self.cancelled: list[str] = []
        self.hanging = asyncio.Event()

    async def _hang(self, what: str) -> bool:
        self.hanging.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.cancelled.append(what)
            raise
        return True

    async def authorize(self, payload: dict[str, Any]) -> bool:
        if payload["operation"] in self.hang_operations:
            return await self._hang(payload["operation"])
        return True

    async def authorize_path(self, payload: dict[str, Any]) -> bool:
        if payload["path"] in self.hang_paths:
            return await self._hang(payload["path"])
        return True


def tools_of(root: Path, host: Host, **limits: Any) -> dict[str, Any]:
    built = create_agent_coding_tools(
        root=root, authorize=host.authorize, authorize_path=host.authorize_path, limits=limits or SHORT
    )
    return {t.name: t for t in built}


async def call(tools: dict[str, Any], name: str, **arguments: Any) -> dict[str, Any]:
    tool = tools[name]
    ctx = AgentToolContext(conversation_id="c", run_id="r", call_id="k", tool_name=name, context=None)
    try:
        return await asyncio.wait_for(tool.call(ctx, tool.validate(arguments)), timeout=10)
    except TimeoutError:
        raise
    except Exception as error:
        return error_envelope(error)


def open_descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


async def test_a_path_policy_hanging_during_the_search_walk_ends_it_with_the_timeout_reason(workspace: Path) -> None:
    host = Host(hang_paths=("src/util.py",))
    before = open_descriptors()
    result = await call(tools_of(workspace, host), "search_files", query="hello")
    # README.md and src/app.py were decided and searched before the policy stopped answering
    assert [m["path"] for m in result["matches"]] == ["README.md", "src/app.py"]
    assert result["truncated"] is True
    assert result["coverage"]["complete"] is False and result["coverage"]["reasons"] == ["timeout"]
    assert host.cancelled == ["src/util.py"]
    assert open_descriptors() == before  # the walk's directory descriptors were closed


async def test_a_path_policy_hanging_on_a_directory_ends_glob_with_the_timeout_reason(workspace: Path) -> None:
    host = Host(hang_paths=("src",))
    result = await call(tools_of(workspace, host), "glob", pattern="**/*")
    assert result["paths"] == ["README.md"]
    assert result["coverage"]["reasons"] == ["timeout"] and result["truncated"] is True
    assert host.cancelled == ["src"]


async def test_a_path_policy_hanging_on_an_entry_ends_the_listing_with_the_timeout_reason(workspace: Path) -> None:
    host = Host(hang_paths=("src",))
    result = await call(tools_of(workspace, host), "list_directory", path=".")
    assert [e["name"] for e in result["entries"]] == ["README.md"]  # nothing undecided is listed
    assert result["coverage"]["reasons"] == ["timeout"] and result["truncated"] is True
    assert "denied" not in result  # undecided is not denied
    assert host.cancelled == ["src"]


@pytest.mark.parametrize(
    ("tool", "arguments", "operation"),
    [
        ("search_files", {"query": "hello"}, "search"),
        ("glob", {"pattern": "**/*.py"}, "glob"),
        ("list_directory", {"path": "src"}, "list"),
    ],
)
async def test_an_authorization_hanging_past_the_deadline_refuses_timeout(
    workspace: Path, tool: str, arguments: dict[str, Any], operation: str
) -> None:
    host = Host(hang_operations=(operation,))
    envelope = await call(tools_of(workspace, host), tool, **arguments)
    assert envelope["error"] == "TIMEOUT" and envelope["status"] == 504, envelope
    assert envelope["_hint"] and "search_timeout" in envelope["_hint"]
    assert host.cancelled == [operation]


async def test_a_path_policy_hanging_on_the_base_refuses_timeout_naming_it(workspace: Path) -> None:
    host = Host(hang_paths=("src",))
    envelope = await call(tools_of(workspace, host), "glob", pattern="*.py", path="src")
    assert envelope["error"] == "TIMEOUT" and envelope["details"]["path"] == "src" and envelope["retryable"]
    rooted = Host(hang_paths=(".",))
    assert (await call(tools_of(workspace, rooted), "search_files", query="x"))["error"] == "TIMEOUT"
    assert host.cancelled == ["src"] and rooted.cancelled == ["."]


async def test_a_sync_policy_cannot_be_interrupted_and_the_deadline_is_observed_when_it_returns(
    workspace: Path,
) -> None:
    finished: list[str] = []

    def slow_policy(payload: dict[str, Any]) -> bool:
        if payload["path"] == "README.md":
            time.sleep(0.5)  # blocks the event loop's thread past the 0.3 s deadline
            finished.append(payload["path"])
        return True

    built = create_agent_coding_tools(
        root=workspace, authorize=lambda payload: True, authorize_path=slow_policy, limits=SHORT
    )
    tools = {t.name: t for t in built}
    result = await call(tools, "search_files", query="hello")
    assert finished == ["README.md"]  # it ran to the end: nothing can stop a sync callback
    assert [m["path"] for m in result["matches"]] == ["README.md"]  # its answer was honoured
    assert result["coverage"]["reasons"] == ["timeout"]  # and the walk stopped at the next entry


async def test_cancelling_the_call_cancels_the_pending_policy_and_closes_every_descriptor(workspace: Path) -> None:
    (workspace / "src" / "deep").mkdir()
    (workspace / "src" / "deep" / "x.py").write_text("hello\n")
    host = Host(hang_paths=("src/deep/x.py",))
    tools = tools_of(workspace, host, search_timeout=3_600)  # only the cancellation can end it
    before = open_descriptors()
    tool = tools["search_files"]
    ctx = AgentToolContext(conversation_id="c", run_id="r", call_id="k", tool_name="search_files", context=None)
    task = asyncio.create_task(tool.call(ctx, tool.validate({"query": "hello"})))
    await asyncio.wait_for(host.hanging.wait(), 10)
    assert open_descriptors() > before  # the walk holds its directories open while it waits
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, 10)
    assert host.cancelled == ["src/deep/x.py"]
    assert open_descriptors() == before


async def test_a_call_that_ends_past_its_deadline_says_timeout_even_with_nothing_left_to_visit(
    tmp_path: Path,
) -> None:
    root = tmp_path / "empty"
    root.mkdir()

    def slow_authorize(payload: dict[str, Any]) -> bool:
        time.sleep(0.5)  # a sync decision that returns past the 0.3 s deadline
        return True

    built = create_agent_coding_tools(root=root, authorize=slow_authorize, limits=SHORT)
    tools = {t.name: t for t in built}
    for name, arguments in (("list_directory", {}), ("glob", {"pattern": "**"}), ("search_files", {"query": "x"})):
        result = await call(tools, name, **arguments)
        assert result["coverage"]["reasons"] == ["timeout"], name
        assert result["coverage"]["complete"] is False and result["truncated"] is True, name
