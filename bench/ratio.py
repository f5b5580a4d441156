"""Throughput against LangGraph, paired: DESIGN §5's 10x target measured as the spread of same-run ratios.

    .venv/bin/python bench/ratio.py [--pairs 10] [--gc default|tuned] [--conversations 100] [--turns 10]

One run of each system says little on a shared two-core machine: either one may land in a slow minute, and
the ratio of two such runs swings by a third. This script alternates them: ``pairs`` times it runs
``throughput.py --configs sqlite-1`` (threadline, in ``.venv``) and then ``langgraph_throughput.py --savers
sqlite`` (LangGraph, in ``bench/.venv-peers``), each in a fresh process, on the same workload and with the
same collector settings, and prints one line per pair

    system=ratio store=sqlite pair=<i> threadline_turns_per_s=<t> langgraph_turns_per_s=<l> ratio=<t/l>

with ``additions_s=<s> langgraph_additions_s=<s>``: ten million Python integer additions timed by each
process right before its timed section (``workload.additions_s``; about 1.1 s on the machine that measured
11.6x, 2.2 s on one where it was 8x: threadline is interpreter-bound and LangGraph partly waits, so the
ratio shrinks on a slower CPU), and a summary

    system=ratio store=sqlite gc=<g> pairs=<n> ratio_min=<r> ratio_median=<r> ratio_max=<r>
        pairs_at_least_10x=<k> threadline_median=<t> langgraph_median=<l> additions_s=<median> loadavg=<1-min>

Exits 2 with a ``# skipped:`` line when ``bench/.venv-peers`` is missing (``bench/setup-peers`` makes it).
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from workload import machine_line

HERE = Path(__file__).resolve().parent
THREADLINE = HERE.parent / ".venv" / "bin" / "python"
PEERS = HERE / ".venv-peers" / "bin" / "python"
TARGET = 10.0
RATE = re.compile(
    r"^system=(threadline|langgraph) store=sqlite .*?turns_per_s=([0-9.]+).*?additions_s=([0-9.]+)", re.MULTILINE
)


def turns_per_s(command: list[str], system: str) -> tuple[float, float]:
    """(turns per second, additions_s) from the one result line of ``command``."""
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, check=False)
    found = [(float(rate), float(speed)) for name, rate, speed in RATE.findall(done.stdout) if name == system]
    if done.returncode != 0 or len(found) != 1:
        raise SystemExit(f"{' '.join(command)} failed (exit {done.returncode}):\n{done.stdout}\n{done.stderr}")
    return found[0]


def load_1min() -> str:
    try:
        with open("/proc/loadavg") as f:
            return f.read().split()[0]
    except OSError:
        return "unknown"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=10)
    parser.add_argument("--gc", choices=("default", "tuned"), default="default", help="see workload.tune_gc")
    parser.add_argument("--conversations", type=int, default=100)
    parser.add_argument("--turns", type=int, default=10, help="turns per conversation")
    args = parser.parse_args()
    if args.pairs < 1:
        parser.error("--pairs is at least 1")
    if not PEERS.exists():
        print(f"# skipped: no {PEERS} (run bench/setup-peers)")
        return 2
    size = ["--conversations", str(args.conversations), "--turns", str(args.turns), "--gc", args.gc]
    ours = [str(THREADLINE), str(HERE / "throughput.py"), "--configs", "sqlite-1", *size]
    theirs = [str(PEERS), str(HERE / "langgraph_throughput.py"), "--savers", "sqlite", *size]
    print(machine_line(), flush=True)
    rates: list[tuple[float, float]] = []
    speeds: list[float] = []
    for pair in range(1, args.pairs + 1):
        (t, t_speed), (lg, lg_speed) = turns_per_s(ours, "threadline"), turns_per_s(theirs, "langgraph")
        rates.append((t, lg))
        speeds.append(t_speed)
        print(
            f"system=ratio store=sqlite pair={pair} threadline_turns_per_s={t:.1f} "
            f"langgraph_turns_per_s={lg:.1f} ratio={t / lg:.2f} additions_s={t_speed:.2f} "
            f"langgraph_additions_s={lg_speed:.2f}",
            flush=True,
        )
    ratios = [t / lg for t, lg in rates]
    print(
        f"system=ratio store=sqlite gc={args.gc} pairs={len(ratios)} ratio_min={min(ratios):.2f} "
        f"ratio_median={statistics.median(ratios):.2f} ratio_max={max(ratios):.2f} "
        f"pairs_at_least_10x={sum(r >= TARGET for r in ratios)} "
        f"threadline_median={statistics.median(t for t, _ in rates):.1f} "
        f"langgraph_median={statistics.median(lg for _, lg in rates):.1f} "
        f"additions_s={statistics.median(speeds):.2f} loadavg={load_1min()}",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
