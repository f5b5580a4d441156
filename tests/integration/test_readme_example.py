"""The README quickstart runs as written: offline with a scripted model, and with a real model name it
refuses cleanly (naming the missing credential) when no key is configured, writing nothing."""

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
    rows = sqlite3.connect(tmp_path / "threadline.db").execute("SELECT COUNT(*) FROM threadline_runs").fetchone()
    assert rows == (1,)


def test_readme_quickstart_without_a_key_names_the_variable_and_writes_nothing(tmp_path: Path) -> None:
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"## Quickstart\s+```python\n(.*?)```", readme, re.S)
    assert block, "the README has a python quickstart block"
    env = {k: v for k, v in os.environ.items() if not k.startswith("OPENAI")}
    done = run(block.group(1), tmp_path, env)
    assert done.returncode != 0
    assert "AgentModelUnavailableError" in done.stderr and "OPENAI_API_KEY" in done.stderr
    db = sqlite3.connect(tmp_path / "threadline.db")
    assert db.execute("SELECT COUNT(*) FROM threadline_conversations").fetchone() == (0,)
