"""A seeded SIGKILL fuzzer for threadline: random kill points over startup, active runs and recovery.

    .venv/bin/python bench/crashfuzz.py [--seed S] [--points N] [--start I] [--store sqlite|postgres]
                                        [--tool direct|step|ledger-step] [--jobs J] [--json out.json]
                                        [--keep]
                                        [--dsn postgresql://…] [--show N]

Point ``i`` (``--start`` .. ``--start + --points - 1``) draws its scenario and kill points from
``random.Random(seed + i)``: 1–3 conversations of 2–6 inputs, each with an input policy (``queue``,
``inject``, ``interrupt``, ``interrupt-next``, ``supersede``), ``runs.coalesce_pending`` on or off, some
inputs asking for 1–2 tool rounds, submitted after a drawn number of the conversation's model deltas.
``bench/_crashfuzz_child.py`` (one fork server per job: it imports threadline once and forks a process per
run) runs the scenario once to count its events, again SIGKILLed at one of them (startup, a run, or a
second process recovering the crash), then a checker that recovers to completion and checks invariants
from the database. ``--start I --points 1 --keep`` reproduces one point and keeps its files (traces,
journal, effects, the SQLite files; PostgreSQL schemas are kept too).

Invariants (each violation is reported with its seed, point and a one-line reason):

- ``admitted-once``: every journaled key is stored once; a retry with the same key and input is a
  duplicate naming the journaled run (or the first admission, if the child died before it heard);
- ``terminal-answered``: after the parent's final recovery pass every run is terminal and every input
  belongs to one run that ended, or was absorbed into a run that completed;
- ``queue-order``: execution sequences are unique, and a run admitted later started earlier only if it
  was urgent (``interrupt-next``) and the one it overtook ordinary;
- ``integrity``: ``PRAGMA integrity_check`` (SQLite); settled positions unique; every terminal run that
  was not absorbed has its settled assistant; no message of an active run has a position (in the crash
  state and after recovery);
- ``live-runtime``: a run that was never killed (every reference run, and kill points past the end)
  leaves nothing it admitted queued or running once its runtime closed normally — checked without any
  recovery;
- ``hang`` / ``harness``: a process that did not end within its timeout, or failed outside the
  invariants (the fuzzer's own failures are reported, never hidden).

Effects applied more than once are figures, not violations (at-least-once is documented): each extra
application of a logical effect id is a ``requeue`` replay (a run that had applied it, again in a later
process), ``inject`` (another run of the conversation: the run that took the injected input, then the
input's own run) or ``other``.

Run it against another tree with ``PYTHONPATH=<tree>/src``: the fork servers inherit the environment and
the summary names the ``threadline`` module they imported.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import queue
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

CHILD = Path(__file__).with_name("_crashfuzz_child.py")
DEFAULT_DSN = os.environ.get("THREADLINE_TEST_POSTGRES_DSN") or "postgresql://postgres@127.0.0.1:5432/test"
INVARIANTS = ("admitted-once", "terminal-answered", "queue-order", "integrity", "live-runtime", "hang", "harness")
POINT_TIMEOUT = 400.0  # the worker's own per-process timeouts add up to less


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--points", type=int, default=100)
    parser.add_argument("--start", type=int, default=0, help="index of the first point (reproduce one with --points 1)")
    parser.add_argument("--store", choices=("sqlite", "postgres"), default="sqlite")
    parser.add_argument("--tool", choices=("direct", "step", "ledger-step"), default="direct")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--json", dest="json_out", help="write every point's result and the summary here")
    parser.add_argument("--keep", action="store_true", help="keep each point's files (and PostgreSQL schemas)")
    parser.add_argument("--dsn", default=DEFAULT_DSN)
    parser.add_argument("--show", type=int, default=40, help="violations listed in the summary")
    return parser.parse_args(argv)


class Worker:
    """One fork server (``_crashfuzz_child.py --serve``): a JSON job in, a JSON result out. It runs in a
    process group of its own, so killing the group also ends the point process it may have forked."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(CHILD), "--serve"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=str(CHILD.parent),
            start_new_session=True,
        )
        hello = self._line(POINT_TIMEOUT)
        try:
            self.hello = json.loads(hello)
        except ValueError:
            raise RuntimeError(f"the fork server said {hello[:200]!r}") from None

    def _line(self, timeout: float) -> str:
        """The server's next line; a server that says nothing for ``timeout`` seconds is killed."""
        assert self.proc.stdout is not None
        timer = threading.Timer(timeout, self.kill)
        timer.start()
        try:
            line = self.proc.stdout.readline()
        finally:
            timer.cancel()
        if not line:
            raise RuntimeError(f"the fork server ended (exit {self.proc.poll()})")
        return line

    def run(self, job: dict[str, Any]) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(job) + "\n")
        self.proc.stdin.flush()
        return json.loads(self._line(POINT_TIMEOUT))  # type: ignore[no-any-return]

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)

    def close(self) -> None:
        """Let the server finish (end of its input), or kill it."""
        with contextlib.suppress(OSError):
            if self.proc.stdin is not None:
                self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.kill()
            self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()


