"""Provider metadata on text, tool calls and reasoning survives the canonical records and goes back only
to the provider that produced it.

For OpenAI (Responses API), Anthropic and Google, a response is parsed by pydantic-ai's own parser for
that provider (``_process_response``), turned into canonical parts by the loop (``canonical_parts``),
stored and read back as JSON, projected, and mapped to the wire by pydantic-ai's own request mapper. For
the provider that produced it the request is exactly the one pydantic-ai maps from its own response
(item ids, encrypted reasoning, Anthropic thinking and redacted-thinking signatures, Gemini thought
signatures on text and function calls); for any other provider none of it is sent.
"""

from __future__ import annotations

import asyncio
import json
from datetime import UTC, datetime
from typing import Any

import pytest
from pydantic_ai.messages import (
    ModelMessage,
    ModelRequest,
    ModelResponse,
    TextPart as AiTextPart,
    ToolReturnPart,
    UserPromptPart,
)
from pydantic_ai.models import ModelRequestParameters

from threadline.history import project_agent_history
from threadline.loop import canonical_parts
from threadline.records import Message, TextPart, ToolCallPart, ToolResultPart

anthropic_types = pytest.importorskip("anthropic.types.beta", reason="needs the anthropic extra")
genai = pytest.importorskip("google.genai.types", reason="needs the google extra")

from openai.types.responses import Response  # noqa: E402
from pydantic_ai.models.anthropic import AnthropicModel  # noqa: E402
from pydantic_ai.models.google import GoogleModel  # noqa: E402
from pydantic_ai.models.openai import OpenAIResponsesModel  # noqa: E402
from pydantic_ai.providers.anthropic import AnthropicProvider  # noqa: E402
from pydantic_ai.providers.google import GoogleProvider  # noqa: E402
from pydantic_ai.providers.openai import OpenAIProvider  # noqa: E402

NOW = datetime(2026, 1, 1, tzinfo=UTC)
PARAMS = ModelRequestParameters()


class Provider:
    """One provider: its model, a response its API returned, parsed by pydantic-ai, and how to map."""

    def __init__(self, model: Any, response: ModelResponse, secrets: tuple[str, ...]) -> None:
        self.model = model
        self.response = response
        self.secrets = secrets
        """Strings only the producing provider may ever see on the wire."""

    @property
    def name(self) -> str:
        return self.model.system

    def wire(self, messages: list[ModelMessage]) -> Any:
        if isinstance(self.model, OpenAIResponsesModel):
            return asyncio.run(self.model._map_messages(messages, {}, PARAMS))[1]
        if isinstance(self.model, AnthropicModel):
            return asyncio.run(self.model._map_message(messages, PARAMS, {}))[1]
        return asyncio.run(self.model._map_messages(messages, PARAMS))[1]


def openai() -> Provider:
    model = OpenAIResponsesModel("gpt-5", provider=OpenAIProvider(api_key="x"))
    api = Response.model_validate(
        {
            "id": "resp_1",
            "created_at": 0,
            "model": "gpt-5",
            "object": "response",
            "parallel_tool_calls": True,
            "tool_choice": "auto",
            "tools": [],
            "status": "completed",
            "output": [
                {
                    "type": "reasoning",
                    "id": "rs_secret",
                    "summary": [{"type": "summary_text", "text": "planning"}],
                    "encrypted_content": "ENCRYPTED-secret",
                },
                {
                    "type": "message",
                    "id": "msg_secret",
                    "role": "assistant",
                    "status": "completed",
                    "content": [{"type": "output_text", "text": "Let me look.", "annotations": []}],
                },
                {
                    "type": "function_call",
                    "id": "fc_secret",
                    "call_id": "call_1",
                    "name": "lookup",
                    "arguments": '{"q": "x"}',
                    "status": "completed",
                },
            ],
        }
    )
    response = model._process_response(api, {}, PARAMS)
    return Provider(model, response, ("rs_secret", "ENCRYPTED-secret", "msg_secret", "fc_secret", "planning"))


def anthropic() -> Provider:
    model = AnthropicModel("claude-sonnet-4-5", provider=AnthropicProvider(api_key="x"))
    api = anthropic_types.BetaMessage.model_validate(
        {
            "id": "msg_01",
            "type": "message",
            "role": "assistant",
            "model": "claude-sonnet-4-5",
            "stop_reason": "tool_use",
            "stop_sequence": None,
            "usage": {"input_tokens": 1, "output_tokens": 2},
            "content": [
                {"type": "thinking", "thinking": "planning", "signature": "SIGNATURE-secret"},
                {"type": "redacted_thinking", "data": "REDACTED-secret"},
                {"type": "text", "text": "Let me look."},
                {"type": "tool_use", "id": "call_1", "name": "lookup", "input": {"q": "x"}},
            ],
        }
    )
    response = model._process_response(api, PARAMS, {})
    return Provider(model, response, ("SIGNATURE-secret", "REDACTED-secret", "planning"))


