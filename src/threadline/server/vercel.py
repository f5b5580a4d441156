"""``POST /api/chat``: the Vercel AI SDK UI message stream, so an existing ``useChat`` front end works with no
custom client.

The request is ``useChat``'s (pydantic-ai's ``SubmitMessage``): ``id`` is the conversation, the last message
is the new input (the server owns the history, so earlier messages are not read), its ``id`` the
idempotency key (a retried request finds the same run). A last message from the assistant carrying
approval decisions (AI SDK 6 ``addToolApprovalResponse``) answers those approvals instead. The response is
the UI message stream of the run that answers: ``start`` (with the stored assistant message id),
``start-step``/``finish-step`` per model request, text and reasoning blocks, ``tool-input-available`` and
``tool-output-available``/``tool-output-error`` per tool call, ``tool-approval-request`` for a call waiting
for a person, then ``finish`` (``abort`` for an interrupted run, ``error`` then ``finish`` for a failed one)
and ``[DONE]``. The chunks are pydantic-ai's models (``pydantic_ai.ui.vercel_ai.response_types``).

The run is durable: a client that disconnects does not stop it (interrupt through the control protocol or
the REST route). A stream that falls behind finishes from the stored answer. A ``context`` field in the
body (``useChat``'s ``body`` option) is the run context when no ``authenticate`` hook is configured.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

from pydantic import TypeAdapter
from pydantic_ai.ui.vercel_ai.request_types import RequestData, UIMessage
from pydantic_ai.ui.vercel_ai.response_types import (
    AbortChunk,
    BaseChunk,
    ErrorChunk,
    FinishChunk,
    FinishStepChunk,
    ReasoningDeltaChunk,
    ReasoningEndChunk,
    ReasoningStartChunk,
    StartChunk,
    StartStepChunk,
    TextDeltaChunk,
    TextEndChunk,
    TextStartChunk,
    ToolApprovalRequestChunk,
    ToolInputAvailableChunk,
    ToolOutputAvailableChunk,
    ToolOutputErrorChunk,
)
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from ..errors import ThreadlineError
from ..records import ACTIVE_RUN_STATES, Message
from .auth import identify
from .body import BodyRefused, parse_body
from .conversations import threadline_error
from .responses import error_response, unauthorized
from .state import server_state

UI_MESSAGE_STREAM_HEADERS = {"x-vercel-ai-ui-message-stream": "v1", "cache-control": "no-cache"}
SDK_VERSION = 6
"""The UI message stream version the chunks are encoded for (6 carries tool approvals; 7 reads the same)."""
_REQUEST: TypeAdapter[Any] = TypeAdapter(RequestData)
_OVERFLOW = object()
STREAM_QUEUE = 16
COMPLETED = frozenset({"success", "policy_stop", "provider_stop"})
STOPPED = frozenset({"interrupted", "superseded", "cancelled", "shutdown"})


def encode(chunk: BaseChunk) -> str:
    return f"data: {chunk.encode(SDK_VERSION)}\n\n"


DONE = "data: [DONE]\n\n"


class UIStream:
    """Turns one run's delivery events into UI message chunks."""

    def __init__(self, run_id: str) -> None:
        self.run_id = run_id
        self.step_open = False
        self.text_id: str | None = None
        self.reasoning_id: str | None = None
        self.blocks = 0
        self.streamed = ""
        self.announced: set[str] = set()

    def _block(self, kind: str) -> str:
        self.blocks += 1
        return f"{kind}-{self.blocks}"

    def close_blocks(self) -> Iterator[BaseChunk]:
        if self.text_id is not None:
            yield TextEndChunk(id=self.text_id)
            self.text_id = None
        if self.reasoning_id is not None:
            yield ReasoningEndChunk(id=self.reasoning_id)
            self.reasoning_id = None

    def text(self, delta: str) -> Iterator[BaseChunk]:
        if self.reasoning_id is not None:
            yield ReasoningEndChunk(id=self.reasoning_id)
            self.reasoning_id = None
        if not self.step_open:
            self.step_open = True
            yield StartStepChunk()
        if self.text_id is None:
            self.text_id = self._block("text")
            yield TextStartChunk(id=self.text_id)
        self.streamed += delta
        yield TextDeltaChunk(id=self.text_id, delta=delta)

    def event(self, event: Any) -> Iterator[BaseChunk]:
        kind = event.type
        if kind == "run-operation" and event.operation.kind == "model-request":
            if event.operation.phase == "started":
                yield from self.close_blocks()
                if self.step_open:
                    yield FinishStepChunk()
                self.step_open = True
                yield StartStepChunk()
            elif event.operation.phase in ("completed", "failed", "cancelled") and self.step_open:
                yield from self.close_blocks()
                self.step_open = False
                yield FinishStepChunk()
        elif kind == "assistant-delta":
            yield from self.text(event.delta)
        elif kind == "reasoning-start":
            yield from self.close_blocks()
            self.reasoning_id = self._block("reasoning")
            yield ReasoningStartChunk(id=self.reasoning_id)
        elif kind == "reasoning-delta" and self.reasoning_id is not None:
            yield ReasoningDeltaChunk(id=self.reasoning_id, delta=event.delta)
        elif kind == "reasoning-end" and self.reasoning_id is not None:
            yield ReasoningEndChunk(id=self.reasoning_id)
            self.reasoning_id = None
        elif kind == "tool-status":
            yield from self.close_blocks()
            if event.status == "started" or event.call_id not in self.announced:
                self.announced.add(event.call_id)
                yield ToolInputAvailableChunk(tool_call_id=event.call_id, tool_name=event.tool_name, input=event.input)
            if event.status == "completed":
                yield ToolOutputAvailableChunk(tool_call_id=event.call_id, output=event.output)
            elif event.status == "failed":
                error = event.error or {}
                yield ToolOutputErrorChunk(
                    tool_call_id=event.call_id, error_text=error.get("message") or error.get("error") or "failed"
                )
            elif event.status == "interrupted":
                yield ToolOutputErrorChunk(tool_call_id=event.call_id, error_text="interrupted")

    def finish(self, terminal_reason: str, assistant: Message | None) -> Iterator[BaseChunk]:
        """The end of the stream: what the stored answer holds beyond what streamed, approval requests, and
        the closing chunk for ``terminal_reason``."""
        stored = "".join(p.text for p in assistant.parts if p.type == "text") if assistant is not None else ""
        if stored.startswith(self.streamed) and len(stored) > len(self.streamed):
            yield from self.text(stored[len(self.streamed) :])  # fell behind, or nothing streamed here
        yield from self.close_blocks()
        for part in assistant.parts if assistant is not None else ():
            if part.type == "approval-request":
                if part.call_id not in self.announced:
                    self.announced.add(part.call_id)
                    yield ToolInputAvailableChunk(tool_call_id=part.call_id, tool_name=part.tool_name, input=part.input)
                yield ToolApprovalRequestChunk(approval_id=part.approval_id, tool_call_id=part.call_id)
        if self.step_open:
            self.step_open = False
            yield FinishStepChunk()
        if terminal_reason in COMPLETED:
            yield FinishChunk(finish_reason="stop")
        elif terminal_reason in STOPPED:
            yield AbortChunk(reason=terminal_reason)
        else:
            yield ErrorChunk(error_text=f"the run ended {terminal_reason}")
            yield FinishChunk(finish_reason="error")


