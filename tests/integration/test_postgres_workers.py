"""Four worker processes on one PostgreSQL database, 50 conversations, random policies and random durable
interrupts, admitted by a separate admission-only runtime. Checked from the database afterwards: every
admitted input is answered exactly once or ended as its policy says; no conversation ever had two runs
executing at once; urgent inputs ran before ordinary ones queued beside them, and each class in FIFO.
With one connection per process, writes wait for connections and the drivers commit them in batches
(group commit); with ten they mostly go one by one."""

from __future__ import annotations

import asyncio
import itertools
import random
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from pydantic_ai.models.function import FunctionModel

from threadline import create_agent_runtime, define_agent_protocol, define_model_registry
from threadline.store.postgres import create_postgres_agent_runtime_store

WORKER = Path(__file__).with_name("_pg_worker.py")
pytestmark = [pytest.mark.postgres, pytest.mark.subprocess]


async def unused(messages: list[Any], info: Any) -> AsyncIterator[Any]:
    yield "never called: this runtime only admits"


@pytest.mark.parametrize("pool_size", [10, 1])
async def test_four_workers_fifty_conversations(postgres_dsn: str, schema: str, pool_size: int) -> None:
    rng = random.Random(20261130)
    async with create_postgres_agent_runtime_store(postgres_dsn, schema=schema):
        pass  # migrate once before the workers start
    workers = [
        subprocess.Popen(
            [sys.executable, str(WORKER), postgres_dsn, schema, f"worker-{i}", str(pool_size)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(4)
    ]
    try:
        for w in workers:
            line = await asyncio.wait_for(asyncio.to_thread(w.stdout.readline), 60)  # type: ignore[union-attr]
            assert line.strip() == "READY", w.stderr.read() if w.stderr else line  # type: ignore[union-attr]
        registry = define_model_registry(models={"m": {"model": FunctionModel(stream_function=unused)}})
        async with create_postgres_agent_runtime_store(postgres_dsn, schema=schema, max_size=pool_size) as pg:
            policies = ["queue", "queue", "interrupt", "interrupt-next", "supersede"]
            web = create_agent_runtime(
                protocol=define_agent_protocol(),
                store=pg.store,
                models={"resolve": lambda: registry.resolve("m")},
                runs={
                    "execute": False,
                    "watch_interval": 0.1,
                    "input_policy": lambda raw: raw.input_metadata["policy"],
                },
            )
            tickets = []
            for round_ in range(3):
                for c in range(50):
                    policy = rng.choice(policies)
                    ticket = web.submit(
                        conversation_id=f"c{c}",
                        idempotency_key=f"c{c}-{round_}",
                        context=None,
                        parts=[{"type": "text", "text": f"c{c} r{round_}"}],
                        input_metadata={"policy": policy},
                    )
                    tickets.append((policy, ticket))
                await asyncio.sleep(0.05)
                for c in rng.sample(range(50), 5):  # random durable interrupts of whatever runs there
                    active = await pg.store.list_active_runs(conversation_id=f"c{c}")
                    for run in active.runs:
                        if run.acquired:
                            await web.interrupt(conversation_id=f"c{c}", run_id=run.id)
            results = [await asyncio.wait_for(t.result, 120) for _, t in tickets]
            await web.close()

            allowed = {"success", "interrupted", "superseded"}
            assert {r.terminal_reason for r in results} <= allowed, {r.terminal_reason for r in results}
            for conversation in range(50):
                snapshot = await pg.store.load_snapshot(conversation_id=f"c{conversation}")
                runs = [r for r in snapshot.runs if r.execution_sequence is not None]
                assert all(r.terminal for r in snapshot.runs), "nothing is left active"
                # answered exactly once: every input belongs to exactly one run, every run has one answer
                inputs = [m for m in snapshot.messages if m.role == "user"]
                owners = [r for m in inputs for r in snapshot.runs if m.id in r.input_message_ids]
                assert len(owners) == len(inputs)
                assert len({m.id for m in snapshot.messages}) == len(snapshot.messages)
                # never two executing at once: acquisition-to-terminal intervals do not overlap
                ordered = sorted(runs, key=lambda r: r.execution_sequence)  # type: ignore[arg-type, return-value]
                for before, after in itertools.pairwise(ordered):
                    assert before.terminal_at <= after.acquired_at, (before.id, after.id)  # type: ignore[operator]
                # FIFO inside each class by admission order
                for priority in ("ordinary", "urgent"):
                    same = [r.admission_sequence for r in ordered if r.priority == priority]
                    assert same == sorted(same), (conversation, priority)
    finally:
        batches = 0
        for w in workers:
            if w.poll() is None:
                w.send_signal(signal.SIGTERM)
        for w in workers:
            try:
                out, err = w.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                w.kill()
                out, err = w.communicate()
            assert w.returncode == 0, err[-2000:]
            assert "CLOSED True" in out, out + err[-2000:]
            batches += int(out.rsplit("batches=", 1)[1].split()[0])
    if pool_size == 1:
        assert batches > 0  # the checks above held with writes committed in batches
