"""``threadline demo``: the durable store, driven directly, on a real SQLite file.

Until the runtime loop exists this demo plays the executor itself: it admits inputs, acquires runs,
checkpoints simulated assistant tokens and commits terminals through :class:`AgentRuntimeStore`, then closes
the file, reopens it and reads everything back. Every scene checks the fact it shows; a failed check raises
:class:`DemoCheckFailed` instead of printing something untrue.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.panel import Panel
from rich.table import Table

from ..records import Message, MessageDraft, Run, TextPart
from ..store.aggregate import AgentConversationReader, AgentRuntimeStore

OWNER = "demo-worker"
"""The owner id this demo acquires runs as (a runtime would use one per process)."""

QUESTIONS = (
    "What is a durable run?",
    "And what happens if the process crashes?",
    "Also: can a stale worker still write?",
)
URGENT = "Stop — summarise in one line instead!"
ANSWER_A = "A durable run is a model turn whose every state change is committed before anyone sees it."
ANSWER_C = "Summary: durable runs survive crashes and"
ANSWER_B = "Nothing accepted is lost: recovery requeues or abandons it, and fencing tokens stop stale workers."


class DemoCheckFailed(Exception):
    """A fact the demo shows did not hold (the store disagreed with what the scene expected)."""


def _expect(condition: bool, what: str) -> None:
    if not condition:
        raise DemoCheckFailed(what)


def short(run_id: str) -> str:
    """``run_4f0c1a2b…`` → ``run_4f0c1a``: enough to tell runs apart on screen."""
    prefix, _, rest = run_id.partition("_")
    return f"{prefix}_{rest[:6]}" if rest else run_id[:10]


def text_of(message: Message | None) -> str:
    if message is None:
        return ""
    return "".join(getattr(p, "text", "") for p in message.parts if p.type == "text")


@asynccontextmanager
async def open_store(path: Path) -> AsyncIterator[tuple[AgentRuntimeStore, AgentConversationReader]]:
    """Open the SQLite store at ``path``; closed on exit."""
    from ..store.sqlite import create_sqlite_agent_runtime_store

    async with create_sqlite_agent_runtime_store(filename=str(path)) as handle:
        yield handle.store, handle.conversations


def _draft(text: str) -> MessageDraft:
    return MessageDraft(id=f"msg_{uuid.uuid4().hex}", role="user", parts=(TextPart(text=text),))


class Demo:
    """The executor this demo plays: thin helpers over the store calls each scene makes."""

    def __init__(self, console: Console, store: AgentRuntimeStore, conversation_id: str, pace: float) -> None:
        self.console = console
        self.store = store
        self.conversation_id = conversation_id
        self.pace = pace
        self.labels: dict[str, str] = {}

    def label(self, run: Run, letter: str) -> None:
        self.labels[run.id] = letter

    def name(self, run_id: str) -> str:
        """``run A (run_4f0c1a)``: a letter to follow the story, the stored id to check it."""
        letter = self.labels.get(run_id)
        return f"run {letter} [dim]({short(run_id)})[/]" if letter else f"run {short(run_id)}"

    def say(self, markup: str) -> None:
        self.console.print(markup)

    def ok(self, markup: str) -> None:
        self.console.print(f"[green]✓[/] {markup}")

    async def accept(self, key: str, draft: MessageDraft, **options: Any) -> Any:
        return await self.store.accept_input_and_assign_run(
            conversation_id=self.conversation_id, idempotency_key=key, input=draft, **options
        )

    async def acquire(self, run: Run) -> Run:
        result = await self.store.acquire_run(
            conversation_id=self.conversation_id, run_id=run.id, expected_revision=run.revision, owner_id=OWNER
        )
        return result.run

    async def stream(self, run: Run, answer: str, *, every: int = 4, stop_after: int | None = None) -> Run:
        """Print ``answer`` word by word as if streamed, checkpointing the growing draft every ``every`` words."""
        words = answer.split(" ")
        if stop_after is not None:
            words = words[:stop_after]
        self.console.print("  [bold magenta]assistant ▸[/] ", end="")
        checkpoints = 0
        for i, word in enumerate(words, start=1):
            self.console.print(escape(word if i == 1 else f" {word}"), end="")
            if self.pace:
                await asyncio.sleep(self.pace)
            if i % every == 0 or i == len(words):
                result = await self.store.checkpoint_run_assistant(
                    conversation_id=self.conversation_id,
                    run_id=run.id,
                    expected_revision=run.revision,
                    owner_id=OWNER,
                    fencing_token=run.fencing_token,
                    parts=[TextPart(text=" ".join(words[:i]))],
                )
                run = result.run
                checkpoints += 1
                _expect(result.assistant is not None and result.assistant.status == "streaming", "draft is streaming")
                self.console.print(" [dim]⟨saved⟩[/]", end="")
        self.console.print()
        self.say(f"  [dim]{checkpoints} checkpoints of the streaming draft, run revision now {run.revision}[/]")
        return run

    async def commit(self, run: Run, reason: str, final_text: str | None = None) -> Any:
        return await self.store.commit_run_terminal(
            conversation_id=self.conversation_id,
            run_id=run.id,
            expected_revision=run.revision,
            owner_id=OWNER,
            fencing_token=run.fencing_token,
            terminal_reason=reason,
            parts=None if final_text is None else [TextPart(text=final_text)],
        )

    async def active_runs(self) -> tuple[Run, ...]:
        return (await self.store.list_active_runs(conversation_id=self.conversation_id)).runs


def _rule(console: Console, title: str) -> None:
    console.print()
    console.rule(f"[bold]{title}[/]", align="left")


async def _count_conversations(reader: AgentConversationReader) -> int:
    count, cursor = 0, None
    while True:
        page = await reader.list(limit=1000, cursor=cursor)
        count += len(page.items)
        if page.next_cursor is None:
            return count
        cursor = page.next_cursor


async def run_demo(console: Console, db: Path, *, pace: float = 0.03) -> None:
    """Run every scene against the SQLite file ``db`` with a fresh conversation id."""
    path = db.expanduser().resolve()
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%S")
    conversation_id = f"demo-{stamp}-{uuid.uuid4().hex[:4]}"

    async with open_store(path) as (store, _reader):
        console.print(
            Panel(
                "This demo drives the durable [bold]store[/] directly — [bold]no model yet[/] (the runtime loop "
                "comes later). It plays the executor itself and the assistant tokens are simulated, but every "
                "[green]✓[/] line states what the store returned from a committed SQLite transaction.",
                title="threadline demo",
                expand=False,
            )
        )
        console.print(f"database      {escape(str(path))}")
        console.print(f"conversation  {conversation_id}")

        demo = Demo(console, store, conversation_id, pace)
        drafts = [_draft(q) for q in QUESTIONS]
        keys = [f"input-{i}" for i in range(1, 4)]

        # ------------------------------------------------------------------ scene 1: coalescing
        _rule(console, "Scene 1 · three inputs while a run is running")
        first = await demo.accept(keys[0], drafts[0], coalesce=True)
        run_a = first.run
        demo.label(run_a, "A")
        demo.say(f"  input 1 {QUESTIONS[0]!r} → {demo.name(run_a.id)} [yellow]{run_a.state}[/]")
        run_a = await demo.acquire(run_a)
        _expect(run_a.state == "running", "run A is running after acquire")
        demo.say(f"  {demo.name(run_a.id)} acquired: [cyan]{run_a.state}[/], fencing token {run_a.fencing_token}")
        second = await demo.accept(keys[1], drafts[1], coalesce=True)
        run_b = second.run
        demo.label(run_b, "B")
        _expect(not second.coalesced and run_b.id != run_a.id, "input 2 opens a new queued successor")
        demo.say(f"  input 2 → new queued successor {demo.name(run_b.id)}")
        third = await demo.accept(keys[2], drafts[2], coalesce=True)
        _expect(third.coalesced and third.run.id == run_b.id, "input 3 coalesces into the successor")
        demo.say(f"  input 3 → [bold]coalesced[/] into {demo.name(third.run.id)}")
        active = await demo.active_runs()
        queued = [r for r in active if r.state == "queued"]
        _expect(len(queued) == 1 and len(queued[0].input_message_ids) == 2, "one queued successor with two inputs")
        run_b = queued[0]
        demo.ok(
            f"inputs 2 and 3 coalesced into ONE queued successor: run B holds {len(run_b.input_message_ids)} inputs"
        )

        # ------------------------------------------------------------------ scene 2: streaming + terminal
        _rule(console, "Scene 2 · run A streams its answer, checkpointed as it grows")
        run_a = await demo.stream(run_a, ANSWER_A)
        done = await demo.commit(run_a, "success")
        _expect(done.outcome == "committed" and done.run.state == "completed", "run A committed success")
        _expect(done.assistant is not None and done.assistant.status == "completed", "run A's assistant completed")
        demo.ok(f"terminal 'success' committed: run A [green]{done.run.state}[/], assistant {done.assistant.status}")

        # ------------------------------------------------------------------ scene 3: urgent ordering
        _rule(console, "Scene 3 · an urgent input while the successor is queued")
        urgent = await demo.accept("input-urgent", _draft(URGENT), priority="urgent", input_policy="interrupt-next")
        run_c = urgent.run
        demo.label(run_c, "C")
        demo.say(f"  urgent input 4 {URGENT!r} → {demo.name(run_c.id)}")
        order = await demo.active_runs()
        demo.say("  execution order from list_active_runs:")
        for i, r in enumerate(order, start=1):
            demo.say(
                f"    {i}. {demo.name(r.id)}  {r.priority:<8} {r.input_policy:<14} "
                f"admitted #{r.admission_sequence}, {len(r.input_message_ids)} input(s)"
            )
        _expect([r.id for r in order] == [run_c.id, run_b.id], "urgent run before the ordinary successor")
        demo.ok("urgent before ordinary: run C runs before run B, although B was admitted first")

        # ------------------------------------------------------------------ scene 4: durable interrupt
        _rule(console, "Scene 4 · a durable interrupt")
        run_c = await demo.acquire(run_c)
        demo.say(f"  {demo.name(run_c.id)} acquired: [cyan]{run_c.state}[/]")
        run_c = await demo.stream(run_c, ANSWER_C, every=3)
        asked = await store.request_run_interrupt(conversation_id=conversation_id, run_id=run_c.id)
        _expect(asked.outcome == "requested" and asked.run.state == "interrupt_requested", "interrupt recorded")
        demo.say(f"  request_run_interrupt (any process may ask) → run C [red]{asked.run.state}[/]")
        seen = await store.load_run(conversation_id=conversation_id, run_id=run_c.id)
        _expect(seen is not None and seen.run.state == "interrupt_requested", "executor sees the durable request")
        assert seen is not None
        stopped = await demo.commit(seen.run, "interrupted")
        _expect(stopped.run.state == "interrupted", "run C is interrupted")
        _expect(stopped.assistant is not None and stopped.assistant.status == "interrupted", "assistant interrupted")
        demo.say("  the executor sees the request (load_run) at its next boundary and stops")
        demo.ok(
            f"committed 'interrupted': run C [red]{stopped.run.state}[/], assistant status '{stopped.assistant.status}'"
        )
        demo.say("  now the queued successor run B answers inputs 2 and 3 in one turn:")
        run_b = await demo.acquire(run_b)
        run_b = await demo.stream(run_b, ANSWER_B)
        answered = await demo.commit(run_b, "success")
        _expect(answered.run.state == "completed", "run B completed")
        demo.ok(f"run B [green]{answered.run.state}[/]: one answer for {len(run_b.input_message_ids)} inputs")

        # ------------------------------------------------------------------ scene 5: idempotent retry
        _rule(console, "Scene 5 · a client retries an input that was already answered")
        retry = await demo.accept(keys[0], drafts[0], coalesce=True)
        _expect(retry.outcome == "duplicate" and retry.run.id == run_a.id, "the retry is a duplicate of input 1")
        _expect(text_of(retry.answer) == ANSWER_A, "the duplicate carries the original answer")
        demo.say(f"  the same idempotency key {keys[0]!r} and input again → outcome [bold]'{retry.outcome}'[/]")
        demo.ok(f"duplicate: nothing written; the original run A and its answer: {text_of(retry.answer)!r}")

    # ---------------------------------------------------------------------- scene 6: reopen from disk
    _rule(console, "Scene 6 · closed, reopened, read back from disk")
    async with open_store(path) as (store, reader):
        snapshot = await store.load_snapshot(conversation_id=conversation_id)
        runs = sorted(snapshot.runs, key=lambda r: r.admission_sequence)
        _expect([r.id for r in runs] == [run_a.id, run_b.id, run_c.id], "three runs read back")
        table = Table(title="runs, read back from disk", title_justify="left")
        for column in ("", "run", "state", "terminal_reason", "priority", "inputs"):
            table.add_column(column)
        for r in runs:
            table.add_row(
                demo.labels.get(r.id, "?"),
                short(r.id),
                r.state,
                r.terminal_reason or "—",
                r.priority,
                str(len(r.input_message_ids)),
            )
        console.print(table)

        page = await reader.messages(conversation_id, limit=50)
        history = Table(title="message history (conversations.messages)", title_justify="left")
        for column in ("pos", "run", "role", "status", "text"):
            history.add_column(column)
        for m in page.items:
            history.add_row(
                str(m.position) if m.position is not None else "—",
                demo.labels.get(m.run_id or "", "—"),
                m.role,
                m.status,
                escape(text_of(m)),
            )
        console.print(history)
        _expect(len(page.items) == 7, "four inputs and three answers read back")
        total = await _count_conversations(reader)
        console.print(
            f"[green]✓[/] read back {len(runs)} runs and {len(page.items)} messages; "
            f"{escape(path.name)} holds {total} conversation(s)"
        )
