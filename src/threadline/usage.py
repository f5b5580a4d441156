"""What a run says it spent, with per-field provenance.

Provenance, read before the number:

- ``provider-reported`` — the provider handed over exactly this figure (one step's usage; OpenRouter's
  cost, which it reports in US dollars);
- ``computed`` — threadline added reported figures up (every total, e.g. a terminal event's usage);
- ``estimated`` — a guess: a price-table cost (genai-prices), a tokenizer count. A total with an
  estimated part is itself ``estimated``, never ``computed``;
- ``unavailable`` — nobody reported it. Not zero.

Summation rules (stitchkit 0.62, "What a run says it spent"):

- a token total over a step that reported nothing is a **floor**: the sum of what was reported, labelled
  ``computed`` with ``floor=True`` (and the usage's ``complete`` is false);
- a cost over a step that did not report its cost is ``unavailable``, and it **stays** unavailable:
  later steps reporting normally cannot revive it;
- two costs in different currencies do not add: the sum is ``unavailable``; nothing is ever converted;
- a failed attempt's usage stays in the run's spend (add it like any other step).

The rules hold per field: a field one step left ``unavailable`` and another reported sums to a
``computed`` floor, and a field no step reported stays ``unavailable`` (not a floor of 0).

Which token fields a step reported (pydantic-ai 2.68). pydantic-ai's ``RequestUsage`` reads 0 for every
field nobody set, so the number alone cannot tell "the provider said 0" from "the provider said nothing".
What can: the instance's own ``__dict__`` holds only the fields its mapping set. The provider mappings
hand the wire usage to genai-prices (``RequestUsage.extract``), whose extractor returns only the fields
present in the payload (``None`` ones are dropped), and their own fix-ups set a field only when the wire
had it (Google's stream is the exception, below); the rest set input and output only. So, per detail
field (``cache_read_tokens``, ``cache_write_tokens``, ``reasoning_tokens`` from ``output_reasoning_tokens``):

- set on the instance → ``provider-reported``, a carried 0 included (it is a real 0);
- not set → ``unavailable``;
- when the set fields cannot be trusted (below) → ``provider-reported`` if non-zero, else ``unavailable``.

Per provider mapping:

- **OpenAI Chat** (and every OpenAI-compatible server: Ollama, vLLM, DeepSeek, OpenRouter…):
  ``prompt_tokens_details.cached_tokens`` → cache read, ``prompt_tokens_details.cache_write_tokens`` →
  cache write, ``completion_tokens_details.reasoning_tokens`` → reasoning; a server that sends no
  ``*_details`` object leaves them ``unavailable``. A field the genai-prices extractor for that provider
  does not map (Cerebras has no cache read) stays ``unavailable`` too: pydantic-ai never surfaces it.
- **OpenAI Responses**: ``input_tokens_details.cached_tokens`` / ``.cache_write_tokens``,
  ``output_tokens_details.reasoning_tokens`` (``details['reasoning_tokens']`` is filled with 0 even when
  absent, so it is not read).
- **Anthropic**: ``cache_read_input_tokens`` / ``cache_creation_input_tokens``
  when the response carried them (0 included; streamed, they come from ``message_start``). Reasoning:
  the mapping keeps ``output_tokens_details.thinking_tokens`` only when non-zero, so a 0 or an absent
  count is ``unavailable``.
- **Google** (``provider_name`` ``google`` / ``google-cloud``): a streamed response zero-fills cache read,
  cache write and the audio fields on every chunk (``_backfill_dropped_token_fields``), and the Gemini API
  typically omits a zero count anyway, so a Google zero is never trusted: ``cachedContentTokenCount`` /
  ``thoughtsTokenCount`` count when non-zero. Gemini reports no cache writes: always ``unavailable``.
- **Bedrock Converse**: ``cacheReadInputTokens`` / ``cacheWriteInputTokens`` when present; no reasoning
  count (``unavailable``). **Groq**, **Mistral**: like OpenAI Chat. **Cohere**: ``cached_tokens``.
  **xAI**: only non-zero counts are passed on, so a 0 is ``unavailable``. **Hugging Face**: input and
  output only.
- **FunctionModel / TestModel**: input and output only (pydantic-ai's word-count estimate, labelled as
  the model's report); a ``FunctionModel`` function that returns its own ``usage`` reports what it set.
- A ``RequestUsage`` that was validated from JSON (a stored or replayed response) has every field set,
  0s included; a zero-filled one is recognised by ``cache_write_tokens`` and ``cache_audio_read_tokens``
  both being set, which no single extractor does (Google's stream backfill and validation do).

Audio token counts are not exposed: threadline sends and renders no audio, and they are already inside
the input and output totals.

Addition is associative, and ``AgentUsage()`` (no steps) contributes nothing, so a run total is
``functools.reduce(operator.add, steps, AgentUsage())`` in any grouping. A run's cumulative usage is stored
with its row (:attr:`threadline.records.Run.usage`), in the compact form of :func:`stored_usage`.
"""

