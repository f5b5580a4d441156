"""Descriptor-anchored access to one declared workspace root (Linux).

Containment is decided by the kernel, not by string checks. A :class:`Workspace` holds an absolute root whose
identity (device, inode) is pinned when it is declared. A workspace-relative path is first checked for its
spelling (:meth:`Workspace.parse`: relative, ``/``-separated, bounded, no backslash, NUL, ``.``/``..`` or
empty segment), then resolved one segment at a time: every ancestor is opened with
``os.open(name, O_DIRECTORY | O_NOFOLLOW, dir_fd=parent)``, so a symlink anywhere refuses instead of being
followed, and a name that reaches the entry only through case folding or Unicode normalisation refuses too
(a rule on ``credentials`` cannot be passed by asking for ``CREDENTIALS``). Files are looked at with
``fstatat`` before they are opened, opened non-blocking, and must be regular files (a FIFO, device or socket
is never opened for reading).

The API, shared by the coding tools and the harness's file resources:

- :class:`Workspace` — ``Workspace(root)``; ``parse(path)`` → segments; ``open_root()``;
  ``open_directory(segments)``; ``open_file(segments)`` → :class:`WorkspaceFile`; ``read_file(segments,
  max_bytes)``; ``file_identity(segments)`` / ``directory_identity(segments)`` to revalidate a pinned handle;
  ``plan_missing_directories(segments)``, ``open_parent(segments, create=plan)`` and
  :func:`write_file_at` for writes; :func:`scan_directory` for one bounded directory read; :meth:`walk`, an
  async generator over the files of a tree within :class:`WalkLimits`, reporting what it skipped in
  :class:`WalkStats`.
- :func:`descriptor_platform_gaps` / :func:`require_descriptor_platform`: the platform check every
  ``Workspace()`` runs first — Linux, the open flags, ``dir_fd`` support and ``/proc/self/fd``; without them
  construction fails closed with :class:`AgentCodingPlatformError` (there is no string-checked fallback).
- :class:`WorkspaceError` and its subclasses: each carries the refusal ``code`` a tool hands a model
  (``BAD_REQUEST``, ``FORBIDDEN``, ``NOT_FOUND``, ``CONFLICT``), the workspace-relative ``path`` and a ``hint``.
  They never name a host path. :class:`WorkspaceUnavailableError` (the root itself is gone or was replaced)
  has no refusal code: it is a host-level cause.

Every descriptor this module returns is the caller's to close (``os.close``); :class:`WorkspaceFile` is a
context manager. Nothing here is asynchronous except :meth:`Workspace.walk` (it awaits the host's admission
callback and yields to the event loop between entries); the filesystem calls themselves are short local
syscalls made on the calling thread.

Limits of the guarantee: a directory opened by descriptor can be *moved* elsewhere by another process while
it is held; callers revalidate the pinned identity (:meth:`Workspace.directory_identity`) immediately before
they write, which narrows that window but cannot close it. A hard link inside the root to a file elsewhere on
the same filesystem is the same inode: reads through it see that file (writes replace the directory entry by
rename, so they never write into a shared inode).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import inspect
import operator
import os
import secrets
import stat
import sys
import time
import unicodedata
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple

from ..errors import AgentConfigError, AppError, ThreadlineError

__all__ = (
    "MAX_NAME_BYTES",
    "MAX_PATH_BYTES",
    "AgentCodingPlatformError",
    "EntryKind",
    "HostDecisionTimeout",
    "WalkEntry",
    "WalkLimits",
    "WalkStats",
    "Workspace",
    "WorkspaceBackslashError",
    "WorkspaceChangedError",
    "WorkspaceError",
    "WorkspaceExistsError",
    "WorkspaceFile",
    "WorkspaceForbiddenError",
    "WorkspaceNotDirectoryError",
    "WorkspaceNotFoundError",
    "WorkspaceNotRegularFileError",
    "WorkspacePathError",
    "WorkspaceSymlinkError",
    "WorkspaceUnavailableError",
    "await_decision",
    "descriptor_platform_gaps",
    "join_segments",
    "open_regular_file_at",
    "require_descriptor_platform",
    "scan_directory",
    "write_file_at",
)

MAX_PATH_BYTES = 4_096
MAX_NAME_BYTES = 255

# read with getattr: on a platform without one of them this module still imports, and Workspace() refuses
_O_DIRECTORY = getattr(os, "O_DIRECTORY", 0)
_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_O_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
_O_DIR = os.O_RDONLY | _O_DIRECTORY | _O_NOFOLLOW | _O_CLOEXEC
_O_FILE = os.O_RDONLY | _O_NOFOLLOW | _O_NONBLOCK | _O_CLOEXEC
_O_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_NOFOLLOW | _O_CLOEXEC

PROC_FD = "/proc/self/fd"
"""Where Linux names this process's descriptors; ``run_command`` hands its pinned cwd over through it."""
_REQUIRED_FLAGS = ("O_DIRECTORY", "O_NOFOLLOW", "O_CLOEXEC", "O_NONBLOCK")

