"""threadline's built-in scripted model: a pydantic-ai ``FunctionModel`` that answers offline.

The demo, ``threadline chat`` without ``--model`` and ``threadline recover`` without ``--model`` use it. It
reads the prompt it is given (like a real model would) and answers from a small script, so a recovering
process answers exactly like the process that crashed would have:

- it answers every user input of the current turn (the inputs since its last finished answer, including
  inputs that joined the turn at a step boundary);
- for a topic it keeps notes on (Lisbon, Porto) it first calls the ``lookup`` tool when that tool is
  offered; asked for the time, it calls ``current_time`` when offered;
- when its previous answer was cut off (the history carries the interrupted marker) it says so.

Streaming is word by word. ``pace`` (seconds between words) is for display only; ``hold`` is a hook the
demo uses to pause an answer at a chosen word until an event of its own, so what happens is decided by
events, never by timing.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from pydantic_ai.messages import (
    ModelRequest,
    ModelResponse,
    TextPart,
    ToolCallPart,
    ToolReturnPart,
    UserPromptPart,
)
from pydantic_ai.models.function import AgentInfo, DeltaToolCall, FunctionModel

from ..history.projection import INTERRUPTED_MARKER

SCRIPTED_MODEL_NAME = "threadline-scripted"

NOTES = {
    "lisbon": "Belém tower at nine, pastéis de nata, the 28 tram through Alfama, sunset at Miradouro da Graça",
    "porto": "the Ribeira at noon, Livraria Lello, a port cellar in Gaia, sunset on the Dom Luís I bridge",
}
"""What the ``lookup`` tool knows (the demo's tool answers from this)."""

Hold = Callable[[int, int], Awaitable[None]]
"""``hold(call_index, words_streamed)``: awaited after each streamed word of a text answer and before a
tool call (then ``words_streamed`` is -1)."""


def _text_of(part: UserPromptPart) -> str:
    if isinstance(part.content, str):
        return part.content
    return " ".join(c for c in part.content if isinstance(c, str))


@dataclass
class Turn:
    """What the model reads from its prompt: the inputs it answers, tool results of this turn, and whether
    its previous answer was cut off."""

    inputs: list[str]
    returns: list[ToolReturnPart]
    previous_cut_off: bool
    earlier_topic: str | None = None


def read_turn(messages: list[Any]) -> Turn:
    """The current turn: the user inputs after the last answer that called no tool; and from before it,
    whether that answer was cut off and the last city talked about."""
    inputs: list[str] = []
    returns: list[ToolReturnPart] = []
    previous_cut_off = False
    earlier: list[str] = []
    in_turn = True
    for message in reversed(messages):
        if isinstance(message, ModelResponse):
            if in_turn and any(isinstance(p, ToolCallPart) for p in message.parts):
                continue  # a step of this turn
            if in_turn:
                texts = [p.content for p in message.parts if isinstance(p, TextPart)]
                previous_cut_off = any(INTERRUPTED_MARKER in t for t in texts)
                in_turn = False
            continue
        if isinstance(message, ModelRequest):
            for part in reversed(message.parts):
                if isinstance(part, UserPromptPart):
                    (inputs if in_turn else earlier).insert(0, _text_of(part))
                elif isinstance(part, ToolReturnPart) and in_turn:
                    returns.insert(0, part)
    topics = [t for t in map(_topic, earlier) if t is not None]
    return Turn(inputs, returns, previous_cut_off, topics[-1] if topics else None)


def _topic(text: str) -> str | None:
    lowered = text.lower()
    # the last topic named wins: "Actually, make it Porto" after "a day in Lisbon" means Porto
    found = [(lowered.rfind(name), name) for name in NOTES if name in lowered]
    return max(found)[1] if found else None


def _answer_one(text: str, notes: dict[str, str], context_topic: str | None) -> str:
    lowered = text.lower()
    topic = _topic(text)
    if "restaurant" in lowered:
        where = (topic or context_topic or "lisbon").title()
        return f"For dinner in {where}, book a table at a small tasca and order the fish of the day."
    if topic is not None:
        facts = notes.get(topic) or NOTES[topic]
        switch = f"Switching to {topic.title()} as you asked. " if "actually" in lowered else ""
        return f"{switch}A day in {topic.title()}: {facts}."
    if "time" in lowered and "current_time" in notes:
        return f"It is {notes['current_time']}."
    quoted = " ".join(text.split())
    if len(quoted) > 60:
        quoted = quoted[:57] + "..."
    return (
        f"You said “{quoted}”. I am threadline's built-in scripted model, so this answer is canned: it streams "
        "word by word so you can type while I answer, press Ctrl-C, or restart the chat and find it again."
    )


def compose_answer(turn: Turn) -> str:
    """The text answering every input of ``turn`` (tool results feed the facts)."""
    notes: dict[str, str] = {}
    for r in turn.returns:
        if r.tool_name == "lookup" and isinstance(r.content, str) and ":" in r.content:
            topic, _, facts = r.content.partition(":")
            notes[topic.strip().lower()] = facts.strip()
        elif r.tool_name == "current_time":
            notes["current_time"] = str(r.content)
    parts = []
    if turn.previous_cut_off:
        parts.append("(My previous answer was cut off; picking up from here.)")
    inputs = turn.inputs or ["(nothing)"]
    corrections = [t for t in inputs if "actually" in t.lower() and _topic(t) is not None]
    if corrections:  # "Actually, make it Porto" replaces the plans asked for before it
        inputs = [t for t in inputs if _topic(t) is None or t is corrections[-1]]
    context_topic = turn.earlier_topic
    for text in inputs:
        parts.append(_answer_one(text, notes, context_topic))
        context_topic = _topic(text) or context_topic
    return " ".join(parts)


def _wanted_tool(turn: Turn, offered: set[str]) -> tuple[str, dict[str, Any]] | None:
    if turn.returns:
        return None
    text = " ".join(turn.inputs)
    topic = _topic(text)
    if topic is not None and "lookup" in offered and "restaurant" not in text.lower():
        return "lookup", {"topic": topic.title()}
    if re.search(r"\btime\b", text.lower()) and "current_time" in offered:
        return "current_time", {}
    return None


class ScriptedModel:
    """The built-in scripted model. ``model`` is the pydantic-ai ``FunctionModel`` to hand a registry."""

    def __init__(self, *, pace: float = 0.0, hold: Hold | None = None) -> None:
        self.pace = pace
        self.hold = hold
        self.calls = 0
        self.prompts: list[list[Any]] = []
        self.model = FunctionModel(stream_function=self._stream, model_name=SCRIPTED_MODEL_NAME)

    async def _stream(self, messages: list[Any], info: AgentInfo) -> AsyncIterator[Any]:
        call = self.calls
        self.calls += 1
        self.prompts.append(messages)
        turn = read_turn(messages)
        offered = {t.name for t in info.function_tools}
        tool = _wanted_tool(turn, offered)
        if tool is not None:
            name, args = tool
            preface = f"Let me check my notes on {args['topic']}." if name == "lookup" else "Let me look at the clock."
            async for chunk in self._words(call, preface):
                yield chunk
            if self.hold is not None:
                await self.hold(call, -1)
            yield {1: DeltaToolCall(name=name, json_args=json.dumps(args), tool_call_id=f"call_{call}")}
            return
        async for chunk in self._words(call, compose_answer(turn)):
            yield chunk

    async def _words(self, call: int, text: str) -> AsyncIterator[str]:
        words = text.split(" ")
        for i, word in enumerate(words):
            yield word if i == 0 else f" {word}"
            if self.pace:
                await asyncio.sleep(self.pace)
            if self.hold is not None:
                await self.hold(call, i + 1)
