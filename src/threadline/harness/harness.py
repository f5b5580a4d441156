"""``create_headless_agent_harness``: a runtime composed with resources, per-run models and observers.

The harness is :func:`~threadline.create_agent_runtime` with three hooks filled in — nothing runs outside
the runtime's one loop:

- ``prompt``: per run, ``resources.load(request)`` is called, its result bounded and checked
  (:class:`~threadline.harness.AgentHarnessLimits`: count, UTF-8 bytes, diagnostics, unique names), the
  diagnostics handed to ``on_diagnostics``, and the resources rendered as the run's instructions. This
  happens before the run's first provider request: a loader that fails or returns something invalid ends
  the run ``runtime_failure`` and nothing is sent. With ``prompt_budget``, resources that cannot fit the
  model's window even with no history end it ``context_overflow`` instead.
- ``tools``: the application's tools plus the loader's own (``read_resource`` of file resources).
- ``publish``: every delivery event goes to the application's ``publish`` (if any) and then to the
  harness's :class:`~threadline.harness.AgentEventHub`, which the control server and the HTTP transports
  subscribe to.

Once a run has both its prompt and its tools, one :class:`~threadline.harness.AgentHarnessProfileEvent`
(``profile-applied``) goes to ``on_profile``: the model descriptor, each resource's kind, name and
provenance, the diagnostics, the sorted tool names — no text, prompt, argument or credential. An observer
(``on_profile``, ``on_profile_error``, ``on_diagnostics``) that raises is logged and ignored: it never
changes a run's outcome.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..coordinator import call_maybe_async
from ..errors import AgentContextOverflowError, AgentRuntimeUsageError
from ..events import delivered_message
from ..following import AgentRelayedDelivery
from ..history.prompt import AgentPrompt, compose_agent_prompt
from ..protocol import AgentProtocol
from ..records import ConversationSnapshot
from ..runtime import AgentPromptContext, AgentRuntime, AgentRuntimeTicket, create_agent_runtime
from ..store.aggregate import AgentRuntimeStore
from ..tools import AgentTool
from .contract import (
    AgentHarnessAppliedResource,
    AgentHarnessLimits,
    AgentHarnessModelSummary,
    AgentHarnessProfileEvent,
    AgentHarnessResourceDiagnostic,
    AgentHarnessResourceError,
    AgentHarnessResourceRequest,
    AgentHarnessResourceResult,
)
from .hub import AgentEventHub
from .resources import harness_limits, render_harness_resources, validate_harness_resources

_log = logging.getLogger("threadline.harness")

_BUDGET_KEYS = frozenset({"reserved_output", "tool_schema_tokens", "attachment_tokens", "provider_overhead_tokens"})


@dataclass(frozen=True)
class AgentHarnessDiagnostics:
    """What ``on_diagnostics`` receives once per run: the loader's diagnostics (possibly none)."""

    conversation_id: str
    run_id: str
    context: Any
    diagnostics: tuple[AgentHarnessResourceDiagnostic, ...]


@dataclass
class _Pending:
    """A run's profile while it is being assembled (prompt first, then tools)."""

    conversation_id: str
    model: AgentHarnessModelSummary | None = None
    loaded: AgentHarnessResourceResult | None = None
    tool_names: tuple[str, ...] | None = None


def _model_summary(model: Any) -> AgentHarnessModelSummary:
    inner = getattr(model, "model", None)
    return AgentHarnessModelSummary(
        name=model.name,
        provider=getattr(inner, "system", None),
        model_name=getattr(inner, "model_name", None),
        context_window=model.context_window,
        capabilities=tuple(sorted(model.capabilities)),
    )


async def _observe(name: str, hook: Callable[..., Any] | None, *args: Any) -> BaseException | None:
    """Call an observer; its failure is logged and returned, never raised."""
    if hook is None:
        return None
    try:
        outcome = hook(*args)
        if inspect.isawaitable(outcome):
            await outcome
    except Exception as error:
        _log.warning("harness observer %s failed; the run goes on", name, exc_info=True)
        return error
    return None