from __future__ import annotations

from decimal import Decimal, InvalidOperation
from numbers import Real
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ._evolve import build, evolve

if TYPE_CHECKING:
    from pydantic_ai.messages import ModelResponse
    from pydantic_ai.usage import RequestUsage  # only read, never built: importing pydantic-ai costs ~0.5 s

Provenance = Literal["provider-reported", "computed", "estimated", "unavailable"]
TOKEN_FIELDS = ("input_tokens", "output_tokens", "cache_read_tokens", "cache_write_tokens", "reasoning_tokens")
USD = "USD"


class UsageFigure(BaseModel):
    """One token count. ``value`` is None exactly when it is ``unavailable``; ``floor`` marks a total
    that left out at least one step which reported nothing (the true count is at least ``value``)."""

    model_config = ConfigDict(frozen=True)

    value: int | None = None
    provenance: Provenance = "unavailable"
    floor: bool = False


class AgentCost(BaseModel):
    """Money, with an ISO 4217 currency code. ``amount`` is None exactly when ``unavailable``."""

    model_config = ConfigDict(frozen=True)

    amount: Decimal | None = None
    currency: str | None = Field(default=None, pattern=r"^[A-Z]{3}$")
    provenance: Provenance = "unavailable"

    @model_validator(mode="after")
    def _consistent(self) -> AgentCost:
        if self.amount is None:
            if self.provenance != "unavailable":
                raise ValueError("a cost without an amount is 'unavailable'")
        else:
            if self.provenance == "unavailable":
                raise ValueError("an 'unavailable' cost has no amount")
            if self.currency is None:
                raise ValueError("a cost with an amount names its currency")
        return self


_FIGURES: dict[tuple[int | None, str, bool], UsageFigure] = {}
_FIGURES_LIMIT = 4096


def _figure(value: int | None, provenance: Provenance, floor: bool = False) -> UsageFigure:
    """A shared ``UsageFigure`` (frozen, of immutable values): every step builds several, mostly the same."""
    key = (value, provenance, floor)
    figure = _FIGURES.get(key)
    if figure is None:
        if len(_FIGURES) >= _FIGURES_LIMIT:
            _FIGURES.clear()
        figure = _FIGURES[key] = UsageFigure(value=value, provenance=provenance, floor=floor)
    return figure


def _reported(value: Any) -> UsageFigure:
    """A provider's token count as a step's figure. A count that is not a whole, non-negative number of
    tokens (a provider reporting 3.5 input tokens) is no usable figure: ``unavailable``, never a failed
    run that already answered."""
    figure = _FIGURES.get((value, "provider-reported", False))
    if figure is not None:  # the usual case: a count seen before
        return figure
    if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0:
        return _UNAVAILABLE
    if isinstance(value, float):
        if not value.is_integer():
            return _UNAVAILABLE
        value = int(value)
    return _figure(value, "provider-reported")


def _carried(value: Any, zero_known: bool) -> UsageFigure:
    """A detail field as a step's figure: ``value`` is what its mapping set, None when it set nothing."""
    if value is None or (not value and not zero_known):
        return _UNAVAILABLE
    return _reported(value)


_ZERO_FILLING_PROVIDERS = frozenset({"google", "google-cloud", "google-gla", "google-vertex"})
"""``ModelResponse.provider_name`` of the mappings that set detail fields to 0 the provider never sent
(pydantic-ai's ``GoogleModel``, current and legacy names): a 0 from them is not a report."""


def _total_provenance(*provenances: Provenance) -> Provenance:
    """A sum is ``computed`` unless one of its known parts was a guess."""
    return "estimated" if "estimated" in provenances else "computed"


