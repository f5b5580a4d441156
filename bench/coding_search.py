"""search_files against ripgrep (``rg -j1``) on the Python standard library's sources, and a pathological regex.

    .venv/bin/python bench/coding_search.py [--tree DIR] [--runs 11]

The tree defaults to this interpreter's standard library (``sysconfig``'s ``stdlib``) with ``site-packages``
and ``__pycache__`` excluded on both sides (ripgrep: ``--no-ignore --hidden -g '!site-packages'
-g '!__pycache__'``; threadline: ``exclude_directories``). Both skip symlinks and binary files (a NUL byte);
threadline's budgets are raised so its coverage is complete and it returns every match, as ripgrep does
(the script checks that both count the same matches). Timed: the tool call on a warm page cache, one
process, one thread, alternating with ripgrep ``--runs`` times (so a busy machine slows both alike); the
medians of wall time (``ratio``, the goal's figure) and of CPU time (``cpu_ratio``: this process's
``process_time`` against ripgrep's user + system time, less sensitive to other load). Queries: a literal,
a regex (content) and a path query (ripgrep: ``--files -g``; threadline: ``glob``). Then ``(a+)+$``
against ``a+`` on a 1 MB line: RE2 runs both in linear time, so they must cost about the same.

Ripgrep comes from Debian's ``ripgrep`` package; the script installs it with apt-get when ``rg`` is missing.
Every line ends with ``additions_s=`` (ten million Python additions, the machine's speed that minute).
"""

from __future__ import annotations

import argparse
import asyncio
import resource
import shutil
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from workload import additions_s

from threadline.coding import AgentCodingToolLimits, create_agent_coding_tools
from threadline.tools import AgentToolContext

EXCLUDED = ["site-packages", "__pycache__"]
UNBOUNDED = AgentCodingToolLimits(
    max_read_bytes=1 << 30,
    max_search_results=10_000_000,
    max_search_files=10_000_000,
    max_search_directories=10_000_000,
    max_search_entries=100_000_000,
    max_search_bytes=1 << 40,
    max_search_output_bytes=1 << 31,
    search_timeout=3_600,
)


def ensure_rg() -> str:
    found = shutil.which("rg")
    if found:
        return found
    print("installing ripgrep (apt-get install ripgrep)", file=sys.stderr)
    subprocess.run(["apt-get", "install", "-y", "-q", "ripgrep"], check=False, capture_output=True)
    found = shutil.which("rg")
    if not found:
        subprocess.run(["apt-get", "update", "-q"], check=False, capture_output=True)
        subprocess.run(["apt-get", "install", "-y", "-q", "ripgrep"], check=True, capture_output=True)
        found = shutil.which("rg")
    assert found, "ripgrep could not be installed"
    return found


def tools_for(root: Path, **limits) -> dict:
    built = create_agent_coding_tools(
        root=root, authorize=lambda payload: True, limits=limits.get("limits", UNBOUNDED), exclude_directories=EXCLUDED
    )
    return {t.name: t for t in built}


async def call(tools: dict, name: str, **arguments) -> dict:
    tool = tools[name]
    ctx = AgentToolContext(conversation_id="bench", run_id="r", call_id="k", tool_name=name, context=None)
    return await tool.call(ctx, tool.validate(arguments))


def median_ms(samples: list[float]) -> float:
    return statistics.median(samples) * 1000


def time_ours(tools: dict, name: str, arguments: dict) -> tuple[float, float, dict]:
    """One call: wall seconds, this process's CPU seconds, the result."""
    wall, cpu = time.perf_counter(), time.process_time()
    result = asyncio.run(call(tools, name, **arguments))
    return time.perf_counter() - wall, time.process_time() - cpu, result


