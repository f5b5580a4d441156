"""Tool declaration and the error envelope a model sees when a tool fails.

``define_agent_tool`` turns a typed function — ``async def`` or plain ``def`` — (or an explicit pydantic
arguments model) into a tool whose JSON Schema pydantic generates. Arguments from the model are validated
before the handler runs. A plain function runs on a worker thread (``asyncio.to_thread``), never on the
event loop. The loop checks the run's fence (owner, fencing token, still running) before a tool's effect
and again before its result is accepted; losing it stops the run and is never shown to the model.

A tool's result is lossless JSON at the tool boundary (the rule of :mod:`threadline.jsonvalue`): pydantic
models, dataclasses, datetimes and the like are first made JSON (``to_jsonable_python``), then a value JSON
cannot hold exactly (``nan``, ``inf``, ``-0.0``, a lone surrogate) refuses the call with
:class:`AgentToolValueError` (``TOOL_VALUE_REFUSED``). What the model sees, what ``tool-status`` shows and
what the store keeps are then the same value.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, get_type_hints

from pydantic import BaseModel, ConfigDict, ValidationError, create_model
from pydantic_ai.tools import ToolDefinition
from pydantic_core import to_jsonable_python

from .durability import AgentStepDurability, StepBody, StepReconcile, run_agent_step
from .errors import (
    APP_ERROR_STATUS as APP_ERROR_STATUS,
    AgentConfigError,
    AgentRuntimeUsageError,
    AgentToolFenceLostError,
    AppError as AppError,
)
from .jsonvalue import LosslessJsonError, lossless_json

INTERNAL_SERVER_ERROR = "INTERNAL_SERVER_ERROR"
INVALID_ARGUMENTS = "INVALID_ARGUMENTS"
TOOL_VALUE_REFUSED = "TOOL_VALUE_REFUSED"


class AgentToolValueError(AppError):
    """A tool returned a value that is not lossless JSON (``nan``, ``inf``, ``-0.0``, a lone surrogate, a
    dict with a non-str key, ...). Raised **after** the tool ran: its effect happened, its result was not
    accepted. The model sees the code, the path and the reason (``$.score: nan is not a finite JSON
    number``); so does the stored tool result. ``tool_name``, ``path`` and ``reason`` say which value."""

    def __init__(self, tool_name: str, path: str, reason: str) -> None:
        super().__init__(
            TOOL_VALUE_REFUSED,
            f"tool {tool_name!r} returned a value that is not lossless JSON at {path}: {reason}",
            details={"path": path},
            hint="the tool ran; its result could not be recorded exactly: do not repeat an effect without checking",
        )
        self.tool_name = tool_name
        self.path = path
        self.reason = reason


def tool_result(tool_name: str, value: Any) -> Any:
    """A tool's return value as the lossless JSON the model, the events and the store all get (a detached
    copy); :class:`AgentToolValueError` when it is not."""
    try:
        copied, _text = lossless_json(to_jsonable_python(value))
    except LosslessJsonError as refused:
        raise AgentToolValueError(tool_name, refused.path, refused.reason) from None
    except (TypeError, ValueError) as error:  # to_jsonable_python knows no JSON form for it
        raise AgentToolValueError(tool_name, "$", f"{type(value).__name__} has no JSON form ({error})") from None
    return copied


def error_envelope(error: BaseException) -> dict[str, Any]:
    """The safe ``{error, retryable, message?, details?, _hint?, status?}`` envelope. Only :class:`AppError`
    says more than ``INTERNAL_SERVER_ERROR``; the cause of anything else stays in the process."""
    if isinstance(error, AppError):
        envelope: dict[str, Any] = {"error": error.code, "message": error.message, "retryable": error.retryable}
        if error.details is not None:
            envelope["details"] = error.details
        if error.hint:
            envelope["_hint"] = error.hint
        envelope["status"] = error.status
        return envelope
    return {"error": INTERNAL_SERVER_ERROR, "retryable": False}


def tool_error_from_result(envelope: Any) -> AppError:
    """Rebuild the :class:`AppError` of an envelope that crossed a process boundary (a stored tool result,
    an event, JSON from another process): same code, message, details, hint and retryability; its status
    comes from the code, so it survives the wire. Anything that is not an envelope is an
    ``INTERNAL_SERVER_ERROR``."""
    if not isinstance(envelope, dict) or not isinstance(envelope.get("error"), str):
        return AppError(INTERNAL_SERVER_ERROR, "the tool failed")
    code = envelope["error"]
    message = envelope.get("message")
    hint = envelope.get("_hint")
    return AppError(
        code,
        message if isinstance(message, str) else code,
        envelope.get("details"),
        hint if isinstance(hint, str) else None,
        retryable=envelope.get("retryable") is True,
    )


@dataclass
class AgentToolContext:
    """What a tool handler may receive as its first parameter (annotated ``AgentToolContext``).

    ``owner_id`` and ``fencing_token`` identify the execution that runs the call: the token grows every time
    the run is acquired (a takeover after a crash or an expired lease acquires it again). Pass them to an
    external system that can refuse a stale writer (store the highest token seen per ``run_id`` and refuse a
    lower one), and pass ``idempotency_key`` where the system deduplicates requests: a paused process that
    wakes up after another one took its run over then cannot apply an effect the other already applied."""

    conversation_id: str
    run_id: str
    call_id: str
    tool_name: str
    context: Any
    report_progress: Callable[..., None] = field(default=lambda *args, **kwargs: None)
    """``report_progress(message=None, progress=None, total=None)``: a transient ``tool-progress`` event
    for this call (never model input, never durable history). Reports closer than 250 ms are dropped."""
    extra: dict[str, Any] = field(default_factory=dict)
    owner_id: str = ""
    """The runtime executing the run (``runs.owner_id``)."""
    fencing_token: int = 0
    """The run's fencing token for this execution (monotonic per run)."""
    idempotency_key: str = ""
    """Stable for this call: ``tl-`` and a SHA-256 digest of conversation, run and call id, the same each
    time this exact call record is executed (an approved call, a takeover of the same step); a new model
    turn is a new call."""
    _durability: AgentStepDurability | None = field(default=None, repr=False)
    """The runtime's step ledger (``threadline.durability``); ``None`` runs steps without recording them."""
    _joined_run_ids: tuple[str, ...] = field(default=(), repr=False)
    """Queued runs whose injected inputs this run answers too (``inject``): a step also stands for them."""

    async def step(self, name: str, body: StepBody, *, reconcile: StepReconcile | None = None) -> Any:
        """Run an external effect as a durable step and return its lossless-JSON value (a detached copy).

        ``body`` is a zero-argument callable (``async def`` or plain). With a step ledger the effect is
        keyed by ``(conversation_id, run_id, name)``: an intent is committed before ``body`` runs and the
        proof after; a later call with the same key returns the proof without running ``body``, or —
        when only the intent exists — asks ``reconcile(record)`` and otherwise raises
        :class:`~threadline.durability.AgentStepUncertainError`. A value that is not lossless JSON raises
        :class:`~threadline.durability.AgentStepValueError` *after* ``body`` ran: the effect happened.
        Without a ledger the body runs every time and nothing is recorded (the value rules still hold).

        When inputs joined this run (``inject``), the step is recorded for their queued runs too: if this
        run then ends without answering them (interrupted, crashed, abandoned) and their own run calls a
        step of the same name, it gets this proof and the body does not run again.
        See :mod:`threadline.durability`.
        """
        return await run_agent_step(
            self._durability,
            self.conversation_id,
            self.run_id,
            name,
            body,
            reconcile=reconcile,
            joined_run_ids=self._joined_run_ids,
        )


