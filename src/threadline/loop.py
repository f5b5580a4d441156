"""The one step loop: every run, wherever it starts, executes here over pydantic-ai's ``Model.request_stream``.

Per step: take injected inputs at the boundary → load the snapshot this run may see → project it →
``prepare_step`` → durably record the ``model-request`` operation (a failed write prevents the call; step
0's is recorded by the acquisition itself unless a compaction hook may write first) →
stream, publishing deltas and checkpointing every ``checkpoint_every_events`` events and at every
structural boundary (a completed tool call: at the next part, else by the step's finish) → run the step's
tool calls behind the fence → stop policies → next step. The terminal commit is one CAS (it also records
the last step's completion: no checkpoint of its own); only its winner publishes the delivery ``terminal``
event.

Failures are classified by where they happened, never by message text: the provider stream →
``provider_failure``; the application's callbacks → ``runtime_failure``; an owned store mutation refused →
``storage_conflict``; provider silence → ``timeout``. Losing the fence stops the loop without a terminal:
the run belongs to someone else now.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import hashlib
import inspect
import logging
import math
import uuid
from collections.abc import Awaitable, Callable, Collection, Coroutine, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, TypeVar

from pydantic_ai.exceptions import (
    ModelConnectionError,
    ModelHTTPError,
    ModelRateLimitError,
    ModelServerError,
    ModelUnavailableError,
)
from pydantic_ai.messages import (
    ModelRequest,
    ModelResponse,
    PartDeltaEvent,
    PartEndEvent,
    PartStartEvent,
    TextPart as PaiTextPart,
    TextPartDelta,
    ThinkingPart as PaiThinkingPart,
    ThinkingPartDelta,
    ToolCallPart as PaiToolCallPart,
    ToolCallPartDelta,
)
from pydantic_ai.models import ModelRequestParameters
from pydantic_ai.settings import ModelSettings
from pydantic_ai.usage import RequestUsage
from pydantic_core import to_jsonable_python

from .approvals import AgentApprovalInvalidError, approval_state, sign_tool_call, verify_tool_call
from .errors import (
    AgentConfigError,
    AgentContextOverflowError,
    AgentConversationPurgedError,
    AgentRecordNotFoundError,
    AgentRunOwnershipConflictError,
    AgentRunRevisionConflictError,
    AgentRunStateConflictError,
    AgentRuntimeUsageError,
    AgentStoreConflictError,
    AgentToolFenceLostError,
)
from .events import (
    AgentProviderResponse,
    AgentStepFinishedEvent,
    AssistantCheckpointEvent,
    AssistantDeltaEvent,
    AttemptResetEvent,
    ReasoningDeltaEvent,
    ReasoningEndEvent,
    ReasoningStartEvent,
    RunOperationEvent,
    ToolProgressEvent,
    ToolStatusEvent,
    delivered_parts,
    durable_event_id,
)
from .failures import FAILURE_REASONS, describe_run_failure
from .history.projection import AgentHistoryProjectionOptions
from .history.prompt import request_instruction_parts, with_history_system
from .history.view import ConversationView
from .ledger.digests import PrefixDigests
from .ledger.events import AgentStoreEventDraft, runtime_draft
from .ledger.requests import provider_request_records
from .models import AgentModelDescriptor, response_provider
from .output import AgentOutput, OutputJudgement
from .protocol import AgentProtocol
from .records import (
    TEMPLATE_TIME,
    AgentRunFailure,
    ApprovalRequestPart,
    ApprovalResponsePart,
    ControlPart,
    FailureOrigin,
    InputJoinedPart,
    Message,
    Part,
    ProviderEnvelope,
    ProviderPart,
    ReasoningPart,
    Run,
    RunOperation,
    TextPart,
    ToolCallPart,
    ToolResultPart,
    build,
    evolve,
)
from .store.aggregate import AgentRuntimeStore, new_id
from .store.reducer import AbsorbClaim
from .tools import (
    AgentTool,
    AgentToolCall,
    AgentToolContext,
    AgentToolLifecycle,
    AppError,
    compose_tool_lifecycle,
    create_agent_tool_fence_lifecycle,
    error_envelope,
    tool_result,
)
from .usage import NO_USAGE, AgentUsage

_store_log = logging.getLogger("threadline.store")
_tool_log = logging.getLogger("threadline.tools")
INTERRUPTED_REASONS = frozenset({"interrupted", "cancelled", "shutdown"})
PROGRESS_MIN_INTERVAL = 0.25
"""Seconds: a tool's progress reports closer together than this are dropped."""
STORE_RETRY_DELAYS = (0.01, 0.02, 0.04, 0.08, 0.15, 0.2)  # about half a second in all
_RETRY_DELAYS = (*STORE_RETRY_DELAYS, None)  # None: the last attempt
_DECISIONS = (AgentStoreConflictError, AgentRecordNotFoundError, AgentConversationPurgedError, AgentRuntimeUsageError)
T = TypeVar("T")


async def with_store_retry(call: Callable[[], Awaitable[T]]) -> T:
    """Retry a failing store call for about half a second. Decisions (conflicts, purges, unknown ids,
    bad input) are answers, not failures, and pass through at once. Retries bound a call that fails,
    not one that hangs: give the store its own timeouts. Giving up is logged (``threadline.store``, a
    warning: whoever handles the error it raises logs the traceback)."""
    for delay in _RETRY_DELAYS:
        try:
            return await call()
        except _DECISIONS:
            raise
        except Exception as error:
            if delay is None:
                _store_log.warning(
                    "a store call failed %d times in a row; giving up: %s: %s",
                    len(_RETRY_DELAYS),
                    type(error).__name__,
                    error,
                )
                raise
            await asyncio.sleep(delay)
    raise AssertionError("unreachable")


def _log_tool_failure(run: Run, tool_name: str, call_id: str, error: BaseException, envelope: Any) -> None:
    """A tool call failed; the model sees ``envelope``. An :class:`AppError` is the application's own
    answer (info, no traceback); anything else is a defect somewhere: an error with its traceback."""
    if isinstance(error, AppError):
        _tool_log.info(
            "tool %r (call %s, run %s) refused: %s: %s", tool_name, call_id, run.id, error.code, error.message
        )
        return
    _tool_log.error(
        "tool %r (call %s, run %s) raised %s; the model saw %s",
        tool_name,
        call_id,
        run.id,
        type(error).__name__,
        envelope.get("error"),
        exc_info=error,
    )


COMPLETED_REASONS = frozenset({"success", "policy_stop", "provider_stop"})


def _now() -> datetime:
    return datetime.now(UTC)


# ----------------------------------------------------------------------------------- control signals


class RunControl:
    """Process-local control of one executing run. Abort is a request: it never advances durable state;
    only the loop's terminal commit does."""

    def __init__(self, run_id: str) -> None:
        self.run_id = run_id
        self.abort_reason: str | None = None
        self._aborted: asyncio.Event | None = None  # made by the first ``wait``: seldom anyone waits
        self._cut: dict[asyncio.Task[Any], bool] = {}  # task awaiting abortable work -> cancelled by the abort
        self.injections: list[str] = []

    def abort(self, reason: str) -> None:
        if self.abort_reason is None:
            self.abort_reason = reason
            if self._aborted is not None:
                self._aborted.set()
            for task in tuple(self._cut):
                self._cut[task] = task.cancel()

    @property
    def aborted(self) -> bool:
        return self.abort_reason is not None

    async def wait(self) -> None:
        if self._aborted is None:
            self._aborted = asyncio.Event()
            if self.aborted:
                self._aborted.set()
        await self._aborted.wait()

    def watch(self, task: asyncio.Task[Any]) -> None:
        """Cancel ``task`` if the run is aborted before :meth:`unwatch` (the run is not aborted yet)."""
        self._cut[task] = False

    def unwatch(self, task: asyncio.Task[Any]) -> bool:
        """Stop watching ``task``; returns whether the abort cancelled it meanwhile."""
        return self._cut.pop(task, False)

    def offer_injection(self, run_id: str) -> None:
        """An ``inject`` input's queued run may join this run at its next step boundary."""
        if run_id != self.run_id and run_id not in self.injections:
            self.injections.append(run_id)


class _Aborted(Exception):
    pass


async def _take_back_cancel(task: asyncio.Task[Any]) -> None:
    """The abort's cancellation of ``task`` never surfaced (the work swallowed it, or it is still pending
    because the abort came from inside the task): withdraw it, and let one still pending land here."""
    if task.uncancel() == 0 and task._must_cancel:  # type: ignore[attr-defined]
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.sleep(0)


class _FenceLost(Exception):
    def __init__(self, cause: BaseException) -> None:
        super().__init__(str(cause))
        self.cause = cause


class _Failure(Exception):
    """A classified failure: ``reason`` is the terminal reason, ``cause`` the original exception, ``origin``
    where it happened (None: by the reason; see :func:`threadline.failures.describe_run_failure`)."""

    def __init__(
        self, reason: str, cause: BaseException, origin: FailureOrigin | None = None, summary: str | None = None
    ) -> None:
        super().__init__(f"{reason}: {cause!r}")
        self.reason = reason
        self.cause = cause
        self.origin = origin
        self.summary = summary
        """Why, in words, when the cause's own text would not say it."""
        self.partial: list[Part] = []
        self.response: ModelResponse | None = None
        """What the provider had sent before a failed request (its response identity, partial usage)."""


# ------------------------------------------------------------------------------------ configuration


