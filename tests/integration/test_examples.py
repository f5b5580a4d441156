"""Every program in ``examples/`` runs offline, as written, in a fresh directory, and prints what its
docstring promises. (``quickstart_scripted.py`` is run by ``test_readme_example.py``.)"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"

pytestmark = pytest.mark.subprocess


def run(name: str, cwd: Path) -> str:
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / name)], cwd=cwd, capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stderr == "", done.stderr
    return done.stdout


def test_every_example_is_tested() -> None:
    tested = {"quickstart_scripted.py", *(name for name, _ in CHECKS)}
    assert {p.name for p in EXAMPLES.glob("*.py")} == tested


def check_policies(out: str) -> None:
    rows = {line.split()[0]: line.split()[1:4] for line in out.splitlines() if line and not line.startswith(" ")}
    assert rows["queue"] == ["success", "success", "success"]
    assert rows["interrupt"] == ["interrupted", "success", "success"]
    assert rows["interrupt-next"] == ["interrupted", "success", "success"]
    assert rows["supersede"] == ["superseded", "success", "success"]
    assert rows["inject"] == ["success", "success", "absorbed"]
    orders = dict(re.findall(r"^(\S+).*answered: ([\d →]+)$", out, re.M))
    assert orders == {
        "queue": "1 → 2 → 3",
        "interrupt": "2 → 3",
        "interrupt-next": "3 → 2",
        "supersede": "2 → 3",
        "inject": "1 → 2",
    }
    # supersede: the discarded answer left input 1 unanswered in the prompt, so the next run answers it too
    assert "2: answering plan a day in Lisbon + suggest a restaurant" in out
    # inject: input 3 joined input 1's run at the step boundary after the tool call
    assert "answering plan a day in Lisbon + actually, make it Porto" in out


def check_tools(out: str) -> None:
    assert 'tool get_order failed: {"error": "NOT_FOUND", "retryable": false, "message": "no order ZZ"' in out
    assert "tool get_order progress: looking up A1" in out
    assert "run 1: provider_stop" in out and "(payments so far: [])" in out
    assert 'pending approval: refund({"order_id": "A1"})' in out
    assert "run 2: success: Done: refunded 39.0 as rf-A1." in out
    assert "payments: ['A1']; pending approvals: 0" in out


def check_recovery(out: str) -> None:
    lines = out.splitlines()
    assert lines[0] == "child killed: exit status -9"
    assert lines[1].startswith("on disk: running  owner=child-") and "draft='Here is a'" in lines[1]
    assert lines[2].startswith("on disk: queued   owner=None")
    assert lines[3] == "recovered: requeued success: Here is a careful answer to 'what is durable?', in several words."
    assert lines[4] == "recovered: resumed  success: Here is a careful answer to 'and recovery?', in several words."
    assert lines[5:] == ["close: settled=True remaining=0", "purge: purged"]


def check_events(out: str) -> None:
    assert "delivery sink: {'delivered': 19, 'dropped': 0, 'failed': 0}" in out
    assert "transient #1  assistant-delta      fresh  Checking." in out
    assert "transient #2  tool-status          fresh  started" in out
    assert "durable       terminal             fresh" in out
    assert "gap" not in out
    assert "redelivered terminal: duplicate" in out
    assert "control view answer == stored answer: True" in out
    assert "step-finished step 0: input_tokens 50 (provider-reported)" in out
    assert (
        "run-terminal success: input_tokens 100 (computed), output_tokens 11 (computed), cost None (unavailable)" in out
    )


def check_compaction(out: str) -> None:
    assert "stored messages: 12, compacted (kept, no longer sent): 5" in out
    assert "  summary    Earlier, the user said: my name is Ada; I live in Porto" in out
    assert "its instructions: 'Earlier, the user said: my name is Ada; I live in Porto'" in out


def check_coding(out: str) -> None:
    assert "  glob: ['calc/core.py', 'calc/test_core.py']" in out
    assert "  edit_file refused: NOT_FOUND — read the file and copy the snippet exactly" in out
    assert '"creates_directories"' not in out and '"operation": "edit"' in out
    assert "  run_command: exit 0 (exited): OK" in out
    assert "denied [{'path': 'secrets', 'kind': 'directory'}]" in out
    assert "run: success: Fixed add() in calc/core.py; the tests pass." in out
    assert "calc/core.py now: 'def add(a, b):\\n    return a + b\\n'" in out


CHECKS = [
    ("policies.py", check_policies),
    ("tools_and_approvals.py", check_tools),
    ("recovery.py", check_recovery),
    ("events_sink.py", check_events),
    ("compaction.py", check_compaction),
    ("coding_agent.py", check_coding),
]


@pytest.mark.parametrize(("name", "check"), CHECKS, ids=[name for name, _ in CHECKS])
def test_example_runs_and_prints_what_it_promises(name: str, check, tmp_path: Path) -> None:
    check(run(name, tmp_path))
    if name == "recovery.py":
        assert (tmp_path / "recovery.db").exists()
