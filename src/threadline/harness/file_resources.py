"""``create_agent_harness_file_resources``: instructions, skills and resources from declared directories.

Only the roots the application declares are read: each is ``{"id", "path", "kind"}`` with an absolute
``path`` and ``kind`` ``instruction``, ``skill`` or ``resource``. Discovery walks each root with the coding
tools' descriptor-anchored traversal (:meth:`threadline.coding.workspace.Workspace.walk`): every directory
is opened relative to its parent with ``O_NOFOLLOW``, so a symlink is never followed: a root with a
symlink anywhere under it fails the load (discovery refuses symlinks), and only regular files are opened.
A resource's provenance is ``root_id:relative/path``.

- ``instruction`` files enter the prompt as they are.
- ``skill`` roots hold one directory per skill with a ``SKILL.md`` whose YAML frontmatter (parsed with
  PyYAML's ``safe_load``) names it and describes it (``name``, ``description``); only the summary enters the
  prompt. Other files in a skill root are not read.
- ``resource`` files enter as one line each (their name is their relative path).

Skills and resources are read later, exactly, through the ``read_resource`` tool (:attr:`tools`).

One loader is one immutable discovery generation: the first :meth:`AgentHarnessFileResources.load`
discovers, and every later or concurrent ``load`` — and every ``read_resource`` call — sees that same
catalog, so a read never crosses into files that changed since. Build a new loader to refresh. A discovery
that failed is not kept: the next ``load`` tries again.

Bounds (:class:`AgentHarnessFileLimits`; the seeds' defaults): 128 files, depth 8, 256 KiB per file and
1 MiB in all. A file over its bound, text that is not UTF-8, a skill without valid frontmatter, a duplicate
name, a symlink under a root or a missing root fails the load
(:class:`~threadline.harness.AgentHarnessResourceError`), and with it the run, before any provider request.
Needs ``pip install 'threadline[harness]'`` (PyYAML).
"""

from __future__ import annotations

import asyncio
import os
import re
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..errors import AgentConfigError, ThreadlineError
from ..tools import AgentTool, AppError, define_agent_tool
from .contract import (
    AgentHarnessResource,
    AgentHarnessResourceDiagnostic,
    AgentHarnessResourceError,
    AgentHarnessResourceResult,
)

SKILL_FILE = "SKILL.md"
MAX_SKILL_NAME = 128
MAX_SKILL_DESCRIPTION = 1024
_FRONTMATTER = re.compile(r"\A---[ \t]*\r?\n(.*?)\r?\n---[ \t]*(?:\r?\n|\Z)", re.DOTALL)


class AgentHarnessFileRoot(BaseModel):
    """One declared root: ``id`` (``[A-Za-z0-9][A-Za-z0-9._-]*``, used in provenance), an absolute ``path``
    and what its files are."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    id: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
    path: str = Field(min_length=1)
    kind: Literal["instruction", "skill", "resource"]


class AgentHarnessFileLimits(BaseModel):
    """Discovery bounds: files read over all roots, directory depth below a root, bytes per file, bytes in
    all."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_files: int = Field(default=128, gt=0)
    max_depth: int = Field(default=8, ge=0)
    max_file_bytes: int = Field(default=262_144, gt=0)
    max_total_bytes: int = Field(default=1_048_576, gt=0)


class ReadResourceArgs(BaseModel):
    name: str = Field(min_length=1, description="The exact name of a skill or resource listed in the instructions.")


def _yaml() -> Any:
    try:
        import yaml
    except ImportError as error:
        raise ImportError("skill frontmatter needs PyYAML: pip install 'threadline[harness]'") from error
    return yaml


def skill_metadata(text: str, provenance: str) -> tuple[str, str]:
    """A ``SKILL.md``'s ``name`` and ``description`` from its YAML frontmatter (``safe_load``: no tags, no
    objects). Raises :class:`AgentHarnessResourceError` naming the file and what is wrong."""
    match = _FRONTMATTER.match(text)
    if match is None:
        raise AgentHarnessResourceError(
            f"{provenance}: a skill starts with YAML frontmatter between '---' lines", field="frontmatter"
        )
    yaml = _yaml()
    try:
        fields = yaml.safe_load(match.group(1))
    except yaml.YAMLError as error:
        raise AgentHarnessResourceError(
            f"{provenance}: invalid YAML frontmatter: {error}", field="frontmatter"
        ) from None
    if not isinstance(fields, dict):
        raise AgentHarnessResourceError(f"{provenance}: the frontmatter is a mapping", field="frontmatter")
    found = {}
    for key, bound in (("name", MAX_SKILL_NAME), ("description", MAX_SKILL_DESCRIPTION)):
        value = fields.get(key)
        if not isinstance(value, str) or not value.strip():
            raise AgentHarnessResourceError(f"{provenance}: the frontmatter needs a text '{key}'", field=key)
        value = " ".join(value.split())
        if len(value) > bound:
            raise AgentHarnessResourceError(f"{provenance}: '{key}' is at most {bound} characters", field=key)
        found[key] = value
    return found["name"], found["description"]


