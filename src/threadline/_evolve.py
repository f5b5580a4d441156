"""``evolve``: a cheap, unvalidated copy of a frozen pydantic record with some fields changed.

Its own module so that both :mod:`threadline.records` and :mod:`threadline.usage` (which a run record
holds) can use it without importing each other.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeVar

from pydantic import BaseModel

R = TypeVar("R", bound=BaseModel)
_new = object.__new__
_set = object.__setattr__


def evolve(record: R, changes: Mapping[str, Any]) -> R:
    """``record.model_copy(update=changes)``: a new record with ``changes``, not validated (the caller vouches
    for them: the reducer's own values), and without ``model_copy``'s generic copying, which these records
    do not need (no extra fields, no private attributes). It runs several times per store operation."""
    new = _new(record.__class__)
    values = record.__dict__.copy()
    values.update(changes)
    _set(new, "__dict__", values)
    _set(new, "__pydantic_extra__", None)
    fields_set = record.__pydantic_fields_set__
    if not fields_set.issuperset(changes):  # shared otherwise: nothing changes a frozen record's set in place
        fields_set = fields_set | changes.keys()
    _set(new, "__pydantic_fields_set__", fields_set)
    _set(new, "__pydantic_private__", None)
    return new


def build(template: R, values: Mapping[str, Any]) -> R:
    """A new record like ``template`` with ``values``, not validated, reporting exactly ``template``'s fields
    as set: for records made from values the caller vouches for, copying a template that was validated once
    and constructed with the very fields the construction it stands for names. A mutable field's value
    (a dict) is shared with the template unless ``values`` gives a fresh one."""
    new = _new(template.__class__)
    fields = template.__dict__.copy()
    fields.update(values)
    _set(new, "__dict__", fields)
    _set(new, "__pydantic_extra__", None)
    _set(new, "__pydantic_fields_set__", template.__pydantic_fields_set__)
    _set(new, "__pydantic_private__", None)
    return new
