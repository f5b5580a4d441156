"""``threadline inspect conversations | runs | messages | events``: read a database, print tables or JSON.

Reads only (through the store's paged readers and per-conversation loads); never writes. The ``events``
command reads the event ledger (:mod:`threadline.cli.ledger`); the ``events`` view here, a timeline derived
from the run rows, is what it showed before the ledger existed.
"""

from __future__ import annotations

import asyncio
import json
import typing
from datetime import datetime
from pathlib import Path
from typing import Any

from rich import box
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from ..records import ConversationHead, Message, MessageStatus, Run, RunState
from .common import CliUsageError, OpenStore, open_store
from .render import reason_markup, short, text_of

RUN_STATES = typing.get_args(RunState)
MESSAGE_STATUSES = typing.get_args(MessageStatus)
PAGE = 500


def _check_state(kind: str, state: str | None) -> None:
    if state is None:
        return
    allowed = MESSAGE_STATUSES if kind == "messages" else RUN_STATES
    if state not in allowed:
        what = "message status" if kind == "messages" else "run state"
        raise CliUsageError(f"unknown {what} {state!r}; choose one of: {', '.join(allowed)}")


async def _heads(opened: OpenStore, conversation: str | None) -> list[ConversationHead]:
    heads: list[ConversationHead] = []
    cursor = None
    while True:
        page = await opened.conversations.list(limit=PAGE, cursor=cursor)
        heads.extend(h for h in page.items if conversation is None or h.conversation_id == conversation)
        if page.next_cursor is None:
            break
        cursor = page.next_cursor
    if conversation is not None and not heads:
        raise CliUsageError(f"no conversation {conversation!r} in {opened.where}")
    return heads


async def _runs(opened: OpenStore, head: ConversationHead) -> list[Run]:
    snapshot = await opened.store.load_snapshot(conversation_id=head.conversation_id)
    return sorted(snapshot.runs, key=lambda r: r.admission_sequence)


def _iso(value: datetime | None) -> str | None:
    return value.isoformat() if value is not None else None


def _when(value: datetime | None) -> str:
    return value.astimezone().strftime("%m-%d %H:%M:%S") if value is not None else "—"


# ------------------------------------------------------------------------------------------ collect


async def _conversations(opened: OpenStore, state: str | None, limit: int) -> list[dict[str, Any]]:
    rows = []
    for head in await _heads(opened, None):
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
                "created_at": _iso(head.created_at),
                "updated_at": _iso(head.updated_at),
            }
        )
        if len(rows) >= limit:
            break
    return rows


async def _all_runs(opened: OpenStore, conversation: str | None, state: str | None, limit: int) -> list[Run]:
    out: list[Run] = []
    for head in await _heads(opened, conversation):
        out.extend(r for r in await _runs(opened, head) if state is None or r.state == state)
        if len(out) >= limit:
            return out[:limit]
    return out


async def _messages(opened: OpenStore, conversation: str | None, state: str | None, limit: int) -> list[Message]:
    out: list[Message] = []
    for head in await _heads(opened, conversation):
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


def _run_events(run: Run) -> list[dict[str, Any]]:
    base = {"conversation_id": run.conversation_id, "run_id": run.id}
    inputs = len(run.input_message_ids)
    events = [
        {
            **base,
            "at": run.created_at,
            "event": "admitted",
            "detail": f"{run.input_policy}, {run.priority}, {inputs} input{'s' if inputs != 1 else ''}",
        }
    ]
    if run.acquired_at is not None:
        events.append(
            {**base, "at": run.acquired_at, "event": "acquired", "detail": f"by {run.owner_id} #{run.fencing_token}"}
        )
    op = run.last_operation
    if op is not None:
        at = op.finished_at or op.first_output_at or op.started_at
        where = [f"step {op.step}" if op.step is not None else "", f"attempt {op.attempt}" if op.attempt else ""]
        detail = " · ".join(x for x in [*where, op.detail or ""] if x)
        events.append({**base, "at": at, "event": f"{op.kind} {op.phase}", "detail": f"{detail} (last recorded)"})
    if run.state == "interrupt_requested":
        events.append({**base, "at": run.updated_at, "event": "interrupt requested", "detail": "durable"})
    if run.terminal_at is not None:
        detail = run.terminal_reason or ""
        if run.policy_name:
            detail += f" ({run.policy_name})"
        if run.absorbed_into_run_id:
            detail += f" into {run.absorbed_into_run_id}"
        if run.absorbed_run_ids:
            detail += f", absorbed {', '.join(run.absorbed_run_ids)}"
        events.append({**base, "at": run.terminal_at, "event": f"terminal {run.state}", "detail": detail})
    return events


