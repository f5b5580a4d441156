"""Record a model's streamed answers, and replay them offline, deterministically.

A **recording** is plain JSON: a list of turns (one per provider request, in order), each a list of
stream items::

    [
      [{"type": "text", "delta": "Let me "}, {"type": "text", "delta": "check."},
       {"type": "tool-call", "call_id": "call_1", "tool_name": "weather", "args": "{\\"city\\": \\"Paris\\"}"},
       {"type": "usage", "input_tokens": 30, "output_tokens": 12},
       {"type": "finish", "finish_reason": "tool_call"}],
      [{"type": "text", "delta": "Sunny."}],
    ]

Items:

- ``{"type": "text", "delta": str, "part"?: int}`` — a text delta. Without ``part`` it extends the last
  part when that is text, else starts a new one; with ``part`` it goes to that part (as recorded).
- ``{"type": "thinking", "delta": str, "signature"?: str, "part"?: int}`` — reasoning.
- ``{"type": "tool-call", "tool_name"?: str, "call_id"?: str, "args"?: str, "part"?: int}`` — without
  ``part`` a complete call; with ``part`` the first item of a part names the call and later ones append
  ``args``.
- ``{"type": "part", "part": int, "value": {...}}`` — any other response part, as pydantic-ai dumps it.
- ``{"type": "usage", "input_tokens": int, "output_tokens": int, ...}`` — the provider-reported usage
  (``pydantic_ai.usage.RequestUsage`` fields). Without it the turn reported no usage.
- ``{"type": "finish", "finish_reason"?: str, "model_name"?: str, "provider_name"?: str,
  "provider_response_id"?: str}``.
- ``{"type": "error", "error_type": str, "message": str}`` — the provider failed here; the replay raises
  :class:`ReplayedProviderError` (a pydantic-ai ``ModelAPIError``) at this point.

:func:`record_agent_provider` wraps a real model and writes that format while a session runs;
:func:`create_replay_agent_provider` turns it back into a pydantic-ai ``Model``. A replay that runs out
of turns raises :class:`AgentReplayExhaustedError`.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator, AsyncIterator, Iterable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from pydantic import TypeAdapter
from pydantic_ai.exceptions import ModelAPIError
from pydantic_ai.messages import (
    ModelMessage,
    ModelResponse,
    ModelResponsePart,
    ModelResponseStreamEvent,
    PartDeltaEvent,
    PartStartEvent,
    TextPart,
    TextPartDelta,
    ThinkingPart,
    ThinkingPartDelta,
    ToolCallPart,
    ToolCallPartDelta,
)
from pydantic_ai.models import Model, ModelRequestParameters, StreamedResponse
from pydantic_ai.models.wrapper import WrapperModel
from pydantic_ai.profiles import ModelProfile
from pydantic_ai.settings import ModelSettings
from pydantic_ai.usage import RequestUsage
from pydantic_core import to_jsonable_python

from ..errors import AgentRuntimeUsageError, ThreadlineError

__all__ = (
    "AgentReplayExhaustedError",
    "RecordingModel",
    "ReplayModel",
    "ReplayedProviderError",
    "create_replay_agent_provider",
    "record_agent_provider",
)

ITEM_TYPES = frozenset({"text", "thinking", "tool-call", "part", "usage", "finish", "error"})
_PART_ADAPTER: TypeAdapter[ModelResponsePart] = TypeAdapter(ModelResponsePart)
_USAGE_ADAPTER: TypeAdapter[RequestUsage] = TypeAdapter(RequestUsage)


class AgentReplayExhaustedError(ThreadlineError):
    """The replay was asked for more turns than it recorded (``requested`` is the 0-based turn index)."""

    def __init__(self, message: str, *, requested: int, recorded: int) -> None:
        super().__init__(message)
        self.requested = requested
        self.recorded = recorded


class ReplayedProviderError(ModelAPIError):
    """A provider failure that the recording captured, raised again where it happened.
    ``error_type`` is the class name of the original error."""

    def __init__(self, model_name: str, message: str, *, error_type: str) -> None:
        super().__init__(model_name=model_name, message=message)
        self.error_type = error_type


def _validate_recording(recording: Iterable[Iterable[Any]]) -> list[list[dict[str, Any]]]:
    turns: list[list[dict[str, Any]]] = []
    for t, turn in enumerate(recording):
        if isinstance(turn, str | bytes | Mapping):
            raise AgentRuntimeUsageError(f"recording[{t}] is a list of stream items, got {type(turn).__name__}")
        items: list[dict[str, Any]] = []
        for i, item in enumerate(turn):
            if isinstance(item, str):
                item = {"type": "text", "delta": item}
            if not isinstance(item, Mapping) or item.get("type") not in ITEM_TYPES:
                raise AgentRuntimeUsageError(
                    f"recording[{t}][{i}] is not a stream item ({sorted(ITEM_TYPES)}): {item!r}"
                )
            if item["type"] == "part" and not isinstance(item.get("part"), int):
                raise AgentRuntimeUsageError(f"recording[{t}][{i}] (a 'part' item) needs its integer 'part' index")
            items.append(dict(item))
        turns.append(items)
    return turns


# ------------------------------------------------------------------------------------------- replay


@dataclass
class _ReplayStreamedResponse(StreamedResponse):
    _items: list[dict[str, Any]] = field(default_factory=list)
    _model_name: str = "replay"
    _provider_name: str = "replay"
    _timestamp: datetime = field(default_factory=lambda: datetime.now(UTC))
    _usage_received: bool | None = field(default=False, init=False)  # a turn without a usage item reported none

    async def _get_event_iterator(self) -> AsyncIterator[ModelResponseStreamEvent]:
        for item in self._items:
            await asyncio.sleep(0)  # a real stream yields to the event loop between chunks; so does a replay
            for event in self._apply(item):
                yield event

    def _apply(self, item: dict[str, Any]) -> list[ModelResponseStreamEvent]:
        kind = item["type"]
        part = item.get("part")
        manager = self._parts_manager
        if kind == "text":
            return list(
                manager.handle_text_delta(
                    vendor_part_id=part,
                    content=item.get("delta", ""),
                    id=item.get("id"),
                    provider_name=item.get("provider_name"),
                    provider_details=item.get("provider_details"),
                )
            )
        if kind == "thinking":
            return list(
                manager.handle_thinking_delta(
                    vendor_part_id=part,
                    content=item.get("delta"),
                    id=item.get("id"),
                    signature=item.get("signature"),
                    provider_name=item.get("provider_name"),
                    provider_details=item.get("provider_details"),
                )
            )
        if kind == "tool-call":
            if part is None:
                return [
                    manager.handle_tool_call_part(
                        vendor_part_id=None,
                        tool_name=item.get("tool_name") or "",
                        args=item.get("args"),
                        tool_call_id=item.get("call_id"),
                    )
                ]
            return list(
                manager.handle_tool_call_delta_events(
                    vendor_part_id=part,
                    tool_name=item.get("tool_name"),
                    args=item.get("args"),
                    tool_call_id=item.get("call_id"),
                )
            )
        if kind == "part":
            return [manager.handle_part(vendor_part_id=part, part=_PART_ADAPTER.validate_python(item["value"]))]
        if kind == "usage":
            values = {k: v for k, v in item.items() if k != "type"}
            self._add_usage(_USAGE_ADAPTER.validate_python(values), reported=True, cumulative=True)
            return []
        if kind == "finish":
            if item.get("finish_reason") is not None:
                self.finish_reason = item["finish_reason"]
            if item.get("provider_response_id") is not None:
                self.provider_response_id = item["provider_response_id"]
            return []
        if kind == "error":
            raise ReplayedProviderError(
                self._model_name, item.get("message") or "replayed failure", error_type=item.get("error_type") or ""
            )
        raise AssertionError(f"unknown item {item!r}")  # pragma: no cover - validated on construction

    async def close_stream(self) -> None:
        pass  # nothing to tear down

    @property
    def model_name(self) -> str:
        return self._model_name

    @property
    def provider_name(self) -> str | None:
        return self._provider_name

    @property
    def provider_url(self) -> str | None:
        return None

    @property
    def timestamp(self) -> datetime:
        return self._timestamp


class ReplayModel(Model):
    """A pydantic-ai ``Model`` answering request *n* with turn *n* of a recording. ``requests`` keeps the
    messages each request received; ``remaining`` counts the turns not replayed yet."""

    def __init__(
        self,
        recording: Iterable[Iterable[Any]],
        *,
        model_name: str | None = None,
        system: str | None = None,
        settings: ModelSettings | None = None,
    ) -> None:
        self.recording = _validate_recording(recording)
        finish = next((i for turn in self.recording for i in turn if i["type"] == "finish"), {})
        self._model_name = model_name or finish.get("model_name") or "replay"
        self._system = system or finish.get("provider_name") or "replay"
        self.requests: list[list[ModelMessage]] = []
        super().__init__(settings=settings, profile=ModelProfile())

    @property
    def model_name(self) -> str:
        return self._model_name

    @property
    def system(self) -> str:
        return self._system

    @property
    def remaining(self) -> int:
        return max(0, len(self.recording) - len(self.requests))

    def _next_turn(self, messages: list[ModelMessage]) -> list[dict[str, Any]]:
        index = len(self.requests)
        self.requests.append(messages)
        if index >= len(self.recording):
            raise AgentReplayExhaustedError(
                f"the replay has {len(self.recording)} recorded turn(s); request #{index} has none",
                requested=index,
                recorded=len(self.recording),
            )
        return self.recording[index]

    def _stream_for(self, items: list[dict[str, Any]], params: ModelRequestParameters) -> _ReplayStreamedResponse:
        finish = next((i for i in items if i["type"] == "finish"), {})
        return _ReplayStreamedResponse(
            model_request_parameters=params,
            _items=items,
            _model_name=finish.get("model_name") or self._model_name,
            _provider_name=finish.get("provider_name") or self._system,
        )

    async def request(
        self,
        messages: list[ModelMessage],
        model_settings: ModelSettings | None,
        model_request_parameters: ModelRequestParameters,
    ) -> ModelResponse:
        _settings, params = self.prepare_request(model_settings, model_request_parameters)
        stream = self._stream_for(self._next_turn(messages), params)
        async for _ in stream:
            pass
        return stream.get()

    @asynccontextmanager
    async def request_stream(
        self,
        messages: list[ModelMessage],
        model_settings: ModelSettings | None,
        model_request_parameters: ModelRequestParameters,
        run_context: Any = None,
    ) -> AsyncGenerator[StreamedResponse]:
        _settings, params = self.prepare_request(model_settings, model_request_parameters)
        items = self._next_turn(messages)
        stream = self._stream_for(items, params)
        if items and items[0]["type"] == "error":  # the request itself failed (e.g. a 429): nothing streamed
            stream._apply(items[0])
        yield stream


def create_replay_agent_provider(
    recording: Iterable[Iterable[Any]], *, model_name: str | None = None, system: str | None = None
) -> ReplayModel:
    """A pydantic-ai ``Model`` replaying ``recording`` one turn per request, with no network.

    ``model_name`` and ``system`` (the provider name the runtime sees) default to what the recording's
    first ``finish`` item says, else ``'replay'``."""
    return ReplayModel(recording, model_name=model_name, system=system)


# ----------------------------------------------------------------------------------------- record


def _args_text(args: Any) -> str | None:
    if args is None or isinstance(args, str):
        return args
    return json.dumps(args)


def _item_for(event: ModelResponseStreamEvent) -> dict[str, Any] | None:
    """The recording item of one stream event (None for events that carry nothing new)."""
    if isinstance(event, PartStartEvent):
        p = event.part
        if isinstance(p, TextPart):
            item: dict[str, Any] = {"type": "text", "part": event.index, "delta": p.content}
            extra = {"id": p.id, "provider_name": p.provider_name, "provider_details": p.provider_details}
        elif isinstance(p, ThinkingPart):
            item = {"type": "thinking", "part": event.index, "delta": p.content}
            extra = {
                "id": p.id,
                "signature": p.signature,
                "provider_name": p.provider_name,
                "provider_details": p.provider_details,
            }
        elif isinstance(p, ToolCallPart):
            item = {"type": "tool-call", "part": event.index, "tool_name": p.tool_name, "call_id": p.tool_call_id}
            extra = {"args": _args_text(p.args)}
        else:
            return {"type": "part", "part": event.index, "value": to_jsonable_python(p)}
        item.update({k: to_jsonable_python(v) for k, v in extra.items() if v is not None})
        return item
    if isinstance(event, PartDeltaEvent):
        d = event.delta
        if isinstance(d, TextPartDelta):
            item = {"type": "text", "part": event.index, "delta": d.content_delta}
            if d.provider_details:
                item["provider_details"] = to_jsonable_python(d.provider_details)
            return item
        if isinstance(d, ThinkingPartDelta):
            item = {"type": "thinking", "part": event.index, "delta": d.content_delta}
            if d.signature_delta is not None:
                item["signature"] = d.signature_delta
            return item
        if isinstance(d, ToolCallPartDelta):
            item = {"type": "tool-call", "part": event.index}
            if d.tool_name_delta:
                item["tool_name"] = d.tool_name_delta
            if d.tool_call_id:
                item["call_id"] = d.tool_call_id
            if d.args_delta:
                item["args"] = _args_text(d.args_delta)
            return item
    return None  # PartEndEvent, FinalResultEvent, and events a newer pydantic-ai may add


def _error_item(error: BaseException) -> dict[str, Any]:
    return {"type": "error", "error_type": type(error).__name__, "message": str(error)}


class _RecordingStream:
    """Forwards everything to the real ``StreamedResponse`` and notes each event it hands out."""

    def __init__(self, inner: StreamedResponse, items: list[dict[str, Any]]) -> None:
        self._inner = inner
        self._items = items
        self._iterator: AsyncIterator[ModelResponseStreamEvent] | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def __aiter__(self) -> AsyncIterator[ModelResponseStreamEvent]:
        if self._iterator is None:
            self._iterator = self._events()
        return self._iterator

    async def _events(self) -> AsyncIterator[ModelResponseStreamEvent]:
        iterator = aiter(self._inner)
        while True:
            try:
                event = await anext(iterator)
            except StopAsyncIteration:
                return
            except Exception as error:  # the provider failed mid-stream: that is part of the recording
                self._items.append(_error_item(error))
                raise
            item = _item_for(event)
            if item is not None:
                self._items.append(item)
            yield event


class RecordingModel(WrapperModel):
    """Wraps a real model; every streamed or plain request appends one turn to ``recording``."""

    def __init__(self, wrapped: Model) -> None:
        super().__init__(wrapped)
        self.recording: list[list[dict[str, Any]]] = []

    @staticmethod
    def _closing_items(response: ModelResponse | StreamedResponse) -> list[dict[str, Any]]:
        usage = response.usage
        items: list[dict[str, Any]] = []
        if usage.has_values():
            values = to_jsonable_python(usage)
            values.pop("unmeasured_requests", None)
            items.append({"type": "usage", **{k: v for k, v in values.items() if v}})
        finish: dict[str, Any] = {"type": "finish"}
        for key in ("finish_reason", "model_name", "provider_name", "provider_response_id"):
            value = getattr(response, key, None)
            if value is not None:
                finish[key] = value
        items.append(finish)
        return items

    async def request(
        self,
        messages: list[ModelMessage],
        model_settings: ModelSettings | None,
        model_request_parameters: ModelRequestParameters,
    ) -> ModelResponse:
        items: list[dict[str, Any]] = []
        self.recording.append(items)
        try:
            response = await self.wrapped.request(messages, model_settings, model_request_parameters)
        except Exception as error:
            items.append(_error_item(error))
            raise
        for index, part in enumerate(response.parts):
            item = _item_for(PartStartEvent(index=index, part=part))
            if item is not None:
                items.append(item)
        items.extend(self._closing_items(response))
        return response

    @asynccontextmanager
    async def request_stream(
        self,
        messages: list[ModelMessage],
        model_settings: ModelSettings | None,
        model_request_parameters: ModelRequestParameters,
        run_context: Any = None,
    ) -> AsyncGenerator[StreamedResponse]:
        items: list[dict[str, Any]] = []
        self.recording.append(items)
        opened = False
        try:
            async with self.wrapped.request_stream(
                messages, model_settings, model_request_parameters, run_context
            ) as stream:
                opened = True
                recorder = _RecordingStream(stream, items)
                yield recorder  # type: ignore[misc]  # a forwarding proxy of the real StreamedResponse
        except Exception as error:
            if not opened:  # the request itself failed (HTTP error, first chunk unreadable)
                items.append(_error_item(error))
            raise
        else:
            if not any(i["type"] == "error" for i in items):
                items.extend(self._closing_items(stream))


def record_agent_provider(model: Model) -> RecordingModel:
    """Wrap ``model`` so that each answer it streams is captured in ``.recording`` (JSON-serializable),
    ready for :func:`create_replay_agent_provider`."""
    return RecordingModel(model)
