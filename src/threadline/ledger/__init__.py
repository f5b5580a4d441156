"""The event ledger: one append-only journal per conversation, kept by the store.

The ledger is part of the store (DESIGN §8): every store mutation appends its ``runtime/transition``
record in the same transaction, decided by the reducer; drivers only insert and select rows. This package
holds what the store and its readers share and what needs no store: the envelope and typed payloads
(:mod:`.events`), provider request digests (:mod:`.digests`, :mod:`.requests`) and the archive format
(:mod:`.archive`). The store imports these modules; none of them imports the store.
"""

from .events import (
    AGENT_STORE_EVENT_KINDS,
    EVENT_SCHEMA_VERSION,
    AgentStoreEvent,
    AgentStoreEventDraft,
    AgentStoreEventKind,
    AgentStoreEventPage,
    AgentStoreTransitionRecord,
    AssistantDigest,
    BaselineRecord,
    BranchObservationRecord,
    ProviderMessageRecord,
    ProviderRequestRecord,
    ProviderResponseRecord,
    decode_agent_store_event,
)

__all__ = [
    "AGENT_STORE_EVENT_KINDS",
    "EVENT_SCHEMA_VERSION",
    "AgentStoreEvent",
    "AgentStoreEventDraft",
    "AgentStoreEventKind",
    "AgentStoreEventPage",
    "AgentStoreTransitionRecord",
    "AssistantDigest",
    "BaselineRecord",
    "BranchObservationRecord",
    "ProviderMessageRecord",
    "ProviderRequestRecord",
    "ProviderResponseRecord",
    "decode_agent_store_event",
]
