"""Throughput: many conversations at once, each turn submitted when the previous one's result arrives.

    .venv/bin/python bench/throughput.py [--configs sqlite-1 postgres-1 postgres-4] [--conversations 100]
                                         [--turns 10] [--model function|minimal] [--repeat 1]
                                         [--dsn postgresql://postgres@127.0.0.1:5432/test] [--pool-max 10]
                                         [--verbose] [--profile sqlite-1|postgres-1] [--switch-interval S]
                                         (PROFILE_OUT=FILE with --profile: also dump the loop's stats)
                                         [--no-group-commit] [--no-additions]

DESIGN §5: 100 conversations × 10 turns in one process, at least 10× LangGraph on the same workload
(``bench/langgraph_throughput.py``; anchor: 46.6 turns/s on its async SQLite checkpointer), and PostgreSQL
with one and four processes.

The workload is ``bench/turns.py``'s (``bench/workload.py``): every turn is one user question, one call of
``lookup(query)``, its result and an answer of about 200 characters, from a zero-latency scripted model
(``--model function``: pydantic-ai's ``FunctionModel``; ``--model minimal``: ``bench/minimal_model.py``).
Every conversation is a task that submits its next turn as soon as its previous turn's result arrives; all
conversations start together and run concurrently on one runtime (one store) per process. Before the clock
starts, one untimed warm-up turn runs on a separate conversation in each process (first-call costs).

Configurations (``--configs``), one line each:

- ``sqlite-1``: one process, a SQLite file in a temp dir (WAL, ``synchronous=NORMAL``);
- ``postgres-P``: a fresh schema (dropped afterwards) in the database at ``--dsn``; with ``P`` > 1, ``P``
  child processes (this script with ``--child``) each run their share of the conversations on their own
  runtime and connection pool. Each child imports, opens its store, runs its warm-up turn and reports
  ready; the parent then sends every child the start signal at once, and the wall time runs from that
  signal to the last child's last turn.

    system=threadline store=<sqlite|postgres> processes=<p> conversations=<c> turns_per_s=<x>
        total_turns=<n> seconds=<wall> p50_turn_ms=<m> p90_turn_ms=<m> max_turn_ms=<m>
        store_ops_per_turn=<o> commits_per_turn=<c> client_cpu_s=<s> [server_cpu_s=<s>]
        [roundtrips_per_turn=<r>] machine_busy=<f> model=<m> gc=<g> [pool_max=<n> group_commit=<on|off>]
        additions_s=<s>

``p50_turn_ms``: the median time from ``submit`` to the result under this load (it includes waiting for
the other conversations). ``commits_per_turn``: write operations per turn (``store.metrics``).
``roundtrips_per_turn`` (PostgreSQL): round trips to the server per turn (``driver.round_trips``: batches
of statements, preparing statements and rollbacks included); with ``commits_per_turn``, the figure that
does not move with the machine's load.
``client_cpu_s``: CPU time of the benchmark process(es) during the timed section (user + system, all
threads); ``server_cpu_s``: CPU of the run's PostgreSQL backends (found in ``pg_stat_activity`` by
``application_name``, which is set to the schema name; read from ``/proc``, so only for a server on this
machine); ``machine_busy``: the fraction of all CPUs busy during it (``/proc/stat``; other work included);
``additions_s``: ten million Python integer additions timed right before the timed section, in the process
that runs it (the parent for ``postgres-P``): ``workload.additions_s``, the machine's speed that minute.
``--no-additions`` leaves it out (``bench/instructions.py``, under valgrind).
A PostgreSQL configuration is skipped with a ``# skipped:`` line when no server answers at ``--dsn``.

``--verbose`` (SQLite) adds the driver's counters over the timed section: transactions, operations and
how many ran on the event loop's thread (the rest on the store's own thread), wall time inside
transactions, and the CPU of the event-loop thread and of the store's thread.
``--switch-interval`` sets ``sys.setswitchinterval`` in every process (a GIL diagnostic).

``--profile sqlite-1`` (or ``postgres-1``) runs the configuration once more, untimed, under cProfile: the
event-loop thread (top 25 by cumulative time, top 15 by own time) and, for SQLite, the store's worker thread
separately (cProfile sees one thread at a time). In the worker's profile ``SimpleQueue.get`` is idle time; in
the loop's, ``epoll.poll`` is waiting (for the worker or the server).
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pydantic_ai.models.function import FunctionModel
from turns import WRITE_OPS, Context, driver_call, lookup, print_profile, scripted, text
from workload import additions_s, machine_line, question, tune_gc

from threadline import (
    AgentRuntime,
    AgentRuntimeStore,
    create_agent_runtime,
    create_sqlite_agent_runtime_store,
    define_agent_protocol,
    define_model_registry,
)

DEFAULT_DSN = os.environ.get("THREADLINE_TEST_POSTGRES_DSN") or "postgresql://postgres@127.0.0.1:5432/test"
CONFIG = re.compile(r"(sqlite|postgres)-([1-9][0-9]*)\Z")
TIMEOUT_S = 300.0  # per configuration: a run that takes longer is a bug, not a measurement


def make_runtime(store: AgentRuntimeStore, model_kind: str) -> AgentRuntime:
    if model_kind == "minimal":
        from minimal_model import MinimalScriptedModel

        model: Any = MinimalScriptedModel()
    else:
        model = FunctionModel(stream_function=scripted, model_name="scripted")
    registry = define_model_registry(models={"m": {"model": model, "context_window": 10**8}})
    return create_agent_runtime(
        protocol=define_agent_protocol(context=Context),
        store=store,
        models={"resolve": lambda: registry.resolve("m")},
        tools=[lookup],
    )


async def conversation(runtime: AgentRuntime, cid: str, turns: int, times_ns: list[int]) -> None:
    for k in range(turns):
        start = time.perf_counter_ns()
        ticket = runtime.submit(
            conversation_id=cid, idempotency_key=f"k{k}", context={"user_id": "bench"}, parts=text(question(k))
        )
        result = await ticket.result
        times_ns.append(time.perf_counter_ns() - start)
        if result.terminal_reason != "success" or result.assistant is None:
            raise RuntimeError(f"{cid} turn {k} ended {result.terminal_reason!r}")
        kinds = [p.type for p in result.assistant.parts]
        if kinds != ["tool-call", "tool-result", "text"]:
            raise RuntimeError(f"{cid} turn {k}: unexpected assistant parts {kinds}")


def cpu_ticks() -> tuple[int, int]:
    """(busy, total) jiffies of all CPUs from /proc/stat; (0, 0) where there is none."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except OSError:
        return 0, 0
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return sum(fields) - idle, sum(fields)


