"""``compose_agent_prompt``: ordered instruction contributions and the context-window budget.

A contribution is ``{"name", "stability", "render", "source"}``. ``render(ctx)`` returns text (or None to
skip; it may be async) and receives the run's prompt context (parsed ``context``, ``conversation_id``,
``run``, ``model``). Contributions render in the order given and join with a blank line; each rendered
one keeps its ``name``, ``stability`` (``stable`` for the life of the application, ``session`` for one
conversation, ``dynamic`` per request), ``source`` (where it came from: a file, a package, the
application; ``"application"`` when not given), its place in the order and its token count with
provenance.

``adapt_instructions`` turns the composed instruction text into whatever a provider needs as system
content and metadata (stitchkit's ``adaptInstructions``). Its result is kept in ``AgentPrompt.adapted``;
the text stays in ``AgentPrompt.instructions``. For pydantic-ai it returns what goes into
``ModelRequestParameters.instruction_parts``: an ``InstructionPart``, a text, a mapping of
``InstructionPart`` fields (``{"role": "system", "content": ...}`` is the stitchkit shape), or a list of
those, e.g. ``lambda text: [InstructionPart(content=text)]``. Without it,
:meth:`AgentPrompt.instruction_parts` gives the per-contribution split (``dynamic`` contributions marked
``dynamic=True`` so a provider can cache the stable prefix).

What a request sends (:func:`agent_instructions`, :func:`with_history_system`,
:func:`request_instruction_parts`): those parts, in order, then one part with the history's system
channel (summaries, ``system`` messages, interrupted notes). :class:`AgentInstructions` is that
request's instruction *text* (``StepContext.instructions``, a ``str``) carrying the parts along; text a
``prepare_step`` puts in its place is sent as it is, as one part.

The budget (:func:`decide_prompt_budget`, :meth:`AgentPrompt.decide_budget`) is a pre-request decision
over ``context_window`` minus ``reserved_output``, instructions, tool schemas, attachments and provider
overhead. ``available_history_tokens`` stays signed, exact equality fits, and any unknown component makes
the decision ``unavailable`` — it never invents a number.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from ..errors import AgentConfigError, AgentRuntimeUsageError

__all__ = (
    "AgentInstructions",
    "AgentPrompt",
    "AgentPromptBudget",
    "AgentPromptContribution",
    "ComposedAgentPrompt",
    "ContextDecision",
    "RenderedContribution",
    "Stability",
    "TokenProvenance",
    "agent_instructions",
    "compose_agent_prompt",
    "decide_prompt_budget",
    "estimate_tokens",
    "estimate_tool_schema_tokens",
    "request_instruction_parts",
    "with_history_system",
)

Stability = Literal["stable", "session", "dynamic"]
ContextDecision = Literal["fits", "compact", "oversized", "unavailable"]
TokenProvenance = Literal["measured", "estimated", "unavailable"]
"""``measured``: a tokenizer or provider counted it; ``estimated``: :func:`estimate_tokens`;
``unavailable``: nothing could count it (no number is invented)."""

_STABILITIES = ("stable", "session", "dynamic")
_CONTRIBUTION_KEYS = {"name", "stability", "render", "source"}

TextCounter = Callable[[str], "int | None"]
"""Counts the tokens of a text for the selected model; ``None`` means it cannot."""

_INSTRUCTION_PART: Any = None


def _instruction_part() -> Any:
    """pydantic-ai's ``InstructionPart``, imported on first use and kept (an import statement in the
    functions of every step costs more than the part it builds)."""
    global _INSTRUCTION_PART
    if _INSTRUCTION_PART is None:
        from pydantic_ai.messages import InstructionPart

        _INSTRUCTION_PART = InstructionPart
    return _INSTRUCTION_PART


@dataclass(frozen=True, slots=True)
class AgentPromptContribution:
    name: str
    stability: Stability
    render: Callable[[Any], str | Awaitable[str | None] | None]
    source: str | None = None
    """Where the contribution comes from (a file path, a package, a skill); ``"application"`` if None."""


@dataclass(frozen=True, slots=True)
class RenderedContribution:
    """One contribution as rendered for a request, with where it came from."""

    name: str
    stability: Stability
    text: str
    source: str = "application"
    index: int = 0
    """Its place among the composed contributions (skipped ones keep their index)."""
    tokens: int | None = None
    token_provenance: TokenProvenance = "unavailable"


@dataclass(frozen=True, slots=True)
class AgentPromptBudget:
    """A pre-request decision. ``available_history_tokens`` stays signed: negative means even an empty
    history cannot fit. ``None`` counts make the decision ``unavailable``; ``unavailable`` names them."""

    decision: ContextDecision
    available_history_tokens: int | None
    history_tokens: int | None
    fixed_tokens: int | None = None
    """Everything but history: reserved output, instructions, tool schemas, attachments, overhead."""
    removable_history_tokens: int | None = None
    unavailable: tuple[str, ...] = ()

    @property
    def context_decision(self) -> ContextDecision:
        """The decision under its stitchkit name (``contextDecision``): the same value as ``decision``."""
        return self.decision


@dataclass(frozen=True, slots=True)
class AgentPrompt:
    """The composed instructions of one request.

    ``instructions`` is the contributions' text joined by blank lines; ``adapted`` is what
    ``adapt_instructions`` made of it (None without a hook); ``instructions_tokens`` counts
    ``instructions`` with ``token_provenance``.
    """

    instructions: str
    contributions: tuple[RenderedContribution, ...]
    adapted: Any = None
    instructions_tokens: int | None = None
    token_provenance: TokenProvenance = "unavailable"

    def instruction_parts(self) -> list[Any]:
        """pydantic-ai ``InstructionPart`` s, one per rendered contribution in order; a ``dynamic``
        contribution is marked ``dynamic=True`` (``stable`` and ``session`` ones are a cacheable prefix)."""
        InstructionPart = _instruction_part()
        return [InstructionPart(content=c.text, dynamic=c.stability == "dynamic") for c in self.contributions]

    def request_parts(self) -> list[Any]:
        """What a request sends for this prompt: what ``adapt_instructions`` returned, as
        ``InstructionPart`` s, else :meth:`instruction_parts`. A hook's result of another shape is refused
        (:class:`~threadline.errors.AgentRuntimeUsageError`)."""
        if self.adapted is None:
            return self.instruction_parts()
        return _adapted_parts(self.adapted)

    def decide_budget(
        self,
        *,
        context_window: int | None,
        reserved_output: int | None = 0,
        tool_schema_tokens: int | None = 0,
        attachment_tokens: int | None = 0,
        provider_overhead_tokens: int | None = 0,
        history_tokens: int | None = 0,
        removable_history_tokens: int | None = None,
    ) -> AgentPromptBudget:
        """:func:`decide_prompt_budget` with this prompt's ``instructions_tokens``."""
        return decide_prompt_budget(
            context_window=context_window,
            reserved_output=reserved_output,
            instructions_tokens=self.instructions_tokens,
            tool_schema_tokens=tool_schema_tokens,
            attachment_tokens=attachment_tokens,
            provider_overhead_tokens=provider_overhead_tokens,
            history_tokens=history_tokens,
            removable_history_tokens=removable_history_tokens,
        )