def _summary(kind: str, name: str, description: str | None) -> str:
    if kind == "skill":
        return f"Skill {name}: {description}. To use it, call read_resource with name {name!r}."
    return f"Resource {name}. To read it, call read_resource with name {name!r}."


class AgentHarnessFileResources:
    """A resource loader over declared roots; pass it as the harness's ``resources`` (its :attr:`tools`,
    ``read_resource``, are offered with it). Build it with :func:`create_agent_harness_file_resources`."""

    def __init__(self, roots: Sequence[AgentHarnessFileRoot], limits: AgentHarnessFileLimits) -> None:
        self.roots = tuple(roots)
        self.limits = limits
        self._generation: asyncio.Future[AgentHarnessResourceResult] | None = None
        self._exact: dict[str, AgentHarnessResource] = {}
        self.tools: tuple[AgentTool, ...] = (self._read_resource_tool(),)

    async def load(self, request: Any = None) -> AgentHarnessResourceResult:
        """The catalog of this generation: discovered on the first call, shared by every later or concurrent
        one. ``request`` (the harness's per-run request) is not used: one generation serves every run.
        Raises :class:`AgentHarnessResourceError`; a failed discovery is tried again by the next call."""
        generation = self._generation
        if generation is None or (generation.done() and generation.exception() is not None):
            generation = self._generation = asyncio.ensure_future(self._discover())
        return await asyncio.shield(generation)

    async def read(self, name: str) -> AgentHarnessResource:
        """One discovered resource, exactly (what ``read_resource`` returns). Raises :class:`KeyError`."""
        await self.load()
        return self._exact[name]

    async def _discover(self) -> AgentHarnessResourceResult:
        from ..coding.workspace import WalkLimits, WalkStats, Workspace, WorkspaceError

        exact: dict[str, AgentHarnessResource] = {}
        projected: list[AgentHarnessResource] = []
        diagnostics: list[AgentHarnessResourceDiagnostic] = []
        files = total = 0
        for root in self.roots:
            try:
                workspace = Workspace(root.path)
            except AgentConfigError as error:
                raise AgentHarnessResourceError(f"root {root.id!r}: {error}", field="roots") from None
            stats = WalkStats()
            limits = WalkLimits(
                max_files=self.limits.max_files - files + 1,  # one more, to tell "at the bound" from "beyond"
                max_depth=self.limits.max_depth,
                max_directories=self.limits.max_files * 8,
            )
            include = (lambda relative: relative.rsplit("/", 1)[-1] == SKILL_FILE) if root.kind == "skill" else None
            try:
                async for entry in workspace.walk((), limits=limits, stats=stats, include=include):
                    files += 1
                    provenance = f"{root.id}:{entry.path}"
                    if files > self.limits.max_files:
                        raise AgentHarnessResourceError(
                            f"{provenance}: more than max_files ({self.limits.max_files}) files under the roots",
                            field="max_files",
                        )
                    with entry.open() as opened:
                        if opened.size > self.limits.max_file_bytes:
                            raise AgentHarnessResourceError(
                                f"{provenance}: {opened.size} bytes; max_file_bytes is {self.limits.max_file_bytes}",
                                field="max_file_bytes",
                            )
                        data = opened.read(0, self.limits.max_file_bytes + 1)
                    if len(data) > self.limits.max_file_bytes:
                        raise AgentHarnessResourceError(
                            f"{provenance}: grew past max_file_bytes while read", field="max_file_bytes"
                        )
                    total += len(data)
                    if total > self.limits.max_total_bytes:
                        raise AgentHarnessResourceError(
                            f"the files exceed max_total_bytes ({self.limits.max_total_bytes})", field="max_total_bytes"
                        )
                    try:
                        text = data.decode("utf-8")
                    except UnicodeDecodeError:
                        raise AgentHarnessResourceError(f"{provenance}: not UTF-8 text", field="encoding") from None
                    description = None
                    if root.kind == "skill":
                        name, description = skill_metadata(text, provenance)
                    else:
                        name = entry.path
                    if name in exact:
                        raise AgentHarnessResourceError(
                            f"{provenance}: the name {name!r} is already {exact[name].provenance}", field="name"
                        )
                    resource = AgentHarnessResource(kind=root.kind, name=name, text=text, provenance=provenance)
                    exact[name] = resource
                    if root.kind == "instruction":
                        projected.append(resource)
                    else:
                        projected.append(resource.model_copy(update={"text": _summary(root.kind, name, description)}))
            except WorkspaceError as error:
                raise AgentHarnessResourceError(f"root {root.id!r}: {error}", field="roots") from None
            if stats.skipped_symlinks:
                # a symlink could lead out of the declared root: discovery refuses the root rather than
                # leaving out what the deployer may believe is loaded
                raise AgentHarnessResourceError(
                    f"root {root.id!r}: discovery refuses symlinks; {stats.skipped_symlinks} found under the root "
                    "(replace them with the files or directories themselves)",
                    field="symlink",
                )
            for reason in stats.reasons:
                if reason != "max-search-files":
                    diagnostics.append(
                        AgentHarnessResourceDiagnostic(
                            resource=root.id, severity="warning", message=f"discovery stopped early: {reason}"
                        )
                    )
        self._exact = exact
        return AgentHarnessResourceResult(resources=tuple(projected), diagnostics=tuple(diagnostics))

    def _read_resource_tool(self) -> AgentTool:
        loader = self

        async def read_resource(name: str) -> dict[str, Any]:
            try:
                resource = await loader.read(name)
            except KeyError:
                raise AppError(
                    "NOT_FOUND",
                    f"no skill or resource is named {name!r}",
                    hint="use a name exactly as the instructions list it",
                ) from None
            except ThreadlineError as error:
                raise AppError("UNAVAILABLE", "the resources could not be read", hint=str(error)) from None
            return resource.model_dump()

        return define_agent_tool(
            read_resource,
            args=ReadResourceArgs,
            description="Read one skill or resource listed in the instructions, by its exact name: its full text "
            "and where it came from.",
        )