@dataclass
class Batch:
    """What one process measured over its share of the conversations."""

    times_ns: list[int] = field(default_factory=list)
    ops: int = 0
    commits: int = 0
    cpu_s: float = 0.0
    start_ns: int = 0  # time.monotonic_ns() (CLOCK_MONOTONIC: comparable across processes on Linux)
    end_ns: int = 0
    round_trips: int = -1  # PostgreSQL: round trips to the server by store operations (-1: not counted)


def metrics_totals(store: AgentRuntimeStore) -> tuple[int, int]:
    ops = commits = 0
    for name, s in store.metrics.items():
        ops += s.calls
        if name in WRITE_OPS:
            commits += s.calls
    return ops, commits


async def warm_up(runtime: AgentRuntime, tag: str, gc_mode: str = "default") -> None:
    await conversation(runtime, f"warmup-{tag}", 1, [])
    tune_gc(gc_mode)


async def run_batch(runtime: AgentRuntime, store: AgentRuntimeStore, cids: list[str], turns: int) -> Batch:
    batch = Batch()
    per_conv: list[list[int]] = [[] for _ in cids]
    ops0, commits0 = metrics_totals(store)
    trips0 = getattr(store.driver, "round_trips", None)
    cpu0 = time.process_time()
    batch.start_ns = time.monotonic_ns()
    await asyncio.wait_for(
        asyncio.gather(*(conversation(runtime, cid, turns, t) for cid, t in zip(cids, per_conv, strict=True))),
        TIMEOUT_S,
    )
    batch.end_ns = time.monotonic_ns()
    batch.cpu_s = time.process_time() - cpu0
    ops1, commits1 = metrics_totals(store)
    batch.ops, batch.commits = ops1 - ops0, commits1 - commits0
    if trips0 is not None:
        batch.round_trips = store.driver.round_trips - trips0  # type: ignore[attr-defined]
    batch.times_ns = [t for ts in per_conv for t in ts]
    return batch