_INSTRUCTION_FIELDS = frozenset({"content", "dynamic", "on_change", "name"})


def _adapted_part(value: Any, where: str) -> Any:
    InstructionPart = _instruction_part()
    if isinstance(value, InstructionPart):
        return value
    if isinstance(value, str):
        return InstructionPart(content=value)
    if isinstance(value, Mapping):
        fields = dict(value)
        if fields.get("role", "system") != "system":
            raise AgentRuntimeUsageError(f"{where} has role {fields['role']!r}; instructions are 'system' content")
        fields.pop("role", None)
        unknown = sorted(set(fields) - _INSTRUCTION_FIELDS)
        if unknown or not isinstance(fields.get("content"), str):
            raise AgentRuntimeUsageError(
                f"{where} has keys {sorted(value)}: an InstructionPart takes a str 'content' and optionally "
                f"{sorted(_INSTRUCTION_FIELDS - {'content'})} (provider options such as cache control belong "
                "in the model's settings)"
            )
        return InstructionPart(**fields)
    raise AgentRuntimeUsageError(
        f"{where} is a {type(value).__name__}; return an InstructionPart, a str, a mapping of InstructionPart "
        "fields, or a list of those"
    )


def _adapted_parts(adapted: Any) -> list[Any]:
    if isinstance(adapted, list | tuple):
        return [_adapted_part(v, f"adapt_instructions(...)[{i}]") for i, v in enumerate(adapted)]
    return [_adapted_part(adapted, "adapt_instructions(...)")]


