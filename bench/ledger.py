"""The event ledger's costs on SQLite: request record size, export/import speed, read_events page latency.

    .venv/bin/python bench/ledger.py [--turns 1000 5000] [--events 1000000] [--page 100]

- ``request_bytes`` / ``request_digests``: the JSON size of a ``provider/request`` payload (step 1 of a
  tool turn) and the number of digests it holds when the conversation holds 40 and 2,000 messages. Its
  settled prefix is a chained digest and a count, so the digests are the same in number (DESIGN §5); the
  bytes differ only by the decimal digits of the count (``"count":39`` against ``"count":1999``).
  stitchkit's lists every message digest and grows with the conversation.
- ``export_mb_s`` / ``import_mb_s``: one conversation of real turns (the workload of ``bench/turns.py``: a
  tool call, its result and a ~200-character answer per turn) exported from SQLite and imported into a
  fresh SQLite file (import validates the whole archive first: canonical form, digest, replay of every
  transition through the reducer against the snapshot, provider records), when it holds each of
  ``--turns`` turns (one line each: the speed per MB should not fall as the archive grows); ``_cpu_``
  figures divide by the process's CPU time instead of the wall clock (steadier on a shared machine).
- ``read_events_ms``: the median latency of one ``read_events`` page of ``--page`` events at seq 10 and at
  seq 1,000,000, in a conversation whose journal of ``--events`` events was bulk-loaded into the table
  (as the store writes them: one row per event, indexed by (conversation, seq)).

Every line ends with ``additions_s=`` (``workload.additions_s``: ten million Python integer additions timed
in this process right before the figure; a machine twice as slow there gives figures about twice as slow).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sqlite3
import statistics
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import turns as T  # the turn workload and its runtime
from workload import additions_s, machine_line

from threadline import create_sqlite_agent_runtime_store
from threadline.ledger.events import AgentStoreEvent
from threadline.store.codec import encode, pack


async def grow(path: Path, turns: int, at: Any = None) -> tuple[dict[int, tuple[int, int]], int]:
    """Run ``turns`` turns; the step-1 request size when the conversation held 40 and 2,000 messages.
    ``at(turns_done, store)`` is awaited after every turn (the transfer figures)."""
    sqlite = create_sqlite_agent_runtime_store(filename=path)
    conv = T.Conversation(T.make_runtime(sqlite.store), "ledger-bench")
    sizes: dict[int, tuple[int, int]] = {}
    for done in range(1, turns + 1):
        held = conv.messages
        await conv.turn()
        if held in (40, 2000):
            tail: dict = await last_request(sqlite.store, conv.cid)  # type: ignore[assignment]
            digests = len(tail["message_shas"]) + len(tail["prefix"]["added"]) + 2  # + prefix, instructions
            sizes[held] = (len(json.dumps(tail, separators=(",", ":"))), digests)
        if at is not None:
            await at(done, sqlite.store)
    await conv.runtime.close()
    events = 0
    seq: int | None = 1
    while seq is not None:
        page = await sqlite.store.read_events(conversation_id=conv.cid, from_seq=seq, limit=10_000)
        events += len(page.items)
        seq = page.next_seq
    await sqlite.close()
    return sizes, events


async def all_events(store: Any) -> list[Any]:
    out: list[Any] = []
    seq: int | None = 1
    while seq is not None:
        page = await store.read_events(conversation_id="ledger-bench", from_seq=seq, limit=10_000)
        out += page.items
        seq = page.next_seq
    return out


async def last_request(store: object, cid: str) -> object:
    """The newest provider/request payload (the journal read a page at a time)."""
    seq = 1
    found = None
    while True:
        page = await store.read_events(conversation_id=cid, from_seq=seq, limit=10_000)  # type: ignore[attr-defined]
        for event in page.items:
            if event.kind == "provider/request":
                found = event.payload
        if page.next_seq is None:
            return found
        seq = page.next_seq


async def transfer(store: Any, target_path: Path) -> tuple[float, float, float, float, int]:
    """Export the conversation from ``store``, import it into a fresh SQLite file: export and import MB/s by
    the wall clock and by this process's CPU time (its threads' too: steadier on a shared machine), and
    the archive's bytes. The imported copy exports the same bytes."""
    start, cpu = time.perf_counter(), time.process_time()
    data = await store.export_conversation("ledger-bench")
    exported, exported_cpu = time.perf_counter() - start, time.process_time() - cpu
    async with create_sqlite_agent_runtime_store(filename=target_path) as target:
        start, cpu = time.perf_counter(), time.process_time()
        await target.store.import_conversation(data)
        imported, imported_cpu = time.perf_counter() - start, time.process_time() - cpu
        assert await target.store.export_conversation("ledger-bench") == data
    mb = len(data) / 1e6
    return mb / exported, mb / imported, mb / exported_cpu, mb / imported_cpu, len(data)


