"""``threadline demo``: the runtime at work, offline, on a real SQLite file.

Every run goes through the real runtime (admission, lanes and input policies, the step loop, tools behind
the fence, checkpoints, terminal commits, recovery) with threadline's built-in scripted model instead of a
provider. What happens is decided by events, never by timing: the scripted model pauses mid-answer on a
gate the demo opens, and ``--pace`` only slows the words down for the eye. Every scene checks the fact it
shows; a failed check raises :class:`DemoCheckFailed` instead of printing something untrue.

Scenes: (1) one answer streamed live with a tool call; (2) the five input policies side by side on the
same three inputs, each policy in its own conversation; (3) a child process killed with SIGKILL
mid-answer, and the recovery that answers its pending inputs; (4) a table of every run of this demo, read
back from the database, with usage and its provenance.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from rich import box
from rich.console import Console
from rich.markup import escape
from rich.panel import Panel
from rich.table import Table

from ..errors import ThreadlineError
from ..history.projection import INTERRUPTED_MARKER
from ..runtime import AgentRuntime, AgentRuntimeResult, AgentRuntimeTicket
from ..store.aggregate import AgentRuntimeStore
from .common import build_runtime, lookup_tool, open_store
from .render import StreamPrinter, reason_markup, short, text_of, usage_cells, usage_text
from .scripted import ScriptedModel, Turn, compose_answer, read_turn

CONTEXT = {"user": "demo"}
INPUTS = ("Plan a day in Lisbon.", "Also suggest a restaurant.", "Actually, make it Porto.")
MARKS = ("①", "②", "③")
POLICIES = ("queue", "interrupt", "interrupt-next", "supersede", "inject")
CRASH_INPUTS = ("Plan a day in Lisbon.", "Also suggest a restaurant.")
CHILD_HOLD_AT_WORD = 8
"""The crash child stops streaming after this many words, once they are checkpointed, and waits to die."""
CHILD_CHECKPOINT_EVERY = 4
CHILD_TIMEOUT = 60.0
"""Seconds the parent waits for the child to reach its point (a broken build fails instead of hanging)."""


class DemoCheckFailed(Exception):
    """A fact the demo shows did not hold (the runtime or the store disagreed with the scene)."""


class NotThisDemo(ThreadlineError):
    """Recovery met a run of a conversation this demo did not create: it is left alone."""


def _expect(condition: bool, what: str) -> None:
    if not condition:
        raise DemoCheckFailed(what)


def _rule(console: Console, title: str) -> None:
    console.print()
    console.rule(f"[bold]{title}[/]", align="left")


@dataclass
class Entry:
    """One run of this demo, for the final table."""

    scene: str
    conversation_id: str
    label: str
    run_id: str
    result: AgentRuntimeResult | None = None


@dataclass
class Book:
    """Every run this demo started, in order, and how each is labelled on screen."""

    entries: list[Entry] = field(default_factory=list)
    labels: dict[str, str] = field(default_factory=dict)

    def add(self, scene: str, conversation_id: str, label: str, run_id: str) -> Entry:
        self.labels[run_id] = label
        entry = Entry(scene, conversation_id, label, run_id)
        self.entries.append(entry)
        return entry

    def label(self, run_id: str) -> str:
        return self.labels.get(run_id, short(run_id))


class Demo:
    def __init__(self, console: Console, store: AgentRuntimeStore, db: Path, prefix: str, pace: float) -> None:
        self.console = console
        self.store = store
        self.db = db
        self.prefix = prefix
        self.pace = pace
        self.book = Book()
        self.printer = StreamPrinter(console, label=self.book.label)

    def runtime(self, model: ScriptedModel, policy: str = "queue", *, tools: bool = True) -> AgentRuntime:
        return build_runtime(
            self.store,
            model.model,
            model_name="scripted",
            policy=policy,
            tools=[lookup_tool()] if tools else [],
            publish=self.printer,
        )

    async def submit(
        self, runtime: AgentRuntime, scene: str, conversation_id: str, key: str, text: str, mark: str
    ) -> tuple[AgentRuntimeTicket, Entry]:
        ticket = runtime.submit(
            conversation_id=conversation_id,
            idempotency_key=key,
            context=CONTEXT,
            parts=[{"type": "text", "text": text}],
        )
        admission = await ticket.accepted
        entry = self.book.add(scene, conversation_id, mark, admission.run_id)
        return ticket, entry

    # ------------------------------------------------------------------------------------ scene 1

    async def stream_scene(self) -> None:
        _rule(self.console, "1 · A streamed answer with a tool call")
        conversation_id = f"{self.prefix}-stream"
        model = ScriptedModel(pace=self.pace)
        runtime = self.runtime(model)
        self.console.print(f"  conversation [bold]{conversation_id}[/]")
        self.printer.note(f"  ① [bold]{escape(INPUTS[0])}[/]")
        ticket, entry = await self.submit(runtime, "stream", conversation_id, "s1", INPUTS[0], "①")
        result = await ticket.result
        entry.result = result
        await runtime.close()
        tools = [(name, status) for run_id, name, status in self.printer.tools if run_id == entry.run_id]
        _expect(result.terminal_reason == "success", "the streamed run succeeded")
        _expect(tools == [("lookup", "started"), ("lookup", "completed")], "the tool ran once, behind the fence")
        stored = "".join(p.text for p in result.assistant.parts if p.type == "text") if result.assistant else ""
        _expect(stored == self.printer.streamed[entry.run_id], "the stored answer is exactly what streamed")
        self.printer.note(
            f"  [green]✓[/] streamed live, tool status as it happened; the stored answer is exactly what streamed "
            f"({result.metrics.steps if result.metrics else '?'} steps: tool call, then the answer)"
        )
        self.printer.note(f"  [green]✓[/] usage: {usage_text(result.usage)}")

    # ------------------------------------------------------------------------------------ scene 2

    async def policy_column(self, policy: str) -> dict[str, Any]:
        conversation_id = f"{self.prefix}-{policy}"
        paused, release = asyncio.Event(), asyncio.Event()

        async def hold(call: int, words: int) -> None:
            if call == 0 and words == -1:  # the first answer, just before its tool call
                paused.set()
                await release.wait()

        model = ScriptedModel(pace=self.pace, hold=hold)
        # ② is an ordinary follow-up (queued in every column); ③ arrives under the column's policy
        runtime = self.runtime(model, lambda raw: policy if raw.idempotency_key == "p3" else "queue")
        self.console.print()
        self.console.print(f"  [bold reverse] {policy} [/]  conversation {conversation_id}")
        self.printer.note(f"  ① [bold]{escape(INPUTS[0])}[/]")
        t1, e1 = await self.submit(runtime, "policies", conversation_id, "p1", INPUTS[0], "①")
        await asyncio.wait_for(paused.wait(), CHILD_TIMEOUT)
        self.printer.note(f"  ② [bold]{escape(INPUTS[1])}[/] [dim](arrives mid-answer: queue)[/]")
        t2, e2 = await self.submit(runtime, "policies", conversation_id, "p2", INPUTS[1], "②")
        self.printer.note(f"  ③ [bold]{escape(INPUTS[2])}[/] [dim](arrives mid-answer: {policy})[/]")
        t3, e3 = await self.submit(runtime, "policies", conversation_id, "p3", INPUTS[2], "③")
        release.set()
        results = [await t.result for t in (t1, t2, t3)]
        for entry, result in zip((e1, e2, e3), results, strict=True):
            entry.result = result
        await runtime.close()
        answered = [r for r in results if r.terminal_reason == "success"]
        order = "".join(
            self.book.label(r.run.id)
            for r in sorted(answered, key=lambda r: r.run.terminal_at or datetime.max.replace(tzinfo=UTC))
        )
        # what the request answering ② was shown of ①'s answer (② always runs after ①'s run ended)
        later = next(p for p in model.prompts if "restaurant" in " ".join(read_turn(p).inputs))
        shown = " ".join(str(m) for m in later)
        texts = [p.text for p in results[0].assistant.parts if p.type == "text"] if results[0].assistant else []
        first_answer = texts[-1] if texts else ""
        if INTERRUPTED_MARKER in shown:
            saw = "partial + cut-off marker"
        elif first_answer and first_answer in shown:
            saw = "the complete answer"
        else:
            saw = "nothing (left out)"
        return {"policy": policy, "results": results, "order": order, "saw": saw, "calls": model.calls}

    async def policies_scene(self) -> list[dict[str, Any]]:
        _rule(self.console, "2 · Five input policies, side by side, on the same three inputs")
        self.printer.note(
            "  Each policy gets its own conversation. ① is sent; while its answer streams (the scripted "
            "model waits on a gate the demo holds), ② arrives as an ordinary queued follow-up and ③ "
            "arrives under the policy. Then the gate opens."
        )
        columns = [await self.policy_column(policy) for policy in POLICIES]
        by = {c["policy"]: c for c in columns}

        def reasons(policy: str) -> list[str]:
            return [r.terminal_reason for r in by[policy]["results"]]

        _expect(reasons("queue") == ["success", "success", "success"], "queue: every input answered in turn")
        _expect(by["queue"]["order"] == "①②③", "queue: answered in arrival order")
        _expect(reasons("interrupt") == ["interrupted", "success", "success"], "interrupt ends ①'s run")
        _expect(by["interrupt"]["order"] == "②③", "interrupt: ③ waits behind ②")
        _expect(reasons("interrupt-next") == ["interrupted", "success", "success"], "interrupt-next ends ①'s run")
        _expect(by["interrupt-next"]["order"] == "③②", "interrupt-next: ③ runs before the ordinary ②")
        _expect(reasons("supersede") == ["superseded", "success", "success"], "supersede ends ①'s run")
        _expect(reasons("inject") == ["success", "success", "absorbed"], "inject: ③ joins ①'s run")
        _expect(by["interrupt"]["saw"] == "partial + cut-off marker", "interrupted partial kept and marked")
        _expect(by["supersede"]["saw"] == "nothing (left out)", "superseded partial left out of the prompt")
        _expect(by["queue"]["saw"] == by["inject"]["saw"] == "the complete answer", "completed answers are history")
        inject_answer = text_of(by["inject"]["results"][0].assistant)
        _expect("Porto" in inject_answer, "the injected ③ was answered by ①'s run")

        table = Table(title="the same three inputs under each policy", title_justify="left")
        for column in ("policy", "① Lisbon", "② restaurant", "③ Porto", "answers, in order", "what ② saw of ①"):
            table.add_column(column)
        for c in columns:
            cells = []
            for r in c["results"]:
                cell = reason_markup(r.terminal_reason)
                if r.terminal_reason == "absorbed":
                    cell += " into ①"
                cells.append(cell)
            table.add_row(c["policy"], *cells, c["order"] or "—", c["saw"])
        self.console.print()
        self.console.print(table)
        self.printer.note(
            "  [green]✓[/] queue answers all three in turn; interrupt and interrupt-next cut ① off (kept, marked) "
            "— interrupt-next runs ③ before ②; supersede drops ①'s partial from the prompt; inject lets ③ "
            "join ①'s run (one answer for both)"
        )
        return columns

    # ------------------------------------------------------------------------------------ scene 3

    async def crash_scene(self) -> None:
        _rule(self.console, "3 · A crash mid-answer, and the recovery")
        conversation_id = f"{self.prefix}-crash"
        self.printer.note(
            f"  A child process runs conversation {conversation_id}: ① streams, ② queues behind it, "
            "and the child is killed with SIGKILL mid-answer — no close, no cleanup."
        )
        command = [
            sys.executable,
            "-m",
            "threadline.cli",
            "_demo-child",
            "--db",
            str(self.db),
            "--conversation",
            conversation_id,
            "--pace",
            str(self.pace),
        ]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        child = await asyncio.create_subprocess_exec(
            *command,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=env,
        )
        assert child.stdout is not None and child.stderr is not None
        ready: dict[str, Any] | None = None
        checkpoint = ""
        child_labels: dict[str, str] = {}
        printer = StreamPrinter(self.console, label=lambda run_id: child_labels.get(run_id, short(run_id)))
        try:
            while ready is None:
                line = await asyncio.wait_for(child.stdout.readline(), CHILD_TIMEOUT)
                if not line:
                    break
                message = json.loads(line)
                if message["event"] == "admitted":
                    child_labels[message["run_id"]] = message["mark"]
                    printer.note(f"  {message['mark']} [bold]{escape(message['text'])}[/] [dim](child)[/]")
                elif message["event"] == "delta":
                    printer(_Delta(message["run_id"], message["delta"]))
                elif message["event"] == "checkpoint" and message["text"]:
                    checkpoint = message["text"]
                    printer.console.print(" [dim]⟨saved⟩[/]", end="")
                    printer.console.file.flush()
                elif message["event"] == "ready":
                    ready = message
        except (TimeoutError, json.JSONDecodeError, KeyError) as error:
            child.kill()
            await child.wait()
            raise DemoCheckFailed(f"the crash child did not reach its point: {error!r}") from None
        if ready is None:
            await child.wait()
            err = (await child.stderr.read()).decode(errors="replace").strip().splitlines()
            raise DemoCheckFailed(f"the crash child exited early ({child.returncode}): {err[-1] if err else ''}")
        child.send_signal(signal.SIGKILL)
        status = await child.wait()
        printer.note(f"  [red]✗ killed[/] child pid {child.pid} with SIGKILL (exit status {status}) mid-answer")
        _expect(status == -signal.SIGKILL, "the child died of SIGKILL")

        first, second = ready["runs"]
        for run_id, mark in ((first, "①"), (second, "②")):
            self.book.labels[run_id] = mark
        active = await self.store.list_active_runs(conversation_id=conversation_id)
        states = {r.id: r for r in active.runs}
        _expect(first in states and states[first].state == "running", "① is still 'running' on disk")
        _expect(second in states and states[second].state == "queued", "② is queued behind it")
        snapshot = await self.store.load_snapshot(conversation_id=conversation_id)
        draft = next(m for m in snapshot.messages if m.id == states[first].assistant_message_id)
        _expect(draft.status == "streaming" and text_of(draft) == checkpoint, "the last checkpoint is on disk")
        _expect(all(p.type == "text" for p in draft.parts), "① invoked no tool (replaying its request is safe)")
        self.printer.note(
            f"  on disk: ① [yellow]running[/] (owner {escape(states[first].owner_id or '?')}, fencing token "
            f"{states[first].fencing_token}), draft '{escape(text_of(draft))}' ({draft.status}); ② [yellow]queued[/]"
        )
        self.printer.note(
            "  recovery: runtime.recover(policy=…) — ①'s owner is dead and ① invoked no tool, so replaying its "
            "model request is safe: requeue it (replay_safe=True); ② resumes after it."
        )

        model = ScriptedModel(pace=self.pace)
        runtime = build_runtime(self.store, model.model, model_name="scripted", publish=self.printer)

        def resolve_context(run: Any) -> Any:
            if run.conversation_id != conversation_id:
                raise NotThisDemo(f"{run.conversation_id} is not this demo's")
            return CONTEXT

        def policy(run: Any) -> dict[str, Any]:
            if run.conversation_id != conversation_id:
                return {"action": "skip"}
            return {"action": "requeue", "replay_safe": True}

        outcomes = await runtime.recover(resolve_context=resolve_context, policy=policy)
        mine = [o for o in outcomes if o.conversation_id == conversation_id]
        _expect([(o.run_id, o.outcome) for o in mine] == [(first, "requeued"), (second, "resumed")], "recovery plan")
        results = []
        for o, mark in zip(mine, ("①", "②"), strict=True):
            assert o.result is not None
            result = await o.result
            results.append(result)
            entry = self.book.add("crash", conversation_id, mark, o.run_id)
            entry.result = result
        await runtime.close()
        _expect([r.terminal_reason for r in results] == ["success", "success"], "both inputs answered")
        answers = [r.assistant for r in results]
        _expect(all(a is not None and a.status == "completed" for a in answers), "both answers completed")
        _expect(
            text_of(answers[0]) == compose_answer(Turn([CRASH_INPUTS[0]], [], previous_cut_off=False)),
            "① answered in full (the whole scripted answer, not the draft the child left)",
        )
        reported = ", ".join(f"{self.book.label(o.run_id)} {o.outcome}" for o in mine)
        self.printer.note(f"  recover() reported: {reported}")
        others = len(outcomes) - len(mine)
        left = f"; {others} run(s) of other conversations left alone" if others else ""
        self.printer.note(
            f"  [green]✓[/] recovered: ① requeued and answered in full, ② answered after it — nothing accepted "
            f"was lost{left}"
        )

    # ------------------------------------------------------------------------------------ scene 4

    async def runs_table(self) -> None:
        _rule(self.console, "4 · Every run of this demo, read back from the database")
        table = Table(box=box.SIMPLE_HEAD, pad_edge=False)
        for column in ("conversation", "#", "state", "terminal reason", "tokens in/out", "cost"):
            table.add_column(column, no_wrap=column in ("conversation", "tokens in/out"))
        for entry in self.book.entries:
            loaded = await self.store.load_run(conversation_id=entry.conversation_id, run_id=entry.run_id)
            _expect(loaded is not None, f"run {entry.run_id} is on disk")
            assert loaded is not None
            run = loaded.run
            _expect(run.terminal and run.terminal_reason is not None, f"run {entry.run_id} has its terminal reason")
            if run.terminal_reason == "absorbed":
                tokens, cost = "in ①'s run", "—"
            else:
                counts, provenance, cost = usage_cells(run.usage)  # the run's durable spend, read back
                tokens = f"{counts} {provenance}"
            table.add_row(
                entry.conversation_id.removeprefix(self.prefix + "-"),
                entry.label,
                run.state,
                reason_markup(run.terminal_reason),
                tokens,
                cost,
            )
        self.console.print(table)
        self.printer.note(
            "  Usage is each run's durable spend (Run.usage), read back with the run: every attempt, with "
            "per-field provenance. The scripted model (pydantic-ai's FunctionModel) reports word-count "
            "estimates as its token usage; threadline cannot tell, so each step's figure is taken as reported "
            "and a run's total, their sum, is 'computed'. It has no price, so cost stays 'unavailable' (never "
            "0). The crashed child's spend up to its last commit stays with its run; what it spent after that "
            "died with it."
        )
        self.printer.note(
            f"[green]✓[/] {len(self.book.entries)} runs, each with exactly one terminal reason. "
            f"Look around: [bold]threadline inspect runs --db {escape(str(self.db))}[/]"
        )


@dataclass
class _Delta:
    """A child's streamed delta, replayed through the printer."""

    run_id: str
    delta: str
    type: str = "assistant-delta"