@dataclass
class HeadlessAgentHarness:
    """A runtime with resources and observers, plus what a control surface needs: ``snapshot``,
    ``subscribe`` and the approval calls. Build it with :func:`create_headless_agent_harness`.

    Every call goes to :attr:`runtime`; the harness adds no state of its own that a restart would lose."""

    runtime: AgentRuntime
    events: AgentEventHub
    """The seam subscribers read (see :mod:`threadline.harness.hub`)."""
    _pending: dict[str, _Pending] = field(default_factory=dict, repr=False)

    @property
    def store(self) -> AgentRuntimeStore:
        return self.runtime.store

    @property
    def closing(self) -> bool:
        """True once :meth:`close` began: the harness admits nothing new."""
        return self.runtime.closing

    def submit(self, **kwargs: Any) -> AgentRuntimeTicket:
        """:meth:`AgentRuntime.submit <threadline.AgentRuntime.submit>` — admit one input; same arguments,
        same ticket, same durability."""
        return self.runtime.submit(**kwargs)

    async def interrupt(self, *, conversation_id: str, run_id: str) -> Any:
        """Durably interrupt a run (:meth:`AgentRuntime.interrupt <threadline.AgentRuntime.interrupt>`)."""
        return await self.runtime.interrupt(conversation_id=conversation_id, run_id=run_id)

    async def snapshot(self, conversation_id: str) -> ConversationSnapshot:
        """The conversation's canonical snapshot as delivery shows it (provider envelopes stay in the store).
        A read: cancelling it changes nothing."""
        snapshot = await self.runtime.store.load_snapshot(conversation_id=conversation_id)
        messages = tuple(delivered_message(m) for m in snapshot.messages)
        return snapshot.model_copy(update={"messages": messages})

    def subscribe(self, listener: Callable[[Any], Any], *, conversation_id: str | None = None) -> Callable[[], None]:
        """Receive delivery events from now on (all, or one conversation's); returns the unsubscribe
        function. ``listener`` must not block: hand the event to a bounded queue of your own."""
        return self.events.subscribe(listener, conversation_id=conversation_id)

    def relayed_delivery(self) -> AgentRelayedDelivery:
        """The runtime's seam for other processes' events
        (:meth:`AgentRuntime.relayed_delivery <threadline.AgentRuntime.relayed_delivery>`): what
        ``await relay.subscribe(harness)`` feeds. They reach the application's ``publish``, the event hub
        (every transport) and the tickets' followers."""
        return self.runtime.relayed_delivery()

    async def pending_approvals(self, conversation_id: str) -> list[Any]:
        """Unanswered approval requests, derived from the stored history."""
        return await self.runtime.pending_approvals(conversation_id)

    async def respond_to_approval(
        self, *, conversation_id: str, approval_id: str, approved: bool, context: Any, reason: str | None = None
    ) -> AgentRuntimeTicket:
        """Answer one pending approval and queue the run that continues
        (:meth:`AgentRuntime.respond_to_approval <threadline.AgentRuntime.respond_to_approval>`)."""
        return await self.runtime.respond_to_approval(
            conversation_id=conversation_id, approval_id=approval_id, approved=approved, context=context, reason=reason
        )

    def stop(self, conversation_id: str, reason: Any = "interrupt") -> bool:
        return self.runtime.stop(conversation_id, reason)

    async def resume(self, **kwargs: Any) -> AgentRuntimeTicket:
        return await self.runtime.resume(**kwargs)

    async def recover(self, **kwargs: Any) -> Any:
        return await self.runtime.recover(**kwargs)

    async def serve(self, **kwargs: Any) -> None:
        await self.runtime.serve(**kwargs)

    async def close(self, *, grace_period: float | None = None, force_timeout: float | None = None) -> Any:
        """Close the runtime (:meth:`AgentRuntime.close <threadline.AgentRuntime.close>`): stop admitting,
        let runs finish for ``grace_period`` seconds, abort the rest and wait at most ``force_timeout``.
        Queued runs stay durably queued. Subscribers stay subscribed (a control server is closed on its own)."""
        return await self.runtime.close(grace_period=grace_period, force_timeout=force_timeout)


