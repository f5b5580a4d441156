"""LangGraph's throughput on the same workload as ``bench/throughput.py``: many conversations at once.

    bench/setup-peers            # once: creates bench/.venv-peers
    bench/.venv-peers/bin/python bench/langgraph_throughput.py [--savers sqlite postgres] [--conversations 100]
                                 [--turns 10] [--repeat 1] [--dsn postgresql://postgres@127.0.0.1:5432/test]
                                 [--pool-max 10] [--no-additions]

``langgraph.prebuilt.create_react_agent`` with the zero-latency scripted chat model and ``lookup`` tool of
``bench/langgraph_turns.py`` (the ``bench/workload.py`` turn: one tool call, its result, a ~200-character
answer). Every conversation is a thread (``thread_id``) driven by a task that awaits ``graph.ainvoke`` for
its next turn as soon as the previous one returns; all conversations start together in one process and
one event loop, on one compiled graph and one checkpointer. One untimed warm-up turn on a separate thread
runs first.

- ``sqlite``: ``AsyncSqliteSaver.from_conn_string`` on a temp file (LangGraph's defaults: one aiosqlite
  connection);
- ``postgres`` (needs ``langgraph-checkpoint-postgres``, installed by ``bench/setup-peers``):
  ``AsyncPostgresSaver`` on a psycopg ``AsyncConnectionPool`` (``--pool-max`` connections, with the
  connection settings LangGraph documents: autocommit, ``prepare_threshold=0``, ``dict_row``) in a fresh
  schema of the database at ``--dsn``, dropped afterwards. (The saver serializes its own operations with an
  ``asyncio.Lock`` whatever the pool size.) Skipped with a ``# skipped:`` line when no server answers or the
  package is missing.

    system=langgraph store=<sqlite|postgres> processes=1 conversations=<c> turns_per_s=<x> total_turns=<n>
        seconds=<wall> p50_turn_ms=<m> p90_turn_ms=<m> max_turn_ms=<m> client_cpu_s=<s> [server_cpu_s=<s>]
        machine_busy=<f> gc=<g> [pool_max=<n>] additions_s=<s>

``client_cpu_s``: CPU of this process during the timed section; ``server_cpu_s`` (PostgreSQL, local server):
CPU of the run's server backends (found by ``application_name``); ``machine_busy``: the fraction of all
CPUs busy (``/proc/stat``), other work on the machine included; ``additions_s``: ten million Python
integer additions timed in this process right before the timed section (``workload.additions_s``: the
machine's speed that minute; ``--no-additions`` leaves it out).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from langchain_core.messages import AIMessage, HumanMessage, ToolMessage

sys.path.insert(0, str(Path(__file__).resolve().parent))
from langgraph_turns import ScriptedChatModel, agent
from workload import ANSWER, additions_s, machine_line, question, tune_gc

DEFAULT_DSN = os.environ.get("THREADLINE_TEST_POSTGRES_DSN") or "postgresql://postgres@127.0.0.1:5432/test"
TIMEOUT_S = 300.0


def cpu_ticks() -> tuple[int, int]:
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except OSError:
        return 0, 0
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return sum(fields) - idle, sum(fields)


async def conversation(graph: Any, thread: str, turns: int, times_ns: list[int]) -> None:
    config = {"configurable": {"thread_id": thread}, "recursion_limit": 10}
    for k in range(turns):
        start = time.perf_counter_ns()
        out = await graph.ainvoke({"messages": [HumanMessage(content=question(k))]}, config)
        times_ns.append(time.perf_counter_ns() - start)
        messages = out["messages"]
        last = messages[-1]
        if not (isinstance(last, AIMessage) and last.content == ANSWER and isinstance(messages[-2], ToolMessage)):
            raise RuntimeError(f"{thread} turn {k}: unexpected ending {[type(m).__name__ for m in messages[-4:]]}")
        if len(messages) != 4 * (k + 1):
            raise RuntimeError(f"{thread} turn {k}: {len(messages)} messages, expected {4 * (k + 1)}")


def backend_cpu(dsn: str, app: str) -> dict[int, float] | None:
    """CPU seconds of the server backends whose ``application_name`` is ``app``, by pid (local server only)."""
    import psycopg

    with psycopg.connect(dsn, autocommit=True, connect_timeout=5) as conn:
        pids = [pid for (pid,) in conn.execute("SELECT pid FROM pg_stat_activity WHERE application_name = %s", [app])]
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rpartition(")")[2].split()
        except OSError:
            return None
        out[pid] = (int(fields[11]) + int(fields[12])) / tick
    return out or None


async def run_batch(graph: Any, turns: int, per_thread: list[list[int]]) -> None:
    """The timed section: every conversation's turns, all at once (``bench/instructions.py`` counts it)."""
    await asyncio.wait_for(
        asyncio.gather(*(conversation(graph, f"t{i:04d}", turns, t) for i, t in enumerate(per_thread))),
        TIMEOUT_S,
    )


