"""``compose_agent_prompt``: ordered instruction contributions and the context-window budget.

A contribution is ``{"name", "stability", "render"}``; ``render(ctx)`` returns text (or None to skip)
and receives the run's prompt context (parsed ``context``, ``conversation_id``, ``run``, ``snapshot``).
The composed instructions reach the model through ``instruction_parts`` on every request.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from ..errors import AgentRuntimeUsageError

Stability = Literal["stable", "session", "dynamic"]
ContextDecision = Literal["fits", "compact", "oversized", "unavailable"]


@dataclass(frozen=True, slots=True)
class AgentPromptContribution:
    name: str
    stability: Stability
    render: Callable[[Any], str | Awaitable[str | None] | None]


@dataclass(frozen=True, slots=True)
class RenderedContribution:
    """One contribution as rendered for a request, with where it came from."""

    name: str
    stability: Stability
    text: str


@dataclass(frozen=True, slots=True)
class AgentPrompt:
    instructions: str
    contributions: tuple[RenderedContribution, ...]


@dataclass(frozen=True, slots=True)
class AgentPromptBudget:
    """A pre-request decision. ``available_history_tokens`` stays signed: negative means even an empty
    history cannot fit. ``None`` counts make the decision ``unavailable``."""

    decision: ContextDecision
    available_history_tokens: int | None
    history_tokens: int | None


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
    """``fits`` when everything fits (exact equality fits); ``compact`` only when removing the removable
    history could make it fit; ``oversized`` otherwise (also when the fixed parts alone overflow, with a
    negative ``available_history_tokens``); ``unavailable`` when any component is unknown."""
    fixed = (reserved_output, instructions_tokens, tool_schema_tokens, attachment_tokens, provider_overhead_tokens)
    if context_window is None or history_tokens is None or any(v is None for v in fixed):
        return AgentPromptBudget("unavailable", None, history_tokens)
    available = context_window - sum(v for v in fixed if v is not None)
    if available < 0:
        return AgentPromptBudget("oversized", available, history_tokens)
    if history_tokens <= available:
        return AgentPromptBudget("fits", available, history_tokens)
    removable = history_tokens if removable_history_tokens is None else removable_history_tokens
    if history_tokens - removable <= available:
        return AgentPromptBudget("compact", available, history_tokens)
    return AgentPromptBudget("oversized", available, history_tokens)


def estimate_tokens(text: str) -> int:
    """A rough token estimate (about four characters a token); its provenance is ``estimated``."""
    return (len(text) + 3) // 4


class ComposedAgentPrompt:
    """Callable ``prompt(ctx) -> AgentPrompt`` rendering the contributions in order."""

    def __init__(self, contributions: Sequence[AgentPromptContribution]) -> None:
        self.contributions = tuple(contributions)

    async def __call__(self, ctx: Any) -> AgentPrompt:
        rendered = []
        for c in self.contributions:
            text = c.render(ctx)
            if inspect.isawaitable(text):
                text = await text
            if text:
                rendered.append(RenderedContribution(c.name, c.stability, str(text)))
        return AgentPrompt("\n\n".join(r.text for r in rendered), tuple(rendered))


def compose_agent_prompt(
    contributions: Sequence[AgentPromptContribution | Mapping[str, Any]],
) -> ComposedAgentPrompt:
    """Compose ordered contributions; names must be unique and ``render`` callable."""
    parsed: list[AgentPromptContribution] = []
    for i, c in enumerate(contributions):
        if isinstance(c, Mapping):
            unknown = set(c) - {"name", "stability", "render"}
            if unknown:
                raise AgentRuntimeUsageError(f"contributions[{i}] has unknown keys {sorted(unknown)}")
            c = AgentPromptContribution(c.get("name", ""), c.get("stability", "stable"), c.get("render"))  # type: ignore[arg-type]
        if not c.name or not callable(c.render):
            raise AgentRuntimeUsageError(f"contributions[{i}] needs a name and a callable render")
        if c.stability not in ("stable", "session", "dynamic"):
            raise AgentRuntimeUsageError(f"contributions[{i}].stability is 'stable', 'session' or 'dynamic'")
        parsed.append(c)
    names = [c.name for c in parsed]
    if len(set(names)) != len(names):
        raise AgentRuntimeUsageError(f"contribution names are unique: {names}")
    return ComposedAgentPrompt(parsed)
