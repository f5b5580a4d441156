"""The SQLite relay: processes on one machine that share a SQLite store exchange frames through a relay
table in a file beside the store's (``<store file>-live``), read by polling.

Why a file of its own: the store's connections never wait for a lock (``busy_timeout=0``: a write that
meets another connection's write lock fails at once and is retried by the runtime). Relay writes in the
store's file would take that lock dozens of times a second during a stream and make the store's own
writes fail and retry; in a file of their own they never meet. The relay file holds nothing durable:
deleting it (with no process running) loses nothing but live frames.

Readers poll ``PRAGMA data_version`` (it changes when another connection commits; a cheap read) every
``poll_interval`` seconds and read the new rows only then. Row ids come from ``AUTOINCREMENT`` and SQLite
commits one writer at a time, so readers see ids without holes except where rows were pruned: a reader
whose next row is not ``last + 1`` (or whose table's sequence moved past its last row with no row left)
lost rows to pruning and heals.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sqlite3
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from ..errors import AgentStoreUnavailableError
from .frames import OutgoingFrame, RelayGap, Sink, decode_body

T = TypeVar("T")
_log = logging.getLogger("threadline.live")

READ_BATCH = 256
"""Relay rows a poll reads at most (it reads again at once when it got that many)."""
_BUSY_TIMEOUT_MS = 2_000  # relay writers of several processes wait for each other this long at most

_CREATE = (
    "CREATE TABLE IF NOT EXISTS live_relay ("
    "id INTEGER PRIMARY KEY AUTOINCREMENT, origin TEXT NOT NULL, created_at REAL NOT NULL, body TEXT NOT NULL)"
)


class _Poller:
    """One subscription's position: the last row id read and the data version it was read at."""

    __slots__ = ("last", "seen")

    def __init__(self, last: int) -> None:
        self.last = last
        self.seen: int | None = None