class AgentInstructions(str):
    """A request's instruction text that carries the ``InstructionPart`` s it is sent as.

    It is a ``str`` (``StepContext.instructions``), so a ``prepare_step`` reads and edits it as text; any
    edit makes a plain ``str``, and :func:`request_instruction_parts` then sends that text as one part.
    """

    parts: tuple[Any, ...]

    def __new__(cls, text: str, parts: Sequence[Any]) -> AgentInstructions:
        self = super().__new__(cls, text)
        self.parts = tuple(parts)
        return self


def agent_instructions(prompt: AgentPrompt | str | None) -> AgentInstructions:
    """A prompt's instructions as a request sends them: an :class:`AgentPrompt` gives its text and
    :meth:`AgentPrompt.request_parts`; text is one (non-dynamic) part; None is nothing."""
    if isinstance(prompt, AgentPrompt):
        return AgentInstructions(prompt.instructions, [p for p in prompt.request_parts() if p.content])
    if prompt is None or isinstance(prompt, str):
        if isinstance(prompt, AgentInstructions):
            return prompt
        text = (prompt or "").strip()
        return AgentInstructions(text, [_instruction_part()(content=text)] if text else [])
    raise AgentRuntimeUsageError(f"prompt returns instructions text or an AgentPrompt, not {type(prompt).__name__}")


def with_history_system(instructions: str, system: Sequence[str]) -> AgentInstructions:
    """``instructions`` followed by the history's system channel (``AgentHistoryProjection.system``): the
    text joined by blank lines, and the system lines as one more part of their own (conversation-scoped,
    so not ``dynamic``: they belong to the cacheable prefix until the next compaction changes them)."""
    base = instructions if isinstance(instructions, AgentInstructions) else agent_instructions(instructions)
    text = "\n\n".join([instructions, *system]).strip()
    if not system:
        return base if text == base else AgentInstructions(text, base.parts)
    return AgentInstructions(text, [*base.parts, _instruction_part()(content="\n\n".join(system))])


def request_instruction_parts(instructions: str) -> list[Any] | None:
    """``ModelRequestParameters.instruction_parts`` for a step: the parts :class:`AgentInstructions`
    carries, or the text (one part) that ``prepare_step`` put in its place; None for nothing."""
    if isinstance(instructions, AgentInstructions):
        return list(instructions.parts) or None
    return [_instruction_part()(content=instructions)] if instructions else None


def _count(name: str, value: int | None) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise AgentRuntimeUsageError(f"{name} is a non-negative integer token count or None, got {value!r}")
    return value