async def measure(
    saver: Any, store: str, args: Any, server: Callable[[], dict[int, float] | None] | None = None
) -> None:
    graph = agent(ScriptedChatModel(), saver)
    await conversation(graph, "warmup", 1, [])
    tune_gc(args.gc)
    per_thread: list[list[int]] = [[] for _ in range(args.conversations)]
    additions = None if args.no_additions else additions_s()
    server0 = server() if server is not None else None
    busy0, cpu0 = cpu_ticks(), time.process_time()
    start = time.perf_counter_ns()
    await run_batch(graph, args.turns, per_thread)
    wall_s = (time.perf_counter_ns() - start) / 1e9
    cpu_s = time.process_time() - cpu0
    busy1 = cpu_ticks()
    server1 = server() if server is not None else None
    server_cpu = None
    if server1 is not None:
        server_cpu = sum(cpu - (server0 or {}).get(pid, 0.0) for pid, cpu in server1.items())
    busy = (busy1[0] - busy0[0]) / (busy1[1] - busy0[1]) if busy1[1] > busy0[1] else float("nan")
    times = sorted(t for ts in per_thread for t in ts)
    n = len(times)
    q = statistics.quantiles(times, n=10) if n >= 2 else times * 9
    print(
        f"system=langgraph store={store} processes=1 conversations={args.conversations} "
        f"turns_per_s={n / wall_s:.1f} total_turns={n} seconds={wall_s:.2f} "
        f"p50_turn_ms={statistics.median(times) / 1e6:.1f} p90_turn_ms={q[-1] / 1e6:.1f} "
        f"max_turn_ms={times[-1] / 1e6:.1f} client_cpu_s={cpu_s:.2f} "
        + (f"server_cpu_s={server_cpu:.2f} " if server_cpu is not None else "")
        + f"machine_busy={busy:.2f} gc={args.gc}"
        + (f" pool_max={args.pool_max}" if store == "postgres" else "")
        + (f" additions_s={additions:.2f}" if additions is not None else ""),
        flush=True,
    )


async def sqlite_run(args: Any) -> None:
    from langgraph.checkpoint.sqlite.aio import AsyncSqliteSaver

    with tempfile.TemporaryDirectory(prefix="langgraph-throughput-") as tmp:
        async with AsyncSqliteSaver.from_conn_string(str(Path(tmp) / "langgraph.db")) as saver:
            await saver.setup()
            await measure(saver, "sqlite", args)


@asynccontextmanager
async def postgres_saver(dsn: str, schema: str, pool_max: int) -> AsyncIterator[Any]:
    from langgraph.checkpoint.postgres.aio import AsyncPostgresSaver
    from psycopg.rows import dict_row
    from psycopg_pool import AsyncConnectionPool

    kwargs = {
        "autocommit": True,
        "prepare_threshold": 0,
        "row_factory": dict_row,
        "options": f"-c search_path={schema}",
        "application_name": schema,  # to find the run's backends (server_cpu_s)
    }
    async with AsyncConnectionPool(dsn, min_size=1, max_size=pool_max, kwargs=kwargs, open=False) as pool:
        yield AsyncPostgresSaver(pool)  # type: ignore[arg-type]


def postgres_problem(dsn: str) -> str | None:
    try:
        version("langgraph-checkpoint-postgres")
    except PackageNotFoundError:
        return "langgraph-checkpoint-postgres is not installed in this venv (bench/setup-peers)"
    try:
        import psycopg

        with psycopg.connect(dsn, connect_timeout=3) as conn:
            conn.execute("SELECT 1")
    except Exception as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        return f"no PostgreSQL at {dsn} ({type(exc).__name__}: {first})"
    return None


def with_schema(dsn: str, body: Callable[[str], Any]) -> None:
    import psycopg
    from psycopg import sql

    schema = f"bench_lg_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(schema)))
    try:
        body(schema)
    finally:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))


async def postgres_run(args: Any, schema: str) -> None:
    async with postgres_saver(args.dsn, schema, args.pool_max) as saver:
        await saver.setup()
        await measure(saver, "postgres", args, lambda: backend_cpu(args.dsn, schema))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--savers", nargs="+", choices=("sqlite", "postgres"), default=["sqlite", "postgres"])
    parser.add_argument("--conversations", type=int, default=100)
    parser.add_argument("--turns", type=int, default=10, help="turns per conversation")
    parser.add_argument("--repeat", type=int, default=1, help="run every saver this many times")
    parser.add_argument("--gc", choices=("default", "tuned"), default="default", help="see workload.tune_gc")
    parser.add_argument("--dsn", default=DEFAULT_DSN)
    parser.add_argument("--pool-max", type=int, default=10, help="PostgreSQL pool max_size")
    parser.add_argument(
        "--no-additions",
        action="store_true",
        help="do not time ten million additions before each run (bench/instructions.py: valgrind is slow)",
    )
    args = parser.parse_args()
    print(machine_line(), flush=True)
    names = ("langgraph", "langgraph-prebuilt", "langgraph-checkpoint", "langgraph-checkpoint-sqlite",
             "langgraph-checkpoint-postgres", "langchain-core")  # fmt: skip

    def ver(name: str) -> str:
        try:
            return version(name)
        except PackageNotFoundError:
            return "missing"

    print("# versions: " + " ".join(f"{n}=={ver(n)}" for n in names), flush=True)
    problem = postgres_problem(args.dsn) if "postgres" in args.savers else None
    for _ in range(args.repeat):
        for saver in args.savers:
            if saver == "sqlite":
                asyncio.run(sqlite_run(args))
            elif problem is not None:
                print(f"# skipped: system=langgraph store=postgres processes=1: {problem}", flush=True)
            else:
                with_schema(args.dsn, lambda schema: asyncio.run(postgres_run(args, schema)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
