"""Cross-process delta latency: a worker process executes runs and publishes through the store's live
relay; this process (the web side: admits only, ``runs={"execute": False}``) subscribes and receives the
worker's ``assistant-delta`` events in its event hub.

    .venv/bin/python bench/live.py [--backends sqlite postgres] [--runs 20] [--deltas 50] [--pause 0.002]
                                   [--dsn postgresql://postgres@127.0.0.1:5432/test]

Each run streams ``--deltas`` deltas ``--pause`` seconds apart (a model emitting tokens; 0 sends them in
one burst). The latency of a delta is the wall-clock time from its creation in the worker
(``event.emitted_at``, taken when the runtime publishes it) to the moment the web hub hands it to its
listener (both processes read the same clock). Lines:

    system=threadline live=<backend> deltas=<n> p50_ms=<t> p99_ms=<t> max_ms=<t> lost=<k> heals=<h> additions_s=<s>

``lost`` counts deltas that never reached the hub (0 unless a gap was healed from the store, ``heals``).
The SQLite relay polls every ``DEFAULT_POLL_INTERVAL`` (20 ms): expect a p50 near half of it. PostgreSQL
delivers through LISTEN/NOTIFY. ``additions_s``: ten million Python integer additions timed right before
the timed section (``workload.additions_s``), the machine's speed that minute.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from pydantic_ai.models.function import FunctionModel
from workload import additions_s, machine_line

from threadline import create_agent_runtime, define_agent_protocol, define_model_registry
from threadline.harness import AgentEventHub
from threadline.live import create_agent_live_relay

WAIT = 60.0


def open_store(backend: str, where: list[str]) -> Any:
    if backend == "sqlite":
        from threadline.store.sqlite import create_sqlite_agent_runtime_store

        return create_sqlite_agent_runtime_store(where[0])
    from threadline.store.postgres import create_postgres_agent_runtime_store

    return create_postgres_agent_runtime_store(where[0], schema=where[1])


async def worker(backend: str, where: list[str], deltas: int, pause: float) -> None:
    """The worker process: serve until SIGTERM, publishing through the relay."""

    async def stream(messages: list[Any], info: Any) -> AsyncIterator[str]:
        for i in range(deltas):
            yield f"w{i} "
            if pause:
                await asyncio.sleep(pause)

    handle = open_store(backend, where)
    if backend == "postgres":
        await handle.open()
    registry = define_model_registry(models={"m": {"model": FunctionModel(stream_function=stream)}})
    async with create_agent_live_relay(handle) as relay:
        runtime = create_agent_runtime(
            protocol=define_agent_protocol(),
            store=handle.store,
            models={"resolve": lambda: registry.resolve("m")},
            publish=relay.publish,
        )
        stop = asyncio.Event()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
        serving = asyncio.ensure_future(runtime.serve(resolve_context=lambda run: None, poll_interval=0.05))
        print("READY", flush=True)
        await stop.wait()
        await runtime.close(grace_period=1, force_timeout=2)
        serving.cancel()
    await handle.close()


async def web(backend: str, where: list[str], runs: int, deltas: int, pause: float, seam: str = "hub") -> str:
    handle = open_store(backend, where)
    if backend == "postgres":
        await handle.open()
    argv = [sys.executable, __file__, "--worker", backend, *where, "--deltas", str(deltas), "--pause", str(pause)]
    child = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None
        line = await asyncio.wait_for(asyncio.to_thread(child.stdout.readline), WAIT)
        assert line.strip() == "READY", line
        latencies: list[float] = []
        terminals: set[str] = set()
        arrived = asyncio.Event()

        def on_event(event: Any) -> None:
            if event.type == "assistant-delta":
                latencies.append(time.time() - event.emitted_at.timestamp())
            elif event.type == "terminal":
                terminals.add(event.run_id)
                arrived.set()

        hub = AgentEventHub()
        hub.subscribe(on_event)
        registry = define_model_registry(models={"m": {"model": FunctionModel(stream_function=_unused)}})
        async with create_agent_live_relay(handle) as relay:
            admit = create_agent_runtime(
                protocol=define_agent_protocol(),
                store=handle.store,
                models={"resolve": lambda: registry.resolve("m")},
                runs={"execute": False, "watch_interval": 0.05},
            )
            settles: list[float] = []
            if seam == "ticket":
                subscription = await relay.subscribe(admit)  # through the runtime: tickets' followers

                async def turn(key: str) -> None:
                    await _ticket_turn(admit, key, latencies, settles)
            else:
                subscription = await relay.subscribe(hub)

                async def turn(key: str) -> None:
                    await _turn(admit, key, terminals, arrived)

            # one untimed run first: connections, prepared statements, first imports
            await turn("warm")
            latencies.clear()
            settles.clear()
            speed = additions_s()
            for k in range(runs):
                await turn(f"r{k}")
            await admit.close()
            status = subscription.status()
        lost = runs * deltas - len(latencies)
        ms = sorted(x * 1000 for x in latencies)
        p99 = ms[min(len(ms) - 1, int(len(ms) * 0.99))]
        settled = f" settle_p50_ms={statistics.median(settles) * 1000:.2f}" if settles else ""
        return (
            f"system=threadline live={backend} seam={seam} deltas={len(ms)} p50_ms={statistics.median(ms):.2f} "
            f"p99_ms={p99:.2f} max_ms={ms[-1]:.2f} lost={lost} heals={status.heals}{settled} additions_s={speed:.2f}"
        )
    finally:
        child.send_signal(signal.SIGTERM)
        try:
            child.wait(WAIT)
        except subprocess.TimeoutExpired:
            child.kill()
        await handle.close()


async def _unused(messages: list[Any], info: Any) -> AsyncIterator[str]:
    yield "this process only admits"


async def _turn(admit: Any, key: str, terminals: set[str], arrived: asyncio.Event) -> None:
    ticket = admit.submit(conversation_id=key, idempotency_key=key, context=None, parts=[{"type": "text", "text": key}])
    run_id = (await asyncio.wait_for(ticket.admission, WAIT)).run_id
    async with asyncio.timeout(WAIT):
        while run_id not in terminals:
            arrived.clear()
            await arrived.wait()


async def _ticket_turn(admit: Any, key: str, latencies: list[float], settles: list[float]) -> None:
    """One run followed through ``ticket.events()`` in this (admitting) process: the deltas' latency, and
    how long after the worker's terminal the ticket's result settled."""
    ticket = admit.submit(conversation_id=key, idempotency_key=key, context=None, parts=[{"type": "text", "text": key}])
    terminal_at = None
    async with asyncio.timeout(WAIT):
        async for event in ticket.events():
            if event.type == "assistant-delta":
                latencies.append(time.time() - event.emitted_at.timestamp())
            elif event.type == "terminal":
                terminal_at = event.emitted_at.timestamp()
        await ticket.result
    if terminal_at is not None:
        settles.append(time.time() - terminal_at)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backends", nargs="+", default=["sqlite", "postgres"])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--deltas", type=int, default=50)
    parser.add_argument("--pause", type=float, default=0.002)
    parser.add_argument(
        "--dsn", default=os.environ.get("THREADLINE_TEST_POSTGRES_DSN", "postgresql://postgres@127.0.0.1:5432/test")
    )
    parser.add_argument(
        "--seam", choices=["hub", "ticket"], default="hub", help="the web process reads its hub or ticket.events()"
    )
    parser.add_argument("--worker", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        asyncio.run(worker(args.worker[0], args.worker[1:], args.deltas, args.pause))
        return
    print(machine_line())
    print(f"# runs={args.runs} deltas_per_run={args.deltas} pause_s={args.pause}")
    for backend in args.backends:
        if backend == "sqlite":
            with tempfile.TemporaryDirectory() as tmp:
                where = [str(Path(tmp) / "live.db")]
                print(asyncio.run(web("sqlite", where, args.runs, args.deltas, args.pause, args.seam)))
        else:
            schema = f"threadline_bench_{uuid.uuid4().hex[:12]}"
            try:
                print(asyncio.run(web("postgres", [args.dsn, schema], args.runs, args.deltas, args.pause, args.seam)))
            finally:
                import psycopg

                with psycopg.connect(args.dsn, autocommit=True) as conn:
                    conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
        sys.stdout.flush()


if __name__ == "__main__":
    main()