@dataclass(frozen=True)
class AgentTool:
    """A declared tool. Build it with :func:`define_agent_tool`."""

    name: str
    description: str | None
    args_model: type[BaseModel]
    handler: Callable[..., Awaitable[Any]]
    takes_context: bool
    context_schema: type[BaseModel] | None = None
    """When set, the run's context is validated against it and the handler's ``ctx.context`` is the
    parsed model; a context that does not fit refuses the call (``INVALID_CONTEXT``) before any effect."""

    def parse_context(self, context: Any) -> Any:
        if self.context_schema is None or isinstance(context, self.context_schema):
            return context
        raw = context.model_dump() if isinstance(context, BaseModel) else context
        try:
            return self.context_schema.model_validate(raw)
        except ValidationError as error:
            first = error.errors()[0]
            where = ".".join(str(p) for p in first["loc"]) or "context"
            raise AppError(
                "INVALID_CONTEXT", f"the run context does not fit {self.name}: {where}: {first['msg']}"
            ) from error

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

    @functools.cached_property
    def is_async(self) -> bool:
        """Whether the handler is a coroutine function (else it runs on a worker thread)."""
        return _is_async(self.handler)

    async def call(self, ctx: AgentToolContext, args: BaseModel) -> Any:
        """Run the handler with validated arguments. A plain function runs on a worker thread
        (``asyncio.to_thread``: context variables are copied). Cancelling stops an ``async`` handler; a
        thread cannot be stopped: the call stops waiting for it at once, its result is dropped, and the
        function finishes on its own (an abort or a lost fence never accepts that result)."""
        values = {name: getattr(args, name) for name in type(args).model_fields}
        if self.is_async:
            if self.takes_context:
                return await self.handler(ctx, **values)
            return await self.handler(**values)
        call = (
            functools.partial(self.handler, ctx, **values)
            if self.takes_context
            else functools.partial(self.handler, **values)
        )
        result = await asyncio.to_thread(call)
        return await result if inspect.isawaitable(result) else result


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


