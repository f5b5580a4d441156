"""``search_files``: bounded path or content search over the workspace, every regex in linear time.

Regular expressions run on RE2 (the ``google-re2`` package, ``threadline[coding]``): a pattern costs time
linear in the text whatever its shape, so ``(a+)+$`` on a long line costs what ``a+`` does. That is where
threadline does better than the seeds, which run most lines on a backtracking engine and skip lines over
8,192 bytes: here every line is searched, whatever its length; only the *returned* text of a line is cut at
8,192 bytes (on a character boundary, with ``text_truncated``). Constructs RE2 cannot run in linear time —
backreferences and lookaround — refuse before any I/O with a hint. Patterns use the usual syntax (groups,
alternation, classes, ``\\b``, quantifiers, ``(?ims-ims:…)`` modifiers; the JavaScript spellings ``\\uXXXX``,
``\\cX``, ``[\\b]``, ``[]`` and ``[^]`` are rewritten for RE2); ``^``/``$`` match at line boundaries and
no match spans a newline.

A content search reads one file at a time, each whole and at most ``max_read_bytes`` (a larger file is
skipped: reason ``max-read-bytes``), into one buffer the whole search reuses, within the aggregate
``max_search_bytes``; a NUL in the first 64 KiB marks a binary file, skipped unread beyond that block
(``binary``). The bytes are searched before anything is decoded — a literal on RE2 too (its prefix
accelerator outruns ``bytes.find``), byte for byte — so the many files without a match cost no decoding. A
file with a match must be strict UTF-8, else its matches are withheld (``invalid-utf8``); a file without one
needs no such check, since "no match here" is exact whatever its encoding (the seeds decode every file
first and would mark it). The walk, its budgets and the coverage report are the discovery tools'.
"""

from __future__ import annotations

import contextlib
import os
import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from ..tools import AgentTool, define_agent_tool

try:
    import re2
except ImportError as error:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "threadline's coding search needs google-re2; install it with: pip install 'threadline[coding]'"
    ) from error

from .discovery import (
    OutputBudget,
    coverage,
    diagnostics,
    excluded_by,
    new_stats,
    observe_deadline,
    open_discovery_base,
    scope_of,
    walk_limits,
)
from .globs import MAX_GLOB_PATTERN_CHARS, compile_glob, utf16_units
from .policy import CodingConfig, authorize, path_decision, refuse, workspace_refusals
from .workspace import WalkStats, WorkspaceError

__all__ = ("MAX_LINE_BYTES", "MAX_QUERY_CHARS", "compile_search_regex", "create_search_tools")

MAX_QUERY_CHARS = 8_192
"""The longest query, in UTF-16 code units (a character beyond U+FFFF counts two)."""
MAX_LINE_BYTES = 8_192
MAX_CONTEXT_LINES = 10
_BINARY_PROBE = 65_536

_LOOKAROUND = ("(?=", "(?!", "(?<=", "(?<!")


def include_hint(rejected: int) -> str:
    """The hint of a search whose include pattern rejected every file or directory it was compared with
    (``rejected`` of them) — given only when the include is what produced the zero, never for an empty
    workspace or files the host refused. The pattern itself is in ``coverage.scope.include``."""
    noun = "file or directory" if rejected == 1 else "files or directories"
    return (
        f"the anchored include pattern (coverage.scope.include) rejected all {rejected} {noun} it was compared "
        "with; '*' does not cross '/', so use a pattern such as '**/*.py' for files in subdirectories"
    )


def _unbounded_construct(pattern: str) -> str | None:
    """The first construct RE2 cannot run in linear time (a backreference or lookaround), else None."""
    index, in_class = 0, False
    while index < len(pattern):
        char = pattern[index]
        if char == "\\":
            following = pattern[index + 1 : index + 2]
            if not in_class and (following in tuple("123456789") or following == "k"):
                return "backreference"
            index += 2
            continue
        if in_class:
            if char == "]":
                in_class = False
        elif char == "[":
            in_class = True
        elif pattern.startswith(_LOOKAROUND, index):
            return "lookaround"
        index += 1
    return None