EntryKind = Literal["file", "directory", "symlink", "other"]
Identity = tuple[int, int]


# ------------------------------------------------------------------------------------------------ errors


class WorkspaceError(ThreadlineError):
    """A workspace path refused. ``code`` is the refusal code a tool may hand a model; ``path`` is the
    workspace-relative path (or the caller's own spelling) and never a host path; ``hint`` names the next move."""

    code: str | None = "BAD_REQUEST"

    def __init__(
        self, message: str, *, path: str | None = None, hint: str | None = None, details: dict[str, Any] | None = None
    ) -> None:
        super().__init__(message)
        self.message = message
        self.path = path
        self.hint = hint
        self.details = dict(details or {})


class WorkspacePathError(WorkspaceError):
    """The spelling of a path is not accepted (empty, NUL, ``.``/empty segment, too long)."""


class WorkspaceForbiddenError(WorkspaceError):
    """The path leaves the workspace (absolute, ``..``); ``recovery_path`` is the workspace-relative spelling
    of an absolute path that lies inside the root, else ``None``."""

    code = "FORBIDDEN"

    def __init__(self, message: str, *, recovery_path: str | None = None, **kwargs: Any) -> None:
        super().__init__(message, **kwargs)
        self.recovery_path = recovery_path
        if recovery_path is not None:
            self.details["recovery_path"] = recovery_path


class WorkspaceBackslashError(WorkspaceForbiddenError):
    """The path contains a backslash: refused (``FORBIDDEN``), never normalised, so no policy is asked about a
    different decomposition than the one that would be opened."""


class WorkspaceSymlinkError(WorkspaceForbiddenError):
    """A segment of the path is a symlink; symlinks are never followed."""


class WorkspaceNotFoundError(WorkspaceError):
    code = "NOT_FOUND"


class WorkspaceNotDirectoryError(WorkspaceError):
    """A segment that must be a directory is not one."""


class WorkspaceNotRegularFileError(WorkspaceError):
    """The entry is a directory, FIFO, socket or device, not a regular file."""


class WorkspaceChangedError(WorkspaceError):
    """The entry changed between two looks at it (swapped, removed, replaced): nothing was done."""

    code = "CONFLICT"


class WorkspaceExistsError(WorkspaceError):
    code = "CONFLICT"


class WorkspaceUnavailableError(WorkspaceError):
    """The root itself cannot be opened or is no longer the directory that was declared (host-level)."""

    code = None


# ------------------------------------------------------------------------------------------------ platform


class AgentCodingPlatformError(AppError):
    """This platform cannot give descriptor-anchored containment, so the coding tools (and every other user
    of :class:`Workspace`) refuse to be built here instead of falling back to string checks.
    ``SERVICE_UNAVAILABLE`` (503); ``details`` names the ``platform`` and what is ``missing``."""

    def __init__(self, platform: str, missing: list[str]) -> None:
        message = (
            f"the coding tools need descriptor-anchored file access, which this platform ({platform}) does not "
            f"provide: missing {', '.join(missing)}"
        )
        super().__init__(
            "SERVICE_UNAVAILABLE",
            message,
            {"message": message, "platform": platform, "missing": list(missing)},
            "run the coding tools on Linux with /proc mounted; no string-checked fallback exists",
        )
        self.platform = platform
        self.missing = list(missing)


def _proc_fd_names_descriptors(proc_fd: str) -> bool:
    """Whether ``proc_fd/N`` reaches the directory open as descriptor N (Linux with /proc mounted)."""
    try:
        fd = os.open("/", os.O_RDONLY | _O_DIRECTORY | _O_CLOEXEC)
    except OSError:
        return False
    try:
        return _identity(os.stat(f"{proc_fd}/{fd}")) == _identity(os.fstat(fd))
    except OSError:
        return False
    finally:
        os.close(fd)


def descriptor_platform_gaps() -> list[str]:
    """What this platform lacks for descriptor-anchored containment, empty when nothing: Linux (the one
    qualified platform: FreeBSD and macOS have ``openat`` but not the spelling, ``/proc`` and process
    semantics the tools are tested against), the open flags ``O_DIRECTORY``, ``O_NOFOLLOW``,
    ``O_CLOEXEC``, ``O_NONBLOCK``, ``dir_fd`` support for open/stat/mkdir/rename/link/unlink, ``scandir``
    of a descriptor, and :data:`PROC_FD` naming this process's descriptors."""
    missing: list[str] = []
    if not sys.platform.startswith("linux"):
        missing.append("Linux (the one qualified platform)")
    missing += [f"os.{flag}" for flag in _REQUIRED_FLAGS if not getattr(os, flag, 0)]
    for function in (os.open, os.stat, os.mkdir, os.rename, os.link, os.unlink):
        if function not in os.supports_dir_fd:
            missing.append(f"dir_fd support in os.{function.__name__}")
    if os.scandir not in os.supports_fd:
        missing.append("os.scandir of a descriptor")
    if not _proc_fd_names_descriptors(PROC_FD):
        missing.append(PROC_FD)
    return missing