@dataclass(frozen=True)
class StopPolicy:
    """A named stop condition checked after every step that ran tools; true ends the run ``policy_stop``."""

    name: str
    should_stop: Callable[[StepContext], bool | Awaitable[bool]]


@dataclass(frozen=True)
class AgentContextUsage:
    """The last step's prompt size beside the selected model's window (``input_tokens`` is what the
    provider reported for the last request; ``None`` before the first step or when it reported nothing).
    Deciding when that is too full — and compacting — is the application's call."""

    input_tokens: int | None
    context_window: int | None
    provenance: str = "unavailable"

    @property
    def ratio(self) -> float | None:
        if self.input_tokens is None or not self.context_window:
            return None
        return self.input_tokens / self.context_window


@dataclass
class StepContext:
    """What ``prepare_step`` and stop policies see; ``prepare_step`` may change ``model``,
    ``instructions``, ``active_tools`` or ``messages`` in place or by returning a dict of changes."""

    step: int
    run: Run
    context: Any
    model: AgentModelDescriptor
    instructions: str
    messages: list[Any]
    active_tools: list[str]
    parts: tuple[Part, ...] = ()
    context_usage: AgentContextUsage | None = None


AgentRuntimeRunContext = StepContext
"""The name the documentation uses for what ``prepare_step`` and stop policies receive."""


@dataclass(frozen=True)
class AgentCompactionRequest:
    """What a runtime-managed compaction hook receives before each step. The hook decides (typically
    from ``context_usage``) whether to compact — e.g. with ``threadline.history.compaction.
    structured_compaction(store, conversation_id, ...)`` — and may simply return when it is not needed.
    Its invocation is recorded as a ``compaction`` run operation either way.

    What the hook's summarizer spent enters the run's usage (:attr:`threadline.records.Run.usage`): pass it
    to ``report_usage`` (an ``AgentUsage``, or the summarizer's pydantic-ai ``ModelResponse`` or
    ``RequestUsage``), or return an ``AgentUsage`` from the hook."""

    conversation_id: str
    run: Run
    step: int
    context: Any
    store: Any
    context_usage: AgentContextUsage
    report_usage: Callable[[Any], None] = lambda usage: None


def _retryable_by_default(error: BaseException) -> bool:
    """Transient provider conditions: rate limits, overload, server errors, dropped connections."""
    if isinstance(error, ModelRateLimitError | ModelServerError | ModelUnavailableError | ModelConnectionError):
        return True
    return isinstance(error, ModelHTTPError) and error.status_code in (408, 409, 429, 500, 502, 503, 504)


