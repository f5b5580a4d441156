"""The ledger from the command line: ``threadline inspect events`` reads the journal (``--follow`` tails it),
``threadline export`` writes a conversation's archive, ``threadline import`` restores one, ``threadline
branch`` copies a settled prefix into a new conversation.

``inspect events`` and ``export`` only read. ``import`` and ``branch`` write one transaction each, after
the whole archive or request was validated; a refusal is one ``error:`` line naming its code.
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from rich import box
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from ..ledger.events import AgentStoreEvent
from .common import CliUsageError, open_store
from .render import short

FOLLOW_POLL = 0.5
"""Seconds between two reads of a followed journal's tail."""


def _summary(event: AgentStoreEvent) -> str:
    """One line saying what an event records (its payload, abridged)."""
    p: Any = event.payload if isinstance(event.payload, dict) else {}
    kind = event.kind
    if kind == "runtime/transition":
        command = p.get("input", {})
        run = command.get("run_id")
        detail = {
            "accept": lambda: f"input {command.get('input', {}).get('id')} -> run {short(run or '')}",
            "terminal": lambda: f"run {short(run or '')} {command.get('terminal_reason')}",
            "checkpoint": lambda: f"run {short(run or '')} draft {command.get('assistant', {}).get('parts')} parts",
            "recover": lambda: f"run {short(run or '')} {command.get('action')}",
            "compact": lambda: f"{len(command.get('replaced_message_ids', []))} messages -> summary",
            "seed": lambda: f"seed {command.get('seed_key')}",
        }.get(p.get("type"), lambda: f"run {short(run)}" if run else "")()
        operation = command.get("operation")
        if operation:
            detail += f" · {operation.get('kind')} {operation.get('phase')} step {operation.get('step')}"
        return f"{p.get('type')} v{p.get('version')}: {detail}"
    if kind == "provider/request":
        prefix = p.get("prefix", {})
        return (
            f"run {short(p.get('run_id', ''))} step {p.get('step_number')} attempt {p.get('attempt')}: "
            f"prefix {prefix.get('count')} messages (+{len(prefix.get('added', []))}), "
            f"tail {len(p.get('message_shas', []))}"
        )
    if kind == "provider/message":
        return f"body {str(p.get('sha256', ''))[:12]}"
    if kind == "provider/response":
        response = p.get("response", {})
        return f"run {short(p.get('run_id', ''))} step {p.get('step_number')}: {response.get('id')}"
    if kind == "runtime/baseline":
        return f"{len(p.get('messages', []))} messages, {len(p.get('runs', []))} runs as of {p.get('as_of')}"
    return json.dumps(p, ensure_ascii=False)[:160]


def _event_json(event: AgentStoreEvent) -> dict[str, Any]:
    return event.model_dump(mode="json", exclude_none=True)


async def _events(store: Any, conversation: str, from_seq: int, limit: int) -> AsyncIterator[AgentStoreEvent]:
    seq: int | None = from_seq
    left = limit
    while seq is not None and left > 0:
        page = await store.read_events(conversation_id=conversation, from_seq=seq, limit=min(left, 10_000))
        for event in page.items:
            yield event
        left -= len(page.items)
        seq = page.next_seq


async def _collect(store: Any, conversation: str | None, from_seq: int, limit: int) -> list[AgentStoreEvent]:
    if conversation is not None:
        return [e async for e in _events(store, conversation, from_seq, limit)]
    out: list[AgentStoreEvent] = []
    cursor = None
    while len(out) < limit:
        page = await store.conversations.list(limit=100, cursor=cursor)
        for head in page.items:
            out += [e async for e in _events(store, head.conversation_id, from_seq, limit - len(out))]
        cursor = page.next_cursor
        if cursor is None:
            break
    return out


def _table(events: list[AgentStoreEvent], with_conversation: bool) -> Table:
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False)
    columns = (["conversation"] if with_conversation else []) + ["seq", "at", "kind", "what"]
    for column in columns:
        table.add_column(column, overflow="fold", ratio=1) if column == "what" else table.add_column(
            column, no_wrap=True
        )
    for e in events:
        at = e.occurred_at.astimezone().strftime("%m-%d %H:%M:%S")
        cells = [str(e.seq), at, e.kind, escape(_summary(e))]
        table.add_row(*([escape(e.conversation_id)] if with_conversation else []), *cells)
    return table