def require_descriptor_platform() -> None:
    """Raise :class:`AgentCodingPlatformError` naming the platform unless :func:`descriptor_platform_gaps`
    is empty."""
    missing = descriptor_platform_gaps()
    if missing:
        raise AgentCodingPlatformError(sys.platform, missing)


# ------------------------------------------------------------------------------------------------ helpers


def join_segments(segments: Sequence[str]) -> str:
    """The workspace-relative spelling of ``segments`` (``.`` for the root)."""
    return "/".join(segments) if segments else "."


def _identity(st: os.stat_result) -> Identity:
    return (st.st_dev, st.st_ino)


def _kind(mode: int) -> EntryKind:
    if stat.S_ISREG(mode):
        return "file"
    if stat.S_ISDIR(mode):
        return "directory"
    if stat.S_ISLNK(mode):
        return "symlink"
    return "other"


def _spelling_variants(name: str) -> set[str]:
    variants = {name.swapcase(), name.lower(), name.upper()}
    variants.add(unicodedata.normalize("NFC", name))
    variants.add(unicodedata.normalize("NFD", name))
    variants.discard(name)
    return {v for v in variants if "/" not in v and "\x00" not in v}


def _check_spelling(parent_fd: int, name: str, identity: Identity, relative: str) -> None:
    """Refuse a name that reached ``identity`` only because the directory folds case or normalises Unicode.

    On a case-sensitive directory the other spellings are absent or other entries (one failing ``fstatat``
    each); only when one of them reaches the same inode is the directory read to find the stored name."""
    for variant in _spelling_variants(name):
        try:
            other = os.stat(variant, dir_fd=parent_fd, follow_symlinks=False)
        except (OSError, ValueError):
            continue
        if _identity(other) != identity:
            continue
        with os.scandir(parent_fd) as entries:
            for count, entry in enumerate(entries):
                if entry.name == name:
                    return
                if count >= 100_000:
                    break
        raise WorkspacePathError(
            "this path is spelled differently from the name stored on disk",
            path=relative,
            hint="use the exact name list_directory shows",
        )


def _is_symlink_at(dir_fd: int, name: str) -> bool:
    try:
        return stat.S_ISLNK(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)
    except OSError:
        return False


def _raise_for_errno(error: OSError, relative: str, *, what: str = "path") -> None:
    code = error.errno
    if code == errno.ENOENT:
        raise WorkspaceNotFoundError(
            f"this {what} does not exist", path=relative, hint="use list_directory or glob to find the right path"
        ) from None
    if code == errno.ENOTDIR:
        raise WorkspaceNotDirectoryError(
            "a segment of this path is not a directory", path=relative, hint="check the path with list_directory"
        ) from None
    if code == errno.ELOOP:
        raise WorkspaceSymlinkError(
            "this path goes through a symlink, which is never followed",
            path=relative,
            hint="use the target's own workspace-relative path",
        ) from None
    if code in (errno.EACCES, errno.EPERM):
        raise WorkspaceForbiddenError(
            "the host does not allow access to this path", path=relative, hint="choose another path"
        ) from None
    if code == errno.ENAMETOOLONG:
        raise WorkspacePathError("this path is too long", path=relative, hint="use a shorter path") from None
    raise error


# ------------------------------------------------------------------------------------------------ files


@dataclass
class WorkspaceFile:
    """An opened regular file: ``fd`` (read-only, non-blocking), ``identity`` (device, inode), ``size`` and
    ``mode`` at open time, ``relative`` path. Close it (or use ``with``)."""

    fd: int
    identity: Identity
    size: int
    mode: int
    relative: str

    def read(self, offset: int, length: int) -> bytes:
        """Up to ``length`` bytes from ``offset`` (fewer at the end of the file)."""
        chunks: list[bytes] = []
        remaining = length
        while remaining > 0:
            chunk = os.pread(self.fd, min(remaining, 1 << 20), offset)
            if not chunk:
                break
            chunks.append(chunk)
            offset += len(chunk)
            remaining -= len(chunk)
        return b"".join(chunks)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> WorkspaceFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_regular_file_at(dir_fd: int, name: str, relative: str) -> WorkspaceFile:
    """Open ``name`` under ``dir_fd`` if it is a regular file: looked at first (a FIFO or device is never
    opened), opened non-blocking without following a symlink, then checked to be the inode looked at."""
    try:
        before = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except OSError as error:
        _raise_for_errno(error, relative, what="file")
    if stat.S_ISLNK(before.st_mode):
        raise WorkspaceSymlinkError(
            "this path is a symlink, which is never followed",
            path=relative,
            hint="use the target's own workspace-relative path",
        )
    if not stat.S_ISREG(before.st_mode):
        raise WorkspaceNotRegularFileError(
            "this path is not a regular file", path=relative, hint="use list_directory to see what is here"
        )
    try:
        fd = os.open(name, _O_FILE, dir_fd=dir_fd)
    except OSError as error:
        _raise_for_errno(error, relative, what="file")
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or _identity(st) != _identity(before):
        os.close(fd)
        raise WorkspaceChangedError("this file changed while it was being opened", path=relative, hint="call again")
    return WorkspaceFile(fd, _identity(st), st.st_size, st.st_mode, relative)


