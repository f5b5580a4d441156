"""LangGraph's prebuilt agent on its SQLite checkpointer: per-turn time as one conversation grows.

    bench/setup-peers            # once: creates bench/.venv-peers
    bench/.venv-peers/bin/python bench/langgraph_turns.py [--sizes 40 400 2000] [--window 20]
                                 [--saver sync|async] [--size-turns 500] [--quick] [--max-seconds 300]

The same workload as ``bench/turns.py`` (``bench/workload.py``): each turn is one user question, one call
of the ``lookup(query)`` tool, its result, and an answer of about 200 characters from a zero-latency fake
chat model (a ``BaseChatModel`` that returns the tool call first and the answer once the tool result is the
last message). The agent is ``langgraph.prebuilt.create_react_agent`` with the SQLite checkpointer
(``SqliteSaver`` with ``graph.invoke``, or ``AsyncSqliteSaver`` with ``graph.ainvoke``), on a temp file,
with LangGraph's defaults (durability, serializer, pragmas).

LangGraph keeps four messages per turn of this workload (human, AI tool call, tool result, AI answer), and
its state is what the checkpointer stores, so history is grown by real turns only (no seeding). For each
size ``n`` the window of ``--window`` turns is centred on ``n`` messages. Lines:

    system=langgraph store=sqlite messages=<n> per_turn_ms=<t> db_bytes=<b> turns=<k> saver=<sync|async>

``messages`` is LangGraph's own count at the window's centre, ``turns`` the same content in turns
(messages / 4; compare with threadline on ``turns``: threadline stores two messages per turn).
``db_bytes`` is the main file plus ``-wal`` after a ``wal_checkpoint(TRUNCATE)`` from a second connection.
The size line is taken in the same growing database when it reaches ``--size-turns`` turns (500 by
default: the DESIGN §5 workload) — the same thing as a fresh database with 500 real turns.

``--quick`` measures 40 and 400 messages with 10-turn windows and the size at 100 turns. ``--max-seconds``
bounds the run: past it the growth stops and a ``status=budget-exceeded`` line says how far it got.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sqlite3
import statistics
import sys
import tempfile
import time
import uuid
import warnings
from collections.abc import Callable, Sequence
from importlib.metadata import version
from pathlib import Path
from typing import Any

from langchain_core.callbacks import CallbackManagerForLLMRun
from langchain_core.language_models.chat_models import BaseChatModel
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, ToolMessage
from langchain_core.outputs import ChatGeneration, ChatResult
from langchain_core.tools import tool
from langgraph.prebuilt import create_react_agent

sys.path.insert(0, str(Path(__file__).resolve().parent))
from workload import ANSWER, QUERY, TOOL_NAME, TOOL_RESULT, additions_s, machine_line, question


class ScriptedChatModel(BaseChatModel):
    """Zero latency: a tool call when the last message is not a tool result, else the answer."""

    @property
    def _llm_type(self) -> str:
        return "scripted"

    def _respond(self, messages: list[BaseMessage]) -> AIMessage:
        if messages and isinstance(messages[-1], ToolMessage):
            return AIMessage(content=ANSWER)
        call = {"name": TOOL_NAME, "args": {"query": QUERY}, "id": f"call_{uuid.uuid4().hex}", "type": "tool_call"}
        return AIMessage(content="", tool_calls=[call])

    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        return ChatResult(generations=[ChatGeneration(message=self._respond(messages))])

    async def _agenerate(
        self, messages: list[BaseMessage], stop: Any = None, run_manager: Any = None, **kwargs: Any
    ) -> ChatResult:
        return ChatResult(generations=[ChatGeneration(message=self._respond(messages))])

    def bind_tools(self, tools: Sequence[Any], **kwargs: Any) -> ScriptedChatModel:  # type: ignore[override]
        return self


@tool(TOOL_NAME)
def lookup(query: str) -> dict[str, Any]:
    """Look a query up in the knowledge base."""
    return {**TOOL_RESULT, "query": query}


def agent(model: BaseChatModel, checkpointer: Any) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # deprecated in favour of langchain.agents.create_agent (same graph)
        return create_react_agent(model, [lookup], checkpointer=checkpointer)


def db_bytes(path: Path) -> int:
    return sum(os.path.getsize(p) for p in (path, Path(f"{path}-wal")) if p.exists())


def checkpoint(path: Path) -> str:
    conn = sqlite3.connect(path, timeout=5)
    try:
        busy, log, done = conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
        return "ok" if busy == 0 else f"busy(log={log},checkpointed={done})"
    finally:
        conn.close()


class Grower:
    def __init__(self, invoke: Callable[[dict[str, Any]], Any], path: Path, saver: str, budget_s: float) -> None:
        self.invoke = invoke
        self.path = path
        self.saver = saver
        self.turns = 0
        self.messages = 0
        self.started = time.monotonic()
        self.budget_s = budget_s
        self.size_turns: int | None = None
        self.size_times: list[int] = []
        self.all_times: list[int] = []
        self.speed = additions_s()  # the machine's speed before the first timed turn (the size line)

    def over_budget(self) -> bool:
        return time.monotonic() - self.started > self.budget_s

    async def turn(self) -> int:
        k = self.turns
        start = time.perf_counter_ns()
        out = await self.invoke({"messages": [HumanMessage(content=question(k))]})
        elapsed = time.perf_counter_ns() - start
        messages = out["messages"]
        last = messages[-1]
        if not (isinstance(last, AIMessage) and last.content == ANSWER and isinstance(messages[-2], ToolMessage)):
            raise RuntimeError(f"turn {k}: unexpected ending {[type(m).__name__ for m in messages[-4:]]}")
        self.turns += 1
        self.messages = len(messages)
        self.all_times.append(elapsed)
        if self.size_turns is not None and self.turns == self.size_turns:
            status = checkpoint(self.path)
            tail = self.all_times[-20:]
            print(
                f"system=langgraph store=sqlite messages={self.messages} "
                f"per_turn_ms={statistics.median(tail) / 1e6:.2f} db_bytes={db_bytes(self.path)} "
                f"turns={self.turns} saver={self.saver} history=real "
                f"total_s={sum(self.all_times) / 1e9:.1f} checkpoint={status} additions_s={self.speed:.2f} "
                f"(per_turn_ms: median of the last 20 turns)",
                flush=True,
            )
        return elapsed


async def run(args: argparse.Namespace, path: Path, invoke: Callable[[dict[str, Any]], Any]) -> int:
    grower = Grower(invoke, path, args.saver, args.max_seconds)
    grower.size_turns = args.size_turns or None
    sizes = sorted(args.sizes)
    for n in sizes:
        start_at = n - 2 * args.window  # a window of W turns spans 4W messages
        while grower.messages < start_at:
            if grower.over_budget():
                print(f"status=budget-exceeded system=langgraph reached_messages={grower.messages} "
                      f"reached_turns={grower.turns} wanted_messages={n} max_seconds={args.max_seconds}")  # fmt: skip
                return 1
            await grower.turn()
        speed = additions_s()  # the machine's speed right before the timed turns
        times = [await grower.turn() for _ in range(args.window)]
        status = checkpoint(path)
        print(
            f"system=langgraph store=sqlite messages={n} per_turn_ms={statistics.median(times) / 1e6:.2f} "
            f"db_bytes={db_bytes(path)} turns={n // 4} saver={args.saver} history=real window_turns={args.window} "
            f"p90_ms={statistics.quantiles(times, n=10)[-1] / 1e6:.2f} checkpoint={status} additions_s={speed:.2f}",
            flush=True,
        )
    while grower.size_turns is not None and grower.turns < grower.size_turns:
        if grower.over_budget():
            print(f"status=budget-exceeded system=langgraph reached_turns={grower.turns} "
                  f"wanted_turns={grower.size_turns} db_bytes={db_bytes(path)}")  # fmt: skip
            return 1
        await grower.turn()
    return 0


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=None, help="history sizes in LangGraph messages")
    parser.add_argument("--window", type=int, default=None, help="timed turns per size (default 20)")
    parser.add_argument("--saver", choices=("sync", "async"), default="sync")
    parser.add_argument("--size-turns", type=int, default=None, help="turns at which to print the size (0: off)")
    parser.add_argument("--quick", action="store_true", help="40 and 400 messages, 10-turn windows, size at 100")
    parser.add_argument("--max-seconds", type=float, default=300.0, help="stop growing past this")
    args = parser.parse_args()
    args.sizes = args.sizes or ([40, 400] if args.quick else [40, 400, 2000])
    args.window = args.window or (10 if args.quick else 20)
    if args.size_turns is None:
        args.size_turns = 100 if args.quick else 500
    if any(n < 2 * args.window for n in args.sizes):
        parser.error(f"sizes are at least 2 × --window ({2 * args.window})")
    print(machine_line(), flush=True)
    names = ("langgraph", "langgraph-prebuilt", "langgraph-checkpoint", "langgraph-checkpoint-sqlite", "langchain-core")
    print("# versions: " + " ".join(f"{n}=={version(n)}" for n in names), flush=True)
    model = ScriptedChatModel()
    config = {"configurable": {"thread_id": "bench-thread"}, "recursion_limit": 10}
    with tempfile.TemporaryDirectory(prefix="langgraph-turns-") as tmp:
        path = Path(tmp) / "langgraph.db"
        if args.saver == "sync":
            from langgraph.checkpoint.sqlite import SqliteSaver

            conn = sqlite3.connect(path, check_same_thread=False)
            try:
                saver = SqliteSaver(conn)
                saver.setup()
                graph = agent(model, saver)

                async def invoke(state: dict[str, Any]) -> Any:
                    return graph.invoke(state, config)

                return await run(args, path, invoke)
            finally:
                conn.close()
        from langgraph.checkpoint.sqlite.aio import AsyncSqliteSaver

        async with AsyncSqliteSaver.from_conn_string(str(path)) as asaver:
            await asaver.setup()
            agraph = agent(model, asaver)

            async def ainvoke(state: dict[str, Any]) -> Any:
                return await agraph.ainvoke(state, config)

            return await run(args, path, ainvoke)


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
