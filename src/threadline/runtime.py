"""``create_agent_runtime`` and the :class:`AgentRuntime` facade.

Durable order: accept input + assign a queued run (one transaction) → acquire → execute and checkpoint →
execution settles → terminal CAS → the lane releases → the successor starts. An event claiming a durable
fact is published only after its commit. Abort is a request, never a state.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import logging
import math
import uuid
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError

from ._logging import ThrottledLog
from .approvals import AgentApprovalError, AgentPendingApproval, approval_state, pending_approvals
from .config import (
    HistoryConfig as HistoryConfig,
    LoopConfig as LoopConfig,
    RunsConfig as RunsConfig,
    model_hooks as _model_hooks,
    prompt_source as _prompt_source,
    runtime_store as _runtime_store,
    section,
    tool_source as _tool_source,
)
from .coordinator import INPUT_POLICIES, Lane, Step, Waiters, call_maybe_async, quiet
from .errors import (
    AgentConfigError,
    AgentConversationPurgedError,
    AgentRecordNotFoundError,
    AgentRecordValidationError,
    AgentRunOwnershipConflictError,
    AgentRunStateConflictError,
    AgentRuntimeClosedError,
    AgentRuntimeUsageError,
    AgentRunUnsettledError,
    AgentStoreConflictError,
    ThreadlineError,
)
from .events import (
    AdmissionEvent,
    AgentRunStartedEvent,
    AgentRunTerminalEvent,
    RunStateEvent,
    TerminalEvent,
    delivered_message,
    describe_internal_cause,
    durable_event_id,
)
from .following import AGENT_TICKET_EVENTS_MAX, RELAYED_TERMINAL_GRACE, AgentRelayedDelivery, Followers, RunFollower
from .history.projection import AgentHistoryProjectionOptions
from .history.prompt import ComposedAgentPrompt, agent_instructions
from .history.view import ConversationView
from .inputs import check_input_parts, check_input_size, input_parts
from .loop import (
    LoopEnv,
    LoopSettings,
    RunControl,
    RunOutcome,
    execute_run,
    model_request,
    with_store_retry,
)
from .models import AgentModelDescriptor
from .output import OUTPUT_RETRIES, AgentOutput, agent_output
from .protocol import AgentProtocol
from .records import TEMPLATE_TIME, AgentRunFailure, Message, Run, RunOperation, build, evolve
from .store.aggregate import AgentRuntimeStore, new_id
from .store.driver import Purge, Write
from .store.reducer import order_recoverable
from .store.results import InterruptResult, RecoverResult
from .tools import AgentTool
from .usage import AgentUsage

C = TypeVar("C")
_log = logging.getLogger("threadline.runtime")
_events_log = logging.getLogger("threadline.events")
VIEW_CACHE_LIMIT = 256
"""Conversations whose history views a runtime keeps in memory; older ones are rebuilt on next use."""
_LISTEN_RETRY_S = 1.0  # a store that could not listen is asked again at most this often


_ARITY: dict[Any, bool] = {}


def _takes_argument(hook: Callable[..., Any]) -> bool:
    """Whether a model hook takes the prompt context (``lambda: ...`` hooks take nothing). Hooks are the
    runtime's configuration, so their signatures are read once, not on every run."""
    try:
        return _ARITY[hook]
    except KeyError:
        pass
    except TypeError:  # unhashable callable
        return bool(inspect.signature(hook).parameters)
    takes = _ARITY[hook] = bool(inspect.signature(hook).parameters)
    if len(_ARITY) > 256:  # runtimes built again and again with fresh lambdas: stay bounded
        _ARITY.clear()
    return takes


# ----------------------------------------------------------------------------------------- results


class AgentRuntimeInput(BaseModel):
    """The raw input an ``input_policy`` function sees (context not yet parsed)."""

    model_config = ConfigDict(frozen=True, arbitrary_types_allowed=True)

    conversation_id: str
    idempotency_key: str
    context: Any
    parts: tuple[Any, ...]
    input_metadata: Any = None


class PendingAssistant(BaseModel):
    model_config = ConfigDict(frozen=True)

    id: str
    run_id: str
    status: Literal["pending"] = "pending"


class AgentAdmission(BaseModel):
    """``ticket.admission``: what the acceptance CAS committed."""

    model_config = ConfigDict(frozen=True)

    outcome: Literal["accepted", "duplicate"]
    input: Message
    run: Run
    pending: PendingAssistant
    version: int
    coalesced: bool = False

    @property
    def run_id(self) -> str:
        return self.run.id

    @property
    def input_message_id(self) -> str:
        return self.input.id

    @property
    def assistant_message_id(self) -> str:
        return self.pending.id


class AgentRunMetrics(BaseModel):
    """Execution figures of the executor that applied the terminal CAS."""

    model_config = ConfigDict(frozen=True)

    steps: int
    usage: AgentUsage


class AgentRuntimeResult(BaseModel):
    """``ticket.result``: how the run ended. ``metrics`` is None unless this process applied the terminal
    (a CAS loser, a duplicate submission or an absorbed run reads the canonical winner).

    ``answered`` is the one question most callers mean: did the input get its answer? True for a run that
    completed (``success``, ``provider_stop``, ``policy_stop``) and for an input absorbed into another run
    that completed — its ``terminal_reason`` is ``absorbed``, ``assistant`` is the absorbing run's answer
    and ``answered_by_run_id`` names that run. ``usage`` is the run's durable cumulative spend
    (:attr:`Run.usage`); ``metrics.usage`` what this process's execution spent."""

    model_config = ConfigDict(frozen=True)

    terminal_reason: str
    run: Run
    assistant: Message | None
    usage: AgentUsage
    policy_name: str | None = None
    metrics: AgentRunMetrics | None = None
    answered_by_run_id: str | None = None
    """The run whose assistant answered this input: the run itself once completed, the absorbing run for
    an absorbed input, None when the input got no answer (interrupted, failed, ...)."""
    output: Any = None
    """The answer as the declared structured output (``define_agent_protocol(output=...)`` or
    ``submit(output=...)``): the validated value (a ``City``), read back from the stored answer — so a
    duplicate submission or a run read from the store has it too. None without a declared output or
    without an answer."""

    @property
    def answered(self) -> bool:
        return self.answered_by_run_id is not None

    @property
    def error(self) -> AgentRunFailure | None:
        """Why the run failed (:attr:`Run.failure`: origin, exception type, HTTP status, a bounded summary),
        or None — for an answered input, and for one that was interrupted, superseded, cancelled or
        abandoned, where ``terminal_reason`` says all there is. The traceback is in the log
        (``threadline.runtime``), never here."""
        return self.run.failure

    @property
    def text(self) -> str:
        """The answer's text parts joined ("" without an answer): what a chat shows."""
        assistant = self.assistant
        if assistant is None:
            return ""
        return "".join(p.text for p in assistant.parts if p.type == "text")


# What a turn's admission and result are copied from (``build``): every value comes from store records or
# the loop's own figures, so validating them again would only cost (about twice as much as the copy).
_TEMPLATE_RUN = Run(
    id="-",
    conversation_id="-",
    state="queued",
    revision=1,
    input_message_ids=("-",),
    assistant_message_id="-",
    admission_sequence=1,
    created_at=TEMPLATE_TIME,
    updated_at=TEMPLATE_TIME,
)
_TEMPLATE_INPUT = Message(id="-", conversation_id="-", role="user", status="committed", created_at=TEMPLATE_TIME, seq=0)
_PENDING = PendingAssistant(id="-", run_id="-")
_ADMISSION = AgentAdmission(
    outcome="accepted", input=_TEMPLATE_INPUT, run=_TEMPLATE_RUN, pending=_PENDING, version=0, coalesced=False
)
_METRICS = AgentRunMetrics(steps=0, usage=AgentUsage())
_RESULT = AgentRuntimeResult(
    terminal_reason="",
    run=_TEMPLATE_RUN,
    assistant=None,
    usage=AgentUsage(),
    policy_name=None,
    metrics=None,
    answered_by_run_id=None,
    output=None,
)


class AgentRuntimeCloseResult(BaseModel):
    model_config = ConfigDict(frozen=True)

    settled: bool
    timed_out: bool
    remaining: int


@dataclass
class AgentRecoveryOutcome:
    """One run's recovery outcome. ``result`` resolves at its terminal for ``resumed``/``requeued``."""

    conversation_id: str
    run_id: str
    outcome: Literal["resumed", "requeued", "skipped", "abandoned", "blocked", "failed"]
    result: asyncio.Future[AgentRuntimeResult] | None = None
    error: BaseException | None = None


