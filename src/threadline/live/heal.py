"""Healing events: the durable facts of a conversation, read from the store, as delivery events.

When a subscription finds it missed something (a relay gap, a transient ``sequence`` gap, a durable event
that arrived after a newer one), it reads what the store holds and publishes it into the local seam as
ordinary durable events, so every consumer downstream — a control view, an SSE stream, a ticket — settles
on the canonical state without knowing a relay exists.

Each healed event keeps the identity the original had (``event_id`` from the run id, the event type and
the version of the commit that made the fact, as :func:`threadline.events.durable_event_id` derives it),
so a sink that delivered the original drops the repeat; its ``version`` is the version the store was
read at, so a cursor that already moved past the original still accepts it. A heal may therefore repeat
a fact a consumer already has: applying a durable event twice is harmless by design (a checkpoint
replaces the streamed text, a terminal settles a settled run again).

Pure: no I/O here; :mod:`threadline.live.subscription` does the reads.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from ..events import (
    AdmissionEvent,
    AssistantCheckpointEvent,
    RunOperationEvent,
    RunStateEvent,
    TerminalEvent,
    delivered_message,
    delivered_parts,
    durable_event_id,
)
from ..records import Message, Run


def healing_events(
    conversation_id: str,
    version: int,
    runs: Iterable[Run],
    messages: Iterable[Message],
    *,
    since: int | None,
) -> list[Any]:
    """The delivery events that bring a consumer to the durable state of ``runs`` at ``version``.

    ``messages`` are the rows read with the runs (a snapshot's, or the changes since ``since``): inputs
    written after ``since`` (every input of an active run when ``since`` is None) give ``admission``
    events, an active run its ``run-state``, ``run-operation`` and the ``assistant-checkpoint`` of its
    streaming draft, a run that ended its ``terminal`` (an absorbed one, which has no answer of its own,
    a ``run-state``). Runs go in the order they were last written, so a run's admission comes before what
    followed it."""
    by_id = {m.id: m for m in messages}
    out: list[Any] = []
    common = {"conversation_id": conversation_id, "version": version}
    for run in sorted(runs, key=lambda r: (r.version, r.admission_sequence)):
        for input_id in run.input_message_ids:
            message = by_id.get(input_id)
            if message is None or (since is None and run.terminal) or (since is not None and message.version <= since):
                continue
            out.append(
                AdmissionEvent(
                    event_id=durable_event_id(run.id, "admission", message.version),
                    run_id=run.id,
                    outcome="accepted",
                    input=delivered_message(message),
                    run=run,
                    assistant_message_id=run.assistant_message_id,
                    **common,
                )
            )
        if run.terminal and run.terminal_reason != "absorbed":
            out.append(
                TerminalEvent(
                    event_id=durable_event_id(run.id, "terminal", run.version),
                    run_id=run.id,
                    terminal_reason=run.terminal_reason or "",
                    policy_name=run.policy_name,
                    assistant=delivered_message(by_id.get(run.assistant_message_id)),
                    usage=run.usage,
                    **common,
                )
            )
            continue
        out.append(
            RunStateEvent(
                event_id=durable_event_id(run.id, "run-state", run.version),
                run_id=run.id,
                state=run.state,
                terminal_reason=run.terminal_reason,
                **common,
            )
        )
        if run.terminal:
            continue
        if run.last_operation is not None:
            out.append(
                RunOperationEvent(
                    event_id=durable_event_id(run.id, "run-operation", run.version, run.last_operation.phase),
                    run_id=run.id,
                    operation=run.last_operation,
                    **common,
                )
            )
        draft = by_id.get(run.assistant_message_id)
        if draft is not None and draft.status == "streaming":
            out.append(
                AssistantCheckpointEvent(
                    event_id=durable_event_id(run.id, "assistant-checkpoint", draft.version),
                    run_id=run.id,
                    message_id=draft.id,
                    parts=delivered_parts(draft.parts),
                    **common,
                )
            )
    return out
