"""Store operations on SQLite at two conversation lengths: rows touched and median time per call.

    .venv/bin/python bench/store_ops.py [--sizes 10 5000] [--conversations 40] [--cycles 5]

Both sizes live in the same database file, so the B-tree depth is the same for both and the only
difference is the conversation's own history. Prints one line per operation and size:

    store=sqlite op=<name> history=<n> rows_read=<r> rows_written=<w> median_us=<t>

then one ``check`` line per operation comparing the sizes. ``load_snapshot`` and
``purge_conversation`` are unbounded by design (they read, or delete, the whole conversation) and are
reported with ``bounded=false``.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

from threadline.store import AgentRuntimeStore
from threadline.store.sqlite import create_sqlite_agent_runtime_store

UNBOUNDED = {"load_snapshot", "purge_conversation"}


class Recorder:
    def __init__(self, store: AgentRuntimeStore) -> None:
        self.store = store
        self.samples: dict[str, list[tuple[int, int, int]]] = defaultdict(list)

    async def __call__(self, name: str, awaitable):  # type: ignore[no-untyped-def]
        before = self.store.metrics.get(name)
        r0, w0 = (before.rows_read, before.rows_written) if before else (0, 0)
        start = time.perf_counter_ns()
        result = await awaitable
        elapsed = time.perf_counter_ns() - start
        after = self.store.metrics[name]
        self.samples[name].append((after.rows_read - r0, after.rows_written - w0, elapsed))
        return result


def text(t: str) -> list[dict[str, str]]:
    return [{"type": "text", "text": t}]


async def fill(store: AgentRuntimeStore, cid: str, n: int) -> None:
    """``n`` settled messages of ordinary conversation (user/assistant pairs) via after-settled seeds."""
    batch = 200
    for start in range(0, n, batch):
        count = min(batch, n - start)
        inputs = [
            {
                "id": f"{cid}-h{start + i}",
                "role": "user" if (start + i) % 2 == 0 else "assistant",
                "parts": text(f"history message {start + i} " + "lorem ipsum " * 8),
            }
            for i in range(count)
        ]
        await store.seed_conversation_input(
            conversation_id=cid, seed_key=f"fill-{start}", inputs=inputs, placement="after-settled"
        )


async def cycle(rec: Recorder, cid: str, k: int) -> None:
    store = rec.store
    owner = "bench-owner"
    accepted = await rec(
        "accept_input_and_assign_run",
        store.accept_input_and_assign_run(
            conversation_id=cid, idempotency_key=f"k{k}", input={"id": f"{cid}-in{k}", "parts": text("question")}
        ),
    )
    run = accepted.run
    got = await rec(
        "acquire_run",
        store.acquire_run(conversation_id=cid, run_id=run.id, expected_revision=run.revision, owner_id=owner),
    )
    run = got.run
    op = {"kind": "model-request", "phase": "started", "operation_id": f"op{k}", "started_at": "2026-01-01T00:00:00Z"}
    run = (
        await rec(
            "record_run_operation",
            store.record_run_operation(
                conversation_id=cid,
                run_id=run.id,
                expected_revision=run.revision,
                owner_id=owner,
                fencing_token=run.fencing_token,
                operation=op,
            ),
        )
    ).run
    for i in range(3):
        run = (
            await rec(
                "checkpoint_run_assistant",
                store.checkpoint_run_assistant(
                    conversation_id=cid,
                    run_id=run.id,
                    expected_revision=run.revision,
                    owner_id=owner,
                    fencing_token=run.fencing_token,
                    parts=text("partial answer " * (i + 1)),
                ),
            )
        ).run
    run = (
        await rec(
            "request_run_interrupt",
            store.request_run_interrupt(conversation_id=cid, run_id=run.id, expected_revision=run.revision),
        )
    ).run
    run = (
        await rec(
            "recover_run",
            store.recover_run(
                conversation_id=cid, run_id=run.id, expected_revision=run.revision, action="requeue", replay_safe=True
            ),
        )
    ).run
    run = (
        await store.acquire_run(conversation_id=cid, run_id=run.id, expected_revision=run.revision, owner_id=owner)
    ).run
    await rec(
        "commit_run_terminal",
        store.commit_run_terminal(
            conversation_id=cid,
            run_id=run.id,
            expected_revision=run.revision,
            owner_id=owner,
            fencing_token=run.fencing_token,
            terminal_reason="success",
            parts=text("final answer " * 10),
        ),
    )
    await rec("load_run", store.load_run(conversation_id=cid, run_id=run.id))
    await rec("list_active_runs", store.list_active_runs(conversation_id=cid))
    await rec(
        "seed_conversation_input",
        store.seed_conversation_input(
            conversation_id=cid,
            seed_key=f"seed{k}",
            placement="after-settled",
            inputs=[
                {"id": f"{cid}-su{k}", "role": "user", "parts": text("voice command")},
                {"id": f"{cid}-sa{k}", "role": "assistant", "parts": text("done")},
            ],
        ),
    )
    # compaction of the oldest four active messages (a fixed-size range at any history length)
    page = await store.conversations.messages(cid, limit=4)
    head = await store.list_active_runs(conversation_id=cid)
    await rec(
        "replace_compacted_range",
        store.replace_compacted_range(
            conversation_id=cid,
            expected_version=head.version,
            replaced_message_ids=[m.id for m in page.items],
            summary={"id": f"{cid}-sum{k}", "role": "summary", "parts": text("summary of earlier turns")},
        ),
    )
    await rec("conversations.messages", store.conversations.messages(cid, limit=5, direction="before"))
    await rec("scan_recoverable", store.scan_recoverable(limit=100))
    await rec("load_snapshot", store.load_snapshot(conversation_id=cid))


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[10, 5000])
    parser.add_argument("--conversations", type=int, default=40)
    parser.add_argument("--cycles", type=int, default=5)
    args = parser.parse_args()
    results: dict[int, dict[str, tuple[int, int, float]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        async with create_sqlite_agent_runtime_store(filename=Path(tmp) / "bench.db") as sqlite:
            store = sqlite.store
            for size in args.sizes:
                for c in range(args.conversations):
                    await fill(store, f"h{size}-c{c}", size)
            recorders = {size: Recorder(store) for size in args.sizes}
            for k in range(args.cycles):  # interleave sizes so machine noise hits both alike
                for c in range(args.conversations):
                    for size in args.sizes:
                        await cycle(recorders[size], f"h{size}-c{c}", k)
            for size in args.sizes:
                purge = Recorder(store)
                for c in range(args.conversations):
                    await purge("purge_conversation", store.purge_conversation(conversation_id=f"h{size}-c{c}"))
                recorders[size].samples.update(purge.samples)
            for size, rec in recorders.items():
                results[size] = {}
                for name, samples in rec.samples.items():
                    reads = max(s[0] for s in samples)
                    writes = max(s[1] for s in samples)
                    median_us = statistics.median(s[2] for s in samples) / 1000
                    results[size][name] = (reads, writes, median_us)
                    extra = " bounded=false" if name in UNBOUNDED else ""
                    print(
                        f"store=sqlite op={name} history={size} rows_read={reads} rows_written={writes} "
                        f"median_us={median_us:.1f}{extra}"
                    )
    lo, hi = min(args.sizes), max(args.sizes)
    failed = False
    for name in sorted(results[lo]):
        r_lo, r_hi = results[lo][name], results[hi][name]
        rows_equal = r_lo[:2] == r_hi[:2]
        ratio = r_hi[2] / r_lo[2] if r_lo[2] else float("inf")
        ok = rows_equal and ratio <= 1.5
        if name not in UNBOUNDED:
            failed |= not ok
        print(
            f"check op={name} rows_equal={rows_equal} time_ratio={ratio:.2f} "
            f"{'ok' if ok else ('unbounded-by-design' if name in UNBOUNDED else 'FAIL')}"
        )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
