"""The provider that served a response is named by the model's ``resolve_response_provider``, never by a
gateway key the runtime knows: pydantic-ai's real ``OpenRouterModel`` talks to the fault provider server,
which answers in OpenRouter's wire format (``"provider": "Anthropic"`` in every chunk). With
``openrouter_response_provider`` declared, ``provider/response`` and ``step-finished.response`` carry the
upstream; without a resolver they carry the response id alone."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel
from pydantic_ai.messages import ModelResponse

from threadline import (
    AgentRuntimeUsageError,
    create_agent_runtime,
    create_sqlite_agent_runtime_store,
    define_agent_protocol,
    define_model_registry,
    openrouter_response_provider,
)
from threadline.testing import FaultProviderServer, create_fault_provider_server, stream_text

GUARD = 30  # seconds; only a broken build ever waits this long


class Context(BaseModel):
    user_id: str = "u1"


@pytest.fixture
async def server() -> AsyncIterator[FaultProviderServer]:
    async with create_fault_provider_server() as running:
        yield running


def openrouter_model(server: FaultProviderServer) -> Any:
    from openai import AsyncOpenAI
    from pydantic_ai.models.openrouter import OpenRouterModel
    from pydantic_ai.providers.openrouter import OpenRouterProvider

    client = AsyncOpenAI(base_url=server.base_url, api_key="test")
    return OpenRouterModel("anthropic/claude-sonnet-4", provider=OpenRouterProvider(openai_client=client)), client


async def answer_once(tmp_path: Path, server: FaultProviderServer, **declaration: Any) -> tuple[Any, list[Any]]:
    """One turn through an OpenRouter model declared with ``declaration``; (step-finished, ledger events)."""
    model, client = openrouter_model(server)
    registry = define_model_registry(models={"router": {"model": model, **declaration}})
    handle = create_sqlite_agent_runtime_store(tmp_path / "threadline.db")
    operator: list[Any] = []
    runtime = create_agent_runtime(
        protocol=define_agent_protocol(context=Context),
        store=handle.store,
        models={"resolve": lambda: registry.resolve("router")},
        operator_publish=operator.append,
    )
    try:
        ticket = runtime.submit(
            conversation_id="c1", idempotency_key="k1", context={}, parts=[{"type": "text", "text": "hi"}]
        )
        result = await asyncio.wait_for(ticket.result, GUARD)
        assert result.terminal_reason == "success"
        page = await handle.store.read_events(conversation_id="c1")
    finally:
        await runtime.close(grace_period=0, force_timeout=GUARD)
        await handle.close()
        await client.close()
    (step,) = [e for e in operator if e.type == "step-finished"]
    return step, list(page.items)


async def test_openrouters_resolver_names_the_upstream_in_the_ledger_and_the_operator_event(
    tmp_path: Path, server: FaultProviderServer
) -> None:
    server.script([stream_text(["Hel", "lo"], usage=(5, 2), provider="Anthropic")])
    step, events = await answer_once(tmp_path, server, resolve_response_provider=openrouter_response_provider)
    assert step.response.model_dump(exclude_none=True) == {"id": "chatcmpl-fault-0", "provider": "Anthropic"}
    (response,) = [e.payload for e in events if e.kind == "provider/response"]
    assert response == {
        "run_id": step.run_id,
        "attempt": 1,
        "step_number": 0,
        "response": {"id": "chatcmpl-fault-0", "provider": "Anthropic"},
    }


async def test_without_a_resolver_a_response_names_no_provider(tmp_path: Path, server: FaultProviderServer) -> None:
    # the gateway said which upstream served it, but the model declared no resolver: the runtime does not
    # read OpenRouter's key itself
    server.script([stream_text(["Hel", "lo"], usage=(5, 2), provider="Anthropic")])
    step, events = await answer_once(tmp_path, server)
    assert step.response.model_dump(exclude_none=True) == {"id": "chatcmpl-fault-0"}
    (response,) = [e.payload for e in events if e.kind == "provider/response"]
    assert response["response"] == {"id": "chatcmpl-fault-0"}


async def test_a_failing_resolver_is_logged_and_the_run_still_succeeds(
    tmp_path: Path, server: FaultProviderServer, caplog: pytest.LogCaptureFixture
) -> None:
    def broken(response: ModelResponse) -> str | None:
        raise RuntimeError("resolver bug")

    server.script([stream_text(["ok"], usage=(5, 1), provider="Anthropic")])
    with caplog.at_level(logging.WARNING, logger="threadline.models"):
        step, _ = await answer_once(tmp_path, server, resolve_response_provider=broken)
    assert step.response.model_dump(exclude_none=True) == {"id": "chatcmpl-fault-0"}
    assert any("resolve_response_provider" in r.getMessage() for r in caplog.records)


def test_openrouter_resolver_reads_only_a_named_upstream() -> None:
    routed = ModelResponse(parts=[], provider_details={"downstream_provider": "Groq"})
    assert openrouter_response_provider(routed) == "Groq"
    assert openrouter_response_provider(ModelResponse(parts=[])) is None
    assert openrouter_response_provider(ModelResponse(parts=[], provider_details={"downstream_provider": ""})) is None


def test_a_resolver_that_is_not_callable_is_refused_at_declaration() -> None:
    with pytest.raises(AgentRuntimeUsageError, match="resolve_response_provider is a callable"):
        define_model_registry(models={"m": {"model": "test", "resolve_response_provider": "downstream_provider"}})
    registry = define_model_registry(
        models={"m": {"model": "test", "resolve_response_provider": openrouter_response_provider}}
    )
    assert registry.resolve("m").resolve_response_provider is openrouter_response_provider