def write_file_at(parent_fd: int, name: str, data: bytes, *, replace: bool, relative: str) -> None:
    """Write ``data`` as ``name`` in the directory ``parent_fd``, atomically: a temporary file in the same
    directory is written and fsynced, then renamed over the entry (``replace=True``; an existing regular
    file keeps its permission bits) or hard-linked to a name that must not exist (``replace=False``).

    Refuses a symlink or non-regular entry with a :class:`WorkspaceError` and writes nothing. When it
    returns, the new content is on disk (the file is fsynced; the directory entry is not). If the call is
    interrupted, the old entry is intact and the temporary file is removed."""
    try:
        current: os.stat_result | None = os.stat(name, dir_fd=parent_fd, follow_symlinks=False)
    except FileNotFoundError:
        current = None
    if current is not None:
        if stat.S_ISLNK(current.st_mode):
            raise WorkspaceSymlinkError(
                "this path is a symlink, which is never written through",
                path=relative,
                hint="write to the target's own workspace-relative path",
            )
        if not replace:
            raise WorkspaceExistsError(
                "this file already exists",
                path=relative,
                hint="pass overwrite=true to replace it, or use edit_file to change part of it",
            )
        if not stat.S_ISREG(current.st_mode):
            raise WorkspaceNotRegularFileError(
                "this path is not a regular file", path=relative, hint="write under a different path"
            )
    prefix = name.encode()[:200].decode(errors="ignore")
    temporary = f".{prefix}.{secrets.token_hex(6)}.tl-tmp"
    mode = stat.S_IMODE(current.st_mode) if current is not None else 0o666
    fd = os.open(temporary, _O_CREATE, mode, dir_fd=parent_fd)
    placed = False
    try:
        try:
            if current is not None:
                os.fchmod(fd, mode)
            view = memoryview(data)
            while view:
                written = os.write(fd, view)
                view = view[written:]
            os.fsync(fd)
        finally:
            os.close(fd)
        if replace:
            os.rename(temporary, name, src_dir_fd=parent_fd, dst_dir_fd=parent_fd)
            placed = True
        else:
            try:
                os.link(temporary, name, src_dir_fd=parent_fd, dst_dir_fd=parent_fd, follow_symlinks=False)
            except FileExistsError:
                raise WorkspaceExistsError(
                    "this file already exists",
                    path=relative,
                    hint="pass overwrite=true to replace it, or use edit_file to change part of it",
                ) from None
    finally:
        if not placed:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(temporary, dir_fd=parent_fd)


# ------------------------------------------------------------------------------------------------ listing


class ScannedEntry(NamedTuple):
    # a NamedTuple, not a frozen dataclass: one is built per directory entry, and this is 3x cheaper
    name: str
    kind: EntryKind
    entry: os.DirEntry[str]


def _entry_kind(entry: os.DirEntry[str]) -> EntryKind:
    # d_type answers these without a stat; an unknown type falls back to lstat inside DirEntry
    if entry.is_symlink():
        return "symlink"
    if entry.is_dir(follow_symlinks=False):
        return "directory"
    if entry.is_file(follow_symlinks=False):
        return "file"
    return "other"


_by_name = operator.attrgetter("name")


def scan_directory(dir_fd: int, max_entries: int) -> tuple[list[ScannedEntry], bool]:
    """Read at most ``max_entries`` entries of the directory ``dir_fd``, sorted by name, and whether the
    cap stopped the read (conservatively: reaching the cap counts as truncated, no lookahead entry is read)."""
    entries: list[ScannedEntry] = []
    truncated = False
    if max_entries <= 0:
        return entries, True
    with os.scandir(dir_fd) as iterator:
        for entry in iterator:
            entries.append(ScannedEntry(entry.name, _entry_kind(entry), entry))
            if len(entries) >= max_entries:
                truncated = True
                break
    entries.sort(key=_by_name)
    return entries, truncated


# ------------------------------------------------------------------------------------------------ walking


@dataclass(frozen=True)
class WalkLimits:
    """Bounds of one walk (the seeds' search budgets): files yielded, depth below the base, directory-open
    attempts (the base included), entries observed, and a ``time.monotonic()`` deadline."""

    max_files: int = 10_000
    max_depth: int = 32
    max_directories: int = 1_000
    max_entries: int = 20_000
    deadline: float | None = None


