"""Tool declaration and the error envelope a model sees when a tool fails.

``define_agent_tool`` turns a typed async function (or an explicit pydantic arguments model) into a tool
whose JSON Schema pydantic generates. Arguments from the model are validated before the handler runs.
The loop checks the run's fence (owner, fencing token, still running) before a tool's effect and again
before its result is accepted; losing it stops the run and is never shown to the model.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, get_type_hints

from pydantic import BaseModel, ConfigDict, ValidationError, create_model
from pydantic_ai.tools import ToolDefinition

from .errors import AgentRuntimeUsageError, ThreadlineError

INTERNAL_SERVER_ERROR = "INTERNAL_SERVER_ERROR"
INVALID_ARGUMENTS = "INVALID_ARGUMENTS"


class AppError(ThreadlineError):
    """A typed application error whose ``code``, message, ``details`` and ``hint`` may reach the model."""

    def __init__(
        self, code: str, message: str, details: Any = None, hint: str | None = None, *, retryable: bool = False
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.details = details
        self.hint = hint
        self.retryable = retryable


def error_envelope(error: BaseException) -> dict[str, Any]:
    """The safe ``{error, retryable, details?, _hint?}`` envelope. Only :class:`AppError` says more than
    ``INTERNAL_SERVER_ERROR``; the cause of anything else stays in the process."""
    if isinstance(error, AppError):
        envelope: dict[str, Any] = {"error": error.code, "message": error.message, "retryable": error.retryable}
        if error.details is not None:
            envelope["details"] = error.details
        if error.hint:
            envelope["_hint"] = error.hint
        return envelope
    return {"error": INTERNAL_SERVER_ERROR, "retryable": False}


@dataclass
class AgentToolContext:
    """What a tool handler may receive as its first parameter (annotated ``AgentToolContext``)."""

    conversation_id: str
    run_id: str
    call_id: str
    tool_name: str
    context: Any
    report_progress: Callable[..., None] = field(default=lambda *args, **kwargs: None)
    """``report_progress(message=None, progress=None, total=None)``: a transient ``tool-progress`` event
    for this call (never model input, never durable history). Reports closer than 250 ms are dropped."""
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class AgentTool:
    """A declared tool. Build it with :func:`define_agent_tool`."""

    name: str
    description: str | None
    args_model: type[BaseModel]
    handler: Callable[..., Awaitable[Any]]
    takes_context: bool

    @functools.cached_property
    def _definition(self) -> ToolDefinition:
        return ToolDefinition(
            name=self.name, description=self.description, parameters_json_schema=self.args_model.model_json_schema()
        )

    def definition(self) -> ToolDefinition:
        """What the model is told about the tool (built once: the JSON Schema comes from pydantic)."""
        return self._definition

    def validate(self, raw: Any) -> BaseModel:
        """Validate model-supplied arguments; raises :class:`AppError` ``INVALID_ARGUMENTS`` naming the field."""
        try:
            return self.args_model.model_validate(raw if raw is not None else {})
        except ValidationError as error:
            first = error.errors()[0]
            where = ".".join(str(p) for p in first["loc"]) or "arguments"
            raise AppError(
                INVALID_ARGUMENTS, f"{where}: {first['msg']}", hint="fix the arguments and call again"
            ) from error

    async def call(self, ctx: AgentToolContext, args: BaseModel) -> Any:
        values = {name: getattr(args, name) for name in type(args).model_fields}
        if self.takes_context:
            return await self.handler(ctx, **values)
        return await self.handler(**values)


def _args_model_from_signature(fn: Callable[..., Any], name: str) -> tuple[type[BaseModel], bool]:
    signature = inspect.signature(fn)
    hints = get_type_hints(fn)
    params = list(signature.parameters.values())
    takes_context = bool(params) and hints.get(params[0].name) is AgentToolContext
    fields: dict[str, Any] = {}
    for p in params[1:] if takes_context else params:
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            raise AgentRuntimeUsageError(f"tool {name!r}: *args/**kwargs parameters cannot be described to a model")
        annotation = hints.get(p.name, Any)
        fields[p.name] = (annotation, ... if p.default is p.empty else p.default)
    model = create_model(f"{name}_args", __config__=ConfigDict(extra="forbid"), **fields)
    return model, takes_context


def define_agent_tool(
    fn: Callable[..., Awaitable[Any]] | None = None,
    *,
    name: str | None = None,
    description: str | None = None,
    args: type[BaseModel] | None = None,
) -> Any:
    """Declare a tool from an async function (usable as ``@define_agent_tool`` or with options).

    With ``args`` the handler receives the validated fields as keyword arguments; otherwise the schema
    comes from the function's annotated parameters. A first parameter annotated :class:`AgentToolContext`
    receives the call context.
    """

    def build(handler: Callable[..., Awaitable[Any]]) -> AgentTool:
        if not inspect.iscoroutinefunction(handler):
            raise AgentRuntimeUsageError(f"tool {handler!r} must be an async function")
        tool_name = name or handler.__name__
        if args is not None:
            hints = get_type_hints(handler)
            first = next(iter(inspect.signature(handler).parameters), None)
            model, takes_context = args, first is not None and hints.get(first) is AgentToolContext
        else:
            model, takes_context = _args_model_from_signature(handler, tool_name)
        doc = description or (inspect.getdoc(handler) or None)
        return AgentTool(tool_name, doc, model, handler, takes_context)

    return build(fn) if fn is not None else build
