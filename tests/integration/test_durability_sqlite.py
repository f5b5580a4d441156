"""The step ledger in its own SQLite file: proofs and intents survive closing, reopening and SIGKILL.

Pins. The file is WAL with one table, ``threadline_step_effects``. An accepted proof survives closing and
reopening: the body is not run again. A child process SIGKILLed inside the body — after the intent's
commit, before the proof — leaves a bare intent: the parent reopening the file gets
:class:`AgentStepUncertainError` without running the body, and ``reconcile`` can settle it for good. A
child that finished leaves a proof the parent replays. Two ledgers on one file share the key: the second
sees the first's intent. The runtime store's own file and a foreign table of the same name are refused.
No verdict depends on timing (``wait_for`` only keeps a broken build from hanging).
"""

from __future__ import annotations

import asyncio
import signal
import sqlite3
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from threadline.durability import (
    STEP_EFFECTS_TABLE,
    AgentStepUncertainError,
    create_local_step_durability,
    run_agent_step,
)
from threadline.errors import AgentStoreCorruptRecordError, AgentStoreSchemaError
from threadline.store.sqlite import create_sqlite_agent_runtime_store


@pytest.fixture
def ledger_file(tmp_path: Path) -> Path:
    return tmp_path / "steps.db"


def columns(path: Path) -> dict[str, Any]:
    conn = sqlite3.connect(path)
    try:
        rows = conn.execute(f"SELECT * FROM {STEP_EFFECTS_TABLE}").fetchall()
        names = [d[0] for d in conn.execute(f"SELECT * FROM {STEP_EFFECTS_TABLE}").description]
        return {
            "mode": conn.execute("PRAGMA journal_mode").fetchone()[0],
            "rows": [dict(zip(names, r, strict=True)) for r in rows],
        }
    finally:
        conn.close()


async def test_the_proof_survives_closing_and_reopening(ledger_file: Path) -> None:
    calls = 0

    async def body() -> dict[str, Any]:
        nonlocal calls
        calls += 1
        return {"ticket": "T-1", "tags": ["a", "b"], "score": 0.5}

    async with create_local_step_durability(ledger_file) as durability:
        assert await run_agent_step(durability, "c", "r", "open-ticket", body) == {
            "ticket": "T-1",
            "tags": ["a", "b"],
            "score": 0.5,
        }
    table = columns(ledger_file)
    assert table["mode"] == "wal"
    [row] = table["rows"]
    assert (row["conversation_id"], row["run_id"], row["effect_name"], row["state"]) == (
        "c",
        "r",
        "open-ticket",
        "accepted",
    )
    assert row["value"] == '{"ticket":"T-1","tags":["a","b"],"score":0.5}'
    assert row["intent_at"] and row["accepted_at"] and row["reconciled"] == 0

    async with create_local_step_durability(str(ledger_file)) as reopened:
        got = await run_agent_step(reopened, "c", "r", "open-ticket", body)
        assert got == {"ticket": "T-1", "tags": ["a", "b"], "score": 0.5} and calls == 1
        record = await reopened.read("c", "r", "open-ticket")
        assert record is not None and record.state == "accepted" and record.accepted_at is not None
        assert await run_agent_step(reopened, "c", "r2", "open-ticket", body) == got and calls == 2  # new run


async def test_an_undecodable_proof_fails_closed_without_running_the_body(ledger_file: Path) -> None:
    ran: list[str] = []

    async def body() -> int:
        ran.append("effect")
        return 1

    async with create_local_step_durability(ledger_file) as durability:
        await run_agent_step(durability, "c", "r", "effect", body)
    conn = sqlite3.connect(ledger_file)
    try:
        with conn:
            conn.execute(f"UPDATE {STEP_EFFECTS_TABLE} SET value = '{{not-json'")
    finally:
        conn.close()
    async with create_local_step_durability(ledger_file) as reopened:
        with pytest.raises(AgentStoreCorruptRecordError, match="not JSON"):
            await run_agent_step(reopened, "c", "r", "effect", body)
    assert ran == ["effect"]  # the recorded effect is never run again on a proof it cannot read


async def test_purge_is_durable(ledger_file: Path) -> None:
    async with create_local_step_durability(ledger_file) as durability:
        await run_agent_step(durability, "c", "r", "a", lambda: 1)
        await run_agent_step(durability, "keep", "r", "a", lambda: 2)
        assert await durability.purge("c") == 1
    async with create_local_step_durability(ledger_file) as reopened:
        assert await reopened.read("c", "r", "a") is None
        assert (await reopened.read("keep", "r", "a")).value == 2  # type: ignore[union-attr]


