"""``threadline chat``: an interactive terminal chat over the durable runtime.

In a terminal, the input line is prompt_toolkit's and stays below the answer: complete lines of the answer
are printed above it (through prompt_toolkit's stdout proxy, so nothing typed is ever mixed into them) and
the line still streaming is shown just above the input line until it completes. With stdin not a terminal
(a script piping lines in), a reader thread reads the lines. Each line sent is echoed as the user's message
with the policy it got; ``--policy`` decides what a line typed while the model answers does to that answer.
Ctrl-C once asks for a durable interrupt of the answer in progress (``runtime.interrupt``) and keeps the
chat open; Ctrl-C again within two seconds, or when nothing is answering, leaves — so do Ctrl-D and
``/quit``. Leaving closes the runtime: an answer still streaming ends ``shutdown``, queued inputs stay
queued and are answered by the next ``threadline chat`` on the same conversation; the last line says how
many are, as read back from the store after the close.

The conversation lives in the database: without ``--conversation`` the chat continues the most recently
active ``chat-…`` conversation of the database (or starts one), and shows its last messages on start.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
import threading
import uuid
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape

from ..errors import AgentRunUnsettledError, ThreadlineError
from ..records import Message
from ..runtime import AgentRuntime, AgentRuntimeTicket
from .common import (
    CliContext,
    ModelChoice,
    OpenStore,
    build_runtime,
    check_model,
    check_reachable,
    choose_model,
    clock_tool,
    open_store,
)
from .render import StreamPrinter, say, text_of, usage_text

CONSEQUENCE = {
    "queue": "waits for the answer in progress",
    "inject": "joins the answer in progress at its next step",
    "interrupt": "ends the answer in progress, keeping what it said",
    "interrupt-next": "ends the answer in progress and goes before anything queued",
    "supersede": "replaces the answer in progress",
}
"""What a line sent while the model answers does, by input policy (echoed with the line)."""
HISTORY = 6
"""Messages shown from the conversation's history on start."""
DOUBLE_PRESS = 2.0
"""Seconds within which a second Ctrl-C leaves instead of interrupting."""
PROMPT = "[bold cyan]you ›[/] "
PROMPT_ANSI = "\x1b[1;36myou ›\x1b[0m "
"""The same prompt for prompt_toolkit (ANSI formatted text)."""
LEASE = 30.0
"""Seconds of the lease a chat holds on the answer it is running (renewed while it runs): a chat that was
killed leaves a run whose lease expires, and the next chat on the conversation takes it over."""
CHAT_PREFIX = "chat-"


async def default_conversation(opened: OpenStore) -> str | None:
    """The most recently active ``chat-…`` conversation of the database, if any."""
    best: tuple[datetime, str] | None = None
    cursor = None
    while True:
        page = await opened.conversations.list(limit=500, cursor=cursor)
        for head in page.items:
            if head.conversation_id.startswith(CHAT_PREFIX) and (best is None or head.updated_at > best[0]):
                best = (head.updated_at, head.conversation_id)
        if page.next_cursor is None:
            return best[1] if best else None
        cursor = page.next_cursor


def _history_line(message: Message) -> str:
    who = {"user": "[bold cyan]you ›[/]", "assistant": "[bold magenta]assistant ›[/]"}.get(
        message.role, f"[dim]{message.role} ›[/]"
    )
    text = text_of(message) or ", ".join(p.type for p in message.parts) or "(empty)"
    status = "" if message.status in ("committed", "completed") else f" [yellow]({message.status})[/]"
    return f"  {who} {escape(text)}{status}"


class TerminalLines:
    """The file a terminal chat's Rich console writes to. Complete lines go to ``emit`` (prompt_toolkit's
    stdout proxy: printed above the input line); the line still being written (an answer streaming) is kept
    in ``partial`` and shown above the input line by the prompt, until its newline arrives."""

    encoding = "utf-8"

    def __init__(self, emit: Callable[[str], None]) -> None:
        self.emit = emit
        self.changed: Callable[[], None] = lambda: None
        """Called after every write: the chat redraws its prompt (set once the chat exists)."""
        self.partial = ""

    def write(self, text: str) -> int:
        self.partial += text
        if "\n" in self.partial:
            done, self.partial = self.partial.rsplit("\n", 1)
            self.emit(done + "\n")
        self.changed()
        return len(text)

    def flush(self) -> None:
        self.changed()

    def isatty(self) -> bool:
        return True


