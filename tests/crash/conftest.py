"""Crash-suite plumbing: notes worth reading that are not failures (the at-least-once tool boundary)."""

from __future__ import annotations

from typing import Any

import pytest

_NOTES = pytest.StashKey[list[str]]()


@pytest.fixture
def crash_notes(request: pytest.FixtureRequest) -> list[str]:
    """A list the crash tests append observations to; printed in the terminal summary."""
    return request.config.stash.setdefault(_NOTES, [])


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    notes = config.stash.get(_NOTES, [])
    if notes:
        terminalreporter.section("crash suite notes")
        for note in notes:
            terminalreporter.write_line(note)
