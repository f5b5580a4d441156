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

from ..ledger.events import AgentStoreEvent
from .common import CliUsageError, open_store
from .inspect import Column, find_conversations, plain_table, rich_table, utc_z

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
            "accept": lambda: f"input {command.get('input', {}).get('id')} -> run {run or ''}",
            "terminal": lambda: f"run {run or ''} {command.get('terminal_reason')}",
            "checkpoint": lambda: f"run {run or ''} draft {command.get('assistant', {}).get('parts')} parts",
            "recover": lambda: f"run {run or ''} {command.get('action')}",
            "compact": lambda: f"{len(command.get('replaced_message_ids', []))} messages -> summary",
            "seed": lambda: f"seed {command.get('seed_key')}",
        }.get(p.get("type"), lambda: f"run {run}" if run else "")()
        operation = command.get("operation")
        if operation:
            detail += f" · {operation.get('kind')} {operation.get('phase')} step {operation.get('step')}"
        return f"{p.get('type')} v{p.get('version')}: {detail}"
    if kind == "provider/request":
        prefix = p.get("prefix", {})
        return (
            f"run {p.get('run_id', '')} step {p.get('step_number')} attempt {p.get('attempt')}: "
            f"prefix {prefix.get('count')} messages (+{len(prefix.get('added', []))}), "
            f"tail {len(p.get('message_shas', []))}"
        )
    if kind == "provider/message":
        return f"body {p.get('sha256', '')}"
    if kind == "provider/response":
        response = p.get("response", {})
        served = f" ({response['provider']})" if response.get("provider") else ""
        return f"run {p.get('run_id', '')} step {p.get('step_number')}: {response.get('id')}{served}"
    if kind == "durability/effect":
        reconciled = " (reconciled)" if p.get("reconciled") else ""
        return f"run {p.get('run_id', '')} step {p.get('effect_name')!r} {p.get('status')}{reconciled}"
    if kind == "runtime/baseline":
        return f"{len(p.get('messages', []))} messages, {len(p.get('runs', []))} runs as of {p.get('as_of')}"
    return json.dumps(p, ensure_ascii=False)


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


def _columns(one_conversation: bool) -> list[Column]:
    return [
        *([] if one_conversation else [Column("conversation", lambda e: e.conversation_id)]),
        Column("seq", lambda e: str(e.seq)),
        Column("at", lambda e: utc_z(e.occurred_at) or ""),
        Column("kind", lambda e: e.kind),
        Column("what", _summary, text=True),
    ]


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
    out = sys.stdout
    async with open_store(db, dsn, create=False, schema=schema, read_only=True) as opened:
        store = opened.store
        events: list[AgentStoreEvent] = []
        heads = await find_conversations(opened, conversation)
        for head in heads:
            events += [e async for e in _events(store, head.conversation_id, from_seq, limit - len(events))]
            if len(events) >= limit:
                break
        if not follow:
            if as_json:
                out.write(json.dumps([_event_json(e) for e in events], indent=2, ensure_ascii=False) + "\n")
            elif not events:
                out.write("(no events)\n")
            elif out.isatty():
                rich_table(_columns(conversation is not None), events)
            else:
                out.write(plain_table(_columns(conversation is not None), events) + "\n")
            return
        followed = heads[0].conversation_id
        seq = events[-1].seq + 1 if events else from_seq
        for e in events:  # then one line (or JSON document) per event as it is appended
            _print_line(e, as_json)
        while True:
            page = await store.read_events(conversation_id=followed, from_seq=seq, limit=1000)
            for e in page.items:
                _print_line(e, as_json)
                seq = e.seq + 1
            out.flush()
            if page.next_seq is None:
                await asyncio.sleep(FOLLOW_POLL)


def _print_line(event: AgentStoreEvent, as_json: bool) -> None:
    """One event per line, never cut: its seq, UTC time, kind and what it records (or its JSON)."""
    if as_json:
        line = json.dumps(_event_json(event), ensure_ascii=False)
    else:
        line = f"{event.seq:>6} {utc_z(event.occurred_at)} {event.kind:<28} {_summary(event)}"
    sys.stdout.write(line.replace("\n", "\\n") + "\n")
    sys.stdout.flush()


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
    db: Path | None,
    dsn: str | None,
    schema: str | None,
    request_key: str,
    destination: str,
    source: dict[str, Any],
    artifact_authorization: Any,
) -> Any:
    async with open_store(db, dsn, create=False, schema=schema) as opened:
        return await opened.store.branch_conversation(
            request_key=request_key,
            destination_conversation_id=destination,
            source=source,
            artifact_authorization=artifact_authorization,
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
    artifact_authorization: str | None = None,
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
    authorization: Any = None
    if artifact_authorization is not None:
        try:
            authorization = json.loads(artifact_authorization)
        except ValueError as error:
            raise CliUsageError(f"--artifact-authorization is JSON: {error}") from error
    result = asyncio.run(_branch(db, dsn, schema, request_key, destination, source, authorization))
    if as_json:
        print(json.dumps(result.model_dump(mode="json"), indent=2))
        return
    r = result.receipt
    print(
        f"{result.outcome}: {r.destination_conversation_id} from {r.source_kind} {r.source_conversation_id} "
        f"through seq {r.source_seq} (version {r.source_version})"
    )