def _input_parts(message: UIMessage) -> list[dict[str, Any]]:
    parts: list[dict[str, Any]] = []
    for part in message.parts:
        if part.type == "text":
            parts.append({"type": "text", "text": part.text})
        elif part.type == "file":
            parts.append(
                {"type": "file", "reference": part.url, "media_type": part.media_type, "filename": part.filename}
            )
    return parts


def _approval_decisions(message: UIMessage) -> list[tuple[str, bool, str | None]]:
    decisions = []
    for part in message.parts:
        approval = getattr(part, "approval", None)
        if getattr(part, "state", None) == "approval-responded" and approval is not None:
            approved = getattr(approval, "approved", None)
            if isinstance(approved, bool):
                decisions.append((approval.id, approved, getattr(approval, "reason", None)))
    return decisions


async def chat(request: Request) -> Response:
    state = server_state(request.app)
    caller = await identify(state.settings.authenticate, request)
    if caller is None:
        return unauthorized()
    try:
        body = await parse_body(request, state.settings.max_body_bytes, _REQUEST)
    except BodyRefused as refused:
        return refused.response
    if body.trigger != "submit-message":
        return error_response(
            422,
            "REQUEST_REJECTED",
            "only trigger 'submit-message' is supported (regenerate: submit again)",
            field="trigger",
        )
    if not body.messages:
        return error_response(422, "REQUEST_REJECTED", "messages: at least one message", field="messages")
    conversation_id, last = body.id, body.messages[-1]
    context = caller.run_context((body.model_extra or {}).get("context"))
    decisions = _approval_decisions(last) if last.role == "assistant" else []
    if last.role != "user" and not decisions:
        return error_response(
            422, "REQUEST_REJECTED", "the last message is the new user input (or approval decisions)", field="messages"
        )
    parts = _input_parts(last) if last.role == "user" else []
    if last.role == "user" and not parts:
        return error_response(422, "REQUEST_REJECTED", "the last message has no text or file part", field="messages")

    queue: asyncio.Queue[Any] = asyncio.Queue(STREAM_QUEUE)

    overflowed = asyncio.Event()  # the marker below may not fit a full queue; the reader also checks this

    def on_overflow(delivery: Any) -> None:
        overflowed.set()
        with contextlib.suppress(asyncio.QueueFull):
            queue.put_nowait(_OVERFLOW)

    # observe before admitting, so no event of the run can be published unseen
    connection = state.control.connect(id=f"chat-{uuid.uuid4().hex}", deliver=queue.put, on_overflow=on_overflow)
    attached = await connection.request(
        {"request_id": "chat", "operation": "attach", "conversation_id": conversation_id, "access": "observe"}
    )
    if attached.outcome == "error":
        connection.close()
        status = 503 if attached.error.code == "ATTACHMENT_CAPACITY" else 400
        return error_response(status, attached.error.code, attached.error.message, field=attached.error.field)
    try:
        if decisions:
            ticket = None
            for approval_id, approved, reason in decisions:
                ticket = await state.harness.respond_to_approval(
                    conversation_id=conversation_id,
                    approval_id=approval_id,
                    approved=approved,
                    reason=reason,
                    context=context,
                )
            assert ticket is not None
        else:
            ticket = state.harness.submit(
                conversation_id=conversation_id, idempotency_key=f"ui:{last.id}", context=context, parts=parts
            )
        admission = await ticket.admission
    except ThreadlineError as error:
        connection.close()
        return threadline_error(error)

    async def stream() -> AsyncIterator[str]:
        ui = UIStream(admission.run_id)
        try:
            yield encode(StartChunk(message_id=admission.assistant_message_id))
            if not admission.run.terminal:
                while True:
                    if overflowed.is_set() and queue.empty():
                        break  # finish from the stored answer below
                    item = await queue.get()
                    if item is _OVERFLOW:
                        break  # finish from the stored answer below
                    event = item.event
                    if event.run_id != ui.run_id:
                        continue
                    if event.type == "run-state" and event.state not in ACTIVE_RUN_STATES:
                        break  # ended without a terminal event of its own (absorbed by another run)
                    if event.type == "terminal":
                        for chunk in ui.finish(event.terminal_reason, event.assistant):
                            yield encode(chunk)
                        yield DONE
                        return
                    for chunk in ui.event(event):
                        yield encode(chunk)
            result = await ticket.result
            for chunk in ui.finish(result.terminal_reason, result.assistant):
                yield encode(chunk)
            yield DONE
        finally:
            connection.close()

    return StreamingResponse(stream(), media_type="text/event-stream", headers=UI_MESSAGE_STREAM_HEADERS)


def routes(path: str) -> list[Route]:
    return [Route(path, chat, methods=["POST"])]
