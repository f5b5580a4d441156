"""What a run says it spent, with per-field provenance.

Provenance: ``provider-reported`` (a provider's own figure), ``computed`` (threadline added reported
figures), ``estimated`` (a price table or a tokenizer guess) and ``unavailable``. A token total over a
step that reported nothing is a floor (kept, marked ``computed`` with ``complete=False``); a cost over
such a step is ``unavailable`` and stays so. Usage is not written to the store.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict
from pydantic_ai.usage import RequestUsage

Provenance = Literal["provider-reported", "computed", "estimated", "unavailable"]
TOKEN_FIELDS = ("input_tokens", "output_tokens", "cache_read_tokens", "cache_write_tokens", "reasoning_tokens")


class UsageFigure(BaseModel):
    model_config = ConfigDict(frozen=True)

    value: int | None = None
    provenance: Provenance = "unavailable"


class AgentUsage(BaseModel):
    """Token counts of one step or a whole run. ``complete`` is false when a step reported nothing."""

    model_config = ConfigDict(frozen=True)

    input_tokens: UsageFigure = UsageFigure()
    output_tokens: UsageFigure = UsageFigure()
    cache_read_tokens: UsageFigure = UsageFigure()
    cache_write_tokens: UsageFigure = UsageFigure()
    reasoning_tokens: UsageFigure = UsageFigure()
    steps: int = 0
    complete: bool = True

    @classmethod
    def from_request(cls, usage: RequestUsage | None) -> AgentUsage:
        """One provider response's usage; a response that omitted usage is all ``unavailable``."""
        if usage is None or usage.unmeasured_requests or (usage.input_tokens == 0 and usage.output_tokens == 0):
            return cls(steps=1, complete=False)
        values = {
            "input_tokens": usage.input_tokens,
            "output_tokens": usage.output_tokens,
            "cache_read_tokens": usage.cache_read_tokens,
            "cache_write_tokens": usage.cache_write_tokens,
            "reasoning_tokens": usage.output_reasoning_tokens,
        }
        figures = {k: UsageFigure(value=v, provenance="provider-reported") for k, v in values.items()}
        return cls(steps=1, **figures)

    def __add__(self, other: AgentUsage) -> AgentUsage:
        figures = {}
        for name in TOKEN_FIELDS:
            a, b = getattr(self, name), getattr(other, name)
            known = [f.value for f in (a, b) if f.value is not None]
            figures[name] = UsageFigure(value=sum(known), provenance="computed") if known else UsageFigure()
        return AgentUsage(steps=self.steps + other.steps, complete=self.complete and other.complete, **figures)
