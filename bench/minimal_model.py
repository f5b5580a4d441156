"""A zero-latency scripted pydantic-ai ``Model`` whose cost per request does not depend on the history.

pydantic-ai's ``FunctionModel`` scans every message of the prompt on each request (its instruction-state
check and usage estimate), so with it a turn at 2,000 messages also measures that scan. This model only
looks at the last message, so ``bench/turns.py --model minimal`` measures threadline's own overhead. Same
workload: a ``lookup`` call, then the answer once the tool result is in.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from pydantic_ai.messages import ModelMessage, ModelRequest, ModelResponseStreamEvent, ToolReturnPart
from pydantic_ai.models import Model, ModelRequestParameters, StreamedResponse
from pydantic_ai.settings import ModelSettings
from pydantic_ai.usage import RequestUsage
from workload import ANSWER, QUERY, TOOL_NAME


@dataclass
class _Stream(StreamedResponse):
    answer: bool = False
    call_id: str = ""
    _timestamp: datetime = field(default_factory=lambda: datetime.now(UTC))

    async def _get_event_iterator(self) -> AsyncIterator[ModelResponseStreamEvent]:
        self._usage = RequestUsage(input_tokens=50, output_tokens=40)
        if self.answer:
            for event in self._parts_manager.handle_text_delta(vendor_part_id="content", content=ANSWER):
                yield event
        else:
            for event in self._parts_manager.handle_tool_call_delta_events(
                vendor_part_id=0, tool_name=TOOL_NAME, args=f'{{"query": "{QUERY}"}}', tool_call_id=self.call_id
            ):
                yield event

    @property
    def model_name(self) -> str:
        return "minimal"

    @property
    def provider_name(self) -> str:
        return "minimal"

    @property
    def provider_url(self) -> None:
        return None

    @property
    def timestamp(self) -> datetime:
        return self._timestamp


class MinimalScriptedModel(Model):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    async def request(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError("stream only")

    @asynccontextmanager
    async def request_stream(
        self,
        messages: list[ModelMessage],
        model_settings: ModelSettings | None,
        model_request_parameters: ModelRequestParameters,
        run_context: Any = None,
    ) -> AsyncIterator[StreamedResponse]:
        self.calls += 1
        last = messages[-1]
        answer = isinstance(last, ModelRequest) and any(isinstance(p, ToolReturnPart) for p in last.parts)
        yield _Stream(model_request_parameters=model_request_parameters, answer=answer, call_id=f"call-{self.calls}")

    @property
    def model_name(self) -> str:
        return "minimal"

    @property
    def system(self) -> str:
        return "minimal"
