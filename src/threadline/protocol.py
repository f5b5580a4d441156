"""``define_agent_protocol``: what an application's inputs look like and what counts as a finished answer."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ValidationError

from .errors import AgentConfigError, AgentRecordValidationError
from .output import OUTPUT_RETRIES, AgentOutput, agent_output
from .records import Part

TerminalAcceptance = Literal["allow-empty", "require-output"] | Callable[..., bool]


@dataclass(frozen=True, slots=True)
class TerminalCandidate:
    """What a terminal-acceptance callback judges: the final parts, the terminal reason and policy name, and
    the validated structured output when the protocol (or the run) declares one."""

    parts: tuple[Part, ...]
    terminal_reason: str
    policy_name: str | None
    output: Any = None


def _has_output(candidate: TerminalCandidate) -> bool:
    if candidate.output is not None:  # a validated structured output is an answer, text or not
        return True
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
    output: AgentOutput | None = None
    """The structured output every run's answer is validated as (``result.output``); a run may override it."""

    def parse_context(self, raw: Any) -> Any:
        """Validate a raw context; raises :class:`AgentRecordValidationError` naming the field."""
        return _parse(self.context, raw, "context")

    def parse_input_metadata(self, raw: Any) -> Any:
        if raw is None and self.input_metadata is None:
            return None
        return _parse(self.input_metadata, raw if raw is not None else {}, "input_metadata")

    def accept_terminal(
        self, parts: Sequence[Part], terminal_reason: str, policy_name: str | None = None, output: Any = None
    ) -> bool:
        """Whether a completed run's answer is acceptable. Checked only for success, policy_stop and
        provider_stop, before the terminal commit."""
        candidate = TerminalCandidate(tuple(parts), terminal_reason, policy_name, output)
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
    output: Any = None,
    output_retries: int = OUTPUT_RETRIES,
) -> AgentProtocol:
    """Declare the context model (validated on every submit), the input-metadata model and the terminal
    acceptance rule: ``'allow-empty'`` (default), ``'require-output'`` (non-blank text, files, provider
    parts, a structured output, or a tool-only ``policy_stop``) or a callable receiving a
    :class:`TerminalCandidate`.

    ``output`` declares structured output, as pydantic-ai's ``output_type`` does (``City``,
    ``ToolOutput(City)``, ``NativeOutput(City)``, ``PromptedOutput(City)``; see :mod:`threadline.output`):
    a completed run's ``result.output`` is then the validated value. ``output_retries`` bounds the retries of
    an invalid one before the run ends ``output_rejected``. Everything is checked here
    (:class:`~threadline.errors.AgentConfigError` naming the field)."""
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
    declared = agent_output(output, retries=output_retries) if output is not None else None
    if output is None and output_retries != OUTPUT_RETRIES:
        raise AgentConfigError("output_retries needs output=...", field="output_retries")
    return AgentProtocol(
        context=context, input_metadata=input_metadata, terminal_acceptance=terminal_acceptance, output=declared
    )
