"""``read_file``, ``write_file`` and ``edit_file``: direct access to one workspace file.

Order of every call: the path's spelling is checked (no host policy sees a refused spelling); the file (or
its parent) is opened by descriptor and pinned; ``authorize_path`` is asked about each segment, outermost
first; the host's ``authorize`` is asked about the exact operation; the pinned identity is checked again;
only then are bytes read or written. When opening fails (missing, not a directory, symlink) the path policy
is asked first, so a denied tree does not reveal what exists in it.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from ..tools import AgentTool, define_agent_tool
from .policy import (
    CodingConfig,
    authorize,
    authorize_path_chain,
    refuse,
    target_lock,
    workspace_refusals,
)
from .workspace import (
    WorkspaceError,
    WorkspaceFile,
    WorkspaceNotDirectoryError,
    WorkspacePathError,
    join_segments,
    open_regular_file_at,
    write_file_at,
)

_DIGEST_IN_THREAD = 1 << 20


class ReadFileArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")
    path: str = Field(description="Workspace-relative path, '/'-separated.")
    offset: int = Field(0, ge=0, description="Byte offset to start at (next_offset of the previous window).")
    max_bytes: int | None = Field(None, gt=0, description="Window size in bytes (capped by the host's limit).")


class WriteFileArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")
    path: str = Field(description="Workspace-relative path, '/'-separated.")
    content: str = Field(description="The whole new content (UTF-8).")
    overwrite: bool = Field(False, description="Replace an existing file.")


class EditFileArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")
    path: str = Field(description="Workspace-relative path, '/'-separated.")
    old_text: str = Field(min_length=1, description="The exact text to replace, indentation included.")
    new_text: str = Field(description="The text inserted literally in its place.")
    replace_all: bool = Field(False, description="Replace every occurrence instead of exactly one.")
    expected_sha256: str | None = Field(
        None, min_length=64, max_length=64, description="The sha256 read_file returned, to refuse a changed file."
    )
    dry_run: bool = Field(False, description="Compute and authorize the edit without writing it.")


def _is_continuation(byte: int) -> bool:
    return byte & 0xC0 == 0x80


def _sha256_of(opened: WorkspaceFile, size: int) -> str:
    digest = hashlib.sha256()
    position = 0
    while position < size:
        chunk = os.pread(opened.fd, min(1 << 20, size - position), position)
        if not chunk:
            break
        digest.update(chunk)
        position += len(chunk)
    return digest.hexdigest()


async def _open_pinned(config: CodingConfig, segments: tuple[str, ...]) -> WorkspaceFile:
    try:
        return config.workspace.open_file(segments)
    except WorkspacePathError:
        raise
    except WorkspaceError:
        await authorize_path_chain(config, segments)  # a denied tree refuses before revealing what exists
        raise


def _decode(data: bytes, relative: str) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        refuse(
            "BAD_REQUEST",
            "the selected bytes of this file are not valid UTF-8",
            path=relative,
            hint="this looks like a binary file; use a command that understands its format",
            reason="invalid_utf8",
        )


def _encode(text: str, field: str) -> bytes:
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError:
        refuse("BAD_REQUEST", f"{field} is not valid Unicode text (lone surrogate)", hint=f"fix {field}")


def create_file_tools(config: CodingConfig) -> list[AgentTool]:
    workspace, limits = config.workspace, config.limits

    @define_agent_tool(
        name="read_file",
        args=ReadFileArgs,
        description=(
            "Read a window of a UTF-8 workspace file. Returns text cut on character boundaries, the whole "
            "file's sha256 (pass it to edit_file as expected_sha256) and next_offset when more remains."
        ),
    )
    async def read_file(path: str, offset: int = 0, max_bytes: int | None = None) -> dict[str, Any]:
        async with workspace_refusals():
            segments = workspace.parse(path, max_path_bytes=limits.max_path_bytes)
            relative = join_segments(segments)
            opened = await _open_pinned(config, segments)
        with opened:
            await authorize_path_chain(config, segments)
            await authorize(config, {"operation": "read", "path": relative})
            if workspace.file_identity(segments) != opened.identity:
                refuse(
                    "CONFLICT",
                    "this file was replaced while the read was being authorized",
                    path=relative,
                    hint="call read_file again",
                )
            size = os.fstat(opened.fd).st_size
            maximum = min(max_bytes or limits.max_read_bytes, limits.max_read_bytes)
            # a few bytes past the window complete a character cut at its end
            selected = opened.read(offset, maximum + 4)
            start = offset
            if offset > 0:  # a resumed byte offset may land inside a character: start at the next one
                skip = 0
                while skip < min(3, len(selected)) and _is_continuation(selected[skip]):
                    skip += 1
                start, selected = offset + skip, selected[skip:]
            if len(selected) > maximum:
                cut = maximum
                while cut < len(selected) and _is_continuation(selected[cut]):
                    cut += 1
                selected = selected[:cut]
            if size > _DIGEST_IN_THREAD:
                sha256 = await asyncio.to_thread(_sha256_of, opened, size)
            else:
                sha256 = _sha256_of(opened, size)
        text = _decode(selected, relative)
        end = start + len(selected)
        result: dict[str, Any] = {
            "path": relative,
            "text": text,
            "bytes": len(selected),
            "sha256": sha256,
            "truncated": end < size,
        }
        if end < size:
            result["next_offset"] = end
        return result

    @define_agent_tool(
        name="write_file",
        args=WriteFileArgs,
        description=(
            "Create a UTF-8 workspace file (or replace one with overwrite=true). Missing parent directories "
            "are created and named in created_directories."
        ),
    )
    async def write_file(path: str, content: str, overwrite: bool = False) -> dict[str, Any]:
        async with workspace_refusals():
            segments = workspace.parse(path, max_path_bytes=limits.max_path_bytes)
            relative = join_segments(segments)
            data = _encode(content, "content")
            if len(data) > limits.max_write_bytes:
                refuse(
                    "BAD_REQUEST",
                    f"the content is {len(data)} bytes, over the {limits.max_write_bytes}-byte limit",
                    path=relative,
                    hint="write a smaller file, or split it",
                    bytes=len(data),
                    max_write_bytes=limits.max_write_bytes,
                )
            try:
                plan = workspace.plan_missing_directories(segments)
                existing = workspace.entry_kind(segments) if not plan else None
            except WorkspacePathError:
                raise
            except WorkspaceNotDirectoryError:
                await authorize_path_chain(config, segments)
                refuse(
                    "CONFLICT",
                    "a segment of this path is not a directory",
                    path=relative,
                    hint="write under a different path, or remove the file in the way",
                )
            except WorkspaceError:
                await authorize_path_chain(config, segments)
                raise
            await authorize_path_chain(config, segments)
            if existing is not None and not overwrite:
                refuse(
                    "CONFLICT",
                    "this file already exists",
                    path=relative,
                    hint="pass overwrite=true to replace it, or use edit_file to change part of it",
                )
            if existing in ("directory", "other"):
                refuse("BAD_REQUEST", "this path is not a regular file", path=relative, hint="write elsewhere")
            await authorize(
                config,
                {
                    "operation": "write",
                    "path": relative,
                    "bytes": len(data),
                    "overwrite": overwrite,
                    "creates_directories": list(plan),
                },
            )
            async with target_lock(config, relative):
                parent, created = workspace.open_parent(segments, create=plan)
                try:
                    if workspace.directory_identity(segments[:-1]) != _identity_of(parent):
                        refuse(
                            "CONFLICT",
                            "the parent directory was replaced after the write was authorized",
                            path=relative,
                            hint="call write_file again",
                        )
                    await asyncio.to_thread(
                        write_file_at, parent, segments[-1], data, replace=overwrite, relative=relative
                    )
                finally:
                    os.close(parent)
        return {"path": relative, "bytes": len(data), "created_directories": created}

    @define_agent_tool(
        name="edit_file",
        args=EditFileArgs,
        description=(
            "Replace an exact snippet of a UTF-8 workspace file (literal text, exactly one occurrence unless "
            "replace_all). Returns the new sha256 to chain the next edit without re-reading."
        ),
    )
    async def edit_file(
        path: str,
        old_text: str,
        new_text: str,
        replace_all: bool = False,
        expected_sha256: str | None = None,
        dry_run: bool = False,
    ) -> dict[str, Any]:
        async with workspace_refusals():
            segments = workspace.parse(path, max_path_bytes=limits.max_path_bytes)
            relative = join_segments(segments)
            try:
                parent = workspace.open_directory(segments[:-1])
            except WorkspacePathError:
                raise
            except WorkspaceError:
                await authorize_path_chain(config, segments)
                raise
            try:
                await authorize_path_chain(config, segments)
                async with target_lock(config, relative):
                    with open_regular_file_at(parent, segments[-1], relative) as opened:
                        if opened.size > limits.max_write_bytes:
                            refuse(
                                "BAD_REQUEST",
                                f"this file is {opened.size} bytes, over the {limits.max_write_bytes}-byte edit limit",
                                path=relative,
                                hint="edit a smaller file",
                            )
                        raw = opened.read(0, limits.max_write_bytes + 1)
                        pinned = opened.identity
                    if len(raw) > limits.max_write_bytes:
                        refuse("CONFLICT", "this file grew while it was read", path=relative, hint="call again")
                    source = _decode(raw, relative)
                    base_sha256 = hashlib.sha256(raw).hexdigest()
                    if expected_sha256 is not None and expected_sha256 != base_sha256:
                        refuse(
                            "CONFLICT",
                            "the file changed since it was read",
                            path=relative,
                            hint="read the file again and redo the edit against its current text",
                            expected_sha256=expected_sha256,
                            actual_sha256=base_sha256,
                        )
                    old, new = old_text, new_text
                    count = source.count(old)
                    if count == 0:
                        refuse(
                            "NOT_FOUND",
                            "old_text does not appear in this file",
                            path=relative,
                            hint="read the file and copy the snippet exactly, including indentation",
                            occurrences=0,
                        )
                    if count > 1 and not replace_all:
                        refuse(
                            "CONFLICT",
                            f"old_text appears {count} times, so the edit is ambiguous",
                            path=relative,
                            hint="lengthen the snippet until it is unique, or pass replace_all=true",
                            occurrences=count,
                        )
                    changed = source.replace(old, new) if replace_all else source.replace(old, new, 1)
                    result = _encode(changed, "new_text")
                    if len(result) > limits.max_write_bytes:
                        refuse(
                            "BAD_REQUEST",
                            f"the result would be {len(result)} bytes, over the {limits.max_write_bytes}-byte limit",
                            path=relative,
                            hint="make a smaller edit",
                        )
                    result_sha256 = hashlib.sha256(result).hexdigest()
                    replacements = count if replace_all else 1
                    await authorize(
                        config,
                        {
                            "operation": "edit",
                            "path": relative,
                            "base_sha256": base_sha256,
                            "result_sha256": result_sha256,
                            "result_bytes": len(result),
                            "replacements": replacements,
                            "dry_run": dry_run,
                        },
                    )
                    if workspace.directory_identity(segments[:-1]) != _identity_of(parent) or (
                        workspace.file_identity(segments) != pinned
                    ):
                        refuse(
                            "CONFLICT",
                            "the file or its directory was replaced while the edit was being authorized",
                            path=relative,
                            hint="read the file again and redo the edit",
                        )
                    if not dry_run:
                        await asyncio.to_thread(
                            write_file_at, parent, segments[-1], result, replace=True, relative=relative
                        )
            finally:
                os.close(parent)
        return {
            "path": relative,
            "base_sha256": base_sha256,
            "sha256": result_sha256,
            "replacements": replacements,
            "bytes": len(result),
            "applied": not dry_run,
        }

    return [read_file, write_file, edit_file]


def _identity_of(fd: int) -> tuple[int, int]:
    st = os.fstat(fd)
    return (st.st_dev, st.st_ino)