class AgentUsage(BaseModel):
    """Token counts and cost of one step or of a whole run (``steps`` steps).

    ``complete`` is false when at least one step reported no token usage at all. An ``AgentUsage()``
    with no steps is the empty sum: every field ``unavailable``, and adding it changes no figure.
    """

    model_config = ConfigDict(frozen=True)

    input_tokens: UsageFigure = UsageFigure()
    output_tokens: UsageFigure = UsageFigure()
    cache_read_tokens: UsageFigure = UsageFigure()
    cache_write_tokens: UsageFigure = UsageFigure()
    reasoning_tokens: UsageFigure = UsageFigure()
    cost: AgentCost = AgentCost()
    steps: int = Field(default=0, ge=0)
    complete: bool = True

    # ------------------------------------------------------------------------------------ construction

    @classmethod
    def unreported(cls) -> AgentUsage:
        """One step that reported nothing (a provider call that failed or was cut off before usage)."""
        return _UNREPORTED if cls is AgentUsage else cls(steps=1, complete=False)

    @classmethod
    def from_request(cls, usage: RequestUsage | None, *, provider_name: str | None = None) -> AgentUsage:
        """One provider response's token usage (cost ``unavailable``); a response that omitted usage is
        all ``unavailable``. Prefer :meth:`from_response`, which also knows the cost.

        Input and output are the provider's figures (a count that is not a whole number of tokens is
        ``unavailable``). Each detail field is ``provider-reported`` when the
        response carried it (a carried 0 is a real 0) and ``unavailable`` when it did not, read from which
        fields ``usage``'s mapping set (the module docstring has the rule per provider). ``provider_name``
        (``ModelResponse.provider_name``) names a mapping that zero-fills fields: there a 0 is
        ``unavailable``."""
        if usage is None or usage.unmeasured_requests or (usage.input_tokens == 0 and usage.output_tokens == 0):
            return cls.unreported()
        carried = usage.__dict__  # only the fields the mapping set; the class defaults read 0 for the rest
        zero_known = provider_name not in _ZERO_FILLING_PROVIDERS and not (
            "cache_audio_read_tokens" in carried and "cache_write_tokens" in carried
        )
        figures = {
            "input_tokens": _reported(usage.input_tokens),
            "output_tokens": _reported(usage.output_tokens),
            "cache_read_tokens": _carried(carried.get("cache_read_tokens"), zero_known),
            "cache_write_tokens": _carried(carried.get("cache_write_tokens"), zero_known),
            "reasoning_tokens": _carried(carried.get("output_reasoning_tokens"), zero_known),
        }
        # every figure is a valid field value: a subclass is validated, the hot path is not
        return evolve(_ONE_STEP, figures) if cls is AgentUsage else cls(steps=1, **figures)

    @classmethod
    def from_response(cls, response: ModelResponse | None) -> AgentUsage:
        """One step's usage from a pydantic-ai ``ModelResponse`` (a partial one too), with its cost:

        - ``provider_details['cost']`` (OpenRouter, US dollars) or ``usage.cost`` (a gateway's own figure)
          is ``provider-reported``;
        - otherwise ``ModelResponse.cost()`` from the genai-prices tables is ``estimated`` (US dollars);
        - an unknown model or provider, or a response without usage, gives ``unavailable``. Never raises.
        """
        if response is None:
            return cls.unreported()
        tokens = cls.from_request(response.usage, provider_name=response.provider_name)
        cost = _reported_cost(response)
        if cost is None and tokens.complete:
            cost = _estimated_cost(response)
        return evolve(tokens, {"cost": cost}) if cost is not None else tokens

    # ---------------------------------------------------------------------------------------- addition

    def _token_missing(self, figure: UsageFigure) -> bool:
        """Whether a step inside this usage reported nothing for ``figure``'s field."""
        return figure.floor or (figure.value is None and self.steps > 0)

    def _cost_poisoned(self) -> bool:
        """Whether a step inside this usage has no usable cost (unreported, or a currency clash)."""
        fields = self.__dict__
        return fields["cost"].__dict__["amount"] is None and fields["steps"] > 0

    def __add__(self, other: object) -> AgentUsage:
        if not isinstance(other, AgentUsage):
            return NotImplemented
        # one pass, no helper calls: a run adds every step's usage (``_token_missing`` and
        # ``_total_provenance`` say the same rules one field at a time)
        # (fields are read from the records' ``__dict__``: pydantic's attribute hook costs several dict lookups)
        figures: dict[str, Any] = {}
        mine, theirs = self.__dict__, other.__dict__
        my_steps, their_steps = mine["steps"] > 0, theirs["steps"] > 0
        for name in TOKEN_FIELDS:
            a, b = mine[name], theirs[name]
            if a is _UNAVAILABLE and b is _UNAVAILABLE:  # the shared figure of a field nobody reported
                figures[name] = _UNAVAILABLE
                continue
            a, b = a.__dict__, b.__dict__
            av, bv = a["value"], b["value"]
            if av is None:
                if bv is None:
                    figures[name] = _UNAVAILABLE
                    continue
                value, estimated = bv, b["provenance"] == "estimated"
            elif bv is None:
                value, estimated = av, a["provenance"] == "estimated"
            else:
                value, estimated = av + bv, a["provenance"] == "estimated" or b["provenance"] == "estimated"
            missing = a["floor"] or b["floor"] or (av is None and my_steps) or (bv is None and their_steps)
            figures[name] = _figure(value, "estimated" if estimated else "computed", missing)
        figures["cost"] = self._add_cost(other)
        figures["steps"] = mine["steps"] + theirs["steps"]
        figures["complete"] = mine["complete"] and theirs["complete"]
        # every value above is already a valid field value: no need to validate the sum again
        return build(_SUM, figures)

    def __radd__(self, other: object) -> AgentUsage:
        if other == 0:  # sum(usages) starts from 0
            return self + AgentUsage()
        return NotImplemented

    def _add_cost(self, other: AgentUsage) -> AgentCost:
        if self._cost_poisoned() or other._cost_poisoned():
            return _NO_COST  # sticky: one unreported step makes the total unknown, not smaller
        known = [c for c in (self.cost, other.cost) if c.amount is not None]
        if not known:
            return _NO_COST
        if len({c.currency for c in known}) > 1:
            return _NO_COST  # two currencies do not add, and nothing converts one into the other
        return AgentCost(
            amount=sum((c.amount for c in known if c.amount is not None), Decimal(0)),
            currency=known[0].currency,
            provenance=_total_provenance(*(c.provenance for c in known)),
        )