_HEX = frozenset("0123456789abcdefABCDEF")


def _unicode_escape(pattern: str, index: int) -> int | None:
    """The code unit of a ``\\uXXXX`` escape at ``index`` (the backslash), else None."""
    digits = pattern[index + 2 : index + 6]
    return int(digits, 16) if len(digits) == 4 and all(c in _HEX for c in digits) else None


def _javascript_escapes(pattern: str) -> str:
    """Rewrite the JavaScript spellings RE2 does not read into RE2's: ``\\uXXXX`` (a surrogate pair is one
    character) as ``\\x{...}``, ``\\cX`` as its control character, ``[\\b]`` (backspace in a class),
    the empty class ``[]`` (matches nothing) and ``[^]`` (any character). A lone surrogate refuses: it
    cannot occur in UTF-8 text. Everything else is left for RE2 to read (or refuse)."""
    if "\\u" not in pattern and "\\c" not in pattern and "[" not in pattern:
        return pattern
    out: list[str] = []
    index, in_class = 0, False
    while index < len(pattern):
        char = pattern[index]
        if char == "\\":
            following = pattern[index + 1 : index + 2]
            unit = _unicode_escape(pattern, index) if following == "u" else None
            if unit is not None:
                width = 6
                if 0xD800 <= unit <= 0xDBFF and pattern[index + 6 : index + 8] == "\\u":
                    low = _unicode_escape(pattern, index + 6)
                    if low is not None and 0xDC00 <= low <= 0xDFFF:
                        unit, width = 0x10000 + ((unit - 0xD800) << 10) + (low - 0xDC00), 12
                if 0xD800 <= unit <= 0xDFFF:
                    refuse(
                        "BAD_REQUEST",
                        "this pattern names a lone UTF-16 surrogate, which cannot occur in UTF-8 text",
                        hint="name the whole character (a surrogate pair, or the character itself)",
                        pattern=pattern,
                    )
                out.append(f"\\x{{{unit:X}}}")
                index += width
                continue
            letter = pattern[index + 2 : index + 3]
            if following == "c" and letter.isascii() and letter.isalpha():
                out.append(f"\\x{{{ord(letter) % 32:02X}}}")
                index += 3
                continue
            if in_class and following == "b":
                out.append("\\x08")
                index += 2
                continue
            out.append(pattern[index : index + 2])
            index += 2
            continue
        if in_class:
            if char == "]":
                in_class = False
        elif char == "[":
            if pattern.startswith("[]", index):
                out.append("[^\\x00-\\x{10FFFF}]")
                index += 2
                continue
            if pattern.startswith("[^]", index):
                out.append("(?s:.)")
                index += 3
                continue
            in_class = True
            out.append(pattern[index : index + 2] if pattern.startswith("[^", index) else char)
            index += 2 if pattern.startswith("[^", index) else 1
            continue
        out.append(char)
        index += 1
    return "".join(out)


def compile_search_regex(pattern: str) -> Any:
    """Compile ``pattern`` for line-wise search on UTF-8 bytes; refuses ``BAD_REQUEST`` (before any I/O)
    for backreferences, lookaround and invalid syntax."""
    construct = _unbounded_construct(pattern)
    if construct is not None:
        refuse(
            "BAD_REQUEST",
            f"this pattern uses a {construct}, which search does not run",
            hint=(
                "every search runs in linear time, which rules out backreferences and lookaround; rewrite the "
                "pattern without them, or search for a literal with regex=false"
            ),
            pattern=pattern,
        )
    translated = _javascript_escapes(pattern)
    options = re2.Options()
    options.never_nl = True  # a match never spans lines
    options.never_capture = True
    options.log_errors = False
    try:
        return re2.compile(("(?m)" + translated).encode(), options)
    except re2.error as error:
        refuse(
            "BAD_REQUEST",
            "this pattern is not a valid regular expression",
            hint="fix the expression, or pass regex=false to search for the text literally",
            pattern=pattern,
            reason=_reason(error),
        )


