"""Conversation history: projecting canonical records onto what a model is sent."""

from .projection import (
    FAILED_MARKER as FAILED_MARKER,
    INTERRUPTED_MARKER as INTERRUPTED_MARKER,
    AgentHistoryEvidencePolicy as AgentHistoryEvidencePolicy,
    AgentHistoryProjection as AgentHistoryProjection,
    AgentHistoryProjectionError as AgentHistoryProjectionError,
    AgentHistoryProjectionOptions as AgentHistoryProjectionOptions,
    AgentProjectionDecision as AgentProjectionDecision,
    project_agent_history as project_agent_history,
    project_agent_history_detailed as project_agent_history_detailed,
)
from .prompt import (
    AgentPrompt as AgentPrompt,
    AgentPromptBudget as AgentPromptBudget,
    ComposedAgentPrompt as ComposedAgentPrompt,
    compose_agent_prompt as compose_agent_prompt,
    decide_prompt_budget as decide_prompt_budget,
    estimate_tokens as estimate_tokens,
)

__all__ = (
    "FAILED_MARKER",
    "INTERRUPTED_MARKER",
    "AgentHistoryEvidencePolicy",
    "AgentHistoryProjection",
    "AgentHistoryProjectionError",
    "AgentHistoryProjectionOptions",
    "AgentProjectionDecision",
    "AgentPrompt",
    "AgentPromptBudget",
    "ComposedAgentPrompt",
    "compose_agent_prompt",
    "decide_prompt_budget",
    "estimate_tokens",
    "project_agent_history",
    "project_agent_history_detailed",
)
