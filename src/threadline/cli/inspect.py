"""``threadline inspect conversations | runs | messages | events``: read a database, print a table or JSON.

Reads only: a SQLite file is opened read-only (SQLite's ``mode=ro``: nothing is created, migrated or
written), and a PostgreSQL schema that does not exist is an error, never created. Reads go through the
store's paged readers and per-conversation loads.

Three outputs: ``--json`` (one document; records as their JSON form, every timestamp UTC ``...Z``, events
as structured fields); a Rich table when stdout is a terminal (fitted to its width: a cell too narrow
folds onto more lines, never cut off); and, when stdout is not a terminal (a pipe, a file), plain aligned
columns that are never truncated or wrapped, one row per line (a newline inside a message is written
``\\n``), without loading Rich.
Ids are always shown in full; ``--conversation`` also takes any unique prefix of one.

The ``events`` command reads the event ledger (:mod:`threadline.cli.ledger`) with the same rules.
"""

from __future__ import annotations

import asyncio
import json
import sys
import typing
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from ..records import ConversationHead, Message, MessageStatus, Run, RunState
from .common import CliUsageError, OpenStore, open_store

RUN_STATES = typing.get_args(RunState)
MESSAGE_STATUSES = typing.get_args(MessageStatus)
PAGE = 500
TEXT_MIN = 20
"""Columns a terminal table keeps for free text before it folds ids too."""
AMBIGUOUS_SHOWN = 5
"""Candidates named when a ``--conversation`` prefix matches more than one conversation."""


def _check_state(kind: str, state: str | None) -> None:
    if state is None:
        return
    allowed = MESSAGE_STATUSES if kind == "messages" else RUN_STATES
    if state not in allowed:
        what = "message status" if kind == "messages" else "run state"
        raise CliUsageError(f"unknown {what} {state!r}; choose one of: {', '.join(allowed)}")


def utc_z(value: datetime | None) -> str | None:
    """The one timestamp format of ``--json``: ISO 8601 in UTC with ``Z`` (as the records serialize)."""
    if value is None:
        return None
    return value.astimezone(UTC).isoformat().replace("+00:00", "Z")


def _when(value: datetime | None) -> str:
    """A table's timestamp: UTC, to the second, with ``Z`` (a table is compared with ``--json``)."""
    return value.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%SZ") if value is not None else "—"


# ------------------------------------------------------------------------------------------ collect


async def _all_heads(opened: OpenStore) -> list[ConversationHead]:
    heads: list[ConversationHead] = []
    cursor = None
    while True:
        page = await opened.conversations.list(limit=PAGE, cursor=cursor)
        heads.extend(page.items)
        if page.next_cursor is None:
            return heads
        cursor = page.next_cursor


async def find_conversations(opened: OpenStore, conversation: str | None) -> list[ConversationHead]:
    """Every conversation, or the one ``conversation`` names: its exact id, else the only id it prefixes."""
    heads = await _all_heads(opened)
    if conversation is None:
        return heads
    exact = [h for h in heads if h.conversation_id == conversation]
    if exact:
        return exact
    matches = [h for h in heads if h.conversation_id.startswith(conversation)]
    if len(matches) == 1:
        return matches
    if not matches:
        raise CliUsageError(f"no conversation {conversation!r} (nor one starting with it) in {opened.where}")
    shown = ", ".join(h.conversation_id for h in matches[:AMBIGUOUS_SHOWN])
    more = f" and {len(matches) - AMBIGUOUS_SHOWN} more" if len(matches) > AMBIGUOUS_SHOWN else ""
    raise CliUsageError(f"{conversation!r} starts {len(matches)} conversation ids ({shown}{more}); give more of it")


async def _runs(opened: OpenStore, head: ConversationHead) -> list[Run]:
    snapshot = await opened.store.load_snapshot(conversation_id=head.conversation_id)
    return sorted(snapshot.runs, key=lambda r: r.admission_sequence)


async def _conversations(opened: OpenStore, state: str | None, limit: int) -> list[dict[str, Any]]:
    rows = []
    for head in await find_conversations(opened, None):
        if state is not None:
            runs = await _runs(opened, head)
            if not any(r.state == state for r in runs):
                continue
        active = await opened.store.list_active_runs(conversation_id=head.conversation_id)
        rows.append(
            {
                "conversation_id": head.conversation_id,
                "version": head.version,
                "runs": head.admission_seq,
                "messages": head.message_seq,
                "active_runs": [{"run_id": r.id, "state": r.state} for r in active.runs],
                "created_at": head.created_at,
                "updated_at": head.updated_at,
            }
        )
        if len(rows) >= limit:
            break
    return rows


async def _all_runs(opened: OpenStore, conversation: str | None, state: str | None, limit: int) -> list[Run]:
    out: list[Run] = []
    for head in await find_conversations(opened, conversation):
        out.extend(r for r in await _runs(opened, head) if state is None or r.state == state)
        if len(out) >= limit:
            return out[:limit]
    return out


async def _messages(opened: OpenStore, conversation: str | None, state: str | None, limit: int) -> list[Message]:
    out: list[Message] = []
    for head in await find_conversations(opened, conversation):
        picked: list[Message] = []
        cursor = None
        while len(picked) < limit:  # newest first, page by page, until `limit` match
            page = await opened.conversations.messages(
                head.conversation_id, limit=min(PAGE, max(limit, 1)), direction="before", cursor=cursor
            )
            picked[:0] = [m for m in page.items if state is None or m.status == state]
            if page.next_cursor is None:
                break
            cursor = page.next_cursor
        out.extend(picked[-limit:])
    return out


# ------------------------------------------------------------------------------------------- tables


