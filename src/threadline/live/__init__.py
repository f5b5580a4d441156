"""Live delivery across processes: a web process that only admits (``runs={"execute": False}``) shows the
deltas, reasoning, tool status, progress and terminal of runs a worker process executes, as they happen.

The seam, on both sides one call::

    # the worker (executes)
    async with create_agent_live_relay(store) as relay:
        runtime = create_agent_runtime(..., publish=relay.publish)
        await runtime.serve(...)

    # the web process (admits, serves subscribers)
    async with create_agent_live_relay(store) as relay:
        harness = create_headless_agent_harness(..., runs={"execute": False}, publish=relay.publish)
        await relay.subscribe(harness)       # or a runtime, an AgentEventHub, or a callable taking one event

The worker's runtime hands every delivery event to :meth:`AgentLiveRelay.publish`; the web process's
:class:`AgentLiveSubscription` re-publishes them into the same seam its own runtime's events go through —
for a runtime or a harness its ``relayed_delivery()``: the ``publish=`` callback (a harness's event hub) and
the followers of ``ticket.events()`` — so the control server, SSE streams, the Vercel AI endpoint and the
tickets serve them with no change. The web process's ``publish=relay.publish`` lets other web processes see
its admissions too; what its subscription delivers is not sent out again.

Transport: on PostgreSQL LISTEN/NOTIFY on a channel of the relay's own, with frames larger than a NOTIFY
payload (8,000 bytes) in the relay table ``<schema>.live_relay``; on SQLite (processes on one machine) the
same relay table in the file ``<store file>-live``, polled. The table is the relay's own, created on first
use, bounded (``max_rows``, ``max_age``) and pruned by publishers; the store's layout does not change.

Nothing here is durable or exactly-once — a process can crash between a commit and its publish, as in one
process. What the relay adds is detection: a subscriber that lost frames (pruned before it read them, a
dropped LISTEN connection, a publisher's full queue) or sees a transient ``sequence`` gap or a durable event
arriving after a newer one heals the conversations concerned from the store
(:mod:`threadline.live.subscription`), so the terminal and the last checkpoint always arrive.

Ordering: one publisher's events arrive in the order it published them; events of different processes
have no order between them beyond what their versions say (the cursor rules handle that).
"""

from __future__ import annotations

from .frames import (
    MAX_EVENT_BYTES as MAX_EVENT_BYTES,
    MAX_FRAME_BYTES as MAX_FRAME_BYTES,
    NOTIFY_PAYLOAD_LIMIT as NOTIFY_PAYLOAD_LIMIT,
)
from .heal import healing_events as healing_events
from .relay import (
    DEFAULT_CAPACITY as DEFAULT_CAPACITY,
    DEFAULT_MAX_AGE as DEFAULT_MAX_AGE,
    DEFAULT_MAX_ROWS as DEFAULT_MAX_ROWS,
    DEFAULT_POLL_INTERVAL as DEFAULT_POLL_INTERVAL,
    AgentLiveRelay as AgentLiveRelay,
    AgentLiveRelayStatus as AgentLiveRelayStatus,
    create_agent_live_relay as create_agent_live_relay,
)
from .subscription import (
    AgentLiveSubscription as AgentLiveSubscription,
    AgentLiveSubscriptionStatus as AgentLiveSubscriptionStatus,
)

__all__ = (
    "DEFAULT_CAPACITY",
    "DEFAULT_MAX_AGE",
    "DEFAULT_MAX_ROWS",
    "DEFAULT_POLL_INTERVAL",
    "MAX_EVENT_BYTES",
    "MAX_FRAME_BYTES",
    "NOTIFY_PAYLOAD_LIMIT",
    "AgentLiveRelay",
    "AgentLiveRelayStatus",
    "AgentLiveSubscription",
    "AgentLiveSubscriptionStatus",
    "create_agent_live_relay",
    "healing_events",
)