async def _inspect_events(
    db: Path | None,
    dsn: str | None,
    schema: str | None,
    conversation: str | None,
    from_seq: int,
    limit: int,
    as_json: bool,
    follow: bool,
) -> None:
    if follow and conversation is None:
        raise CliUsageError("--follow tails one conversation: pass --conversation")
    console = Console(highlight=False)
    async with open_store(db, dsn, create=False, schema=schema) as opened:
        store = opened.store
        events = await _collect(store, conversation, from_seq, limit)
        if as_json and not follow:
            print(json.dumps([_event_json(e) for e in events], indent=2, ensure_ascii=False))
            return
        if not follow:
            console.print(_table(events, conversation is None) if events else "(no events)")
            return
        assert conversation is not None
        seq = events[-1].seq + 1 if events else from_seq
        for e in events:  # then one line (or JSON document) per event as it is appended
            _print_line(console, e, as_json)
        while True:
            page = await store.read_events(conversation_id=conversation, from_seq=seq, limit=1000)
            for e in page.items:
                _print_line(console, e, as_json)
                seq = e.seq + 1
            sys.stdout.flush()
            if page.next_seq is None:
                await asyncio.sleep(FOLLOW_POLL)


def _print_line(console: Console, event: AgentStoreEvent, as_json: bool) -> None:
    if as_json:
        print(json.dumps(_event_json(event), ensure_ascii=False), flush=True)
    else:
        at = event.occurred_at.astimezone().strftime("%H:%M:%S")
        console.print(f"{event.seq:>6} {at} {event.kind:<28} {escape(_summary(event))}", soft_wrap=True)


def inspect_events_command(
    *,
    db: Path | None,
    dsn: str | None,
    schema: str | None,
    conversation: str | None,
    from_seq: int,
    limit: int,
    as_json: bool,
    follow: bool,
) -> None:
    asyncio.run(_inspect_events(db, dsn, schema, conversation, from_seq, limit, as_json, follow))


async def _export(db: Path | None, dsn: str | None, schema: str | None, conversation: str, out: Path | None) -> int:
    async with open_store(db, dsn, create=False, schema=schema) as opened:
        data = await opened.store.export_conversation(conversation)
    if out is None:
        sys.stdout.buffer.write(data)
        sys.stdout.buffer.flush()
    else:
        out.write_bytes(data)
    return len(data)


def export_command(
    *, db: Path | None, dsn: str | None, schema: str | None, conversation: str, out: Path | None
) -> None:
    size = asyncio.run(_export(db, dsn, schema, conversation, out))
    if out is not None:
        print(f"exported {conversation} to {out} ({size} bytes)", file=sys.stderr)


async def _import(db: Path | None, dsn: str | None, schema: str | None, data: bytes) -> Any:
    async with open_store(db, dsn, create=True, schema=schema) as opened:
        return await opened.store.import_conversation(data)


def import_command(*, db: Path | None, dsn: str | None, schema: str | None, archive: Path) -> None:
    data = sys.stdin.buffer.read() if str(archive) == "-" else archive.read_bytes()
    result = asyncio.run(_import(db, dsn, schema, data))
    print(f"imported {result.conversation_id} ({result.events} events)")


async def _branch(
    db: Path | None, dsn: str | None, schema: str | None, request_key: str, destination: str, source: dict[str, Any]
) -> Any:
    async with open_store(db, dsn, create=False, schema=schema) as opened:
        return await opened.store.branch_conversation(
            request_key=request_key, destination_conversation_id=destination, source=source
        )


def branch_command(
    *,
    db: Path | None,
    dsn: str | None,
    schema: str | None,
    request_key: str,
    destination: str,
    source_conversation: str | None,
    archive: Path | None,
    through_run: str | None,
    as_json: bool,
) -> None:
    if (source_conversation is None) == (archive is None):
        raise CliUsageError("pass exactly one of --from (a conversation) or --archive (a file)")
    source: dict[str, Any] = (
        {"kind": "conversation", "conversation_id": source_conversation}
        if source_conversation is not None
        else {"kind": "archive", "bytes": archive.read_bytes()}  # type: ignore[union-attr]
    )
    if through_run:
        source["through_run_id"] = through_run
    result = asyncio.run(_branch(db, dsn, schema, request_key, destination, source))
    if as_json:
        print(json.dumps(result.model_dump(mode="json"), indent=2))
        return
    r = result.receipt
    print(
        f"{result.outcome}: {r.destination_conversation_id} from {r.source_kind} {r.source_conversation_id} "
        f"through seq {r.source_seq} (version {r.source_version})"
    )
