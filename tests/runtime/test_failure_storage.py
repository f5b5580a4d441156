"""``Run.failure`` on real SQLite files and the real PostgreSQL server: a failed run keeps its failure across
a reopen, a run without one is stored in the shape it always had (no ``failure`` key), and rows written
before the field existed (bodies without it) still load."""

from __future__ import annotations

import asyncio
import json
import os
import sqlite3
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from threadline import create_postgres_agent_runtime_store, create_sqlite_agent_runtime_store

from .conftest import Script, make_runtime, submit

WAIT = 10


async def failing(i: int, messages: list[Any], info: Any) -> AsyncIterator[Any]:
    if i == 0:
        raise ConnectionResetError("the provider went away")
    yield "fine"


async def two_runs(store: Any) -> tuple[Any, Any]:
    runtime = make_runtime(store, Script(failing))
    failed = await asyncio.wait_for(submit(runtime, "k1", "one").result, WAIT)
    answered = await asyncio.wait_for(submit(runtime, "k2", "two").result, WAIT)
    await runtime.close()
    return failed, answered


async def test_sqlite_keeps_the_failure_and_the_old_shape(tmp_path: Path) -> None:
    path = tmp_path / "runs.db"
    async with create_sqlite_agent_runtime_store(path) as handle:
        failed, answered = await two_runs(handle.store)
    assert failed.error is not None and answered.error is None
    bodies = {
        run_id: json.loads(body)
        for run_id, body in sqlite3.connect(path).execute("SELECT run_id, body FROM threadline_runs")
    }
    assert "failure" not in bodies[answered.run.id]
    assert bodies[failed.run.id]["failure"]["origin"] == "provider"
    async with create_sqlite_agent_runtime_store(path) as handle:
        again = await handle.store.load_run(conversation_id="c1", run_id=failed.run.id)
        ok = await handle.store.load_run(conversation_id="c1", run_id=answered.run.id)
    assert again is not None and again.run.failure == failed.error
    assert ok is not None and ok.run.failure is None


async def test_sqlite_reads_a_failed_run_written_before_the_field(tmp_path: Path) -> None:
    path = tmp_path / "old.db"
    async with create_sqlite_agent_runtime_store(path) as handle:
        failed, _ = await two_runs(handle.store)
    with sqlite3.connect(path) as db:  # the body an older threadline wrote: no failure key
        (body,) = db.execute("SELECT body FROM threadline_runs WHERE run_id = ?", (failed.run.id,)).fetchone()
        old = json.loads(body)
        del old["failure"]
        db.execute("UPDATE threadline_runs SET body = ? WHERE run_id = ?", (json.dumps(old), failed.run.id))
    async with create_sqlite_agent_runtime_store(path) as handle:
        loaded = await handle.store.load_run(conversation_id="c1", run_id=failed.run.id)
    assert loaded is not None
    assert (loaded.run.terminal_reason, loaded.run.failure) == ("provider_failure", None)


@pytest.mark.postgres
async def test_postgres_keeps_the_failure_and_reads_old_rows(postgres_dsn: str, schema: str) -> None:
    import psycopg

    async with create_postgres_agent_runtime_store(postgres_dsn, schema=schema) as handle:
        failed, answered = await two_runs(handle.store)
    async with await psycopg.AsyncConnection.connect(postgres_dsn, autocommit=True) as conn:
        rows = await (await conn.execute(f'SELECT run_id, body FROM "{schema}".threadline_runs')).fetchall()
        bodies = {run_id: json.loads(body) for run_id, body in rows}
        assert "failure" not in bodies[answered.run.id]
        old = dict(bodies[failed.run.id])
        assert old.pop("failure")["summary"] == failed.error.summary
        await conn.execute(
            f'UPDATE "{schema}".threadline_runs SET body = %s WHERE run_id = %s', (json.dumps(old), answered.run.id)
        )
        await conn.execute(  # a failed run as an older threadline wrote it
            f'INSERT INTO "{schema}".threadline_runs (conversation_id, run_id, active, version, body) '
            "SELECT conversation_id, 'run_old', active, version, %s FROM "
            f'"{schema}".threadline_runs WHERE run_id = %s',
            (json.dumps({**old, "id": "run_old"}), failed.run.id),
        )
    async with create_postgres_agent_runtime_store(postgres_dsn, schema=schema) as handle:
        again = await handle.store.load_run(conversation_id="c1", run_id=failed.run.id)
        legacy = await handle.store.load_run(conversation_id="c1", run_id="run_old")
    assert again is not None and again.run.failure == failed.error
    assert legacy is not None and (legacy.run.terminal_reason, legacy.run.failure) == ("provider_failure", None)


@pytest.mark.subprocess
async def test_threadline_inspect_runs_shows_the_failure(tmp_path: Path) -> None:
    path = tmp_path / "runs.db"
    async with create_sqlite_agent_runtime_store(path) as handle:
        failed, answered = await two_runs(handle.store)

    def inspect(*extra: str) -> str:
        done = subprocess.run(
            [sys.executable, "-m", "threadline.cli", "inspect", "runs", "--db", str(path), *extra],
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, "COLUMNS": "250", "NO_COLOR": "1"},
        )
        assert done.returncode == 0, done.stderr
        return done.stdout

    listed = {r["id"]: r for r in json.loads(inspect("--json"))}
    assert listed[failed.run.id]["failure"] == failed.error.model_dump(mode="json")
    assert "failure" not in listed[answered.run.id]
    table = inspect()
    assert "failure" in table  # the column
    assert f"provider: {failed.error.summary}" in " ".join(table.split())
