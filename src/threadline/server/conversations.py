"""A small REST surface over the harness (LangGraph-style threads and runs, for scripts and curl):

- ``GET /conversations?limit=&cursor=`` — one page of conversations (ids, versions), ``next_cursor``.
- ``GET /conversations/{id}`` — the canonical snapshot.
- ``POST /conversations/{id}/inputs`` — admit one input: ``{"idempotency_key", "text" | "parts", "context",
  "input_metadata"}``; answers 202 with the admission once it is durable.
- ``POST /conversations/{id}/runs/{run_id}/interrupt`` — durably interrupt a run.
- ``GET /conversations/{id}/approvals`` — pending approvals.
- ``POST /conversations/{id}/approvals/{approval_id}`` — ``{"approved", "reason", "context"}``; 202 with the
  run that continues.

These bypass the control server's controller lease (which coordinates interactive WebSocket controllers);
the runtime's own rules (idempotency, policies, approval checks) apply as everywhere.
"""

from __future__ import annotations

import logging
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ..errors import (
    AgentConversationPurgedError,
    AgentRecordNotFoundError,
    AgentRecordValidationError,
    AgentRuntimeClosedError,
    AgentStoreConflictError,
    ThreadlineError,
)
from ..records import Part
from .auth import identify
from .body import BodyRefused, parse_body
from .responses import error_response, model_json, unauthorized
from .state import server_state

_log = logging.getLogger("threadline.server")

MAX_PAGE = 500


class SubmitBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    idempotency_key: str = Field(min_length=1)
    text: str | None = Field(default=None, min_length=1)
    parts: tuple[Part, ...] | None = Field(default=None, min_length=1)
    context: Any = None
    input_metadata: Any = None

    @model_validator(mode="after")
    def _one_content(self) -> SubmitBody:
        if (self.text is None) == (self.parts is None):
            raise ValueError("give exactly one of 'text' and 'parts'")
        return self

    def input_parts(self) -> list[Any]:
        return list(self.parts) if self.parts is not None else [{"type": "text", "text": self.text}]


class ApprovalBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    approved: bool
    reason: str | None = Field(default=None, min_length=1)
    context: Any = None


def threadline_error(error: ThreadlineError) -> JSONResponse:
    """A typed error as an HTTP answer: its class decides the status, its message is the caller's."""
    status = 400
    if isinstance(error, AgentRecordNotFoundError):
        status = 404
    elif isinstance(error, AgentStoreConflictError | AgentConversationPurgedError):
        status = 409
    elif isinstance(error, AgentRecordValidationError):
        status = 422
    elif isinstance(error, AgentRuntimeClosedError):
        status = 503
    message = f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
    return error_response(status, "REQUEST_REJECTED", message, field=getattr(error, "field", None))


async def _guard(request: Request) -> Any:
    state = server_state(request.app)
    caller = await identify(state.settings.authenticate, request)
    if caller is None:
        raise BodyRefused(unauthorized())
    return state, caller


async def list_conversations(request: Request) -> Response:
    try:
        state, _caller = await _guard(request)
        raw_limit = request.query_params.get("limit", "100")
        if not raw_limit.isdigit() or not 1 <= int(raw_limit) <= MAX_PAGE:
            return error_response(422, "REQUEST_REJECTED", f"limit is an integer from 1 to {MAX_PAGE}", field="limit")
        page = await state.conversations.list(limit=int(raw_limit), cursor=request.query_params.get("cursor"))
    except BodyRefused as refused:
        return refused.response
    except ThreadlineError as error:
        return threadline_error(error)
    return JSONResponse(model_json(page))


async def get_conversation(request: Request) -> Response:
    try:
        state, _caller = await _guard(request)
        snapshot = await state.harness.snapshot(request.path_params["conversation_id"])
    except BodyRefused as refused:
        return refused.response
    except ThreadlineError as error:
        return threadline_error(error)
    return JSONResponse(model_json(snapshot))


async def submit_input(request: Request) -> Response:
    try:
        state, caller = await _guard(request)
        body = await parse_body(request, state.settings.max_body_bytes, SubmitBody)
        ticket = state.harness.submit(
            conversation_id=request.path_params["conversation_id"],
            idempotency_key=body.idempotency_key,
            context=caller.run_context(body.context),
            parts=body.input_parts(),
            input_metadata=body.input_metadata,
        )
        admission = await ticket.admission
    except BodyRefused as refused:
        return refused.response
    except ThreadlineError as error:
        return threadline_error(error)
    return JSONResponse(model_json(admission), status_code=202)


async def interrupt_run(request: Request) -> Response:
    try:
        state, _caller = await _guard(request)
        result = await state.harness.interrupt(
            conversation_id=request.path_params["conversation_id"], run_id=request.path_params["run_id"]
        )
    except BodyRefused as refused:
        return refused.response
    except ThreadlineError as error:
        return threadline_error(error)
    return JSONResponse(model_json(result))


async def list_approvals(request: Request) -> Response:
    try:
        state, _caller = await _guard(request)
        pending = await state.harness.pending_approvals(request.path_params["conversation_id"])
    except BodyRefused as refused:
        return refused.response
    except ThreadlineError as error:
        return threadline_error(error)
    return JSONResponse({"approvals": [dict(vars(p)) for p in pending]})


async def respond_approval(request: Request) -> Response:
    try:
        state, caller = await _guard(request)
        body = await parse_body(request, state.settings.max_body_bytes, ApprovalBody)
        ticket = await state.harness.respond_to_approval(
            conversation_id=request.path_params["conversation_id"],
            approval_id=request.path_params["approval_id"],
            approved=body.approved,
            reason=body.reason,
            context=caller.run_context(body.context),
        )
        admission = await ticket.admission
    except BodyRefused as refused:
        return refused.response
    except ThreadlineError as error:
        return threadline_error(error)
    return JSONResponse(model_json(admission), status_code=202)


def routes() -> list[Route]:
    return [
        Route("/conversations", list_conversations, methods=["GET"]),
        Route("/conversations/{conversation_id}", get_conversation, methods=["GET"]),
        Route("/conversations/{conversation_id}/inputs", submit_input, methods=["POST"]),
        Route("/conversations/{conversation_id}/runs/{run_id}/interrupt", interrupt_run, methods=["POST"]),
        Route("/conversations/{conversation_id}/approvals", list_approvals, methods=["GET"]),
        Route("/conversations/{conversation_id}/approvals/{approval_id}", respond_approval, methods=["POST"]),
    ]