@dataclass
class AgentRuntimeTicket:
    """What ``submit`` returns at once. ``admission`` resolves after the acceptance CAS, ``accepted``
    after the admission event was published, ``result`` at the run's terminal."""

    admission: asyncio.Future[AgentAdmission]
    accepted: asyncio.Future[AgentAdmission]
    result: asyncio.Future[AgentRuntimeResult]
    task: asyncio.Task[None] | None = field(default=None, repr=False)
    idempotency_key: str | None = None
    """The key the input was submitted with (drawn by ``submit`` when none was given): retry with it."""
    run_id: str | None = None
    """The run this ticket follows, once known (after admission; at once for ``resume``)."""
    _runtime: AgentRuntime | None = field(default=None, repr=False)
    _waiting: list[RunFollower] = field(default_factory=list, repr=False)

    def events(self, *, capacity: int = AGENT_TICKET_EVENTS_MAX) -> RunFollower:
        """``async for event in ticket.events():`` — this run's delivery events, in order, as this process
        publishes them (see :mod:`threadline.following`): ``admission``, ``assistant-delta``, reasoning,
        ``tool-status``/``tool-progress``, ``assistant-checkpoint``, ``run-operation``, ``run-state``,
        ``attempt-reset``, ``terminal``. The iteration ends once ``result`` settled. Bounded by ``capacity``
        events: a consumer that falls behind reads a :class:`~threadline.following.ResyncEvent` instead of
        what it lost, and never slows the run. Call it right after ``submit`` to see every event; called
        later, it starts with the next one. A run another process executes (``runs.execute=False``) has
        events between its admission and its end only when a live relay feeds this runtime
        (:meth:`relayed_delivery`); without one, the admission, then the end of the iteration.
        Following is observation only: cancelling the consuming task, or ``await events.aclose()``, stops
        reading and changes nothing durable; the run goes on."""
        if self._runtime is None:
            raise AgentRuntimeUsageError("this ticket was not made by a runtime: it has no events to follow")
        if type(capacity) is not int or capacity < 1:
            raise AgentConfigError(f"capacity is an int of at least 1, got {capacity!r}", field="capacity")
        return self._runtime._follow(self, capacity)


@dataclass
class AgentPromptContext:
    """What prompt contributions and ``tools`` receive."""

    context: Any
    conversation_id: str
    run: Run
    model: AgentModelDescriptor | None = None


def _isolated(publisher: Callable[[Any], Any] | None, event: Any, failures: ThrottledLog) -> None:
    """Hand ``event`` to ``publisher``; a failure (raised, or by the awaitable it returned) is logged, never
    raised: a publisher cannot change a committed run."""
    if publisher is None:
        return
    try:
        outcome = publisher(event)
        if inspect.isawaitable(outcome):
            task = asyncio.ensure_future(outcome)
            task.add_done_callback(lambda t: _publish_failed(t, event, failures))
    except Exception as error:
        failures.failed("a publisher raised on a %s event", getattr(event, "type", "?"), error=error)


def _publish_failed(task: asyncio.Future[Any], event: Any, failures: ThrottledLog) -> None:
    if not task.cancelled() and task.exception() is not None:
        failures.failed("a publisher failed on a %s event", getattr(event, "type", "?"), error=task.exception())


def _result_from(run: Run, assistant: Message | None, metrics: Any = None, output: AgentOutput | None = None) -> Any:
    if run.terminal_reason == "absorbed":
        answered_by = run.absorbed_into_run_id
    else:
        answered_by = run.id if run.state == "completed" else None
    value = output.value_of(assistant.parts) if output is not None and answered_by and assistant else None
    return build(
        _RESULT,
        {
            "terminal_reason": run.terminal_reason or "",
            "run": run,
            "assistant": assistant,
            "usage": run.usage,
            "policy_name": run.policy_name,
            "metrics": metrics,
            "answered_by_run_id": answered_by,
            "output": value,
        },
    )


_QUIET_FAILURES = frozenset({"timeout", "context_overflow", "output_rejected"})
"""Failures the application asked for or the provider's silence: a warning without a traceback."""


def _log_outcome(run: Run, outcome: RunOutcome) -> None:
    """One log line for an execution that did not end well (nothing on the happy path): a committed
    failure (its traceback when an exception caused it), a lost fence, or a terminal that could not be
    committed."""
    if outcome.lost is not None:
        _log.warning(
            "run %s (conversation %r) stopped without a terminal: another executor owns it now (%s)",
            run.id,
            run.conversation_id,
            type(outcome.lost).__name__,
        )
        return
    if outcome.unsettled is not None or outcome.reason is None:
        _log.error(
            "run %s (conversation %r) could not be settled: its terminal was not committed",
            run.id,
            run.conversation_id,
            exc_info=outcome.unsettled,
        )
        return
    failure = outcome.run.failure
    if not outcome.committed or failure is None:
        return
    quiet = outcome.reason in _QUIET_FAILURES
    _log.log(
        logging.WARNING if quiet else logging.ERROR,
        "run %s (conversation %r) ended %s: %s failure: %s",
        run.id,
        run.conversation_id,
        outcome.reason,
        failure.origin,
        failure.summary,
        exc_info=None if quiet or outcome.cause is None else outcome.cause,
    )


def _paused_for_approval(run: Run | None, run_id: str | None) -> bool:
    """Whether a stored approval request is answerable: its run paused for it (``provider_stop``)."""
    if run_id is None:
        return True  # a request no run owns (seeded history): the application put it there
    return run is not None and run.terminal_reason == "provider_stop"


def _close_budget(name: str, value: float | None) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
        raise AgentConfigError(
            f"{name} is None or a finite, non-negative number of seconds, got {value!r}; nothing was closed",
            field=name,
        )
    return float(value)


class _Writes:
    """Durable writes this runtime sent outside its lanes (admissions, recovery decisions) and has not seen
    answered yet: ``close()`` waits for them and counts them as still in flight."""

    def __init__(self) -> None:
        self.count = 0
        self._idle: asyncio.Event | None = None

    def begin(self) -> None:
        self.count += 1

    def end(self) -> None:
        self.count -= 1
        if self.count == 0 and self._idle is not None:
            self._idle.set()

    async def idle(self) -> None:
        while self.count:
            if self._idle is None or self._idle.is_set():
                self._idle = asyncio.Event()
            await self._idle.wait()


# ----------------------------------------------------------------------------------------- runtime


