"""``threadline recover``: one recovery pass over a database, with one printed outcome per run.

Queued runs are resumed (and answered with ``--model``, default the built-in scripted model). Runs a dead
process left ``running`` are skipped by default — this command cannot know the process is dead, so the
runs queued behind them stay blocked — unless you assert it: ``--abandon-stale`` ends them ``abandoned``,
``--requeue`` runs them again (a model request is replayed; a tool effect may repeat), ``--takeover-expired``
runs again only those whose lease expired (runtimes with ``runs.lease_duration`` renew a lease while they
execute).
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from rich import box
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from ..errors import ThreadlineError
from ..runtime import takeover_expired_leases
from .common import (
    CliContext,
    CliUsageError,
    build_runtime,
    check_model,
    check_reachable,
    choose_model,
    clock_tool,
    open_store,
)
from .render import StreamPrinter, reason_markup, say, short

HINTS = {
    "skipped": "held by a process that may be dead: --abandon-stale, --requeue or --takeover-expired if it is",
    "blocked": "queued behind a skipped run",
    "abandoned": "ended 'abandoned' (stale owner)",
}


class NotSelected(ThreadlineError):
    """A run outside the ``--conversation`` selection: recovery leaves it alone."""


async def _recover(
    console: Console,
    *,
    db: Path | None,
    dsn: str | None,
    schema: str | None,
    action: str,
    conversations: list[str],
    choice: Any,
) -> int:
    selected = set(conversations)
    takeover = takeover_expired_leases()

    def chosen(run: Any) -> bool:
        return not selected or run.conversation_id in selected

    def policy(run: Any) -> dict[str, Any]:
        if not chosen(run) or action == "skip":
            return {"action": "skip"}
        if action == "takeover":
            return takeover(run)
        if action == "abandon":
            return {"action": "abandon", "stale_owner": True}
        return {"action": "requeue", "replay_safe": True}

    def resolve_context(run: Any) -> Any:
        if not chosen(run):
            raise NotSelected(f"{run.conversation_id} is not selected")
        return CliContext()

    async with open_store(db, dsn, create=False, schema=schema) as opened:
        console.print(f"database  {escape(opened.where)}")
        console.print(f"model     {escape(choice.label)}")
        printer = StreamPrinter(console)
        runtime = build_runtime(opened.store, choice.model, tools=[clock_tool()], publish=printer)
        try:
            outcomes = await runtime.recover(resolve_context=resolve_context, policy=policy)
            rows = []
            failed = 0
            for o in outcomes:
                outcome, detail = o.outcome, HINTS.get(o.outcome, "")
                if selected and o.conversation_id not in selected:
                    outcome, detail = "left alone", "not in --conversation"
                elif o.error is not None:
                    failed += 1
                    detail = " ".join(f"{type(o.error).__name__}: {o.error}".split())
                reason = reason_markup("abandoned") if o.outcome == "abandoned" else "—"
                if o.result is not None:
                    try:
                        result = await o.result
                        reason = reason_markup(result.terminal_reason)
                    except Exception as error:  # the run could not be settled here
                        failed += 1
                        detail = " ".join(f"{type(error).__name__}: {error}".split())
                rows.append((o.conversation_id, short(o.run_id), outcome, reason, detail))
        finally:
            await runtime.close()
    printer.note("")
    if not rows:
        say(console, "no active runs: nothing to recover")
        return 0
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False)
    for column in ("conversation", "run", "outcome", "terminal reason"):
        table.add_column(column, no_wrap=True)
    table.add_column("note", overflow="fold", ratio=1)
    for conversation_id, run, outcome, reason, detail in rows:
        table.add_row(escape(conversation_id), run, outcome, reason, escape(detail))
    console.print(table)
    counts: dict[str, int] = {}
    for row in rows:
        counts[row[2]] = counts.get(row[2], 0) + 1
    say(console, "recovery pass: " + ", ".join(f"{n} {name}" for name, n in counts.items()))
    return 1 if failed else 0


def run_recover(
    *,
    db: Path | None,
    dsn: str | None,
    schema: str | None,
    abandon_stale: bool,
    requeue: bool,
    conversations: list[str],
    takeover_expired: bool = False,
    model: str | None,
    base_url: str | None,
    pace: float,
) -> int:
    if abandon_stale + requeue + takeover_expired > 1:
        raise CliUsageError("choose one of --abandon-stale, --requeue and --takeover-expired")
    choice = choose_model(model, base_url, pace=pace)
    check_model(choice, model or "scripted")
    if base_url is not None:
        check_reachable(base_url)
    action = "abandon" if abandon_stale else "requeue" if requeue else "takeover" if takeover_expired else "skip"
    console = Console(highlight=False)
    return asyncio.run(
        _recover(console, db=db, dsn=dsn, schema=schema, action=action, conversations=conversations, choice=choice)
    )
