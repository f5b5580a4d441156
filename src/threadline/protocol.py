"""``define_agent_protocol``: what an application's inputs look like and what counts as a finished answer."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ValidationError

from .errors import AgentConfigError, AgentRecordValidationError
from .records import Part

TerminalAcceptance = Literal["allow-empty", "require-output"] | Callable[..., bool]


@dataclass(frozen=True, slots=True)
class TerminalCandidate:
    """What a terminal-acceptance callback judges: the final parts, the terminal reason and policy name."""

    parts: tuple[Part, ...]
    terminal_reason: str
    policy_name: str | None


def _has_output(candidate: TerminalCandidate) -> bool:
    for part in candidate.parts:
        if part.type == "text" and part.text.strip():
            return True
        if part.type in ("file", "provider", "approval-request"):
            return True
    # a named tool-only policy stop is a deliberate answer
    return candidate.terminal_reason == "policy_stop" and any(p.type == "tool-call" for p in candidate.parts)


def _parse(model: type[BaseModel] | None, raw: Any, field: str) -> Any:
    if model is None:
        return raw
    if isinstance(raw, model):
        return raw
    try:
        return model.model_validate(raw)
    except ValidationError as error:
        first = error.errors()[0]
        where = ".".join(str(p) for p in (field, *first["loc"]))
        raise AgentRecordValidationError(f"{where}: {first['msg']}", field=where) from error


@dataclass(frozen=True)
class AgentProtocol:
    """The application's contract with the runtime. Build it with :func:`define_agent_protocol`."""

    context: type[BaseModel] | None = None
    input_metadata: type[BaseModel] | None = None
    terminal_acceptance: TerminalAcceptance = "allow-empty"

    def parse_context(self, raw: Any) -> Any:
        """Validate a raw context; raises :class:`AgentRecordValidationError` naming the field."""
        return _parse(self.context, raw, "context")

    def parse_input_metadata(self, raw: Any) -> Any:
        if raw is None and self.input_metadata is None:
            return None
        return _parse(self.input_metadata, raw if raw is not None else {}, "input_metadata")

    def accept_terminal(self, parts: Sequence[Part], terminal_reason: str, policy_name: str | None = None) -> bool:
        """Whether a completed run's answer is acceptable. Checked only for success, policy_stop and
        provider_stop, before the terminal commit."""
        candidate = TerminalCandidate(tuple(parts), terminal_reason, policy_name)
        rule = self.terminal_acceptance
        if rule == "allow-empty":
            return True
        if rule == "require-output":
            return _has_output(candidate)
        return bool(rule(candidate))


def define_agent_protocol(
    *,
    context: type[BaseModel] | None = None,
    input_metadata: type[BaseModel] | None = None,
    terminal_acceptance: TerminalAcceptance = "allow-empty",
) -> AgentProtocol:
    """Declare the context model (validated on every submit), the input-metadata model and the terminal
    acceptance rule: ``'allow-empty'`` (default), ``'require-output'`` (non-blank text, files, provider
    parts, or a tool-only ``policy_stop``) or a callable receiving a :class:`TerminalCandidate`."""
    for name, value in (("context", context), ("input_metadata", input_metadata)):
        if value is not None and not (isinstance(value, type) and issubclass(value, BaseModel)):
            hint = " (the class, not an instance)" if isinstance(value, BaseModel) else ""
            raise AgentConfigError(f"{name} is None or a pydantic model class{hint}, got {value!r}", field=name)
    if terminal_acceptance not in ("allow-empty", "require-output") and not callable(terminal_acceptance):
        raise AgentConfigError(
            f"terminal_acceptance is 'allow-empty', 'require-output' or a callable taking a TerminalCandidate, "
            f"got {terminal_acceptance!r}",
            field="terminal_acceptance",
        )
    return AgentProtocol(context=context, input_metadata=input_metadata, terminal_acceptance=terminal_acceptance)
