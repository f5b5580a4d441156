"""Per-turn runtime overhead on SQLite with a zero-latency scripted model, as one conversation grows.

    .venv/bin/python bench/turns.py [--sizes 40 400 2000] [--window 20] [--no-turns-500]
                                    [--grow seed|real] [--profile] [--publish json] [--verbose]

The workload (the same as ``bench/langgraph_turns.py``): every turn is one user input; the model calls
``lookup(query)`` (which returns a small dict), sees the result and answers with about 200 characters.
The model answers at once, so what is measured is threadline itself: admission, lane, step loop, history
projection, store transactions on a real SQLite file (WAL, ``synchronous=NORMAL``) in a temporary
directory. By default it is a scripted pydantic-ai ``Model`` whose own cost per request does not depend on
the history (``bench/minimal_model.py``); ``--model function`` uses pydantic-ai's ``FunctionModel``
instead, which scans every message of the prompt twice per request (its instruction-state check and its
usage estimate: about 3 ms per turn at 2,000 messages, the test double's cost, not threadline's).

A threadline turn adds two messages to the conversation (the user input, and one assistant message whose
parts are the tool call, its result and the answer). For each size ``n`` one conversation is brought to
``n - window`` messages, then ``window`` turns are timed (``runtime.submit`` to ``await ticket.result``),
so the window is centred on ``n``; the median is printed. With ``--grow seed`` (default) the gap up to
a window is filled with ``seed_conversation_input(placement="after-settled")`` batches of messages with
the same shape as real turns, plus two untimed real turns; ``--grow real`` fills it with real turns only
(seeded history has no run records, real history has one per turn). Lines:

    system=threadline store=sqlite messages=<n> per_turn_ms=<t> db_bytes=<b> turns=<k> history=<seed|real> ...
    system=threadline store=sqlite messages=<n> turn_store_ops=<o> turn_commits=<c> turn_rows_read=<r> ...

Every line ends with ``additions_s=<s>``: ten million Python integer additions timed right before that
window's timed turns (``workload.additions_s``: the machine's speed that minute; per-turn times of a
machine twice as slow there are about twice as long).

``messages`` is the history at the window's centre, ``turns`` the same content in turns (messages / 2;
LangGraph stores four messages per turn of this workload, so compare the two systems on ``turns``).
``db_bytes`` is the main file plus ``-wal`` right after the window, after a ``wal_checkpoint(TRUNCATE)``
from a second connection. ``turn_store_ops`` / ``turn_commits`` are per-turn deltas of
``store.metrics`` (a commit is one write operation: ``BEGIN IMMEDIATE`` … ``COMMIT``); ``--verbose``
adds the per-operation breakdown, with each call's round trip as the event loop sees it and the worker
thread's time inside transactions (timed through two private hooks; a frame of overhead per call).

``--turns-500`` (on by default) then runs 500 real turns in a fresh database, closes the store,
checkpoints the WAL and prints the file size (DESIGN §5: under 5 MB, the event ledger included) and
``ledger_bytes``, the part of it the ledger's table and indexes take.

``--profile`` runs cProfile over a second, untimed window at the largest size (``--profile-size`` picks
another), so the printed medians are never taken under the profiler: the event-loop thread (top 25 by
cumulative time, and top 15 by own time) and the SQLite worker thread of the store (the same, separately;
cProfile sees one thread at a time).

``--publish json`` measures the cost of a publisher: two conversations grow side by side in the same
database, one runtime without ``publish=`` and one whose callback serializes every event with
``event.model_dump_json()``; their turns alternate. It prints events per turn, the difference of the
per-turn times (median of paired differences, turn by turn) divided by the events of a turn, and the time
spent inside the callback per event (the steadier figure: the difference is within the noise at large
histories).
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import json
import os
import pstats
import sqlite3
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel
from pydantic_ai.messages import ModelRequest, ToolReturnPart
from pydantic_ai.models.function import AgentInfo, DeltaToolCall, FunctionModel

from threadline import (
    AgentRuntime,
    AgentRuntimeStore,
    create_agent_runtime,
    create_sqlite_agent_runtime_store,
    define_agent_protocol,
    define_agent_tool,
    define_model_registry,
)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from workload import ANSWER, QUERY, TOOL_NAME, TOOL_RESULT, additions_s, machine_line, question

SEED_BATCH = 200  # messages per seed_conversation_input call
WARMUP_TURNS = 2  # untimed real turns right before every window
# The store's write operations: each one is a single BEGIN IMMEDIATE … COMMIT transaction. Everything else
# in store.metrics is a read (BEGIN … COMMIT of a read transaction, no write).
WRITE_OPS = frozenset(
    {
        "accept_input_and_assign_run",
        "acquire_run",
        "checkpoint_run_assistant",
        "record_run_operation",
        "renew_run_lease",
        "request_run_interrupt",
        "commit_run_terminal",
        "recover_run",
        "replace_compacted_range",
        "seed_conversation_input",
        "purge_conversation",
    }
)


class Context(BaseModel):
    user_id: str = "bench"


@define_agent_tool(name=TOOL_NAME)
async def lookup(query: str) -> dict[str, Any]:
    """Look a query up in the knowledge base."""
    return {**TOOL_RESULT, "query": query}


async def scripted(messages: list[Any], info: AgentInfo) -> AsyncIterator[Any]:
    """One tool call per turn, then the answer once the tool result is the last thing in the prompt.

    Call ids are unique per call, as real providers make them (threadline drops a call whose id already
    appeared earlier in the conversation).
    """
    last = messages[-1]
    if isinstance(last, ModelRequest) and any(isinstance(p, ToolReturnPart) for p in last.parts):
        yield ANSWER
    else:
        yield {
            0: DeltaToolCall(
                name=TOOL_NAME, json_args=json.dumps({"query": QUERY}), tool_call_id=f"call_{uuid.uuid4().hex}"
            )
        }


def text(t: str) -> list[dict[str, str]]:
    return [{"type": "text", "text": t}]


def seeded_turn(cid: str, k: int) -> list[dict[str, Any]]:
    """A settled turn with the same shape as one the runtime writes."""
    call_id = f"seed_{cid}_{k}"
    return [
        {"id": f"{cid}-su{k}", "role": "user", "parts": text(question(k))},
        {
            "id": f"{cid}-sa{k}",
            "role": "assistant",
            "parts": [
                {"type": "tool-call", "call_id": call_id, "tool_name": TOOL_NAME, "input": {"query": QUERY}},
                {"type": "tool-result", "call_id": call_id, "tool_name": TOOL_NAME, "outcome": "success",
                 "output": {**TOOL_RESULT, "query": QUERY}},
                {"type": "text", "text": ANSWER},
            ],
        },
    ]  # fmt: skip


def db_bytes(path: Path) -> int:
    return sum(os.path.getsize(p) for p in (path, Path(f"{path}-wal")) if p.exists())


def ledger_bytes(path: Path) -> int:
    """The bytes the event ledger occupies in the file (its table and indexes, from ``dbstat``), or the
    stored size of its bodies when this SQLite has no ``dbstat``; 0 before the ledger existed."""
    conn = sqlite3.connect(path)
    try:
        names = [n for (n,) in conn.execute("SELECT name FROM sqlite_master WHERE name GLOB 'threadline_events*'")]
        if not names:
            return 0
        try:
            marks = ", ".join("?" * len(names))
            return int(conn.execute(f"SELECT sum(pgsize) FROM dbstat WHERE name IN ({marks})", names).fetchone()[0])
        except sqlite3.OperationalError:
            return int(conn.execute("SELECT coalesce(sum(length(body)), 0) FROM threadline_events").fetchone()[0])
    finally:
        conn.close()


def checkpoint(path: Path) -> None:
    """``wal_checkpoint(TRUNCATE)`` from a second connection (the store's connection is idle between turns)."""
    conn = sqlite3.connect(path, timeout=5)
    try:
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchall()
    finally:
        conn.close()


MODEL_KIND = "function"
COMPACTION = False
COMPACT_ABOVE_TOKENS = 3000


def make_runtime(store: AgentRuntimeStore, publish: Callable[[Any], Any] | None = None) -> AgentRuntime:
    if MODEL_KIND == "minimal":
        from minimal_model import MinimalScriptedModel

        model: Any = MinimalScriptedModel()
    else:
        model = FunctionModel(stream_function=scripted, model_name="scripted")
    registry = define_model_registry(models={"m": {"model": model, "context_window": 10**8}})
    history = None
    if COMPACTION:
        from threadline.history.compaction import AgentCompactionHook

        async def summarize(messages: Any, previous: Any) -> str:
            return f"summary of {len(messages)} earlier messages"

        # the application's threshold: compact once more than 60 messages are settled in the prompt
        history = {
            "compaction": AgentCompactionHook(
                should_compact=lambda usage: (usage.input_tokens or 0) > COMPACT_ABOVE_TOKENS,
                summarize=summarize,
                keep_recent_turns=10,
            )
        }
    return create_agent_runtime(
        protocol=define_agent_protocol(context=Context),
        store=store,
        models={"resolve": lambda: registry.resolve("m")},
        tools=[lookup],
        publish=publish,
        history=history,
    )


@dataclass
class JsonPublisher:
    events: int = 0
    ns: int = 0
    bytes: int = 0

    def __call__(self, event: Any) -> None:
        start = time.perf_counter_ns()
        self.bytes += len(event.model_dump_json())
        self.ns += time.perf_counter_ns() - start
        self.events += 1


@dataclass
class Conversation:
    runtime: AgentRuntime
    cid: str
    messages: int = 0
    turns_done: int = 0
    publisher: JsonPublisher | None = None
    times_ns: list[int] = field(default_factory=list)

    async def turn(self) -> int:
        k = self.turns_done
        start = time.perf_counter_ns()
        ticket = self.runtime.submit(
            conversation_id=self.cid, idempotency_key=f"k{k}", context={"user_id": "bench"}, parts=text(question(k))
        )
        result = await ticket.result
        elapsed = time.perf_counter_ns() - start
        if result.terminal_reason != "success" or result.assistant is None:
            raise RuntimeError(f"turn {k} ended {result.terminal_reason!r}")
        kinds = [p.type for p in result.assistant.parts]
        if kinds != ["tool-call", "tool-result", "text"]:
            raise RuntimeError(f"turn {k}: unexpected assistant parts {kinds}")
        self.turns_done += 1
        self.messages += 2
        return elapsed

    async def seed(self, n: int) -> None:
        """Add ``n`` (even) settled messages shaped like real turns."""
        assert n % 2 == 0
        while n > 0:
            count = min(SEED_BATCH, n)
            inputs: list[dict[str, Any]] = []
            for _ in range(count // 2):
                inputs.extend(seeded_turn(self.cid, self.messages // 2 + len(inputs) // 2))
            await self.runtime.store.seed_conversation_input(
                conversation_id=self.cid, seed_key=f"seed-{self.messages}", inputs=inputs, placement="after-settled"
            )
            self.messages += count
            n -= count

    async def grow_to(self, target: int, grow: str) -> None:
        """Reach ``target`` messages, ending with ``WARMUP_TURNS`` untimed real turns where possible."""
        gap = target - self.messages
        if gap <= 0:
            return
        real_msgs = gap if grow == "real" else min(gap, 2 * WARMUP_TURNS)
        seed_msgs = gap - real_msgs
        seed_msgs -= seed_msgs % 2
        await self.seed(seed_msgs)
        while self.messages < target:
            await self.turn()


class OpTimer:
    """``--verbose`` only: wall time of every store call as the event loop sees it (thread hop, queueing,
    transaction) and the worker thread's time inside the transaction. Wraps two private hooks of the
    SQLite store on this instance; the cost is one extra frame per call."""

    def __init__(self, store: AgentRuntimeStore) -> None:
        self.roundtrip_ns: dict[str, int] = {}
        self.in_tx_ns = {"read": 0, "write": 0}
        run, transaction = store._run, store.driver._transaction  # type: ignore[attr-defined]

        async def timed_run(name: str, operation: Any, access: Any) -> Any:
            start = time.perf_counter_ns()
            try:
                return await run(name, operation, access)
            finally:
                self.roundtrip_ns[name] = self.roundtrip_ns.get(name, 0) + time.perf_counter_ns() - start

        def timed_transaction(operation: Any, access: str, stats: Any) -> Any:
            start = time.perf_counter_ns()
            try:
                return transaction(operation, access, stats)
            finally:
                self.in_tx_ns[access] += time.perf_counter_ns() - start

        store._run = timed_run  # type: ignore[method-assign]
        store.driver._transaction = timed_transaction  # type: ignore[attr-defined]
        self.driver = store.driver

    def snapshot(self) -> tuple[dict[str, int], dict[str, int]]:
        counts = {"transactions": self.driver.transactions, "inline": self.driver.inline_operations}
        return dict(self.roundtrip_ns), {**self.in_tx_ns, **counts}


def snapshot_metrics(store: AgentRuntimeStore) -> dict[str, tuple[int, int, int]]:
    return {name: (s.calls, s.rows_read, s.rows_written) for name, s in store.metrics.items()}


def metrics_delta(
    before: dict[str, tuple[int, int, int]], after: dict[str, tuple[int, int, int]]
) -> dict[str, tuple[int, int, int]]:
    out = {}
    for name, (c, r, w) in after.items():
        c0, r0, w0 = before.get(name, (0, 0, 0))
        if c - c0:
            out[name] = (c - c0, r - r0, w - w0)
    return out


def print_profile(title: str, profile: cProfile.Profile, limit: int, sort: str) -> None:
    limit = int(os.environ.get("THREADLINE_BENCH_PROFILE_LINES", limit))
    buffer = io.StringIO()
    stats = pstats.Stats(profile, stream=buffer)
    stats.strip_dirs().sort_stats(sort).print_stats(limit)
    print(f"--- profile: {title}, top {limit} by {sort} ---")
    lines = buffer.getvalue().splitlines()
    start = next((i for i, line in enumerate(lines) if "function calls" in line), 0)
    print("\n".join(line for line in lines[start:] if line.strip()))


async def driver_call(store: AgentRuntimeStore, fn: Callable[[], Any]) -> bool:
    """Run ``fn`` on the SQLite store's worker thread (bench-only use of a private hook: it lets cProfile
    be enabled and disabled on that thread). False when the driver has no such hook."""
    call = getattr(store.driver, "_call", None) or getattr(store.driver, "_submit", None)
    if call is None:
        return False
    await call(fn)
    return True


async def window(
    convs: list[Conversation],
    size: int,
    turns: int,
    grow: str,
    store: AgentRuntimeStore,
    path: Path,
    *,
    verbose: bool,
    profile: bool,
    timer: OpTimer | None,
) -> None:
    for conv in convs:
        await conv.grow_to(size - turns, grow)
    for conv in convs:
        conv.times_ns = []
    publishers = [c.publisher for c in convs if c.publisher is not None]
    events0 = [(p.events, p.ns, p.bytes) for p in publishers]
    speed = f"additions_s={additions_s():.2f}"  # the machine's speed right before the timed turns
    before = snapshot_metrics(store)
    timed_before = timer.snapshot() if timer is not None else None
    for _ in range(turns):
        for conv in convs:  # alternate so machine noise hits every variant alike
            conv.times_ns.append(await conv.turn())
    delta = metrics_delta(before, snapshot_metrics(store))
    checkpoint(path)
    size_now = db_bytes(path)
    base = convs[0]
    median_ms = statistics.median(base.times_ns) / 1e6
    print(
        f"system=threadline store=sqlite messages={size} per_turn_ms={median_ms:.2f} db_bytes={size_now} "
        f"turns={size // 2} history={grow} window_turns={turns} model={MODEL_KIND} compaction={COMPACTION} "
        f"p90_ms={statistics.quantiles(base.times_ns, n=10)[-1] / 1e6:.2f} {speed}",
        flush=True,
    )
    n_turns = turns * len(convs)
    ops = sum(c for c, _, _ in delta.values()) / n_turns
    commits = sum(c for name, (c, _, _) in delta.items() if name in WRITE_OPS) / n_turns
    rows_read = sum(r for _, r, _ in delta.values()) / n_turns
    rows_written = sum(w for _, _, w in delta.values()) / n_turns
    print(
        f"system=threadline store=sqlite messages={size} turn_store_ops={ops:g} turn_commits={commits:g} "
        f"turn_rows_read={rows_read:g} turn_rows_written={rows_written:g} {speed}",
        flush=True,
    )
    if verbose and timer is not None and timed_before is not None:
        roundtrip, in_tx = timer.snapshot()
        for name, (c, r, w) in sorted(delta.items()):
            access = "write" if name in WRITE_OPS else "read"
            us = (roundtrip.get(name, 0) - timed_before[0].get(name, 0)) / c / 1e3
            print(
                f"  op={name} access={access} calls_per_turn={c / n_turns:g} rows_read_per_turn={r / n_turns:g} "
                f"rows_written_per_turn={w / n_turns:g} roundtrip_us_per_call={us:.0f}"
            )
        store_ms = sum(roundtrip.get(n, 0) - timed_before[0].get(n, 0) for n in delta) / n_turns / 1e6
        tx_ms = {a: (in_tx[a] - timed_before[1][a]) / n_turns / 1e6 for a in in_tx}
        counts = {k: (in_tx[k] - timed_before[1][k]) / n_turns for k in ("transactions", "inline")}
        print(
            f"  store_roundtrip_ms_per_turn={store_ms:.2f} in_read_ops_ms_per_turn={tx_ms['read']:.2f} "
            f"in_write_ops_ms_per_turn={tx_ms['write']:.2f} transactions_per_turn={counts['transactions']:g} "
            f"inline_ops_per_turn={counts['inline']:g} (the rest of a turn is event-loop work)"
        )
    for pub, (e0, ns0, b0), conv in zip(
        publishers, events0, [c for c in convs if c.publisher is not None], strict=True
    ):
        events = pub.events - e0
        per_turn_events = events / turns
        # turns alternate, so pair them: the median of paired differences is steadier than a difference of medians
        diff_us = statistics.median(p - b for p, b in zip(conv.times_ns, base.times_ns, strict=True)) / 1e3
        print(
            f"system=threadline store=sqlite messages={size} publish=json events_per_turn={per_turn_events:g} "
            f"per_turn_ms={statistics.median(conv.times_ns) / 1e6:.2f} baseline_per_turn_ms={median_ms:.2f} "
            f"publish_us_per_event={diff_us / per_turn_events:.1f} "
            f"in_callback_us_per_event={(pub.ns - ns0) / 1e3 / events:.1f} "
            f"json_bytes_per_event={(pub.bytes - b0) / events:.0f} {speed}",
            flush=True,
        )
    if profile:
        # a separate, untimed window: the profiler slows every call, so the medians above are clean
        loop_prof, worker_prof = cProfile.Profile(), cProfile.Profile()
        on_worker = await driver_call(store, worker_prof.enable)
        loop_prof.enable()
        for _ in range(turns):
            for conv in convs:
                await conv.turn()
        loop_prof.disable()
        if on_worker:
            await driver_call(store, worker_prof.disable)
        n_turns = turns * len(convs)
        where = f"window at {size} messages ({n_turns} turns)"
        print_profile(f"event-loop thread, {where}", loop_prof, 25, "cumulative")
        print_profile(f"event-loop thread, {where}", loop_prof, 15, "tottime")
        if on_worker:
            print_profile(f"SQLite worker thread, {where}", worker_prof, 25, "cumulative")
            print_profile(f"SQLite worker thread, {where}", worker_prof, 15, "tottime")
        else:
            print("--- profile: the store driver has no worker-thread hook; event-loop thread only ---")


async def growth_run(args: argparse.Namespace, tmp: Path) -> None:
    path = tmp / "turns.db"
    async with create_sqlite_agent_runtime_store(filename=path) as sqlite:
        store = sqlite.store
        timer = OpTimer(store) if args.verbose else None
        convs = [Conversation(make_runtime(store), "conv-plain")]
        if args.publish == "json":
            publisher = JsonPublisher()
            convs.append(Conversation(make_runtime(store, publisher), "conv-publish", publisher=publisher))
        sizes = sorted(args.sizes)
        for size in sizes:
            await window(
                convs,
                size,
                args.window,
                args.grow,
                store,
                path,
                verbose=args.verbose,
                profile=args.profile and size == (args.profile_size or sizes[-1]),
                timer=timer,
            )
        for conv in convs:
            await conv.runtime.close()


async def size_run(turns: int, tmp: Path) -> None:
    path = tmp / "turns-500.db"
    sqlite = create_sqlite_agent_runtime_store(filename=path)
    conv = Conversation(make_runtime(sqlite.store), "conv-500")
    speed = additions_s()
    times = [await conv.turn() for _ in range(turns)]
    await conv.runtime.close()
    await sqlite.close()
    checkpoint(path)
    tail = times[-20:]
    print(
        f"system=threadline store=sqlite messages={conv.messages} per_turn_ms={statistics.median(tail) / 1e6:.2f} "
        f"db_bytes={db_bytes(path)} ledger_bytes={ledger_bytes(path)} turns={turns} history=real "
        f"model={MODEL_KIND} total_s={sum(times) / 1e9:.1f} "
        f"first20_ms={statistics.median(times[:20]) / 1e6:.2f} additions_s={speed:.2f} "
        "(per_turn_ms: median of the last 20 turns)",
        flush=True,
    )


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[40, 400, 2000], help="history sizes in messages")
    parser.add_argument("--window", type=int, default=20, help="timed turns per size (centred on it)")
    parser.add_argument("--grow", choices=("seed", "real"), default="seed", help="how history is filled")
    parser.add_argument("--turns-500", action=argparse.BooleanOptionalAction, default=True,
                        help="also run 500 real turns in a fresh database and print its size")  # fmt: skip
    parser.add_argument("--size-turns", type=int, default=500, help=argparse.SUPPRESS)
    parser.add_argument("--profile", action="store_true", help="cProfile the largest window")
    parser.add_argument("--profile-size", type=int, default=None,
                        help="the size whose window --profile profiles (default: the largest)")  # fmt: skip
    parser.add_argument("--publish", choices=("json",), default=None, help="compare with a JSON publisher")
    parser.add_argument("--verbose", action="store_true", help="per-operation store breakdown")
    parser.add_argument(
        "--compaction",
        action="store_true",
        help="runtime-managed compaction (a hook that summarizes when the last prompt passed a threshold)",
    )
    parser.add_argument(
        "--model",
        choices=("function", "minimal"),
        default="minimal",
        help="pydantic-ai FunctionModel, or a scripted Model whose cost per request ignores the history",
    )
    args = parser.parse_args()
    global MODEL_KIND, COMPACTION
    MODEL_KIND = args.model
    COMPACTION = args.compaction
    if any(s < 2 * args.window for s in args.sizes) or any(s % 2 for s in args.sizes):
        parser.error(f"sizes are even and at least 2 × --window ({2 * args.window})")
    import threadline

    print(machine_line(), flush=True)
    print(f"# threadline=={threadline.__version__} from {Path(threadline.__file__).parent}", flush=True)
    with tempfile.TemporaryDirectory(prefix="threadline-turns-") as tmp:
        await growth_run(args, Path(tmp))
        if args.turns_500:
            await size_run(args.size_turns, Path(tmp))
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