def report(
    store: str,
    processes: int,
    conversations: int,
    wall_s: float,
    batches: list[Batch],
    busy: float,
    args: Any,
    server_cpu: float | None = None,
    additions: float | None = None,
) -> None:
    times = sorted(t for b in batches for t in b.times_ns)
    n = len(times)
    q = statistics.quantiles(times, n=10) if n >= 2 else times * 9
    print(
        f"system=threadline store={store} processes={processes} conversations={conversations} "
        f"turns_per_s={n / wall_s:.1f} total_turns={n} seconds={wall_s:.2f} "
        f"p50_turn_ms={statistics.median(times) / 1e6:.1f} p90_turn_ms={q[-1] / 1e6:.1f} "
        f"max_turn_ms={times[-1] / 1e6:.1f} store_ops_per_turn={sum(b.ops for b in batches) / n:g} "
        f"commits_per_turn={sum(b.commits for b in batches) / n:g} "
        f"client_cpu_s={sum(b.cpu_s for b in batches):.2f} "
        + (f"server_cpu_s={server_cpu:.2f} " if server_cpu is not None else "")
        + (
            f"roundtrips_per_turn={sum(b.round_trips for b in batches) / n:.1f} "
            if store == "postgres" and all(b.round_trips >= 0 for b in batches)
            else ""
        )
        + f"machine_busy={busy:.2f} model={args.model} gc={args.gc}"
        + (
            f" pool_max={args.pool_max} group_commit={'off' if args.no_group_commit else 'on'}"
            if store == "postgres"
            else ""
        )
        + (f" switch_interval={args.switch_interval:g}" if args.switch_interval is not None else "")
        + (f" additions_s={additions:.2f}" if additions is not None else ""),
        flush=True,
    )


def machine_speed(args: Any) -> float | None:
    """``workload.additions_s()`` right before a timed section (None with ``--no-additions``)."""
    return None if args.no_additions else additions_s()


def conversation_ids(offset: int, count: int) -> list[str]:
    return [f"c{i:04d}" for i in range(offset, offset + count)]


def split(total: int, parts: int) -> list[tuple[int, int]]:
    """(offset, count) of each part; the counts differ by at most one."""
    out, offset = [], 0
    for i in range(parts):
        count = total // parts + (1 if i < total % parts else 0)
        out.append((offset, count))
        offset += count
    return out


# ------------------------------------------------------------------------------------------------ SQLite


class DriverClock:
    """``--verbose``, SQLite: the driver's counters and the CPU time of both threads."""

    def __init__(self, store: AgentRuntimeStore) -> None:
        self.driver = store.driver  # type: ignore[attr-defined]

    async def read(self) -> tuple[int, int, int, int, float, float]:
        """(transactions, operations, inline operations, ns in transactions, store-thread CPU s, loop CPU s)."""
        d = self.driver
        worker_cpu = await d._call(time.thread_time)
        return d.transactions, d.operations, d.inline_operations, d.transaction_ns, worker_cpu, time.thread_time()