def _literal_matcher(literal: bytes) -> Any:
    """RE2 matching ``literal`` byte for byte (Latin-1 mode: every byte is one character, as bytes.find)."""
    options = re2.Options()
    options.literal = True
    options.encoding = re2.Options.Encoding.LATIN1
    options.never_capture = True
    options.log_errors = False
    return re2.compile(literal, options)


def _reason(error: Exception) -> str:
    first = error.args[0] if error.args else error
    text = first.decode(errors="replace") if isinstance(first, bytes) else str(first)
    return text[:200]


def _cut_line(line: bytes) -> tuple[str, bool]:
    if len(line) <= MAX_LINE_BYTES:
        return line.decode("utf-8", "replace"), False
    cut = MAX_LINE_BYTES
    while cut > 0 and line[cut] & 0xC0 == 0x80:
        cut -= 1
    return line[:cut].decode("utf-8", "replace"), True


def _lines_before(data: bytes, line_start: int, count: int) -> list[str]:
    lines: list[str] = []
    end = line_start - 1  # the newline ending the previous line
    while count > 0 and end >= 0:
        start = data.rfind(b"\n", 0, end) + 1
        lines.append(_cut_line(data[start:end])[0])
        end = start - 1
        count -= 1
    lines.reverse()
    return lines


def _lines_after(data: bytes, line_end: int, count: int) -> list[str]:
    lines: list[str] = []
    start = line_end + 1
    while count > 0 and start <= len(data) and line_end < len(data):
        end = data.find(b"\n", start)
        if end < 0:
            end = len(data)
        if start == end == len(data):
            break
        lines.append(_cut_line(data[start:end])[0])
        start = end + 1
        line_end = end
        count -= 1
    return lines


class SearchFilesArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")
    # the length limits (UTF-16 code units) are checked by the tool, which refuses BAD_REQUEST; the schema
    # still advertises them to the model
    query: str = Field(
        min_length=1, json_schema_extra={"maxLength": MAX_QUERY_CHARS}, description="Text (or regex) to find."
    )
    mode: Literal["content", "path"] = Field("content", description="Search file contents, or file paths.")
    regex: bool = Field(False, description="Treat query as a regular expression (linear-time RE2 syntax).")
    context: int = Field(0, ge=0, le=MAX_CONTEXT_LINES, description="Lines of context around each content match.")
    include: str | None = Field(
        None,
        min_length=1,
        json_schema_extra={"maxLength": MAX_GLOB_PATTERN_CHARS},
        description=(
            "Anchored pattern matched against the whole workspace-relative path. '*' does not cross '/'; "
            "use '**/*.py' for files in subdirectories."
        ),
    )


