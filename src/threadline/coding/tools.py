"""``create_agent_coding_tools``: the coding tool set for one workspace root."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Literal

from ..errors import AgentConfigError
from ..tools import AgentTool
from .contract import DEFAULT_EXCLUDED_DIRECTORIES, AgentCodingArtifactStore, AgentCodingToolLimits
from .policy import CodingConfig
from .workspace import Workspace

__all__ = ("AGENT_CODING_TOOL_NAMES", "create_agent_coding_tools")

AGENT_CODING_TOOL_NAMES: dict[str, str] = {
    "edit_file": "edit_file",
    "glob": "glob",
    "list_directory": "list_directory",
    "read_file": "read_file",
    "read_output": "read_output",
    "run_command": "run_command",
    "search_files": "search_files",
    "search_output": "search_output",
    "write_file": "write_file",
}


def create_agent_coding_tools(
    *,
    root: str | os.PathLike[str],
    authorize: Callable[[dict[str, Any]], Any],
    authorize_path: Callable[[dict[str, Any]], Any] | None = None,
    executables: Mapping[str, str] | None = None,
    environment: Mapping[str, str] | None = None,
    artifacts: AgentCodingArtifactStore | None = None,
    limits: AgentCodingToolLimits | Mapping[str, Any] | None = None,
    exclude_directories: Iterable[str] | None = None,
    sandbox: Literal["bubblewrap"] | None = None,
) -> list[AgentTool]:
    """The coding tools for one workspace ``root`` (absolute), as ordinary runtime tools.

    Returns ``read_file``, ``write_file``, ``edit_file``, ``list_directory``, ``glob``, ``search_files``;
    ``run_command`` when ``executables`` maps at least one alias to an absolute executable; ``read_output``
    and ``search_output`` when an ``artifacts`` store is given. Pass them to ``create_agent_runtime(tools=...)``:
    they go through the same fence, error envelope and approval rules as any tool.

    ``authorize(payload)`` (sync or async, required) is asked before every effect with the operation's
    payload (:data:`~threadline.coding.contract.AUTHORIZATION_OPERATIONS`); a falsy answer refuses
    ``FORBIDDEN``. ``authorize_path({"path": ...})`` is the optional operation-independent path policy:
    direct access asks it about every segment, outermost first; discovery omits (and names in ``denied``)
    what it refuses. ``environment`` is the whole environment of a command (empty by default).
    ``exclude_directories`` replaces :data:`~threadline.coding.contract.DEFAULT_EXCLUDED_DIRECTORIES`.
    ``sandbox="bubblewrap"`` runs commands under ``bwrap`` (see :mod:`threadline.coding.sandbox`); where it
    cannot run, construction raises :class:`~threadline.coding.sandbox.AgentSandboxUnavailableError`
    (``SANDBOX_UNAVAILABLE``) — there is no silent fallback.

    The root is a path boundary for the file tools, not a security sandbox for commands: an executable
    can reach whatever its process can, unless ``sandbox`` isolates it.

    ``list_directory``, ``glob`` and ``search_files`` bound the host's async decisions by
    ``limits.search_timeout`` (a pending answer is cancelled: ``TIMEOUT`` or coverage reason ``timeout``); a
    sync callback cannot be interrupted. ``run_command`` called when its run is already aborted (a pending
    cancellation of the calling task) returns ``outcome: "cancelled"`` without spawning.

    Raises :class:`~threadline.errors.AgentConfigError` (naming the field) for an invalid argument,
    :class:`~threadline.coding.workspace.AgentCodingPlatformError` (``SERVICE_UNAVAILABLE``) on a platform
    without descriptor-anchored file access (not Linux, no ``/proc/self/fd``, a missing open flag) — there is
    no fallback — and ImportError naming ``pip install 'threadline[coding]'`` without google-re2.
    """
    from .discovery import create_discovery_tools
    from .files import create_file_tools
    from .search import create_search_tools

    if not callable(authorize):
        raise AgentConfigError("authorize must be a callable (sync or async) returning a bool", field="authorize")
    if authorize_path is not None and not callable(authorize_path):
        raise AgentConfigError("authorize_path must be a callable or None", field="authorize_path")
    workspace = Workspace(root)
    if limits is None:
        resolved = AgentCodingToolLimits()
    elif isinstance(limits, AgentCodingToolLimits):
        resolved = limits
    else:
        try:
            resolved = AgentCodingToolLimits.model_validate(dict(limits))
        except ValueError as error:
            raise AgentConfigError(f"invalid coding tool limits: {error}", field="limits") from error
    aliases = dict(executables or {})
    for alias, path in aliases.items():
        if not isinstance(alias, str) or not alias or not isinstance(path, str) or not os.path.isabs(path):
            raise AgentConfigError(
                f"executables must map a non-empty alias to an absolute path, got {alias!r}: {path!r}",
                field="executables",
            )
    env = dict(environment or {})
    for key, value in env.items():
        if not isinstance(key, str) or not isinstance(value, str) or "=" in key or "\x00" in key + value:
            raise AgentConfigError(f"invalid environment entry {key!r}", field="environment")
    if sandbox not in (None, "bubblewrap"):
        raise AgentConfigError(f"unknown sandbox {sandbox!r}; the one launcher is 'bubblewrap'", field="sandbox")
    excluded = frozenset(DEFAULT_EXCLUDED_DIRECTORIES if exclude_directories is None else exclude_directories)
    config = CodingConfig(
        workspace=workspace,
        authorize=authorize,
        authorize_path=authorize_path,
        limits=resolved,
        excluded=excluded,
        executables=aliases,
        environment=env,
        artifacts=artifacts,
    )
    tools = [*create_file_tools(config), *create_discovery_tools(config), *create_search_tools(config)]
    if aliases:
        from .commands import create_command_tools

        if sandbox == "bubblewrap":
            from .sandbox import create_bubblewrap_launcher

            config.launcher = create_bubblewrap_launcher(workspace, aliases)
        tools.extend(create_command_tools(config))
    elif sandbox is not None:
        raise AgentConfigError("a sandbox needs executables to run", field="sandbox")
    if artifacts is not None:
        from .artifacts import create_artifact_tools

        tools.extend(create_artifact_tools(config))
    return tools