@dataclass
class WalkStats:
    """What a walk saw and skipped. ``reasons`` lists why coverage is partial (empty when complete)."""

    directories: int = 0
    entries: int = 0
    files: int = 0
    skipped_symlinks: int = 0
    excluded_directories: int = 0
    pruned_directories: int = 0
    include_rejected: int = 0
    """Files the walk's ``include`` filter rejected (with ``pruned_directories``: what the include kept out)."""
    include_admitted: int = 0
    """Files the ``include`` filter admitted, before the path policy was asked about them."""
    denied: list[dict[str, str]] = field(default_factory=list)
    denied_count: int = 0
    errors: list[dict[str, str]] = field(default_factory=list)
    errors_count: int = 0
    reasons: list[str] = field(default_factory=list)
    max_denied: int = 100
    max_errors: int = 100

    def reason(self, reason: str) -> None:
        if reason not in self.reasons:
            self.reasons.append(reason)

    def deny(self, path: str, kind: EntryKind) -> None:
        self.denied_count += 1
        self.reason("denied")
        if len(self.denied) < self.max_denied:
            self.denied.append({"path": path, "kind": kind})

    def error(self, path: str, operation: str, code: str) -> None:
        self.errors_count += 1
        self.reason("unreadable")
        if len(self.errors) < self.max_errors:
            self.errors.append({"path": path, "operation": operation, "code": code})

    @property
    def denied_truncated(self) -> bool:
        return self.denied_count > len(self.denied)

    @property
    def errors_truncated(self) -> bool:
        return self.errors_count > len(self.errors)


class WalkEntry(NamedTuple):
    """A file reached by :meth:`Workspace.walk` (immutable; one is built per file, so a NamedTuple). ``dir_fd``
    is its open parent directory, valid only until the walk resumes: open the file with
    :meth:`WalkEntry.open` (or by name under ``dir_fd``) before that."""

    path: str
    name: str
    dir_fd: int
    depth: int

    def open(self) -> WorkspaceFile:
        return open_regular_file_at(self.dir_fd, self.name, self.path)


Admit = Callable[[str, EntryKind], "bool | Awaitable[bool]"]


# ------------------------------------------------------------------------------------------------ workspace


