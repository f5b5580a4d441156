"""Printing delivery events as they arrive: streamed text, tool status, terminals, usage."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.text import Text

from ..records import Message
from ..usage import AgentUsage

REASON_STYLE = {
    "success": "green",
    "absorbed": "cyan",
    "interrupted": "yellow",
    "superseded": "magenta",
    "cancelled": "yellow",
    "shutdown": "yellow",
    "abandoned": "red",
}


def say(console: Console, markup: str) -> None:
    """Print ``markup``; wrapped lines keep its leading indentation."""
    body = markup.lstrip(" ")
    indent = len(markup) - len(body)
    for line in Text.from_markup(body).wrap(console, max(20, console.width - indent)):
        line.rstrip()
        console.print(Text(" " * indent) + line)


def short(run_id: str) -> str:
    """``run_4f0c1a2b…`` → ``run_4f0c1a``: enough to tell runs apart on screen."""
    prefix, _, rest = run_id.partition("_")
    return f"{prefix}_{rest[:6]}" if rest else run_id[:10]


def reason_markup(reason: str | None) -> str:
    if not reason:
        return "—"
    return f"[{REASON_STYLE.get(reason, 'red')}]{escape(reason)}[/]"


def text_of(message: Message | None) -> str:
    if message is None:
        return ""
    return " ".join(p.text for p in message.parts if p.type == "text")


def usage_text(usage: AgentUsage | None) -> str:
    """``in 52 · out 31 (computed) · cost unavailable``: each figure with where it came from."""
    if usage is None or usage.steps == 0:
        return "no provider call (usage unavailable)"
    figures = []
    for label, figure in (("in", usage.input_tokens), ("out", usage.output_tokens)):
        if figure.value is None:
            figures.append(f"{label} unavailable")
        else:
            floor = " at least" if figure.floor else ""
            figures.append(f"{label}{floor} {figure.value} ({figure.provenance})")
    cost = usage.cost
    if cost.amount is None:
        figures.append("cost unavailable")
    else:
        figures.append(f"cost {cost.amount} {cost.currency} ({cost.provenance})")
    steps = f"{usage.steps} step" + ("s" if usage.steps != 1 else "")
    return f"{' · '.join(figures)} · {steps}"


def usage_cells(usage: AgentUsage | None) -> tuple[str, str, str]:
    """``("100/38", "computed", "unavailable")``: tokens in/out, their provenance, the cost."""
    if usage is None or usage.steps == 0:
        return "—", "unavailable", "unavailable"
    figures = (usage.input_tokens, usage.output_tokens)
    tokens = "/".join("?" if f.value is None else (f"≥{f.value}" if f.floor else str(f.value)) for f in figures)
    provenance = "/".join(dict.fromkeys(f.provenance for f in figures))
    cost = usage.cost
    money = "unavailable" if cost.amount is None else f"{cost.amount} {cost.currency} ({cost.provenance})"
    return tokens, provenance, money


def _compact_json(value: Any, limit: int = 48) -> str:
    text = json.dumps(value, ensure_ascii=False) if not isinstance(value, str) else value
    return text if len(text) <= limit else text[: limit - 1] + "…"


class StreamPrinter:
    """A ``publish`` callback that prints what a person wants to watch: the answer as it streams, tool
    status lines, and one line when a run ends. ``label(run_id)`` names a run on screen."""

    def __init__(self, console: Console, label: Callable[[str], str] | None = None, indent: str = "  ") -> None:
        self.console = console
        self.label = label or (lambda run_id: short(run_id))
        self.indent = indent
        self.open_run: str | None = None
        self.streamed: dict[str, str] = {}
        self.tools: list[tuple[str, str, str]] = []
        self.on_terminal: Callable[[Any], None] | None = None

    def close_line(self) -> None:
        if self.open_run is not None:
            self.console.print()
            self.open_run = None

    def _open(self, run_id: str) -> None:
        if self.open_run != run_id:
            self.close_line()
            self.console.print(f"{self.indent}{self.label(run_id)} [bold magenta]▸[/] ", end="")
            self.open_run = run_id

    def note(self, markup: str) -> None:
        """Print commentary (after closing a line the stream left open), wrapped at its indentation."""
        self.close_line()
        say(self.console, markup)

    def __call__(self, event: Any) -> None:
        kind = getattr(event, "type", None)
        if kind == "assistant-delta":
            self._open(event.run_id)
            self.streamed[event.run_id] = self.streamed.get(event.run_id, "") + event.delta
            self.console.print(escape(event.delta), end="")
            self.console.file.flush()
        elif kind == "tool-status":
            self.close_line()
            self.tools.append((event.run_id, event.tool_name, event.status))
            detail = ""
            if event.status == "started":
                detail = f" {escape(_compact_json(event.input))}" if event.input not in (None, {}) else ""
            elif event.status == "completed":
                detail = f" → {escape(_compact_json(event.output))}"
            elif event.status == "failed" and event.error:
                detail = f" → {escape(str(event.error.get('error')))}"
            style = {"started": "cyan", "completed": "green"}.get(event.status, "yellow")
            self.console.print(
                f"{self.indent}{self.label(event.run_id)} [bold]⚙ {escape(event.tool_name)}[/]"
                f" [{style}]{event.status}[/]{detail}"
            )
        elif kind == "attempt-reset":
            self.close_line()
            self.streamed.pop(event.run_id, None)
            self.console.print(f"{self.indent}{self.label(event.run_id)} [yellow]↺ provider retried[/]")
        elif kind == "terminal":
            reason = reason_markup(event.terminal_reason)
            if self.open_run == event.run_id:
                self.console.print(f" ⟨{reason}⟩", end="")
            else:
                self.close_line()
                self.console.print(f"{self.indent}{self.label(event.run_id)} ⟨{reason}⟩", end="")
                self.open_run = event.run_id
            self.close_line()
            if self.on_terminal is not None:
                self.on_terminal(event)