class AgentRuntime:
    """Runs durable conversations: admission, lanes and policies, the step loop, recovery and close."""

    def __init__(
        self,
        *,
        protocol: AgentProtocol,
        store: AgentRuntimeStore,
        models: Any,
        prompt: Any = None,
        tools: Any = None,
        runs: Any = None,
        loop: Any = None,
        history: Any = None,
        publish: Callable[[Any], Any] | None = None,
        operator_publish: Callable[[Any], Any] | None = None,
        include_internal_cause: bool = False,
    ) -> None:
        if not isinstance(protocol, AgentProtocol):
            raise AgentConfigError(
                f"protocol is built with define_agent_protocol(...), got {type(protocol).__name__}", field="protocol"
            )
        self.protocol = protocol
        self.store = _runtime_store(store)
        self._preflight, self._resolve = _model_hooks(models)
        self._prompt = _prompt_source(prompt)
        self._tools = _tool_source(tools)
        for name, hook in (("publish", publish), ("operator_publish", operator_publish)):
            if hook is not None and not callable(hook):
                raise AgentConfigError(
                    f"{name} is None or a callable taking one event (a sink from threadline.delivery is one), "
                    f"got {type(hook).__name__}",
                    field=name,
                )
        self.runs = section(RunsConfig, runs, "runs")
        loop_config = section(LoopConfig, loop, "loop")
        self.loop_settings = LoopSettings(
            checkpoint_every_events=loop_config.checkpoint_every_events,
            idle_timeout=loop_config.idle_timeout,
            max_steps=loop_config.max_steps,
            stop_policies=tuple(loop_config.stop_policies),  # type: ignore[arg-type]  # StopPolicy records now
            prepare_step=loop_config.prepare_step,
            model_settings=dict(loop_config.model_settings) if loop_config.model_settings else None,  # type: ignore[arg-type]
            retry=loop_config.retry,  # type: ignore[arg-type]  # an AgentRetryPolicy now
            tool_lifecycle=loop_config.tool_lifecycle,
            tool_approval=loop_config.tool_approval,
            tool_approval_secret=loop_config.tool_approval_secret,
            step_durability=loop_config.step_durability,
        )
        history_config = section(HistoryConfig, history, "history")
        try:
            self.projection_options = AgentHistoryProjectionOptions.model_validate(
                {k: v for k, v in vars(history_config).items() if v is not None and k not in ("compaction", "project")}
            )
        except ValidationError as error:
            first = error.errors()[0]
            where = "history." + ".".join(str(p) for p in first["loc"])
            raise AgentConfigError(f"{where}: {first['msg']}", field=where) from error
        self.loop_settings.compaction = history_config.compaction
        self.loop_settings.project = history_config.project
        self._publish_fn = publish
        self._operator_publish_fn = operator_publish
        # internal causes (exception text) reach a plain callable only on request; a sink that declares
        # ``include_internal_cause`` (create_agent_operator_sink) redacts by its own setting
        if type(include_internal_cause) is not bool:
            raise AgentConfigError("include_internal_cause is True or False", field="include_internal_cause")
        self._hand_causes = include_internal_cause or hasattr(operator_publish, "include_internal_cause")
        self._writes = _Writes()
        self._publish_failures = ThrottledLog(_events_log)
        self._resolver: Callable[[Run], Any] | None = self.runs.resolve_context
        # without a publisher no event is built at all
        self.publishing = publish is not None
        self.operator_publishing = operator_publish is not None
        self._followers = Followers()
        self._outputs: dict[str, AgentOutput] = {}  # per-run overrides of the protocol's output, by run id
        self._live: dict[str, LoopEnv] = {}  # the environments of runs executing here, by run id
        self._sequences: dict[str, int] = {}
        self.owner_id = self.runs.owner_id or f"runtime-{uuid.uuid4().hex[:12]}"
        self.runtime_epoch = uuid.uuid4().hex
        self.closing = False
        self.lanes: dict[str, Lane] = {}
        self.waiters = Waiters()
        self._views: OrderedDict[str, ConversationView] = OrderedDict()
        self._serve_wakeup = asyncio.Event()
        self._watchers: set[asyncio.Future[None]] = set()
        self._listening: asyncio.Future[Any] | None = None
        self._listen_retry_at = 0.0  # loop time before which a failed first listen is not tried again
        self._unobserve = self.store.observe(self._observed)
        self._options_by_provider: dict[str | None, AgentHistoryProjectionOptions] = {}

    # ---------------------------------------------------------------------------------- plumbing

    @staticmethod
    async def _call_hook(hook: Callable[..., Any], argument: Any) -> Any:
        if _takes_argument(hook):
            return await call_maybe_async(hook, argument)
        return await call_maybe_async(hook)

    def publish(self, event: Any) -> None:
        """Hand a delivery event to the application's publisher and to the followers of its run
        (``ticket.events()``). A publisher failure never changes a run."""
        _isolated(self._publish_fn, event, self._publish_failures)
        if self._followers:
            self._followers.deliver(event)

    def relayed_delivery(self) -> AgentRelayedDelivery:
        """The seam a live relay (:mod:`threadline.live`: ``await relay.subscribe(runtime)``) delivers other
        processes' delivery events through: to this runtime's ``publish=`` callback and to the followers
        of their runs, as if published here. With it, ``ticket.events()`` of a run another process executes
        (``runs={"execute": False}``) yields that run's deltas, tool status and terminal, and its ticket
        settles as soon as the relayed terminal arrives (see :mod:`threadline.following`). Close it when
        the relay stops."""
        return AgentRelayedDelivery(self._followers, self.publish)

    def operator_publish(self, event: Any) -> None:
        """Hand an operator event (run-started, step-finished, run-terminal) to the operator publisher."""
        _isolated(self._operator_publish_fn, event, self._publish_failures)

    async def retry_store(self, call: Callable[[], Awaitable[C]]) -> C:
        """Retry a failing store call for about half a second (see :func:`threadline.loop.with_store_retry`)."""
        return await with_store_retry(call)

    def result_from(self, run: Run, assistant: Message | None) -> AgentRuntimeResult:
        """The result of a run read from the store (this process did not apply its terminal)."""
        return self._result(run, assistant)

    def _result(self, run: Run, assistant: Message | None, metrics: Any = None) -> AgentRuntimeResult:
        return _result_from(run, assistant, metrics, self._outputs.get(run.id) or self.protocol.output)

    def _observed(self, write: Write | Purge) -> None:
        """Keep cached views current with this process's own writes (no read back)."""
        cid = write.conversation_id if isinstance(write, Purge) else write.mutation.head.conversation_id  # type: ignore[union-attr]
        view = self._views.get(cid)
        if view is not None:
            view.observe(write)

    def _view(self, conversation_id: str) -> ConversationView:
        """The cached view of a conversation (least recently used views are dropped beyond the limit)."""
        view = self._views.pop(conversation_id, None) or ConversationView(conversation_id)
        self._views[conversation_id] = view
        while len(self._views) > VIEW_CACHE_LIMIT:
            self._views.popitem(last=False)
        return view

    def _lane(self, conversation_id: str) -> Lane:
        lane = self.lanes.get(conversation_id)
        if lane is None:
            lane = self.lanes[conversation_id] = Lane(self, conversation_id)
        return lane

    def _builds(self, run_id: str) -> bool:
        """Whether events of this run go anywhere (the publisher, a ticket's follower): if not, none is
        even built (each costs a validation)."""
        return self.publishing or run_id in self._followers.by_run

    def _follow(self, ticket: AgentRuntimeTicket, capacity: int) -> RunFollower:
        def unfollow(follower: RunFollower) -> None:
            if ticket.run_id is not None:
                self._followers.unfollow(ticket.run_id, follower)
            elif follower in ticket._waiting:
                ticket._waiting.remove(follower)

        follower = RunFollower(ticket.result, capacity, on_close=unfollow)
        ticket.result.add_done_callback(lambda _: follower.close())
        if ticket.run_id is None:
            ticket._waiting.append(follower)  # until the admission names the run
        else:
            self._start_following(ticket.run_id, follower)
        return follower

    def _start_following(self, run_id: str, follower: RunFollower) -> None:
        self._followers.follow(run_id, follower)
        env = self._live.get(run_id)
        if env is not None:
            env.publishing = True  # executing already: its next events are built

    def _bind(self, ticket: AgentRuntimeTicket, run_id: str) -> None:
        """The admission named the ticket's run: its waiting followers follow that run from now on."""
        ticket.run_id = run_id
        waiting, ticket._waiting = ticket._waiting, []
        for follower in waiting:
            self._start_following(run_id, follower)

    def _publish_run_state(self, run: Run, version: int) -> None:
        if not self._builds(run.id):
            return
        self.publish(
            RunStateEvent(
                event_id=durable_event_id(run.id, "run-state", version),
                conversation_id=run.conversation_id,
                run_id=run.id,
                version=version,
                state=run.state,
                terminal_reason=run.terminal_reason,
            )
        )

    # ------------------------------------------------------------------------------------ submit

    def submit(
        self,
        *,
        conversation_id: str,
        parts: str | Sequence[Any],
        context: Any = None,
        idempotency_key: str | None = None,
        input_metadata: Any = None,
        record_ids: Mapping[str, str] | None = None,
        output: Any = None,
    ) -> AgentRuntimeTicket:
        """Admit one input. Returns a ticket at once; call from a running event loop.

        ``output`` overrides the protocol's structured output for this run (``City``, ``ToolOutput(City)``,
        ...; checked here: :class:`~threadline.errors.AgentConfigError`). It lives in this process: a run
        executed or read elsewhere uses the protocol's.

        ``parts`` is a list of parts (``{"type": "text", "text": ...}``, a file part, or part records); a
        ``str`` is one text part. ``context`` is validated against the protocol's context model.
        ``idempotency_key`` identifies the input: retrying with the same key (after a timeout, a lost reply,
        a restart) resolves to the same run and never admits it twice. Without one, a fresh key is drawn
        (``ticket.idempotency_key``): the input is admitted once, but a retry that does not pass that key
        admits it again as a new input.

        ``record_ids`` may fix ``input_message_id``, ``run_id`` and ``assistant_message_id`` (reuse the same
        input id when retrying a key). When ``admission`` resolves, the input, its receipt and its queued
        run are durable. Cancelling ``ticket.task`` before that may or may not have admitted the input:
        retry with the same key to find out.
        """
        loop = asyncio.get_running_loop()
        declared = None
        if output is not None:
            retries = self.protocol.output.retries if self.protocol.output is not None else OUTPUT_RETRIES
            declared = agent_output(output, retries=retries)
        if idempotency_key is None:
            idempotency_key = new_id("key")
        ticket = AgentRuntimeTicket(
            admission=quiet(loop.create_future()),
            accepted=quiet(loop.create_future()),
            result=quiet(loop.create_future()),
            idempotency_key=idempotency_key,
            _runtime=self,
        )
        ticket.task = loop.create_task(
            self._admit(
                ticket, conversation_id, idempotency_key, context, parts, input_metadata, record_ids or {}, declared
            )
        )
        return ticket

    def _submit_input(
        self, *, conversation_id: str, idempotency_key: str, context: Any, parts: Sequence[Any], role: str, policy: str
    ) -> AgentRuntimeTicket:
        loop = asyncio.get_running_loop()
        ticket = AgentRuntimeTicket(
            admission=quiet(loop.create_future()),
            accepted=quiet(loop.create_future()),
            result=quiet(loop.create_future()),
            idempotency_key=idempotency_key,
            _runtime=self,
        )
        ticket.task = loop.create_task(
            self._admit(
                ticket, conversation_id, idempotency_key, context, parts, None, {}, None, role=role, policy=policy
            )
        )
        return ticket

    async def _admit(
        self,
        ticket: AgentRuntimeTicket,
        conversation_id: str,
        idempotency_key: str,
        context: Any,
        parts: Sequence[Any],
        input_metadata: Any,
        record_ids: Mapping[str, str],
        output: AgentOutput | None = None,
        *,
        role: str = "user",
        policy: str | None = None,
    ) -> None:
        try:
            if self.closing:
                raise AgentRuntimeClosedError(
                    "the runtime is closed and admits no further work: submit() writes nothing"
                )
            unknown = set(record_ids) - {"input_message_id", "run_id", "assistant_message_id"}
            if unknown:
                raise AgentRecordValidationError(f"record_ids has unknown keys {sorted(unknown)}", field="record_ids")
            parsed_context = self.protocol.parse_context(context)
            metadata = self.protocol.parse_input_metadata(input_metadata)
            canonical_parts = input_parts(parts)
            raw = None  # built only for a callback that looks at it
            if (policy is None and callable(self.runs.input_policy)) or self._preflight is not None:
                raw = AgentRuntimeInput(
                    conversation_id=conversation_id,
                    idempotency_key=idempotency_key,
                    context=context,
                    parts=(parts,) if isinstance(parts, str) else tuple(parts),
                    input_metadata=input_metadata,
                )
            if policy is None:
                policy = self.runs.input_policy(raw) if callable(self.runs.input_policy) else self.runs.input_policy
            if policy not in INPUT_POLICIES:
                raise AgentRuntimeUsageError(f"input_policy returned {policy!r}; expected one of {INPUT_POLICIES}")
            if self._preflight is not None:
                await self._call_hook(self._preflight, raw)
            check_input_parts(canonical_parts, role, self.loop_settings.tool_approval_secret)
            metadata_json = metadata.model_dump(mode="json") if isinstance(metadata, BaseModel) else (metadata or {})
            check_input_size(canonical_parts, metadata_json, self.runs.max_input_bytes)
            # an input for a conversation this process is not running anything in is admitted and started
            # in one commit (the store starts it only if nothing is queued or running there durably)
            idle = self.lanes.get(conversation_id)
            start = self.runs.execute and (idle is None or (not idle.busy and not idle.contexts))
            first = self._first_request() if start else None
            if self.closing:  # close() began while the preflight or the policy was deciding: write nothing
                raise AgentRuntimeClosedError(
                    "the runtime is closed and admits no further work: submit() writes nothing"
                )
            self._writes.begin()  # from here the admission is in flight: close() waits for its answer
            try:
                accepted = await self.store.accept_input_and_assign_run(
                    conversation_id=conversation_id,
                    idempotency_key=idempotency_key,
                    input={
                        "id": record_ids.get("input_message_id"),  # None: the store draws a fresh one
                        "role": role,
                        "parts": canonical_parts,
                        "metadata": metadata_json,
                    },
                    run_id=record_ids.get("run_id"),
                    assistant_message_id=record_ids.get("assistant_message_id"),
                    priority="urgent" if policy == "interrupt-next" else "ordinary",
                    input_policy=policy,
                    coalesce=self.runs.coalesce_pending,
                    start_for=self.owner_id if start else None,
                    lease_expires_at=self._lease_expiry() if start else None,
                    operation=first,
                )
            finally:
                self._writes.end()
        except BaseException as error:
            for future in (ticket.admission, ticket.accepted, ticket.result):
                if not future.done():
                    future.set_exception(error)
            if not isinstance(error, Exception):
                raise
            return
        run = accepted.run
        if output is not None:
            self._outputs[run.id] = output
            ticket.result.add_done_callback(lambda _: self._outputs.pop(run.id, None))
        admission = build(
            _ADMISSION,
            {
                "outcome": accepted.outcome,
                "input": accepted.receipt.input,
                "run": run,
                "pending": build(_PENDING, {"id": accepted.receipt.assistant_message_id, "run_id": run.id}),
                "version": accepted.version,
                "coalesced": accepted.coalesced,
            },
        )
        self._bind(ticket, run.id)
        ticket.admission.set_result(admission)
        if self._builds(run.id):
            self.publish(
                AdmissionEvent(
                    event_id=durable_event_id(run.id, "admission", accepted.version),
                    conversation_id=conversation_id,
                    run_id=run.id,
                    version=accepted.version,
                    outcome=accepted.outcome,
                    input=accepted.receipt.input,
                    run=run if run.failure is None else evolve(run, {"failure": None}),  # delivery omits it
                    assistant_message_id=accepted.receipt.assistant_message_id,
                    coalesced=accepted.coalesced,
                )
            )
        if accepted.outcome == "accepted" and not accepted.coalesced:
            self._publish_run_state(run, accepted.version)
        ticket.accepted.set_result(admission)
        if run.terminal:
            ticket.result.set_result(self._result(run, accepted.answer))
            return
        self.waiters.add_result(run.id, ticket.result)
        if not self.runs.execute:
            # admission only: another process executes; the ticket follows the stored run, and an
            # interrupting policy reaches the executor as a durable interrupt (at once over NOTIFY)
            if accepted.outcome == "accepted" and policy in ("interrupt", "interrupt-next", "supersede"):
                await self._interrupt_elsewhere(conversation_id, run.id)
            self._watchers.add(asyncio.ensure_future(self._watch(conversation_id, run.id)))
            return
        lane = self._lane(conversation_id)
        lane.contexts.setdefault(run.id, parsed_context)
        lane.admitted[run.id] = run
        if start and accepted.outcome == "accepted" and not accepted.coalesced and run.state == "running":
            lane.started[run.id] = (run, accepted.version, first)
        if accepted.outcome == "accepted":
            lane.apply_policy(policy, run.id)
        lane.wake()

    def _ensure_listening(self) -> None:
        """Subscribe to the store's cross-process notifications when it has them (PostgreSQL LISTEN/
        NOTIFY): a durable interrupt committed elsewhere aborts the run executing here at once, and new
        queued work wakes ``serve``. Without them the next CAS or sweep finds out, only later."""
        listen = getattr(self.store.driver, "listen", None)
        if listen is None or self.closing:
            return
        listening = self._listening
        if listening is not None:
            failed = listening.done() and not listening.cancelled() and listening.exception() is not None
            if not failed or asyncio.get_running_loop().time() < self._listen_retry_at:
                return  # listening (the driver keeps its connection), or the server was away a moment ago
        self._listen_retry_at = asyncio.get_running_loop().time() + _LISTEN_RETRY_S
        self._listening = asyncio.ensure_future(listen(self._notified))
        self._listening.add_done_callback(lambda f: f.cancelled() or f.exception())

    async def _stop_listening(self) -> None:
        listening, self._listening = self._listening, None
        if listening is None:
            return
        if not listening.done():
            listening.cancel()
            return
        if not listening.cancelled() and listening.exception() is None:
            with contextlib.suppress(Exception):
                await listening.result()()

    def _notified(self, note: dict[str, Any]) -> None:
        if note.get("event") == "interrupt":
            lane = self.lanes.get(str(note.get("conversation_id")))
            if lane is not None and lane.control is not None and lane.control.run_id == note.get("run_id"):
                lane.control.abort("interrupted")
        elif note.get("event") in ("queued", "resync"):  # resync: notifications were missed; sweep now
            self._serve_wakeup.set()

    async def _interrupt_elsewhere(self, conversation_id: str, newcomer: str) -> None:
        """The durable form of an interrupting policy, for runs executing in another process. (There is no
        durable 'supersede' request: such a run ends ``interrupted``.)"""
        active = await self.retry_store(lambda: self.store.list_active_runs(conversation_id=conversation_id))
        for run in active.runs:
            if run.acquired and run.id != newcomer:
                with contextlib.suppress(AgentStoreConflictError, AgentRecordNotFoundError):
                    result = await self.store.request_run_interrupt(conversation_id=conversation_id, run_id=run.id)
                    if result.outcome == "requested":
                        self._publish_run_state(result.run, result.version)

    async def _watch(self, conversation_id: str, run_id: str) -> None:
        """Settle a ticket of a run another process executes, by reading the stored run until it ends."""
        delay = 0.02
        try:
            while run_id in self.waiters.results:
                loaded = await self.retry_store(
                    lambda: self.store.load_run(conversation_id=conversation_id, run_id=run_id)
                )
                if loaded is not None and loaded.run.terminal:
                    if self._followers.relays and run_id in self._followers.by_run:
                        # a live relay brings the terminal event after the commit: followers read it first
                        await self._followers.wait_relayed_terminal(run_id, RELAYED_TERMINAL_GRACE)
                    self._followers.settle_elsewhere(run_id, loaded)
                    self.waiters.resolve(run_id, self._result(loaded.run, loaded.assistant))
                    return
                if self._followers.relays:  # a relayed terminal ends the wait at once
                    await self._followers.wait_relayed_terminal(run_id, delay)
                else:
                    await asyncio.sleep(delay)
                delay = min(delay * 2, self.runs.watch_interval)
        except Exception as error:
            self.waiters.reject(run_id, error)

    # --------------------------------------------------------------------------------- execution

    async def execute(self, lane: Lane, run: Run, context: Any) -> Step:
        """Acquire and execute one queued run (or one its admission started); settle its waiters. Returns
        what the lane does next (see :class:`threadline.coordinator.Step`)."""
        self._ensure_listening()
        started = lane.started.pop(run.id, None)
        if started is not None:  # admitted and acquired in one commit (its run-state event is out)
            owned, version, first = started
        else:
            if self.closing:
                return Step.CLOSED  # nothing new starts once close() began; the run stays queued
            # a run that started before (requeued after a crash) resumes from its draft: its acquisition
            # must not replace that draft with an empty one
            first = self._first_request() if run.execution_sequence is None else None
            try:
                acquisition = await self.retry_store(
                    lambda: self.store.acquire_run(
                        conversation_id=run.conversation_id,
                        run_id=run.id,
                        expected_revision=run.revision,
                        owner_id=self.owner_id,
                        lease_expires_at=self._lease_expiry(),
                        operation=first,
                    )
                )
            except AgentStoreConflictError:
                # the store moved under the lane (an interrupt-next or coalescing input, another executor,
                # a newer revision): never a reason to drop or abandon the run; the lane looks again
                return Step.REFUSED
            except (AgentConversationPurgedError, AgentRecordNotFoundError) as error:
                self.waiters.reject(run.id, error)
                return Step.GONE if isinstance(error, AgentConversationPurgedError) else Step.DONE
            except Exception as error:
                # acquisition failed past the retry budget (or its reply was lost): abandon the run durably
                return Step.DONE if await self._abandon_unacquirable(run, error) else Step.STOP
            owned, version = acquisition.run, acquisition.version
            self._publish_run_state(owned, version)
        self.waiters.mark_acquired(run.id, owned)
        queue_wait = None
        if owned.acquired_at is not None:
            queue_wait = max(0.0, (owned.acquired_at - owned.created_at).total_seconds())
        if self.operator_publishing:
            self.operator_publish(
                AgentRunStartedEvent(
                    conversation_id=run.conversation_id,
                    run_id=run.id,
                    runtime_epoch=self.runtime_epoch,
                    owner_id=self.owner_id,
                    fencing_token=owned.fencing_token,
                    queue_wait=queue_wait,
                )
            )
        control = RunControl(run.id)
        if self.closing:
            # its admission or acquisition was in flight when close() began, which could not abort it yet:
            # it ends at once, as close() ends runs
            control.abort("shutdown")
        lane.control = control
        prompt_ctx = AgentPromptContext(context=context, conversation_id=run.conversation_id, run=owned)
        env = LoopEnv(
            store=self.store,
            owner_id=self.owner_id,
            runtime_epoch=self.runtime_epoch,
            protocol=self.protocol,
            settings=self.loop_settings,
            resolve_model=lambda _execution: self._resolve_model(prompt_ctx),
            context=context,
            instructions=lambda _execution: self._instructions(prompt_ctx),
            tools=lambda _execution: self._run_tools(prompt_ctx),
            publish=self.publish,
            operator_publish=self.operator_publish,
            publishing=self._builds(run.id),
            operator_publishing=self.operator_publishing,
            sequences=self._sequences,
            lease=(self.runs.lease_duration, self._lease_expiry) if self.runs.lease_duration else None,
            view=self._view(run.conversation_id),
            projection_options=self.projection_options,
            output=self._outputs.get(run.id) or self.protocol.output,
            _options_by_provider=self._options_by_provider,
        )
        self._live[run.id] = env
        try:
            outcome = await execute_run(env, owned, control, (first, version) if first is not None else None)
        finally:
            lane.control = None
            del self._live[run.id]
        self._sequences.pop(run.id, None)
        if self.operator_publishing:
            self.operator_publish(
                AgentRunTerminalEvent(
                    conversation_id=run.conversation_id,
                    run_id=run.id,
                    runtime_epoch=self.runtime_epoch,
                    owner_id=self.owner_id,
                    fencing_token=owned.fencing_token,
                    outcome="committed" if outcome.committed else ("unsettled" if outcome.unsettled else "lost"),
                    terminal_reason=outcome.reason or outcome.run.terminal_reason,
                    policy_name=outcome.run.policy_name,
                    steps=outcome.steps,
                    usage=outcome.usage,
                    cause=(
                        describe_internal_cause(outcome.cause or outcome.lost or outcome.unsettled)
                        if self._hand_causes
                        else None
                    ),
                )
            )
        _log_outcome(run, outcome)
        if outcome.lost is not None:
            error = outcome.lost
            if not isinstance(error, AgentStoreConflictError):
                error = AgentRunOwnershipConflictError(
                    f"run {run.id} is no longer owned by {self.owner_id}",
                    conversation_id=run.conversation_id,
                    run_id=run.id,
                )
            self.waiters.reject(run.id, error)
            return Step.DONE
        if outcome.unsettled is not None or outcome.reason is None:
            self.waiters.reject(
                run.id,
                AgentRunUnsettledError(
                    f"run {run.id} could not be settled: {outcome.unsettled!r}", run=outcome.run, owner_id=self.owner_id
                ),
            )
            return Step.STOP
        metrics = build(_METRICS, {"steps": outcome.steps, "usage": outcome.usage}) if outcome.committed else None
        result = self._result(outcome.run, outcome.assistant, metrics)
        if outcome.committed:
            if self._foreign_queue(lane, outcome.run):
                lane.successor = True  # this runtime ended the run: it also starts what is queued behind it
            version = outcome.run.version
            self._publish_run_state(outcome.run, version)
            if self._builds(run.id):
                self.publish(
                    TerminalEvent(
                        event_id=durable_event_id(run.id, "terminal", version),
                        conversation_id=run.conversation_id,
                        run_id=run.id,
                        version=version,
                        terminal_reason=outcome.run.terminal_reason or "",
                        policy_name=outcome.run.policy_name,
                        assistant=delivered_message(outcome.assistant),
                        usage=outcome.run.usage,
                    )
                )
            for absorbed in outcome.absorbed_runs:
                self._publish_run_state(absorbed, version)
                self.waiters.resolve(absorbed.id, self._result(absorbed, outcome.assistant))
                lane.contexts.pop(absorbed.id, None)
        self.waiters.resolve(run.id, result)
        return Step.DONE

    def _foreign_queue(self, lane: Lane, ended: Run) -> bool:
        """Whether the conversation may hold queued runs this process did not admit: another writer wrote
        since this process's view last saw every write, or the view knows of an active run the lane was not
        asked to run. Only then is the stored queue read after a terminal (most turns skip that read)."""
        view = self._views.get(ended.conversation_id)
        if view is None or view.version != ended.version:
            return True
        return any(r.id not in lane.contexts for r in view.active_runs)

    async def _abandon_unacquirable(self, run: Run, cause: BaseException) -> bool:
        """Abandon a run whose acquisition kept failing (never one that merely lost a race: that is a
        conflict, and the lane looks again). Returns whether the store answered."""
        try:
            loaded = await self.retry_store(
                lambda: self.store.load_run(conversation_id=run.conversation_id, run_id=run.id)
            )
            current = loaded.run if loaded else run
            if current.acquired and current.owner_id not in (None, self.owner_id):
                raise AgentRunOwnershipConflictError(
                    f"run {run.id} is held by {current.owner_id}", conversation_id=run.conversation_id, run_id=run.id
                )
            abandoned = await self.retry_store(
                lambda: self.store.recover_run(
                    conversation_id=run.conversation_id,
                    run_id=run.id,
                    expected_revision=current.revision,
                    action="abandon",
                    stale_owner=True,
                )
            )
        except Exception as error:
            self.waiters.reject(
                run.id,
                AgentRunUnsettledError(
                    f"could not acquire run {run.id} ({cause!r}) nor abandon it ({error!r})",
                    run=run,
                    owner_id=self.owner_id,
                ),
            )
            return False
        self._publish_run_state(abandoned.run, abandoned.version)
        if self.operator_publishing:
            # the operator learns why: the acquisition's cause rides on its run-terminal (nothing was spent)
            self.operator_publish(
                AgentRunTerminalEvent(
                    conversation_id=run.conversation_id,
                    run_id=run.id,
                    runtime_epoch=self.runtime_epoch,
                    owner_id=self.owner_id,
                    fencing_token=abandoned.run.fencing_token,
                    outcome="committed",
                    terminal_reason=abandoned.run.terminal_reason,
                    steps=0,
                    usage=AgentUsage(),
                    cause=describe_internal_cause(cause) if self._hand_causes else None,
                )
            )
        self.waiters.resolve(run.id, self._result(abandoned.run, abandoned.assistant))
        return True

    async def resolve_context_of(self, run: Run) -> tuple[bool, Any]:
        """(True, the parsed context) of a run this runtime did not admit (``runs.resolve_context``, else the
        last ``recover()``/``serve()`` resolver); (False, None) without a resolver or when it failed (logged)."""
        resolver = self._resolver
        if resolver is None or not self.runs.execute:
            return False, None
        try:
            return True, self.protocol.parse_context(await call_maybe_async(resolver, run))
        except Exception:
            _log.warning("could not resolve the context of run %s; it waits for recover()", run.id, exc_info=True)
            return False, None

    def _refuse_if_closing(self, what: str) -> None:
        if self.closing:
            raise AgentRuntimeClosedError(f"the runtime is closed and admits no further work: {what}() starts nothing")

    async def _recovery_write(self, call: Callable[[], Awaitable[C]]) -> C:
        """A recovery decision's write: refused once close() began, waited for by close() once sent."""
        self._refuse_if_closing("recover")
        self._writes.begin()
        try:
            return await call()
        finally:
            self._writes.end()

    async def _requeue(self, run: Run, replay_safe: bool) -> RecoverResult:
        """Requeue an acquired run (a recovery decision) and publish its ``run-state`` ``queued``."""
        requeued = await self._recovery_write(
            functools.partial(
                self.store.recover_run,
                conversation_id=run.conversation_id,
                run_id=run.id,
                expected_revision=run.revision,
                action="requeue",
                replay_safe=replay_safe,
            )
        )
        self._publish_run_state(requeued.run, requeued.version)
        return requeued

    def _first_request(self) -> RunOperation | None:
        """Step 0's request admission, to ride on the run's acquisition (one commit less per run); None
        with a compaction hook, which may write between the two."""
        return model_request(0) if self.loop_settings.compaction is None else None

    def _lease_expiry(self) -> datetime | None:
        if self.runs.lease_duration is None:
            return None
        return datetime.now(UTC) + timedelta(seconds=self.runs.lease_duration)

    async def _resolve_model(self, ctx: AgentPromptContext) -> AgentModelDescriptor:
        resolved = await self._call_hook(self._resolve, ctx)
        if not isinstance(resolved, AgentModelDescriptor):
            from pydantic_ai.models import Model

            if not isinstance(resolved, Model):
                raise AgentRuntimeUsageError("models.resolve returns a model descriptor or a pydantic-ai Model")
            resolved = AgentModelDescriptor(name=resolved.model_name, model=resolved, context_window=None)
        ctx.model = resolved
        return resolved

    async def _instructions(self, ctx: AgentPromptContext) -> str:
        """The prompt's text, carrying the ``InstructionPart`` s it is sent as (its contributions' stable /
        dynamic split, or what ``adapt_instructions`` returned): see ``history.prompt.agent_instructions``."""
        if self._prompt is None:
            return agent_instructions(None)
        return agent_instructions(await call_maybe_async(self._prompt, ctx))

    async def _run_tools(self, ctx: AgentPromptContext) -> Sequence[AgentTool]:
        tools = self._tools
        if tools is None:
            return ()
        if callable(tools) and not isinstance(tools, AgentTool):
            tools = await call_maybe_async(tools, ctx)
        tools = list(tools)
        if not all(isinstance(t, AgentTool) for t in tools):
            raise AgentRuntimeUsageError("tools are declared with define_agent_tool(...)")
        return tools

    # ------------------------------------------------------------------------------------ control

    async def interrupt(self, *, conversation_id: str, run_id: str) -> InterruptResult:
        """Durably interrupt a run: commit ``interrupt_requested``, then abort it here if it runs here.
        Its executor commits the terminal (``interrupted``); a queued or ended run is reported as is."""
        result = await self.store.request_run_interrupt(conversation_id=conversation_id, run_id=run_id)
        if result.outcome == "requested":
            self._publish_run_state(result.run, result.version)
        lane = self.lanes.get(conversation_id)
        if lane is not None and lane.control is not None and lane.control.run_id == run_id:
            lane.control.abort("interrupted")
        return result

    def executing_run(self, conversation_id: str) -> str | None:
        """The id of the run this process is executing in the conversation, if any."""
        lane = self.lanes.get(conversation_id)
        return lane.control.run_id if lane is not None and lane.control is not None else None

    def stop(self, conversation_id: str, reason: Literal["interrupt", "supersede", "cancel"] = "interrupt") -> bool:
        """Process-local escape hatch: abort the conversation's executing run in this process. ``interrupt``
        (someone saw the partial answer: it stays, marked), ``supersede`` (nobody saw it: it leaves the
        prompt) or ``cancel`` (the caller withdrew the request). Returns whether a run was executing here.
        Nothing durable happens until the run's own terminal commit."""
        reasons = {"interrupt": "interrupted", "supersede": "superseded", "cancel": "cancelled"}
        if reason not in reasons:
            raise AgentRuntimeUsageError(f"stop reason is one of {sorted(reasons)}, got {reason!r}")
        lane = self.lanes.get(conversation_id)
        if lane is None or lane.control is None:
            return False
        lane.control.abort(reasons[reason])
        return True

    async def pending_approvals(self, conversation_id: str) -> list[AgentPendingApproval]:
        """Approval requests nobody answered yet that ``respond_to_approval`` accepts, derived from the stored
        history (also after a restart): a request of a run that did not pause for it (it failed or was
        interrupted instead) is not pending — nothing would run it."""
        snapshot = await self.store.load_snapshot(conversation_id=conversation_id)
        runs = {r.id: r for r in snapshot.runs}
        return [
            p for p in pending_approvals(snapshot.messages) if _paused_for_approval(runs.get(p.run_id or ""), p.run_id)
        ]

    async def respond_to_approval(
        self,
        *,
        conversation_id: str,
        approval_id: str,
        approved: bool,
        context: Any,
        reason: str | None = None,
    ) -> AgentRuntimeTicket:
        """Answer one pending approval: writes one ``tool`` message with the response and queues a
        successor run, which verifies the signed request and then runs the tool behind its fence (or
        records the denial) before the model continues. Unknown, already answered or mismatched
        approvals raise :class:`AgentApprovalError` and nothing is written."""
        snapshot = await self.store.load_snapshot(conversation_id=conversation_id)
        requests, responses = approval_state(snapshot.messages)
        found = requests.get(approval_id)
        if found is None:
            raise AgentApprovalError(
                f"no approval {approval_id!r} in {conversation_id!r}", reason="unknown", approval_id=approval_id
            )
        if approval_id in responses:
            raise AgentApprovalError(
                f"approval {approval_id!r} was already answered", reason="duplicate", approval_id=approval_id
            )
        request, message = found
        if not _paused_for_approval(next((r for r in snapshot.runs if r.id == message.run_id), None), message.run_id):
            raise AgentApprovalError(
                f"approval {approval_id!r} belongs to a run that did not pause for it",
                reason="mismatch",
                approval_id=approval_id,
            )
        part = {
            "type": "approval-response",
            "approval_id": approval_id,
            "call_id": request.call_id,
            "approved": approved,
        }
        if reason:
            part["reason"] = reason
        return self._submit_input(
            conversation_id=conversation_id,
            idempotency_key=f"approval:{approval_id}",
            context=context,
            parts=[part],
            role="tool",
            policy="queue",
        )

    async def abandon(
        self, *, conversation_id: str, run_id: str, expected_revision: int, stale_owner: bool = False
    ) -> RecoverResult:
        """Close one orphaned run with operator evidence that its owner is gone (``stale_owner=True`` is
        required). The run ends ``abandoned`` with a failed assistant; a run that moved is a conflict."""
        result = await self.store.recover_run(
            conversation_id=conversation_id,
            run_id=run_id,
            expected_revision=expected_revision,
            action="abandon",
            stale_owner=stale_owner,
        )
        self._publish_run_state(result.run, result.version)
        self.waiters.resolve(run_id, self._result(result.run, result.assistant))
        lane = self.lanes.get(conversation_id)
        if lane is not None:
            lane.wake()
        return result

    async def close(
        self, *, grace_period: float | None = None, force_timeout: float | None = None
    ) -> AgentRuntimeCloseResult:
        """Stop admitting, let active runs finish for ``grace_period``, then abort them (``shutdown``) and wait
        at most ``force_timeout`` (unbounded without it). Queued runs stay durably queued for ``recover()``.
        Reports what it achieved: ``settled`` or ``timed_out`` with ``remaining``.

        Work that has not written yet stops: a submit still in its preflight, a recovery still deciding,
        ``resume()`` and ``recover()`` called now raise :class:`AgentRuntimeClosedError` and write nothing. A
        write already sent (an admission, an acquisition, a recovery decision) is waited for like a run:
        ``settled`` is never reported while one is in flight, and ``remaining`` counts it. Negative, NaN or
        infinite budgets are refused (:class:`~threadline.errors.AgentConfigError`) before anything closes."""
        grace = _close_budget("grace_period", grace_period)
        force = _close_budget("force_timeout", force_timeout)
        self.closing = True
        self._serve_wakeup.set()
        for watcher in self._watchers:
            watcher.cancel()
        await self._stop_listening()
        if grace is not None:
            await self._settle(grace, abort=False)
        remaining = await self._settle(force, abort=True)
        in_flight = {lane.control.run_id for lane in self.lanes.values() if lane.control is not None}
        # tickets of runs still executing settle when those runs end; queued ones wait for recover()
        self.waiters.reject_all(
            lambda run_id: AgentRuntimeClosedError(
                f"the runtime closed before run {run_id} ended; recover() resumes it"
            ),
            keep=in_flight,
        )
        return AgentRuntimeCloseResult(settled=remaining == 0, timed_out=remaining > 0, remaining=remaining)

    async def _settle(self, timeout: float | None, *, abort: bool) -> int:
        """Wait, at most ``timeout`` seconds (None: no bound), until no lane works and no admission or
        recovery write is in flight; with ``abort``, every executing run is aborted (``shutdown``), also one
        an in-flight admission starts meanwhile. Returns how much is still in flight."""
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        while True:
            busy = [lane for lane in self.lanes.values() if lane.busy]
            if abort:
                for lane in busy:
                    if lane.control is not None:
                        lane.control.abort("shutdown")
            in_flight = len(busy) + self._writes.count
            left = None if deadline is None else deadline - loop.time()
            if in_flight == 0 or (left is not None and left <= 0):
                return in_flight
            waits: set[asyncio.Future[Any]] = {lane.task for lane in busy if lane.task is not None}
            writes = asyncio.ensure_future(self._writes.idle()) if self._writes.count else None
            if writes is not None:
                waits.add(writes)
            try:
                await asyncio.wait(waits, timeout=left, return_when=asyncio.FIRST_COMPLETED)
            finally:
                if writes is not None:
                    writes.cancel()

    async def resume(self, *, conversation_id: str, run_id: str, context: Any) -> AgentRuntimeTicket:
        """Run one known queued run (for example after a restart). ``accepted`` resolves once this runtime
        durably acquired it; ``result`` at its terminal. Raises :class:`AgentRuntimeClosedError` once
        ``close()`` began."""
        loop = asyncio.get_running_loop()
        self._refuse_if_closing("resume")
        loaded = await self.store.load_run(conversation_id=conversation_id, run_id=run_id)
        self._refuse_if_closing("resume")
        if loaded is None:
            raise AgentRecordNotFoundError(f"conversation {conversation_id!r} has no run {run_id!r}")
        ticket = AgentRuntimeTicket(
            admission=quiet(loop.create_future()),
            accepted=quiet(loop.create_future()),
            result=quiet(loop.create_future()),
            run_id=run_id,
            _runtime=self,
        )
        ticket.admission.set_exception(AgentRuntimeUsageError("resume does not admit input"))
        if loaded.run.terminal:
            ticket.accepted.set_result(loaded.run)
            ticket.result.set_result(self._result(loaded.run, loaded.assistant))
            return ticket
        if loaded.run.state != "queued":
            raise AgentRunStateConflictError(
                f"run {run_id!r} is {loaded.run.state}; only a queued run can be resumed",
                conversation_id=conversation_id,
                run_id=run_id,
                run=loaded.run,
            )
        lane = self._lane(conversation_id)
        lane.contexts[run_id] = self.protocol.parse_context(context)
        self.waiters.add_acquired(run_id, ticket.accepted)
        self.waiters.add_result(run_id, ticket.result)
        lane.wake()
        return ticket

    async def recover(
        self,
        *,
        resolve_context: Callable[[Run], Any],
        policy: Callable[[Run], Any] | None = None,
        page_size: int = 100,
        max_runs: int | None = None,
        conversation_ids: Collection[str] | None = None,
    ) -> list[AgentRecoveryOutcome]:
        """One recovery pass: read bounded pages of active runs, restore each conversation's execution
        order, then resume queued runs (reported after durable acquisition) and apply ``policy`` (sync or
        async) to acquired ones: ``{"action": "skip"}`` (default), ``{"action": "abandon", "stale_owner":
        True}`` or ``{"action": "requeue", "replay_safe": True}``. One outcome per run; one failure hides
        nothing. An acquisition that loses a race (another executor, an input that moved the queue) is that
        run's outcome (``failed`` with the conflict, or ``blocked``) and the pass goes on; it never abandons
        the run. Raises :class:`AgentRuntimeClosedError` when ``close()`` began before or during the pass
        (a decision not yet written is then not written). ``resolve_context`` is also what this runtime
        uses later for runs admitted elsewhere, unless ``runs.resolve_context`` is set."""
        self._refuse_if_closing("recover")
        if self.runs.resolve_context is None:
            self._resolver = resolve_context
        runs: list[Run] = []
        cursor = None
        while True:
            page = await self.store.scan_recoverable(cursor=cursor, limit=page_size)
            runs.extend(r for r in page.runs if conversation_ids is None or r.conversation_id in conversation_ids)
            if max_runs is not None and len(runs) >= max_runs:
                runs = runs[:max_runs]
                break
            if page.next_cursor is None:
                break
            cursor = page.next_cursor
        # conversations recover concurrently; inside one, runs resume strictly in execution order
        groups = order_recoverable(runs)
        results = await asyncio.gather(*(self._recover_conversation(g, resolve_context, policy) for g in groups))
        return [outcome for group in results for outcome in group]

    async def serve(
        self,
        *,
        resolve_context: Callable[[Run], Any],
        policy: Callable[[Run], Any] | None = None,
        poll_interval: float = 1.0,
        page_size: int = 100,
    ) -> None:
        """Execute whatever is queued — also runs other processes admitted — until :meth:`close`: every
        ``poll_interval`` seconds one bounded sweep hands each queued run to its conversation's lane (which
        runs it when it is next in durable order) and applies ``policy`` to acquired runs (for example
        :func:`takeover_expired_leases`). Cancelling the task stops the sweeps; runs already executing go
        on until ``close``. With a PostgreSQL store, new work and interrupts arrive through LISTEN/NOTIFY
        at once; the sweep is the fallback. ``resolve_context`` is also what this runtime uses for runs admitted
        elsewhere that queue behind a run it ends, unless ``runs.resolve_context`` is set."""
        self._refuse_if_closing("serve")
        if self.runs.resolve_context is None:
            self._resolver = resolve_context
        self._ensure_listening()
        while not self.closing:
            cursor = None
            while not self.closing:
                page = await self.retry_store(lambda c=cursor: self.store.scan_recoverable(cursor=c, limit=page_size))
                for group in order_recoverable(page.runs):
                    await self._hand_over(group, resolve_context, policy)
                if page.next_cursor is None:
                    break
                cursor = page.next_cursor
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._serve_wakeup.wait(), poll_interval)
            self._serve_wakeup.clear()

    async def _hand_over(
        self, group: list[Run], resolve_context: Callable[[Run], Any], policy: Callable[[Run], Any] | None
    ) -> None:
        lane = self._lane(group[0].conversation_id)
        for run in group:
            if self.closing:
                return
            if lane.control is not None and lane.control.run_id == run.id:
                continue
            if run.acquired:
                decision = dict(await call_maybe_async(policy, run)) if policy is not None else {"action": "skip"}
                if decision.get("action") == "requeue":
                    with contextlib.suppress(AgentStoreConflictError, AgentRuntimeClosedError):
                        await self._requeue(run, bool(decision.get("replay_safe")))
                elif decision.get("action") == "abandon":
                    with contextlib.suppress(AgentStoreConflictError, AgentRuntimeClosedError):
                        await self._recovery_write(
                            functools.partial(
                                self.abandon,
                                conversation_id=run.conversation_id,
                                run_id=run.id,
                                expected_revision=run.revision,
                                stale_owner=bool(decision.get("stale_owner")),
                            )
                        )
                    continue
                else:
                    return  # held by a live owner: nothing behind it can run yet
            if run.id not in lane.contexts:
                try:
                    lane.contexts[run.id] = self.protocol.parse_context(await call_maybe_async(resolve_context, run))
                except ThreadlineError:
                    return  # no context for it here: leave it to whoever can run it
        lane.wake()

    async def _recover_conversation(
        self, group: list[Run], resolve_context: Callable[[Run], Any], policy: Callable[[Run], Any] | None
    ) -> list[AgentRecoveryOutcome]:
        outcomes: list[AgentRecoveryOutcome] = []
        blocked = False
        loop = asyncio.get_running_loop()
        for scanned in group:
            self._refuse_if_closing("recover")
            cid = scanned.conversation_id
            lane = self._lane(cid)
            # the scan is a snapshot: act on the run as it is now (a retry may have answered it meanwhile)
            try:
                read = functools.partial(self.store.load_run, conversation_id=cid, run_id=scanned.id)
                loaded = await self.retry_store(read)
            except Exception as error:
                outcomes.append(AgentRecoveryOutcome(cid, scanned.id, "failed", error=error))
                blocked = True
                continue
            if loaded is None or loaded.run.terminal:
                settled: asyncio.Future[Any] = quiet(loop.create_future())
                if loaded is not None:
                    settled.set_result(self._result(loaded.run, loaded.assistant))
                    outcomes.append(AgentRecoveryOutcome(cid, scanned.id, "resumed", result=settled))
                continue
            run = loaded.run
            if lane.control is not None and lane.control.run_id == run.id:
                # already executing in this process (acquired durably): report it with its result
                running: asyncio.Future[Any] = quiet(loop.create_future())
                self.waiters.add_result(run.id, running)
                outcomes.append(AgentRecoveryOutcome(cid, run.id, "resumed", result=running))
                continue
            try:
                kind: Literal["resumed", "requeued"] = "resumed"
                if run.acquired:
                    decision = dict(await call_maybe_async(policy, run)) if policy is not None else {"action": "skip"}
                    action = decision.get("action", "skip")
                    if action == "abandon":
                        await self._recovery_write(
                            functools.partial(
                                self.abandon,
                                conversation_id=cid,
                                run_id=run.id,
                                expected_revision=run.revision,
                                stale_owner=bool(decision.get("stale_owner")),
                            )
                        )
                        outcomes.append(AgentRecoveryOutcome(cid, run.id, "abandoned"))
                        continue
                    if action != "requeue":
                        outcomes.append(AgentRecoveryOutcome(cid, run.id, "skipped"))
                        blocked = True
                        continue
                    requeued = await self._requeue(run, bool(decision.get("replay_safe")))
                    run, kind = requeued.run, "requeued"
                elif blocked:
                    outcomes.append(AgentRecoveryOutcome(cid, run.id, "blocked"))
                    continue
                lane.contexts[run.id] = self.protocol.parse_context(await call_maybe_async(resolve_context, run))
                self._refuse_if_closing("recover")
                acquired: asyncio.Future[Any] = quiet(loop.create_future())
                result: asyncio.Future[Any] = quiet(loop.create_future())
                self.waiters.add_acquired(run.id, acquired)
                self.waiters.add_result(run.id, result)
                lane.wake()
                await acquired
                outcomes.append(AgentRecoveryOutcome(cid, run.id, kind, result=result))
            except AgentRuntimeClosedError:
                raise
            except (ThreadlineError, RuntimeError) as error:
                # a conflict (another executor acquired it, the queue moved), a refusal, or the run ended
                # before it could be acquired: this run's outcome; the runs behind it wait
                outcomes.append(AgentRecoveryOutcome(cid, run.id, "failed", error=error))
                blocked = True
        return outcomes