def decide_prompt_budget(
    *,
    context_window: int | None,
    reserved_output: int | None = 0,
    instructions_tokens: int | None = 0,
    tool_schema_tokens: int | None = 0,
    attachment_tokens: int | None = 0,
    provider_overhead_tokens: int | None = 0,
    history_tokens: int | None = 0,
    removable_history_tokens: int | None = None,
) -> AgentPromptBudget:
    """Decide whether a request fits ``context_window``.

    - ``unavailable`` when any component is ``None`` (even if the known ones already overflow); no
      arithmetic is done and ``available_history_tokens`` is ``None``.
    - ``oversized`` when the fixed parts alone exceed the window: ``available_history_tokens`` is
      negative, also with empty history.
    - ``fits`` when history fits what is left; exact equality fits (a zero window with zero everything
      fits, with ``available_history_tokens == 0``).
    - ``compact`` only when removing ``removable_history_tokens`` could make it fit (``None``: all of the
      history is removable); otherwise ``oversized``.
    """
    components = {
        "context_window": _count("context_window", context_window),
        "reserved_output": _count("reserved_output", reserved_output),
        "instructions_tokens": _count("instructions_tokens", instructions_tokens),
        "tool_schema_tokens": _count("tool_schema_tokens", tool_schema_tokens),
        "attachment_tokens": _count("attachment_tokens", attachment_tokens),
        "provider_overhead_tokens": _count("provider_overhead_tokens", provider_overhead_tokens),
        "history_tokens": _count("history_tokens", history_tokens),
    }
    removable = _count("removable_history_tokens", removable_history_tokens)
    missing = tuple(name for name, value in components.items() if value is None)
    if missing:
        return AgentPromptBudget("unavailable", None, history_tokens, None, removable, missing)
    window = components.pop("context_window")
    history = components.pop("history_tokens")
    assert window is not None and history is not None
    fixed = sum(v for v in components.values() if v is not None)
    if removable is None:
        removable = history
    elif removable > history:
        raise AgentRuntimeUsageError(f"removable_history_tokens ({removable}) cannot exceed history_tokens ({history})")
    available = window - fixed
    if available < 0:
        decision: ContextDecision = "oversized"
    elif history <= available:
        decision = "fits"
    elif history - removable <= available:
        decision = "compact"
    else:
        decision = "oversized"
    return AgentPromptBudget(decision, available, history, fixed, removable)


def estimate_tokens(text: str) -> int:
    """A rough token estimate (about four characters a token); its provenance is ``estimated``."""
    return (len(text) + 3) // 4


def estimate_tool_schema_tokens(tools: Iterable[Any]) -> int:
    """Estimate the tokens of tool declarations as a provider receives them: each tool's name,
    description and JSON Schema of its arguments. Accepts pydantic-ai ``ToolDefinition`` s (or anything
    with ``name``, ``description``, ``parameters_json_schema``) and mappings with those keys. The result
    is ``estimated``; a provider's own count, when it reports one, is ``measured``."""
    total = 0
    for tool in tools:
        get = tool.get if isinstance(tool, Mapping) else lambda key, t=tool: getattr(t, key, None)
        payload = {
            "name": get("name"),
            "description": get("description"),
            "parameters": get("parameters_json_schema"),
        }
        total += estimate_tokens(json.dumps(payload, sort_keys=True, default=str))
    return total


def _measure(text: str, count_tokens: TextCounter | None) -> tuple[int | None, TokenProvenance]:
    if count_tokens is None:
        return estimate_tokens(text), "estimated"
    value = count_tokens(text)
    if value is None:
        return None, "unavailable"
    return _count("count_tokens(...)", value), "measured"


class ComposedAgentPrompt:
    """Callable ``prompt(ctx) -> AgentPrompt`` rendering the contributions in order."""

    def __init__(
        self,
        contributions: Sequence[AgentPromptContribution],
        *,
        adapt_instructions: Callable[[str], Any] | None = None,
        count_tokens: TextCounter | None = None,
    ) -> None:
        self.contributions = tuple(contributions)
        self.adapt_instructions = adapt_instructions
        self.count_tokens = count_tokens

    async def __call__(self, ctx: Any, *, adapt_instructions: Callable[[str], Any] | None = None) -> AgentPrompt:
        """Render every contribution for ``ctx``. ``adapt_instructions`` here overrides the composed one.

        A render that raises propagates unchanged (the runtime ends the run ``runtime_failure``).
        """
        rendered: list[RenderedContribution] = []
        for index, c in enumerate(self.contributions):
            text = c.render(ctx)
            if inspect.isawaitable(text):
                text = await text
            if not text:
                continue
            text = str(text)
            tokens, provenance = _measure(text, self.count_tokens)
            rendered.append(
                RenderedContribution(c.name, c.stability, text, c.source or "application", index, tokens, provenance)
            )
        instructions = "\n\n".join(r.text for r in rendered)
        tokens, provenance = _measure(instructions, self.count_tokens) if instructions else (0, "measured")
        adapt = adapt_instructions or self.adapt_instructions
        adapted = None
        if adapt is not None:
            adapted = adapt(instructions)
            if inspect.isawaitable(adapted):
                adapted = await adapted
        return AgentPrompt(instructions, tuple(rendered), adapted, tokens, provenance)