def time_rg(rg: str, root: Path, args: list[str]) -> tuple[float, float, int]:
    """One ripgrep process: wall seconds, its CPU seconds (user + system), the lines it printed."""
    command = [rg, "-j1", "--no-ignore", "--hidden", *[f"-g!{d}" for d in EXCLUDED], *args]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    wall = time.perf_counter()
    done = subprocess.run(command, cwd=root, capture_output=True, check=False)
    wall = time.perf_counter() - wall
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu, len(done.stdout.splitlines())


def compare(tools: dict, rg: str, root: Path, runs: int, name: str, arguments: dict, rg_args: list[str]) -> dict:
    """Alternate the two ``runs`` times, so both see the same machine load; medians of wall and CPU time."""
    ours_wall, ours_cpu, theirs_wall, theirs_cpu = [], [], [], []
    result, rg_count = {}, 0
    for _ in range(runs):
        wall, cpu, result = time_ours(tools, name, arguments)
        ours_wall.append(wall)
        ours_cpu.append(cpu)
        wall, cpu, rg_count = time_rg(rg, root, rg_args)
        theirs_wall.append(wall)
        theirs_cpu.append(cpu)
    return {
        "ours": median_ms(ours_wall),
        "theirs": median_ms(theirs_wall),
        "ours_cpu": median_ms(ours_cpu),
        "theirs_cpu": median_ms(theirs_cpu),
        "result": result,
        "rg_count": rg_count,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tree", default=sysconfig.get_paths()["stdlib"])
    parser.add_argument("--runs", type=int, default=11)
    options = parser.parse_args()
    rg = ensure_rg()
    root = Path(options.tree).resolve()
    tools = tools_for(root)
    speed = additions_s()
    version = subprocess.run([rg, "--version"], capture_output=True, text=True).stdout.split()[1]
    print(f"tree={root} runs={options.runs} rg={version}")
    cases = [
        ("literal", "search_files", {"query": "import re"}, ["-n", "-F", "import re"]),
        ("regex", "search_files", {"query": r"def \w+_cache\(", "regex": True}, ["-n", r"def \w+_cache\("]),
        ("path", "glob", {"pattern": "**/test_*.py"}, ["--files", "-g", "test_*.py"]),
    ]
    # warm the page cache once for both
    time_rg(rg, root, ["-c", "-F", "zzzz-warm"])
    for label, name, arguments, rg_args in cases:
        measured = compare(tools, rg, root, options.runs, name, arguments, rg_args)
        result = measured["result"]
        count = len(result.get("matches", result.get("paths", [])))
        complete = result["coverage"]["complete"] or set(result["coverage"]["reasons"]) <= {"binary", "invalid-utf8"}
        print(
            f"{label}: threadline_ms={measured['ours']:.1f} rg_j1_ms={measured['theirs']:.1f} "
            f"ratio={measured['ours'] / measured['theirs']:.2f} "
            f"cpu_ms={measured['ours_cpu']:.1f}/{measured['theirs_cpu']:.1f} "
            f"cpu_ratio={measured['ours_cpu'] / measured['theirs_cpu']:.2f} "
            f"matches={count} rg_matches={measured['rg_count']} complete={complete} "
            f"reasons={','.join(result['coverage']['reasons']) or '-'} additions_s={speed:.2f}"
        )
    with tempfile.TemporaryDirectory() as scratch:
        line = Path(scratch)
        (line / "long.txt").write_text("a" * 1_000_000 + "b\n")
        small = tools_for(line)
        patho = median_ms(
            [time_ours(small, "search_files", {"query": "(a+)+$", "regex": True})[0] for _ in range(options.runs)]
        )
        simple = median_ms(
            [time_ours(small, "search_files", {"query": "a+", "regex": True})[0] for _ in range(options.runs)]
        )
        print(
            f"pathological: (a+)+$_ms={patho:.2f} a+_ms={simple:.2f} ratio={patho / simple:.2f} "
            f"line_bytes=1000001 additions_s={speed:.2f}"
        )


if __name__ == "__main__":
    main()
