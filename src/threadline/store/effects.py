"""Durable steps kept in the conversation's ledger: the store side of
``create_local_step_durability(store=...)`` (:mod:`threadline.durability`).

A step's intent and its accepted proof are ``durability/effect`` events, each appended by one write
transaction of the store (the reducer decides: :func:`~threadline.store.reducer.claim_step_effect`,
:func:`~threadline.store.reducer.accept_step_effect`). They are found by their key through the ledger's
lookup index (constant work, whatever the conversation's length), and they are ledger events like any
other: compaction leaves them alone, export carries them and import restores them with their index; a
branch keeps them only as inert ``runtime/branch-observation`` records, so a branch never inherits a proof.
Purging the conversation removes them with everything else.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from datetime import datetime
from typing import Any, Protocol

from . import reducer
from .driver import Access
from .ids import new_id
from .reducer import StepEffect


class AgentRuntimeStore(Protocol):
    """What durable steps use of :class:`threadline.store.aggregate.AgentRuntimeStore` (named structurally,
    as :mod:`threadline.store.transfer` does)."""

    _clock: Callable[[], datetime]

    def _require_ledger(self) -> None: ...
    async def _run(self, name: str, operation: Callable[[], Any], access: Access) -> Any: ...


__all__ = ["StepEffect", "accept_step_effect", "claim_step_effect", "read_step_effect"]


async def claim_step_effect(
    store: AgentRuntimeStore, *, conversation_id: str, run_ids: Sequence[str], effect_name: str
) -> StepEffect | None:
    """The recorded step of the first of ``run_ids`` that has one, or ``None`` once an intent is committed
    under every run id (one transaction). A purged conversation is refused
    (:class:`~threadline.errors.AgentConversationPurgedError`). Cancelling the caller does not withdraw a
    write already handed to the driver."""
    store._require_ledger()
    op = functools.partial(
        reducer.claim_step_effect,
        conversation_id=conversation_id,
        run_ids=tuple(run_ids),
        effect_name=effect_name,
        now=store._clock(),
        event_id=new_id("evt"),
    )
    return await store._run("claim_step_effect", op, "write")


async def accept_step_effect(
    store: AgentRuntimeStore,
    *,
    conversation_id: str,
    run_ids: Sequence[str],
    effect_name: str,
    value_json: str,
    reconciled: bool,
) -> StepEffect | None:
    """Commit the accepted proof under each run id that holds a bare intent (one transaction) and return
    ``None``; or return the step when the first run id's key was accepted already (nothing written)."""
    store._require_ledger()
    op = functools.partial(
        reducer.accept_step_effect,
        conversation_id=conversation_id,
        run_ids=tuple(run_ids),
        effect_name=effect_name,
        value_json=value_json,
        reconciled=reconciled,
        now=store._clock(),
        event_id=new_id("evt"),
    )
    return await store._run("accept_step_effect", op, "write")


async def read_step_effect(
    store: AgentRuntimeStore, *, conversation_id: str, run_id: str, effect_name: str
) -> StepEffect | None:
    """The step recorded under ``(conversation_id, run_id, effect_name)``, or ``None``. Reads only."""
    store._require_ledger()
    op = functools.partial(
        reducer.read_step_effect, conversation_id=conversation_id, run_id=run_id, effect_name=effect_name
    )
    return await store._run("read_step_effect", op, "read")