@dataclass
class Column:
    """One table column: its header, how a row fills it, and whether it is free text (folds on a terminal)."""

    header: str
    cell: Callable[[Any], str]
    text: bool = False


def _message_text(m: Message) -> str:
    text = " ".join(p.text for p in m.parts if p.type == "text")
    return text or ", ".join(p.type for p in m.parts) or "—"


def _reason(run: Run) -> str:
    reason = run.terminal_reason or "—"
    return f"{reason} ({run.policy_name})" if run.policy_name else reason


def columns(kind: str, one_conversation: bool) -> list[Column]:
    """The table of ``kind``; the conversation column is left out when one conversation was asked for."""
    conversation = [] if one_conversation else [Column("conversation", lambda r: _get(r, "conversation_id"))]
    if kind == "conversations":
        return [
            Column("conversation", lambda r: r["conversation_id"]),
            Column("version", lambda r: str(r["version"])),
            Column("runs", lambda r: str(r["runs"])),
            Column("messages", lambda r: str(r["messages"])),
            Column("updated", lambda r: _when(r["updated_at"])),
            Column("active runs", lambda r: ", ".join(f"{a['run_id']} {a['state']}" for a in r["active_runs"]) or "—"),
        ]
    if kind == "runs":
        return [
            *conversation,
            Column("run", lambda r: r.id),
            Column("state", lambda r: r.state),
            Column("terminal reason", _reason),
            Column(
                "policy", lambda r: r.input_policy if r.priority == "ordinary" else f"{r.input_policy} {r.priority}"
            ),
            Column("inputs", lambda r: str(len(r.input_message_ids))),
            Column("owner", lambda r: f"{r.owner_id} #{r.fencing_token}" if r.owner_id else "—"),
            Column("failure", lambda r: f"{r.failure.origin}: {r.failure.summary}" if r.failure else "—", text=True),
        ]
    return [
        *conversation,
        Column("pos", lambda m: str(m.position) if m.position is not None else "—"),
        Column("role", lambda m: m.role),
        Column("status", lambda m: m.status),
        Column("run", lambda m: m.run_id or "—"),
        Column("text", _message_text, text=True),
    ]


def _get(row: Any, name: str) -> str:
    return row[name] if isinstance(row, dict) else getattr(row, name)


def plain_table(cols: list[Column], rows: list[Any]) -> str:
    """Aligned columns, every value in full: what a pipe or a file gets (``grep``, ``less -S``, ``cut``)."""
    grid = [[c.header for c in cols]]
    grid += [[c.cell(row).replace("\r", "\\r").replace("\n", "\\n") for c in cols] for row in rows]
    widths = [max(len(line[i]) for line in grid) for i in range(len(cols))]
    lines = []
    for line in grid:
        cells = [value.ljust(width) for value, width in zip(line, widths, strict=True)]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)


def rich_table(cols: list[Column], rows: list[Any]) -> None:
    """A table fitted to the terminal. Nothing is cut off: free text takes the spare width and folds, and a
    terminal too narrow for the ids folds them too (never an ellipsis)."""
    from rich import box
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    from .render import REASON_STYLE

    console = Console(highlight=False)
    grid = [[c.cell(row) for c in cols] for row in rows]
    # ids and times keep their full width while the free text still gets TEXT_MIN columns; narrower, they fold
    widths = [max(len(c.header), *(len(line[i]) for line in grid)) for i, c in enumerate(cols)]
    fixed = sum(w for w, c in zip(widths, cols, strict=True) if not c.text) + 3 * len(cols)
    keep = fixed + TEXT_MIN <= console.width
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False)
    for c, width in zip(cols, widths, strict=True):
        if c.text:
            table.add_column(c.header, overflow="fold", ratio=1)
        else:
            table.add_column(c.header, overflow="fold", min_width=width if keep else None)
    for line in grid:
        cells = []
        for c, value in zip(cols, line, strict=True):
            style = REASON_STYLE.get(value.split(" ", 1)[0], "red") if c.header == "terminal reason" else ""
            cells.append(Text(value, style=style if value != "—" else ""))
        table.add_row(*cells)
    console.print(table)


def _jsonable(kind: str, rows: list[Any]) -> list[Any]:
    if kind in ("runs", "messages"):
        return [r.model_dump(mode="json") for r in rows]
    stamped = ("at", "created_at", "updated_at")
    return [{k: utc_z(v) if k in stamped else v for k, v in row.items()} for row in rows]


async def _collect(
    kind: str,
    db: Path | None,
    dsn: str | None,
    schema: str | None,
    conversation: str | None,
    state: str | None,
    limit: int,
) -> tuple[list[Any], bool]:
    async with open_store(db, dsn, create=False, schema=schema, read_only=True) as opened:
        if kind == "conversations":
            return await _conversations(opened, state, limit), False
        one = conversation is not None
        if kind == "runs":
            return await _all_runs(opened, conversation, state, limit), one
        return await _messages(opened, conversation, state, limit), one


def inspect_command(
    kind: str,
    *,
    db: Path | None,
    dsn: str | None,
    schema: str | None = None,
    conversation: str | None,
    state: str | None,
    as_json: bool,
    limit: int,
) -> None:
    _check_state(kind, state)
    rows, one_conversation = asyncio.run(_collect(kind, db, dsn, schema, conversation, state, limit))
    out = sys.stdout
    if as_json:
        out.write(json.dumps(_jsonable(kind, rows), indent=2, ensure_ascii=False) + "\n")
        return
    if not rows:
        out.write(f"(no {kind})\n")
        return
    cols = columns(kind, one_conversation)
    if out.isatty():
        rich_table(cols, rows)
    else:
        out.write(plain_table(cols, rows) + "\n")