class Workspace:
    """One declared absolute root. Its identity is pinned now: every later open checks the root is still the
    same directory (a root renamed away and replaced refuses with :class:`WorkspaceUnavailableError`).

    Fails closed: on a platform without descriptor-anchored access (:func:`descriptor_platform_gaps`)
    construction raises :class:`AgentCodingPlatformError` naming the platform."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        require_descriptor_platform()
        declared = os.fspath(root)
        if not isinstance(declared, str) or not os.path.isabs(declared):
            raise AgentConfigError(f"the workspace root must be an absolute path, got {declared!r}", field="root")
        self.declared = declared
        self.path = os.path.realpath(declared)
        try:
            fd = os.open(self.path, _O_DIR)
        except OSError as error:
            raise AgentConfigError(
                f"the workspace root {declared!r} is not an openable directory ({error.strerror})", field="root"
            ) from error
        try:
            self.identity = _identity(os.fstat(fd))
        finally:
            os.close(fd)

    # -------------------------------------------------------------- spelling

    def parse(self, path: Any, *, allow_root: bool = False, max_path_bytes: int = MAX_PATH_BYTES) -> tuple[str, ...]:
        """Check a requested path's spelling and split it into segments (``()`` for ``.`` with
        ``allow_root``). Refuses before any filesystem access: a non-string or empty path, NUL, a backslash
        (:class:`WorkspaceBackslashError`, ``FORBIDDEN``),
        more than ``max_path_bytes`` UTF-8 bytes, an absolute path (:class:`WorkspaceForbiddenError` with the
        workspace-relative ``recovery_path`` when it lies inside the root), ``..``, ``.`` or empty segments
        and names longer than 255 bytes."""
        if not isinstance(path, str) or path == "":
            raise WorkspacePathError("a path must be a non-empty string", hint="pass a workspace-relative path")
        if "\x00" in path:
            raise WorkspacePathError("a path cannot contain a NUL byte", hint="remove the NUL byte")
        try:
            encoded = path.encode("utf-8")
        except UnicodeEncodeError:
            raise WorkspacePathError("a path must be valid UTF-8 text", hint="spell the path in UTF-8") from None
        if len(encoded) > max_path_bytes:
            raise WorkspacePathError(
                f"this path is {len(encoded)} bytes, over the {max_path_bytes}-byte limit", hint="use a shorter path"
            )
        if "\\" in path:
            # FORBIDDEN, like the other spellings that could reach an entry the host's policy never saw: the
            # walk would read a backslash as a separator while every callback would be asked about one name
            raise WorkspaceBackslashError(
                "a path uses / as its separator; a backslash is refused, not normalised",
                path=path,
                hint=f"use {path.replace(chr(92), '/')!r} if you meant those as separators",
            )
        if path.startswith("/"):
            raise WorkspaceForbiddenError(
                "an absolute path is refused: paths are relative to the workspace root",
                recovery_path=self._recovery_path(path, max_path_bytes),
                hint="pass the workspace-relative path (recovery_path when given)",
            )
        if path == ".":
            if allow_root:
                return ()
            raise WorkspacePathError(
                "this operation needs a file path, not the root",
                path=".",
                hint="name a file under the root; list_directory shows what is there",
            )
        segments = tuple(path.split("/"))
        for segment in segments:
            if segment == "..":
                raise WorkspaceForbiddenError(
                    "a '..' segment would leave the workspace; it is never followed",
                    hint="name the path from the workspace root without '..'",
                )
            if segment in ("", "."):
                canonical = "/".join(s for s in segments if s not in ("", "."))
                raise WorkspacePathError(
                    "a path cannot contain an empty or '.' segment (no leading './', no '//', no trailing '/')",
                    path=path,
                    hint=f"use {canonical or '.'!r}",
                )
            if len(segment.encode()) > MAX_NAME_BYTES:
                raise WorkspacePathError(
                    f"a path segment is longer than {MAX_NAME_BYTES} bytes", path=path, hint="use a shorter name"
                )
        return segments

    def _recovery_path(self, path: str, max_path_bytes: int) -> str | None:
        candidate = os.path.normpath(path)
        for root in dict.fromkeys((self.path, os.path.normpath(self.declared))):
            if candidate == root:
                return "."
            if candidate.startswith(root.rstrip("/") + "/"):
                relative = candidate[len(root.rstrip("/")) + 1 :]
                try:
                    self.parse(relative, max_path_bytes=max_path_bytes)
                except WorkspaceError:
                    return None
                return relative
        return None

    # -------------------------------------------------------------- opening

    def open_root(self) -> int:
        """A new descriptor of the root, checked to be the declared directory."""
        try:
            fd = os.open(self.path, _O_DIR)
        except OSError as error:
            raise WorkspaceUnavailableError("the workspace root cannot be opened") from error
        if _identity(os.fstat(fd)) != self.identity:
            os.close(fd)
            raise WorkspaceUnavailableError("the workspace root is no longer the declared directory")
        return fd

    def _descend(self, parent_fd: int, name: str, relative: str, *, check_spelling: bool = True) -> int:
        try:
            fd = os.open(name, _O_DIR, dir_fd=parent_fd)
        except OSError as error:
            if error.errno == errno.ENOTDIR and _is_symlink_at(parent_fd, name):
                error = OSError(errno.ELOOP, "symlink")  # O_DIRECTORY reports a symlink as ENOTDIR
            _raise_for_errno(error, relative, what="directory")
        if check_spelling:
            try:
                _check_spelling(parent_fd, name, _identity(os.fstat(fd)), relative)
            except BaseException:
                os.close(fd)
                raise
        return fd

    def open_directory(self, segments: Sequence[str], *, root_fd: int | None = None) -> int:
        """Open the directory at ``segments`` (``()`` is the root) one segment at a time without following
        symlinks; returns a new descriptor. Refuses a missing, non-directory or symlink segment."""
        fd = self.open_root() if root_fd is None else os.dup(root_fd)
        try:
            for index, name in enumerate(segments):
                child = self._descend(fd, name, join_segments(segments[: index + 1]))
                os.close(fd)
                fd = child
        except BaseException:
            os.close(fd)
            raise
        return fd

    def open_file(self, segments: Sequence[str]) -> WorkspaceFile:
        """Open the regular file at ``segments`` (see :func:`_open_regular_at`): looked at first, opened
        non-blocking, never through a symlink; a FIFO, device, socket or directory refuses."""
        if not segments:
            raise WorkspaceNotRegularFileError(
                "the root is a directory, not a file",
                path=".",
                hint="name a file under the root; list_directory shows what is there",
            )
        relative = join_segments(segments)
        parent = self.open_directory(segments[:-1])
        try:
            opened = open_regular_file_at(parent, segments[-1], relative)
            try:
                _check_spelling(parent, segments[-1], opened.identity, relative)
            except BaseException:
                opened.close()
                raise
            return opened
        finally:
            os.close(parent)

    def read_file(self, segments: Sequence[str], max_bytes: int) -> bytes:
        """The whole content of a regular file of at most ``max_bytes`` bytes (a larger file refuses)."""
        with self.open_file(segments) as opened:
            if opened.size > max_bytes:
                raise WorkspacePathError(
                    f"this file is {opened.size} bytes, over the {max_bytes}-byte limit",
                    path=opened.relative,
                    hint="read it in windows",
                )
            data = opened.read(0, max_bytes + 1)
        if len(data) > max_bytes:
            raise WorkspaceChangedError(
                "this file grew while it was read", path=join_segments(segments), hint="call again"
            )
        return data

    def file_identity(self, segments: Sequence[str]) -> Identity | None:
        """The (device, inode) now found at ``segments`` when it is a regular file reached without a symlink,
        else ``None`` — to revalidate a pinned file after a host decision."""
        try:
            parent = self.open_directory(segments[:-1])
        except WorkspaceError:
            return None
        try:
            st = os.stat(segments[-1], dir_fd=parent, follow_symlinks=False)
        except OSError:
            return None
        finally:
            os.close(parent)
        return _identity(st) if stat.S_ISREG(st.st_mode) else None

    def directory_identity(self, segments: Sequence[str]) -> Identity | None:
        """The (device, inode) of the directory now reached at ``segments`` without a symlink, else ``None``."""
        try:
            fd = self.open_directory(segments)
        except WorkspaceError:
            return None
        try:
            return _identity(os.fstat(fd))
        finally:
            os.close(fd)

    def entry_kind(self, segments: Sequence[str]) -> EntryKind | None:
        """What is at ``segments`` (without following a symlink), or ``None`` when nothing is; the ancestors
        are opened as :meth:`open_directory` does (and refuse the same way)."""
        parent = self.open_directory(segments[:-1])
        try:
            return _kind(os.stat(segments[-1], dir_fd=parent, follow_symlinks=False).st_mode)
        except FileNotFoundError:
            return None
        finally:
            os.close(parent)

    def plan_missing_directories(self, segments: Sequence[str]) -> list[str]:
        """The ancestors of the file at ``segments`` that do not exist yet, outermost first, as
        workspace-relative paths — what a write would create. Creates nothing. Refuses a symlink or
        non-directory ancestor."""
        fd = self.open_root()
        try:
            for index, name in enumerate(segments[:-1]):
                relative = join_segments(segments[: index + 1])
                try:
                    child = self._descend(fd, name, relative)
                except WorkspaceNotFoundError:
                    return [join_segments(segments[: i + 1]) for i in range(index, len(segments) - 1)]
                os.close(fd)
                fd = child
            return []
        finally:
            os.close(fd)

    def open_parent(self, segments: Sequence[str], *, create: Sequence[str] = ()) -> tuple[int, list[str]]:
        """Open the parent directory of ``segments``, creating only the missing ancestors named in ``create``
        (the approved plan). Returns the descriptor and the directories actually created. An ancestor missing
        that the plan did not name (it disappeared after approval) refuses with :class:`WorkspaceChangedError`
        without expanding the plan."""
        allowed = set(create)
        created: list[str] = []
        fd = self.open_root()
        try:
            for index, name in enumerate(segments[:-1]):
                relative = join_segments(segments[: index + 1])
                try:
                    child = self._descend(fd, name, relative)
                except WorkspaceNotFoundError:
                    if relative not in allowed:
                        raise WorkspaceChangedError(
                            "an ancestor directory disappeared after the write was authorized",
                            path=relative,
                            hint="call again to plan the write afresh",
                        ) from None
                    try:
                        os.mkdir(name, 0o777, dir_fd=fd)
                        created.append(relative)
                    except FileExistsError:
                        pass
                    child = self._descend(fd, name, relative)
                os.close(fd)
                fd = child
        except BaseException:
            os.close(fd)
            raise
        return fd, created

    # -------------------------------------------------------------- walking

    async def walk(
        self,
        base: Sequence[str],
        *,
        limits: WalkLimits,
        stats: WalkStats,
        exclude: Callable[[str, str], bool] | None = None,
        prune: Callable[[str], bool] | None = None,
        include: Callable[[str], bool] | None = None,
        admit: Admit | None = None,
        root_fd: int | None = None,
    ) -> AsyncIterator[WalkEntry]:
        """Yield the regular files under the directory ``base`` in lexical depth-first order, descending only
        through directories opened by descriptor.

        Per entry, in order: symlinks are skipped and counted (``stats.skipped_symlinks``); a directory is
        skipped when ``prune(relative)`` is false (no match can lie below it), when ``exclude(relative, name)``
        says so (counted, outside the scope) or when ``admit(relative, 'directory')`` refuses (recorded in
        ``stats.denied``) — all before it is opened; a file is skipped when ``include(relative)`` is false
        (silently) or ``admit(relative, 'file')`` refuses (recorded). ``admit`` may be sync or async and
        sees each path before anything below it is opened; an async answer still pending at the deadline is
        cancelled and the walk stops (reason ``timeout``), a sync one cannot be interrupted.

        Stops early at a limit of :class:`WalkLimits`, recording the reason in ``stats.reasons``
        (``max-search-files``, ``max-search-depth``, ``max-search-directories``, ``max-search-entries``,
        ``timeout``). Unreadable directories are recorded in ``stats.errors``. A refused ``base`` raises
        :class:`WorkspaceError`. Cancelling the consuming task stops the walk; every descriptor is closed."""
        fd = self.open_directory(base, root_fd=root_fd)
        stats.directories += 1
        prefix = "/".join(base)
        stack: list[tuple[int, str, int, list[ScannedEntry], int]] = []
        try:
            fd, opened = -1, fd
            self._fill(stack, opened, prefix, 0, limits, stats)
            steps = 0
            while stack:
                dir_fd, dir_prefix, depth, entries, index = stack[-1]
                if index >= len(entries):
                    stack.pop()
                    os.close(dir_fd)
                    continue
                stack[-1] = (dir_fd, dir_prefix, depth, entries, index + 1)
                entry = entries[index]
                steps += 1
                if steps % 64 == 0:
                    await asyncio.sleep(0)
                if limits.deadline is not None and time.monotonic() > limits.deadline:
                    stats.reason("timeout")
                    return
                relative = f"{dir_prefix}/{entry.name}" if dir_prefix else entry.name
                if entry.kind == "symlink":
                    stats.skipped_symlinks += 1
                    continue
                if entry.kind == "directory":
                    if prune is not None and not prune(relative):
                        stats.pruned_directories += 1
                        continue
                    if exclude is not None and exclude(relative, entry.name):
                        stats.excluded_directories += 1
                        continue
                    if depth + 1 > limits.max_depth:
                        stats.reason("max-search-depth")
                        continue
                    if admit is not None:
                        admitted = await _ask(admit, relative, "directory", limits.deadline, stats)
                        if admitted is None:  # undecided at the deadline
                            return
                        if not admitted:
                            continue
                    if stats.entries >= limits.max_entries:
                        stats.reason("max-search-entries")
                        continue
                    if stats.directories >= limits.max_directories:
                        stats.reason("max-search-directories")
                        continue
                    stats.directories += 1
                    try:
                        child = os.open(entry.name, _O_DIR, dir_fd=dir_fd)
                    except OSError as error:
                        if error.errno in (errno.ELOOP, errno.ENOTDIR):  # swapped after it was listed
                            stats.skipped_symlinks += 1
                        else:
                            stats.error(relative, "open-directory", errno.errorcode.get(error.errno or 0, "EIO"))
                        continue
                    self._fill(stack, child, relative, depth + 1, limits, stats)
                    continue
                if entry.kind != "file":
                    continue
                if include is not None:
                    if not include(relative):
                        stats.include_rejected += 1
                        continue
                    stats.include_admitted += 1
                if admit is not None:
                    admitted = await _ask(admit, relative, "file", limits.deadline, stats)
                    if admitted is None:  # undecided at the deadline
                        return
                    if not admitted:
                        continue
                if stats.files >= limits.max_files:
                    stats.reason("max-search-files")
                    return
                stats.files += 1
                yield WalkEntry(relative, entry.name, dir_fd, depth + 1)
        finally:
            if fd >= 0:
                os.close(fd)
            for dir_fd, *_ in stack:
                os.close(dir_fd)

    @staticmethod
    def _fill(
        stack: list[tuple[int, str, int, list[ScannedEntry], int]],
        fd: int,
        prefix: str,
        depth: int,
        limits: WalkLimits,
        stats: WalkStats,
    ) -> None:
        """Read one directory (whose descriptor the stack then owns) within the entry budget."""
        remaining = limits.max_entries - stats.entries
        try:
            entries, truncated = scan_directory(fd, remaining)
        except OSError as error:
            os.close(fd)
            stats.error(prefix or ".", "read-directory", errno.errorcode.get(error.errno or 0, "EIO"))
            return
        stats.entries += len(entries)
        stack.append((fd, prefix, depth, entries, 0))
        if truncated:
            # the entries read so far are still visited; no further directory is opened
            stats.reason("max-search-entries")


class HostDecisionTimeout(Exception):
    """A host callback's awaitable answer did not come before the deadline; it was cancelled."""


async def await_decision(decision: Any, deadline: float | None) -> Any:
    """A host callback's answer: a plain value as it is; an awaitable awaited — and, with a ``deadline``
    (``time.monotonic()``), cancelled there, raising :class:`HostDecisionTimeout`. Cancelling the caller
    cancels the awaitable too. A sync callback has already returned when this is called: it ran on the event
    loop's thread and nothing could interrupt it (the deadline is observed after it returns)."""
    if not inspect.isawaitable(decision):
        return decision
    if deadline is None:
        return await decision
    timeout = asyncio.timeout(deadline - time.monotonic())
    try:
        async with timeout:
            return await decision
    except TimeoutError:
        if timeout.expired():
            raise HostDecisionTimeout() from None
        raise


async def _ask(admit: Admit, relative: str, kind: EntryKind, deadline: float | None, stats: WalkStats) -> bool | None:
    """``admit``'s answer, a refusal recorded in ``stats.denied``; ``None`` (reason ``timeout``) when an
    async answer did not come before the deadline."""
    try:
        admitted = bool(await await_decision(admit(relative, kind), deadline))
    except HostDecisionTimeout:
        stats.reason("timeout")
        return None
    if not admitted:
        stats.deny(relative, kind)
    return admitted
