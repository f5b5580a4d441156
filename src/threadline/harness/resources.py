"""Bounding what a loader returned, and rendering resources into the prompt."""

from __future__ import annotations

from collections.abc import Mapping
from html import escape
from typing import Any

from pydantic import ValidationError

from .contract import AgentHarnessLimits, AgentHarnessResource, AgentHarnessResourceError, AgentHarnessResourceResult


def harness_limits(value: AgentHarnessLimits | Mapping[str, Any] | None) -> AgentHarnessLimits:
    """The limits in force: the defaults, with what the application set on top."""
    if value is None:
        return AgentHarnessLimits()
    if isinstance(value, AgentHarnessLimits):
        return value
    try:
        return AgentHarnessLimits.model_validate(dict(value))
    except (ValidationError, TypeError, ValueError) as error:
        raise AgentHarnessResourceError(f"limits: {_first(error)}", field="limits") from error


def _first(error: Exception) -> str:
    if isinstance(error, ValidationError):
        first = error.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        return f"{where}: {first['msg']}" if where else first["msg"]
    return str(error)


def _count(value: Any, what: str) -> int:
    try:
        return len(value)
    except TypeError:
        raise AgentHarnessResourceError(f"the loader's {what} is not a list", field=what) from None


def validate_harness_resources(raw: Any, limits: AgentHarnessLimits) -> AgentHarnessResourceResult:
    """Check one load against ``limits`` and the records' shapes. The counts are checked before anything is
    parsed, so an oversized load costs nothing more. Raises :class:`AgentHarnessResourceError` naming the
    bound or the record."""
    if isinstance(raw, AgentHarnessResourceResult):
        resources, diagnostics = raw.resources, raw.diagnostics
    elif isinstance(raw, Mapping):
        unknown = set(raw) - {"resources", "diagnostics"}
        if unknown:
            raise AgentHarnessResourceError(
                f"the loader returned unknown keys {sorted(unknown)}; expected 'resources' and 'diagnostics'",
                field="resources",
            )
        resources, diagnostics = raw.get("resources") or (), raw.get("diagnostics") or ()
    else:
        raise AgentHarnessResourceError(
            f"a loader returns an AgentHarnessResourceResult or a mapping, not {type(raw).__name__}",
            field="resources",
        )
    if _count(resources, "resources") > limits.max_resources:
        raise AgentHarnessResourceError(
            f"the loader returned {len(resources)} resources; max_resources is {limits.max_resources}",
            field="max_resources",
        )
    if _count(diagnostics, "diagnostics") > limits.max_diagnostics:
        raise AgentHarnessResourceError(
            f"the loader returned {len(diagnostics)} diagnostics; max_diagnostics is {limits.max_diagnostics}",
            field="max_diagnostics",
        )
    if not isinstance(raw, AgentHarnessResourceResult):
        try:
            raw = AgentHarnessResourceResult(resources=tuple(resources), diagnostics=tuple(diagnostics))
        except ValidationError as error:
            raise AgentHarnessResourceError(f"invalid resource record: {_first(error)}", field="resources") from error
    names: set[str] = set()
    total = 0
    for resource in raw.resources:
        if resource.name in names:
            raise AgentHarnessResourceError(
                f"two resources are named {resource.name!r}; names are unique", field="resources"
            )
        names.add(resource.name)
        total += len(resource.text.encode("utf-8"))
        if total > limits.max_resource_bytes:
            raise AgentHarnessResourceError(
                f"the resources' text exceeds max_resource_bytes ({limits.max_resource_bytes} UTF-8 bytes)",
                field="max_resource_bytes",
            )
    return raw


def render_harness_resources(resources: tuple[AgentHarnessResource, ...]) -> str:
    """The resources as prompt text: each one in a ``<resource kind name provenance>`` element whose
    attributes are escaped, so a name cannot close the element early."""
    return "\n".join(
        f'<resource kind="{r.kind}" name="{escape(r.name)}" provenance="{escape(r.provenance)}">\n{r.text}\n</resource>'
        for r in resources
    )
