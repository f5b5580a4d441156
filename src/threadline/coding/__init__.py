"""Coding tools: contained files, discovery and search, bounded commands and output artifacts.

``create_agent_coding_tools(root=..., authorize=...)`` returns ordinary runtime tools (``read_file``,
``write_file``, ``edit_file``, ``list_directory``, ``glob``, ``search_files``, ``run_command``,
``read_output``, ``search_output``) built with :func:`threadline.define_agent_tool`. The descriptor-anchored
traversal underneath is :mod:`threadline.coding.workspace` (also used by the harness's file resources).

Names load on first use (PEP 562). Search needs the ``coding`` extra (``google-re2``): reading
``create_agent_coding_tools`` without it raises ImportError naming ``pip install 'threadline[coding]'``;
:mod:`threadline.coding.workspace` needs nothing beyond the standard library.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .artifacts import (
        create_memory_agent_coding_artifact_store as create_memory_agent_coding_artifact_store,
        create_sqlite_agent_coding_artifact_store as create_sqlite_agent_coding_artifact_store,
    )
    from .contract import (
        AUTHORIZATION_OPERATIONS as AUTHORIZATION_OPERATIONS,
        DEFAULT_EXCLUDED_DIRECTORIES as DEFAULT_EXCLUDED_DIRECTORIES,
        AgentCodingArtifactSlice as AgentCodingArtifactSlice,
        AgentCodingArtifactStore as AgentCodingArtifactStore,
        AgentCodingToolLimits as AgentCodingToolLimits,
    )
    from .sandbox import AgentSandboxUnavailableError as AgentSandboxUnavailableError
    from .tools import (
        AGENT_CODING_TOOL_NAMES as AGENT_CODING_TOOL_NAMES,
        create_agent_coding_tools as create_agent_coding_tools,
    )
    from .workspace import (
        AgentCodingPlatformError as AgentCodingPlatformError,
        WalkEntry as WalkEntry,
        WalkLimits as WalkLimits,
        WalkStats as WalkStats,
        Workspace as Workspace,
        WorkspaceBackslashError as WorkspaceBackslashError,
        WorkspaceChangedError as WorkspaceChangedError,
        WorkspaceError as WorkspaceError,
        WorkspaceExistsError as WorkspaceExistsError,
        WorkspaceFile as WorkspaceFile,
        WorkspaceForbiddenError as WorkspaceForbiddenError,
        WorkspaceNotDirectoryError as WorkspaceNotDirectoryError,
        WorkspaceNotFoundError as WorkspaceNotFoundError,
        WorkspaceNotRegularFileError as WorkspaceNotRegularFileError,
        WorkspacePathError as WorkspacePathError,
        WorkspaceSymlinkError as WorkspaceSymlinkError,
        WorkspaceUnavailableError as WorkspaceUnavailableError,
    )

_EXPORTS: dict[str, str] = {
    "create_memory_agent_coding_artifact_store": ".artifacts",
    "create_sqlite_agent_coding_artifact_store": ".artifacts",
    "AUTHORIZATION_OPERATIONS": ".contract",
    "DEFAULT_EXCLUDED_DIRECTORIES": ".contract",
    "AgentCodingArtifactSlice": ".contract",
    "AgentCodingArtifactStore": ".contract",
    "AgentCodingToolLimits": ".contract",
    "AgentSandboxUnavailableError": ".sandbox",
    "AGENT_CODING_TOOL_NAMES": ".tools",
    "create_agent_coding_tools": ".tools",
    "AgentCodingPlatformError": ".workspace",
    "WalkEntry": ".workspace",
    "WalkLimits": ".workspace",
    "WalkStats": ".workspace",
    "Workspace": ".workspace",
    "WorkspaceChangedError": ".workspace",
    "WorkspaceError": ".workspace",
    "WorkspaceExistsError": ".workspace",
    "WorkspaceFile": ".workspace",
    "WorkspaceForbiddenError": ".workspace",
    "WorkspaceNotDirectoryError": ".workspace",
    "WorkspaceNotFoundError": ".workspace",
    "WorkspaceNotRegularFileError": ".workspace",
    "WorkspaceBackslashError": ".workspace",
    "WorkspacePathError": ".workspace",
    "WorkspaceSymlinkError": ".workspace",
    "WorkspaceUnavailableError": ".workspace",
}

__all__ = tuple(sorted(_EXPORTS))


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'threadline.coding' has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
