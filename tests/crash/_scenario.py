"""The crash scenario, shared by the child process (``_child.py``) and the parent test.

Four inputs over two conversations, each naming its idempotency key in its text so that every answer says
which inputs it answers:

- ``k0`` (c1): a plain answer streamed in five deltas;
- ``k1`` (c1): submitted while ``k0`` runs; asks for the tool, then gets an answer streamed in five deltas;
- ``k3`` (c1): submitted right after ``k1`` while ``k0`` still runs, so it coalesces into ``k1``'s run;
- ``k2`` (c2): runs concurrently with c1; the tool, then an answer.

The tool ``record_effect`` appends ``<conversation> <run> <call>`` to ``effects.log`` (fsynced) so the
parent can count external effects. The model is content-driven (it reads the keys in the prompt), so
the parent's recovering runtime answers exactly like the child would have.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel
from pydantic_ai.messages import ModelRequest, ToolReturnPart, UserPromptPart
from pydantic_ai.models.function import AgentInfo, DeltaToolCall, FunctionModel

from threadline import (
    AgentRuntime,
    AgentRuntimeStore,
    AgentRuntimeTicket,
    AgentToolContext,
    create_agent_runtime,
    define_agent_protocol,
    define_model_registry,
)
from threadline.tools import AgentTool, define_agent_tool


@dataclass(frozen=True)
class Input:
    key: str
    conversation_id: str
    text: str


INPUTS: dict[str, Input] = {
    "k0": Input("k0", "c1", "k0: hello there"),
    "k1": Input("k1", "c1", "k1: please look it up [tool]"),
    "k2": Input("k2", "c2", "k2: look that up as well [tool]"),
    "k3": Input("k3", "c1", "k3: and summarise it"),
}
CONVERSATIONS = ("c1", "c2")
CONTEXT = {"user_id": "u1"}
KEY = re.compile(r"\bk\d+\b")
TOOL_NAME = "record_effect"
CHECKPOINT_EVERY = 2
POLICIES: dict[str, dict[str, Any]] = {
    "requeue": {"action": "requeue", "replay_safe": True},
    "abandon": {"action": "abandon", "stale_owner": True},
}


class Context(BaseModel):
    user_id: str


class Hooks:
    """No-op hooks (the parent uses these); the child overrides them to gate its schedule and to kill
    itself at named points."""

    async def model_call(self, conversation_id: str, keys: list[str]) -> int:
        return 0

    async def after_chunk(self, conversation_id: str, call: int, k: int, keys: list[str]) -> None:
        return None

    def tool(self, conversation_id: str, stage: str, call_id: str) -> None:
        return None


def keys_in(text: str) -> list[str]:
    seen: list[str] = []
    for key in KEY.findall(text):
        if key not in seen:
            seen.append(key)
    return seen


def last_user_text(messages: list[Any]) -> str:
    for message in reversed(messages):
        if isinstance(message, ModelRequest):
            texts = [p.content for p in message.parts if isinstance(p, UserPromptPart) and isinstance(p.content, str)]
            if texts:
                return " | ".join(texts)
    return ""


def tool_returns(messages: list[Any]) -> list[ToolReturnPart]:
    last = messages[-1] if messages else None
    return [p for p in last.parts if isinstance(p, ToolReturnPart)] if isinstance(last, ModelRequest) else []


def append_line(path: str, line: str, *, fsync: bool = True) -> None:
    """Append one line with one ``write`` (``O_APPEND``): it survives a SIGKILL right after; with
    ``fsync`` it would survive power loss too."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, (line + "\n").encode())
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)


def make_model(hooks: Hooks) -> FunctionModel:
    async def stream(messages: list[Any], info: AgentInfo) -> AsyncIterator[Any]:
        text = last_user_text(messages)
        keys = keys_in(text)
        conversation_id = INPUTS[keys[0]].conversation_id if keys else "?"
        call = await hooks.model_call(conversation_id, keys)
        returns = tool_returns(messages)
        if returns:
            chunks = ["tool ", "said: ", str(returns[0].content), " ", "done."]
        elif "[tool]" in text:
            yield {
                0: DeltaToolCall(
                    name=TOOL_NAME,
                    json_args=json.dumps({"note": " ".join(keys)}),
                    tool_call_id="call-" + "-".join(keys),
                )
            }
            await hooks.after_chunk(conversation_id, call, 1, keys)
            return
        else:
            chunks = ["answer ", "to ", " ".join(keys), ": ", "ok."]
        for k, chunk in enumerate(chunks, 1):
            yield chunk
            await hooks.after_chunk(conversation_id, call, k, keys)

    return FunctionModel(stream_function=stream, model_name="crash-scripted")


def make_tool(hooks: Hooks, effects_path: str) -> AgentTool:
    @define_agent_tool(name=TOOL_NAME)
    async def record_effect(ctx: AgentToolContext, note: str) -> str:
        """Record that something happened in the outside world."""
        hooks.tool(ctx.conversation_id, "before-effect", ctx.call_id)
        append_line(effects_path, f"{ctx.conversation_id} {ctx.run_id} {ctx.call_id}")
        hooks.tool(ctx.conversation_id, "after-effect", ctx.call_id)
        return f"noted {note}"

    return record_effect


def build_runtime(store: AgentRuntimeStore, hooks: Hooks, effects_path: str, owner_id: str) -> AgentRuntime:
    registry = define_model_registry(models={"m": {"model": make_model(hooks), "context_window": 100_000}})
    return create_agent_runtime(
        protocol=define_agent_protocol(context=Context),
        store=store,
        models={"preflight": lambda: registry.preflight("m"), "resolve": lambda: registry.resolve("m")},
        tools=[make_tool(hooks, effects_path)],
        runs={"coalesce_pending": True, "owner_id": owner_id},
        loop={"checkpoint_every_events": CHECKPOINT_EVERY},
    )


def submit(runtime: AgentRuntime, key: str) -> AgentRuntimeTicket:
    item = INPUTS[key]
    return runtime.submit(
        conversation_id=item.conversation_id,
        idempotency_key=item.key,
        context=CONTEXT,
        parts=[{"type": "text", "text": item.text}],
    )
