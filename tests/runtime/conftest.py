"""Scripted pydantic-ai models whose interleavings are decided by the test, not by timing."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from pydantic import BaseModel
from pydantic_ai.messages import ModelRequest, ToolReturnPart, UserPromptPart
from pydantic_ai.models.function import AgentInfo, FunctionModel

from threadline import (
    AgentRuntime,
    create_agent_runtime,
    create_memory_agent_runtime_store,
    define_agent_protocol,
    define_model_registry,
)


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


class Script:
    """A FunctionModel whose every call is handled by ``handler(call_index, messages, info)`` — an async
    generator. ``calls`` records what each request received; ``entered[i]`` is set when call i started."""

    def __init__(self, handler: Callable[[int, list[Any], AgentInfo], AsyncIterator[Any]] | None = None) -> None:
        self.handler = handler or self.echo
        self.calls: list[list[Any]] = []
        self.infos: list[AgentInfo] = []
        self.entered: dict[int, asyncio.Event] = {}
        self.gates: dict[int, asyncio.Event] = {}
        self.model = FunctionModel(stream_function=self._stream, model_name="scripted")

    def entered_event(self, i: int) -> asyncio.Event:
        return self.entered.setdefault(i, asyncio.Event())

    def gate(self, i: int) -> asyncio.Event:
        return self.gates.setdefault(i, asyncio.Event())

    async def _stream(self, messages: list[Any], info: AgentInfo) -> AsyncIterator[Any]:
        i = len(self.calls)
        self.calls.append(messages)
        self.infos.append(info)
        self.entered_event(i).set()
        async for item in self.handler(i, messages, info):
            yield item

    @staticmethod
    async def echo(i: int, messages: list[Any], info: AgentInfo) -> AsyncIterator[Any]:
        yield f"answer to: {last_user_text(messages)}"

    async def wait_entered(self, i: int) -> None:
        await asyncio.wait_for(self.entered_event(i).wait(), 5)


def make_runtime(store: Any, script: Script, **sections: Any) -> AgentRuntime:
    registry = define_model_registry(models={"m": {"model": script.model, "context_window": 100_000}})
    protocol = sections.pop("protocol", None) or define_agent_protocol(context=Context)
    return create_agent_runtime(
        protocol=protocol,
        store=store,
        models={"preflight": lambda: registry.preflight("m"), "resolve": lambda: registry.resolve("m")},
        **sections,
    )


def text(t: str) -> list[dict[str, str]]:
    return [{"type": "text", "text": t}]


def submit(runtime: AgentRuntime, key: str, message: str, conversation_id: str = "c1", **kw: Any) -> Any:
    return runtime.submit(
        conversation_id=conversation_id, idempotency_key=key, context={"user_id": "u1"}, parts=text(message), **kw
    )


def answer_text(result: Any) -> str:
    return "".join(p.text for p in result.assistant.parts if p.type == "text") if result.assistant else ""


@pytest.fixture
def store() -> Any:
    return create_memory_agent_runtime_store()
