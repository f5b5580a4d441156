"""The reference driver: rows in dictionaries, one transaction at a time.

Durability is process-local: everything is gone when the process ends (tombstones too). Use it for tests
and as the model a new driver is checked against. Records are frozen but hold JSON containers, so every
record crossing the boundary is copied through its JSON form: a caller mutating a returned record can
never rewrite a stored row.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from datetime import datetime

from pydantic import BaseModel

from ..errors import AgentStoreUnavailableError
from ._memory_rows import T, _Conversation, _Rows
from .aggregate import AgentRuntimeStore, create_agent_runtime_store
from .driver import (
    Access,
    HeadState,
    Mutation,
    Operation,
    OperationStats,
    Write,
    drive_sync,
)


def _clone(value: T) -> T:
    """An independent copy of a record (or a list/answer of records), made through its JSON form — far
    cheaper than ``copy.deepcopy`` of pydantic models, and exactly what a real database hands back."""
    if isinstance(value, BaseModel):
        return type(value).model_validate_json(value.model_dump_json())  # type: ignore[return-value]
    if isinstance(value, list):
        return [_clone(v) for v in value]  # type: ignore[return-value]
    if isinstance(value, tuple):
        return tuple(_clone(v) for v in value)  # type: ignore[return-value]
    if isinstance(value, HeadState):
        return HeadState(_clone(value.head), value.purged)  # type: ignore[return-value]
    if isinstance(value, Write):
        m = value.mutation
        return Write(  # type: ignore[return-value]
            Mutation(
                head=_clone(m.head),
                runs=_clone(m.runs),
                messages=_clone(m.messages),
                receipts=_clone(m.receipts),
                seeds=_clone(m.seeds),
                events=_clone(m.events),
            )
        )
    return value


class _Copying:
    """Copies every record crossing the driver boundary, in both directions."""

    def __init__(self, rows: _Rows) -> None:
        self._rows = rows

    def __getattr__(self, name: str) -> object:
        method = getattr(self._rows, name)

        def call(request: object) -> object:
            return _clone(method(_clone(request)))

        return call


class MemoryStoreDriver:
    """In-process driver. Transactions are serialized by one lock; a failed operation writes nothing."""

    ledger = True
    """This driver keeps the event ledger (``threadline_events``)."""

    def __init__(self) -> None:
        self._tables: dict[str, _Conversation] = {}
        self._tombstones: set[str] = set()
        self._lock = asyncio.Lock()
        self._closed = False

    async def run(self, operation: Callable[[], Operation[T]], *, access: Access, stats: OperationStats) -> T:
        if self._closed:
            raise AgentStoreUnavailableError("the memory store was closed")
        async with self._lock:
            rows = _Rows(self._tables, self._tombstones)
            result = drive_sync(operation(), _Copying(rows), stats)
            if access == "write":
                rows.commit()
            else:
                assert not rows.staged, "a read operation wrote"
            return result

    async def aclose(self) -> None:
        self._closed = True


def create_memory_agent_runtime_store(*, clock: Callable[[], datetime] | None = None) -> AgentRuntimeStore:
    """A store whose durability ends with the process; the reference for every other driver. ``clock``
    (UTC-aware), as for every store factory, is injectable for tests. Close it with ``aclose()`` or
    ``async with``, like the SQLite and PostgreSQL handles."""
    driver = MemoryStoreDriver()
    return create_agent_runtime_store(driver) if clock is None else create_agent_runtime_store(driver, clock=clock)
