"""The runtime against a real OpenAI-compatible HTTP server on loopback (pydantic-ai's ``OpenAIChatModel``
through ``OpenAIProvider``), with the provider's faults scripted per request.

No verdict depends on wall-clock timing except the idle timeout itself: a hang never ends, so the only
way out is the timeout. The generous ``wait_for`` around each result only keeps a broken build from
hanging the suite.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel
from pydantic_ai.messages import ModelRequest, UserPromptPart
from pydantic_ai.models import ModelRequestParameters

from threadline import (
    AgentRuntime,
    AgentRuntimeResult,
    AgentRuntimeUsageError,
    compose_agent_prompt,
    create_agent_runtime,
    create_memory_agent_runtime_store,
    create_sqlite_agent_runtime_store,
    define_agent_protocol,
    define_agent_tool,
    define_model_registry,
)
from threadline.testing import (
    AgentReplayExhaustedError,
    FaultProviderServer,
    ReplayedProviderError,
    create_fault_provider_server,
    create_replay_agent_provider,
    drop_after,
    finish_length,
    hang,
    malformed,
    rate_limited,
    record_agent_provider,
    server_error,
    stream_text,
    stream_tool_calls,
)

GUARD = 30  # seconds; only a broken build ever waits this long


class Context(BaseModel):
    user_id: str = "u1"


@define_agent_tool
async def weather(city: str) -> str:
    """The weather in a city."""
    return f"sunny in {city}"


@pytest.fixture(params=["memory", "sqlite"])
async def store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Any]:
    if request.param == "memory":
        yield create_memory_agent_runtime_store()
        return
    handle = create_sqlite_agent_runtime_store(tmp_path / "threadline.db")
    try:
        yield handle.store
    finally:
        await handle.close()


@pytest.fixture
async def server() -> AsyncIterator[FaultProviderServer]:
    async with create_fault_provider_server() as running:
        yield running


def make_runtime(store: Any, model: Any, **sections: Any) -> AgentRuntime:
    registry = define_model_registry(models={"fault": {"model": model, "context_window": 128_000}})
    return create_agent_runtime(
        protocol=define_agent_protocol(context=Context),
        store=store,
        models={"resolve": lambda: registry.resolve("fault")},
        **sections,
    )


async def ask(runtime: AgentRuntime, text: str = "hello", key: str = "k1", conversation_id: str = "c1") -> Any:
    ticket = runtime.submit(
        conversation_id=conversation_id,
        idempotency_key=key,
        context={"user_id": "u1"},
        parts=[{"type": "text", "text": text}],
    )
    return await asyncio.wait_for(ticket.result, GUARD)


async def run_one(store: Any, model: Any, **sections: Any) -> AgentRuntimeResult:
    runtime = make_runtime(store, model, **sections)
    try:
        return await ask(runtime)
    finally:
        await runtime.close(grace_period=0, force_timeout=GUARD)


def answer_text(result: AgentRuntimeResult) -> str:
    assert result.assistant is not None
    return "".join(p.text for p in result.assistant.parts if p.type == "text")


def dumped_parts(result: AgentRuntimeResult) -> list[dict[str, Any]]:
    assert result.assistant is not None
    return [p.model_dump(mode="json") for p in result.assistant.parts]


# ------------------------------------------------------------------------------------------ success


async def test_streamed_text_succeeds_with_the_exact_text_and_reported_usage(
    store: Any, server: FaultProviderServer
) -> None:
    server.script([stream_text(["Hel", "lo, ", "world."], usage=(12, 3))])
    operator_events: list[Any] = []
    result = await run_one(store, server.model(), operator_publish=operator_events.append)
    assert (result.terminal_reason, result.run.state, result.assistant.status) == ("success", "completed", "completed")
    assert answer_text(result) == "Hello, world."
    # the step reports exactly what the provider said, labelled as such
    (step,) = [e for e in operator_events if e.type == "step-finished"]
    assert (step.usage.input_tokens.value, step.usage.output_tokens.value) == (12, 3)
    assert step.usage.input_tokens.provenance == step.usage.output_tokens.provenance == "provider-reported"
    assert (step.finish_reason, step.response.id) == ("stop", "chatcmpl-fault-0")
    # the run's total adds that one reported step up (a total is 'computed', never 'estimated')
    assert (result.usage.input_tokens.value, result.usage.output_tokens.value) == (12, 3)
    assert result.usage.input_tokens.provenance == result.usage.output_tokens.provenance == "computed"
    assert result.usage.complete and result.usage.steps == 1
    assert len(server.requests) == 1
    sent = server.requests[0]
    assert sent.path == "/v1/chat/completions" and sent.body["stream"] is True
    assert sent.headers["authorization"] == "Bearer test"
    assert sent.messages[-1] == {"role": "user", "content": "hello"}


async def test_tool_call_then_text_sends_the_tool_result_back_with_the_call_id(
    store: Any, server: FaultProviderServer
) -> None:
    server.script(
        [
            stream_tool_calls([("call_w1", "weather", '{"city": "Paris"}')], text="Let me check.", usage=(20, 9)),
            stream_text("It is sunny in Paris.", usage=(41, 6)),
        ]
    )
    result = await run_one(store, server.model(), tools=[weather])
    assert result.terminal_reason == "success"
    assert [p["type"] for p in dumped_parts(result)] == ["text", "tool-call", "tool-result", "text"]
    call, outcome = result.assistant.parts[1], result.assistant.parts[2]
    assert (call.call_id, call.tool_name, call.input) == ("call_w1", "weather", {"city": "Paris"})
    assert (outcome.call_id, outcome.outcome, outcome.output) == ("call_w1", "success", "sunny in Paris")
    assert answer_text(result) == "Let me check.It is sunny in Paris."
    assert (result.usage.input_tokens.value, result.usage.output_tokens.value) == (61, 15)

    assert len(server.requests) == 2
    first, second = server.requests
    assert [t["function"]["name"] for t in first.tools] == ["weather"]
    assistant = next(m for m in second.messages if m["role"] == "assistant")
    assert [c["id"] for c in assistant["tool_calls"]] == ["call_w1"]
    assert json.loads(assistant["tool_calls"][0]["function"]["arguments"]) == {"city": "Paris"}
    tool_messages = second.tool_messages()
    assert len(tool_messages) == 1
    assert tool_messages[0]["tool_call_id"] == "call_w1"
    assert "sunny in Paris" in tool_messages[0]["content"]


async def test_instructions_reach_the_wire_as_system_messages_on_every_request(
    store: Any, server: FaultProviderServer
) -> None:
    """Each contribution is its own instruction part (the prompt-caching hook), and OpenAI Chat sends each
    part as a system message of its own, in order."""
    prompt = compose_agent_prompt(
        [
            {"name": "product", "stability": "stable", "render": lambda ctx: "You are a weather assistant."},
            {"name": "user", "stability": "session", "render": lambda ctx: f"Help user {ctx.context.user_id}."},
        ]
    )
    server.script([stream_tool_calls([("call_1", "weather", '{"city": "Oslo"}')]), stream_text("Cold.")])
    result = await run_one(store, server.model(), tools=[weather], prompt=prompt)
    assert result.terminal_reason == "success"
    assert len(server.requests) == 2
    for sent in server.requests:
        assert sent.messages[0]["role"] == "system"
        assert sent.system_messages == ["You are a weather assistant.", "Help user u1."]


# ------------------------------------------------------------------------------------------ faults


async def test_rate_limited_is_a_provider_failure_after_exactly_one_request(
    store: Any, server: FaultProviderServer
) -> None:
    server.script([rate_limited(retry_after=1), stream_text("never sent")])
    result = await run_one(store, server.model())
    assert (result.terminal_reason, result.run.state, result.assistant.status) == (
        "provider_failure",
        "failed",
        "failed",
    )
    assert len(server.requests) == 1  # max_retries=0: the SDK did not retry on its own
    assert server.remaining == 1


@pytest.mark.parametrize("status", [500, 503])
async def test_server_error_is_a_provider_failure(store: Any, server: FaultProviderServer, status: int) -> None:
    server.script([server_error(status)])
    result = await run_one(store, server.model())
    assert (result.terminal_reason, result.assistant.status) == ("provider_failure", "failed")
    assert len(server.requests) == 1


async def test_a_hanging_stream_ends_in_timeout_and_the_client_hangs_up(
    store: Any, server: FaultProviderServer
) -> None:
    server.script([hang(["Thinking about it "])])  # one chunk, then silence for ever
    result = await run_one(store, server.model(), loop={"idle_timeout": 0.3})
    assert (result.terminal_reason, result.run.state, result.assistant.status) == ("timeout", "cancelled", "failed")
    assert answer_text(result) == "Thinking about it "  # what streamed before the silence stays as evidence
    await asyncio.wait_for(server.wait_for_disconnect(0), GUARD)
    assert server.requests[0].client_disconnected and server.disconnects == [0]


@pytest.mark.parametrize("headers", [True, False], ids=["headers-then-silence", "no-headers"])
async def test_a_provider_silent_before_its_first_chunk_ends_in_timeout(
    server: FaultProviderServer, headers: bool
) -> None:
    server.script([hang(headers=headers)])
    runtime = make_runtime(create_memory_agent_runtime_store(), server.model(), loop={"idle_timeout": 0.3})
    try:
        ticket = runtime.submit(
            conversation_id="c1", idempotency_key="k1", context={}, parts=[{"type": "text", "text": "hello"}]
        )
        # a correct loop ends this in about 0.3 s; the bound only decides how long the known bug is waited for
        result = await asyncio.wait_for(asyncio.shield(ticket.result), 3)
    finally:
        await runtime.close(grace_period=0, force_timeout=GUARD)
    assert result.terminal_reason == "timeout"


@pytest.mark.parametrize("variant", ["invalid-json", "wrong-shape", "error-event"])
async def test_a_malformed_chunk_is_a_provider_failure(store: Any, server: FaultProviderServer, variant: str) -> None:
    server.script([malformed(variant, ["Partial "])])  # type: ignore[arg-type]
    result = await run_one(store, server.model())
    assert (result.terminal_reason, result.assistant.status) == ("provider_failure", "failed")
    assert answer_text(result) == "Partial "


async def test_a_malformed_first_chunk_is_a_provider_failure(store: Any, server: FaultProviderServer) -> None:
    server.script([malformed()])
    result = await run_one(store, server.model())
    assert (result.terminal_reason, result.assistant.status) == ("provider_failure", "failed")
    assert answer_text(result) == ""


async def test_a_connection_dropped_mid_stream_is_a_provider_failure_keeping_the_partial_text(
    store: Any, server: FaultProviderServer
) -> None:
    server.script([drop_after(2, ["Par", "tial ", "never"])])
    result = await run_one(store, server.model())
    assert (result.terminal_reason, result.run.state, result.assistant.status) == (
        "provider_failure",
        "failed",
        "failed",
    )
    assert dumped_parts(result) == [{"type": "text", "text": "Partial "}]


async def test_finish_reason_length_is_a_provider_stop(store: Any, server: FaultProviderServer) -> None:
    server.script([finish_length(["The answer is ", "cut"], usage=(9, 4))])
    result = await run_one(store, server.model())
    assert (result.terminal_reason, result.run.state, result.assistant.status) == (
        "provider_stop",
        "completed",
        "completed",
    )
    assert answer_text(result) == "The answer is cut"


@pytest.mark.parametrize("fault", [server_error(500), drop_after(1, ["Half "])], ids=["500", "dropped"])
async def test_a_failed_attempt_stays_in_the_spend_as_an_unreported_step(
    store: Any, server: FaultProviderServer, fault: Any
) -> None:
    server.script([fault])
    result = await run_one(store, server.model())
    assert result.terminal_reason == "provider_failure"
    assert result.usage.steps == 1 and not result.usage.complete
    assert result.usage.input_tokens.provenance == "unavailable"


async def test_an_exhausted_script_answers_500_with_a_clear_message(store: Any, server: FaultProviderServer) -> None:
    result = await run_one(store, server.model())
    assert result.terminal_reason == "provider_failure"
    assert len(server.requests) == 1 and server.requests[0].behaviour is None


# ------------------------------------------------------------------------------------------ replay


async def test_a_recorded_session_replays_offline_with_identical_answers(store: Any, tmp_path: Path) -> None:
    questions = ["Weather in Paris?", "And tomorrow?"]
    async with create_fault_provider_server() as server:
        server.script(
            [
                stream_tool_calls([("call_p1", "weather", '{"city": "Paris"}')], text="Checking.", usage=(30, 8)),
                stream_text(["It is ", "sunny."], usage=(52, 4)),
                stream_text(["Also ", "sunny ", "tomorrow."], usage=(60, 5)),
            ]
        )
        recorder = record_agent_provider(server.model())
        runtime = make_runtime(store, recorder, tools=[weather])
        recorded = [await ask(runtime, q, key=f"k{i}") for i, q in enumerate(questions)]
        await runtime.close()
    assert [r.terminal_reason for r in recorded] == ["success", "success"]
    assert len(recorder.recording) == 3  # one turn per provider request

    recording = json.loads(json.dumps(recorder.recording))  # it is plain JSON
    replay = create_replay_agent_provider(recording)
    assert replay.system == "openai" and replay.model_name == "fault-model"
    handle = create_sqlite_agent_runtime_store(tmp_path / "replay.db")
    try:
        runtime = make_runtime(handle.store, replay, tools=[weather])
        replayed = [await ask(runtime, q, key=f"k{i}") for i, q in enumerate(questions)]
        await runtime.close()
    finally:
        await handle.close()
    assert [r.terminal_reason for r in replayed] == ["success", "success"]
    assert [answer_text(r) for r in replayed] == [answer_text(r) for r in recorded]
    assert [dumped_parts(r) for r in replayed] == [dumped_parts(r) for r in recorded]
    assert answer_text(replayed[1]) == "Also sunny tomorrow."
    assert [(r.usage.input_tokens.value, r.usage.output_tokens.value) for r in replayed] == [(82, 12), (60, 5)]
    assert replay.remaining == 0

    with pytest.raises(AgentReplayExhaustedError) as caught:
        async with replay.request_stream(
            [ModelRequest(parts=[UserPromptPart("more?")])], None, ModelRequestParameters()
        ):
            pass
    assert (caught.value.requested, caught.value.recorded) == (3, 3)


async def test_a_recorded_provider_failure_replays_as_a_provider_failure(store: Any) -> None:
    async with create_fault_provider_server() as server:
        server.script([drop_after(1, ["Half "])])
        recorder = record_agent_provider(server.model())
        recorded = await run_one(store, recorder)
    assert recorded.terminal_reason == "provider_failure"
    assert recorder.recording[0][-1]["type"] == "error"

    replay = create_replay_agent_provider(recorder.recording)
    replayed = await run_one(create_memory_agent_runtime_store(), replay)
    assert replayed.terminal_reason == "provider_failure"
    assert dumped_parts(replayed) == dumped_parts(recorded) == [{"type": "text", "text": "Half "}]
    with pytest.raises(ReplayedProviderError):
        async with create_replay_agent_provider(recorder.recording).request_stream(
            [ModelRequest(parts=[UserPromptPart("x")])], None, ModelRequestParameters()
        ) as stream:
            async for _ in stream:
                pass


async def test_a_hand_written_recording_replays_tool_calls_and_text(store: Any) -> None:
    replay = create_replay_agent_provider(
        [
            [{"type": "tool-call", "call_id": "call_r", "tool_name": "weather", "args": '{"city": "Rome"}'}],
            ["Sunny ", "in Rome.", {"type": "usage", "input_tokens": 7, "output_tokens": 2}],
        ]
    )
    result = await run_one(store, replay, tools=[weather])
    assert result.terminal_reason == "success"
    assert [p["type"] for p in dumped_parts(result)] == ["tool-call", "tool-result", "text"]
    assert result.assistant.parts[1].output == "sunny in Rome"
    assert answer_text(result) == "Sunny in Rome."
    assert (result.usage.input_tokens.value, result.usage.steps, result.usage.complete) == (7, 2, False)
    with pytest.raises(AgentRuntimeUsageError):
        create_replay_agent_provider([[{"type": "nonsense"}]])


# ------------------------------------------------------------------------------------------ the server itself


async def test_the_server_listens_on_loopback_only_and_stops_cleanly() -> None:
    async with create_fault_provider_server() as server:
        assert server.base_url.startswith("http://127.0.0.1:") and server.base_url.endswith("/v1")
        port = server.port
        server.script([hang(["held "])])
        model = server.model()
        params = ModelRequestParameters()
        async with model.request_stream([ModelRequest(parts=[UserPromptPart("hi")])], None, params) as stream:
            async for _event in stream:
                break  # the first chunk arrived; the response is now held open
        await asyncio.wait_for(server.wait_for_disconnect(0), GUARD)
        server.script([hang(["held for ever "])])
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        body = b'{"model": "m", "stream": true, "messages": []}'
        writer.write(
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n" % len(body) + body
        )
        await writer.drain()
        assert (await reader.readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 200")
    # leaving the block ended the held response (not recorded as the client leaving) and stopped listening
    rest = b""
    with contextlib.suppress(ConnectionError):
        rest = await asyncio.wait_for(reader.read(), GUARD)  # returns: the held response ended with the server
    assert b"held for ever" in rest and not rest.endswith(b"0\r\n\r\n")  # cut off, never completed
    writer.close()
    with contextlib.suppress(ConnectionError):
        await writer.wait_closed()
    assert server.disconnects == [0]
    with pytest.raises(OSError):
        await asyncio.open_connection("127.0.0.1", port)


async def test_unknown_routes_do_not_consume_the_script(server: FaultProviderServer) -> None:
    server.script([stream_text("kept")])
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    writer.write(b"GET /v1/models HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
    await writer.drain()
    reply = await asyncio.wait_for(reader.read(), GUARD)
    writer.close()
    await writer.wait_closed()
    assert reply.startswith(b"HTTP/1.1 404") and server.remaining == 1
    assert server.requests[0].path == "/v1/models" and server.requests[0].behaviour is None


async def test_a_failed_attempt_s_step_finished_carries_the_response_identity_it_was_given(
    store: Any, server: FaultProviderServer
) -> None:
    """The provider named its response before the connection dropped: the failed attempt's operator
    ``step-finished`` says which response it was, and the run's durable usage counts that attempt."""
    server.script([drop_after(1, ["Half ", "never"])])
    events: list[Any] = []
    runtime = make_runtime(store, server.model(), operator_publish=events.append)
    try:
        result = await ask(runtime)
    finally:
        await runtime.close(grace_period=0, force_timeout=GUARD)
    assert result.terminal_reason == "provider_failure"
    finished = [e for e in events if e.type == "step-finished"]
    assert len(finished) == 1 and finished[0].response is not None
    assert finished[0].response.id.startswith("chatcmpl-fault")
    stored = await store.load_run(conversation_id="c1", run_id=result.run.id)
    assert stored.run.usage.steps == 1 and not stored.run.usage.complete
