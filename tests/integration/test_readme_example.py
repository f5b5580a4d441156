"""The README's programs run as written: the quickstart offline with a scripted model, and with a real
model name it refuses cleanly (naming the missing credential) when no key is configured, writing nothing;
the tools-and-subscriber program prints what the README says and writes only its own database (one
``.gitignore`` covers); the PostgreSQL program opens the store from ``import threadline``."""

from __future__ import annotations

import os
import re
import sqlite3
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run(script: str, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", script], cwd=cwd, env=env, capture_output=True, text=True, timeout=120, check=False
    )


def test_scripted_quickstart_runs_exactly_as_written(tmp_path: Path) -> None:
    script = (ROOT / "examples" / "quickstart_scripted.py").read_text()
    done = run(script, tmp_path)
    assert done.returncode == 0, done.stderr
    run_id, reason = done.stdout.split()
    assert run_id.startswith("run_") and reason == "success"
    rows = sqlite3.connect(tmp_path / "quickstart.db").execute("SELECT COUNT(*) FROM threadline_runs").fetchone()
    assert rows == (1,)
    assert [p.name for p in tmp_path.glob("*.db")] == ["quickstart.db"]  # never the demo's threadline.db


def test_readme_quickstart_without_a_key_names_the_variable_and_writes_nothing(tmp_path: Path) -> None:
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"## Quickstart\s+```python\n(.*?)```", readme, re.S)
    assert block, "the README has a python quickstart block"
    env = {k: v for k, v in os.environ.items() if not k.startswith("OPENAI")}
    done = run(block.group(1), tmp_path, env)
    assert done.returncode != 0
    assert "AgentModelUnavailableError" in done.stderr and "OPENAI_API_KEY" in done.stderr
    db = sqlite3.connect(tmp_path / "quickstart.db")
    assert db.execute("SELECT COUNT(*) FROM threadline_conversations").fetchone() == (0,)


def readme_block(heading: str) -> str:
    """The first python block after ``heading`` in the README."""
    readme = (ROOT / "README.md").read_text()
    block = re.search(re.escape(heading) + r".*?```python\n(.*?)```", readme, re.S)
    assert block, f"the README has a python block under {heading!r}"
    return block.group(1)


def test_readme_tools_and_subscriber_program_runs_as_written(tmp_path: Path) -> None:
    done = run(readme_block("## Tools, a subscriber, and reading the answer"), tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""
    lines = done.stdout.splitlines()
    assert lines == [
        "[get_weather started]",
        "[get_weather completed]",
        "It is sunny in Lisbon, 24 °C. <success>",
        "'It is sunny in Lisbon, 24 °C.' 2 steps",
    ]
    assert [p.name for p in tmp_path.iterdir()] == ["tools.db"]
    for name in ("tools.db", "quickstart.db", "recovery.db", "threadline.db"):
        ignored = subprocess.run(["git", "check-ignore", "-q", "--no-index", name], cwd=ROOT, check=False)
        assert ignored.returncode == 0, f".gitignore covers {name} (a README program or an example writes it)"
    parts = sqlite3.connect(tmp_path / "tools.db").execute("SELECT COUNT(*) FROM threadline_messages").fetchone()
    assert parts == (2,)  # the input, and one assistant message holding the call, its result and the text


def test_readme_postgres_program_runs(postgres_dsn: str, tmp_path: Path) -> None:
    """Run against the test server in a fresh schema (the only change: the schema's name)."""
    import uuid

    import psycopg

    schema = f"readme_{uuid.uuid4().hex[:8]}"
    block = readme_block("### PostgreSQL and many processes")
    assert 'schema="threadline"' in block
    env = {**os.environ, "DATABASE_URL": postgres_dsn}
    try:
        done = run(block.replace('schema="threadline"', f'schema="{schema}"'), tmp_path, env)
        assert done.returncode == 0, done.stderr
        assert done.stdout.split() == [schema, "[]"]
    finally:
        with psycopg.connect(postgres_dsn, autocommit=True) as conn:
            conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