@dataclass(frozen=True)
class AgentRetryPolicy:
    """When a failed provider stream is retried at the step boundary. Only an attempt that has not invoked
    a tool is retried (a tool effect is never replayed automatically). ``retry_on`` decides by the
    exception (the provider's own, e.g. ``ModelRateLimitError``); an idle timeout is retried only with
    ``retry_timeouts``. Delays grow from ``initial_delay`` by ``multiplier`` up to ``max_delay``; a
    provider's ``retry_after`` is honoured when it is longer."""

    max_attempts: int = 3
    initial_delay: float = 0.5
    multiplier: float = 2.0
    max_delay: float = 30.0
    retry_on: Callable[[BaseException], bool] = _retryable_by_default
    retry_timeouts: bool = False

    def __post_init__(self) -> None:
        # refused here, where the policy is built: a bad value must never surface mid-run
        count = self.max_attempts
        if type(count) is not int or count < 0:
            raise AgentConfigError(
                f"loop.retry.max_attempts is a non-negative integer (attempts in all, 1 = no retry), got {count!r}",
                field="loop.retry.max_attempts",
            )
        for name in ("initial_delay", "multiplier", "max_delay"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
                raise AgentConfigError(
                    f"loop.retry.{name} is a finite, non-negative number of seconds, got {value!r}"
                    if name != "multiplier"
                    else f"loop.retry.multiplier is a finite, non-negative number, got {value!r}",
                    field=f"loop.retry.{name}",
                )
        if not callable(self.retry_on):
            raise AgentConfigError(
                f"loop.retry.retry_on is a callable taking the exception, got {type(self.retry_on).__name__}",
                field="loop.retry.retry_on",
            )
        if type(self.retry_timeouts) is not bool:
            raise AgentConfigError(
                f"loop.retry.retry_timeouts is True or False, got {self.retry_timeouts!r}",
                field="loop.retry.retry_timeouts",
            )

    def delay(self, attempt: int, error: BaseException | None = None) -> float:
        base = min(self.max_delay, self.initial_delay * self.multiplier ** max(0, attempt - 1))
        hinted = getattr(error, "retry_after", None)
        return max(base, float(hinted)) if isinstance(hinted, int | float) and hinted > 0 else base


@dataclass
class LoopSettings:
    checkpoint_every_events: int = 20
    idle_timeout: float | None = None
    max_steps: int = 20
    stop_policies: Sequence[StopPolicy] = ()
    prepare_step: Callable[[StepContext], Any] | None = None
    model_settings: ModelSettings | None = None
    retry: AgentRetryPolicy | None = None
    tool_lifecycle: AgentToolLifecycle | None = None
    tool_approval: Callable[[ToolCallPart], Any] | Collection[str] | None = None
    tool_approval_secret: str | bytes | None = None
    compaction: Callable[[AgentCompactionRequest], Any] | None = None
    project: Callable[[list[Message]], Any] | None = None
    """``history.project``: the application's own projection (see :class:`~threadline.config.HistoryConfig`)."""
    step_durability: Any = None
    """A ``threadline.durability.AgentStepDurability`` behind ``ctx.step`` (owned by the application)."""


@dataclass
class LoopEnv:
    """Everything one execution needs; built by the runtime per run."""

    store: AgentRuntimeStore
    owner_id: str
    runtime_epoch: str
    protocol: AgentProtocol
    settings: LoopSettings
    resolve_model: Callable[[Any], Any]
    context: Any
    instructions: Callable[[Any], Awaitable[str]]
    tools: Callable[[Any], Awaitable[Sequence[AgentTool]]]
    publish: Callable[[Any], None]
    view: ConversationView
    operator_publish: Callable[[Any], None] = lambda event: None
    publishing: bool = True
    """Whether ``publish`` goes anywhere; when not, events are not even built (they cost a validation each)."""
    operator_publishing: bool = True
    sequences: dict[str, int] = field(default_factory=dict)
    """Transient sequence per run, kept by the runtime so a re-execution continues the numbering."""
    lease: tuple[float, Callable[[], Any]] | None = None
    """(duration, next expiry) when runs carry leases: the execution renews every third of the duration."""
    projection_options: AgentHistoryProjectionOptions = field(default_factory=AgentHistoryProjectionOptions)
    output: AgentOutput | None = None
    """The structured output this run's answer is validated as (``threadline.output``), if any."""
    _options_by_provider: dict[str | None, AgentHistoryProjectionOptions] = field(default_factory=dict)

    def projection_options_for(self, provider_name: str | None) -> AgentHistoryProjectionOptions:
        """The same options with ``provider_name`` set, one stable object per provider (a cache key)."""
        options = self._options_by_provider.get(provider_name)
        if options is None:
            options = self.projection_options.model_copy(update={"provider_name": provider_name})
            self._options_by_provider[provider_name] = options
        return options


@dataclass
class RunOutcome:
    """How an execution ended. ``terminal`` is None when the fence was lost (``lost``) or the terminal
    could not be committed (``unsettled``)."""

    reason: str | None
    run: Run
    assistant: Message | None = None
    committed: bool = False
    usage: AgentUsage = field(default_factory=AgentUsage)
    cause: BaseException | None = None
    lost: BaseException | None = None
    unsettled: BaseException | None = None
    absorbed_runs: tuple[Run, ...] = ()
    steps: int = 0


# -------------------------------------------------------------------------------------- conversion


def _envelope(provider: str, data: Any) -> ProviderEnvelope:
    return ProviderEnvelope(provider=provider or "unknown", data=to_jsonable_python(data))


def _metadata(part: Any, **fields: Any) -> dict[str, Any]:
    """What a provider attached to a response part: its item ``id``, its ``provider_details`` (Gemini's
    ``thought_signature``, an OpenAI ``phase``) and ``fields``; None values left out."""
    data = {"id": part.id, "provider_details": part.provider_details, **fields}
    return {key: value for key, value in data.items() if value is not None}


def _attached(part: Any, provider: str) -> ProviderEnvelope | None:
    """The envelope of a text or tool-call part's metadata, or None when the provider attached none."""
    if part.id is None and not part.provider_details:  # the usual case, at every checkpoint: nothing to keep
        return None
    data = _metadata(part)
    return _envelope(part.provider_name or provider, data) if data else None


def canonical_parts(response: ModelResponse, provider: str) -> list[Part]:
    """pydantic-ai response parts as canonical parts. Unknown kinds are kept opaque, never dropped; so is
    provider metadata on text, tool calls and reasoning (an empty text part is kept only for its metadata:
    Gemini may put a thought signature there)."""
    parts: list[Part] = []
    for p in response.parts:
        if isinstance(p, PaiTextPart):
            envelope = _attached(p, provider)
            if p.content or envelope is not None:
                parts.append(TextPart(text=p.content, envelope=envelope))
        elif isinstance(p, PaiThinkingPart):
            # reasoning always names its provider, metadata or not: no other provider may read it back
            data = _metadata(p, signature=p.signature)
            parts.append(ReasoningPart(text=p.content, envelope=_envelope(p.provider_name or provider, data)))
        elif isinstance(p, PaiToolCallPart):
            try:
                args: Any = p.args_as_dict()
            except ValueError:
                args = p.args if isinstance(p.args, str) else None
            parts.append(
                ToolCallPart(
                    call_id=p.tool_call_id,
                    tool_name=p.tool_name,
                    input=to_jsonable_python(args),
                    envelope=_attached(p, provider),
                )
            )
        else:
            parts.append(ProviderPart(envelope=_envelope(provider, {"part": p})))
    return parts


async def _all_or_none(calls: Iterable[Coroutine[Any, Any, T]]) -> list[T]:
    """The calls of one step, side by side, in order; when one raises (the attempt lost its fence, say) the
    others are cancelled and waited for before it propagates: an abandoned attempt runs no effect on."""
    tasks = [asyncio.ensure_future(call) for call in calls]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


async def _maybe_await(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value


# ------------------------------------------------------------------------------------ owned writes


class _OwnedRun:
    """Serializes the run's owned mutations and keeps its current revision. A revision conflict caused
    by a durable interrupt is adopted (and aborts the run); any other ownership change is a lost fence."""

    def __init__(self, env: LoopEnv, run: Run, control: RunControl) -> None:
        self.env = env
        self.run = run
        self.control = control
        self.checkpoints = 0
        self.attached: list[AgentStoreEventDraft] = []
        """Ledger records (provider requests and responses, retries) for the run's next commit that takes
        them: a checkpoint, an operation record or the terminal, in the same transaction."""
        self._on_attached: list[Callable[[], None]] = []
        self.vouched = False
        """Set while the tool calls that start right after a step's finish commit pass their fence: that
        compare-and-swap verified owner and fencing token, and nothing could run in between (no
        application hook awaited), so the fence needs no read of its own."""
        # serializes owned writes like an asyncio.Lock, with no coroutine on the free path (every write)
        self._busy = False
        self._waiting: collections.deque[asyncio.Future[None]] = collections.deque()

    async def _still_owned(self) -> Run | None:
        """The run as stored now, if this execution still owns it (same owner and fencing token, acquired);
        a durable interrupt found on the way aborts the run locally."""
        loaded = await with_store_retry(
            lambda: self.env.store.load_run(conversation_id=self.run.conversation_id, run_id=self.run.id)
        )
        current = loaded.run if loaded else None
        if (
            current is None
            or not current.acquired
            or current.owner_id != self.env.owner_id
            or current.fencing_token != self.run.fencing_token
        ):
            return None
        if current.state == "interrupt_requested":
            self.control.abort("interrupted")
        return current

    def attach(self, events: Sequence[AgentStoreEventDraft], committed: Callable[[], None] | None = None) -> None:
        """Ledger records for the next commit that carries them; ``committed`` runs once it has."""
        self.attached.extend(events)
        if committed is not None:
            self._on_attached.append(committed)

    def take_attached(self) -> tuple[list[dict[str, Any]], list[Callable[[], None]]]:
        events, done = self.attached, self._on_attached
        self.attached, self._on_attached = [], []
        return events, done

    async def _owned(self, mutate: Callable[..., Awaitable[Any]], **fields: Any) -> Any:
        """One owned mutation of the run (``mutate`` is a store method taking the run's identity, expected
        revision, owner and fencing token, plus ``fields``), serialized with the run's other owned writes.
        A failing store call is retried (:func:`with_store_retry`). A checkpoint or an operation record
        carries the ledger records attached so far (:meth:`attach`)."""
        if self._busy:  # another owned write (a lease renewal, say) is in flight: wait for it
            await self._wait_turn()
        self._busy = True
        done: list[Callable[[], None]] = []
        if self.attached and mutate.__name__ in ("checkpoint_run_assistant", "record_run_operation"):
            fields["events"], done = self.take_attached()
        try:
            for attempt in range(3):
                run = self.run
                try:
                    result = await with_store_retry(
                        lambda run=run: mutate(
                            conversation_id=run.conversation_id,
                            run_id=run.id,
                            expected_revision=run.revision,
                            owner_id=self.env.owner_id,
                            fencing_token=run.fencing_token,
                            **fields,
                        )
                    )
                except AgentRunRevisionConflictError as error:
                    if attempt == 2:
                        raise _Failure("storage_conflict", error) from error
                    current = await self._still_owned()
                    if current is None:
                        raise _FenceLost(error) from error
                    self.run = current
                    continue
                except (AgentRunOwnershipConflictError, AgentRunStateConflictError) as error:
                    raise _FenceLost(error) from error
                except AgentStoreConflictError as error:
                    raise _Failure("storage_conflict", error) from error
                except Exception as error:  # the store failed: the run cannot continue durably
                    raise _Failure("runtime_failure", error, "storage") from error
                self.run = result.run
                for committed in done:
                    committed()
                return result
            raise AssertionError("unreachable")
        finally:
            self._pass_turn()

    async def _wait_turn(self) -> None:
        future = asyncio.get_running_loop().create_future()
        self._waiting.append(future)
        try:
            await future
        except BaseException:
            if future.done() and not future.cancelled():  # the turn was handed to us: hand it on
                self._pass_turn()
            else:  # still queued, unless the turn was passed over it already
                with contextlib.suppress(ValueError):
                    self._waiting.remove(future)
            raise

    def _pass_turn(self) -> None:
        """End an owned write: hand the turn to the next waiting one (it stays busy), or free it."""
        while self._waiting:
            future = self._waiting.popleft()
            if not future.done():
                future.set_result(None)
                return
        self._busy = False

    async def checkpoint(
        self,
        parts: Sequence[Part],
        operation: RunOperation | None = None,
        preceding: RunOperation | None = None,
        usage: AgentUsage | None = None,
    ) -> None:
        """Checkpoint the draft; with ``operation`` its phase is recorded in the same commit, with ``usage``
        the run's cumulative spend. ``preceding`` is a phase that commit also stands for (a first output
        folded into the step's completion): its event is published first, with its original timestamp."""
        result = await self._owned(
            self.env.store.checkpoint_run_assistant, parts=list(parts), operation=operation, usage=usage
        )
        self.checkpoints += 1
        self.published_checkpoint(parts, result.version, preceding, operation)

    def published_checkpoint(
        self, parts: Sequence[Part], version: int, preceding: RunOperation | None, operation: RunOperation | None
    ) -> None:
        """The events of a committed checkpoint: the draft, then the operation phases it recorded."""
        if not self.env.publishing:
            return
        run = self.run
        self.env.publish(
            AssistantCheckpointEvent(
                event_id=durable_event_id(run.id, "assistant-checkpoint", version),
                conversation_id=run.conversation_id,
                run_id=run.id,
                version=version,
                message_id=run.assistant_message_id,
                parts=delivered_parts(parts),
            )
        )
        if preceding is not None:
            self._published_operation(preceding, version)
        if operation is not None:
            self._published_operation(operation, version)

    def _published_operation(self, operation: RunOperation, version: int) -> None:
        if not self.env.publishing:
            return
        self.env.publish(
            RunOperationEvent(
                event_id=durable_event_id(self.run.id, "run-operation", version, operation.phase),
                conversation_id=self.run.conversation_id,
                run_id=self.run.id,
                version=version,
                operation=operation,
            )
        )

    async def record(self, operation: RunOperation, usage: AgentUsage | None = None) -> None:
        result = await self._owned(self.env.store.record_run_operation, operation=operation, usage=usage)
        self._published_operation(operation, result.version)

    async def renew(self, expires_at: Any) -> None:
        await self._owned(self.env.store.renew_run_lease, lease_expires_at=expires_at)

    async def fence(self, after: bool = False) -> None:
        """Check that this process still owns the run: before a step's tool effects (by reading it, unless
        the step's finish commit just did: ``vouched``) and, with ``after``, once a tool returned, before
        its result is accepted (always a read: time passed inside the tool). The next owned commit's CAS
        checks ownership once more."""
        if self.vouched and not after:
            return
        try:
            current = await self._still_owned()
        except Exception as error:
            raise _Failure("runtime_failure", error, "storage") from error
        if current is None:
            raise _FenceLost(RuntimeError(f"run {self.run.id} is no longer owned by {self.env.owner_id}"))


# -------------------------------------------------------------------------------------- execution


class _Execution:
    def __init__(self, env: LoopEnv, run: Run, control: RunControl, admitted: RunOperation | None = None) -> None:
        self.env = env
        self.control = control
        self.owned = _OwnedRun(env, run, control)
        self.admitted = admitted
        """The first request's ``started`` phase when the acquisition recorded it (with an empty draft);
        step 0 then needs no admission commit of its own."""
        self.parts: list[Part] = []
        self.usage = NO_USAGE
        """What this execution spent (its own figures: the operator ``run-terminal`` and metrics report it)."""
        self.spent_before: AgentUsage = run.usage
        """What earlier executions of the run committed (a run requeued after a crash)."""
        self._committed_usage: AgentUsage = NO_USAGE
        """``usage`` as of the last commit that recorded it (later commits carry it only once it changed)."""
        self._paused = False
        """The run stops for a pending approval request (terminal acceptance is not consulted then)."""
        self.claims: dict[str, AbsorbClaim] = {}
        self.steps = 0
        self.attempt = 1
        self._tools_invoked = False
        self._step_usage: AgentUsage | None = None
        self._finished_calls: set[str] = set()
        self._attempt_over = False  # set once execute() returned: the attempt was committed or abandoned
        self._lifecycle: AgentToolLifecycle | None = None
        """The application's tool hooks composed with the fence; None without hooks (the fence alone)."""
        self._prefix_call_ids: Any = frozenset()
        self._prefix: Any = None
        """The settled-history projection the last request forked (its messages start every request)."""
        self._draft: Message | None = None
        self._inputs_projection: tuple[Any, int, list[Message], Any] | None = None
        """(prefix projector, settled count, inputs, their projection) of the last step (see ``_history``)."""
        """This run's assistant as each request sees it (built once; every step swaps in its parts)."""
        self._last_step: tuple[RunOperation | None, RunOperation] | None = None
        """(first output, completion) of a final step: the terminal commit records them (one commit)."""
        self.output_value: Any = None
        """The validated structured output of the final step (``env.output``), once there is one."""
        self._output_retries = 0
        self._output_feedback: tuple[Any, ...] = ()

    @property
    def run(self) -> Run:
        return self.owned.run

    def total_usage(self) -> AgentUsage:
        """The run's cumulative spend: earlier executions' committed usage plus this execution's."""
        return self.spent_before + self.usage if self.spent_before.steps else self.usage

    def _unrecorded_usage(self) -> tuple[AgentUsage, AgentUsage | None]:
        """(this execution's usage now, the run total to record with the next commit, or None when the last
        commit recorded it already): spend rides on commits the run makes anyway."""
        spent = self.usage
        return spent, (None if spent is self._committed_usage else self.total_usage())

    async def _checkpoint(
        self, parts: Sequence[Part], operation: RunOperation | None = None, preceding: RunOperation | None = None
    ) -> None:
        spent, usage = self._unrecorded_usage()
        await self.owned.checkpoint(parts, operation, preceding, usage=usage)
        self._committed_usage = spent

    async def _record(self, operation: RunOperation) -> None:
        spent, usage = self._unrecorded_usage()
        await self.owned.record(operation, usage=usage)
        self._committed_usage = spent

    def _transient(self, cls: type, **fields: Any) -> None:
        """Publish a transient event, numbered from 1 per run counting only what is published."""
        if not self.env.publishing:
            return
        sequences = self.env.sequences
        sequence = sequences[self.run.id] = sequences.get(self.run.id, 0) + 1
        self.env.publish(
            cls(
                conversation_id=self.run.conversation_id,
                run_id=self.run.id,
                runtime_epoch=self.env.runtime_epoch,
                sequence=sequence,
                **fields,
            )
        )

    async def _abortable(self, work: Awaitable[Any]) -> Any:
        """Await ``work`` in this task until it finishes or the run is aborted (then raise ``_Aborted``).
        The abort cancels this task while it waits inside ``work``; that cancellation is taken back here,
        so only a cancellation from elsewhere (the runtime closing) travels on."""
        control = self.control
        if control.aborted:  # never started, as a task cancelled before its first step
            if inspect.iscoroutine(work):
                work.close()
            elif isinstance(work, asyncio.Future):
                work.cancel()
            raise _Aborted()
        task = asyncio.current_task()
        assert task is not None
        control.watch(task)
        try:
            result = await work
        except asyncio.CancelledError:
            if control.unwatch(task) and task.uncancel() == 0:
                raise _Aborted() from None
            raise
        except BaseException:
            if control.unwatch(task):  # cancelled by the abort; what the work raised instead means: aborted
                await _take_back_cancel(task)
                raise _Aborted() from None
            raise
        if control.unwatch(task):  # the work ignored the abort's cancellation and finished anyway
            await _take_back_cancel(task)
            raise _Aborted()
        return result

    async def _callback(self, fn: Callable[..., Any], *args: Any, origin: FailureOrigin = "runtime") -> Any:
        try:
            return await _maybe_await(fn(*args))
        except AgentContextOverflowError as error:
            raise _Failure("context_overflow", error) from error
        except Exception as error:
            raise _Failure("runtime_failure", error, origin) from error

    async def _join_injections(self, step: int) -> None:
        """At a step boundary, let offered ``inject`` runs join; only still-queued, unstarted runs qualify.
        A claimed run that gained coalesced inputs since is re-claimed at its new revision."""
        offered, self.control.injections = self.control.injections, []
        for run_id in offered:
            loaded = await self.env.store.load_run(conversation_id=self.run.conversation_id, run_id=run_id)
            if loaded is None or loaded.run.state != "queued" or loaded.run.execution_sequence is not None:
                continue
            queued = loaded.run
            previous = self.claims.get(run_id)
            seen = set(previous.input_message_ids) if previous else set()
            new_ids = tuple(mid for mid in queued.input_message_ids if mid not in seen)
            self.claims[run_id] = AbsorbClaim(queued.id, queued.revision, queued.input_message_ids)
            if new_ids:
                self.parts.append(InputJoinedPart(run_id=queued.id, message_ids=new_ids, step=step))

    async def _history(self, model: AgentModelDescriptor) -> tuple[list[Any], list[str]]:
        """What this run may see, projected: settled history (cached, extended incrementally), then the
        unsettled messages of runs up to this one, inputs that joined, and this run's own steps so far."""
        view = self.env.view
        if view.version != self.run.version:  # something this process did not write happened since
            await with_store_retry(lambda: view.refresh(self.env.store))
        run = self.run
        own = run.assistant_message_id
        inputs = [m for m in view.tail(run.id) if m.__dict__["id"] != own]  # (no pydantic hook per message)
        if self.env.settings.project is not None:
            return await self._own_projection(view, inputs), []
        options = self.env.projection_options
        if model.provider_name != options.provider_name:
            options = self.env.projection_options_for(model.provider_name)
        prefix = view.projector(options)
        self._prefix = prefix
        self._prefix_call_ids = prefix.call_ids
        if self.claims:  # joined inputs: the draft places them, so inputs and draft are projected in one pass
            inputs += [m for m in view.messages_of(set(self.claims)) if m.role == "user"]
            projector = prefix.fork()
            projector.extend([*inputs, self._draft_with_parts()])
            return projector.built, projector.system
        # The settled prefix and the inputs before this run's draft seldom change between its steps: their
        # projection is kept (a fork: the prefix is never mutated) and only the draft is projected again.
        # Valid while the prefix is the same object (the view builds a new one when settled history changes
        # other than by appending) with as many settled messages, and the inputs are the same records.
        settled = len(view.settled)
        cached = self._inputs_projection
        if (
            cached is None
            or cached[0] is not prefix
            or cached[1] != settled
            or len(cached[2]) != len(inputs)
            or any(a is not b for a, b in zip(cached[2], inputs, strict=True))
        ):
            projected = prefix.fork()
            projected.extend(inputs)
            cached = self._inputs_projection = (prefix, settled, inputs, projected)
        if not self.parts:  # a draft without parts projects to nothing: the request is the inputs alone
            # (copies: prepare_step may change the lists it is given, and the projection is kept)
            return list(cached[3].built), list(cached[3].system)
        projector = cached[3].fork()
        projector.extend([self._draft_with_parts()])
        return projector.built, projector.system

    async def _own_projection(self, view: Any, inputs: list[Message]) -> list[Any]:
        """``history.project``: the application's projection of what this request may see. No settled
        prefix is kept for it, so every message it returns is digested for the ledger at each request."""
        if self.claims:
            inputs = inputs + [m for m in view.messages_of(set(self.claims)) if m.role == "user"]
        visible = [*view.settled, *inputs, *([self._draft_with_parts()] if self.parts else [])]
        self._prefix, self._prefix_call_ids = (
            None,
            frozenset(p.call_id for m in view.settled for p in m.parts if p.type == "tool-call"),
        )
        built = await _maybe_await(self.env.settings.project(visible))
        if not isinstance(built, list) or not all(isinstance(m, ModelRequest | ModelResponse) for m in built):
            raise AgentConfigError(
                "history.project returned something other than a list of pydantic-ai ModelRequest/ModelResponse "
                f"(got {type(built).__name__})",
                field="history.project",
            )
        return built

    def _draft_with_parts(self) -> Message:
        """This run's assistant as a request sees it: its draft holding the parts so far."""
        run = self.run
        draft = self._draft
        if draft is None or draft.__dict__["id"] != run.assistant_message_id:
            draft = self._draft = build(
                _TAIL_DRAFT,
                {
                    "id": run.assistant_message_id,
                    "conversation_id": run.conversation_id,
                    "run_id": run.id,
                    "metadata": {},
                    "created_at": run.created_at,
                },
            )
        return evolve(draft, {"parts": tuple(self.parts)})

    def _unique_call_ids(self, parts: list[Part]) -> list[Part]:
        """Canonical call ids are unique in the conversation (some providers refuse a repeated id, and
        scripted models reuse them): a colliding id gets a suffix; its result is recorded under it."""
        taken = {p.call_id for p in self.parts if p.type in ("tool-call", "tool-result")}
        out: list[Part] = []
        for p in parts:
            if p.type == "tool-call":
                call_id, n = p.call_id, 1
                while call_id in taken or call_id in self._prefix_call_ids:
                    n += 1
                    call_id = f"{p.call_id}~{n}"
                taken.add(call_id)
                if call_id != p.call_id:
                    p = evolve(p, {"call_id": call_id})
            out.append(p)
        return out

    async def _stream(
        self, operation: RunOperation, model: AgentModelDescriptor, messages: list[Any], params: Any
    ) -> tuple[ModelResponse, datetime | None]:
        """Stream one provider request (already durably admitted as ``operation``); returns the response
        and when its first output came, unless a checkpoint during the stream recorded that already. On
        failure the attempt's usage still counts, and its streamed text stays as evidence unless the
        caller retries."""
        state: dict[str, Any] = {"stream": None, "first": False, "first_pending": None, "base": list(self.parts)}
        try:
            response = await self._abortable(self._consume(operation, model, messages, params, state))
        except _Aborted:
            self.parts.extend(self._partial(state, model))
            await self._finish_operation(operation, "cancelled")
            raise
        except _Failure as failure:
            failure.partial = self._partial(state, model)
            failure.response = state["stream"].get() if state["stream"] is not None else None
            await self._finish_operation(operation, "failed", failure.reason)
            raise
        self._step_usage = AgentUsage.from_response(response)
        self.usage = self.usage + self._step_usage
        return response, state["first_pending"]

    async def _consume(
        self,
        operation: RunOperation,
        model: AgentModelDescriptor,
        messages: list[Any],
        params: Any,
        state: dict[str, Any],
    ) -> ModelResponse:
        """The provider call of :meth:`_stream`: its events, checkpoints and idle timeout (a method, not a
        closure: nothing is allocated per request to capture its variables)."""
        settings = self.env.settings
        every = max(1, settings.checkpoint_every_events)
        base = state["base"]
        loop = asyncio.get_running_loop()
        model_settings: ModelSettings = {"max_retries": 0, **(settings.model_settings or {})}  # type: ignore[typeddict-item]
        idle = settings.idle_timeout
        # provider silence only: the clock starts before the call (opening the stream included),
        # restarts on every event and after each of our own checkpoint writes
        timeout = asyncio.timeout(idle) if idle else None
        try:
            async with (
                timeout or contextlib.nullcontext(),
                model.model.request_stream(messages, model_settings, params) as stream,
            ):
                state["stream"] = stream
                count = 0
                # A completed tool call is a structural boundary. Its checkpoint is written when the
                # next event arrives; when the stream ends there instead (the usual case: a part ends
                # as the next one starts or as the stream closes), the step-finish commit stands for
                # it. No tool runs before that commit, so the deferral never lets an effect precede it.
                boundary = False
                async for event in stream:
                    if timeout is not None:
                        timeout.reschedule(loop.time() + idle)  # type: ignore[operator]
                    if not isinstance(event, PartStartEvent | PartDeltaEvent | PartEndEvent):
                        continue
                    if isinstance(event, PartEndEvent):
                        if isinstance(event.part, PaiThinkingPart):
                            self._reasoning_end(event.part, model.provider_name)
                        elif isinstance(event.part, PaiToolCallPart):
                            boundary = True
                            if not state["first"]:  # a complete call is output, one without arguments too
                                state["first"] = True
                                state["first_pending"] = _now()
                            continue
                    else:
                        count += 1
                        self._on_event(event, operation, state, model.provider_name)
                    if boundary or count >= every:
                        count = 0
                        boundary = False
                        # the first-output phase rides along with the next commit
                        first_at, state["first_pending"] = state["first_pending"], None
                        first = _first_output(operation, first_at) if first_at is not None else None
                        await self.owned.checkpoint([*base, *canonical_parts(stream.get(), model.provider_name)], first)
                        if timeout is not None:
                            timeout.reschedule(loop.time() + idle)  # type: ignore[operator]
                return stream.get()
        except TimeoutError as error:
            if timeout is not None and timeout.expired():
                raise _Failure("timeout", error) from error
            raise _Failure("provider_failure", error) from error
        except (_Failure, _FenceLost, _Aborted):
            raise
        except Exception as error:
            raise _Failure("provider_failure", error) from error

    def _partial(self, state: dict[str, Any], model: AgentModelDescriptor) -> list[Part]:
        """What a failed or aborted request leaves as evidence; its usage counts in the run's spend."""
        stream = state["stream"]
        self._step_usage = AgentUsage.from_response(stream.get()) if stream is not None else AgentUsage.unreported()
        self.usage = self.usage + self._step_usage  # a failed attempt's spend stays in the run's spend
        if stream is None:
            return []
        # complete tool calls cannot stay: their results never came
        return [p for p in canonical_parts(stream.get(), model.provider_name) if p.type != "tool-call"]

    async def _finish_operation(self, operation: RunOperation, phase: str, detail: str | None = None) -> None:
        """Record a failed or cancelled request; the failure that ended it stays the one reported."""
        with contextlib.suppress(_Failure, _FenceLost):
            await self._record(evolve(operation, {"phase": phase, "finished_at": _now(), "detail": detail}))

    def _on_event(
        self, event: PartStartEvent | PartDeltaEvent, operation: RunOperation, state: dict[str, Any], provider: str
    ) -> None:
        text = None
        reasoning = None
        output = False
        if isinstance(event, PartStartEvent):
            part = event.part
            if isinstance(part, PaiTextPart):
                text = part.content
            elif isinstance(part, PaiThinkingPart):
                self._transient(ReasoningStartEvent)
                reasoning = part.content
            elif isinstance(part, PaiToolCallPart):
                output = bool(part.args)  # a name alone is not output yet: its arguments or its end are
        else:
            delta = event.delta
            if isinstance(delta, TextPartDelta):
                text = delta.content_delta
            elif isinstance(delta, ThinkingPartDelta):
                reasoning = delta.content_delta
            elif isinstance(delta, ToolCallPartDelta):
                output = bool(delta.args_delta)
        if text:
            self._transient(AssistantDeltaEvent, delta=text)
        if reasoning:
            self._transient(ReasoningDeltaEvent, delta=reasoning)
        if (text or reasoning or output) and not state["first"]:
            state["first"] = True
            state["first_pending"] = _now()  # its phase record is made where it is written or published

    def _reasoning_end(self, part: PaiThinkingPart, provider: str) -> None:
        self._transient(ReasoningEndEvent)  # the reasoning's provider metadata stays in the store

    def _progress_reporter(self, call: ToolCallPart) -> Callable[..., None]:
        """``ctx.report_progress``: transient only, at most one report per call every 250 ms, none after
        the call's terminal status or once its attempt was abandoned."""
        last: list[float] = []
        loop = asyncio.get_running_loop()

        def report(message: str | None = None, progress: float | None = None, total: float | None = None) -> None:
            if call.call_id in self._finished_calls or self.control.aborted or self._attempt_over:
                return
            now = loop.time()
            if last and now - last[0] < PROGRESS_MIN_INTERVAL:
                return
            last[:] = [now]
            self._transient(
                ToolProgressEvent,
                call_id=call.call_id,
                tool_name=call.tool_name,
                message=message,
                progress=progress,
                total=total,
            )

        return report

    async def _call_tool(self, tools: dict[str, AgentTool], call: ToolCallPart) -> ToolResultPart:
        """One managed call: lifecycle ``before`` (application hooks, then the fence), the tool, ``after``.
        A lost fence stops the run (never a model-facing error); any other failure becomes the safe
        envelope, its real cause going only to ``on_error``."""
        # the call's fields, read once (each read of a record's attribute is a pydantic hook call)
        call_id, tool_name, call_input = call.call_id, call.tool_name, call.input
        self._transient(ToolStatusEvent, call_id=call_id, tool_name=tool_name, status="started", input=call_input)
        lifecycle = self._lifecycle
        info = None
        try:
            if lifecycle is None:
                await self.owned.fence()
            else:
                info = AgentToolCall(self.run.conversation_id, self.run.id, call_id, tool_name, call_input)
                await lifecycle.before(info)  # type: ignore[misc]
            tool = tools.get(tool_name)
            if tool is None:
                raise AppError("UNKNOWN_TOOL", f"no tool named {tool_name!r}", hint=f"use one of {sorted(tools)}")
            args = tool.validate(call_input)
            run = self.run
            ctx = AgentToolContext(
                conversation_id=run.conversation_id,
                run_id=run.id,
                call_id=call_id,
                tool_name=tool_name,
                context=tool.parse_context(self.env.context),
                report_progress=self._progress_reporter(call),
                owner_id=self.env.owner_id,
                fencing_token=run.fencing_token,
                idempotency_key=call_idempotency_key(run.conversation_id, run.id, call_id),
                _durability=self.env.settings.step_durability,
                _joined_run_ids=tuple(self.claims),
            )
            output = tool_result(tool_name, await tool.call(ctx, args))
            # The fence again before the result is accepted (the run may have been taken over meanwhile):
            # through the lifecycle, whose fence reads the run before an application hook sees the output;
            # without one, by the run's next owned commit, whose compare-and-swap takes the result into the
            # run — no application code sees it first (stop policies read the run themselves, below).
            if lifecycle is not None:
                await lifecycle.after(info, output)  # type: ignore[misc]
        except AgentToolFenceLostError as lost:
            raise _FenceLost(lost) from lost
        except (_FenceLost, _Aborted, _Failure):
            raise
        except Exception as error:
            self._finished_calls.add(call_id)
            if lifecycle is not None:
                await lifecycle.on_error(info, error)  # type: ignore[misc]
            envelope = error_envelope(error)
            _log_tool_failure(self.run, tool_name, call_id, error, envelope)
            self._transient(
                ToolStatusEvent, call_id=call_id, tool_name=tool_name, status="failed", output=envelope, error=envelope
            )
            return ToolResultPart(call_id=call_id, tool_name=tool_name, outcome="error", output=envelope)
        self._finished_calls.add(call_id)
        self._transient(ToolStatusEvent, call_id=call_id, tool_name=tool_name, status="completed", output=output)
        return ToolResultPart(call_id=call_id, tool_name=tool_name, outcome="success", output=output)

    async def _needs_approval(self, call: ToolCallPart) -> bool:
        rule = self.env.settings.tool_approval
        if rule is None:
            return False
        if callable(rule):
            return bool(await self._callback(rule, call, origin="tool"))
        return call.tool_name in rule

    def _approval_request(self, call: ToolCallPart) -> ApprovalRequestPart:
        secret = self.env.settings.tool_approval_secret
        assert secret is not None, "the runtime refuses tool_approval without tool_approval_secret"
        return ApprovalRequestPart(
            approval_id=f"apr_{uuid.uuid4().hex}",
            call_id=call.call_id,
            tool_name=call.tool_name,
            input=call.input,
            signature=sign_tool_call(secret, call.call_id, call.tool_name, call.input),
        )

    async def _answer_approvals(self, by_name: dict[str, AgentTool]) -> None:
        """Before the first step: carry out the approval responses this run was queued for. Every one is
        checked first against its signed request (call, tool, input, signature) and against what is already
        answered (an approval an earlier run answered, a call whose result history holds, the same approval
        twice in this run); anything that does not match fails the run (``runtime_failure``, the diagnostic
        stays private) and nothing runs — not even the responses that did match."""
        mine = [m for m in self.env.view.tail(self.run.id) if m.run_id == self.run.id and m.role == "tool"]
        responses = [p for m in mine for p in m.parts if p.type == "approval-response"]
        if not responses:
            return
        history = [*self.env.view.settled, *self.env.view.tail(self.run.id)]
        requests, _ = approval_state(history)
        earlier = [m for m in history if m.run_id != self.run.id]
        earlier_approvals = {
            p.approval_id for m in earlier if m.role == "tool" for p in m.parts if p.type == "approval-response"
        }
        earlier_calls = {p.call_id for m in earlier for p in m.parts if p.type == "tool-result"}
        secret = self.env.settings.tool_approval_secret
        seen: set[str] = set()
        accepted: list[tuple[ApprovalResponsePart, ApprovalRequestPart]] = []
        for response in responses:
            found = requests.get(response.approval_id)
            request = found[0] if found else None
            rejected = None
            if request is None or secret is None or not verify_tool_call(secret, request):
                rejected = "has no valid signed request"
            elif response.call_id != request.call_id:
                rejected = "answers another call"
            elif (
                response.approval_id in seen
                or response.approval_id in earlier_approvals
                or request.call_id in earlier_calls
            ):
                rejected = "was already answered"
            if rejected is not None:  # recorded in the ledger with the run's terminal
                identity = {"run_id": self.run.id, "approval_id": response.approval_id, "call_id": response.call_id}
                self.owned.attach([_ledger("approval/response-rejected", {**identity, "reason": rejected})])
                raise _Failure(
                    "runtime_failure",
                    AgentApprovalInvalidError(f"approval {response.approval_id!r} {rejected}"),
                    "tool",
                )
            assert request is not None
            seen.add(response.approval_id)
            accepted.append((response, request))
        answered = {p.call_id for p in self.parts if p.type == "tool-result"}  # kept by a resumed draft
        for response, request in accepted:
            if request.call_id in answered:
                continue
            call = ToolCallPart(call_id=request.call_id, tool_name=request.tool_name, input=request.input)
            self.parts.append(call)
            if response.approved:
                self._tools_invoked = True
                result = await self._abortable(self._call_tool(by_name, call))
            else:
                envelope = {
                    "error": "APPROVAL_DENIED",
                    "retryable": False,
                    "message": response.reason or "the call was not approved",
                }
                self._transient(
                    ToolStatusEvent,
                    call_id=call.call_id,
                    tool_name=call.tool_name,
                    status="failed",
                    output=envelope,
                    error=envelope,
                )
                result = ToolResultPart(
                    call_id=call.call_id, tool_name=call.tool_name, outcome="error", output=envelope
                )
            self.parts.append(result)

    def _context_usage(self, model: AgentModelDescriptor) -> AgentContextUsage:
        figure = self._step_usage.input_tokens if self._step_usage is not None else None
        known = figure is not None and figure.value is not None
        return AgentContextUsage(
            input_tokens=figure.value if known else None,  # type: ignore[union-attr]
            context_window=model.context_window,
            provenance=figure.provenance if known else "unavailable",  # type: ignore[union-attr]
        )

    async def _prepare(
        self, step: int, model: AgentModelDescriptor, instructions: str, by_name: dict[str, AgentTool]
    ) -> StepContext:
        """The step's history and ``prepare_step``; a failure here is the runtime's, never the provider's."""
        try:
            messages, system = await self._history(model)
        except _Failure:
            raise
        except Exception as error:  # the view could not be read or projected
            raise _Failure("runtime_failure", error) from error
        settings = self.env.settings
        ctx = StepContext(
            step=step,
            run=self.run,
            context=self.env.context,
            model=model,
            instructions=with_history_system(instructions, system),  # the text, carrying its parts
            messages=messages,
            active_tools=list(by_name),
            parts=tuple(self.parts),
            # only application hooks read it: none, no figures to gather
            context_usage=self._context_usage(model) if settings.prepare_step or settings.stop_policies else None,
        )
        if self.env.settings.prepare_step is not None:
            changes = await self._callback(self.env.settings.prepare_step, ctx)
            for key, value in (changes or {}).items():
                setattr(ctx, key, value)
        return ctx

    async def _compact(self, step: int, model: AgentModelDescriptor) -> None:
        """Let the configured compaction hook look at the context before this step; its invocation is a
        durable ``compaction`` operation (``started``, then ``completed`` or ``failed``)."""
        operation = RunOperation(
            kind="compaction", phase="started", operation_id=new_id(), step=step, started_at=_now()
        )
        await self._record(operation)
        request = AgentCompactionRequest(
            conversation_id=self.run.conversation_id,
            run=self.run,
            step=step,
            context=self.env.context,
            store=self.env.store,
            context_usage=self._context_usage(model),
            report_usage=self._report_usage,
        )
        try:
            returned = await self._callback(self.env.settings.compaction, request)  # type: ignore[arg-type]
        except _Failure as failure:
            await self._finish_operation(operation, "failed", failure.reason)
            raise
        if isinstance(returned, AgentUsage):
            self._report_usage(returned)
        await self._record(evolve(operation, {"phase": "completed", "finished_at": _now()}))

    def _report_usage(self, spent: Any) -> None:
        """Spend outside the run's own provider calls (a compaction summarizer) joins the run's usage."""
        if isinstance(spent, AgentUsage):
            usage = spent
        elif isinstance(spent, ModelResponse):
            usage = AgentUsage.from_response(spent)
        elif isinstance(spent, RequestUsage):
            usage = AgentUsage.from_request(spent)
        else:
            raise AgentRuntimeUsageError(
                "report_usage takes an AgentUsage, a pydantic-ai ModelResponse or a RequestUsage, "
                f"got {type(spent).__name__}"
            )
        self.usage = self.usage + usage

    async def _retry(self, failure: _Failure, step: int, attempt_start: list[Part]) -> bool:
        """Decide and prepare a retry of a failed provider stream at the step boundary. Only an attempt
        that invoked no tool is retried; the failed output is discarded (``attempt-reset``) and the draft
        checkpointed without it; inputs that joined the failed attempt join again."""
        policy = self.env.settings.retry
        if policy is None or self._tools_invoked or self.attempt >= policy.max_attempts:
            return False
        if failure.reason == "timeout" and not policy.retry_timeouts:
            return False
        if failure.reason == "provider_failure" and not policy.retry_on(failure.cause):
            return False
        if failure.reason not in ("timeout", "provider_failure"):
            return False
        self.attempt += 1
        delay = policy.delay(self.attempt - 1, failure.cause)
        scheduled = RunOperation(
            kind="retry",
            phase="scheduled",
            operation_id=new_id(),
            step=step,
            attempt=self.attempt,
            started_at=_now(),
            detail=type(failure.cause).__name__,
        )
        self.parts = list(attempt_start)
        for run_id in self.claims:  # taken again by the retry
            self.control.offer_injection(run_id)
        self.parts = [p for p in self.parts if p.type != "input-joined"]
        self.claims.clear()
        self._transient(AttemptResetEvent, step=step, attempt=self.attempt)
        identity = {"run_id": self.run.id, "step_number": step, "attempt": self.attempt}
        reason = {"reason": failure.reason, "error": type(failure.cause).__name__}
        self.owned.attach([_ledger("retry/scheduled", {**identity, "delay": delay, **reason})])
        await self._checkpoint(list(self.parts), scheduled)
        await self._abortable(asyncio.sleep(delay))
        self.owned.attach([_ledger("retry/started", identity)])
        await self._record(evolve(scheduled, {"phase": "started", "started_at": _now()}))
        return True

    async def _steps(self) -> tuple[str, str | None]:
        env = self.env
        model = await self._callback(env.resolve_model, self)
        instructions = await self._callback(env.instructions, self)
        tools = list(await self._callback(env.tools, self, origin="tool"))
        by_name = {t.name: t for t in tools}
        if env.settings.tool_lifecycle is not None:
            self._lifecycle = compose_tool_lifecycle(
                env.settings.tool_lifecycle, create_agent_tool_fence_lifecycle(self.owned.fence)
            )
        if self.env.view.version != self.run.version:
            await with_store_retry(lambda: self.env.view.refresh(self.env.store))
        step = await self._resume()
        await self._answer_approvals(by_name)
        attempt_start: list[Part] = list(self.parts)
        while step < max(1, env.settings.max_steps):
            self.steps = step + 1
            if self.control.aborted:
                raise _Aborted()
            await self._join_injections(step)
            if env.settings.compaction is not None:
                await self._compact(step, model)
            if self.admitted is not None:  # the acquisition committed this request's admission
                operation, self.admitted = self.admitted, None
                try:
                    ctx = await self._prepare(step, model, instructions, by_name)
                except _Failure as failure:
                    await self._finish_operation(operation, "failed", failure.reason)
                    raise
                # the exact request rides with the run's next commit (the admission is durable already)
                self._record_request(step, ctx)
                if self.parts:  # inputs joined or approvals were answered since: the draft holds them
                    await self._checkpoint(list(self.parts))
            else:
                operation = model_request(step, self.attempt)
                ctx = await self._prepare(step, model, instructions, by_name)
                self._record_request(step, ctx)
                # one commit: the draft so far (the initial draft, or the previous step's tool results), the
                # durable admission of this request and its exact record; a failed write prevents the call
                await self._checkpoint(list(self.parts), operation)
            params = ModelRequestParameters(
                function_tools=[by_name[n].definition() for n in ctx.active_tools if n in by_name],
                # the prompt's parts and the history's system part; text prepare_step replaced goes as it is
                instruction_parts=request_instruction_parts(ctx.instructions),
            )
            output = env.output
            messages = ctx.messages
            if output is not None:
                params = output.parameters(params)
                if self._output_feedback:  # the withdrawn invalid answer and the retry prompt, once
                    messages, self._output_feedback = [*messages, *self._output_feedback], ()
            try:
                response, first_at = await self._stream(operation, ctx.model, messages, params)
            except _Failure as failure:
                self._step_finished(step, ctx.model, failure.response)
                if await self._retry(failure, step, attempt_start):
                    continue
                self.parts.extend(failure.partial)
                raise
            # the first-output phase as a record: only its events need one (its time is in the completion)
            publishing = env.publishing or env.operator_publishing
            first = _first_output(operation, first_at) if first_at is not None and publishing else None
            identity = self._step_finished(step, ctx.model, response, first)
            self._record_response(step, identity)
            produced = self._unique_call_ids(canonical_parts(response, ctx.model.provider_name))
            # step finish: the response and the request's completion in one commit
            completed = evolve(operation, {"phase": "completed", "finished_at": _now(), "first_output_at": first_at})
            answered = ()
            if output is not None:
                judgement = output.judge(produced)
                if judgement.kind == "valid":  # the final answer: its finish is written by the terminal commit
                    self.parts.extend((*produced, *judgement.results))
                    self.output_value = judgement.value
                    self._last_step = (first, completed)
                    return ("provider_stop" if response.finish_reason == "length" else "success"), None
                if judgement.kind != "tools":
                    self._output_rejected(output, judgement, produced, (first, completed))
                    if judgement.kind == "invalid-text":  # withdrawn: the next request carries it back
                        self._transient(AttemptResetEvent, step=step, attempt=self.attempt)
                        self._output_feedback = judgement.feedback
                        await self._checkpoint(self.parts, completed, preceding=first)
                        step += 1
                        continue
                    answered = judgement.results  # the output call's answer, recorded after this round
            self.parts.extend(produced)
            calls = [p for p in produced if isinstance(p, ToolCallPart)]
            if answered:
                calls = [c for c in calls if c.tool_name not in output.tool_names]  # type: ignore[union-attr]
            if not calls and not answered:  # the last step: its finish is written by the terminal commit
                self._last_step = (first, completed)
                return ("provider_stop" if response.finish_reason == "length" else "success"), None
            await self._checkpoint(self.parts, completed, preceding=first)
            # each call passes the lifecycle (application hooks, then the fence) before its effect; results
            # are accepted only by the next owned commit, whose CAS verifies owner, token and revision again
            held = [c for c in calls if await self._needs_approval(c)]
            direct = [c for c in calls if c not in held]
            self._tools_invoked = self._tools_invoked or bool(direct)
            # with no application hook that could wait in between, the finish commit's CAS is the fence
            settings = env.settings
            self.owned.vouched = settings.tool_lifecycle is None and not callable(settings.tool_approval)
            try:
                if len(direct) == 1:
                    results = [await self._abortable(self._call_tool(by_name, direct[0]))]
                else:
                    results = await self._abortable(_all_or_none(self._call_tool(by_name, c) for c in direct))
            finally:
                self.owned.vouched = False
            self.parts.extend(results)
            self.parts.extend(answered)
            if held:  # the run pauses: signed requests are stored on its assistant before any effect
                self.parts.extend(self._approval_request(c) for c in held)
                self._paused = True
                return "provider_stop", None
            # the tool results are checkpointed with the next request's admission, or by the terminal
            ctx.parts = tuple(self.parts)
            if env.settings.stop_policies and self._lifecycle is None:
                await self.owned.fence(after=True)  # application code is about to see the results
            for policy in env.settings.stop_policies:
                if await self._callback(policy.should_stop, ctx, origin="policy"):
                    return "policy_stop", policy.name
            step += 1
        return "policy_stop", "max-steps"

    def _output_rejected(
        self,
        output: AgentOutput,
        judgement: OutputJudgement,
        produced: Sequence[Part],
        last_step: tuple[RunOperation | None, RunOperation],
    ) -> None:
        """Count one invalid output; past ``output.retries`` the run ends ``output_rejected`` with the
        invalid answer kept as evidence (the terminal commit records the step's finish)."""
        if self._output_retries < output.retries:
            self._output_retries += 1
            return
        self.parts.extend((*produced, *judgement.results))
        self._last_step = last_step
        tries = self._output_retries + 1
        said = f"the model's output did not fit {output.name} after {tries} attempt{'s' * (tries > 1)}"
        cause = judgement.error or ValueError(judgement.summary)
        raise _Failure("output_rejected", cause, "policy", f"{said}: {judgement.summary}")

    async def _resume(self) -> int:
        """Continue a run acquired again (requeued after a crash, taken over) from its durable draft: the
        completed tool rounds it holds (every call with its result) are kept and never executed again; the
        step that was in progress is replayed. Inputs that had joined at a kept boundary are claimed again
        while their runs are still queued; those that joined the replayed step are offered again. Returns
        the step to continue at (0 for a run that never checkpointed anything)."""
        draft = self.env.view.message(self.run.assistant_message_id)
        if draft is None or draft.run_id != self.run.id or not draft.parts:
            return 0
        kept, replayed = split_completed_rounds(draft.parts)
        for part in replayed:
            if part.type == "input-joined":
                self.control.offer_injection(part.run_id)
        parts: list[Part] = []
        joined: dict[str, tuple[str, ...]] = {}  # per queued run, the inputs that joined at kept boundaries
        for part in kept:
            if part.type == "input-joined":
                ids = (*joined.get(part.run_id, ()), *part.message_ids)
                if not await self._reclaim(part.run_id, ids):
                    continue  # its run moved on (absorbed elsewhere, started, ended): it answers itself
                joined[part.run_id] = ids
            parts.append(part)
        self.parts = parts
        self._tools_invoked = any(p.type == "tool-result" for p in parts)
        last = self.run.last_operation
        return last.step if last is not None and last.step is not None and parts else 0

    async def _reclaim(self, run_id: str, joined: tuple[str, ...]) -> bool:
        """Claim again a queued run whose inputs ``joined`` this run before it stopped, if it still can."""
        loaded = await with_store_retry(
            lambda: self.env.store.load_run(conversation_id=self.run.conversation_id, run_id=run_id)
        )
        queued = loaded.run if loaded is not None else None
        if queued is None or queued.state != "queued" or queued.execution_sequence is not None:
            return False
        if not set(joined) <= set(queued.input_message_ids):
            return False
        # claimed as of the inputs that joined so far; inputs coalesced into it since join at the next boundary
        self.claims[run_id] = AbsorbClaim(run_id, queued.revision, joined)
        if len(joined) < len(queued.input_message_ids):
            self.control.offer_injection(run_id)
        return True

    def _record_request(self, step: int, ctx: StepContext) -> None:
        """Attach this call's ``provider/request`` record (and the ``provider/message`` bodies this process
        has not seen recorded) to the run's next commit, which is made before the call."""
        state = self.env.view.ledger_state
        if not isinstance(state, PrefixDigests):
            state = self.env.view.ledger_state = PrefixDigests()
        events, committed = provider_request_records(
            state,
            self._prefix,
            ctx.messages,
            run_id=self.run.id,
            attempt=self.attempt,
            step=step,
            model_id=getattr(ctx.model, "name", None),
            instructions=str(ctx.instructions),
        )
        self.owned.attach(events, committed)

    def _record_response(self, step: int, identity: AgentProviderResponse | None) -> None:
        """Attach the completed response's identity (``provider/response``) to the run's next commit."""
        if identity is None:
            return
        payload = {"run_id": self.run.id, "attempt": self.attempt, "step_number": step}
        payload["response"] = identity.model_dump(exclude_none=True)
        self.owned.attach([_ledger("provider/response", payload)])

    def _step_finished(
        self, step: int, model: AgentModelDescriptor, response: ModelResponse | None, first: RunOperation | None = None
    ) -> AgentProviderResponse | None:
        """Operator event: what this provider call reported (its own figures, not a sum). Returns the
        response's identity, its provider named by the model's ``resolve_response_provider``."""
        identity = (
            AgentProviderResponse.from_response(response, provider=response_provider(model, response))
            if response is not None
            else None
        )
        if not self.env.operator_publishing:
            return identity
        ttft = None
        if first is not None and first.first_output_at is not None:
            ttft = max(0.0, (first.first_output_at - first.started_at).total_seconds())
        self.env.operator_publish(
            AgentStepFinishedEvent(
                conversation_id=self.run.conversation_id,
                run_id=self.run.id,
                runtime_epoch=self.env.runtime_epoch,
                owner_id=self.env.owner_id,
                fencing_token=self.run.fencing_token,
                model_id=(response.model_name if response is not None else None) or model.name,
                step=step,
                attempt=self.attempt,
                usage=self._step_usage if self._step_usage is not None else AgentUsage.unreported(),
                response=identity,
                finish_reason=response.finish_reason if response is not None else None,
                ttft=ttft,
            )
        )
        return identity

    async def _renew_lease(self) -> None:
        """Keep the lease alive while executing; losing the run stops the loop (the next write fails)."""
        assert self.env.lease is not None
        duration, expiry = self.env.lease
        while True:
            await asyncio.sleep(duration / 3)
            try:
                await self.owned.renew(expiry())
            except (_FenceLost, _Failure):
                return  # the run is no longer ours to keep alive: the loop's next owned write finds out

    async def execute(self) -> RunOutcome:
        renewal = asyncio.ensure_future(self._renew_lease()) if self.env.lease is not None else None
        try:
            return await self._execute()
        finally:
            self._attempt_over = True  # committed or abandoned: a call still running reports nothing more
            if renewal is not None:
                renewal.cancel()
                with contextlib.suppress(BaseException):
                    await renewal

    async def _execute(self) -> RunOutcome:
        cause: BaseException | None = None
        policy_name: str | None = None
        origin: FailureOrigin | None = None
        said: str | None = None  # why, when nothing raised
        try:
            reason, policy_name = await self._steps()
        except _Aborted:
            reason = self.control.abort_reason or "interrupted"
        except _Failure as failure:
            reason, cause, origin, said = failure.reason, failure.cause, failure.origin, failure.summary
            if self.control.aborted:  # an abort that surfaced as a failure is still the abort
                reason = self.control.abort_reason or reason
        except _FenceLost as lost:
            return RunOutcome(reason=None, run=self.run, usage=self.usage, lost=lost.cause, steps=self.steps)
        except Exception as error:  # a defect or a bad value nothing classified: the run still ends
            reason, cause = "runtime_failure", error
        if reason in COMPLETED_REASONS and not self._paused:  # a pause for approval is answered, not judged
            try:
                accepted = self.env.protocol.accept_terminal(self.parts, reason, policy_name, self.output_value)
            except Exception as error:  # the application's acceptance callback failed
                reason, policy_name, cause, origin = "runtime_failure", None, error, "policy"
            else:
                if not accepted:
                    reason, policy_name = "output_rejected", None
                    rule = self.env.protocol.terminal_acceptance
                    named = repr(rule) if isinstance(rule, str) else "a callback"
                    said = f"the protocol's terminal acceptance ({named}) refused the answer"
        if self.admitted is not None:  # the run ended before its admitted request was made: say so
            phase, detail = ("cancelled", None) if reason in INTERRUPTED_REASONS else ("failed", reason)
            ended = evolve(self.admitted, {"phase": phase, "finished_at": _now(), "detail": detail})
            self._last_step, self.admitted = (None, ended), None
        failure = describe_run_failure(reason, cause, origin, said) if reason in FAILURE_REASONS else None
        return await self._commit(reason, policy_name, cause, failure)

    async def _commit(
        self, reason: str, policy_name: str | None, cause: BaseException | None, failure: AgentRunFailure | None
    ) -> RunOutcome:
        parts = list(self.parts)
        if reason in INTERRUPTED_REASONS:
            parts = [p for p in parts if p.type != "control"] + [ControlPart()]
        store = self.env.store
        for attempt in range(3):
            run = self.owned.run
            try:
                commit = functools.partial(
                    store.commit_run_terminal,
                    conversation_id=run.conversation_id,
                    run_id=run.id,
                    expected_revision=run.revision,
                    owner_id=self.env.owner_id,
                    fencing_token=run.fencing_token,
                    terminal_reason=reason,
                    parts=parts,
                    policy_name=policy_name if reason == "policy_stop" else None,
                    absorb=list(self.claims.values()) if reason in COMPLETED_REASONS else (),
                    operation=self._last_step[1] if self._last_step is not None else None,
                    usage=self.total_usage(),
                    events=list(self.owned.attached),
                    failure=failure if reason in FAILURE_REASONS else None,
                )
                result = await with_store_retry(commit)
            except AgentRunRevisionConflictError as error:
                try:
                    current = await self.owned._still_owned()
                except Exception as unread:  # the store cannot say who holds the run now
                    return RunOutcome(reason=None, run=self.run, usage=self.usage, unsettled=unread, steps=self.steps)
                if current is None:
                    return RunOutcome(reason=None, run=self.run, usage=self.usage, lost=error, steps=self.steps)
                self.owned.run = current
                if self.owned.run.state == "interrupt_requested" and reason in COMPLETED_REASONS:
                    reason, parts = "interrupted", [*parts, ControlPart()]
                if attempt < 2:
                    continue
                return RunOutcome(reason=None, run=self.run, usage=self.usage, unsettled=error, steps=self.steps)
            except (AgentRunOwnershipConflictError, AgentRunStateConflictError) as error:
                return RunOutcome(reason=None, run=self.run, usage=self.usage, lost=error, steps=self.steps)
            except Exception as error:
                return RunOutcome(reason=None, run=self.run, usage=self.usage, unsettled=error, steps=self.steps)
            if result.outcome == "committed":
                for committed in self.owned.take_attached()[1]:
                    committed()
            if self._last_step is not None and result.outcome == "committed":
                first, completed = self._last_step
                if first is not None:
                    self.owned._published_operation(first, result.version)
                self.owned._published_operation(completed, result.version)
            return RunOutcome(
                reason=result.run.terminal_reason,
                run=result.run,
                assistant=result.assistant,
                committed=result.outcome == "committed",
                usage=self.usage,
                cause=cause,
                absorbed_runs=result.absorbed_runs,
                steps=self.steps,
            )
        raise AssertionError("unreachable")


async def execute_run(
    env: LoopEnv, run: Run, control: RunControl, admitted: tuple[RunOperation, int] | None = None
) -> RunOutcome:
    """Execute one acquired run to its terminal commit (or to a lost fence). Never raises for a run
    failure: the outcome says how it ended. Cancelling the calling task cancels the provider call and
    tools but commits nothing; the run stays acquired for recovery to decide.

    ``admitted`` is (the first request's ``started`` phase, the version that committed it) when the
    acquisition recorded it with an empty draft (:func:`model_request`): its events are published here and
    step 0 writes no admission of its own."""
    execution = _Execution(env, run, control, admitted[0] if admitted is not None else None)
    if admitted is not None:
        execution.owned.published_checkpoint((), admitted[1], None, admitted[0])
    return await execution.execute()


def _ledger(kind: str, payload: dict[str, Any]) -> AgentStoreEventDraft:
    return runtime_draft(kind, payload)


def split_completed_rounds(parts: Sequence[Part]) -> tuple[tuple[Part, ...], tuple[Part, ...]]:
    """A draft's parts as (the completed tool rounds, what follows them). A round is complete once every
    tool call in it has its result; a draft ending inside a step (streamed text, calls still waiting for
    results) splits at the end of the last complete round."""
    pending: set[str] = set()
    boundary = 0
    for index, part in enumerate(parts):
        if part.type == "tool-call":
            pending.add(part.call_id)
        elif part.type == "tool-result":
            pending.discard(part.call_id)
            if not pending:
                boundary = index + 1
    return tuple(parts[:boundary]), tuple(parts[boundary:])


def call_idempotency_key(conversation_id: str, run_id: str, call_id: str) -> str:
    """The stable idempotency key of one tool call (``AgentToolContext.idempotency_key``)."""
    digest = hashlib.sha256(f"{conversation_id}\x00{run_id}\x00{call_id}".encode()).hexdigest()
    return f"tl-{digest[:40]}"


_TAIL_DRAFT = Message(
    id="-",
    conversation_id="-",
    role="assistant",
    status="completed",
    parts=(),
    run_id="-",
    created_at=TEMPLATE_TIME,
    seq=0,
)
"""What a run's own answer is projected as in its requests (``_Execution._history`` copies it; the run's
fields are validated already)."""

_MODEL_REQUEST = RunOperation(
    kind="model-request", phase="started", operation_id="-", step=0, attempt=1, started_at=TEMPLATE_TIME
)


def _first_output(operation: RunOperation, at: datetime) -> RunOperation:
    """``operation``'s ``first-output`` phase, first output at ``at``."""
    return evolve(operation, {"phase": "first-output", "first_output_at": at})


def model_request(step: int, attempt: int = 1) -> RunOperation:
    """A ``model-request`` operation in its ``started`` phase: what a request's durable admission records."""
    changes = {"operation_id": new_id(), "step": step, "attempt": attempt, "started_at": _now()}
    if type(step) is int and type(attempt) is int:  # a copy of the template: nothing here needs validating
        return build(_MODEL_REQUEST, changes)
    return RunOperation(kind="model-request", phase="started", **changes)  # type: ignore[arg-type]