def create_search_tools(config: CodingConfig) -> list[AgentTool]:
    limits = config.limits

    @define_agent_tool(
        name="search_files",
        args=SearchFilesArgs,
        description=(
            "Search UTF-8 file contents (or paths) under the workspace for a literal or a regular expression; "
            "returns path, line and text per match, and coverage telling a complete empty result from partial work."
        ),
    )
    async def search_files(
        query: str,
        mode: Literal["content", "path"] = "content",
        regex: bool = False,
        context: int = 0,
        include: str | None = None,
    ) -> dict[str, Any]:
        started = time.monotonic()
        if utf16_units(query) > MAX_QUERY_CHARS:
            refuse(
                "BAD_REQUEST",
                f"a query is limited to {MAX_QUERY_CHARS} UTF-16 code units",
                hint="search for a shorter, distinctive part of the text",
            )
        matcher = compile_search_regex(query) if regex else None
        included = None
        if include is not None:
            try:
                included = compile_glob(include)
            except ValueError as error:
                refuse("BAD_REQUEST", f"include: {error}", hint="use '**', '*' and '?' in a relative pattern")
        scope = scope_of(config, base=".", symlinks="skipped", include=include)
        empty: dict[str, Any] = {
            "matches": [],
            "truncated": False,
            "scanned_files": 0,
            "skipped_directories": 0,
            "skipped_symlinks": 0,
            "coverage": coverage(new_stats(config), started=started, scope=scope, content_bytes=0),
        }
        if include is not None:
            empty["hint"] = include_hint(limits.max_search_entries)  # measured at its widest count
        budget = OutputBudget(limits.max_search_output_bytes, empty)
        if not budget.fits:
            refuse(
                "BAD_REQUEST",
                "the smallest result for this search would not fit the output limit",
                hint="use a shorter include pattern",
            )
        async with workspace_refusals():
            deadline = started + limits.search_timeout
            await authorize(config, {"operation": "search", "query": query, "mode": mode}, deadline=deadline)
            segments, fd = await open_discovery_base(config, ".", deadline)
            os.close(fd)
        stats = new_stats(config)
        run = _Search(config, stats, budget, query.encode(), matcher, context, mode)
        walk = config.workspace.walk(
            segments,
            limits=walk_limits(config, started),
            stats=stats,
            exclude=excluded_by(config),
            prune=included.may_contain if included is not None else None,
            include=(lambda relative: included.matches(relative)) if included is not None else None,
            admit=(lambda relative, kind: path_decision(config, relative)) if config.authorize_path else None,
        )
        async with contextlib.aclosing(walk):
            async for entry in walk:
                if not run.visit(entry):
                    break
        observe_deadline(stats, deadline)
        result: dict[str, Any] = {
            "matches": run.matches,
            "truncated": bool(stats.reasons),
            "scanned_files": run.scanned,
            "skipped_directories": stats.excluded_directories,
            "skipped_symlinks": stats.skipped_symlinks,
            **diagnostics(stats, budget),
            "coverage": coverage(stats, started=started, scope=scope, content_bytes=run.content_bytes),
        }
        rejected = stats.include_rejected + stats.pruned_directories
        if include is not None and run.scanned == 0 and stats.include_admitted == 0 and rejected:
            result["hint"] = include_hint(rejected)
        return result

    return [search_files]