class _ResourceLoader:
    """The application's ``resources``: an object with ``load`` or a plain callable, and optionally
    ``tools``."""

    def __init__(self, resources: Any) -> None:
        if resources is None:
            self.load: Callable[..., Any] | None = None
        elif callable(getattr(resources, "load", None)):
            self.load = resources.load
        elif callable(resources):
            self.load = resources
        else:
            raise AgentRuntimeUsageError("resources is an object with load(request), a callable, or None")
        tools = getattr(resources, "tools", ()) if resources is not None else ()
        self.tools: tuple[AgentTool, ...] = tuple(tools or ())
        if not all(isinstance(t, AgentTool) for t in self.tools):
            raise AgentRuntimeUsageError("resources.tools are declared with define_agent_tool(...)")


def create_headless_agent_harness(
    *,
    protocol: AgentProtocol,
    store: AgentRuntimeStore,
    models: Any,
    resources: Any = None,
    tools: Sequence[AgentTool] | Callable[..., Any] | None = None,
    prompt_budget: Callable[[AgentHarnessResourceRequest], Any] | None = None,
    on_profile: Callable[[AgentHarnessProfileEvent], Any] | None = None,
    on_profile_error: Callable[[AgentHarnessProfileEvent, BaseException], Any] | None = None,
    on_diagnostics: Callable[[AgentHarnessDiagnostics], Any] | None = None,
    limits: AgentHarnessLimits | Mapping[str, Any] | None = None,
    estimate_resource_tokens: Callable[[str], int | None] | None = None,
    runs: Any = None,
    loop: Any = None,
    history: Any = None,
    publish: Callable[[Any], Any] | None = None,
    operator_publish: Callable[[Any], Any] | None = None,
    include_internal_cause: bool = False,
    events: AgentEventHub | None = None,
) -> HeadlessAgentHarness:
    """Build a harness over :func:`~threadline.create_agent_runtime` (same ``protocol``, ``store``,
    ``models``, ``runs``, ``loop``, ``history``, ``publish`` and ``operator_publish``).

    ``resources``: an object whose ``load(request)`` (sync or async) receives an
    :class:`~threadline.harness.AgentHarnessResourceRequest` and returns an
    :class:`~threadline.harness.AgentHarnessResourceResult` (or ``{"resources": [...], "diagnostics":
    [...]}``); its ``tools``, if it has any, are offered to every run beside ``tools``. A plain callable is
    ``load``. ``limits`` bounds each load (defaults: 64 resources, 1 MiB of text, 128 diagnostics).

    ``tools``: declared tools, or a function of the run's prompt context returning them (per run).

    ``prompt_budget(request)`` (optional) returns the fixed token components besides the instructions —
    ``{"reserved_output", "tool_schema_tokens", "attachment_tokens", "provider_overhead_tokens"}``, each an
    int or None; when the instructions and these exceed the model's ``context_window`` the run ends
    ``context_overflow`` before any request. ``estimate_resource_tokens(text)`` counts the instructions'
    tokens (default: the rough four-characters estimate).

    ``on_profile``, ``on_profile_error(event, error)`` and ``on_diagnostics`` observe; their failures are
    logged and never change a run. ``events`` lets several harnesses (or a relay) share one hub.
    """
    loader = _ResourceLoader(resources)
    bounds = harness_limits(limits)
    if prompt_budget is not None and not callable(prompt_budget):
        raise AgentRuntimeUsageError("prompt_budget is a callable taking the resource request")
    hub = events or AgentEventHub()
    pending: dict[str, _Pending] = {}

    def fan_out(event: Any) -> None:
        if publish is not None:
            try:
                outcome = publish(event)
                if inspect.isawaitable(outcome):
                    asyncio.ensure_future(outcome).add_done_callback(lambda t: t.cancelled() or t.exception())
            except Exception:
                _log.warning("the application's publish failed; delivery goes on", exc_info=True)
        hub.publish(event)
        if event.type == "terminal":
            pending.pop(event.run_id, None)

    async def emit_profile(run_id: str) -> None:
        entry = pending.get(run_id)
        if entry is None or entry.loaded is None or entry.tool_names is None or entry.model is None:
            return
        del pending[run_id]
        if on_profile is None:
            return
        profile = AgentHarnessProfileEvent(
            conversation_id=entry.conversation_id,
            run_id=run_id,
            model=entry.model,
            resources=tuple(
                AgentHarnessAppliedResource(kind=r.kind, name=r.name, provenance=r.provenance)
                for r in entry.loaded.resources
            ),
            diagnostics=entry.loaded.diagnostics,
            tool_names=entry.tool_names,
        )
        error = await _observe("on_profile", on_profile, profile)
        if error is not None:
            await _observe("on_profile_error", on_profile_error, profile, error)

    async def prompt(ctx: AgentPromptContext) -> AgentPrompt:
        model = ctx.model
        assert model is not None, "the runtime resolves the model before the prompt"
        request = AgentHarnessResourceRequest(
            context=ctx.context, conversation_id=ctx.conversation_id, run=ctx.run, model=model
        )
        raw = AgentHarnessResourceResult() if loader.load is None else await call_maybe_async(loader.load, request)
        loaded = validate_harness_resources(raw, bounds)
        await _observe(
            "on_diagnostics",
            on_diagnostics,
            AgentHarnessDiagnostics(ctx.conversation_id, ctx.run.id, ctx.context, loaded.diagnostics),
        )
        rendered = render_harness_resources(loaded.resources)
        composed = await compose_agent_prompt(
            [
                {
                    "name": "harness-resources",
                    "stability": "session",
                    "render": lambda _ctx: rendered,
                    "source": "harness",
                }
            ],
            count_tokens=estimate_resource_tokens,
        )(ctx)
        if prompt_budget is not None:
            components = await call_maybe_async(prompt_budget, request)
            if not isinstance(components, Mapping) or not set(components) <= _BUDGET_KEYS:
                raise AgentRuntimeUsageError(
                    f"prompt_budget returns a mapping with keys among {sorted(_BUDGET_KEYS)}, got {components!r}"
                )
            budget = composed.decide_budget(context_window=model.context_window, history_tokens=0, **components)
            if budget.decision == "oversized":
                raise AgentContextOverflowError(
                    f"the harness instructions and fixed costs need {budget.fixed_tokens} tokens; "
                    f"{model.name!r} has a window of {model.context_window}"
                )
        entry = pending.setdefault(ctx.run.id, _Pending(ctx.conversation_id))
        entry.model, entry.loaded = _model_summary(model), loaded
        await emit_profile(ctx.run.id)
        return composed

    async def run_tools(ctx: AgentPromptContext) -> list[AgentTool]:
        chosen = tools
        if callable(chosen) and not isinstance(chosen, AgentTool):
            chosen = await call_maybe_async(chosen, ctx)
        offered = [*(chosen or ()), *loader.tools]
        names = [t.name for t in offered if isinstance(t, AgentTool)]
        if len(names) != len(offered):
            raise AgentRuntimeUsageError("tools are declared with define_agent_tool(...)")
        if len(set(names)) != len(names):
            raise AgentHarnessResourceError(f"two tools share a name among {sorted(names)}", field="tools")
        entry = pending.setdefault(ctx.run.id, _Pending(ctx.conversation_id))
        entry.tool_names = tuple(sorted(names))
        await emit_profile(ctx.run.id)
        return offered

    runtime = create_agent_runtime(
        protocol=protocol,
        store=store,
        models=models,
        prompt=prompt,
        tools=run_tools,
        runs=runs,
        loop=loop,
        history=history,
        publish=fan_out,
        operator_publish=operator_publish,
        include_internal_cause=include_internal_cause,
    )
    return HeadlessAgentHarness(runtime=runtime, events=hub, _pending=pending)
