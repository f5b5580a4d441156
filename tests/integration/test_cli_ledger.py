"""``threadline inspect events | export | import | branch`` as a user runs them: real subprocesses on real
SQLite files."""

from __future__ import annotations

import asyncio
import json
import os
import select
import subprocess
import sys
from pathlib import Path

import pytest

from threadline import create_sqlite_agent_runtime_store

pytestmark = pytest.mark.subprocess


def cli(*args: str, stdin: bytes | None = None) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        [sys.executable, "-m", "threadline.cli", *args],
        input=stdin,
        capture_output=True,
        timeout=120,
        env={**os.environ, "COLUMNS": "200"},
    )


async def _one_turn(db: Path, cid: str) -> str:
    async with create_sqlite_agent_runtime_store(filename=db) as sqlite:
        store = sqlite.store
        accepted = await store.accept_input_and_assign_run(
            conversation_id=cid, idempotency_key="k1", input={"id": "in-1", "parts": [{"type": "text", "text": "hi"}]}
        )
        run = (
            await store.acquire_run(conversation_id=cid, run_id=accepted.run.id, expected_revision=1, owner_id="o")
        ).run
        await store.commit_run_terminal(
            conversation_id=cid,
            run_id=run.id,
            expected_revision=run.revision,
            owner_id="o",
            fencing_token=run.fencing_token,
            terminal_reason="success",
            parts=[{"type": "text", "text": "hello there"}],
        )
        return run.id


def test_inspect_export_import_and_branch(tmp_path: Path) -> None:
    source, target = tmp_path / "source.db", tmp_path / "target.db"
    run_id = asyncio.run(_one_turn(source, "c1"))

    shown = cli("inspect", "events", "--db", str(source), "--conversation", "c1", "--json")
    assert shown.returncode == 0, shown.stderr
    events = json.loads(shown.stdout)
    assert [(e["seq"], e["kind"]) for e in events] == [
        (1, "runtime/transition"),
        (2, "runtime/transition"),
        (3, "runtime/transition"),
    ]
    assert [e["payload"]["type"] for e in events] == ["accept", "acquire", "terminal"]
    table = cli("inspect", "events", "--db", str(source), "--conversation", "c1")
    assert table.returncode == 0 and b"terminal v3" in table.stdout

    archive = tmp_path / "c1.archive"
    exported = cli("export", "--db", str(source), "--conversation", "c1", "--out", str(archive))
    assert exported.returncode == 0, exported.stderr
    imported = cli("import", str(archive), "--db", str(target))
    assert imported.returncode == 0 and b"imported c1 (3 events)" in imported.stdout
    again = cli("export", "--db", str(target), "--conversation", "c1")
    assert again.stdout == archive.read_bytes()  # byte-identical through another database
    twice = cli("import", str(archive), "--db", str(target))
    assert twice.returncode == 2 and twice.stderr.startswith(b"error: IMPORT_TARGET_EXISTS")
    damaged = tmp_path / "damaged.archive"
    damaged.write_bytes(archive.read_bytes()[:-10])
    refused = cli("import", str(damaged), "--db", str(tmp_path / "other.db"))
    assert refused.returncode == 2 and refused.stderr.startswith(b"error: ARCHIVE_MALFORMED")

    branched = cli(
        "branch", "--db", str(target), "--request-key", "b1", "--to", "c2", "--from", "c1", "--through-run", run_id
    )
    assert branched.returncode == 0 and branched.stdout.startswith(b"created: c2 from conversation c1 through seq 3")
    retried = cli(
        "branch", "--db", str(target), "--request-key", "b1", "--to", "c2", "--from", "c1", "--through-run", run_id
    )
    assert retried.stdout.startswith(b"duplicate: c2")
    usage = cli("inspect", "events", "--db", str(target), "--follow")
    assert usage.returncode == 2 and b"--conversation" in usage.stderr


def _line(proc: subprocess.Popen[bytes], timeout: float = 60) -> bytes:
    """One line of the follower's output, or a failure once ``timeout`` passed (never a hang)."""
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    assert ready, "the follower printed nothing"
    return proc.stdout.readline()


def test_follow_prints_events_as_they_are_appended(tmp_path: Path) -> None:
    db = tmp_path / "follow.db"
    asyncio.run(_one_turn(db, "c1"))
    command = [
        sys.executable,
        "-m",
        "threadline.cli",
        "inspect",
        "events",
        "--db",
        str(db),
        "-c",
        "c1",
        "--follow",
        "--json",
    ]
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, bufsize=0) as follower:
        try:
            seen = [json.loads(_line(follower)) for _ in range(3)]
            assert [e["seq"] for e in seen] == [1, 2, 3]

            async def append() -> None:
                async with create_sqlite_agent_runtime_store(filename=db) as sqlite:
                    await sqlite.store.append_event(
                        conversation_id="c1", kind="state/set", payload={"name": "goal", "value": 1}
                    )

            asyncio.run(append())
            event = json.loads(_line(follower))
            assert (event["seq"], event["kind"]) == (4, "state/set")
        finally:
            follower.kill()
            follower.communicate(timeout=30)


def test_inspect_events_summarizes_durable_steps(tmp_path: Path) -> None:
    from threadline.durability import create_local_step_durability, run_agent_step

    db = tmp_path / "steps.db"

    async def record() -> None:
        async with create_sqlite_agent_runtime_store(filename=db) as sqlite:
            durability = create_local_step_durability(store=sqlite.store)
            await run_agent_step(durability, "c1", "run-1", "send-mail", lambda: {"sent": True})

    asyncio.run(record())
    table = cli("inspect", "events", "--db", str(db), "--conversation", "c1")
    assert table.returncode == 0, table.stderr
    assert b"run run-1 step 'send-mail' intent" in table.stdout
    assert b"run run-1 step 'send-mail' accepted" in table.stdout


async def _spilled_turn(db: Path, cid: str) -> str:
    run_id = await _one_turn(db, cid)
    async with create_sqlite_agent_runtime_store(filename=db) as sqlite:
        await sqlite.store.append_event(
            conversation_id=cid, kind="spill/created", payload={"reference": "spill-1", "bytes": 3, "sha256": "0" * 64}
        )
    return run_id


def test_branch_of_history_with_spills_takes_a_fresh_artifact_authorization(tmp_path: Path) -> None:
    db = tmp_path / "spills.db"
    asyncio.run(_spilled_turn(db, "c1"))
    base = ("branch", "--db", str(db), "--request-key", "b1", "--to", "c2", "--from", "c1")
    refused = cli(*base)
    assert refused.returncode == 2 and refused.stderr.startswith(b"error: BRANCH_ARTIFACTS"), refused.stderr
    bad = cli(*base, "--artifact-authorization", "{not json")
    assert bad.returncode == 2 and b"--artifact-authorization is JSON" in bad.stderr
    created = cli(*base, "--artifact-authorization", '{"grant": "reader-7"}')
    assert created.returncode == 0 and created.stdout.startswith(b"created: c2 from conversation c1"), created.stderr
