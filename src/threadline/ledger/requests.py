"""The ``provider/request`` and ``provider/message`` records of one provider call (built by the loop,
appended by the store in the commit that admits the call)."""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import Any

from pydantic_ai.messages import ModelMessage

from .digests import PrefixDigests, instructions_digest, message_body
from .events import AgentStoreEventDraft, runtime_draft

__all__ = ["provider_request_records"]


def _settled_count(prefix: Sequence[ModelMessage], messages: Sequence[ModelMessage]) -> int:
    """How many leading messages of the request are the settled projection's own (the same objects: a
    tail message merged into the projection's last one, or a ``prepare_step`` rewrite, ends it)."""
    k = min(len(prefix), len(messages))
    if all(map(operator.is_, prefix[:k], messages[:k])):
        return k
    return next(i for i in range(k) if prefix[i] is not messages[i])


def provider_request_records(
    state: PrefixDigests,
    projection: Any,
    messages: Sequence[ModelMessage],
    *,
    run_id: str,
    attempt: int,
    step: int,
    model_id: str | None,
    instructions: str,
) -> tuple[list[AgentStoreEventDraft], Callable[[], None]]:
    """The ledger records of one request: a ``provider/message`` per body the ledger may not hold yet
    (the store skips those it does), then the ``provider/request``; and what to remember once they are
    committed. ``projection`` is the settled-history projection the request forked (``None``: none)."""
    built: Sequence[ModelMessage] = projection.built if projection is not None else ()
    count = _settled_count(built, messages)
    fresh = state.update(projection, built, count)
    digested = [state.tail_digest(m) for m in messages[count:]]
    tail_bodies = [body for body, _ in digested]
    tail = [sha for _, sha in digested]
    base = state.base()
    start = base[0] if base is not None else 0
    added = state.shas[start:count]
    prefix: dict[str, Any] = {"count": count, "sha256": state.chains[count], "added": added}
    request = {
        "run_id": run_id,
        "attempt": attempt,
        "step_number": step,
        **({"model_id": model_id} if model_id else {}),
        "instructions_sha256": instructions_digest(instructions),
        "prefix": prefix,
        "message_shas": tail,
    }
    bodies = dict(zip(tail, tail_bodies, strict=True))
    events: list[AgentStoreEventDraft] = []
    skip = set(state.bodies_recorded)
    for index, sha in enumerate([*added, *tail]):
        if sha in skip:
            continue
        skip.add(sha)
        body = fresh.get(sha) or bodies.get(sha)
        if body is None:  # digested by an earlier request whose records did not commit
            body = message_body(state.messages[start + index])
        events.append(runtime_draft("provider/message", {"sha256": sha, "message": body}))
    events.append(runtime_draft("provider/request", request))
    shas = [e.payload["sha256"] for e in events[:-1]]  # type: ignore[index,call-overload]
    chained = (count, prefix["sha256"])

    def committed() -> None:
        state.recorded = chained
        state.note_bodies(shas)

    return events, committed