def takeover_expired_leases(
    *, now: Callable[[], datetime] = lambda: datetime.now(UTC), replay_safe: bool = True
) -> Callable[[Run], dict[str, Any]]:
    """A ``recover(policy=...)`` for many processes: an acquired run whose lease expired is requeued (and
    then acquired here with a higher fencing token, so the old owner can no longer checkpoint, apply a
    tool result or commit a terminal); a run with a live lease, or none, is skipped. ``replay_safe`` is the
    application's statement that re-running such a run is acceptable (tool effects may repeat)."""

    def policy(run: Run) -> dict[str, Any]:
        if run.lease_expires_at is not None and run.lease_expires_at <= now():
            return {"action": "requeue", "replay_safe": replay_safe}
        return {"action": "skip"}

    return policy


def create_agent_runtime(
    *,
    protocol: AgentProtocol,
    store: AgentRuntimeStore,
    models: Any,
    prompt: ComposedAgentPrompt | Callable[..., Any] | None = None,
    tools: Sequence[AgentTool] | Callable[..., Any] | None = None,
    runs: RunsConfig | Mapping[str, Any] | None = None,
    loop: LoopConfig | Mapping[str, Any] | None = None,
    history: HistoryConfig | Mapping[str, Any] | None = None,
    publish: Callable[[Any], Any] | None = None,
    operator_publish: Callable[[Any], Any] | None = None,
    include_internal_cause: bool = False,
) -> AgentRuntime:
    """Build a runtime. Each section is a dict or its typed config (``RunsConfig``, ``LoopConfig``,
    ``HistoryConfig``) with the same field names; unknown keys are refused. ``publish`` receives delivery
    events (``threadline.events.AgentRuntimeEvent``), ``operator_publish`` operator events
    (``AgentRunEvent``); both may be plain callables or sinks from ``threadline.delivery``.
    ``run-terminal.cause`` (an internal cause: exception type and text) is redacted for a plain
    ``operator_publish`` callable unless ``include_internal_cause=True``; an operator sink decides by its
    own ``include_internal_cause``."""
    return AgentRuntime(
        protocol=protocol,
        store=store,
        models=models,
        prompt=prompt,
        tools=tools,
        runs=runs,
        loop=loop,
        history=history,
        publish=publish,
        operator_publish=operator_publish,
        include_internal_cause=include_internal_cause,
    )