def create_agent_harness_file_resources(
    *,
    roots: Sequence[AgentHarnessFileRoot | Mapping[str, Any]],
    limits: AgentHarnessFileLimits | Mapping[str, Any] | None = None,
) -> AgentHarnessFileResources:
    """A loader over ``roots`` (see :mod:`threadline.harness.file_resources`). Refuses, naming the field: no
    root, a malformed or duplicate ``id``, a relative ``path``, an unknown ``kind`` or limit. The roots are
    read on the first ``load``, not now."""
    if isinstance(roots, str | bytes) or not isinstance(roots, Sequence) or not roots:
        raise AgentConfigError("roots is a non-empty list of {'id', 'path', 'kind'}", field="roots")
    parsed: list[AgentHarnessFileRoot] = []
    for index, raw in enumerate(roots):
        try:
            root = raw if isinstance(raw, AgentHarnessFileRoot) else AgentHarnessFileRoot.model_validate(dict(raw))
        except (ValidationError, TypeError, ValueError) as error:
            detail = error.errors()[0] if isinstance(error, ValidationError) else None
            where = f"roots[{index}]" + (f".{detail['loc'][0]}" if detail and detail["loc"] else "")
            raise AgentConfigError(f"{where}: {detail['msg'] if detail else error}", field=where) from None
        if not os.path.isabs(root.path):
            raise AgentConfigError(
                f"roots[{index}].path is an absolute path, got {root.path!r}", field=f"roots[{index}].path"
            )
        if any(p.id == root.id for p in parsed):
            raise AgentConfigError(f"roots[{index}].id {root.id!r} is declared twice", field=f"roots[{index}].id")
        parsed.append(root)
    if limits is None:
        bounds = AgentHarnessFileLimits()
    elif isinstance(limits, AgentHarnessFileLimits):
        bounds = limits
    else:
        try:
            bounds = AgentHarnessFileLimits.model_validate(dict(limits))
        except ValidationError as error:
            first = error.errors()[0]
            where = f"limits.{first['loc'][0]}" if first["loc"] else "limits"
            raise AgentConfigError(f"{where}: {first['msg']}", field=where) from None
    return AgentHarnessFileResources(parsed, bounds)
