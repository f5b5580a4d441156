"""``run_headless_agent_runner``: a structured control loop for an external supervisor.

One JSON object per line in, one per line out (``threadline serve --stdio`` runs it on stdin/stdout). The
runner starts no process and chooses no authentication: the supervisor that spawned it owns placement,
restart and isolation.

In (``type``)::

    submit            request_id, conversation_id, idempotency_key, context, parts[, input_metadata]
    interrupt         request_id, conversation_id, run_id
    snapshot          request_id, conversation_id
    pending-approvals request_id, conversation_id
    respond-approval  request_id, conversation_id, approval_id, approved[, reason], context
    close             request_id[, grace_period][, force_timeout]

Out: ``admitted`` (the admission, once durable) and later ``terminal`` (the run's result) for a submit or an
approval response; ``interrupted``, ``snapshot``, ``approvals``, ``closed``; ``error`` with ``code``
(``REQUEST_REJECTED`` or ``REQUEST_CAPACITY``), ``message`` and ``field`` for a line it refuses — the loop
goes on; with ``events=True`` also ``event`` lines carrying every delivery event.

Lines are read one at a time, in order; a line is at most :data:`HEADLESS_AGENT_RUNNER_MAX_LINE_BYTES`,
and at most ``max_in_flight`` submissions wait for their terminal at once. ``close`` closes the harness
and ends the loop; the close is bounded: a line without ``grace_period``/``force_timeout`` uses the
runner's ``close_grace_period``/``close_force_timeout`` (default: no grace, then
:data:`DEFAULT_CLOSE_FORCE_TIMEOUT` seconds for aborted runs to settle), and ``closed`` reports whether
everything settled; at the end of input the loop waits for the terminals it owes,
then returns without closing the harness.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import math
from collections.abc import AsyncIterable, Callable, Mapping
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from ..errors import AgentConfigError, ThreadlineError
from ..events import delivered_message
from ..records import Part
from .control_schema import validation_field
from .harness import HeadlessAgentHarness

_log = logging.getLogger("threadline.harness.runner")

HEADLESS_AGENT_RUNNER_MAX_LINE_BYTES = 1_048_576
"""The longest input line the runner reads (UTF-8 bytes)."""
DEFAULT_MAX_IN_FLIGHT = 256
DEFAULT_CLOSE_FORCE_TIMEOUT = 5.0
"""Seconds a ``close`` line without ``force_timeout`` waits for aborted runs to settle."""
MAX_QUEUED_EVENTS = 1024
"""With ``events=True``: events waiting to be written; beyond it they are dropped and one ``resync-required``
line (with the number dropped) says so before the next event."""


class _Control(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    request_id: str = Field(min_length=1)


class _Conversation(_Control):
    conversation_id: str = Field(min_length=1)


class SubmitControl(_Conversation):
    type: Literal["submit"]
    idempotency_key: str = Field(min_length=1)
    context: Any = None
    parts: tuple[Part, ...] = Field(min_length=1)
    input_metadata: Any = None


class InterruptControl(_Conversation):
    type: Literal["interrupt"]
    run_id: str = Field(min_length=1)


class SnapshotControl(_Conversation):
    type: Literal["snapshot"]


class PendingApprovalsControl(_Conversation):
    type: Literal["pending-approvals"]


class RespondApprovalControl(_Conversation):
    type: Literal["respond-approval"]
    approval_id: str = Field(min_length=1)
    approved: bool
    reason: str | None = Field(default=None, min_length=1)
    context: Any = None


class CloseControl(_Control):
    type: Literal["close"]
    grace_period: float | None = Field(default=None, ge=0, allow_inf_nan=False)
    force_timeout: float | None = Field(default=None, ge=0, allow_inf_nan=False)


HeadlessAgentRunnerControl = Annotated[
    SubmitControl
    | InterruptControl
    | SnapshotControl
    | PendingApprovalsControl
    | RespondApprovalControl
    | CloseControl,
    Field(discriminator="type"),
]
_CONTROL: TypeAdapter[HeadlessAgentRunnerControl] = TypeAdapter(HeadlessAgentRunnerControl)


def _json(value: Any) -> Any:
    return value.model_dump(mode="json") if isinstance(value, BaseModel) else value


def _result_json(result: Any) -> Any:
    return _json(result.model_copy(update={"assistant": delivered_message(result.assistant)}))


class _Refused(Exception):
    def __init__(self, code: str, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.code, self.message, self.field = code, message, field


def _parse(line: Any) -> HeadlessAgentRunnerControl:
    if isinstance(line, bytes | bytearray):
        if len(line) > HEADLESS_AGENT_RUNNER_MAX_LINE_BYTES:
            raise _Refused("REQUEST_REJECTED", f"a line is at most {HEADLESS_AGENT_RUNNER_MAX_LINE_BYTES} bytes")
        line = bytes(line).decode("utf-8", errors="replace")
    if isinstance(line, str):
        if len(line) > HEADLESS_AGENT_RUNNER_MAX_LINE_BYTES or (
            len(line) * 4 > HEADLESS_AGENT_RUNNER_MAX_LINE_BYTES
            and len(line.encode("utf-8", errors="surrogatepass")) > HEADLESS_AGENT_RUNNER_MAX_LINE_BYTES
        ):
            raise _Refused("REQUEST_REJECTED", f"a line is at most {HEADLESS_AGENT_RUNNER_MAX_LINE_BYTES} bytes")
        try:
            line = json.loads(line)
        except ValueError as error:
            raise _Refused("REQUEST_REJECTED", f"a line is one JSON object: {error}") from None
    if not isinstance(line, Mapping):
        raise _Refused("REQUEST_REJECTED", "a line is one JSON object with a 'type'", "type")
    data = dict(line)
    try:
        return _CONTROL.validate_python(data)
    except ValidationError as error:
        where, message = validation_field(error, data)
        where = where or "type"
        raise _Refused("REQUEST_REJECTED", f"{where}: {message}", where) from None


def _request_id(line: Any) -> str | None:
    try:
        value = json.loads(line) if isinstance(line, str | bytes | bytearray) else line
    except ValueError:
        return None
    found = value.get("request_id") if isinstance(value, Mapping) else None
    return found if isinstance(found, str) else None


async def run_headless_agent_runner(
    harness: HeadlessAgentHarness,
    *,
    input: AsyncIterable[Any],
    write: Callable[[dict[str, Any]], Any],
    events: bool = False,
    max_in_flight: int = DEFAULT_MAX_IN_FLIGHT,
    close_grace_period: float | None = None,
    close_force_timeout: float | None = DEFAULT_CLOSE_FORCE_TIMEOUT,
) -> None:
    """Run the control loop until ``close`` or the end of ``input`` (lines as ``str``/``bytes``, or already
    parsed dicts). ``write(obj)`` (sync or async) sends one output object; the runner never calls it
    concurrently. See the module docstring for the protocol. ``close_grace_period`` and
    ``close_force_timeout`` are the budgets of a ``close`` line that names none (``None``: no bound on that
    phase); a bad value raises :class:`~threadline.errors.AgentConfigError` before anything is read.

    Cancellation: cancelling the task stops reading at once; submissions already admitted are durable and
    their runs go on in the harness (their ``terminal`` lines are not written)."""
    for name, budget in (("close_grace_period", close_grace_period), ("close_force_timeout", close_force_timeout)):
        if budget is not None and (
            isinstance(budget, bool) or not isinstance(budget, int | float) or not math.isfinite(budget) or budget < 0
        ):
            raise AgentConfigError(f"{name} is a finite number of seconds >= 0 or None, got {budget!r}", field=name)
    lock = asyncio.Lock()
    owed: set[asyncio.Task[None]] = set()

    async def emit(obj: dict[str, Any]) -> None:
        async with lock:
            outcome = write(obj)
            if inspect.isawaitable(outcome):
                await outcome

    unsubscribe = None
    if events:
        queue: asyncio.Queue[Any] = asyncio.Queue(MAX_QUEUED_EVENTS)
        dropped = 0

        def forward(event: Any) -> None:
            nonlocal dropped
            try:
                queue.put_nowait(event)
            except asyncio.QueueFull:
                dropped += 1

        async def pump() -> None:
            nonlocal dropped
            while True:
                event = await queue.get()
                if dropped:
                    lost, dropped = dropped, 0
                    await emit({"type": "resync-required", "dropped": lost})
                await emit({"type": "event", "event": _json(event)})

        unsubscribe = harness.subscribe(forward)
        pumping = asyncio.ensure_future(pump())

    async def follow(request_id: str, ticket: Any) -> None:
        try:
            result = await ticket.result
            await emit({"type": "terminal", "request_id": request_id, "result": _result_json(result)})
        except Exception as error:
            await emit(_error(request_id, "REQUEST_REJECTED", f"{type(error).__name__}: {error}"))

    def _error(request_id: str | None, code: str, message: str, field: str | None = None) -> dict[str, Any]:
        return {"type": "error", "request_id": request_id, "code": code, "message": message, "field": field}

    try:
        async for line in input:
            if isinstance(line, str | bytes | bytearray) and not line.strip():
                continue
            request_id = None
            try:
                control = _parse(line)
                request_id = control.request_id
                if isinstance(control, CloseControl):
                    closed = await harness.close(
                        grace_period=close_grace_period if control.grace_period is None else control.grace_period,
                        force_timeout=close_force_timeout if control.force_timeout is None else control.force_timeout,
                    )
                    await emit({"type": "closed", "request_id": request_id, "result": _json(closed)})
                    return
                if isinstance(control, SnapshotControl):
                    snapshot = await harness.snapshot(control.conversation_id)
                    await emit({"type": "snapshot", "request_id": request_id, "snapshot": _json(snapshot)})
                elif isinstance(control, PendingApprovalsControl):
                    pending = await harness.pending_approvals(control.conversation_id)
                    approvals = [dict(vars(p)) for p in pending]
                    await emit({"type": "approvals", "request_id": request_id, "approvals": approvals})
                elif isinstance(control, InterruptControl):
                    result = await harness.interrupt(conversation_id=control.conversation_id, run_id=control.run_id)
                    await emit({"type": "interrupted", "request_id": request_id, "result": _json(result)})
                else:
                    if len(owed) >= max_in_flight:
                        raise _Refused(
                            "REQUEST_CAPACITY", f"{max_in_flight} submissions are waiting for their terminal"
                        )
                    if isinstance(control, SubmitControl):
                        ticket = harness.submit(
                            conversation_id=control.conversation_id,
                            idempotency_key=control.idempotency_key,
                            context=control.context,
                            parts=list(control.parts),
                            input_metadata=control.input_metadata,
                        )
                    else:
                        ticket = await harness.respond_to_approval(
                            conversation_id=control.conversation_id,
                            approval_id=control.approval_id,
                            approved=control.approved,
                            reason=control.reason,
                            context=control.context,
                        )
                    admission = await ticket.admission
                    await emit({"type": "admitted", "request_id": request_id, "admission": _json(admission)})
                    task = asyncio.ensure_future(follow(request_id, ticket))
                    owed.add(task)
                    task.add_done_callback(owed.discard)
            except _Refused as refused:
                await emit(_error(request_id or _request_id(line), refused.code, refused.message, refused.field))
            except ThreadlineError as error:
                await emit(
                    _error(
                        request_id,
                        "REQUEST_REJECTED",
                        f"{type(error).__name__}: {error}",
                        getattr(error, "field", None),
                    )
                )
            except Exception as error:
                _log.warning("a runner request failed", exc_info=True)
                await emit(_error(request_id, "REQUEST_REJECTED", f"{type(error).__name__}: the request failed"))
        if owed:
            await asyncio.gather(*owed, return_exceptions=True)
    finally:
        if unsubscribe is not None:
            unsubscribe()
            pumping.cancel()
        for task in owed:
            if not task.done():
                task.cancel()