def _is_async(handler: Callable[..., Any]) -> bool:
    if inspect.iscoroutinefunction(handler):
        return True
    call = getattr(handler, "__call__", None)  # noqa: B004  # a callable object with an async __call__
    return not inspect.isfunction(handler) and not inspect.ismethod(handler) and inspect.iscoroutinefunction(call)


def define_agent_tool(
    fn: Callable[..., Any] | None = None,
    *,
    name: str | None = None,
    description: str | None = None,
    args: type[BaseModel] | None = None,
    context_schema: type[BaseModel] | None = None,
) -> Any:
    """Declare a tool from a function (usable as ``@define_agent_tool`` or with options): an ``async def``
    runs on the event loop, a plain ``def`` on a worker thread (blocking I/O is fine there).

    With ``args`` the handler receives the validated fields as keyword arguments; otherwise the schema
    comes from the function's annotated parameters. A first parameter annotated :class:`AgentToolContext`
    receives the call context; with ``context_schema`` its ``context`` is the run context validated
    against that model (a context that does not fit refuses the call before any effect).
    """

    def build(handler: Callable[..., Any]) -> AgentTool:
        if not callable(handler) or isinstance(handler, type):
            raise AgentConfigError(f"a tool is a function (async def or def), got {handler!r}", field="fn")
        tool_name = name or handler.__name__
        if args is not None:
            hints = get_type_hints(handler)
            first = next(iter(inspect.signature(handler).parameters), None)
            model, takes_context = args, first is not None and hints.get(first) is AgentToolContext
        else:
            model, takes_context = _args_model_from_signature(handler, tool_name)
        doc = description or (inspect.getdoc(handler) or None)
        return AgentTool(tool_name, doc, model, handler, takes_context, context_schema)

    return build(fn) if fn is not None else build


# ------------------------------------------------------------------------------------------ lifecycle


@dataclass(frozen=True)
class AgentToolCall:
    """One call as lifecycle hooks see it."""

    conversation_id: str
    run_id: str
    call_id: str
    tool_name: str
    input: Any


@dataclass(frozen=True)
class AgentToolLifecycle:
    """Hooks around every managed tool call.

    ``before(call)`` runs before the tool's effect (authorization, the fence); raising :class:`AppError`
    refuses the call with that envelope. ``after(call, output)`` runs before the result is accepted.
    ``on_error(call, error)`` sees the real cause of a failed call (the model only ever sees the safe
    envelope). Each hook may be sync or async.
    """

    before: Callable[[AgentToolCall], Any] | None = None
    after: Callable[[AgentToolCall, Any], Any] | None = None
    on_error: Callable[[AgentToolCall, BaseException], Any] | None = None


async def _maybe(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value


def compose_tool_lifecycle(*lifecycles: AgentToolLifecycle | None) -> AgentToolLifecycle:
    """One lifecycle from several: ``before`` hooks run in order, ``after`` hooks in reverse (the first
    lifecycle wraps the others), every ``on_error`` hook is told. Compose application hooks with the
    fence as ``compose_tool_lifecycle(app_hooks, fence)`` so authorization runs before the fence check."""
    parts = [lc for lc in lifecycles if lc is not None]

    async def before(call: AgentToolCall) -> None:
        for lc in parts:
            if lc.before is not None:
                await _maybe(lc.before(call))

    async def after(call: AgentToolCall, output: Any) -> None:
        for lc in reversed(parts):
            if lc.after is not None:
                await _maybe(lc.after(call, output))

    async def on_error(call: AgentToolCall, error: BaseException) -> None:
        for lc in parts:
            if lc.on_error is not None:
                try:
                    await _maybe(lc.on_error(call, error))
                except Exception:
                    continue

    return AgentToolLifecycle(before=before, after=after, on_error=on_error)


def create_agent_tool_fence_lifecycle(check: Callable[[], Any]) -> AgentToolLifecycle:
    """The fence as a lifecycle: ``check()`` (sync or async) verifies that this process still owns the run
    (owner, fencing token, still running), before the tool's effect and again right after it, before the
    result is accepted. ``check`` returning ``False`` or raising means the fence is lost: the call raises
    :class:`~threadline.errors.AgentToolFenceLostError` (the cause chained), a control signal that stops the
    run's loop — never a tool error the model sees, and never a terminal committed by this executor. Any
    other return value means the fence holds. The run's next owned commit checks ownership again too."""

    async def verify(call: AgentToolCall, moment: str) -> None:
        try:
            holds = await _maybe(check())
        except AgentToolFenceLostError:
            raise
        except Exception as error:
            raise AgentToolFenceLostError(
                f"the fence check of call {call.call_id} ({moment}) raised {type(error).__name__}: {error}"
            ) from error
        if holds is False:
            raise AgentToolFenceLostError(
                f"run {call.run_id} is no longer owned by this executor (fence check {moment} call {call.call_id})"
            )

    async def before(call: AgentToolCall) -> None:
        await verify(call, "before")

    async def after(call: AgentToolCall, output: Any) -> None:
        await verify(call, "after")

    return AgentToolLifecycle(before=before, after=after)
