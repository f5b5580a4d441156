"""Helpers for the coding tools: build a tool set on a real temporary workspace and call its tools the way the
loop does (validate the model's arguments, call the handler, turn a failure into the safe envelope)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from threadline.coding import create_agent_coding_tools
from threadline.tools import AgentTool, AgentToolContext, error_envelope


class Tools:
    def __init__(self, tools: list[AgentTool], asked: list[dict[str, Any]], paths: list[str]) -> None:
        self.by_name = {tool.name: tool for tool in tools}
        self.asked = asked
        self.paths = paths

    async def call(self, name: str, conversation_id: str = "c1", **arguments: Any) -> dict[str, Any]:
        """The handler's result; raises the AppError (or host cause) the handler raised."""
        tool = self.by_name[name]
        ctx = AgentToolContext(conversation_id=conversation_id, run_id="r1", call_id="k1", tool_name=name, context=None)
        return await tool.call(ctx, tool.validate(arguments))

    async def envelope(self, name: str, **arguments: Any) -> dict[str, Any]:
        """What the model would see: the result, or the failure envelope."""
        try:
            return await self.call(name, **arguments)
        except Exception as error:
            return error_envelope(error)


@pytest.fixture
def workspace(tmp_path: Path) -> Path:
    root = tmp_path / "ws"
    root.mkdir()
    (root / "src").mkdir()
    (root / "src" / "app.py").write_text("def main():\n    return 'hello'\n\nmain()\n")
    (root / "src" / "util.py").write_text("import os\n\nVALUE = 1\n")
    (root / "README.md").write_text("# Project\n\nSay hello.\n")
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "secret.txt").write_text("outside secret\n")
    return root


@pytest.fixture
def make_tools(workspace: Path):
    def build(*, deny: tuple[str, ...] = (), refuse_operations: tuple[str, ...] = (), **options: Any) -> Tools:
        asked: list[dict[str, Any]] = []
        paths: list[str] = []

        async def authorize(payload: dict[str, Any]) -> bool:
            asked.append(payload)
            return payload["operation"] not in refuse_operations

        def authorize_path(payload: dict[str, Any]) -> bool:
            paths.append(payload["path"])
            return payload["path"] not in deny

        options.setdefault("root", workspace)
        tools = create_agent_coding_tools(authorize=authorize, authorize_path=authorize_path, **options)
        return Tools(tools, asked, paths)

    return build
