"""Each bad database file raises the exception docs/stores-and-drivers.md names for it (real files)."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from threadline import (
    AgentStoreSchemaError,
    AgentStoreUnavailableError,
    create_local_step_durability,
    create_sqlite_agent_runtime_store,
)


async def opened(path: Path) -> None:
    handle = create_sqlite_agent_runtime_store(path)
    try:
        await handle.store.load_snapshot(conversation_id="c")
    finally:
        await handle.aclose()


def tables(path: Path, *statements: str) -> Path:
    with sqlite3.connect(path) as db:
        for statement in statements:
            db.execute(statement)
    return path


async def test_a_file_that_is_not_a_database_is_a_schema_error(tmp_path: Path) -> None:
    path = tmp_path / "notes.db"
    path.write_bytes(b"these are notes, not a database\n" * 64)
    with pytest.raises(AgentStoreSchemaError, match="is not a SQLite database"):
        await opened(path)
    assert path.read_bytes().startswith(b"these are notes")  # never touched


@pytest.mark.parametrize("where", ["a-directory", "missing/folder.db"])
async def test_a_path_that_cannot_be_opened_is_unavailable(tmp_path: Path, where: str) -> None:
    (tmp_path / "a-directory").mkdir()
    with pytest.raises(AgentStoreUnavailableError):
        await opened(tmp_path / where)


async def test_schemas_threadline_did_not_write_or_cannot_read(tmp_path: Path) -> None:
    partial = tables(tmp_path / "partial.db", "CREATE TABLE threadline_runs (x)")
    later = tables(
        tmp_path / "later.db",
        "CREATE TABLE threadline_meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)",
        "INSERT INTO threadline_meta VALUES ('schema_version', '99')",
    )
    with pytest.raises(AgentStoreSchemaError, match="partial threadline schema"):
        await opened(partial)
    with pytest.raises(AgentStoreSchemaError, match="'99' is not supported"):
        await opened(later)


async def test_a_step_ledger_and_a_store_never_share_a_file(tmp_path: Path) -> None:
    ledger = create_local_step_durability(tmp_path / "steps.db")
    await ledger.close()
    with pytest.raises(AgentStoreSchemaError):
        await opened(tmp_path / "steps.db")
    await opened(tmp_path / "store.db")
    with pytest.raises(AgentStoreSchemaError):
        create_local_step_durability(tmp_path / "store.db")


async def test_another_programs_tables_are_left_beside_threadlines(tmp_path: Path) -> None:
    path = tables(tmp_path / "app.db", "CREATE TABLE invoices (id INTEGER PRIMARY KEY)")
    await opened(path)
    with sqlite3.connect(path) as db:
        names = {name for (name,) in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    assert "invoices" in names and "threadline_meta" in names
