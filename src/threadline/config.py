"""The runtime's configuration sections — ``runs``, ``loop``, ``history`` — checked when they are given.

Each section is a dataclass (:class:`RunsConfig`, :class:`LoopConfig`, :class:`HistoryConfig`) or a dict
with the same keys; :func:`create_agent_runtime <threadline.runtime.create_agent_runtime>` takes either.
Every value is validated where it is given — building the dataclass, or building the runtime from a dict —
never at the first run: a bad one raises :class:`~threadline.errors.AgentConfigError` whose ``field``
names it (``runs.watch_interval``) and whose message says what it accepts.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any, Literal, TypeVar

from .errors import AgentConfigError
from .history.prompt import agent_instructions
from .loop import AgentRetryPolicy, StopPolicy
from .models import AgentModelRegistry, define_model_registry
from .records import INPUT_POLICIES, id_problem
from .store.aggregate import AgentRuntimeStore
from .tools import AgentTool, AgentToolLifecycle

__all__ = (
    "MAX_INPUT_BYTES",
    "HistoryConfig",
    "LoopConfig",
    "RunsConfig",
    "model_hooks",
    "prompt_source",
    "runtime_store",
    "section",
    "tool_source",
)

C = TypeVar("C")

MAX_INPUT_BYTES = 1024 * 1024
"""``runs.max_input_bytes`` by default (1 MiB): the largest input ``submit`` admits, as stored JSON."""


def _fail(field: str, accepts: str, value: Any) -> AgentConfigError:
    shown = repr(value)
    if len(shown) > 80:
        shown = shown[:80] + "…"
    return AgentConfigError(f"{field} is {accepts}, got {shown}", field=field)


def _flag(field: str, value: Any) -> None:
    if type(value) is not bool:
        raise _fail(field, "True or False", value)


def _count(field: str, value: Any, minimum: int) -> None:
    if type(value) is not int or value < minimum:
        raise _fail(field, f"an int of at least {minimum}", value)


def _seconds(field: str, value: Any, *, optional: bool) -> None:
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
        accepts = "a positive, finite number of seconds" + (" or None" if optional else "")
        raise _fail(field, accepts, value)


def _callable(field: str, value: Any, what: str) -> None:
    if value is not None and not callable(value):
        raise _fail(field, f"None or a callable {what}", value)


@dataclass
class RunsConfig:
    """How runs are admitted and executed. Checked when built (:class:`~threadline.errors.AgentConfigError`).

    ``input_policy``: a policy name (``'queue'``, ``'inject'``, ``'interrupt'``, ``'interrupt-next'``,
    ``'supersede'``) or a function of the raw input returning one. ``coalesce_pending``: later inputs join
    the single queued successor."""

    input_policy: str | Callable[[Any], str] = "queue"
    """A policy name or a function of the raw input (an ``AgentRuntimeInput``) returning one."""
    coalesce_pending: bool = False
    owner_id: str | None = None
    """This runtime's owner id on the runs it executes (an id: see :func:`threadline.records.id_problem`);
    None draws ``runtime-<random>``."""
    execute: bool = True
    """False: this runtime only admits input (a web process, say) and tickets follow the stored runs
    while other processes (``serve``, ``threadline worker``) execute them."""
    watch_interval: float = 0.5
    """Seconds between reads of a run executed elsewhere (``execute=False``), at most."""
    lease_duration: float | None = None
    """Seconds: when set, an executing run carries a lease (``lease_expires_at``) that this runtime renews
    every third of it; another process may take the run over only once the lease expired (see
    :func:`~threadline.runtime.takeover_expired_leases`)."""
    resolve_context: Callable[[Any], Any] | None = None
    """The raw context of a run this runtime did not admit (sync or async; parsed with the protocol). When a
    run this runtime executed ends, it starts the conversation's next queued run, whoever admitted it:
    another process's queued input is then answered here instead of waiting for ``recover()``. Without it,
    the ``resolve_context`` of this runtime's last ``recover()`` or ``serve()`` is used; with neither, such
    a run waits for its admitter, ``resume()`` or ``recover()``."""
    max_input_bytes: int = MAX_INPUT_BYTES
    """The largest input ``submit`` admits: its parts and metadata as stored JSON, in UTF-8 bytes (1 MiB by
    default). A larger one is refused before anything is written; send big content as a file part (a
    reference the application resolves) instead."""

    def __post_init__(self) -> None:
        policy = self.input_policy
        if not callable(policy) and policy not in INPUT_POLICIES:
            raise _fail("runs.input_policy", f"one of {', '.join(map(repr, INPUT_POLICIES))} or a function", policy)
        _flag("runs.coalesce_pending", self.coalesce_pending)
        if self.owner_id is not None and id_problem(self.owner_id) is not None:
            raise _fail("runs.owner_id", f"None or an id ({id_problem(self.owner_id)})", self.owner_id)
        _flag("runs.execute", self.execute)
        _seconds("runs.watch_interval", self.watch_interval, optional=False)
        _seconds("runs.lease_duration", self.lease_duration, optional=True)
        _callable("runs.resolve_context", self.resolve_context, "taking a Run")
        _count("runs.max_input_bytes", self.max_input_bytes, 1)


@dataclass
class LoopConfig:
    """The step loop. Checked when built (:class:`~threadline.errors.AgentConfigError`); ``stop_policies``
    become :class:`~threadline.loop.StopPolicy` records and ``retry`` an
    :class:`~threadline.loop.AgentRetryPolicy`."""

    checkpoint_every_events: int = 20
    idle_timeout: float | None = None
    max_steps: int = 20
    stop_policies: Sequence[StopPolicy | Mapping[str, Any]] = ()
    prepare_step: Callable[..., Any] | None = None
    model_settings: Mapping[str, Any] | None = None
    retry: AgentRetryPolicy | Mapping[str, Any] | None = None
    tool_lifecycle: AgentToolLifecycle | None = None
    tool_approval: Callable[..., Any] | Collection[str] | None = None
    tool_approval_secret: str | bytes | None = None
    step_durability: Any = None
    """Behind ``ctx.step`` in tools, e.g. ``create_local_step_durability("steps.db")``; the application
    creates and closes it."""

    def __post_init__(self) -> None:
        _count("loop.checkpoint_every_events", self.checkpoint_every_events, 1)
        _seconds("loop.idle_timeout", self.idle_timeout, optional=True)
        _count("loop.max_steps", self.max_steps, 1)
        if isinstance(self.stop_policies, str | bytes | Mapping) or not isinstance(self.stop_policies, Sequence):
            raise _fail(
                "loop.stop_policies", "a list of StopPolicy or {'name': ..., 'should_stop': ...}", self.stop_policies
            )
        self.stop_policies = tuple(_stop_policy(i, p) for i, p in enumerate(self.stop_policies))
        _callable("loop.prepare_step", self.prepare_step, "taking the StepContext")
        if self.model_settings is not None and not isinstance(self.model_settings, Mapping):
            raise _fail("loop.model_settings", "None or a dict of pydantic-ai ModelSettings", self.model_settings)
        if isinstance(self.retry, Mapping):
            self.retry = section(AgentRetryPolicy, self.retry, "loop.retry")
        elif self.retry is not None and not isinstance(self.retry, AgentRetryPolicy):
            raise _fail("loop.retry", "None, an AgentRetryPolicy or a dict of its fields", self.retry)
        if self.tool_lifecycle is not None and not isinstance(self.tool_lifecycle, AgentToolLifecycle):
            raise _fail("loop.tool_lifecycle", "None or an AgentToolLifecycle", self.tool_lifecycle)
        approval = self.tool_approval
        if isinstance(approval, str):
            raise _fail("loop.tool_approval", f"a callable or a list of tool names (write [{approval!r}])", approval)
        if (
            approval is not None
            and not callable(approval)
            and (not isinstance(approval, Collection) or not all(isinstance(n, str) and n for n in approval))
        ):
            raise _fail("loop.tool_approval", "None, a callable taking the call, or a list of tool names", approval)
        secret = self.tool_approval_secret
        if secret is not None and (not isinstance(secret, str | bytes) or not secret):
            raise _fail("loop.tool_approval_secret", "None or a non-empty str or bytes", "<hidden>")
        if approval is not None and secret is None:
            raise AgentConfigError(
                "loop.tool_approval needs loop.tool_approval_secret (a str or bytes only this application "
                "knows) to sign the approval requests it stores",
                field="loop.tool_approval_secret",
            )
        step = getattr(self.step_durability, "step", None)
        if self.step_durability is not None and not callable(step):
            raise _fail(
                "loop.step_durability",
                "None or a step ledger with a step(...) method, e.g. create_local_step_durability()",
                self.step_durability,
            )


def _stop_policy(index: int, value: Any) -> StopPolicy:
    where = f"loop.stop_policies[{index}]"
    if isinstance(value, StopPolicy):
        policy = value
    elif isinstance(value, Mapping) and set(value) == {"name", "should_stop"}:
        policy = StopPolicy(value["name"], value["should_stop"])
    else:
        raise _fail(where, "a StopPolicy or {'name': str, 'should_stop': callable}", value)
    if not isinstance(policy.name, str) or not policy.name or policy.name == "max-steps":
        raise _fail(
            f"{where}.name", "a non-empty str other than 'max-steps' (reserved for loop.max_steps)", policy.name
        )
    if not callable(policy.should_stop):
        raise _fail(f"{where}.should_stop", "a callable taking the StepContext", policy.should_stop)
    return policy


_INTERRUPTED = ("assistant-marked", "system-note", "omit")
_INCOMPLETE = ("drop", "error")
_UNRESOLVED = ("omit", "text", "error")


@dataclass
class HistoryConfig:
    """How history is projected for the model. Checked when built
    (:class:`~threadline.errors.AgentConfigError`)."""

    interrupted_assistant: Literal["assistant-marked", "system-note", "omit"] = "assistant-marked"
    evidence_policy: Any = None
    incomplete_tool_turn: Literal["drop", "error"] = "drop"
    unresolved_file: Literal["omit", "text", "error"] = "omit"
    resolve_file: Callable[..., Any] | None = None
    compaction: Callable[..., Any] | None = None
    """Runtime-managed compaction: called before every step with an ``AgentCompactionRequest`` (or an
    ``AgentCompactionHook`` mapping)."""
    project: Callable[..., Any] | None = None
    """Your own projection, in place of threadline's: called (sync or async) before every provider request
    with the messages that request may see, in order (the active settled history, then this run's inputs
    and inputs that joined it, then this run's answer so far when it has parts), and returning the
    pydantic-ai ``ModelMessage`` list to send. The other history options do not apply then (the
    interrupted-turn question still does: you decide how a cut-off answer reads)."""

    def __post_init__(self) -> None:
        for name, allowed in (
            ("interrupted_assistant", _INTERRUPTED),
            ("incomplete_tool_turn", _INCOMPLETE),
            ("unresolved_file", _UNRESOLVED),
        ):
            if getattr(self, name) not in allowed:
                raise _fail(f"history.{name}", f"one of {', '.join(map(repr, allowed))}", getattr(self, name))
        _callable("history.resolve_file", self.resolve_file, "taking a FilePart")
        if isinstance(self.compaction, Mapping):
            from .history.compaction import AgentCompactionHook

            try:
                self.compaction = AgentCompactionHook.parse(self.compaction)
            except AgentConfigError:
                raise
            except Exception as error:
                raise AgentConfigError(f"history.compaction: {error}", field="history.compaction") from error
        _callable("history.compaction", self.compaction, "taking an AgentCompactionRequest, or a hook mapping")
        _callable("history.project", self.project, "taking the messages a request may see, returning ModelMessages")


def section(cls: type[C], value: C | Mapping[str, Any] | None, name: str) -> C:
    """``value`` as the section ``cls``: None gives the defaults, a dict its keys (unknown ones refused,
    naming the known), an instance itself."""
    if value is None:
        return cls()
    if isinstance(value, cls):
        return value
    if not isinstance(value, Mapping):
        raise AgentConfigError(f"{name} is a dict or a {cls.__name__}, got {type(value).__name__}", field=name)
    known = {f.name for f in fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(value) - known)
    if unknown:
        raise AgentConfigError(
            f"{name} has unknown keys {unknown}; known: {sorted(known)}", field=f"{name}.{unknown[0]}"
        )
    return cls(**value)


# ----------------------------------------------------------------------- create_agent_runtime's arguments


def runtime_store(store: Any) -> AgentRuntimeStore:
    """``store=``: an :class:`AgentRuntimeStore`, or a handle that carries one (SQLite, PostgreSQL)."""
    if isinstance(store, AgentRuntimeStore):
        return store
    inner = getattr(store, "store", None)
    if isinstance(inner, AgentRuntimeStore):
        return inner
    raise AgentConfigError(
        "store is an AgentRuntimeStore or a store handle: create_memory_agent_runtime_store(), "
        "create_sqlite_agent_runtime_store(path), create_postgres_agent_runtime_store(dsn); "
        f"got {type(store).__name__}",
        field="store",
    )


_MODEL_HOOKS = {"resolve", "preflight"}


def model_hooks(models: Any) -> tuple[Callable[..., Any] | None, Callable[..., Any]]:
    """``models=`` as (preflight, resolve) hooks. Accepted: a registry with a default model
    (``define_model_registry(models=..., default=...)``, or one that declares a single model), a pydantic-ai
    ``Model`` or model name (one model for every run), ``{"resolve": ..., "preflight": ...}`` or an object
    with those methods (each may take the prompt context, or nothing)."""
    from pydantic_ai.models import Model

    if isinstance(models, Model | str) and not isinstance(models, AgentModelRegistry):
        if isinstance(models, str) and not models:
            raise _fail("models", "a model name, a pydantic-ai Model, a registry or {'resolve': ...}", models)
        models = define_model_registry(models={"default": {"model": models}}, default="default")
    if isinstance(models, AgentModelRegistry):
        registry = models
        name = registry.default
        if name is None:
            names = registry.names
            raise AgentConfigError(
                f"models is a model registry of {len(names)} models and no default: name the one every run uses "
                f"with define_model_registry(models=..., default={names[0]!r}), or choose per run with "
                f"models={{'resolve': lambda ctx: registry.resolve({names[0]!r})}}",
                field="models",
            )
        return (lambda: registry.preflight(name)), (lambda: registry.resolve(name))
    if isinstance(models, Mapping):
        unknown = sorted(set(models) - _MODEL_HOOKS)
        if unknown:
            raise AgentConfigError(
                f"models has unknown keys {unknown}; it is {{'resolve': ..., 'preflight': ...}} "
                "(to declare models, use define_model_registry(models={...}, default=...))",
                field=f"models.{unknown[0]}",
            )
        preflight, resolve = models.get("preflight"), models.get("resolve")
    else:
        preflight, resolve = getattr(models, "preflight", None), getattr(models, "resolve", None)
    if not callable(resolve):
        raise AgentConfigError(
            "models is a model registry with a default (define_model_registry(models=..., default=...)), a "
            "pydantic-ai Model or model name, or {'resolve': callable, 'preflight': callable}; "
            f"got {type(models).__name__}",
            field="models.resolve",
        )
    if preflight is not None and not callable(preflight):
        raise _fail("models.preflight", "None or a callable", preflight)
    return preflight, resolve


def prompt_source(prompt: Any) -> Callable[..., Any] | None:
    """``prompt=``: None, instructions text (one stable instruction, the same for every request), a
    ``compose_agent_prompt([...])`` or a callable of the prompt context returning text or an ``AgentPrompt``."""
    if prompt is None:
        return None
    if isinstance(prompt, str):
        if not prompt.strip():
            raise _fail("prompt", "None, instructions text, compose_agent_prompt([...]) or a callable", prompt)
        fixed = agent_instructions(prompt)  # built once: every request sends the same part
        return lambda ctx: fixed
    if callable(prompt):
        return prompt  # type: ignore[no-any-return]
    raise AgentConfigError(
        "prompt is instructions text (prompt='You are helpful.'), compose_agent_prompt([...]) or a callable "
        f"taking the prompt context; got {type(prompt).__name__}",
        field="prompt",
    )


def tool_source(tools: Any) -> tuple[AgentTool, ...] | Callable[..., Any] | None:
    """``tools=``: None, a list of tools declared with ``define_agent_tool`` (names unique), or a callable of
    the prompt context returning such a list."""
    if tools is None:
        return None
    if isinstance(tools, AgentTool):
        raise AgentConfigError(f"tools is a list: write tools=[{tools.name}]", field="tools")
    if callable(tools):
        return tools  # type: ignore[no-any-return]
    if isinstance(tools, str | bytes | Mapping) or not isinstance(tools, Sequence | Collection):
        raise _fail("tools", "None, a list of define_agent_tool(...) tools, or a callable returning one", tools)
    declared = tuple(tools)
    for index, tool in enumerate(declared):
        if not isinstance(tool, AgentTool):
            hint = "; declare it with @define_agent_tool" if callable(tool) else ""
            raise AgentConfigError(
                f"tools[{index}] is a tool declared with define_agent_tool(...), got {type(tool).__name__}{hint}",
                field=f"tools[{index}]",
            )
    names = [t.name for t in declared]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise AgentConfigError(f"tool names are unique; declared more than once: {twice}", field="tools")
    return declared
