"""``threadline worker``: execute whatever is queued in a store, for applications that admit input from
web processes (``runs={"execute": False}``) and execute elsewhere.

The worker serves until SIGTERM or SIGINT, then closes with its grace and force budgets: runs in flight
get ``--grace`` seconds to finish, are then aborted (``shutdown``) and waited for at most ``--force``
seconds; queued runs stay durably queued for the next worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import signal
import sys
from pathlib import Path

import typer

from ..runtime import takeover_expired_leases
from .common import build_runtime, check_model, choose_model, lookup_tool, open_store

GC_YOUNGEST_THRESHOLD = 50_000
"""Allocations between two collections of the youngest generation once tuned (Python's default: 700)."""


def tune_gc() -> int:
    """What ``docs/operations.md`` (Throughput) recommends for a busy process, applied once start-up is
    done: collect, freeze what exists (modules, schemas, the runtime: never scanned again) and collect the
    youngest generation less often. Returns the number of objects frozen."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(GC_YOUNGEST_THRESHOLD, 20, 100)
    return gc.get_freeze_count()


async def run_worker(
    *,
    db: Path | None,
    dsn: str | None,
    schema: str | None,
    model: str | None,
    base_url: str | None,
    lease: float,
    poll: float,
    grace: float,
    force: float,
    replay_safe: bool,
    gc_tuning: bool = True,
    live: bool = False,
) -> int:
    choice = choose_model(model, base_url)
    check_model(choice, model or "scripted")
    async with open_store(db, dsn, schema=schema) as opened, contextlib.AsyncExitStack() as stack:
        publish = None
        if live:  # other processes (threadline serve --live) see this worker's runs as they stream
            from ..live import create_agent_live_relay

            relay = await stack.enter_async_context(create_agent_live_relay(opened.store))
            publish = relay.publish
        runtime = build_runtime(
            opened.store, choice.model, tools=[lookup_tool()], lease_duration=lease, owner_id=None, publish=publish
        )
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, stop.set)
        policy = takeover_expired_leases(replay_safe=True) if replay_safe else None
        serving = asyncio.ensure_future(
            runtime.serve(resolve_context=lambda run: {"user": "worker"}, policy=policy, poll_interval=poll)
        )
        tuned = f"; gc tuned, {tune_gc()} objects frozen" if gc_tuning else ""
        typer.echo(f"worker {runtime.owner_id} serving {opened.where} (model: {choice.label}{tuned}); SIGTERM to stop")
        sys.stdout.flush()
        stopped = asyncio.ensure_future(stop.wait())
        await asyncio.wait({serving, stopped}, return_when=asyncio.FIRST_COMPLETED)
        closed = await runtime.close(grace_period=grace, force_timeout=force)
        serving.cancel()
        stopped.cancel()
        if closed.settled:
            typer.echo("worker stopped: every run in flight settled")
            return 0
        typer.echo(f"worker stopped with {closed.remaining} run(s) still in flight (force budget spent)")
        return 1
