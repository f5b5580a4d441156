"""Lossless JSON: the one rule for values threadline records from application code.

A durable step's value (:mod:`threadline.durability`) and a tool's result (:mod:`threadline.tools`) are
*lossless JSON*: ``None``, ``bool``, ``int``, finite ``float`` (not ``-0.0``), ``str`` (valid Unicode),
``list`` and ``dict`` with ``str`` keys — exact types, nested freely. Such a value reads back from its JSON
text exactly as it was, so what a live reader saw is what a stored reader sees. Anything else (``nan``,
``inf``, ``-0.0``, a lone surrogate, a tuple, a set, a ``str`` subclass, a cycle, ...) is refused with
:class:`LosslessJsonError`, naming the path of the offending value (``$.items[2].when``) and what is wrong
with it.

This module sits below everything that records application values and imports nothing of threadline.
"""

from __future__ import annotations

import json
import math
from typing import Any

__all__ = ("LosslessJsonError", "lossless_json")


class LosslessJsonError(ValueError):
    """A value is not lossless JSON: ``path`` names it (``$`` is the value itself), ``reason`` says why."""

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(f"{path}: {reason}")
        self.path = path
        self.reason = reason


class _Refused(Exception):
    def __init__(self, path: tuple[Any, ...] | None, reason: str) -> None:
        self.path = path
        self.reason = reason


def _render_path(node: tuple[Any, ...] | None) -> str:
    segments: list[str] = []
    while node is not None:
        node, segment = node
        segments.append(segment)
    out = "$"
    for segment in reversed(segments):
        if isinstance(segment, int):
            out += f"[{segment}]"
        elif segment.isidentifier():
            out += f".{segment}"
        else:
            out += f"[{json.dumps(segment, ensure_ascii=False)}]"
    return out


def _describe(value: Any) -> str:
    kind = type(value)
    name = kind.__name__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"
    if kind is float:
        return f"{value!r} is not a finite JSON number" if not math.isfinite(value) else "-0.0 is not lossless JSON"
    if kind is int:
        return "the integer has too many digits to encode"
    if kind is str:
        return "the string is not valid Unicode (it holds a lone surrogate)"
    if isinstance(value, str | int | float | list | dict):
        return f"{name} is a subclass of {kind.__mro__[1].__name__}; return the plain type"
    if isinstance(value, tuple | set | frozenset):
        return f"{name} is not JSON; return a list"
    if hasattr(value, "isoformat"):
        return f"{name} is not JSON; convert it to a string"
    return f"{name} is not JSON"


_INT_BITS_LIMIT = 14_000  # below sys.get_int_max_str_digits() at its default (4300 digits): no str() needed


def _copy(value: Any, path: tuple[Any, ...] | None, active: set[int]) -> Any:
    kind = type(value)
    if kind is str:
        if not value.isascii():
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                raise _Refused(path, _describe(value)) from None
        return value
    if value is None or kind is bool:
        return value
    if kind is int:
        if value.bit_length() > _INT_BITS_LIMIT:
            try:
                str(value)
            except ValueError:
                raise _Refused(path, _describe(value)) from None
        return value
    if kind is float:
        if not math.isfinite(value) or (value == 0.0 and math.copysign(1.0, value) < 0):
            raise _Refused(path, _describe(value))
        return value
    if kind is list:
        if id(value) in active:
            raise _Refused(path, "the list contains itself (a cycle)")
        active.add(id(value))
        copied = [_copy(item, (path, index), active) for index, item in enumerate(value)]
        active.discard(id(value))
        return copied
    if kind is dict:
        if id(value) in active:
            raise _Refused(path, "the dict contains itself (a cycle)")
        active.add(id(value))
        out: dict[str, Any] = {}
        for key, item in value.items():
            if type(key) is not str:
                raise _Refused(path, f"the dict has the key {key!r}, which is {type(key).__name__}, not str")
            out[_copy(key, (path, key), active)] = _copy(item, (path, key), active)
        active.discard(id(value))
        return out
    raise _Refused(path, _describe(value))


def lossless_json(value: Any) -> tuple[Any, str]:
    """A detached copy of ``value`` and its compact JSON text; :class:`LosslessJsonError` when ``value`` is
    not lossless JSON. Mutating the copy never changes ``value`` (nor the other way round)."""
    try:
        copied = _copy(value, None, set())
        text = json.dumps(copied, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    except _Refused as refused:
        raise LosslessJsonError(_render_path(refused.path), refused.reason) from None
    except RecursionError:
        raise LosslessJsonError("$", "the value is nested too deeply") from None
    return copied, text