class Pool:
    """``--jobs`` fork servers taking points from one queue. A server that dies is replaced (its point is
    reported as a harness failure); one that cannot even start stops the run."""

    def __init__(self, args: argparse.Namespace, root: str, tag: str) -> None:
        self.args = args
        self.job = {
            "seed": args.seed,
            "store": args.store,
            "tool": args.tool,
            "dsn": args.dsn,
            "root": root,
            "keep": args.keep,
            "tag": tag,
        }
        self.points: queue.SimpleQueue[int] = queue.SimpleQueue()
        for point in range(args.start, args.start + args.points):
            self.points.put(point)
        self.results: list[dict[str, Any]] = []
        self.modules: set[str] = set()
        self.workers: list[Worker] = []
        self.stopping = False
        self.lock = threading.Lock()
        self.started = time.monotonic()

    def _worker(self) -> Worker:
        worker = Worker()
        with self.lock:
            self.workers.append(worker)
            self.modules.add(worker.hello["threadline"])
        return worker

    def _serve(self, worker: Worker | None) -> None:
        while not self.stopping:
            try:
                point = self.points.get_nowait()
            except queue.Empty:
                break
            try:
                worker = worker or self._worker()
                result = worker.run({**self.job, "point": point})
            except Exception as error:
                if worker is not None:
                    worker.kill()
                    worker.close()
                worker = None
                failure = {"invariant": "harness", "reason": f"fork server: {error}"}
                result = {"seed": self.args.seed, "point": point, "figures": {}, "notes": [], "violations": [failure]}
            with self.lock:
                self.results.append(result)
                if len(self.results) % 50 == 0:
                    elapsed = time.monotonic() - self.started
                    print(f"# {len(self.results)}/{self.args.points} points, {elapsed:.0f} s", file=sys.stderr)
        if worker is not None:
            worker.close()

    def run(self) -> list[dict[str, Any]]:
        try:
            threads = [
                threading.Thread(target=self._serve, args=(self._worker(),), daemon=True)
                for _ in range(max(1, self.args.jobs))
            ]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
        finally:  # also when interrupted: no fork server (nor what it forked) outlives this process
            self.stopping = True
            for worker in self.workers:
                worker.kill()
        return sorted(self.results, key=lambda r: r["point"])


def summarize(results: list[dict[str, Any]], seconds: float) -> dict[str, Any]:
    """The figures of the summary table."""
    phases: Counter[str] = Counter()
    references = 0
    first: Counter[str] = Counter()
    second: Counter[str] = Counter()
    violations: Counter[str] = Counter()
    affected: Counter[str] = Counter()
    extra: Counter[str] = Counter()
    applied = distinct = missing = uncertain = final_pass = 0
    for result in results:
        phases[result.get("plan", {}).get("phase", "none")] += 1
        references += "reference" in result
        first[result.get("first", {}).get("status", "not run")] += 1
        if "second" in result:
            second[result["second"]["status"]] += 1
        kinds = [v["invariant"] for v in result["violations"]]
        violations.update(kinds)
        affected.update(set(kinds))
        figures = result.get("figures", {})
        applied += figures.get("effects_applied", 0)
        distinct += figures.get("effects_distinct", 0)
        missing += figures.get("results_without_effect", 0)
        uncertain += figures.get("step_uncertain", 0)
        final_pass += figures.get("final_pass_runs", 0) > 0
        extra.update(figures.get("effects_extra", {}))
    return {
        "points": len(results),
        "phases": dict(phases),
        "reference_runs": references,
        "first_process": dict(first),
        "second_process": dict(second),
        "violations": {k: violations[k] for k in INVARIANTS},
        "points_with_violations": {k: affected[k] for k in INVARIANTS},
        "effects_applied": applied,
        "effects_distinct": distinct,
        "effects_extra": {k: extra[k] for k in ("requeue", "inject", "other")},
        "results_without_effect": missing,
        "step_uncertain": uncertain,
        "final_pass_found_runs": final_pass,
        "classified": sum(1 for r in results if "effects_extra" in r.get("figures", {})),
        "seconds": round(seconds, 1),
    }


