"""Start-up time of the ``threadline`` command and of ``import threadline``, each in a fresh process.

    .venv/bin/python bench/startup.py [--runs 11] [--all]

Times the whole process from outside (start to exit, interpreter start-up included), ``--runs`` times after
one warm-up run, and prints one line per command:

    command=<c> median_ms=<t> min_ms=<t> max_ms=<t> cpu_median_ms=<t> runs=<n> additions_s=<s>

for ``threadline --help``, ``threadline inspect runs`` (in a directory whose ``threadline.db`` holds 20
finished conversations, made with the store API before timing) and ``import threadline``. ``--all`` adds
``--help`` of every subcommand. The target (DESIGN §5, issue 18) is under 300 ms each. ``additions_s`` is
the machine's speed at that moment (``workload.additions_s``): compare figures only at similar values.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from workload import additions_s, machine_line

SUBCOMMANDS = (
    "chat",
    "demo",
    "recover",
    "worker",
    "schema",
    "inspect",
    "inspect conversations",
    "inspect runs",
    "inspect messages",
    "inspect events",
)


def threadline_command() -> list[str]:
    """The console script beside this interpreter (what a user with the venv active runs)."""
    script = Path(sys.executable).parent / "threadline"
    if script.exists():
        return [str(script)]
    found = shutil.which("threadline")
    return [found] if found else [sys.executable, "-m", "threadline.cli"]


async def seed(path: Path, conversations: int = 20) -> None:
    from threadline import create_sqlite_agent_runtime_store

    async with create_sqlite_agent_runtime_store(filename=path) as sqlite:
        for i in range(conversations):
            accepted = await sqlite.store.accept_input_and_assign_run(
                conversation_id=f"bench-{i:02d}",
                idempotency_key="k1",
                input={"id": f"m{i}", "role": "user", "parts": [{"type": "text", "text": f"question {i}"}]},
            )
            assert accepted.run.state in ("running", "queued")


def time_command(argv: list[str], cwd: Path, runs: int) -> tuple[list[float], list[float]]:
    """Wall milliseconds and CPU milliseconds (user + system, the kernel's accounting of the finished
    child: less moved by other work on the machine than the wall clock) of each run."""
    # the warm-up run writes threadline's .pyc files, as a user's first run does (an installed wheel has them
    # already); with PYTHONDONTWRITEBYTECODE every run would compile threadline's sources again
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env["COLUMNS"] = "120"
    wall, cpu = [], []
    for i in range(runs + 1):
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        start = time.perf_counter()
        done = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, check=False)
        elapsed = time.perf_counter() - start
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        if done.returncode != 0:
            raise SystemExit(f"{' '.join(argv)} exited {done.returncode}: {done.stderr.decode()[-400:]}")
        if i:  # the first run warms the file cache and writes the .pyc files
            wall.append(elapsed * 1000)
            cpu.append((after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime) * 1000)
    return wall, cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=11)
    parser.add_argument("--all", action="store_true", help="also every subcommand's --help")
    args = parser.parse_args()

    threadline = threadline_command()
    commands: list[tuple[str, list[str]]] = [
        ("threadline --help", [*threadline, "--help"]),
        ("threadline inspect runs", [*threadline, "inspect", "runs"]),
        ("import threadline", [sys.executable, "-c", "import threadline"]),
    ]
    if args.all:
        commands += [(f"threadline {sub} --help", [*threadline, *sub.split(), "--help"]) for sub in SUBCOMMANDS]

    print(machine_line())
    print(f"# threadline: {' '.join(threadline)}")
    with tempfile.TemporaryDirectory(prefix="threadline-startup-") as tmp:
        cwd = Path(tmp)
        asyncio.run(seed(cwd / "threadline.db"))
        for label, argv in commands:
            speed = additions_s()
            wall, cpu = time_command(argv, cwd, args.runs)
            print(
                f"command={label!r} median_ms={statistics.median(wall):.0f} min_ms={min(wall):.0f} "
                f"max_ms={max(wall):.0f} cpu_median_ms={statistics.median(cpu):.0f} runs={len(wall)} "
                f"additions_s={speed:.2f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