def _decimal(value: Any) -> Decimal | None:
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, Decimal):
        amount = value
    elif isinstance(value, Real | str):
        try:
            amount = Decimal(str(value))  # str() keeps 0.0123 as 0.0123, not its binary expansion
        except InvalidOperation:
            return None
    else:
        return None
    return amount if amount.is_finite() and amount >= 0 else None


def _reported_cost(response: ModelResponse) -> AgentCost | None:
    details = response.provider_details or {}
    for raw in (details.get("cost"), response.usage.cost if response.usage is not None else None):
        amount = _decimal(raw)
        if amount is not None:
            return AgentCost(amount=amount, currency=USD, provenance="provider-reported")
    return None


_UNPRICED: dict[tuple[str, str | None, str | None], None] = {}
"""Models the price tables do not know (looking one up scans the tables: tens of microseconds per step)."""
_UNPRICED_LIMIT = 256


def _estimated_cost(response: ModelResponse) -> AgentCost | None:
    if not response.model_name:
        return None
    key = (response.model_name, response.provider_name, response.provider_url)
    if key in _UNPRICED:
        return None
    try:
        price = response.cost()
    except LookupError:  # an unknown model or provider stays unknown: remember it (bounded)
        if len(_UNPRICED) >= _UNPRICED_LIMIT:
            _UNPRICED.pop(next(iter(_UNPRICED)))
        _UNPRICED[key] = None
        return None
    except Exception:  # ValueError: usage not measured; anything else: a price table is an estimate
        return None  # and never fails the run that asked for it
    amount = _decimal(price.total_price)
    return AgentCost(amount=amount, currency=USD, provenance="estimated") if amount is not None else None


_STORED: dict[int, tuple[AgentUsage, dict[str, Any]]] = {}
_STORED_LIMIT = 512


def stored_usage(usage: AgentUsage) -> dict[str, Any]:
    """``usage`` as a stored run row keeps it: only what differs from the defaults of ``AgentUsage()``, so it
    validates back to an equal record (a run row is written several times a turn, and the full form of
    five figures and a cost is half of its JSON even when nothing was spent). Remembered per usage
    record (frozen, of frozen figures): a run's rows carry the same one until it spends again."""
    known = _STORED.get(id(usage))
    if known is not None and known[0] is usage:
        return known[1]
    if len(_STORED) >= _STORED_LIMIT:
        _STORED.clear()
    out = _stored(usage)
    _STORED[id(usage)] = (usage, out)
    return out


def _stored(usage: AgentUsage) -> dict[str, Any]:
    fields = usage.__dict__
    out: dict[str, Any] = {}
    for name in TOKEN_FIELDS:
        figure = fields[name]
        if figure is _UNAVAILABLE:  # the shared figure of the usual case: nothing to keep
            continue
        f = figure.__dict__
        value, provenance, floor = f["value"], f["provenance"], f["floor"]
        if value is None and provenance == "unavailable" and not floor:
            continue
        entry: dict[str, Any] = {} if value is None else {"value": value}
        if provenance != "unavailable":
            entry["provenance"] = provenance
        if floor:
            entry["floor"] = True
        out[name] = entry
    cost = fields["cost"]
    if cost is not _NO_COST and cost != _NO_COST:
        out["cost"] = cost
    if fields["steps"]:
        out["steps"] = fields["steps"]
    if not fields["complete"]:
        out["complete"] = False
    return out


_NO_COST = AgentCost()
_UNAVAILABLE = _figure(None, "unavailable")
NO_USAGE = AgentUsage()
"""Nothing spent yet (frozen, so one instance serves every run)."""
_ONE_STEP = AgentUsage(steps=1, **dict.fromkeys(TOKEN_FIELDS, _UNAVAILABLE))  # every field set: evolve shares it
_SUM = AgentUsage(cost=_NO_COST, steps=0, complete=True, **dict.fromkeys(TOKEN_FIELDS, _UNAVAILABLE))
"""What a sum is built from (``build``): every field set, as a sum sets every field."""
_UNREPORTED = AgentUsage(steps=1, complete=False)
