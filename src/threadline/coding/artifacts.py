"""Artifact stores for command output beyond the inline preview, and the ``read_output`` / ``search_output`` tools.

Two implementations of :class:`~threadline.coding.contract.AgentCodingArtifactStore`: in memory (bounded by
count and bytes, oldest evicted first) and SQLite (one table in a file of the host's choosing; a write is
durable when it returns). References are opaque (``art_`` + 32 hex digits) and scoped by conversation: a
reference from another conversation is absent, exactly like one that never existed
(``SPILL_REFERENCE_UNKNOWN``, 404).
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
import threading
import uuid
from collections import OrderedDict
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from ..errors import AgentConfigError
from ..tools import AgentTool, AgentToolContext, define_agent_tool
from .contract import AgentCodingArtifactSlice
from .policy import CodingConfig, authorize, maybe, refuse

__all__ = (
    "MemoryAgentCodingArtifactStore",
    "SqliteAgentCodingArtifactStore",
    "create_artifact_tools",
    "create_memory_agent_coding_artifact_store",
    "create_sqlite_agent_coding_artifact_store",
)

MAX_MATCH_TEXT_BYTES = 8_192


def _new_reference() -> str:
    return f"art_{uuid.uuid4().hex}"


def _search_lines(data: bytes, query: str, max_matches: int) -> list[dict[str, Any]]:
    matches: list[dict[str, Any]] = []
    for number, line in enumerate(data.decode("utf-8", "replace").split("\n"), start=1):
        if query in line:
            matches.append({"line": number, "text": line.encode()[:MAX_MATCH_TEXT_BYTES].decode("utf-8", "ignore")})
            if len(matches) >= max_matches:
                break
    return matches


class MemoryAgentCodingArtifactStore:
    """Artifacts in this process's memory: at most ``max_artifacts`` and ``max_total_bytes`` together (the
    oldest is evicted first). Nothing survives the process."""

    def __init__(self, *, max_artifacts: int = 256, max_total_bytes: int = 64 * 1024 * 1024) -> None:
        if max_artifacts < 1 or max_total_bytes < 1:
            raise AgentConfigError("the artifact store bounds must be positive", field="max_artifacts")
        self.max_artifacts = max_artifacts
        self.max_total_bytes = max_total_bytes
        self._items: OrderedDict[tuple[str, str], tuple[bytes, dict[str, Any] | None]] = OrderedDict()
        self._bytes = 0

    def write(self, *, scope: str, media_type: str, data: bytes, authorization: dict[str, Any] | None) -> str:
        reference = _new_reference()
        self._items[(scope, reference)] = (bytes(data), authorization)
        self._bytes += len(data)
        while len(self._items) > self.max_artifacts or (self._bytes > self.max_total_bytes and len(self._items) > 1):
            _, (old, _) = self._items.popitem(last=False)
            self._bytes -= len(old)
        return reference

    def read(self, *, scope: str, reference: str, offset: int, max_bytes: int) -> AgentCodingArtifactSlice | None:
        item = self._items.get((scope, reference))
        if item is None:
            return None
        return AgentCodingArtifactSlice(data=item[0][offset : offset + max_bytes], total_bytes=len(item[0]))

    def search(self, *, scope: str, reference: str, query: str, max_matches: int) -> list[dict[str, Any]] | None:
        item = self._items.get((scope, reference))
        return None if item is None else _search_lines(item[0], query, max_matches)

    def authorization(self, *, scope: str, reference: str) -> dict[str, Any] | None:
        item = self._items.get((scope, reference))
        return None if item is None else item[1]


class SqliteAgentCodingArtifactStore:
    """Artifacts in a SQLite file (table ``coding_artifacts``). Calls run on a worker thread, one at a time;
    a write is committed when it returns. ``close()`` closes the connection."""

    def __init__(self, path: str) -> None:
        self._connection = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._lock = threading.Lock()
        with self._lock:
            self._connection.execute("pragma journal_mode=wal")
            self._connection.execute(
                "create table if not exists coding_artifacts ("
                " scope text not null, reference text not null, media_type text not null,"
                " data blob not null, authorization text, created_at integer not null default (strftime('%s', 'now')),"
                " primary key (scope, reference))"
            )

    def _run(self, sql: str, parameters: tuple[Any, ...]) -> list[tuple[Any, ...]]:
        with self._lock:
            return self._connection.execute(sql, parameters).fetchall()

    async def write(self, *, scope: str, media_type: str, data: bytes, authorization: dict[str, Any] | None) -> str:
        reference = _new_reference()
        await asyncio.to_thread(
            self._run,
            "insert into coding_artifacts (scope, reference, media_type, data, authorization) values (?, ?, ?, ?, ?)",
            (scope, reference, media_type, bytes(data), None if authorization is None else json.dumps(authorization)),
        )
        return reference

    async def read(self, *, scope: str, reference: str, offset: int, max_bytes: int) -> AgentCodingArtifactSlice | None:
        rows = await asyncio.to_thread(
            self._run,
            "select substr(data, ?, ?), length(data) from coding_artifacts where scope = ? and reference = ?",
            (offset + 1, max_bytes, scope, reference),
        )
        if not rows:
            return None
        return AgentCodingArtifactSlice(data=bytes(rows[0][0] or b""), total_bytes=rows[0][1])

    async def search(self, *, scope: str, reference: str, query: str, max_matches: int) -> list[dict[str, Any]] | None:
        rows = await asyncio.to_thread(
            self._run, "select data from coding_artifacts where scope = ? and reference = ?", (scope, reference)
        )
        return None if not rows else _search_lines(bytes(rows[0][0]), query, max_matches)

    async def authorization(self, *, scope: str, reference: str) -> dict[str, Any] | None:
        rows = await asyncio.to_thread(
            self._run,
            "select authorization from coding_artifacts where scope = ? and reference = ?",
            (scope, reference),
        )
        return json.loads(rows[0][0]) if rows and rows[0][0] else None

    def close(self) -> None:
        with self._lock:
            self._connection.close()


def create_memory_agent_coding_artifact_store(
    *, max_artifacts: int = 256, max_total_bytes: int = 64 * 1024 * 1024
) -> MemoryAgentCodingArtifactStore:
    return MemoryAgentCodingArtifactStore(max_artifacts=max_artifacts, max_total_bytes=max_total_bytes)


def create_sqlite_agent_coding_artifact_store(path: str) -> SqliteAgentCodingArtifactStore:
    return SqliteAgentCodingArtifactStore(path)


class ReadOutputArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")
    reference: str = Field(min_length=1, max_length=256, description="The artifact reference run_command returned.")
    offset: int = Field(0, ge=0, description="Byte offset (next_offset of the previous slice).")
    max_bytes: int | None = Field(None, gt=0, description="Slice size in bytes (capped by the host's limit).")


def _unknown(reference: str) -> None:
    refuse(
        "SPILL_REFERENCE_UNKNOWN",
        f"no output is held under {reference!r}",
        hint="use the artifact reference the command that produced the output returned, not a call or session id",
        reference=reference,
    )


def create_artifact_tools(config: CodingConfig) -> list[AgentTool]:
    store, limits = config.artifacts, config.limits
    assert store is not None

    async def origin(ctx: AgentToolContext, reference: str) -> None:
        payload = await maybe(store.authorization(scope=ctx.conversation_id, reference=reference))
        if payload:
            await authorize(config, payload)  # the originating tool's admission, asked again

    @define_agent_tool(
        name="read_output",
        args=ReadOutputArgs,
        description="Read a bounded slice of a command's kept output (an artifact reference from run_command).",
    )
    async def read_output(
        ctx: AgentToolContext, reference: str, offset: int = 0, max_bytes: int | None = None
    ) -> dict[str, Any]:
        maximum = min(max_bytes or limits.max_read_bytes, limits.max_read_bytes)
        await authorize(
            config, {"operation": "artifact-read", "reference": reference, "offset": offset, "max_bytes": maximum}
        )
        await origin(ctx, reference)
        piece = await maybe(
            store.read(scope=ctx.conversation_id, reference=reference, offset=offset, max_bytes=maximum + 3)
        )
        if piece is None:
            _unknown(reference)
        data = piece.data
        start = offset
        if offset > 0:
            skip = 0
            while skip < min(3, len(data)) and data[skip] & 0xC0 == 0x80:
                skip += 1
            start, data = offset + skip, data[skip:]
        if len(data) > maximum:
            cut = maximum
            while cut > 0 and data[cut] & 0xC0 == 0x80:
                cut -= 1
            data = data[:cut]
        result: dict[str, Any] = {
            "reference": reference,
            "offset": start,
            "text": data.decode("utf-8", "replace"),
            "bytes": len(data),
        }
        if piece.total_bytes is not None:
            result["total_bytes"] = piece.total_bytes
            if start + len(data) < piece.total_bytes:
                result["next_offset"] = start + len(data)
        return result

    search_args = type(
        "SearchOutputArgs",
        (BaseModel,),
        {
            "__annotations__": {"reference": str, "query": str, "max_matches": int},
            "model_config": ConfigDict(extra="forbid"),
            "reference": Field(min_length=1, max_length=256, description="The artifact reference."),
            "query": Field(min_length=1, max_length=8_192, description="Literal text to find, line by line."),
            "max_matches": Field(20, ge=1, le=limits.max_search_results, description="Matching lines to return."),
        },
    )

    @define_agent_tool(
        name="search_output",
        args=search_args,
        description="Find the lines of a command's kept output that contain a literal text (line numbers from 1).",
    )
    async def search_output(ctx: AgentToolContext, reference: str, query: str, max_matches: int = 20) -> dict[str, Any]:
        await authorize(
            config, {"operation": "artifact-search", "reference": reference, "query": query, "max_matches": max_matches}
        )
        await origin(ctx, reference)
        found = await maybe(
            store.search(scope=ctx.conversation_id, reference=reference, query=query, max_matches=max_matches)
        )
        if found is None:
            _unknown(reference)
        return {"reference": reference, "matches": list(found)[:max_matches]}

    return [read_output, search_output]
