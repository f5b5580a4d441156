"""The ``threadline`` command: ``schema`` and ``demo``.

Pins: ``schema`` prints (or writes) the JSON Schema of every canonical record; ``demo`` runs every scene on
a real SQLite file, shows each scene's key fact, and can run again on the same file; a file that is not a
database gives one ``error:`` line and a non-zero status, never a traceback; bad invocations fail cleanly.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from threadline.cli import app
from threadline.records import RECORD_MODELS, export_json_schemas

runner = CliRunner()


def cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """Run ``python -m threadline.cli`` the way a user's shell would (its own process, piped output)."""
    env = {**os.environ, "COLUMNS": "200", "NO_COLOR": "1"}
    return subprocess.run(
        [sys.executable, "-m", "threadline.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        check=False,
    )


# ------------------------------------------------------------------------------------------- schema


def test_schema_prints_one_json_object_keyed_by_record_name() -> None:
    result = runner.invoke(app, ["schema"])
    assert result.exit_code == 0, result.output
    printed = json.loads(result.stdout)
    assert set(printed) == set(RECORD_MODELS)
    assert printed == export_json_schemas()
    assert result.stdout.startswith("{\n  ")  # indented


def test_schema_output_writes_one_file_per_record(tmp_path: Path) -> None:
    target = tmp_path / "schemas" / "nested"
    result = runner.invoke(app, ["schema", "--output", str(target)])
    assert result.exit_code == 0, result.output
    written = sorted(p.name for p in target.iterdir())
    assert written == sorted(f"{name}.schema.json" for name in RECORD_MODELS)
    schemas = export_json_schemas()
    for name in RECORD_MODELS:
        assert json.loads((target / f"{name}.schema.json").read_text(encoding="utf-8")) == schemas[name]


def test_schema_output_onto_a_file_fails_cleanly(tmp_path: Path) -> None:
    occupied = tmp_path / "occupied"
    occupied.write_text("x")
    result = runner.invoke(app, ["schema", "--output", str(occupied)])
    assert result.exit_code != 0
    assert "Traceback" not in result.output


def test_schema_output_under_a_file_is_one_error_line(tmp_path: Path) -> None:
    occupied = tmp_path / "occupied"
    occupied.write_text("x")
    result = runner.invoke(app, ["schema", "--output", str(occupied / "sub")])
    assert result.exit_code == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: cannot write schemas"), result.stderr
    assert "Traceback" not in result.output


@pytest.mark.parametrize("args", [["nosuchcommand"], ["schema", "--bogus"], ["demo", "--pace", "-1"]])
def test_bad_invocations_exit_non_zero_without_a_traceback(args: list[str]) -> None:
    result = runner.invoke(app, args)
    assert result.exit_code == 2
    assert "Traceback" not in result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)


def test_help_lists_the_commands() -> None:
    result = runner.invoke(app, ["--help"])
    assert result.exit_code == 0
    assert "schema" in result.output and "demo" in result.output


# --------------------------------------------------------------------------------------------- demo

SCENE_FACTS = [
    "no model yet",
    "Scene 1",
    "coalesced into ONE queued successor",
    "Scene 2",
    "⟨saved⟩",
    "terminal 'success' committed",
    "Scene 3",
    "urgent before ordinary",
    "Scene 4",
    "interrupt_requested",
    "assistant status 'interrupted'",
    "Scene 5",
    "'duplicate'",
    "Scene 6",
    "runs, read back from disk",
    "terminal_reason",
    "conversations.messages",
    "read back 3 runs and 7 messages",
]


@pytest.mark.subprocess
def test_demo_runs_every_scene_and_runs_again_on_the_same_file(tmp_path: Path) -> None:
    db = tmp_path / "demo.db"
    first = cli("demo", "--db", str(db), "--pace", "0")
    assert first.returncode == 0, first.stdout + first.stderr
    assert "Traceback" not in first.stderr
    for fact in SCENE_FACTS:
        assert fact in first.stdout, f"missing {fact!r} in:\n{first.stdout}"
    assert db.exists() and db.stat().st_size > 0
    assert "holds 1 conversation(s)" in first.stdout

    second = cli("demo", "--db", str(db), "--pace", "0")
    assert second.returncode == 0, second.stdout + second.stderr
    for fact in SCENE_FACTS:
        assert fact in second.stdout, f"missing {fact!r} on the second run"
    assert "holds 2 conversation(s)" in second.stdout


@pytest.mark.subprocess
def test_demo_table_reads_back_each_run(tmp_path: Path) -> None:
    result = cli("demo", "--db", str(tmp_path / "t.db"), "--pace", "0")
    assert result.returncode == 0, result.stdout + result.stderr
    rows = [line for line in result.stdout.splitlines() if line.startswith("│ ") and "run_" in line]
    cells = [[c.strip() for c in row.strip("│ ").split("│")] for row in rows]
    assert [(c[0], c[2], c[3], c[5]) for c in cells] == [
        ("A", "completed", "success", "1"),
        ("B", "completed", "success", "2"),
        ("C", "interrupted", "interrupted", "1"),
    ]


@pytest.mark.subprocess
def test_demo_on_a_garbage_file_is_one_error_line(tmp_path: Path) -> None:
    garbage = tmp_path / "garbage.db"
    garbage.write_bytes(b"this is not a database\x00\xff" * 200)
    result = cli("demo", "--db", str(garbage), "--pace", "0")
    assert result.returncode == 2
    combined = result.stdout + result.stderr
    assert "Traceback" not in combined
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: ")
    assert result.stdout.strip() == ""


def test_demo_in_process(tmp_path: Path) -> None:
    """The same command through Typer's runner: the scenes' checks pass and a typed store error exits 2."""
    result = runner.invoke(app, ["demo", "--db", str(tmp_path / "in-process.db"), "--pace", "0"])
    assert result.exit_code == 0, result.output
    assert "read back 3 runs and 7 messages" in result.stdout

    garbage = tmp_path / "garbage.db"
    garbage.write_bytes(b"\x00\x01not sqlite" * 500)
    failed = runner.invoke(app, ["demo", "--db", str(garbage)])
    assert failed.exit_code == 2
    assert failed.stdout == ""
    assert failed.stderr.startswith("error: ") and failed.stderr.count("\n") == 1
