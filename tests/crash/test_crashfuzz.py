"""A short seeded slice of ``bench/crashfuzz.py`` (the SIGKILL fuzzer) on SQLite and PostgreSQL.

The fuzzer runs as a subprocess with a timeout (it forks its own fork servers and children) and writes
every point's result to a JSON file; the test reads that file. It asserts the invariants that must always
hold — every journaled key admitted once, every run terminal and every input answerable after the
parent's recovery, durable queue order, store integrity — and that nothing hung or failed outside them.
— and the live-runtime invariant: a runtime that was never killed leaves nothing it admitted queued. Tool
effects applied more than once are figures for a tool that applies its effect directly (at-least-once is
documented) and are noted in the crash-suite summary; with durable steps (``--tool step``: their own
SQLite file; ``--tool ledger-step``: the store's event ledger) a logical effect is applied at most once,
across requeues and across the runs an injected input joined.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.subprocess

FUZZER = Path(__file__).parents[2] / "bench" / "crashfuzz.py"
MUST_HOLD = ("admitted-once", "terminal-answered", "queue-order", "integrity", "live-runtime", "hang", "harness")
TIMEOUT = 300.0


def run_fuzzer(tmp_path: Path, *args: str) -> dict[str, Any]:
    """Run the fuzzer; past ``TIMEOUT`` it gets SIGTERM (it then kills its fork servers), then SIGKILL."""
    out = tmp_path / "crashfuzz.json"
    proc = subprocess.Popen(
        [sys.executable, str(FUZZER), "--json", str(out), "--jobs", "2", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        proc.terminate()
        try:
            proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
        pytest.fail(f"the fuzzer did not finish within {TIMEOUT} s")
    # exit 1 means violations were found (read below); 2 means the fuzzer could not run at all
    assert proc.returncode in (0, 1) and out.exists(), f"exit {proc.returncode}\n{stdout}\n{stderr[-3000:]}"
    return json.loads(out.read_text())  # type: ignore[no-any-return]


def check(report: dict[str, Any], points: int, notes: list[str]) -> None:
    summary = report["summary"]
    assert summary["points"] == points
    assert summary["first_process"].get("killed", 0) > 0, summary  # the fuzzer does kill
    broken = [
        f"point {p['point']} {v['invariant']}: {v['reason']}"
        for p in report["points"]
        for v in p["violations"]
        if v["invariant"] in MUST_HOLD
    ]
    assert not broken, "\n".join(broken)
    assert summary["classified"] == points, "some points' effects were not classified"
    extra = summary["effects_extra"]
    assert sum(extra.values()) == summary["effects_applied"] - summary["effects_distinct"]
    args = report["args"]
    if args["tool"] in ("step", "ledger-step"):
        assert sum(extra.values()) == 0, f"a durable step's effect was applied more than once: {extra}"
    notes.append(
        f"crashfuzz {args['store']}/{args['tool']} seed={args['seed']} points={points}: "
        f"live-runtime violations {summary['violations']['live-runtime']} "
        f"(points: {summary['points_with_violations']['live-runtime']}); effects applied "
        f"{summary['effects_applied']}, extra: requeue {extra['requeue']}, inject {extra['inject']}, "
        f"other {extra['other']}"
    )


@pytest.mark.parametrize("tool", ["direct", "step", "ledger-step"])
def test_crashfuzz_sqlite(tool: str, tmp_path: Path, crash_notes: list[str]) -> None:
    report = run_fuzzer(tmp_path, "--seed", "7", "--points", "8", "--tool", tool)
    check(report, 8, crash_notes)


@pytest.mark.postgres
def test_crashfuzz_postgres(postgres_dsn: str, tmp_path: Path, crash_notes: list[str]) -> None:
    report = run_fuzzer(tmp_path, "--seed", "7", "--points", "4", "--store", "postgres", "--dsn", postgres_dsn)
    check(report, 4, crash_notes)
