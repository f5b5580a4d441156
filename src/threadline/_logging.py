"""Logging for failures that can repeat at the rate of events (a publisher that raises on every delta).

threadline logs through stdlib :mod:`logging` under ``threadline.*`` and installs no handler: the
application decides where lines go (``logging.basicConfig()`` shows warnings and errors on stderr).
"""

from __future__ import annotations

import logging
import time

__all__ = ("ThrottledLog",)


class ThrottledLog:
    """The first failure is logged with its traceback; later ones at most once per ``interval`` seconds,
    counting those that were not logged. Nothing is logged while nothing fails."""

    def __init__(self, logger: logging.Logger, interval: float = 60.0) -> None:
        self.logger = logger
        self.interval = interval
        self.failures = 0
        self._unreported = 0
        self._last: float | None = None

    def failed(self, message: str, *args: object, error: BaseException) -> None:
        self.failures += 1
        now = time.monotonic()
        if self._last is not None and now - self._last < self.interval:
            self._unreported += 1
            return
        first = self._last is None
        self._last = now
        if first:
            self.logger.error(message, *args, exc_info=error)
            return
        skipped, self._unreported = self._unreported, 0
        self.logger.error(
            message + " (again; %d more such failures since the last line)",
            *args,
            skipped,
            exc_info=error,
        )
