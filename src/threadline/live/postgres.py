"""The PostgreSQL relay: frames travel as NOTIFY payloads on a channel of the relay's own; a frame larger
than a payload may be (:data:`~threadline.live.frames.NOTIFY_PAYLOAD_LIMIT`) is written to the relay table
``<schema>.live_relay`` and its row id notified instead.

Connections: listening reuses the store driver's (:meth:`PostgresStoreDriver.listen
<threadline.store.postgres.PostgresStoreDriver.listen>` on the relay's channel: one dedicated connection,
replaced with back-off when it drops, followed by a ``resync`` note — frames sent meanwhile were missed,
so the subscriber heals). Publishing uses one more dedicated connection (never a pooled one: the store's
operations never wait behind the relay), and reading relay rows a third, opened on first need.

A publisher's frames go out in order on its one connection, each NOTIFY its own transaction, so listeners
receive them in that order; a table frame is inserted and notified in one statement. The table is not
part of the store's layout (its version does not change); it is created on first use, idempotently, under
an advisory lock so processes starting together agree.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import psycopg
from psycopg import sql

from ..errors import AgentStoreUnavailableError
from ..store.postgres import PostgresStoreDriver
from .frames import NOTIFY_PAYLOAD_LIMIT, OutgoingFrame, RelayGap, Sink, decode_frame, pointer_prefix

_log = logging.getLogger("threadline.live")
_MAX_IDENTIFIER = 63


def live_channel(schema: str) -> str:
    """The NOTIFY channel of the live relay of a store in ``schema`` (distinct from the store's own)."""
    name = f"threadline_live_{schema}"
    if len(name.encode()) <= _MAX_IDENTIFIER:
        return name
    return "threadline_live_" + hashlib.sha256(schema.encode()).hexdigest()[:32]


class PostgresLiveBackend:
    inline_limit: int | None = NOTIFY_PAYLOAD_LIMIT

    def __init__(self, driver: PostgresStoreDriver, *, max_rows: int, max_age: float) -> None:
        self.driver = driver
        self.schema = driver.schema
        self.channel = live_channel(driver.schema)
        self.where = f"{driver.where} schema {driver.schema!r}"
        self.max_rows = max_rows
        self.max_age = max_age
        self._table = sql.Identifier(driver.schema, "live_relay")
        self._send_conn: psycopg.AsyncConnection[Any] | None = None
        self._read_conn: psycopg.AsyncConnection[Any] | None = None
        self._opened = False
        self._closed = False

    # ----------------------------------------------------------------------------------- lifecycle

    async def open(self) -> None:
        if self._opened:
            return
        conn = await self.driver.connect(what="open the live relay")
        try:
            async with conn.transaction():
                await conn.execute(
                    "SELECT pg_advisory_xact_lock(hashtextextended(%s, 0))", (f"threadline-live:{self.schema}",)
                )
                await conn.execute(sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(sql.Identifier(self.schema)))
                await conn.execute(
                    sql.SQL(
                        "CREATE TABLE IF NOT EXISTS {} (id bigserial PRIMARY KEY, "
                        "created_at timestamptz NOT NULL DEFAULT clock_timestamp(), body text NOT NULL)"
                    ).format(self._table)
                )
        except psycopg.Error as error:
            raise AgentStoreUnavailableError(f"cannot create the live relay table at {self.where}: {error}") from error
        finally:
            await conn.close()
        self._opened = True

    async def aclose(self) -> None:
        self._closed = True
        for conn in (self._send_conn, self._read_conn):
            if conn is not None:
                with contextlib.suppress(Exception):
                    await conn.close()
        self._send_conn = self._read_conn = None

    async def _connection(self, attribute: str) -> psycopg.AsyncConnection[Any]:
        if self._closed:
            raise AgentStoreUnavailableError(f"the live relay at {self.where} is closed")
        conn = getattr(self, attribute)
        if conn is None or conn.closed:
            conn = await self.driver.connect(what="reach the live relay")
            setattr(self, attribute, conn)
        return conn  # type: ignore[no-any-return]

    async def _drop(self, attribute: str) -> None:
        conn = getattr(self, attribute)
        setattr(self, attribute, None)
        if conn is not None:
            with contextlib.suppress(Exception):
                await conn.close()

    # ----------------------------------------------------------------------------------- publish

    async def send(self, origin: str, frames: list[OutgoingFrame]) -> int:
        """Notify ``frames`` in order, in one round trip (pipeline); returns how many went through the
        table. A failure closes the connection (the next send opens another) and propagates."""
        conn = await self._connection("_send_conn")
        rows = 0
        try:
            async with conn.pipeline():
                for frame in frames:
                    if frame.inline:
                        await conn.execute("SELECT pg_notify(%s, %s)", (self.channel, frame.body))
                    else:
                        rows += 1
                        await conn.execute(
                            sql.SQL(
                                "WITH r AS (INSERT INTO {} (body) VALUES (%s) RETURNING id) "
                                "SELECT pg_notify(%s, %s || r.id || '}}') FROM r"
                            ).format(self._table),
                            (frame.body, self.channel, pointer_prefix(frame, origin)),
                        )
        except BaseException:
            await self._drop("_send_conn")
            raise
        return rows

    async def prune(self) -> int:
        """Delete relay rows beyond ``max_rows`` (the oldest) or older than ``max_age`` seconds."""
        conn = await self._connection("_send_conn")
        try:
            cursor = await conn.execute(
                sql.SQL(
                    "DELETE FROM {t} WHERE created_at < clock_timestamp() - make_interval(secs => %s) "
                    "OR id <= (SELECT max(id) FROM {t}) - %s"
                ).format(t=self._table),
                (self.max_age, self.max_rows),
            )
        except BaseException:
            await self._drop("_send_conn")
            raise
        return cursor.rowcount

    # --------------------------------------------------------------------------------- subscribe

    async def fetch(self, row: int) -> str | None:
        """The body of relay row ``row``, or None when it was pruned."""
        conn = await self._connection("_read_conn")
        try:
            cursor = await conn.execute(sql.SQL("SELECT body FROM {} WHERE id = %s").format(self._table), (row,))
            found = await cursor.fetchone()
        except BaseException:
            await self._drop("_read_conn")
            raise
        return found[0] if found else None

    async def listen(self, sink: Sink, *, own_origin: str) -> Callable[[], Awaitable[None]]:
        """Receive frames of other origins from now on (LISTEN is in place when this returns); a dropped
        connection comes back with back-off and reports a :class:`RelayGap`."""

        def on_note(note: dict[str, Any]) -> None:
            if note.get("event") == "resync":  # the driver listened again: what was sent meanwhile is gone
                sink(RelayGap())
                return
            if note.get("o") == own_origin:
                return
            try:
                frame = decode_frame(note)
            except Exception:
                _log.warning("a malformed live relay notification was skipped", exc_info=True)
                sink(RelayGap())
                return
            sink(frame)

        return await self.driver.listen(on_note, channel=self.channel)