def table(args: argparse.Namespace, summary: dict[str, Any], module: str) -> str:
    first, second, phases = summary["first_process"], summary["second_process"], summary["phases"]
    extra = summary["effects_extra"]
    rows = [
        ("points run", f"{summary['points']} (points {args.start}..{args.start + args.points - 1})"),
        (
            "  phase startup / run / recovery",
            f"{phases.get('startup', 0)} / {phases.get('run', 0)} / {phases.get('recovery', 0)}",
        ),
        ("  reference runs finished (DONE, live-runtime checked)", str(summary["reference_runs"])),
        ("  first process killed / finished (DONE)", f"{first.get('killed', 0)} / {first.get('finished', 0)}"),
        ("  second process killed / finished", f"{second.get('killed', 0)} / {second.get('finished', 0)}"),
    ]
    rows += [
        (f"violations: {k}", f"{n} (points: {summary['points_with_violations'][k]})")
        for k, n in summary["violations"].items()
    ]
    rows += [
        ("effects applied (distinct logical ids)", f"{summary['effects_applied']} ({summary['effects_distinct']})"),
        ("effects applied more than once (extra applications)", str(sum(extra.values()))),
        ("  requeue replay / inject / other", f"{extra['requeue']} / {extra['inject']} / {extra['other']}"),
        ("tool results without an applied effect", str(summary["results_without_effect"])),
        ("step results uncertain (intent, no proof)", str(summary["step_uncertain"])),
        ("points whose final recovery pass still found runs", str(summary["final_pass_found_runs"])),
        ("seconds", str(summary["seconds"])),
    ]
    width = max(len(name) for name, _ in rows)
    head = [
        f"crashfuzz seed={args.seed} points={args.points} start={args.start} store={args.store} "
        f"tool={args.tool} jobs={args.jobs}",
        f"threadline: {module}",
        "",
        f"| {'figure'.ljust(width)} | value",
        f"|{'-' * (width + 2)}|------",
    ]
    return "\n".join(head + [f"| {name.ljust(width)} | {value}" for name, value in rows])


def violation_lines(results: list[dict[str, Any]], limit: int) -> list[str]:
    lines = [
        f"seed={r['seed']} point={r['point']} {v['invariant']}: {v['reason'].splitlines()[0] if v['reason'] else ''}"
        for r in results
        for v in r["violations"]
    ]
    if len(lines) > limit:
        lines = [*lines[:limit], f"... {len(lines) - limit} more (see --json)"]
    return lines


def postgres_ready(dsn: str) -> str | None:
    try:
        import psycopg

        with psycopg.connect(dsn, connect_timeout=3) as conn:
            conn.execute("SELECT 1")
    except Exception as error:
        return f"PostgreSQL not reachable at {dsn}: {error}"
    return None


def drop_leftover_schemas(dsn: str, tag: str) -> None:
    """Schemas a checker that failed could not drop (every one of this run starts with ``tag``)."""
    import psycopg

    with psycopg.connect(dsn, autocommit=True, connect_timeout=5) as conn:
        names = [n for (n,) in conn.execute("SELECT nspname FROM pg_namespace WHERE nspname LIKE %s", [f"{tag}%"])]
        for name in names:
            conn.execute(f'DROP SCHEMA IF EXISTS "{name}" CASCADE')


def _terminate(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)  # unwinds through the cleanup in Pool.run and main


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.store == "postgres" and (problem := postgres_ready(args.dsn)):
        print(f"# skipped: {problem}", flush=True)
        return 2
    tag = f"cfz_{secrets.token_hex(4)}"
    root = tempfile.mkdtemp(prefix="crashfuzz-")
    started = time.monotonic()
    pool = Pool(args, root, tag)
    signal.signal(signal.SIGTERM, _terminate)
    try:
        results = pool.run()
        module = ", ".join(sorted(pool.modules))
    except RuntimeError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    finally:
        if args.store == "postgres" and not args.keep:
            drop_leftover_schemas(args.dsn, tag)
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    summary = summarize(results, time.monotonic() - started)
    print(table(args, summary, module))
    lines = violation_lines(results, args.show)
    print("\nviolations:" if lines else "\nno violations")
    for line in lines:
        print("  " + line)
    if args.keep:
        print(f"\nfiles kept under {root}" + (f" (schemas {tag}_*)" if args.store == "postgres" else ""))
    if args.json_out:
        out = {"args": vars(args), "threadline": module, "summary": summary, "points": results}
        Path(args.json_out).write_text(json.dumps(out, indent=1, default=str))
    return 1 if any(summary["violations"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