def bulk_load(path: Path, cid: str, events: int) -> None:
    """A journal of ``events`` small events, written straight into the table the store reads."""
    conn = sqlite3.connect(path)
    at = datetime(2030, 1, 1, tzinfo=UTC)

    def rows():  # type: ignore[no-untyped-def]
        for seq in range(1, events + 1):
            event = AgentStoreEvent(
                event_id=f"evt_{seq:032x}",
                conversation_id=cid,
                seq=seq,
                kind="state/set",
                occurred_at=at,
                payload={"name": "counter", "value": seq},
            )
            yield (cid, seq, event.kind, None, pack(encode(event)))

    with conn:
        conn.executemany(
            "INSERT INTO threadline_events (conversation_id, seq, kind, digest, body) VALUES (?, ?, ?, ?, ?)", rows()
        )
        (body,) = conn.execute("SELECT body FROM threadline_conversations WHERE conversation_id = ?", (cid,)).fetchone()
        head = json.loads(body)
        head["event_seq"] = events
        conn.execute("UPDATE threadline_conversations SET body = ? WHERE conversation_id = ?", (json.dumps(head), cid))
    conn.close()


async def page_latency(path: Path, cid: str, page: int) -> dict[int, float]:
    """Median latency of one page at seq 10 and of the page that ends at seq 1,000,000."""
    out = {}
    async with create_sqlite_agent_runtime_store(filename=path) as sqlite:
        for at in (10, 1_000_000 - page + 1):  # a page starting at seq 10, and the page ending at 1,000,000
            times = []
            for _ in range(50):
                start = time.perf_counter()
                got = await sqlite.store.read_events(conversation_id=cid, from_seq=at, limit=page)
                times.append(time.perf_counter() - start)
                assert len(got.items) == page and got.items[0].seq == at
            out[at] = statistics.median(times) * 1000
    return out


async def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--turns", type=int, nargs="+", default=[1000, 5000])
    parser.add_argument("--events", type=int, default=1_000_000)
    parser.add_argument("--page", type=int, default=100)
    args = parser.parse_args()
    print(machine_line(), flush=True)
    with tempfile.TemporaryDirectory() as directory:
        tmp = Path(directory)
        path = tmp / "ledger.db"
        wanted = set(args.turns)

        async def at(done: int, store: Any) -> None:
            if done not in wanted:
                return
            count = len(await all_events(store))
            speed = additions_s()
            export_mb_s, import_mb_s, export_cpu, import_cpu, size = await transfer(store, tmp / f"imported-{done}.db")
            print(
                f"system=threadline store=sqlite figure=transfer turns={done} events={count} archive_bytes={size} "
                f"export_mb_s={export_mb_s:.1f} import_mb_s={import_mb_s:.1f} export_cpu_mb_s={export_cpu:.1f} "
                f"import_cpu_mb_s={import_cpu:.1f} additions_s={speed:.2f}",
                flush=True,
            )

        speed = additions_s()
        sizes, _ = await grow(path, max(*args.turns, 1001), at)
        (bytes_40, digests_40), (bytes_2000, digests_2000) = sizes[40], sizes[2000]
        print(
            f"system=threadline store=sqlite figure=provider_request request_bytes_40={bytes_40} "
            f"request_bytes_2000={bytes_2000} request_digests_40={digests_40} request_digests_2000={digests_2000} "
            f"additions_s={speed:.2f}",
            flush=True,
        )
        journal = tmp / "journal.db"
        async with create_sqlite_agent_runtime_store(filename=journal) as sqlite:
            await sqlite.store.append_event(conversation_id="long", kind="state/set", payload={"name": "counter"})
        conn = sqlite3.connect(journal)
        with conn:
            conn.execute("DELETE FROM threadline_events")
        conn.close()
        bulk_load(journal, "long", args.events)
        speed = additions_s()
        latency = await page_latency(journal, "long", args.page)
        print(
            f"system=threadline store=sqlite figure=read_events events={args.events} page={args.page} "
            f"read_events_ms_seq10={latency[10]:.3f} "
            f"read_events_ms_seq1000000={latency[1_000_000 - args.page + 1]:.3f} "
            f"additions_s={speed:.2f}",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(asyncio.run(main()))
