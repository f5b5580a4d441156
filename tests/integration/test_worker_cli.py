"""``threadline worker --dsn``: executes what another process admitted, and stops gracefully on SIGTERM."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from typing import Any

import pytest
from pydantic_ai.models.function import FunctionModel

from threadline import create_agent_runtime, define_agent_protocol, define_model_registry
from threadline.store.postgres import create_postgres_agent_runtime_store

pytestmark = [pytest.mark.postgres, pytest.mark.subprocess]


async def never(messages: list[Any], info: Any) -> AsyncIterator[Any]:
    yield "this runtime only admits"


async def test_the_worker_command_answers_and_stops_on_sigterm(postgres_dsn: str, schema: str) -> None:
    async with create_postgres_agent_runtime_store(postgres_dsn, schema=schema):
        pass  # migrated before the worker starts
    with subprocess.Popen(
        [sys.executable, "-m", "threadline.cli", "worker", "--dsn", postgres_dsn, "--schema", schema, "--poll", "0.2"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    ) as worker:
        try:
            line = await asyncio.wait_for(asyncio.to_thread(worker.stdout.readline), 60)  # type: ignore[union-attr]
            assert "serving" in line and "gc tuned" in line, line
            registry = define_model_registry(models={"m": {"model": FunctionModel(stream_function=never)}})
            async with create_postgres_agent_runtime_store(postgres_dsn, schema=schema) as pg:
                web = create_agent_runtime(
                    protocol=define_agent_protocol(),
                    store=pg.store,
                    models={"resolve": lambda: registry.resolve("m")},
                    runs={"execute": False, "watch_interval": 0.1},
                )
                tickets = [
                    web.submit(
                        conversation_id=f"c{i}",
                        idempotency_key="k",
                        context=None,
                        parts=[{"type": "text", "text": "Hi"}],
                    )
                    for i in range(3)
                ]
                results = [await asyncio.wait_for(t.result, 60) for t in tickets]
                assert [r.terminal_reason for r in results] == ["success"] * 3
                assert all(r.run.owner_id and r.run.owner_id.startswith("runtime-") for r in results)
                await web.close()
            worker.send_signal(signal.SIGTERM)
            out, err = worker.communicate(timeout=60)
        finally:
            if worker.poll() is None:
                worker.kill()
    assert worker.returncode == 0, err
    assert "every run in flight settled" in out