class ChatSession:
    def __init__(
        self, console: Console, conversation_id: str, policy: str, *, base_url: str | None = None, tty: bool = False
    ) -> None:
        self.console = console
        self.conversation_id = conversation_id
        self.policy = policy
        self.base_url = base_url
        self.tty = tty
        """stdin and stdout are a terminal: prompt_toolkit reads the lines and keeps the input line below."""
        self.prompts = tty or sys.stdin.isatty()
        """Print a prompt before reading a line (a person types it, e.g. with stdout piped to ``tee``)."""
        self.lines_out: TerminalLines | None = None
        self.prompt_app: Any = None
        self.runtime: AgentRuntime | None = None
        self.printer = StreamPrinter(console, label=lambda _run_id: "[bold magenta]assistant[/]", indent="")
        self.running: str | None = None
        self.pending: set[asyncio.Task[None]] = set()
        self.causes: dict[str, str] = {}
        self.quit = asyncio.Event()
        self.lines: asyncio.Queue[str | None] = asyncio.Queue()
        self.last_interrupt = float("-inf")
        self.prompted = False
        self.ended = False
        self.session = uuid.uuid4().hex[:8]
        self.sent = 0

    # ---------------------------------------------------------------------------------------- events

    def on_event(self, event: Any) -> None:
        if self.prompted and event.type in ("assistant-delta", "tool-status", "terminal", "attempt-reset"):
            self.prompted = False
            self.printer.open_run = "prompt"  # the prompt's line is open: close it before printing
        self.printer(event)
        if event.type == "terminal" and not self.pending:
            self.prompt()  # an answer this window gave to another window's message: ready for input again
        if event.type == "run-state":
            if event.state == "running":
                self.running = event.run_id
            elif event.run_id == self.running and event.state not in ("interrupt_requested", "queued"):
                self.running = None

    def on_operator(self, event: Any) -> None:
        if event.type == "run-terminal" and event.cause:
            cause = event.cause if isinstance(event.cause, dict) else {}
            name = str(cause.get("type", "")).rsplit(".", 1)[-1]
            self.causes[event.run_id] = " ".join(f"{name}: {cause.get('message', '')}".split())[:240]

    def note(self, markup: str) -> None:
        if self.prompted:
            self.prompted = False
            self.console.print()
        self.printer.note(markup)

    def prompt(self) -> None:
        if self.tty or not self.prompts:  # prompt_toolkit keeps its input line on screen; a pipe needs none
            return
        if not self.pending and not self.quit.is_set() and not self.prompted and not self.ended:
            self.printer.close_line()
            self.console.print(PROMPT, end="")
            self.console.file.flush()
            self.prompted = True

    # ----------------------------------------------------------------------------------------- input

    def start_reader(self, loop: asyncio.AbstractEventLoop) -> None:
        """Read stdin on a thread, so the event loop keeps streaming while a person types."""

        def read() -> None:
            while True:
                try:
                    line = sys.stdin.readline()
                except (OSError, ValueError):
                    line = ""
                try:
                    loop.call_soon_threadsafe(self.lines.put_nowait, line.rstrip("\r\n") if line else None)
                except RuntimeError:  # the chat ended and its loop is closed
                    return
                if not line:
                    return

        threading.Thread(target=read, name="threadline-chat-stdin", daemon=True).start()

    def prompt_message(self) -> Any:
        """The prompt: the answer's line still streaming (if any), then the input line."""
        from prompt_toolkit.formatted_text import ANSI

        partial = self.lines_out.partial if self.lines_out is not None else ""
        return ANSI(f"{partial}\n{PROMPT_ANSI}" if partial else PROMPT_ANSI)

    def start_prompt(self, loop: asyncio.AbstractEventLoop) -> asyncio.Task[None]:
        """Read lines with prompt_toolkit (a terminal): Ctrl-C at the prompt is a key press, not SIGINT."""
        from prompt_toolkit import PromptSession

        session: PromptSession[str] = PromptSession(erase_when_done=True)
        self.prompt_app = session.app

        async def read() -> None:
            while not self.quit.is_set():
                try:
                    line = await session.prompt_async(self.prompt_message)
                except KeyboardInterrupt:
                    self.on_sigint()
                    continue
                except EOFError:
                    self.lines.put_nowait(None)
                    return
                self.lines.put_nowait(line)

        return loop.create_task(read())

    def redraw(self) -> None:
        app = self.prompt_app
        if app is not None and app.is_running:
            app.invalidate()

    def on_sigint(self) -> None:
        loop = asyncio.get_running_loop()
        now = loop.time()
        if self.running is not None and now - self.last_interrupt > DOUBLE_PRESS:
            self.last_interrupt = now
            task = loop.create_task(self.interrupt(self.running))
            task.add_done_callback(lambda t: t.cancelled() or t.exception())
        else:
            self.quit.set()

    async def interrupt(self, run_id: str) -> None:
        assert self.runtime is not None
        try:
            result = await self.runtime.interrupt(conversation_id=self.conversation_id, run_id=run_id)
        except ThreadlineError as error:
            self.note(f"[red]could not interrupt:[/] {escape(str(error))}")
            return
        if result.outcome in ("requested", "already_requested"):
            self.note("[yellow]⏹ interrupt requested (durable)[/] [dim]— Ctrl-C again to leave[/]")

    # ------------------------------------------------------------------------------------------ runs

    def follow(self, ticket: AgentRuntimeTicket, admitted: bool = False) -> None:
        task = asyncio.get_running_loop().create_task(self._follow(ticket, admitted))
        self.pending.add(task)
        task.add_done_callback(self._settled)

    def _settled(self, task: asyncio.Task[None]) -> None:
        self.pending.discard(task)
        if not task.cancelled() and task.exception() is not None:
            self.note(f"[red]error:[/] {escape(str(task.exception()))}")
        self.prompt()

    async def _follow(self, ticket: AgentRuntimeTicket, admitted: bool) -> None:
        try:
            if not admitted:
                await ticket.admission
            try:
                result = await ticket.result
            except AgentRunUnsettledError as error:
                if error.run is None or error.run.state != "queued":
                    raise
                # queued behind a run another chat window (or worker) executes: that process answers it
                # when its run ends; show the answer from the store once it is there
                self.note("[dim]  ↳ queued behind an answer another window is giving; it answers this too[/]")
                result = await self._stored_result(error.run.id)
                self.note(f"[bold magenta]assistant[/] {escape(text_of(result.assistant) if result.assistant else '')}")
        except ThreadlineError as error:
            self.note(f"[red]error:[/] {escape(' '.join(str(error).split()))}")
            return
        if result.terminal_reason == "absorbed":
            self.note("[dim]  (answered together with the message it joined)[/]")
            return
        cause = self.causes.pop(result.run.id, None)
        if cause and result.terminal_reason not in ("success", "interrupted", "superseded", "shutdown"):
            at = (
                f" (model server {self.base_url})"
                if self.base_url and result.terminal_reason == "provider_failure"
                else ""
            )
            self.note(f"  [red]cause:[/] {escape(cause)}{escape(at)}")
        self.note(f"[dim]  usage: {escape(usage_text(result.usage))}[/]")

    async def _stored_result(self, run_id: str) -> Any:
        """The result of a run another process executes, read from the store until it ended."""
        assert self.runtime is not None
        delay = 0.05
        while True:
            loaded = await self.runtime.store.load_run(conversation_id=self.conversation_id, run_id=run_id)
            if loaded is not None and loaded.run.terminal:
                return self.runtime.result_from(loaded.run, loaded.assistant)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.5)

    def send(self, text: str) -> None:
        assert self.runtime is not None
        busy = bool(self.pending)
        self.sent += 1
        ticket = self.runtime.submit(
            conversation_id=self.conversation_id,
            idempotency_key=f"{self.session}-{self.sent}",
            context=CliContext(),
            parts=[{"type": "text", "text": text}],
        )
        # echoed as the user's message (prompt_toolkit erased the typed line; a pipe never showed it)
        what = f"policy {self.policy}: {CONSEQUENCE.get(self.policy, 'applied')}" if busy else f"policy {self.policy}"
        self.note(f"[bold cyan]you ›[/] {escape(text)}  [dim]({what})[/]")
        self.follow(ticket)

    async def resume_pending(self, opened: OpenStore) -> None:
        """Answer inputs an earlier chat left queued; warn about a run a dead process left running."""
        assert self.runtime is not None
        active = await opened.store.list_active_runs(conversation_id=self.conversation_id)
        if not active.runs:
            return
        head = active.runs[0]
        if head.acquired and head.lease_expires_at is not None and head.lease_expires_at <= datetime.now(UTC):
            # its process stopped renewing the lease: it is gone. The chat's only tool reads the clock,
            # so answering again is safe (replay_safe)
            with contextlib.suppress(ThreadlineError):
                await opened.store.recover_run(
                    conversation_id=self.conversation_id,
                    run_id=head.id,
                    expected_revision=head.revision,
                    action="requeue",
                    replay_safe=True,
                )
                self.note(f"[yellow]run {escape(head.id)}'s lease expired (its chat is gone): answering it again[/]")
            active = await opened.store.list_active_runs(conversation_id=self.conversation_id)
            if not active.runs:
                return
            head = active.runs[0]
        if head.acquired:
            until = ""
            if head.lease_expires_at is not None:
                until = f" until its lease expires ({head.lease_expires_at.astimezone().strftime('%H:%M:%S')})"
            self.note(
                f"[yellow]run {escape(head.id)} is {head.state} in another process ({escape(head.owner_id or '?')})"
                f"[/]: new messages wait behind it{until}. If that process is gone, run "
                f"[bold]threadline recover --abandon-stale -c {escape(self.conversation_id)}[/]"
            )
            return
        self.note(f"[dim]answering {len(active.runs)} message(s) left queued by an earlier session[/]")
        for run in active.runs:
            ticket = await self.runtime.resume(
                conversation_id=self.conversation_id, run_id=run.id, context=CliContext()
            )
            self.follow(ticket, admitted=True)

    # ------------------------------------------------------------------------------------------ loop

    async def run(self) -> None:
        self.prompt()
        while True:
            get = asyncio.ensure_future(self.lines.get())
            stop = asyncio.ensure_future(self.quit.wait())
            await asyncio.wait({get, stop}, return_when=asyncio.FIRST_COMPLETED)
            stop.cancel()
            if self.quit.is_set():
                get.cancel()
                return
            line = get.result()
            self.prompted = False
            if not self.tty:
                self.printer.open_run = None  # the Enter key ended the line on screen
            if line is None:  # end of input: let the answers in progress finish (Ctrl-C leaves at once)
                self.ended = True
                if self.pending:
                    if self.printer.open_run is None:  # never cut an answer's line in two for this remark
                        self.note("[dim](end of input: waiting for the answers in progress)[/]")
                    waiter = asyncio.ensure_future(asyncio.wait(set(self.pending)))
                    stop = asyncio.ensure_future(self.quit.wait())
                    await asyncio.wait({waiter, stop}, return_when=asyncio.FIRST_COMPLETED)
                    stop.cancel()
                    waiter.cancel()
                return
            text = line.strip()
            if text in ("/quit", "/exit"):
                return
            if not text:
                self.prompt()
                continue
            self.send(text)