class SqliteLiveBackend:
    """One connection to the relay file, used from one thread of its own (publisher and poller alike)."""

    inline_limit: int | None = None

    def __init__(self, store_filename: str, *, max_rows: int, max_age: float, poll_interval: float) -> None:
        if store_filename in ("", ":memory:") or store_filename.startswith("file::memory:"):
            raise AgentStoreUnavailableError(
                "an in-memory SQLite store lives in one process: live delivery across processes needs a file"
            )
        self.path = f"{store_filename}-live"
        self.where = self.path
        self.max_rows = max_rows
        self.max_age = max_age
        self.poll_interval = poll_interval
        self._executor: ThreadPoolExecutor | None = None
        self._conn: sqlite3.Connection | None = None
        self._pollers: set[_Poller] = set()  # touched on the relay's thread only

    async def _call(self, fn: Callable[..., T], *args: Any) -> T:
        if self._executor is None:
            raise AgentStoreUnavailableError(f"the live relay at {self.path} is closed")
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    # ----------------------------------------------------------------------------------- lifecycle

    async def open(self) -> None:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="threadline-live")
        await self._call(self._open)

    def _open(self) -> None:
        if self._conn is not None:
            return
        try:
            conn = sqlite3.connect(self.path, timeout=_BUSY_TIMEOUT_MS / 1000, isolation_level=None)
            conn.execute(f"PRAGMA busy_timeout = {_BUSY_TIMEOUT_MS}")
            conn.execute("PRAGMA journal_mode = WAL")
            conn.execute("PRAGMA synchronous = NORMAL")
            conn.execute(_CREATE)
        except sqlite3.Error as error:
            raise AgentStoreUnavailableError(f"cannot open the live relay at {self.path}: {error}") from error
        self._conn = conn

    async def aclose(self) -> None:
        executor, self._executor = self._executor, None
        if executor is None:
            return
        with contextlib.suppress(Exception):
            await asyncio.get_running_loop().run_in_executor(executor, self._close)
        executor.shutdown(wait=False)

    def _close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()

    def _connection(self) -> sqlite3.Connection:
        if self._conn is None:
            self._open()
        assert self._conn is not None
        return self._conn

    # ----------------------------------------------------------------------------------- publish

    async def send(self, origin: str, frames: list[OutgoingFrame]) -> int:
        """Insert ``frames`` in order in one transaction; returns how many rows were written."""
        return await self._call(self._send, origin, frames)

    def _send(self, origin: str, frames: list[OutgoingFrame]) -> int:
        conn = self._connection()
        now = time.time()
        conn.execute("BEGIN IMMEDIATE")
        try:
            conn.executemany(
                "INSERT INTO live_relay (origin, created_at, body) VALUES (?, ?, ?)",
                [(origin, now, frame.body) for frame in frames],
            )
            top = int(conn.execute("SELECT seq FROM sqlite_sequence WHERE name = 'live_relay'").fetchone()[0])
            conn.execute("COMMIT")
        except BaseException:
            with contextlib.suppress(sqlite3.Error):
                conn.execute("ROLLBACK")
            raise
        # our own rows do not change this connection's data_version, so pollers would read them only with
        # the next foreign row: a poller right before them steps over them now (the ids of one
        # transaction are consecutive), so their pruning later never looks like a gap
        first = top - len(frames) + 1
        for poller in self._pollers:
            if poller.last == first - 1:
                poller.last = top
        return len(frames)

    async def prune(self) -> int:
        """Delete rows beyond ``max_rows`` (the oldest) or older than ``max_age`` seconds."""
        return await self._call(self._prune)

    def _prune(self) -> int:
        conn = self._connection()
        cursor = conn.execute(
            "DELETE FROM live_relay WHERE created_at < ? "
            "OR id <= (SELECT seq FROM sqlite_sequence WHERE name = 'live_relay') - ?",
            (time.time() - self.max_age, self.max_rows),
        )
        return cursor.rowcount

    # --------------------------------------------------------------------------------- subscribe

    def _position(self) -> int:
        row = self._connection().execute("SELECT seq FROM sqlite_sequence WHERE name = 'live_relay'").fetchone()
        return int(row[0]) if row else 0

    def _read(self, poller: _Poller) -> tuple[list[tuple[int, str, str]], bool]:
        """Rows after the poller's last (at most :data:`READ_BATCH`) and whether rows were lost before
        them; advances the poller. One read transaction, so the rows and the table's sequence agree."""
        conn = self._connection()
        version = int(conn.execute("PRAGMA data_version").fetchone()[0])
        if version == poller.seen:
            return [], False
        last = poller.last
        conn.execute("BEGIN")
        try:
            rows = conn.execute(
                "SELECT id, origin, body FROM live_relay WHERE id > ? ORDER BY id LIMIT ?", (last, READ_BATCH)
            ).fetchall()
            if rows:
                gap = rows[0][0] != last + 1
                poller.last = rows[-1][0]
            else:
                row = conn.execute("SELECT seq FROM sqlite_sequence WHERE name = 'live_relay'").fetchone()
                top = int(row[0]) if row else 0
                gap = top > last
                poller.last = max(last, top)
        finally:
            conn.execute("COMMIT")
        poller.seen = None if len(rows) >= READ_BATCH else version  # a full batch: read again at once
        return rows, gap

    def _add_poller(self) -> _Poller:
        poller = _Poller(self._position())
        self._pollers.add(poller)
        return poller

    async def listen(self, sink: Sink, *, own_origin: str) -> Callable[[], Awaitable[None]]:
        """Poll for frames of other origins from now on; hand each (decoded) or a :class:`RelayGap` to
        ``sink`` in order. Returns the function that stops polling."""
        poller = await self._call(self._add_poller)

        async def poll() -> None:
            failing = False
            while True:
                try:
                    rows, gap = await self._call(self._read, poller)
                    failing = False
                except AgentStoreUnavailableError:
                    return  # closed
                except Exception:
                    if not failing:
                        _log.warning("reading the live relay at %s failed; trying again", self.path, exc_info=True)
                    failing, poller.seen = True, None
                    await asyncio.sleep(min(1.0, self.poll_interval * 10))
                    continue
                if gap:
                    sink(RelayGap())
                for row_id, origin, body in rows:
                    if origin == own_origin:
                        continue
                    try:
                        sink(decode_body(body))
                    except Exception:
                        _log.warning("malformed live relay row %s in %s skipped", row_id, self.path, exc_info=True)
                        sink(RelayGap())
                if poller.seen is not None:
                    await asyncio.sleep(self.poll_interval)

        task = asyncio.ensure_future(poll())

        async def stop() -> None:
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
            self._pollers.discard(poller)

        return stop

    async def fetch(self, row: int) -> str | None:  # pragma: no cover - SQLite frames are never pointers
        return None