class _Search:
    """The per-call state of one content or path search (one file at a time)."""

    def __init__(
        self,
        config: CodingConfig,
        stats: WalkStats,
        budget: OutputBudget,
        literal: bytes,
        matcher: Any,
        context: int,
        mode: str,
    ) -> None:
        self.limits = config.limits
        self.stats = stats
        self.budget = budget
        self.literal = literal
        self.regex = matcher
        # content: RE2 scans for a literal faster than bytes.find (its prefix accelerator; 1.6x on the
        # standard library's sources); a literal spanning lines keeps bytes.find, which can find it
        self.matcher = matcher if matcher is not None or b"\n" in literal else _literal_matcher(literal)
        self.context = context
        self.mode = mode
        self.matches: list[dict[str, Any]] = []
        self.scanned = 0
        self.content_bytes = 0
        self.buffer = bytearray(0)

    def _find(self, data: bytes, position: int) -> int:
        if self.matcher is None:
            return data.find(self.literal, position)
        found = self.matcher.search(data, position)
        return -1 if found is None else found.start()

    def _find_line(self, data: bytes, position: int) -> int:
        """The next match at or after ``position`` that lies on a line (an empty match after the final
        newline, or in an empty file, is not on one), else -1."""
        found = self._find(data, position)
        if found == len(data) and (not data or data[-1] == 0x0A):
            return -1
        return found

    def _find_path(self, path: bytes) -> bool:
        # a path is a few dozen bytes: bytes.find beats an RE2 call there
        return (path.find(self.literal) if self.regex is None else self._find(path, 0)) >= 0

    def _add(self, item: dict[str, Any]) -> bool:
        if not self.budget.take(item):
            self.stats.reason("max-search-output-bytes")
            return False
        self.matches.append(item)
        if len(self.matches) >= self.limits.max_search_results:
            self.stats.reason("max-search-results")  # conservatively partial: no lookahead match is read
            return False
        return True

    def visit(self, entry: Any) -> bool:
        """Search one file; False stops the search."""
        if self.mode == "path":
            self.scanned += 1
            if self._find_path(entry.path.encode()):
                return self._add({"path": entry.path})
            return True
        try:
            opened = entry.open()
        except WorkspaceError as error:
            self.stats.error(entry.path, "open", type(error).__name__.removeprefix("Workspace").removesuffix("Error"))
            return True
        with opened:
            size = opened.size
            if size > self.limits.max_read_bytes:
                self.stats.reason("max-read-bytes")
                return True
            if self.content_bytes + size > self.limits.max_search_bytes:
                self.stats.reason("max-search-bytes")
                return False
            try:
                # a NUL in the first block marks a binary file: skipped (reason "binary") without reading on
                length = self._read(opened.fd, 0, min(size, _BINARY_PROBE))
                if self.buffer.find(b"\x00", 0, length) >= 0:
                    self.content_bytes += length
                    self.stats.reason("binary")
                    return True
                if length < size:
                    length += self._read(opened.fd, length, size - length)
            except OSError:
                self.stats.error(entry.path, "read", "EIO")
                return True
        self.content_bytes += length
        # the bytes are searched first: a file that holds no match needs no decoding (the answer "nothing
        # here" is exact whatever its encoding); one that does must be strict UTF-8, else it is withheld
        content = memoryview(self.buffer)[:length] if self.matcher is not None else bytes(self.buffer[:length])
        found = self._find_line(content, 0)
        if found < 0:
            self.scanned += 1
            return True
        data = bytes(content)  # the few files with a match leave the shared buffer
        try:
            data.decode("utf-8")
        except UnicodeDecodeError:
            self.stats.reason("invalid-utf8")
            return True
        self.scanned += 1
        return self._search_content(entry.path, data, found)

    def _read(self, fd: int, offset: int, length: int) -> int:
        """Read up to ``length`` bytes at ``offset`` into the shared buffer (at the same offset, within its
        size); returns how many arrived (fewer at the end of the file). One buffer serves every file of the
        search — no allocation and no fresh pages per file; it grows to the largest file read (at most
        ``max_read_bytes``) and only bytes below the returned length belong to the current file."""
        end = offset + length
        if len(self.buffer) < end:  # grow, keeping the bytes below offset (this file's so far)
            grown = bytearray(max(end, min(2 * len(self.buffer), self.limits.max_read_bytes)))
            grown[:offset] = memoryview(self.buffer)[:offset]
            self.buffer = grown
        view = memoryview(self.buffer)
        done = 0
        while done < length:
            got = os.preadv(fd, [view[offset + done : end]], offset + done)
            if got == 0:
                break
            done += got
        return done

    def _search_content(self, path: str, data: bytes, found: int) -> bool:
        """Report the lines of ``data`` holding a match, from the first match at ``found``."""
        line_number, counted = 1, 0
        while True:
            line_start = data.rfind(b"\n", 0, found) + 1
            line_end = data.find(b"\n", found)
            if line_end < 0:
                line_end = len(data)
            line_number += data.count(b"\n", counted, line_start)
            counted = line_start
            text, cut = _cut_line(data[line_start:line_end])
            item: dict[str, Any] = {"path": path, "line": line_number, "text": text}
            if cut:
                item["text_truncated"] = True
            if self.context:
                item["before"] = _lines_before(data, line_start, self.context)
                item["after"] = _lines_after(data, line_end, self.context)
            if not self._add(item):
                return False
            if line_end >= len(data):
                return True
            found = self._find_line(data, line_end + 1)
            if found < 0:
                return True