async def sqlite_run(args: Any, profile: bool = False) -> None:
    with tempfile.TemporaryDirectory(prefix="threadline-throughput-") as tmp:
        async with create_sqlite_agent_runtime_store(filename=Path(tmp) / "throughput.db") as sqlite:
            store = sqlite.store
            runtime = make_runtime(store, args.model)
            clock = DriverClock(store) if args.verbose and not profile else None
            await warm_up(runtime, "0", args.gc)
            cids = conversation_ids(0, args.conversations)
            if profile:
                await profiled(store, lambda: run_batch(runtime, store, cids, args.turns), "sqlite-1", args)
            else:
                additions = machine_speed(args)
                before = await clock.read() if clock is not None else None
                busy0 = cpu_ticks()
                batch = await run_batch(runtime, store, cids, args.turns)
                busy = busy_fraction(busy0, cpu_ticks())
                wall_s = (batch.end_ns - batch.start_ns) / 1e9
                report("sqlite", 1, args.conversations, wall_s, [batch], busy, args, additions=additions)
                if clock is not None and before is not None:
                    tx, ops, inline, tx_ns, worker_cpu, loop_cpu = (
                        a - b for a, b in zip(await clock.read(), before, strict=True)
                    )
                    print(
                        f"# sqlite-1 driver: wall_s={wall_s:.2f} transactions={tx} operations={ops} "
                        f"inline_operations={inline} in_tx_s={tx_ns / 1e9:.2f} loop_thread_cpu_s={loop_cpu:.2f} "
                        f"store_thread_cpu_s={worker_cpu:.2f}",
                        flush=True,
                    )
            await runtime.close()


def busy_fraction(before: tuple[int, int], after: tuple[int, int]) -> float:
    total = after[1] - before[1]
    return (after[0] - before[0]) / total if total > 0 else float("nan")


async def profiled(store: AgentRuntimeStore, body: Callable[[], Awaitable[Batch]], config: str, args: Any) -> None:
    loop_prof, worker_prof = cProfile.Profile(), cProfile.Profile()
    on_worker = config.startswith("sqlite") and await driver_call(store, worker_prof.enable)
    loop_prof.enable()
    batch = await body()
    if os.environ.get("PROFILE_OUT"):  # the event-loop thread's raw stats, for pstats (callers, callees)
        loop_prof.dump_stats(os.environ["PROFILE_OUT"])
    loop_prof.disable()
    if on_worker:
        await driver_call(store, worker_prof.disable)
    n = len(batch.times_ns)
    where = f"{config}, {args.conversations} conversations x {args.turns} turns ({n} turns) under the profiler"
    print(f"# profiled run: {(batch.end_ns - batch.start_ns) / 1e9:.2f} s under cProfile ({where})")
    print_profile(f"event-loop thread, {where}", loop_prof, 25, "cumulative")
    print_profile(f"event-loop thread, {where}", loop_prof, 15, "tottime")
    if on_worker:
        print_profile(f"SQLite worker thread, {where}", worker_prof, 25, "cumulative")
        print_profile(f"SQLite worker thread, {where}", worker_prof, 15, "tottime")


# ---------------------------------------------------------------------------------------------- PostgreSQL


def postgres_reachable(dsn: str) -> str | None:
    """None when a server answers at ``dsn``, else why not."""
    try:
        import psycopg

        with psycopg.connect(dsn, connect_timeout=3) as conn:
            conn.execute("SELECT 1")
    except Exception as exc:
        return f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
    return None


def drop_schema(dsn: str, schema: str) -> None:
    import psycopg
    from psycopg import sql

    with psycopg.connect(dsn, autocommit=True, connect_timeout=5) as conn:
        conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))


def tagged_dsn(dsn: str, schema: str) -> str:
    """``dsn`` with ``application_name=<schema>``: the run's server backends can be found in
    ``pg_stat_activity`` (and their CPU read from ``/proc`` when the server is local)."""
    from psycopg.conninfo import make_conninfo

    return make_conninfo(dsn, application_name=schema)


def backend_cpu(dsn: str, schema: str) -> dict[int, float] | None:
    """CPU seconds (user + system) of every server backend serving this run, by pid; None when they
    cannot be read (a remote server, or no ``/proc``)."""
    import psycopg

    with psycopg.connect(dsn, autocommit=True, connect_timeout=5) as conn:
        pids = [
            pid for (pid,) in conn.execute("SELECT pid FROM pg_stat_activity WHERE application_name = %s", [schema])
        ]
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rpartition(")")[2].split()
        except OSError:
            return None
        out[pid] = (int(fields[11]) + int(fields[12])) / tick  # utime, stime
    return out or None


def server_cpu_s(before: dict[int, float] | None, after: dict[int, float] | None) -> float | None:
    """CPU the run's backends spent between two readings (backends that appeared in between count whole:
    connecting costs a few ms)."""
    if after is None:
        return None
    return sum(cpu - (before or {}).get(pid, 0.0) for pid, cpu in after.items())