CHILD = textwrap.dedent(
    """
    import asyncio, os, signal, sys

    from threadline.durability import create_local_step_durability, run_agent_step

    filename, mode = sys.argv[1], sys.argv[2]

    async def body():
        print("effect", flush=True)  # the external effect happened
        if mode == "kill":
            os.kill(os.getpid(), signal.SIGKILL)  # dies after the intent's commit, before the proof
        return {"sent": True}

    async def main():
        durability = create_local_step_durability(filename)
        print(await run_agent_step(durability, "c", "r", "send-mail", body), flush=True)
        await durability.close()

    asyncio.run(main())
    """
)


async def run_child(filename: Path, mode: str) -> tuple[int | None, list[str]]:
    child = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        CHILD,
        str(filename),
        mode,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        out, err = await asyncio.wait_for(child.communicate(), timeout=120)
    finally:
        if child.returncode is None:
            child.send_signal(signal.SIGKILL)
            await child.communicate()
    lines = out.decode().split()
    if mode != "kill" and child.returncode != 0:
        pytest.fail(f"child failed: {err.decode()}")
    return child.returncode, lines


@pytest.mark.subprocess
async def test_sigkill_between_intent_and_proof_is_uncertain(ledger_file: Path) -> None:
    returncode, lines = await run_child(ledger_file, "kill")
    assert returncode == -signal.SIGKILL and lines == ["effect"]

    calls = 0

    async def body() -> dict[str, bool]:
        nonlocal calls
        calls += 1
        return {"sent": True}

    async with create_local_step_durability(ledger_file) as reopened:
        record = await reopened.read("c", "r", "send-mail")
        assert record is not None and record.state == "intent" and record.value is None
        with pytest.raises(AgentStepUncertainError) as caught:
            await run_agent_step(reopened, "c", "r", "send-mail", body)
        assert caught.value.key == ("c", "r", "send-mail") and calls == 0
        with pytest.raises(AgentStepUncertainError):
            await run_agent_step(reopened, "c", "r", "send-mail", body, reconcile=lambda record: None)
        # the mail server says it was sent: the reconciled proof is accepted and durable
        got = await run_agent_step(reopened, "c", "r", "send-mail", body, reconcile=lambda record: {"sent": True})
        assert got == {"sent": True} and calls == 0
    async with create_local_step_durability(ledger_file) as again:
        record = await again.read("c", "r", "send-mail")
        assert record is not None and record.state == "accepted" and record.reconciled
        assert await run_agent_step(again, "c", "r", "send-mail", body) == {"sent": True} and calls == 0


@pytest.mark.subprocess
async def test_a_finished_child_leaves_a_proof_the_parent_replays(ledger_file: Path) -> None:
    returncode, lines = await run_child(ledger_file, "finish")
    assert returncode == 0 and lines[0] == "effect"
    async with create_local_step_durability(ledger_file) as reopened:
        assert await run_agent_step(reopened, "c", "r", "send-mail", lambda: pytest.fail("ran again")) == {"sent": True}


async def test_two_ledgers_on_one_file_share_the_key(ledger_file: Path) -> None:
    first = create_local_step_durability(ledger_file)
    second = create_local_step_durability(ledger_file)
    try:
        release = asyncio.Event()
        entered = asyncio.Event()

        async def slow() -> str:
            entered.set()
            await release.wait()
            return "done"

        running = asyncio.ensure_future(run_agent_step(first, "c", "r", "effect", slow))
        await entered.wait()  # the intent is committed
        with pytest.raises(AgentStepUncertainError):
            await run_agent_step(second, "c", "r", "effect", lambda: pytest.fail("ran twice"))
        release.set()
        assert await running == "done"
        assert await run_agent_step(second, "c", "r", "effect", lambda: pytest.fail("ran twice")) == "done"
    finally:
        await first.close()
        await second.close()


async def test_the_runtime_store_file_is_refused(tmp_path: Path) -> None:
    store_file = tmp_path / "threadline.db"
    async with create_sqlite_agent_runtime_store(filename=store_file):
        pass
    with pytest.raises(AgentStoreSchemaError):
        create_local_step_durability(store_file)


def test_a_foreign_table_of_that_name_is_refused(ledger_file: Path) -> None:
    conn = sqlite3.connect(ledger_file)
    conn.execute(f"CREATE TABLE {STEP_EFFECTS_TABLE} (id INTEGER PRIMARY KEY)")
    conn.commit()
    conn.close()
    with pytest.raises(AgentStoreSchemaError):
        create_local_step_durability(ledger_file)
