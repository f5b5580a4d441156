"""Projection time: canonical records -> pydantic-ai messages, at 40, 400 and 2,000 messages.

    .venv/bin/python bench/projection.py [--sizes 40 400 2000] [--repeat 20]

Each turn of the synthetic history is a user input and one assistant message with a tool call, its result
and a ~200-character answer. Two figures per size: a full projection (``project_agent_history``, what a
cold cache or a one-off read pays) and the runtime's per-step cost once the conversation's view is warm
(fork the cached settled projection and project only the live tail):

    projection=full messages=<n> median_us=<t>
    projection=incremental messages=<n> median_us=<t>
"""

from __future__ import annotations

import argparse
import statistics
import time
from datetime import UTC, datetime

from workload import ANSWER, TOOL_RESULT, machine_line

from threadline.history.projection import AgentHistoryProjectionOptions, project_agent_history
from threadline.history.view import ConversationView
from threadline.records import Message
from threadline.store.results import ConversationChanges

NOW = datetime(2026, 1, 1, tzinfo=UTC)


def history(n: int) -> list[Message]:
    out: list[Message] = []
    for k in range(n // 2):
        out.append(
            Message(
                id=f"u{k}",
                conversation_id="c",
                role="user",
                status="committed",
                created_at=NOW,
                parts=({"type": "text", "text": f"question {k}"},),
                position=2 * k + 1,
                seq=2 * k + 1,
                run_id=f"r{k}",
            )
        )
        out.append(
            Message(
                id=f"a{k}",
                conversation_id="c",
                role="assistant",
                status="completed",
                created_at=NOW,
                run_id=f"r{k}",
                position=2 * k + 2,
                seq=2 * k + 2,
                parts=(
                    {"type": "tool-call", "call_id": f"call{k}", "tool_name": "lookup", "input": {"query": "q"}},
                    {"type": "tool-result", "call_id": f"call{k}", "tool_name": "lookup", "output": TOOL_RESULT},
                    {"type": "text", "text": ANSWER},
                ),
            )
        )
    return out


def timed(fn, repeat: int) -> float:  # type: ignore[no-untyped-def]
    samples = []
    for _ in range(repeat):
        start = time.perf_counter_ns()
        fn()
        samples.append(time.perf_counter_ns() - start)
    return statistics.median(samples) / 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[40, 400, 2000])
    parser.add_argument("--repeat", type=int, default=20)
    args = parser.parse_args()
    print(machine_line())
    options = AgentHistoryProjectionOptions()
    for n in args.sizes:
        messages = history(n)
        full = timed(lambda messages=messages: project_agent_history(messages, options), args.repeat)
        view = ConversationView("c")
        view.apply(ConversationChanges(conversation_id="c", version=1, messages=tuple(messages), reset=True))
        view.projector(options)  # warm: built once per conversation, extended as turns settle
        tail = [
            Message(
                id="u-live",
                conversation_id="c",
                role="user",
                status="committed",
                created_at=NOW,
                parts=({"type": "text", "text": "live question"},),
                seq=10**6,
                run_id="live",
            )
        ]

        def step(view: ConversationView = view, tail: list[Message] = tail) -> None:
            projector = view.projector(options).fork()
            projector.extend(tail)

        incremental = timed(step, args.repeat)
        print(f"projection=full messages={n} median_us={full:.1f}")
        print(f"projection=incremental messages={n} median_us={incremental:.1f}")


if __name__ == "__main__":
    main()