async def _chat(choice: ModelChoice, *, tty: bool, **options: Any) -> int:
    """The chat. In a terminal (``tty``) everything prints through prompt_toolkit's stdout proxy, so the
    input line stays below the answer and what a person types is never mixed into it."""
    if not tty:
        return await _chat_on(Console(highlight=False), choice, **options)
    from prompt_toolkit.patch_stdout import StdoutProxy

    real_stdout, real_stderr = sys.stdout, sys.stderr
    proxy = StdoutProxy(sleep_between_writes=0.02, raw=True)
    lines = TerminalLines(proxy.write)
    # the width is read from the terminal (stdin/stdout) at each print: a resized window is followed
    console = Console(file=lines, force_terminal=True, highlight=False)  # type: ignore[arg-type]
    sys.stdout = sys.stderr = proxy  # type: ignore[assignment]  # stray prints (warnings) go above the prompt too
    try:
        return await _chat_on(console, choice, lines=lines, **options)
    finally:
        if lines.partial:
            proxy.write(lines.partial + "\n")
            lines.partial = ""
        proxy.close()  # writes what it still holds
        sys.stdout, sys.stderr = real_stdout, real_stderr


async def _chat_on(
    console: Console,
    choice: ModelChoice,
    *,
    db: Path | None,
    dsn: str | None,
    schema: str | None,
    conversation: str | None,
    policy: str,
    base_url: str | None,
    lines: TerminalLines | None = None,
    coding_root: Path | None = None,
) -> int:
    """The chat on ``console``; with ``lines`` (a terminal) prompt_toolkit reads the input."""
    tty = lines is not None
    loop = asyncio.get_running_loop()
    tools = [clock_tool()]
    if coding_root is not None:
        from ..coding import create_agent_coding_tools

        # the user chose this directory for the model: its file tools are allowed there, and nothing runs
        tools += create_agent_coding_tools(root=coding_root.resolve(), authorize=lambda payload: True)
    async with open_store(db, dsn, schema=schema) as opened:
        conversation_id = conversation or await default_conversation(opened)
        new = conversation_id is None
        if conversation_id is None:
            conversation_id = f"{CHAT_PREFIX}{datetime.now(UTC).strftime('%Y%m%d-%H%M%S')}"
        session = ChatSession(console, conversation_id, policy, base_url=base_url, tty=tty)
        session.lines_out = lines
        if lines is not None:
            lines.changed = session.redraw
        runtime = build_runtime(
            opened.store,
            choice.model,
            model_name="chat",
            policy=policy,
            tools=tools,
            publish=session.on_event,
            operator_publish=session.on_operator,
            lease_duration=LEASE,
        )
        session.runtime = runtime
        console.print(f"[bold]threadline chat[/]  database {escape(opened.where)}")
        console.print(f"model         {escape(choice.label)}")
        console.print(f"conversation  {escape(conversation_id)}{' (new)' if new else ''}    policy {policy}")
        say(
            console,
            "[dim]Enter sends. Typing while the model answers applies the policy. Ctrl-C interrupts the "
            "answer (durably); Ctrl-C twice, Ctrl-D or /quit leaves.[/]",
        )
        if not new:
            page = await opened.conversations.messages(conversation_id, limit=HISTORY, direction="before")
            if page.items:
                more = " (and earlier)" if page.next_cursor else ""
                console.rule(f"[dim]last {len(page.items)} messages{more}[/]", align="left", style="dim")
                for message in page.items:
                    say(console, _history_line(message))
                console.rule(style="dim")
        loop.add_signal_handler(signal.SIGINT, session.on_sigint)
        reader: asyncio.Task[None] | None = None
        try:
            if not tty:
                session.start_reader(loop)
            await session.resume_pending(opened)
            if tty:  # the input line appears once the start-up notes are on screen: the chat is ready
                reader = session.start_prompt(loop)
            await session.run()
        finally:
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.remove_signal_handler(signal.SIGINT)
            session.quit.set()
            if reader is not None:
                if session.prompt_app is not None and session.prompt_app.is_running:
                    session.prompt_app.exit(exception=EOFError)
                with contextlib.suppress(BaseException):
                    await asyncio.wait_for(reader, 5)
            closed = await runtime.close(grace_period=0, force_timeout=10)
            for task in list(session.pending):
                task.cancel()
            if session.prompted:
                console.print()
            session.printer.close_line()
            left = await _left_behind(opened, conversation_id, stopped=not closed.timed_out)
            if closed.timed_out:
                left += f" {closed.remaining} run(s) did not stop in time: `threadline recover` settles them."
            say(console, f"[dim]bye — conversation {escape(conversation_id)} is saved.{left}[/]")
    return 0


