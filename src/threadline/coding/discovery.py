"""``list_directory`` and ``glob``, and the coverage report and output budget they share with search.

Discovery never follows a symlink and never hides what it skipped: excluded directories are listed and
marked (``excluded: true``), entries the host's path policy refuses are named in ``denied`` (bounded, with
``denied_truncated``), skipped symlinks are counted, and ``coverage.complete`` / ``coverage.reasons`` tell a
full empty result from partial work. Reasons: ``denied``, ``unreadable``, ``max-list-entries``,
``max-search-files``, ``max-search-depth``, ``max-search-directories``, ``max-search-entries``,
``max-search-results``, ``max-search-bytes``, ``max-search-output-bytes``, ``max-read-bytes``,
``invalid-utf8``, ``binary``, ``timeout``.

``search_timeout`` counts from the call's start and bounds the host's decisions too: an async ``authorize``
or ``authorize_path`` answer still pending at the deadline is cancelled — ``TIMEOUT`` (504) before anything
was visited, reason ``timeout`` once the walk or listing had begun. Cancelling the call cancels a pending
answer the same way. A sync callback cannot be interrupted; the deadline is observed when it returns.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from ..tools import AgentTool, define_agent_tool
from .globs import GlobPattern, compile_glob
from .policy import (
    CodingConfig,
    authorize,
    authorize_path_chain,
    path_admitted,
    path_decision,
    refuse,
    workspace_refusals,
)
from .workspace import (
    HostDecisionTimeout,
    WalkLimits,
    WalkStats,
    WorkspaceError,
    WorkspacePathError,
    join_segments,
    scan_directory,
)


def json_size(value: Any) -> int:
    """Bytes of ``value`` serialized as compact UTF-8 JSON."""
    return len(json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode())


COVERAGE_REASONS: tuple[str, ...] = (
    "denied",
    "unreadable",
    "binary",
    "invalid-utf8",
    "max-read-bytes",
    "max-list-entries",
    "max-search-files",
    "max-search-depth",
    "max-search-directories",
    "max-search-entries",
    "max-search-bytes",
    "max-search-results",
    "max-search-output-bytes",
    "timeout",
)
"""Every reason ``coverage.reasons`` can name."""

_WIDEST_COUNTER = 10**12  # wider than any counter or elapsed time a call can reach


def widest_envelope(envelope: dict[str, Any]) -> dict[str, Any]:
    """``envelope`` (an empty result) at its largest fixed size: every coverage reason, the widest counters,
    every flag true and both diagnostics present but shortened to nothing. What a result costs beyond its
    items and diagnostic entries is never more than this."""
    widest = dict(envelope)
    report = dict(widest["coverage"])
    report["complete"] = False
    report["reasons"] = list(COVERAGE_REASONS)
    for key in ("directories", "entries", "elapsed_ms", "bytes"):
        if key in report:
            report[key] = _WIDEST_COUNTER
    widest["coverage"] = report
    for key in ("scanned_files", "skipped_directories", "skipped_symlinks"):
        if key in widest:
            widest[key] = _WIDEST_COUNTER
    for key in ("truncated", "result_truncated"):
        if key in widest:
            widest[key] = True
    widest.update(denied=[], denied_truncated=True, errors=[], errors_truncated=True)
    return widest


class OutputBudget:
    """The serialized-output ceiling of one discovery result (``max_search_output_bytes``, the whole UTF-8
    JSON). The fixed part is measured once at its widest (:func:`widest_envelope`); items, then diagnostic
    entries, are admitted one at a time while they fit, so the result never exceeds the ceiling.
    ``fits`` is false when even the smallest result would not: the call refuses before any filesystem
    access."""

    def __init__(self, max_bytes: int, envelope: dict[str, Any]) -> None:
        self.remaining = max_bytes - json_size(widest_envelope(envelope))
        self.fits = self.remaining >= 0
        self.exhausted = False

    def take(self, item: Any) -> bool:
        cost = json_size(item) + 1
        if self.exhausted or cost > self.remaining:
            self.exhausted = True
            return False
        self.remaining -= cost
        return True

    def take_diagnostic(self, item: Any) -> bool:
        """Admit one ``denied`` / ``errors`` entry (after the items, so never at their expense)."""
        if self.remaining < 0:  # linear: once one entry did not fit, the rest are not measured
            return False
        cost = json_size(item) + 1
        if cost > self.remaining:
            self.remaining = -1
            return False
        self.remaining -= cost
        return True


def _identity_of(fd: int) -> tuple[int, int]:
    st = os.fstat(fd)
    return (st.st_dev, st.st_ino)


def walk_limits(config: CodingConfig, started: float) -> WalkLimits:
    limits = config.limits
    return WalkLimits(
        max_files=limits.max_search_files,
        max_depth=limits.max_search_depth,
        max_directories=limits.max_search_directories,
        max_entries=limits.max_search_entries,
        deadline=started + limits.search_timeout,
    )


def new_stats(config: CodingConfig) -> WalkStats:
    cap = config.limits.max_search_results
    return WalkStats(max_denied=cap, max_errors=cap)


def coverage(
    stats: WalkStats, *, started: float, scope: dict[str, Any], content_bytes: int | None = None
) -> dict[str, Any]:
    report: dict[str, Any] = {
        "complete": not stats.reasons,
        "reasons": list(stats.reasons),
        "scope": scope,
        "directories": stats.directories,
        "entries": stats.entries,
        "elapsed_ms": round((time.monotonic() - started) * 1000),
    }
    if content_bytes is not None:
        report["bytes"] = content_bytes
    return report


def observe_deadline(stats: WalkStats, deadline: float) -> None:
    """Checked once more as the result is assembled, so a call that ends past its deadline (a sync host
    callback that returned late, an empty directory with nothing left to check between) says ``timeout``
    even when nothing was cut."""
    if time.monotonic() > deadline:
        stats.reason("timeout")


def diagnostics(stats: WalkStats, budget: OutputBudget) -> dict[str, Any]:
    """``denied`` / ``errors`` (workspace-relative path, kind or operation and a safe code) when any, each
    entry admitted within what the output budget has left; ``denied_truncated`` / ``errors_truncated`` say
    when the list is shorter than what was found (its own bound, or the output ceiling)."""
    out: dict[str, Any] = {}
    if stats.denied_count:
        denied = [item for item in stats.denied if budget.take_diagnostic(item)]
        out["denied"] = denied
        out["denied_truncated"] = stats.denied_count > len(denied)
    if stats.errors_count:
        errors = [item for item in stats.errors if budget.take_diagnostic(item)]
        out["errors"] = errors
        out["errors_truncated"] = stats.errors_count > len(errors)
    return out


def scope_of(config: CodingConfig, *, base: str, symlinks: str, include: str | None = None) -> dict[str, Any]:
    scope: dict[str, Any] = {"base": base, "excluded_directories": sorted(config.excluded), "symlinks": symlinks}
    if include is not None:
        scope["include"] = include
    return scope


def excluded_by(config: CodingConfig) -> Any:
    excluded = config.excluded
    return lambda relative, name: name in excluded


async def open_discovery_base(config: CodingConfig, path: str, deadline: float) -> tuple[tuple[str, ...], int]:
    """Parse and open a discovery base directory (``.`` allowed), then ask the path policy about it
    (about ``.`` first when rooted there; an async answer pending at ``deadline`` refuses ``TIMEOUT``).
    Returns the segments and an open descriptor."""
    workspace = config.workspace
    segments = workspace.parse(path, allow_root=True, max_path_bytes=config.limits.max_path_bytes)
    try:
        fd = workspace.open_directory(segments)
    except WorkspacePathError:
        raise
    except WorkspaceError:
        await authorize_path_chain(config, segments, root=not segments, deadline=deadline)
        raise
    try:
        await authorize_path_chain(config, segments, root=not segments, deadline=deadline)
    except BaseException:
        os.close(fd)
        raise
    return segments, fd


class ListDirectoryArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")
    path: str = Field(".", description="Workspace-relative directory ('.' is the root).")


class GlobArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")
    pattern: str = Field(
        description="Anchored pattern relative to path: '**' spans directories, '*' and '?' stay within one name."
    )
    path: str = Field(".", description="Workspace-relative directory to search under ('.' is the root).")


def create_discovery_tools(config: CodingConfig) -> list[AgentTool]:
    limits = config.limits

    @define_agent_tool(
        name="list_directory",
        args=ListDirectoryArgs,
        description=(
            "List the direct entries of one workspace directory (name, kind, bytes). Directories the search "
            "tools skip are marked excluded; entries the host denies are named in denied."
        ),
    )
    async def list_directory(path: str = ".") -> dict[str, Any]:
        started = time.monotonic()
        deadline = started + limits.search_timeout
        async with workspace_refusals():
            relative = join_segments(
                config.workspace.parse(path, allow_root=True, max_path_bytes=limits.max_path_bytes)
            )
            scope = scope_of(config, base=relative, symlinks="listed")
            envelope = {
                "path": relative,
                "entries": [],
                "truncated": False,
                "coverage": coverage(new_stats(config), started=started, scope=scope),
            }
            budget = OutputBudget(limits.max_search_output_bytes, envelope)
            if not budget.fits:
                refuse(
                    "BAD_REQUEST",
                    "the smallest listing of this path would not fit the output limit",
                    path=relative,
                    hint="list a shorter path; the host can raise limits.max_search_output_bytes",
                )
            segments, fd = await open_discovery_base(config, path, deadline)
            try:
                await authorize(config, {"operation": "list", "path": relative}, deadline=deadline)
                if config.workspace.directory_identity(segments) != _identity_of(fd):
                    refuse(
                        "CONFLICT",
                        "this directory was replaced while the listing was being authorized",
                        path=relative,
                        hint="call list_directory again",
                    )
                cap = min(limits.max_list_entries, limits.max_search_entries)
                stats = new_stats(config)
                stats.directories = 1
                entries, truncated = scan_directory(fd, cap)
                stats.entries = len(entries)
                if truncated:  # named after the smaller of the two limits, the one that stopped the read
                    by_entries = limits.max_search_entries < limits.max_list_entries
                    stats.reason("max-search-entries" if by_entries else "max-list-entries")
                listed: list[dict[str, Any]] = []
                for entry in entries:
                    child = f"{relative}/{entry.name}" if segments else entry.name
                    if time.monotonic() > deadline:
                        stats.reason("timeout")
                        break
                    try:
                        admitted = await path_admitted(config, child, deadline=deadline)
                    except HostDecisionTimeout:
                        stats.reason("timeout")  # the rest of the listing is withheld undecided
                        break
                    if not admitted:
                        stats.deny(child, entry.kind)
                        continue
                    item: dict[str, Any] = {"name": entry.name, "kind": entry.kind}
                    if entry.kind == "file":
                        with contextlib.suppress(OSError):
                            item["bytes"] = entry.entry.stat(follow_symlinks=False).st_size
                    elif entry.kind == "directory" and entry.name in config.excluded:
                        item["excluded"] = True
                    if not budget.take(item):
                        stats.reason("max-search-output-bytes")
                        break
                    listed.append(item)
            finally:
                os.close(fd)
        observe_deadline(stats, deadline)
        # directories first, then everything else, each by name: the order a reader scans a tree in (which
        # entries a cap keeps is still decided by name)
        listed.sort(key=lambda item: item["kind"] != "directory")
        return {
            "path": relative,
            "entries": listed,
            "truncated": bool(stats.reasons and set(stats.reasons) - {"denied"}),
            **diagnostics(stats, budget),
            "coverage": coverage(stats, started=started, scope=scope),
        }

    @define_agent_tool(
        name="glob",
        args=GlobArgs,
        description=(
            "Find workspace files whose path (relative to path) matches an anchored pattern such as "
            "'**/*.py' or 'src/*.ts'. Symlinks and excluded directories are skipped and counted."
        ),
    )
    async def glob(pattern: str, path: str = ".") -> dict[str, Any]:
        started = time.monotonic()
        try:
            compiled = compile_glob(pattern)
        except ValueError as error:
            refuse("BAD_REQUEST", str(error), hint="use '**', '*' and '?' in a relative '/'-separated pattern")
        async with workspace_refusals():
            segments = config.workspace.parse(path, allow_root=True, max_path_bytes=limits.max_path_bytes)
            relative = join_segments(segments)
            scope = scope_of(config, base=relative, symlinks="skipped")
            empty = {
                "paths": [],
                "truncated": False,
                "result_truncated": False,
                "skipped_directories": 0,
                "skipped_symlinks": 0,
                "scanned_files": 0,
                "coverage": coverage(new_stats(config), started=started, scope={**scope, "pattern": pattern}),
            }
            budget = OutputBudget(limits.max_search_output_bytes, empty)
            if not budget.fits:
                refuse(
                    "BAD_REQUEST",
                    "the smallest result for this pattern would not fit the output limit",
                    hint="use a shorter pattern or path; the host can raise limits.max_search_output_bytes",
                )
            deadline = started + limits.search_timeout
            segments, fd = await open_discovery_base(config, path, deadline)
            os.close(fd)
            await authorize(config, {"operation": "glob", "pattern": pattern, "path": relative}, deadline=deadline)
            stats = new_stats(config)
            paths, result_truncated = await _glob_walk(config, compiled, segments, stats, budget, started)
        observe_deadline(stats, deadline)
        return {
            "paths": paths,
            "truncated": bool(set(stats.reasons) - {"max-search-results"}),
            "result_truncated": result_truncated,
            "skipped_directories": stats.excluded_directories,
            "skipped_symlinks": stats.skipped_symlinks,
            "scanned_files": stats.files,
            **diagnostics(stats, budget),
            "coverage": coverage(stats, started=started, scope={**scope, "pattern": pattern}),
        }

    return [list_directory, glob]


async def _glob_walk(
    config: CodingConfig,
    compiled: GlobPattern,
    base: tuple[str, ...],
    stats: WalkStats,
    budget: OutputBudget,
    started: float,
) -> tuple[list[str], bool]:
    cut = len("/".join(base)) + 1 if base else 0
    paths: list[str] = []
    walk = config.workspace.walk(
        base,
        limits=walk_limits(config, started),
        stats=stats,
        exclude=excluded_by(config),
        prune=lambda relative: compiled.may_contain(relative[cut:]),
        include=lambda relative: compiled.matches(relative[cut:]),
        admit=(lambda relative, kind: path_decision(config, relative)) if config.authorize_path else None,
    )
    async with contextlib.aclosing(walk):
        async for entry in walk:
            if not budget.take(entry.path):
                stats.reason("max-search-output-bytes")
                return paths, True
            paths.append(entry.path)
            if len(paths) >= config.limits.max_search_results:
                stats.reason("max-search-results")  # conservatively: no lookahead match is read
                return paths, True
    return paths, False
