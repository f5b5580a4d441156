"""The coding tools' contract: limits with the seeds' defaults, host authorization payloads and the artifact
store protocol.

Durations are seconds (``shellTimeoutMs`` → ``shell_timeout``). Every payload the host's ``authorize``
callback receives is a plain dict whose ``operation`` names the tool's effect (the keys are listed in
:data:`AUTHORIZATION_OPERATIONS`)."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = (
    "AUTHORIZATION_OPERATIONS",
    "DEFAULT_EXCLUDED_DIRECTORIES",
    "AgentCodingArtifactSlice",
    "AgentCodingArtifactStore",
    "AgentCodingToolLimits",
)

DEFAULT_EXCLUDED_DIRECTORIES: tuple[str, ...] = (
    ".git",
    ".next",
    ".threadline",
    "build",
    "coverage",
    "dist",
    "node_modules",
    # Python's own noise (beyond the seeds' list): caches and virtual environments
    "__pycache__",
    ".venv",
    ".mypy_cache",
    ".pytest_cache",
    ".ruff_cache",
    ".tox",
)
"""Directory basenames the discovery tools skip at every depth (listed, marked ``excluded``, never hidden)."""

AUTHORIZATION_OPERATIONS: dict[str, tuple[str, ...]] = {
    "read": ("path",),
    "write": ("path", "bytes", "overwrite", "creates_directories"),
    "edit": ("path", "base_sha256", "result_sha256", "result_bytes", "replacements", "dry_run"),
    "list": ("path",),
    "glob": ("pattern", "path"),
    "search": ("query", "mode"),
    "shell": ("executable", "args", "cwd"),
    "artifact-read": ("reference", "offset", "max_bytes"),
    "artifact-search": ("reference", "query", "max_matches"),
}
"""Each operation's payload keys (besides ``operation``). ``write.creates_directories`` is the exact list of
workspace-relative directories the write would create, outermost first; ``edit`` carries the digests of the
file before and after, the result's byte size and the replacement count."""


class AgentCodingToolLimits(BaseModel):
    """Every bound of the coding tools, with the seeds' defaults. Invalid values refuse at construction."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_path_bytes: int = Field(4_096, gt=0)
    max_read_bytes: int = Field(262_144, gt=0)
    """A ``read_file`` window, and the largest file ``search_files`` reads."""
    max_write_bytes: int = Field(262_144, gt=0)
    """A ``write_file`` content, an ``edit_file`` source and result."""
    max_shell_arguments: int = Field(128, gt=0)
    max_shell_argument_bytes: int = Field(65_536, gt=0)
    max_shell_output_bytes: int = Field(262_144, gt=0)
    """Output returned inline by ``run_command`` (stdout and stderr together)."""
    max_artifact_bytes: int = Field(4_194_304, gt=0)
    """Output kept in an artifact when a store is configured; beyond it the command stops (``output-limit``)."""
    max_list_entries: int = Field(500, gt=0)
    max_search_results: int = Field(100, gt=0)
    max_search_files: int = Field(10_000, gt=0)
    max_search_depth: int = Field(32, ge=0)
    max_search_directories: int = Field(1_000, gt=0)
    """Directory-open attempts per discovery call, the base directory included."""
    max_search_entries: int = Field(20_000, gt=0)
    """Directory entries observed per discovery call."""
    max_search_bytes: int = Field(16_777_216, gt=0)
    """Aggregate content bytes ``search_files`` reads, rejected UTF-8 included."""
    max_search_output_bytes: int = Field(65_536, ge=1_024)
    """The whole serialized UTF-8 JSON result of ``list_directory``, ``glob`` and ``search_files``."""
    search_timeout: float = Field(5.0, gt=0)
    shell_timeout: float = Field(30.0, gt=0)
    """Counts from the command's start."""
    shell_termination_grace: float = Field(0.25, gt=0)
    """Bounds settlement after a timeout, cancellation, output overflow or the leader's exit."""

    @model_validator(mode="after")
    def _coherent(self) -> AgentCodingToolLimits:
        if self.max_artifact_bytes < 64:
            raise ValueError("max_artifact_bytes must leave room for the stdout/stderr headers (at least 64)")
        return self


class AgentCodingArtifactSlice(BaseModel):
    """What :meth:`AgentCodingArtifactStore.read` returns: at most the requested bytes, and the artifact's
    total size when known."""

    model_config = ConfigDict(frozen=True)

    data: bytes
    total_bytes: int | None = None


@runtime_checkable
class AgentCodingArtifactStore(Protocol):
    """Where ``run_command`` keeps output beyond its inline preview (stitchkit's ``AgentCodingArtifactStore``).

    References are opaque and never a host path. Every method may be sync or async. ``scope`` is the
    conversation id: a reference written in one conversation is absent (``None``) from another, so a refusal
    cannot tell a model it exists elsewhere. ``authorization`` is the originating tool's host payload, asked
    again before bytes are read. The in-memory and SQLite stores of :mod:`threadline.coding.artifacts`
    implement it; the ledger's spill store is another."""

    def write(self, *, scope: str, media_type: str, data: bytes, authorization: dict[str, Any] | None) -> Any:
        """Store ``data`` and return its reference (``str``)."""
        ...

    def read(self, *, scope: str, reference: str, offset: int, max_bytes: int) -> Any:
        """An :class:`AgentCodingArtifactSlice`, or ``None`` for a reference this scope does not hold."""
        ...

    def search(self, *, scope: str, reference: str, query: str, max_matches: int) -> Any:
        """Up to ``max_matches`` ``{"line": n, "text": ...}`` lines containing ``query``, or ``None``."""
        ...

    def authorization(self, *, scope: str, reference: str) -> Any:
        """The originating tool's authorization payload, or ``None``."""
        ...
