"""Crash-suite plumbing: notes worth reading that are not failures (the at-least-once tool boundary, the
fuzzer's figures).

Quiet by default: the run ends with one line counting the notes. They are printed in full in the terminal
summary with ``-v``, with ``-s`` (output not captured) or with ``THREADLINE_TEST_NOTES=1``.
"""

from __future__ import annotations

import os
from typing import Any

import pytest

_NOTES = pytest.StashKey[list[str]]()


@pytest.fixture
def crash_notes(request: pytest.FixtureRequest) -> list[str]:
    """A list the crash tests append observations to; shown in the terminal summary (see the module)."""
    return request.config.stash.setdefault(_NOTES, [])


def _wanted(config: pytest.Config) -> bool:
    return (
        os.environ.get("THREADLINE_TEST_NOTES") == "1"
        or config.get_verbosity() > 0
        or config.getoption("capture", default="fd") == "no"
    )


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    notes = config.stash.get(_NOTES, [])
    if not notes:
        return
    if _wanted(config):
        terminalreporter.section("crash suite notes")
        for note in notes:
            terminalreporter.write_line(note)
    else:
        terminalreporter.write_line(
            f"crash suite: {len(notes)} note{'s' if len(notes) != 1 else ''} (fuzzer figures, at-least-once "
            "replays); -v, -s or THREADLINE_TEST_NOTES=1 prints them"
        )