async def postgres_open(args: Any, schema: str) -> Any:
    from threadline.store.postgres import create_postgres_agent_runtime_store

    handle = create_postgres_agent_runtime_store(
        dsn=tagged_dsn(args.dsn, schema), schema=schema, max_size=args.pool_max
    )
    handle.driver.batch_writes = not args.no_group_commit
    return handle


async def postgres_one(args: Any, schema: str, profile: bool = False) -> None:
    async with await postgres_open(args, schema) as pg:
        store = pg.store
        runtime = make_runtime(store, args.model)
        await warm_up(runtime, "0", args.gc)
        cids = conversation_ids(0, args.conversations)
        if profile:
            await profiled(store, lambda: run_batch(runtime, store, cids, args.turns), "postgres-1", args)
        else:
            additions = machine_speed(args)
            server0 = backend_cpu(args.dsn, schema)
            busy0 = cpu_ticks()
            batch = await run_batch(runtime, store, cids, args.turns)
            busy = busy_fraction(busy0, cpu_ticks())
            server = server_cpu_s(server0, backend_cpu(args.dsn, schema))
            wall_s = (batch.end_ns - batch.start_ns) / 1e9
            report("postgres", 1, args.conversations, wall_s, [batch], busy, args, server, additions)
        await runtime.close()


async def child_main(args: Any) -> int:
    """One of ``P`` processes: open, warm up, say ``ready``, wait for ``go`` on stdin, run, report JSON."""
    async with await postgres_open(args, args.schema) as pg:
        store = pg.store
        runtime = make_runtime(store, args.model)
        await warm_up(runtime, str(args.offset), args.gc)
        cids = conversation_ids(args.offset, args.conversations)
        print("ready", flush=True)
        line = await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
        if line.strip() != "go":
            return 1
        batch = await run_batch(runtime, store, cids, args.turns)
        print(json.dumps(batch.__dict__), flush=True)
        # keep the pool's connections until the parent has read the server backends' CPU
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
        await runtime.close()
    return 0


