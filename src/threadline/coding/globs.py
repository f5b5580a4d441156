"""One finite glob automaton over path segments: it matches files and prunes incompatible directory prefixes.

The syntax is a deliberate subset: ``**`` as a whole segment spans zero or more directories, ``*`` matches
any run of characters within one segment (it never crosses ``/``), ``?`` one character; everything else is
literal. A pattern is anchored: it matches the whole path relative to its base. The automaton's states are
positions in the pattern's segments; a directory is worth opening only while some state is still live after
consuming its segments, so ``src/**/*.py`` never opens ``docs/``.
"""

from __future__ import annotations

import re

__all__ = ("MAX_GLOB_PATTERN_CHARS", "GlobPattern", "compile_glob", "utf16_units")

MAX_GLOB_PATTERN_CHARS = 4_096
"""The longest glob or ``include`` pattern, in UTF-16 code units (a character beyond U+FFFF counts two)."""


def utf16_units(text: str) -> int:
    """The length of ``text`` in UTF-16 code units, the unit the seeds' pattern and query limits count."""
    return len(text) + sum(1 for char in text if ord(char) > 0xFFFF)


def _segment_regex(segment: str) -> re.Pattern[str] | None:
    """``None`` for a literal segment (compared by equality), else an anchored regex of its wildcards."""
    if "*" not in segment and "?" not in segment:
        return None
    parts: list[str] = []
    previous_star = False
    for char in segment:
        if char == "*":
            if not previous_star:  # runs of '*' inside a segment mean one '*' (no catastrophic nesting)
                parts.append("[^/]*")
            previous_star = True
            continue
        previous_star = False
        parts.append("[^/]" if char == "?" else re.escape(char))
    return re.compile("".join(parts), re.DOTALL)


class GlobPattern:
    """A compiled pattern. :meth:`matches` tests a relative file path; :meth:`may_contain` tells whether a
    directory (relative path) could hold a match below it."""

    def __init__(self, pattern: str) -> None:
        self.pattern = pattern
        raw = pattern.split("/")
        self._segments: list[str] = []
        for segment in raw:  # consecutive '**' are one
            if segment == "**" and self._segments and self._segments[-1] == "**":
                continue
            self._segments.append(segment)
        self._regexes = [None if s == "**" else _segment_regex(s) for s in self._segments]
        self._end = len(self._segments)
        self._cache: dict[str, frozenset[int]] = {}

    def _closure(self, states: frozenset[int]) -> frozenset[int]:
        out = set(states)
        for state in sorted(states):
            position = state
            while position < self._end and self._segments[position] == "**":
                position += 1
                out.add(position)
        return frozenset(out)

    def _step(self, states: frozenset[int], name: str) -> frozenset[int]:
        following: set[int] = set()
        for state in states:
            if state >= self._end:
                continue
            segment = self._segments[state]
            if segment == "**":
                following.add(state)  # '**' consumes this segment and stays
                continue
            regex = self._regexes[state]
            if (regex.fullmatch(name) is not None) if regex is not None else (segment == name):
                following.add(state + 1)
        return self._closure(frozenset(following))

    def _states(self, relative: str) -> frozenset[int]:
        """The live states after consuming ``relative``'s segments (memoised per directory prefix)."""
        cached = self._cache.get(relative)
        if cached is not None:
            return cached
        if relative in ("", "."):
            states = self._closure(frozenset({0}))
        else:
            head, _, name = relative.rpartition("/")
            states = self._states(head)
            states = self._step(states, name) if states else states
        if len(self._cache) >= 8_192:
            self._cache.clear()
        self._cache[relative] = states
        return states

    def matches(self, relative: str) -> bool:
        return self._end in self._states(relative)

    def may_contain(self, relative_directory: str) -> bool:
        """False when no path below this directory can match (the directory need not be opened)."""
        return any(state < self._end for state in self._states(relative_directory))


def compile_glob(pattern: str) -> GlobPattern:
    """Compile ``pattern``; raises ``ValueError`` naming what is wrong (empty, too long, absolute, a ``..``,
    ``.`` or empty segment, a backslash, NUL)."""
    if not pattern:
        raise ValueError("a glob pattern cannot be empty")
    if len(pattern) > MAX_GLOB_PATTERN_CHARS or utf16_units(pattern) > MAX_GLOB_PATTERN_CHARS:
        raise ValueError(f"a glob pattern is limited to {MAX_GLOB_PATTERN_CHARS} UTF-16 code units")
    if "\x00" in pattern or "\\" in pattern:
        raise ValueError("a glob pattern cannot contain a NUL or a backslash (use '/')")
    if pattern.startswith("/"):
        raise ValueError("a glob pattern is relative to its base path; it cannot start with '/'")
    for segment in pattern.split("/"):
        if segment in ("", ".", ".."):
            raise ValueError("a glob pattern cannot contain an empty, '.' or '..' segment")
    return GlobPattern(pattern)