def compose_agent_prompt(
    contributions: Sequence[AgentPromptContribution | Mapping[str, Any]],
    *,
    adapt_instructions: Callable[[str], Any] | None = None,
    count_tokens: TextCounter | None = None,
) -> ComposedAgentPrompt:
    """Compose ordered contributions; names must be unique, ``render`` callable and ``stability`` one of
    ``stable``, ``session``, ``dynamic``. Checked here: a bad one raises
    :class:`~threadline.errors.AgentConfigError` naming it (``contributions[1].stability``).

    ``adapt_instructions(text)`` (sync or async) makes the provider-specific system content; its result is
    ``AgentPrompt.adapted``. ``count_tokens(text)`` measures tokens for the selected model (provenance
    ``measured``; ``None`` from it is ``unavailable``); without it counts are ``estimated``. Empty
    instructions count as zero tokens, ``measured`` (nothing to send).
    """
    if isinstance(contributions, str | bytes | Mapping) or not isinstance(contributions, Sequence):
        raise AgentConfigError(
            "contributions is a list of {'name': ..., 'stability': ..., 'render': ...} "
            f"(for one fixed text, pass prompt='...' to create_agent_runtime); got {type(contributions).__name__}",
            field="contributions",
        )
    parsed: list[AgentPromptContribution] = []
    for i, c in enumerate(contributions):
        where = f"contributions[{i}]"
        if isinstance(c, Mapping):
            unknown = sorted(set(c) - _CONTRIBUTION_KEYS)
            if unknown:
                raise AgentConfigError(
                    f"{where} has unknown keys {unknown}; known: {sorted(_CONTRIBUTION_KEYS)}",
                    field=f"{where}.{unknown[0]}",
                )
            c = AgentPromptContribution(
                c.get("name", ""),
                c.get("stability", "stable"),
                c.get("render"),  # type: ignore[arg-type]
                c.get("source"),
            )
        if not isinstance(c, AgentPromptContribution):
            raise AgentConfigError(
                f"{where} is a mapping or an AgentPromptContribution, got {type(c).__name__}", field=where
            )
        if not isinstance(c.name, str) or not c.name:
            raise AgentConfigError(f"{where}.name is a non-empty str, got {c.name!r}", field=f"{where}.name")
        if not callable(c.render):
            raise AgentConfigError(
                f"{where}.render is a callable taking the prompt context and returning text "
                f"(for fixed text: lambda ctx: 'You are helpful.'), got {c.render!r}",
                field=f"{where}.render",
            )
        if c.stability not in _STABILITIES:
            raise AgentConfigError(
                f"{where}.stability is 'stable', 'session' or 'dynamic', got {c.stability!r}",
                field=f"{where}.stability",
            )
        if c.source is not None and (not isinstance(c.source, str) or not c.source):
            raise AgentConfigError(
                f"{where}.source is a non-empty string or None, got {c.source!r}", field=f"{where}.source"
            )
        parsed.append(c)
    names = [c.name for c in parsed]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise AgentConfigError(f"contribution names are unique; given more than once: {twice}", field="contributions")
    if adapt_instructions is not None and not callable(adapt_instructions):
        raise AgentConfigError(
            "adapt_instructions is None or a callable taking the instruction text", field="adapt_instructions"
        )
    if count_tokens is not None and not callable(count_tokens):
        raise AgentConfigError(
            "count_tokens is None or a callable taking a text and returning an int or None", field="count_tokens"
        )
    return ComposedAgentPrompt(parsed, adapt_instructions=adapt_instructions, count_tokens=count_tokens)