def postgres_many(args: Any, schema: str, processes: int) -> None:
    children: list[subprocess.Popen[str]] = []
    try:
        for offset, count in split(args.conversations, processes):
            cmd = [sys.executable, __file__, "--child", "--dsn", args.dsn, "--schema", schema,
                   "--offset", str(offset), "--conversations", str(count), "--turns", str(args.turns),
                   "--model", args.model, "--gc", args.gc,
                   "--pool-max", str(-(-args.pool_max // processes))]  # fmt: skip
            if args.switch_interval is not None:
                cmd += ["--switch-interval", str(args.switch_interval)]
            if args.no_group_commit:
                cmd.append("--no-group-commit")
            children.append(subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True))
        for child in children:
            assert child.stdout is not None
            line = child.stdout.readline()
            if line.strip() != "ready":
                raise RuntimeError(f"child {child.pid} did not get ready: {line!r}")
        additions = machine_speed(args)  # in the parent, while the children wait for the start signal
        server0 = backend_cpu(args.dsn, schema)
        busy0 = cpu_ticks()
        start_ns = time.monotonic_ns()
        for child in children:
            assert child.stdin is not None
            child.stdin.write("go\n")
            child.stdin.flush()
        batches = []
        for child in children:
            assert child.stdout is not None
            line = child.stdout.readline()
            if not line:
                raise RuntimeError(f"child {child.pid} ended without a result (exit {child.wait()})")
            batches.append(Batch(**json.loads(line)))
        busy = busy_fraction(busy0, cpu_ticks())
        server = server_cpu_s(server0, backend_cpu(args.dsn, schema))
        for child in children:
            assert child.stdin is not None
            child.stdin.write("exit\n")
            child.stdin.flush()
        for child in children:
            if child.wait(timeout=60) != 0:
                raise RuntimeError(f"child {child.pid} exited {child.returncode}")
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
                child.wait()
    end_ns = max(b.end_ns for b in batches)
    lag_ms = max(b.start_ns - start_ns for b in batches) / 1e6
    wall_s = (end_ns - start_ns) / 1e9
    report("postgres", processes, args.conversations, wall_s, batches, busy, args, server, additions)
    print(f"# postgres-{processes}: last child started {lag_ms:.1f} ms after the start signal", flush=True)


async def postgres_prepare(args: Any, schema: str) -> None:
    """Create the schema once so the children do not all migrate at the same moment."""
    async with await postgres_open(args, schema):
        pass


def postgres_config(args: Any, processes: int, profile: bool = False) -> None:
    schema = f"bench_tp_{uuid.uuid4().hex[:12]}"
    try:
        if processes == 1:
            asyncio.run(postgres_one(args, schema, profile))
        else:
            asyncio.run(postgres_prepare(args, schema))
            postgres_many(args, schema, processes)
    finally:
        drop_schema(args.dsn, schema)


# ------------------------------------------------------------------------------------------------------ main


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--configs",
        nargs="*",
        default=["sqlite-1", "postgres-1", "postgres-4"],
        help="sqlite-1 and/or postgres-P (P processes); none with --profile to profile only",
    )
    parser.add_argument("--conversations", type=int, default=100)
    parser.add_argument("--turns", type=int, default=10, help="turns per conversation")
    parser.add_argument("--model", choices=("function", "minimal"), default="minimal", help="as in turns.py")
    parser.add_argument("--repeat", type=int, default=1, help="run every configuration this many times")
    parser.add_argument("--gc", choices=("default", "tuned"), default="default", help="see workload.tune_gc")
    parser.add_argument("--dsn", default=DEFAULT_DSN, help="PostgreSQL (default: the test suite's)")
    parser.add_argument(
        "--pool-max",
        type=int,
        default=10,
        help="PostgreSQL connections in all: each of P processes gets a pool of ceil(pool_max / P)",
    )
    parser.add_argument(
        "--no-group-commit",
        action="store_true",
        help="PostgreSQL: every write in a transaction of its own (driver.batch_writes = False)",
    )
    parser.add_argument("--profile", default=None, help="sqlite-1 or postgres-1: an extra run under cProfile")
    parser.add_argument(
        "--verbose",
        action="store_true",
        help="sqlite-1: the SQLite worker thread's time inside transactions and CPU per thread",
    )
    parser.add_argument(
        "--switch-interval",
        type=float,
        default=None,
        help="diagnostic: sys.setswitchinterval(seconds) in every process (default: Python's 0.005)",
    )
    parser.add_argument(
        "--no-additions",
        action="store_true",
        help="do not time ten million additions before each run (bench/instructions.py: valgrind is slow)",
    )
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--schema", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--offset", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval)
    if args.child:
        return asyncio.run(child_main(args))
    configs = []
    for spec in args.configs:
        m = CONFIG.match(spec)
        if m is None or (m.group(1) == "sqlite" and m.group(2) != "1"):
            parser.error(f"unknown configuration {spec!r}: sqlite-1 or postgres-<P>")
        configs.append((m.group(1), int(m.group(2))))
    if args.profile not in (None, "sqlite-1", "postgres-1"):
        parser.error("--profile is sqlite-1 or postgres-1")
    import threadline

    print(machine_line(), flush=True)
    print(f"# threadline=={threadline.__version__} from {Path(threadline.__file__).parent}", flush=True)
    why_not = postgres_reachable(args.dsn) if any(s == "postgres" for s, _ in configs) else None
    for _ in range(args.repeat):
        for store, processes in configs:
            if store == "sqlite":
                asyncio.run(sqlite_run(args))
            elif why_not is not None:
                print(f"# skipped: system=threadline store=postgres processes={processes}: "
                      f"no PostgreSQL at {args.dsn} ({why_not})", flush=True)  # fmt: skip
            else:
                postgres_config(args, processes)
    if args.profile == "sqlite-1":
        asyncio.run(sqlite_run(args, profile=True))
    elif args.profile == "postgres-1":
        reason = postgres_reachable(args.dsn)
        if reason is None:
            postgres_config(args, 1, profile=True)
        else:
            print(f"# skipped profile: no PostgreSQL at {args.dsn} ({reason})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