async def run_demo(console: Console, db: Path, *, pace: float = 0.03) -> None:
    """Run every scene against the SQLite file ``db`` with fresh conversation ids."""
    path = db.expanduser().resolve()
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%S")
    prefix = f"demo-{stamp}-{uuid.uuid4().hex[:4]}"
    async with open_store(path, None) as opened:
        console.print(
            Panel(
                "Everything below runs through the real threadline runtime on a real SQLite file — offline, with "
                "[bold]a built-in scripted model[/] instead of a provider (no network, no API key). The scripted "
                "model reads its prompt and answers from a script; it pauses mid-answer on gates the demo holds, "
                "so every outcome is decided by events, not timing. Every [green]✓[/] line is a checked fact.\n"
                "For a real model: [bold]threadline chat --model openai:gpt-4.1-mini[/]",
                title="threadline demo",
                expand=False,
            )
        )
        console.print(f"database  {escape(str(path))}")
        demo = Demo(console, opened.store, path, prefix, pace)
        await demo.stream_scene()
        await demo.policies_scene()
        await demo.crash_scene()
        await demo.runs_table()


# --------------------------------------------------------------------------------------- the child


def _emit(message: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


async def run_demo_child(db: Path, conversation_id: str, *, pace: float) -> None:
    """The crash scene's child: stream ①, queue ② behind it, then wait to be killed (it never ends by
    itself). Speaks JSON lines on stdout: ``admitted``, ``delta``, ``checkpoint``, ``ready``."""
    held = asyncio.Event()

    async def hold(call: int, words: int) -> None:
        if call == 0 and words == CHILD_HOLD_AT_WORD:
            held.set()
            await asyncio.Event().wait()  # mid-answer, for ever: the parent kills this process

    def publish(event: Any) -> None:
        if event.type == "assistant-delta":
            _emit({"event": "delta", "run_id": event.run_id, "delta": event.delta})
        elif event.type == "assistant-checkpoint":
            _emit(
                {
                    "event": "checkpoint",
                    "run_id": event.run_id,
                    "text": "".join(p.text for p in event.parts if p.type == "text"),
                }
            )

    model = ScriptedModel(pace=pace, hold=hold)
    async with open_store(db, None) as opened:
        runtime = build_runtime(
            opened.store,
            model.model,
            model_name="scripted",
            publish=publish,
            owner_id=f"demo-child-{os.getpid()}",
            checkpoint_every_events=CHILD_CHECKPOINT_EVERY,
        )
        runs = []
        for i, (text, mark) in enumerate(zip(CRASH_INPUTS, ("①", "②"), strict=True)):
            ticket = runtime.submit(
                conversation_id=conversation_id,
                idempotency_key=f"x{i + 1}",
                context=CONTEXT,
                parts=[{"type": "text", "text": text}],
            )
            admission = await ticket.accepted
            runs.append(admission.run_id)
            _emit({"event": "admitted", "run_id": admission.run_id, "mark": mark, "text": text})
            if i == 0:
                await held.wait()
        _emit({"event": "ready", "runs": runs})
        await asyncio.Event().wait()
