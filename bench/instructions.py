"""Instructions per turn: ``throughput.py``'s SQLite workload counted by callgrind, not timed.

    .venv/bin/python bench/instructions.py [--system threadline|langgraph] [--conversations 40] [--turns 5]
                                           [--gc default|tuned] [--keep FILE]

Wall-clock figures on a small shared machine swing by up to 1.5x between runs minutes apart, which hides
a 5% change. Instructions do not: this script runs ``bench/throughput.py --configs sqlite-1`` under
``valgrind --tool=callgrind`` with instrumentation switched on only for the timed section (the batch of
turns; start-up, warm-up and shutdown are not counted) and prints

    system=threadline store=sqlite conversations=<c> turns=<n> instructions=<i> instructions_per_turn=<i/n>
        gc=<mode> model=minimal

The same code, inputs and ``PYTHONHASHSEED`` give the same count to within a few thousandths of a per
cent, whatever else the machine is doing, so two trees can be compared with one run each (point
``PYTHONPATH`` at the other tree's ``src``). The run is about 50 times slower than a native one (about a
minute and a half with the defaults). What it does not see: waiting, cache misses, the GIL handed between
threads, and the cost of an instruction (``fsync`` is one instruction). With ``--gc default`` a single
full collection more or less moves the count by about 1% per 200 turns; ``--gc tuned`` takes that out.

``--system langgraph`` counts ``bench/langgraph_throughput.py --savers sqlite`` the same way (its
``run_batch``), in ``bench/.venv-peers`` (``bench/setup-peers``; skipped with a ``# skipped:`` line when that
environment is missing): the CPU work of both systems on the same workload, free of the machine's mood.
(LangGraph's cost per turn grows with the conversation, so compare at the same ``--turns``.)

``--keep FILE`` keeps callgrind's output (``callgrind_annotate FILE`` shows where the instructions went:
the interpreter, pydantic-core, SQLite, libc).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
PEERS = HERE / ".venv-peers" / "bin" / "python"


def child(system: str, argv: list[str]) -> int:
    """Inside valgrind: run the system's throughput script with callgrind instrumenting only its
    ``run_batch`` (the timed section)."""
    sys.path.insert(0, str(HERE))
    if system == "langgraph":
        import langgraph_throughput as script
    else:
        import throughput as script  # type: ignore[no-redef]

    batch = script.run_batch

    def instrument(state: str) -> None:
        subprocess.run(["callgrind_control", "-i", state, str(os.getpid())], check=True, capture_output=True)

    async def counted(*args, **kwargs):  # type: ignore[no-untyped-def]
        instrument("on")
        try:
            return await batch(*args, **kwargs)
        finally:
            instrument("off")

    script.run_batch = counted
    sys.argv = [script.__file__, *argv]
    return script.main()


def main() -> int:
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        return child(sys.argv[2], sys.argv[3:])
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--system", choices=("threadline", "langgraph"), default="threadline")
    parser.add_argument("--conversations", type=int, default=40)
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--gc", choices=("default", "tuned"), default="tuned")
    parser.add_argument("--keep", type=Path, default=None, help="keep callgrind's output file here")
    args = parser.parse_args()
    for tool in ("valgrind", "callgrind_control"):
        if shutil.which(tool) is None:
            print(f"# skipped: {tool} is not installed (Debian package valgrind)")
            return 0
    # no additions_s timing: ten million additions take minutes under valgrind, and counts need no speed
    python, workload = sys.executable, ["--configs", "sqlite-1", "--no-additions"]
    if args.system == "langgraph":
        python, workload = str(PEERS), ["--savers", "sqlite", "--no-additions"]
        if not PEERS.exists():
            print(f"# skipped: no {PEERS} (run bench/setup-peers)")
            return 0
    with tempfile.TemporaryDirectory() as tmp:
        out = args.keep or Path(tmp) / "callgrind.out"
        command = [
            "valgrind",
            "--tool=callgrind",
            "--instr-atstart=no",
            f"--callgrind-out-file={out}",
            python,
            __file__,
            "--child",
            args.system,
            *workload,
            "--conversations",
            str(args.conversations),
            "--turns",
            str(args.turns),
            "--gc",
            args.gc,
        ]
        env = {**os.environ, "PYTHONHASHSEED": os.environ.get("PYTHONHASHSEED", "0")}
        done = subprocess.run(command, env=env, capture_output=True, text=True)
    for line in done.stdout.splitlines():
        if line.startswith("#"):
            print(line)
    found = re.search(r"Collected : (\d+)", done.stderr)
    if done.returncode != 0 or found is None:
        sys.stderr.write(done.stdout[-2000:] + done.stderr[-3000:])
        print(f"# failed: valgrind exited with {done.returncode}")
        return 1
    total = int(found.group(1))
    turns = args.conversations * args.turns
    print(
        f"system={args.system} store=sqlite conversations={args.conversations} turns={turns} instructions={total} "
        f"instructions_per_turn={total // turns} gc={args.gc}"
        + (" model=minimal" if args.system == "threadline" else "")
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
