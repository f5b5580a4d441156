"""The durable store: one reducer, thin drivers (memory, SQLite; PostgreSQL as an extra)."""

from .aggregate import (
    AgentConversationReader,
    AgentRuntimeStore,
    create_agent_runtime_store,
    new_id,
    purge_agent_conversation,
)
from .driver import AsyncRows, Mutation, Operation, OperationStats, StoreDriver, SyncRows, drive_async, drive_sync
from .memory import MemoryStoreDriver, create_memory_agent_runtime_store
from .reducer import AbsorbClaim, order_recoverable

__all__ = [
    "AbsorbClaim",
    "AgentConversationReader",
    "AgentRuntimeStore",
    "AsyncRows",
    "MemoryStoreDriver",
    "Mutation",
    "Operation",
    "OperationStats",
    "StoreDriver",
    "SyncRows",
    "create_agent_runtime_store",
    "create_memory_agent_runtime_store",
    "drive_async",
    "drive_sync",
    "new_id",
    "order_recoverable",
    "purge_agent_conversation",
]
