"""Delivery events a transport or UI receives through ``publish``.

Durable events (``admission``, ``run-state``, ``assistant-checkpoint``, ``run-operation``, ``terminal``)
are published only after their transaction committed and carry ``event_id`` derived from
(run id, event type, snapshot version). Transient events (``assistant-delta``, ``reasoning-delta``,
``tool-status``) carry ``(run_id, runtime_epoch, sequence)``, numbered from 1 per run.
These are post-commit notifications, not an outbox: reconnect by loading the snapshot.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, JsonValue

from .records import Message, Part, Run, RunOperation
from .usage import AgentUsage


class _Event(BaseModel):
    model_config = ConfigDict(frozen=True)

    conversation_id: str
    run_id: str


class _Durable(_Event):
    event_id: str
    version: int


class _Transient(_Event):
    runtime_epoch: str
    sequence: int


def durable_event_id(run_id: str, event_type: str, version: int, phase: str | None = None) -> str:
    return f"{run_id}:{event_type}{':' + phase if phase else ''}:{version}"


class AdmissionEvent(_Durable):
    type: Literal["admission"] = "admission"
    outcome: Literal["accepted", "duplicate"]
    input: Message
    run: Run
    assistant_message_id: str
    coalesced: bool = False


class RunStateEvent(_Durable):
    type: Literal["run-state"] = "run-state"
    state: str
    terminal_reason: str | None = None


class AssistantCheckpointEvent(_Durable):
    type: Literal["assistant-checkpoint"] = "assistant-checkpoint"
    message_id: str
    parts: tuple[Part, ...]


class RunOperationEvent(_Durable):
    type: Literal["run-operation"] = "run-operation"
    operation: RunOperation


class AssistantDeltaEvent(_Transient):
    type: Literal["assistant-delta"] = "assistant-delta"
    delta: str


class ReasoningDeltaEvent(_Transient):
    type: Literal["reasoning-delta"] = "reasoning-delta"
    delta: str


class ToolStatusEvent(_Transient):
    type: Literal["tool-status"] = "tool-status"
    call_id: str
    tool_name: str
    status: Literal["started", "completed", "failed", "interrupted"]
    input: JsonValue = None
    output: JsonValue = None
    error: dict[str, Any] | None = None


class TerminalEvent(_Durable):
    type: Literal["terminal"] = "terminal"
    terminal_reason: str
    policy_name: str | None = None
    assistant: Message | None = None
    usage: AgentUsage


AgentRuntimeEvent = Annotated[
    AdmissionEvent
    | RunStateEvent
    | AssistantCheckpointEvent
    | RunOperationEvent
    | AssistantDeltaEvent
    | ReasoningDeltaEvent
    | ToolStatusEvent
    | TerminalEvent,
    Field(discriminator="type"),
]