async def _events(opened: OpenStore, conversation: str | None, state: str | None, limit: int) -> list[dict[str, Any]]:
    events: list[dict[str, Any]] = []
    for run in await _all_runs(opened, conversation, state, 10**9):
        events.extend(_run_events(run))
    events.sort(key=lambda e: e["at"])
    return events[-limit:]


# -------------------------------------------------------------------------------------------- print


def _table(*columns: str, wide: tuple[str, ...] = ()) -> Table:
    """Ids and times never wrap (they are copied and compared); the ``wide`` text columns fold."""
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False)
    for column in columns:
        if column in wide:
            table.add_column(column, overflow="fold", ratio=1)
        else:
            table.add_column(column, no_wrap=True)
    return table


def _print(console: Console, kind: str, rows: list[Any], conversation: str | None) -> None:
    if not rows:
        console.print(f"(no {kind})")
        return
    cid = [] if conversation else ["conversation"]

    def row(conversation_id: str, *cells: str) -> list[str]:
        return ([] if conversation else [escape(conversation_id)]) + list(cells)

    if kind == "conversations":
        table = _table("conversation", "version", "runs", "messages", "updated", "active runs", wide=("active runs",))
        for r in rows:
            active = ", ".join(f"{short(a['run_id'])} {a['state']}" for a in r["active_runs"]) or "—"
            updated = _when(datetime.fromisoformat(r["updated_at"]))
            table.add_row(
                escape(r["conversation_id"]), str(r["version"]), str(r["runs"]), str(r["messages"]), updated, active
            )
    elif kind == "runs":
        table = _table(*cid, "run", "state", "terminal reason", "policy", "inputs", "owner", wide=("owner",))
        for run in rows:
            table.add_row(
                *row(
                    run.conversation_id,
                    short(run.id),
                    run.state,
                    reason_markup(run.terminal_reason) + (f" ({escape(run.policy_name)})" if run.policy_name else ""),
                    f"{run.input_policy} {run.priority}" if run.priority != "ordinary" else run.input_policy,
                    str(len(run.input_message_ids)),
                    escape(f"{run.owner_id} #{run.fencing_token}") if run.owner_id else "—",
                )
            )
    elif kind == "messages":
        table = _table(*cid, "pos", "role", "status", "run", "text", wide=("text",))
        for m in rows:
            text = text_of(m) or ", ".join(p.type for p in m.parts) or "—"
            table.add_row(
                *row(
                    m.conversation_id,
                    str(m.position) if m.position is not None else "—",
                    m.role,
                    m.status,
                    short(m.run_id) if m.run_id else "—",
                    escape(text),
                )
            )
    else:
        table = _table("at", *cid, "run", "event", "detail", wide=("detail",))
        for e in rows:
            cells = row(e["conversation_id"], short(e["run_id"]), e["event"], escape(e["detail"]))
            table.add_row(_when(e["at"]), *cells)
    console.print(table)


def _jsonable(kind: str, rows: list[Any]) -> list[Any]:
    if kind in ("runs", "messages"):
        return [r.model_dump(mode="json") for r in rows]
    if kind == "events":
        return [{**e, "at": _iso(e["at"])} for e in rows]
    return rows


async def _collect(
    kind: str,
    db: Path | None,
    dsn: str | None,
    schema: str | None,
    conversation: str | None,
    state: str | None,
    limit: int,
) -> list[Any]:
    async with open_store(db, dsn, create=False, schema=schema) as opened:
        if kind == "conversations":
            return await _conversations(opened, state, limit)
        if kind == "runs":
            return await _all_runs(opened, conversation, state, limit)
        if kind == "messages":
            return await _messages(opened, conversation, state, limit)
        return await _events(opened, conversation, state, limit)


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
    rows = asyncio.run(_collect(kind, db, dsn, schema, conversation, state, limit))
    if as_json:
        print(json.dumps(_jsonable(kind, rows), indent=2, ensure_ascii=False))
        return
    _print(Console(highlight=False), kind, rows, conversation)