def google() -> Provider:
    model = GoogleModel("gemini-2.5-flash", provider=GoogleProvider(api_key="x"))
    api = genai.GenerateContentResponse(
        response_id="r1",
        model_version="gemini-2.5-flash",
        candidates=[
            genai.Candidate(
                finish_reason="STOP",
                content=genai.Content(
                    role="model",
                    parts=[
                        genai.Part(text="planning", thought=True, thought_signature=b"think-secret"),
                        genai.Part(text="Let me look.", thought_signature=b"text-secret"),
                        genai.Part(
                            function_call=genai.FunctionCall(name="lookup", args={"q": "x"}, id="call_1"),
                            thought_signature=b"call-secret",
                        ),
                    ],
                ),
            )
        ],
    )
    response = model._process_response(api, PARAMS)
    return Provider(model, response, ("think-secret", "text-secret", "call-secret", "planning"))


PROVIDERS = {"openai": openai, "anthropic": anthropic, "google": google}


def stored(provider: Provider) -> list[Message]:
    """The conversation as the store keeps it: the response's canonical parts (read back from JSON), the
    tool's result, and the answer after it."""
    parts = [*canonical_parts(provider.response, provider.name)]
    parts.append(ToolResultPart(call_id="call_1", tool_name="lookup", output="ok"))
    parts.append(TextPart(text="It is x."))
    records = [
        Message(
            id="u1",
            conversation_id="c",
            role="user",
            status="committed",
            parts=(TextPart(text="hi"),),
            created_at=NOW,
            seq=1,
            position=1,
        ),
        Message(
            id="a1",
            conversation_id="c",
            role="assistant",
            status="completed",
            parts=tuple(parts),
            created_at=NOW,
            seq=2,
            position=2,
        ),
    ]
    return [Message.model_validate_json(m.model_dump_json()) for m in records]


def native(provider: Provider) -> list[ModelMessage]:
    """The same conversation had pydantic-ai kept the provider's response itself."""
    return [
        ModelRequest(parts=[UserPromptPart("hi")]),
        provider.response,
        ModelRequest(parts=[ToolReturnPart("lookup", "ok", tool_call_id="call_1")]),
        ModelResponse(parts=[AiTextPart("It is x.")]),
    ]


def dumped(wire: Any) -> str:
    return json.dumps(wire, default=lambda v: v.decode() if isinstance(v, bytes) else str(v))


@pytest.mark.parametrize("name", sorted(PROVIDERS))
def test_the_producing_provider_gets_its_metadata_back_exactly(name: str) -> None:
    provider = PROVIDERS[name]()
    history = stored(provider)
    answer = history[1]
    # every part that carried metadata keeps it in the versioned envelope, naming its provider
    enveloped = [p for p in answer.parts if getattr(p, "envelope", None) is not None]
    assert enveloped and all(p.envelope.version == 1 and p.envelope.provider == name for p in enveloped)
    projected = project_agent_history(history, {"provider_name": name})
    assert provider.wire(projected) == provider.wire(native(provider))
    assert all(secret in dumped(provider.wire(projected)) for secret in provider.secrets)


@pytest.mark.parametrize(("origin", "target"), [(o, t) for o in sorted(PROVIDERS) for t in sorted(PROVIDERS) if o != t])
def test_another_provider_gets_none_of_it(origin: str, target: str) -> None:
    produced, receiving = PROVIDERS[origin](), PROVIDERS[target]()
    projected = project_agent_history(stored(produced), {"provider_name": receiving.name})
    wire = dumped(receiving.wire(projected))
    assert "Let me look." in wire and "It is x." in wire and "call_1" in wire  # the conversation itself goes
    assert not [secret for secret in produced.secrets if secret in wire]


def test_a_tool_call_envelope_restores_the_item_id_and_details_only_for_its_provider() -> None:
    history = stored(openai())
    calls = [p for p in history[1].parts if isinstance(p, ToolCallPart)]
    assert calls[0].envelope is not None and calls[0].envelope.data == {"id": "fc_secret"}
    own = project_agent_history(history, {"provider_name": "openai"})[1].parts[-1]
    assert (own.tool_call_id, own.id, own.provider_name) == ("call_1", "fc_secret", "openai")
    other = project_agent_history(history, {"provider_name": "google"})[1].parts[-1]
    assert (other.tool_call_id, other.id, other.provider_name, other.provider_details) == ("call_1", None, None, None)


def test_an_empty_text_part_is_kept_for_its_thought_signature() -> None:
    signed = ModelResponse(
        parts=[AiTextPart("", provider_name="google", provider_details={"thought_signature": "c2ln"})]
    )
    (part,) = canonical_parts(signed, "google")
    assert part.type == "text" and part.text == "" and part.envelope is not None
    assert canonical_parts(ModelResponse(parts=[AiTextPart("")]), "google") == []  # nothing to keep
    history = [
        stored(google())[0],
        Message(
            id="a1",
            conversation_id="c",
            role="assistant",
            status="completed",
            parts=(part,),
            created_at=NOW,
            seq=2,
            position=2,
        ),
    ]
    own = project_agent_history(history, {"provider_name": "google"})
    assert own[1].parts[0].provider_details == {"thought_signature": "c2ln"}
    assert len(project_agent_history(history, {"provider_name": "openai"})) == 1  # empty, not sent
