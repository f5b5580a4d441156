"""The records a headless harness and its resource loaders exchange.

A loader (:func:`~threadline.harness.create_agent_harness_file_resources`, or any object with a ``load``
method) returns an :class:`AgentHarnessResourceResult`: resources (``instruction``, ``skill`` or
``resource``, each with a unique ``name``, its ``text`` and where it came from, ``provenance``) and
diagnostics, evidence the loader wants the application to see. The harness bounds both with
:class:`AgentHarnessLimits` and reports what a run was given in one :class:`AgentHarnessProfileEvent` —
never resource text, prompts, tool arguments or credentials.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from ..errors import AgentRuntimeUsageError

if TYPE_CHECKING:
    from ..models import AgentModelDescriptor
    from ..records import Run

AgentHarnessResourceKind = Literal["instruction", "skill", "resource"]
"""``instruction`` enters the prompt as it is; ``skill`` and ``resource`` enter as one-line summaries and are
read on demand through the ``read_resource`` tool."""

DEFAULT_MAX_RESOURCES = 64
DEFAULT_MAX_RESOURCE_BYTES = 1_048_576
DEFAULT_MAX_DIAGNOSTICS = 128


class _Record(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class AgentHarnessResource(_Record):
    """One loaded resource. ``provenance`` says where it came from (``root_id:relative/path`` for files)."""

    kind: AgentHarnessResourceKind
    name: str = Field(min_length=1)
    text: str
    provenance: str = Field(min_length=1)


class AgentHarnessResourceDiagnostic(_Record):
    """Something a loader noticed about a resource. Evidence only: the loader decides what is fatal (it
    raises); the harness passes diagnostics to ``on_diagnostics`` and into the profile."""

    resource: str = Field(min_length=1)
    severity: Literal["warning", "error"]
    message: str = Field(min_length=1)


class AgentHarnessLimits(_Record):
    """Bounds on what one load may hand a run: resource count, their text's UTF-8 bytes together, and
    diagnostics."""

    max_resources: int = Field(default=DEFAULT_MAX_RESOURCES, gt=0)
    max_resource_bytes: int = Field(default=DEFAULT_MAX_RESOURCE_BYTES, gt=0)
    max_diagnostics: int = Field(default=DEFAULT_MAX_DIAGNOSTICS, ge=0)


class AgentHarnessResourceResult(_Record):
    """What a loader returns."""

    resources: tuple[AgentHarnessResource, ...] = ()
    diagnostics: tuple[AgentHarnessResourceDiagnostic, ...] = ()


class AgentHarnessAppliedResource(_Record):
    """A resource as the profile reports it: kind, name and provenance, never its text."""

    kind: AgentHarnessResourceKind
    name: str
    provenance: str


class AgentHarnessModelSummary(_Record):
    """The model a run actually used, as the profile reports it (no credentials, no client objects)."""

    name: str
    """The registry name the application resolved."""
    provider: str | None = None
    """pydantic-ai's provider system (``openai``, ``anthropic``, ``function`` …)."""
    model_name: str | None = None
    """The provider's model name."""
    context_window: int | None = None
    capabilities: tuple[str, ...] = ()


class AgentHarnessProfileEvent(_Record):
    """``profile-applied``: the profile one run was given — its model, its resources (kind, name,
    provenance), the loader's diagnostics and the sorted names of its tools. It carries no resource text,
    prompt, argument or credential."""

    schema_version: Literal[1] = 1
    type: Literal["profile-applied"] = "profile-applied"
    conversation_id: str = Field(min_length=1)
    run_id: str = Field(min_length=1)
    model: AgentHarnessModelSummary
    resources: tuple[AgentHarnessAppliedResource, ...] = ()
    diagnostics: tuple[AgentHarnessResourceDiagnostic, ...] = ()
    tool_names: tuple[str, ...] = ()


@dataclass(frozen=True)
class AgentHarnessResourceRequest:
    """What a loader's ``load`` receives for one run."""

    context: Any
    """The run's parsed context."""
    conversation_id: str
    run: Run
    model: AgentModelDescriptor
    """The model this run resolved (a loader may choose resources per model)."""


class AgentHarnessResourceError(AgentRuntimeUsageError):
    """A loader returned something the harness refuses (too many resources or diagnostics, too many bytes,
    a duplicate name, a malformed record) or a file resource could not be discovered. Raised before any
    provider request: the run ends ``runtime_failure`` and nothing is sent. ``field`` names the bound or
    record at fault."""

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field
