"""The turn workload shared by ``bench/turns.py`` (threadline) and ``bench/langgraph_turns.py`` (LangGraph).

Plain constants only (no imports), so either environment (``.venv`` or ``bench/.venv-peers``) can use it.
Every turn: one user question; the model calls ``lookup(query)`` once; the tool returns ``TOOL_RESULT``;
the model answers with ``ANSWER`` (about 200 characters). The model answers at once (zero latency).
"""

from __future__ import annotations

TOOL_NAME = "lookup"
QUERY = "durable conversations"
TOOL_RESULT = {"query": QUERY, "hits": 3, "top": "threadline", "score": 0.92}
ANSWER = (
    "Here is what I found: the lookup returned three matching records for your query, the most relevant "
    "one is threadline; durable conversations keep every turn on disk so a restart loses nothing at all."
)
assert 190 <= len(ANSWER) <= 210


def question(k: int) -> str:
    return f"Question {k}: what do we know about durable conversations?"


def machine_line() -> str:
    """A ``#`` comment line with the load average: other work on the machine skews the medians."""
    try:
        with open("/proc/loadavg") as f:
            load = " ".join(f.read().split()[:3])
    except OSError:
        load = "unknown"
    import os
    import platform

    return f"# machine: cpus={os.cpu_count()} loadavg={load} python={platform.python_version()}"


_ADDITIONS = compile("s = 0\nfor i in range(10_000_000):\n    s += i\n", "<additions>", "exec")


def additions_s() -> float:
    """Seconds this process takes for ten million Python integer additions: ``for i in range(10_000_000):
    s += i`` at module scope (``s`` and ``i`` are globals, as ``python -c`` runs it), timed with
    ``perf_counter``. The machine's speed for interpreter-bound work at that moment, load included; printed
    as ``additions_s=`` beside every figure and measured in the benchmark's own process right before its
    timed section, so a figure from a machine (or a minute) twice as slow can be told from a slower
    system. About 1.1 s on the machine that measured 11.6x LangGraph's throughput, 2.2 s on one where it
    was 8x (issue 17)."""
    import time

    scope: dict[str, int] = {}
    start = time.perf_counter()
    exec(_ADDITIONS, scope)
    elapsed = time.perf_counter() - start
    assert scope["s"] == 49_999_995_000_000
    return elapsed


GC_THRESHOLD = 50_000


def tune_gc(mode: str) -> None:
    """``--gc tuned``: what a long-running server does after start-up (both systems get the same): move
    everything alive now out of the collector's reach (``gc.freeze``) and collect the youngest generation
    every ``GC_THRESHOLD`` allocations instead of 700. ``default`` leaves Python's settings alone."""
    import gc

    if mode == "tuned":
        gc.collect()
        gc.freeze()
        gc.set_threshold(GC_THRESHOLD, 20, 100)
