"""Scripted models and a harness factory for the harness, control-server and transport tests.

Interleavings are decided by events the test opens (``Scripted.gate``), never by timing.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from pydantic import BaseModel
from pydantic_ai.messages import ModelRequest, ToolReturnPart, UserPromptPart
from pydantic_ai.models.function import AgentInfo, DeltaToolCall, FunctionModel

from threadline import create_memory_agent_runtime_store, define_agent_protocol, define_model_registry
from threadline.harness import HeadlessAgentHarness, create_headless_agent_harness

WAIT = 10.0
"""Seconds any awaited condition may take before the test fails (never a verdict by timing)."""

SECRET = "approval-secret"


class Context(BaseModel):
    user_id: str = "u1"


def last_user_text(messages: list[Any]) -> str:
    for message in reversed(messages):
        if isinstance(message, ModelRequest):
            texts = [p.content for p in message.parts if isinstance(p, UserPromptPart) and isinstance(p.content, str)]
            if texts:
                return " | ".join(texts)
    return ""


def tool_returns(messages: list[Any]) -> list[ToolReturnPart]:
    last = messages[-1]
    return [p for p in last.parts if isinstance(p, ToolReturnPart)] if isinstance(last, ModelRequest) else []


class Scripted:
    """A FunctionModel answering ``answer to: <input>`` word by word; ``gate(i)`` (when created before call
    i starts) holds call i after its first word until the test sets it. ``calls``/``infos`` record what
    each request received; ``tool`` makes the first call of a turn call that tool with ``tool_args``."""

    def __init__(self, name: str = "scripted", *, tool: str | None = None, tool_args: str = "{}") -> None:
        self.calls: list[list[Any]] = []
        self.infos: list[AgentInfo] = []
        self.entered: dict[int, asyncio.Event] = {}
        self.gates: dict[int, asyncio.Event] = {}
        self.tool = tool
        self.tool_args = tool_args
        self.model = FunctionModel(stream_function=self._stream, model_name=name)

    def entered_event(self, i: int) -> asyncio.Event:
        return self.entered.setdefault(i, asyncio.Event())

    def gate(self, i: int) -> asyncio.Event:
        return self.gates.setdefault(i, asyncio.Event())

    async def wait_entered(self, i: int) -> None:
        await asyncio.wait_for(self.entered_event(i).wait(), WAIT)

    async def _stream(self, messages: list[Any], info: AgentInfo) -> AsyncIterator[Any]:
        i = len(self.calls)
        self.calls.append(messages)
        self.infos.append(info)
        self.entered_event(i).set()
        returns = tool_returns(messages)
        if self.tool is not None and not returns and any(t.name == self.tool for t in info.function_tools):
            yield {0: DeltaToolCall(name=self.tool, json_args=self.tool_args, tool_call_id=f"call-{i}")}
            return
        text = f"the tool said: {returns[0].content}" if returns else f"answer to: {last_user_text(messages)}"
        words = text.split(" ")
        for n, word in enumerate(words):
            yield word if n == 0 else f" {word}"
            await asyncio.sleep(0)  # a network stream lets other tasks run between chunks
            if n == 0 and i in self.gates:
                await self.gates[i].wait()


def make_harness(scripted: Scripted | dict[str, Scripted], store: Any = None, **options: Any) -> HeadlessAgentHarness:
    """A harness over a memory store (unless given). One script, or several by registry name (then
    ``options['models']`` chooses among them per run)."""
    models = scripted if isinstance(scripted, dict) else {"m": scripted}
    registry = define_model_registry(
        models={name: {"model": s.model, "context_window": 100_000} for name, s in models.items()}
    )
    first = next(iter(models))
    options.setdefault(
        "models", {"preflight": lambda: registry.preflight(first), "resolve": lambda: registry.resolve(first)}
    )
    if callable(options.get("models_from_registry")):
        options["models"] = options.pop("models_from_registry")(registry)
    return create_headless_agent_harness(
        protocol=options.pop("protocol", None) or define_agent_protocol(context=Context),
        store=store if store is not None else create_memory_agent_runtime_store(),
        **options,
    )


def text(t: str) -> list[dict[str, str]]:
    return [{"type": "text", "text": t}]


def submit(harness: HeadlessAgentHarness, key: str, message: str, conversation_id: str = "c1") -> Any:
    return harness.submit(
        conversation_id=conversation_id, idempotency_key=key, context={"user_id": "u1"}, parts=text(message)
    )


def answer_text(result: Any) -> str:
    return "".join(p.text for p in result.assistant.parts if p.type == "text") if result.assistant else ""


async def wait_for(predicate: Callable[[], bool], what: str) -> None:
    """Wait (bounded) until ``predicate()`` holds, checking after each loop iteration."""

    async def poll() -> None:
        while not predicate():
            await asyncio.sleep(0.005)

    try:
        await asyncio.wait_for(poll(), WAIT)
    except TimeoutError:
        raise AssertionError(f"timed out waiting for {what}") from None


@pytest.fixture
def scripted() -> Scripted:
    return Scripted()


@contextlib.asynccontextmanager
async def serving(app: Any) -> AsyncIterator[str]:
    """Run ``app`` with uvicorn on 127.0.0.1 on an ephemeral port in this event loop; yields its base URL."""
    import uvicorn

    config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="on", ws="websockets-sansio")
    server = uvicorn.Server(config)
    task = asyncio.ensure_future(server.serve())
    try:

        async def started() -> None:
            while not server.started:
                if task.done():
                    task.result()
                await asyncio.sleep(0.01)

        await asyncio.wait_for(started(), WAIT)
        port = server.servers[0].sockets[0].getsockname()[1]
        yield f"127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, WAIT)
