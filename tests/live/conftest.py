"""Stores on both real backends, a worker process, and a web side that collects what its seam delivers.

Every wait is bounded (:data:`WAIT`); no verdict depends on timing.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from pydantic_ai.models.function import FunctionModel

from threadline import define_agent_protocol, define_model_registry
from threadline.delivery import reduce_agent_control_event
from threadline.harness import HeadlessAgentHarness, create_headless_agent_harness

WAIT = 30.0
"""Seconds any awaited condition may take before the test fails."""
WORKER = Path(__file__).with_name("_worker.py")


@pytest.fixture(params=["sqlite", "postgres"])
def backend(request: pytest.FixtureRequest) -> str:
    if request.param == "postgres":
        request.applymarker(pytest.mark.postgres)
    return str(request.param)


@pytest.fixture
def location(backend: str, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[list[str]]:
    """Where the store lives, as the worker's arguments: ``sqlite PATH`` or ``postgres DSN SCHEMA`` (a fresh
    schema, dropped afterwards)."""
    if backend == "sqlite":
        yield ["sqlite", str(tmp_path / "threadline.db")]
        return
    import psycopg

    dsn = request.getfixturevalue("postgres_dsn")
    schema = f"threadline_test_{uuid.uuid4().hex}"
    yield ["postgres", dsn, schema]
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


@pytest.fixture
async def store_handle(location: list[str]) -> AsyncIterator[Any]:
    """An open store at ``location``; ``handle.worker_args`` names it for a worker process."""
    if location[0] == "sqlite":
        from threadline.store.sqlite import create_sqlite_agent_runtime_store

        handle: Any = create_sqlite_agent_runtime_store(location[1])
    else:
        from threadline.store.postgres import create_postgres_agent_runtime_store

        handle = await create_postgres_agent_runtime_store(location[1], schema=location[2]).open()
    handle.worker_args = location
    try:
        yield handle
    finally:
        await handle.close()


class Worker:
    """A worker process (``_worker.py``): lines on stdin release held answers; it prints READY and DONE."""

    def __init__(self, argv: list[str]) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(WORKER), *argv],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    def _line(self) -> str:
        assert self.proc.stdout is not None
        box: list[str] = []
        reader = threading.Thread(target=lambda: box.append(self.proc.stdout.readline()), daemon=True)  # type: ignore[union-attr]
        reader.start()
        reader.join(WAIT)
        if not box or not box[0]:
            self.proc.kill()
            _, err = self.proc.communicate(timeout=WAIT)
            raise AssertionError(f"the worker said nothing within {WAIT} s; stderr:\n{err}")
        return box[0].strip()

    async def expect(self, word: str) -> str:
        line = await asyncio.to_thread(self._line)
        assert line.split()[0] == word, line
        return line

    def expect_blocking(self, word: str) -> str:
        """Read the next line with this process's event loop blocked (nothing else runs meanwhile)."""
        line = self._line()
        assert line.split()[0] == word, line
        return line

    def release(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()

    def stop(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(WAIT)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(WAIT)
        for pipe in (self.proc.stdout, self.proc.stderr):
            if pipe is not None:
                pipe.close()


@pytest.fixture
async def start_worker(store_handle: Any) -> AsyncIterator[Callable[..., Any]]:
    workers: list[Worker] = []

    async def start(*options: str) -> Worker:
        worker = Worker([*store_handle.worker_args, *options])
        workers.append(worker)
        await worker.expect("READY")
        return worker

    try:
        yield start
    finally:
        for worker in workers:
            worker.stop()


async def _never(messages: list[Any], info: Any) -> AsyncIterator[str]:
    yield "this process only admits"


class Seam:
    """What a web process's subscribers receive: every event its harness's hub delivered, in order."""

    def __init__(self, harness: HeadlessAgentHarness) -> None:
        self.harness = harness
        self.events: list[Any] = []
        self._changed = asyncio.Event()
        harness.subscribe(self._on_event)

    def _on_event(self, event: Any) -> None:
        self.events.append(event)
        self._changed.set()

    async def until(self, predicate: Callable[[list[Any]], Any]) -> Any:
        """Wait (at most :data:`WAIT`) until ``predicate(events)`` is truthy; return its value."""
        async with asyncio.timeout(WAIT):
            while True:
                found = predicate(self.events)
                if found:
                    return found
                self._changed.clear()
                await self._changed.wait()

    def view(self) -> Any:
        state = None
        for event in self.events:
            state = reduce_agent_control_event(state, event)
        return state


def web_harness(store: Any, **options: Any) -> HeadlessAgentHarness:
    """A harness that only admits (``execute: False``); ``options`` go to the harness (``publish=``...)."""
    registry = define_model_registry(models={"m": {"model": FunctionModel(stream_function=_never)}})
    return create_headless_agent_harness(
        protocol=define_agent_protocol(),
        store=store,
        models={"resolve": lambda: registry.resolve("m")},
        runs={"execute": False, "watch_interval": 0.05},
        **options,
    )


def text_of(message: Any) -> str:
    return "".join(p.text for p in message.parts if p.type == "text") if message is not None else ""


def terminal_of(run_id: str) -> Callable[[list[Any]], Any]:
    return lambda events: next((e for e in events if e.type == "terminal" and e.run_id == run_id), None)
