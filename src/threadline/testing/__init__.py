"""Test doubles for threadline applications: a scripted fault provider and a replay provider.

- :func:`create_fault_provider_server` — a real OpenAI-compatible Chat Completions HTTP server on
  loopback whose every answer is scripted (text, tool calls, 429, 5xx, hangs, malformed chunks, dropped
  connections, ``finish_reason='length'``), recording what the client sent.
- :func:`record_agent_provider` / :func:`create_replay_agent_provider` — capture a model's streamed
  answers as JSON and replay them offline, deterministically.

Nothing here reads a credential or listens beyond ``127.0.0.1``.
"""

from .fault_provider import (
    DropAfter as DropAfter,
    FaultBehaviour as FaultBehaviour,
    FaultProviderServer as FaultProviderServer,
    FinishLength as FinishLength,
    Hang as Hang,
    Malformed as Malformed,
    RateLimited as RateLimited,
    RecordedRequest as RecordedRequest,
    ServerError as ServerError,
    StreamText as StreamText,
    StreamToolCalls as StreamToolCalls,
    create_fault_provider_server as create_fault_provider_server,
    drop_after as drop_after,
    finish_length as finish_length,
    hang as hang,
    malformed as malformed,
    rate_limited as rate_limited,
    server_error as server_error,
    stream_text as stream_text,
    stream_tool_calls as stream_tool_calls,
)
from .replay import (
    AgentReplayExhaustedError as AgentReplayExhaustedError,
    RecordingModel as RecordingModel,
    ReplayedProviderError as ReplayedProviderError,
    ReplayModel as ReplayModel,
    create_replay_agent_provider as create_replay_agent_provider,
    record_agent_provider as record_agent_provider,
)

__all__ = [
    "AgentReplayExhaustedError",
    "DropAfter",
    "FaultBehaviour",
    "FaultProviderServer",
    "FinishLength",
    "Hang",
    "Malformed",
    "RateLimited",
    "RecordedRequest",
    "RecordingModel",
    "ReplayModel",
    "ReplayedProviderError",
    "ServerError",
    "StreamText",
    "StreamToolCalls",
    "create_fault_provider_server",
    "create_replay_agent_provider",
    "drop_after",
    "finish_length",
    "hang",
    "malformed",
    "rate_limited",
    "record_agent_provider",
    "server_error",
    "stream_text",
    "stream_tool_calls",
]
