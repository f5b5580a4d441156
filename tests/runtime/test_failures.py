"""Failures are visible: ``result.error`` and the durable ``run.failure`` say why a run failed (origin,
exception type, HTTP status, a bounded summary with no request body and no credential), delivery events
never carry it, and the stdlib log (``threadline.*``, no handler installed) has one line per failure, with
the traceback — and nothing at all on the happy path."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

import pytest
from pydantic_ai.models.function import DeltaToolCall

from threadline import (
    AgentRunFailure,
    AgentStoreUnavailableError,
    AppError,
    create_agent_runtime_event_sink,
    create_memory_agent_runtime_store,
    define_agent_protocol,
    define_agent_tool,
)
from threadline.records import FAILURE_SUMMARY_MAX
from threadline.testing import create_fault_provider_server, server_error

from .conftest import Context, Script, make_runtime, submit

WAIT = 10


async def run_one(store: Any, script: Script, message: str = "hello", **sections: Any) -> Any:
    runtime = make_runtime(store, script, **sections)
    try:
        return await asyncio.wait_for(submit(runtime, "k", message).result, WAIT)
    finally:
        await runtime.close()


def records(caplog: pytest.LogCaptureFixture, logger: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == logger]


@define_agent_tool
async def lookup(query: str) -> dict[str, str]:
    """Looks something up."""
    return {"query": query, "answer": "42"}


@define_agent_tool
async def broken(query: str) -> str:
    """Always fails."""
    raise KeyError("the tool's own secret detail")


def calls_then_answers(tool: str) -> Any:
    async def handler(i: int, messages: list[Any], info: Any) -> AsyncIterator[Any]:
        if i == 0:
            yield {0: DeltaToolCall(name=tool, json_args='{"query": "x"}', tool_call_id="call-1")}
        else:
            yield "done"

    return handler


async def test_the_happy_path_logs_nothing_and_the_library_installs_no_handler(
    store: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="threadline")
    result = await run_one(store, Script(calls_then_answers("lookup")), tools=[lookup], publish=lambda e: None)
    assert result.terminal_reason == "success" and result.error is None
    assert [r for r in caplog.records if r.name.startswith("threadline")] == []
    assert logging.getLogger("threadline").handlers == []
    assert logging.getLogger("threadline.runtime").handlers == []


async def test_a_provider_http_error_says_status_origin_and_the_providers_message_only(
    caplog: pytest.LogCaptureFixture, tmp_path: Any
) -> None:
    from threadline import create_sqlite_agent_runtime_store

    caplog.set_level(logging.DEBUG, logger="threadline")
    events: list[Any] = []
    async with create_fault_provider_server() as server:
        server.script([server_error(503, "upstream overloaded; key sk-live1234567890abcdef rejected")])
        script = Script()
        script.model = server.model()  # type: ignore[assignment]
        handle = create_sqlite_agent_runtime_store(tmp_path / "t.db")
        try:
            result = await run_one(handle.store, script, "my password is hunter2-PRIVATE", publish=events.append)
            loaded = await handle.store.load_run(conversation_id="c1", run_id=result.run.id)
        finally:
            await handle.aclose()
        assert "hunter2-PRIVATE" in server.requests[0].body["messages"][-1]["content"]  # it was sent ...
    error = result.error
    assert result.terminal_reason == "provider_failure"
    assert isinstance(error, AgentRunFailure)
    assert (error.origin, error.status_code) == ("provider", 503)
    assert error.exception_type == "pydantic_ai.exceptions.ModelOverloadedError"  # a ModelHTTPError too
    assert "HTTP 503" in error.summary and "upstream overloaded" in error.summary
    assert "hunter2" not in error.model_dump_json()  # ... and is in no failure record
    assert "sk-live1234567890abcdef" not in error.summary and "sk-***" in error.summary
    # the store keeps the same summary on the run
    assert loaded is not None and loaded.run.failure == error
    # delivery events never carry it
    assert events
    for event in events:
        assert '"failure"' not in event.model_dump_json() and "upstream" not in event.model_dump_json()
    terminal = [e for e in events if e.type == "terminal"]
    assert terminal and terminal[0].terminal_reason == "provider_failure"
    # the log has the traceback, once
    lines = [r for r in records(caplog, "threadline.runtime") if r.levelno >= logging.ERROR]
    assert len(lines) == 1 and lines[0].exc_info is not None
    assert "provider_failure" in lines[0].getMessage()


async def test_credentials_in_an_error_are_masked_and_the_summary_is_bounded(store: Any) -> None:
    async def failing(i: int, messages: list[Any], info: Any) -> AsyncIterator[Any]:
        yield "partial"
        raise ConnectionError(
            "POST https://bob:s3cretpass@example.test/v1 failed; Authorization: Bearer abc.def-123 "
            "api_key=AKIA-very-secret " + "x" * 2000
        )

    result = await run_one(store, Script(failing))
    error = result.error
    assert (result.terminal_reason, error.origin, error.exception_type) == (
        "provider_failure",
        "provider",
        "builtins.ConnectionError",
    )
    assert error.status_code is None
    for secret in ("s3cretpass", "abc.def-123", "AKIA-very-secret"):
        assert secret not in error.summary
    assert len(error.summary) <= FAILURE_SUMMARY_MAX and error.summary.endswith("…")


async def test_each_origin_names_where_the_failure_happened(store: Any) -> None:
    def fail(*args: Any) -> Any:
        raise ValueError("application callback failed")

    by_origin = {}
    result = await run_one(create_memory_agent_runtime_store(), Script(), loop={"prepare_step": fail})
    by_origin["runtime"] = result.error
    result = await run_one(
        create_memory_agent_runtime_store(),
        Script(calls_then_answers("lookup")),
        tools=[lookup],
        loop={"stop_policies": [{"name": "judge", "should_stop": fail}]},
    )
    by_origin["policy"] = result.error
    result = await run_one(
        create_memory_agent_runtime_store(),
        Script(calls_then_answers("lookup")),
        tools=[lookup],
        loop={"tool_approval": fail, "tool_approval_secret": "s"},
    )
    by_origin["tool"] = result.error
    for origin, error in by_origin.items():
        assert (error.origin, error.exception_type, error.summary) == (
            origin,
            "builtins.ValueError",
            "application callback failed",
        ), origin


async def test_a_failing_store_is_a_storage_failure(store: Any, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="threadline")
    original = store.checkpoint_run_assistant

    async def unavailable(**kwargs: Any) -> Any:
        if kwargs.get("operation") is not None and kwargs["operation"].phase == "started":
            raise AgentStoreUnavailableError("the database went away")
        return await original(**kwargs)

    store.checkpoint_run_assistant = unavailable
    result = await run_one(store, Script(calls_then_answers("lookup")), tools=[lookup])
    assert result.terminal_reason == "runtime_failure"
    assert (result.error.origin, result.error.exception_type) == (
        "storage",
        "threadline.errors.AgentStoreUnavailableError",
    )
    # the store retry that gave up says so (a warning: the run's own line carries the traceback)
    gave_up = records(caplog, "threadline.store")
    assert len(gave_up) == 1 and gave_up[0].levelno == logging.WARNING
    assert "giving up" in gave_up[0].getMessage()


async def cut_after_first_chunk(i: int, messages: list[Any], info: Any) -> AsyncIterator[Any]:
    yield "partial"
    raise ConnectionError("Failed to process successful response")


async def test_a_stream_cut_mid_read_blames_the_provider_and_a_store_failure_there_does_not(store: Any) -> None:
    cut = await run_one(store, Script(cut_after_first_chunk))
    assert (cut.terminal_reason, cut.error.origin) == ("provider_failure", "provider")

    own = create_memory_agent_runtime_store()
    original = own.checkpoint_run_assistant

    async def unavailable(**kwargs: Any) -> Any:
        if kwargs.get("operation") is not None and kwargs["operation"].phase == "first-output":
            raise AgentStoreUnavailableError("operation storage unavailable")
        return await original(**kwargs)

    own.checkpoint_run_assistant = unavailable
    result = await run_one(own, Script(cut_after_first_chunk), loop={"checkpoint_every_events": 1})
    assert (result.terminal_reason, result.error.origin) == ("runtime_failure", "storage")


async def test_a_refused_answer_says_the_protocol_refused_it(store: Any, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="threadline")

    async def blank(i: int, messages: list[Any], info: Any) -> AsyncIterator[Any]:
        yield "   "

    protocol = define_agent_protocol(context=Context, terminal_acceptance="require-output")
    result = await run_one(store, Script(blank), protocol=protocol)
    assert result.terminal_reason == "output_rejected"
    assert (result.error.origin, result.error.exception_type) == ("policy", None)
    assert "'require-output'" in result.error.summary
    line = records(caplog, "threadline.runtime")
    assert len(line) == 1 and line[0].levelno == logging.WARNING and line[0].exc_info is None


async def test_a_timeout_is_the_providers_silence(store: Any) -> None:
    async def silent(i: int, messages: list[Any], info: Any) -> AsyncIterator[Any]:
        yield "thinking"
        await asyncio.Event().wait()
        yield "never"

    result = await run_one(store, Script(silent), loop={"idle_timeout": 0.05})
    assert result.terminal_reason == "timeout"
    assert (result.error.origin, result.error.exception_type) == ("provider", "builtins.TimeoutError")
    assert "idle_timeout" in result.error.summary


async def test_interrupted_and_answered_runs_have_no_error(store: Any) -> None:
    gate = asyncio.Event()

    async def slow(i: int, messages: list[Any], info: Any) -> AsyncIterator[Any]:
        if i == 0:
            yield "first"
            await gate.wait()
        yield "second answer"

    script = Script(slow)
    runtime = make_runtime(store, script, runs={"input_policy": "interrupt"})
    first = submit(runtime, "k1", "one")
    await script.wait_entered(0)
    second = submit(runtime, "k2", "two")
    one, two = await asyncio.wait_for(asyncio.gather(first.result, second.result), WAIT)
    await runtime.close()
    assert (one.terminal_reason, one.error) == ("interrupted", None)
    assert (two.terminal_reason, two.error, two.text) == ("success", None, "second answer")


async def test_a_raising_tool_shows_the_model_the_envelope_and_logs_the_traceback(
    store: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="threadline")
    script = Script(calls_then_answers("broken"))
    result = await run_one(store, script, tools=[broken])
    assert result.terminal_reason == "success" and result.error is None
    seen = [p for m in script.calls[1] for p in getattr(m, "parts", ()) if p.part_kind == "tool-return"]
    assert [p.content for p in seen] == [{"error": "INTERNAL_SERVER_ERROR", "retryable": False}]
    lines = records(caplog, "threadline.tools")
    assert len(lines) == 1 and lines[0].levelno == logging.ERROR
    assert lines[0].exc_info is not None and isinstance(lines[0].exc_info[1], KeyError)
    assert "'broken'" in lines[0].getMessage() and "INTERNAL_SERVER_ERROR" in lines[0].getMessage()


async def test_an_app_error_from_a_tool_is_an_info_line_without_traceback(
    store: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="threadline")

    @define_agent_tool(name="refuses")
    async def refuses(query: str) -> str:
        raise AppError("NOT_FOUND", "no such order", hint="ask for the order id")

    await run_one(store, Script(calls_then_answers("refuses")), tools=[refuses])
    lines = records(caplog, "threadline.tools")
    assert [(r.levelno, r.exc_info) for r in lines] == [(logging.INFO, None)]
    assert "NOT_FOUND" in lines[0].getMessage()


async def test_a_failing_publisher_is_logged_once_not_per_event(store: Any, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="threadline")
    seen: list[Any] = []

    def publish(event: Any) -> None:
        seen.append(event)
        raise RuntimeError("the transport is down")

    result = await run_one(store, Script(calls_then_answers("lookup")), tools=[lookup], publish=publish)
    assert result.terminal_reason == "success"
    assert len(seen) > 5
    lines = records(caplog, "threadline.events")
    assert len(lines) == 1 and lines[0].exc_info is not None
    assert isinstance(lines[0].exc_info[1], RuntimeError)


async def test_a_sink_without_an_error_hook_logs_its_failures(store: Any, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="threadline")

    def deliver(event: Any) -> None:
        raise OSError("socket closed")

    sink = create_agent_runtime_event_sink(deliver=deliver)
    result = await run_one(store, Script(), publish=sink)
    await asyncio.wait_for(sink.aclose(), WAIT)
    assert result.terminal_reason == "success" and sink.failed > 1
    lines = records(caplog, "threadline.events")
    assert len(lines) == 1 and isinstance(lines[0].exc_info[1], OSError)


async def test_a_duplicate_of_a_failed_run_admits_without_the_failure(store: Any) -> None:
    async def failing(i: int, messages: list[Any], info: Any) -> AsyncIterator[Any]:
        raise ConnectionResetError("gone")
        yield ""

    events: list[Any] = []
    runtime = make_runtime(store, Script(failing), publish=events.append)
    first = await asyncio.wait_for(submit(runtime, "k", "hello").result, WAIT)
    again = submit(runtime, "k", "hello")
    admission = await asyncio.wait_for(again.admission, WAIT)
    duplicate = await asyncio.wait_for(again.result, WAIT)
    await runtime.close()
    assert first.error is not None and duplicate.error == first.error  # the result reads the stored run
    assert admission.outcome == "duplicate"
    admissions = [e for e in events if e.type == "admission" and e.outcome == "duplicate"]
    assert len(admissions) == 1 and admissions[0].run.failure is None