async def _left_behind(opened: OpenStore, conversation_id: str, *, stopped: bool) -> str:
    """What is still queued (or running elsewhere) on the conversation after the close, read from the store.
    ``stopped``: every run of this chat stopped in time, so a run still running is another process's."""
    try:
        active = await opened.store.list_active_runs(conversation_id=conversation_id)
    except ThreadlineError as error:
        return f" (could not read what is still queued: {' '.join(str(error).split())})"
    queued = sum(1 for r in active.runs if r.state == "queued")
    other = len(active.runs) - queued
    if not active.runs:
        return " Nothing is queued."
    parts = []
    if queued:
        parts.append(f"{queued} message{'s' if queued != 1 else ''} still queued: the next chat on it answers them")
    if other and stopped:
        parts.append(f"{other} run{'s' if other != 1 else ''} still running in another process")
    return " " + "; ".join(parts) + "." if parts else ""


def run_chat(
    *,
    db: Path | None,
    dsn: str | None,
    schema: str | None = None,
    conversation: str | None,
    model: str | None,
    base_url: str | None,
    policy: str,
    pace: float,
    coding_root: Path | None = None,
) -> int:
    choice = choose_model(model, base_url, pace=pace)
    check_model(choice, model or "scripted")
    if base_url is not None:
        check_reachable(base_url)
    tty = sys.stdin.isatty() and sys.stdout.isatty()
    options = {"db": db, "dsn": dsn, "schema": schema, "conversation": conversation, "policy": policy}
    return asyncio.run(_chat(choice, tty=tty, base_url=base_url, coding_root=coding_root, **options))
