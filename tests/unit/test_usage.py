"""Usage and cost with per-field provenance (``threadline.usage``), against stitchkit 0.62's "What a run
says it spent".

Pins, one by one: a step's figures are ``provider-reported``; every total is ``computed`` (``estimated``
when a part was a guess); a token total over a step that reported nothing is a floor; a cost over a step
that did not report its cost is ``unavailable`` and stays so; two currencies do not add; a run that
reported nothing has every field ``unavailable`` (not zero); a failed attempt's spend stays in the total.
Properties: addition is associative; unavailable cost is sticky in any order and grouping; a currency
mismatch anywhere poisons the total. ``from_response`` on real pydantic-ai ``ModelResponse`` objects:
genai-prices gives ``estimated`` USD, OpenRouter's ``provider_details['cost']`` gives
``provider-reported`` USD, an unknown model gives ``unavailable`` without raising.

Per-field provenance through each provider's own pydantic-ai mapping (issue 17 §3): a detail field (cache
read, cache write, reasoning) the response carried is ``provider-reported``, a carried 0 included; one it
did not carry is ``unavailable``, although pydantic-ai reads it as 0. OpenAI Chat and Anthropic are driven
end to end (their SDK clients over an ``httpx`` mock transport, request and stream), the OpenAI Responses
and Anthropic mappings also directly; Google through ``GoogleModel``'s own response processing (skipped
without ``google-genai``); Bedrock, Groq and Mistral, whose SDKs are not installed, through the one call
their mappings make (``RequestUsage.extract`` on the wire usage); FunctionModel and TestModel as they
run. A zero-filled ``RequestUsage`` (Google's stream backfill, one validated from JSON) trusts no 0.
"""

from __future__ import annotations

import functools
import json
import operator
from decimal import Decimal
from typing import Any

import httpx
import httpx2
import pytest
from anthropic import AsyncAnthropic
from anthropic.types.beta import BetaMessage, BetaUsage
from hypothesis import given, settings, strategies as st
from openai import AsyncOpenAI
from openai.types.chat import ChatCompletion
from openai.types.completion_usage import CompletionTokensDetails, CompletionUsage, PromptTokensDetails
from openai.types.responses import Response as OpenAIResponse, ResponseUsage
from openai.types.responses.response_usage import InputTokensDetails, OutputTokensDetails
from pydantic import ValidationError
from pydantic_ai.messages import (
    ModelMessage,
    ModelMessagesTypeAdapter,
    ModelRequest,
    ModelResponse,
    TextPart,
    UserPromptPart,
)
from pydantic_ai.models import Model, ModelRequestParameters
from pydantic_ai.models.anthropic import AnthropicModel
from pydantic_ai.models.anthropic._response import map_usage as anthropic_map_usage
from pydantic_ai.models.function import AgentInfo, FunctionModel
from pydantic_ai.models.openai import OpenAIChatModel
from pydantic_ai.models.openai._response_fields import map_usage as openai_map_usage
from pydantic_ai.models.test import TestModel
from pydantic_ai.providers.anthropic import AnthropicProvider
from pydantic_ai.providers.openai import OpenAIProvider
from pydantic_ai.usage import RequestUsage

from threadline.events import TerminalEvent
from threadline.usage import TOKEN_FIELDS, AgentCost, AgentUsage, UsageFigure


def step(tokens: int = 100, cost: str | None = "0.01", currency: str = "USD", provenance: str = "provider-reported"):
    """One step that reported ``tokens`` of each kind and, when ``cost`` is given, that cost."""
    figure = UsageFigure(value=tokens, provenance="provider-reported")
    money = AgentCost(amount=Decimal(cost), currency=currency, provenance=provenance) if cost else AgentCost()
    return AgentUsage(steps=1, cost=money, **dict.fromkeys(TOKEN_FIELDS, figure))


def total(*usages: AgentUsage) -> AgentUsage:
    return functools.reduce(operator.add, usages, AgentUsage())


def response(usage: RequestUsage, **fields) -> ModelResponse:
    return ModelResponse(parts=[TextPart("hi")], usage=usage, **fields)


GPT4O_USAGE = RequestUsage(input_tokens=1000, cache_read_tokens=400, output_tokens=200, output_reasoning_tokens=50)

# ----------------------------------------------------------------------------- the 0.62 rules, one by one


def test_a_step_reports_provider_figures():
    usage = AgentUsage.from_request(GPT4O_USAGE)
    assert usage.steps == 1 and usage.complete
    assert usage.input_tokens == UsageFigure(value=1000, provenance="provider-reported")
    assert usage.cache_read_tokens.value == 400
    assert usage.output_tokens.value == 200
    assert usage.reasoning_tokens.value == 50
    assert usage.cost.provenance == "unavailable"  # from_request knows no money


def test_a_run_total_is_computed_even_over_one_step():
    run = total(AgentUsage.from_request(GPT4O_USAGE))
    for name in ("input_tokens", "output_tokens", "cache_read_tokens", "reasoning_tokens"):
        assert getattr(run, name).provenance == "computed"
        assert not getattr(run, name).floor
    assert run.input_tokens.value == 1000
    assert run.cache_write_tokens == UsageFigure()  # no step carried it: unavailable, not a floor of 0


def test_a_cost_sum_over_reported_steps_is_computed_not_provider_reported():
    run = total(step(cost="0.01"), step(cost="0.02"))
    assert run.cost == AgentCost(amount=Decimal("0.03"), currency="USD", provenance="computed")


def test_a_total_with_an_estimated_part_is_estimated():
    run = total(step(cost="0.01"), step(cost="0.02", provenance="estimated"))
    assert run.cost.provenance == "estimated"
    assert run.cost.amount == Decimal("0.03")


def test_a_token_total_with_an_unreported_step_is_a_floor():
    run = total(step(tokens=100), AgentUsage.unreported(), step(tokens=50))
    assert run.input_tokens == UsageFigure(value=150, provenance="computed", floor=True)
    assert not run.complete
    assert run.steps == 3


def test_a_cost_with_an_unreported_step_is_unavailable_not_a_floor():
    run = total(step(cost="1.00"), AgentUsage.unreported())
    assert run.cost == AgentCost()
    assert run.cost.amount is None


def test_an_unavailable_cost_stays_unavailable_when_later_steps_report():
    run = total(AgentUsage.unreported(), step(cost="1.00"), step(cost="2.00"))
    assert run.cost.provenance == "unavailable"
    # a step that reported tokens but no cost (no price known) poisons the total just the same
    assert total(step(cost="1.00"), step(cost=None), step(cost="2.00")).cost.provenance == "unavailable"


def test_two_currencies_do_not_add():
    run = total(step(cost="1.00", currency="USD"), step(cost="1.00", currency="EUR"))
    assert run.cost == AgentCost()
    # and the clash is sticky too: a later USD step does not pick a label
    assert total(run, step(cost="1.00", currency="USD")).cost.provenance == "unavailable"


def test_a_run_that_reported_nothing_carries_every_field_unavailable():
    for run in (AgentUsage(), total(AgentUsage.unreported()), total(AgentUsage.from_response(None))):
        for name in TOKEN_FIELDS:
            assert getattr(run, name) == UsageFigure()  # None, not 0
        assert run.cost == AgentCost()
    terminal = TerminalEvent(
        event_id="r:terminal:3",
        conversation_id="c",
        run_id="r",
        version=3,
        terminal_reason="interrupted",
        usage=AgentUsage(),
    )
    assert terminal.model_dump(mode="json")["usage"]["cost"] == {
        "amount": None,
        "currency": None,
        "provenance": "unavailable",
    }
    with pytest.raises(ValidationError):  # a terminal event cannot omit usage
        TerminalEvent(event_id="r:terminal:3", conversation_id="c", run_id="r", version=3, terminal_reason="success")


def test_a_run_that_spent_nothing_differs_from_one_that_reported_nothing():
    never_called = AgentUsage()
    cut_off = total(AgentUsage.unreported())
    assert never_called.steps == 0 and cut_off.steps == 1
    assert never_called.complete and not cut_off.complete


def test_a_failed_attempts_spend_stays_in_the_run_total():
    failed_attempt = step(tokens=40, cost="0.004")
    retry = step(tokens=60, cost="0.006")
    run = total(failed_attempt, retry)
    assert run.input_tokens.value == 100
    assert run.cost.amount == Decimal("0.010")
    assert run.steps == 2


def test_sum_builtin_and_reduce_agree():
    parts = [step(tokens=1), step(tokens=2), step(tokens=3)]
    assert sum(parts) == total(*parts)


def test_cost_invariants_are_enforced():
    with pytest.raises(ValidationError):
        AgentCost(amount=Decimal(1), provenance="computed")  # no currency
    with pytest.raises(ValidationError):
        AgentCost(amount=Decimal(1), currency="usd", provenance="computed")  # not an ISO code
    with pytest.raises(ValidationError):
        AgentCost(provenance="computed")  # a known cost without an amount
    with pytest.raises(ValidationError):
        AgentCost(amount=Decimal(1), currency="USD", provenance="unavailable")


def test_usage_round_trips_json_with_exact_money():
    run = total(step(cost="0.0123"), step(cost="0.0001"))
    again = AgentUsage.model_validate_json(run.model_dump_json())
    assert again == run
    assert again.cost.amount == Decimal("0.0124")


# --------------------------------------------------------------------------------------------- properties

costs = st.one_of(
    st.none(),
    st.tuples(
        st.decimals(min_value=0, max_value=1000, places=6, allow_nan=False, allow_infinity=False),
        st.sampled_from(["USD", "EUR"]),
        st.sampled_from(["provider-reported", "estimated"]),
    ),
)


@st.composite
def step_usages(draw, currencies=("USD", "EUR")) -> AgentUsage:
    if draw(st.booleans()) and draw(st.booleans()):
        return AgentUsage.unreported()
    figure = UsageFigure(value=draw(st.integers(0, 10**9)), provenance="provider-reported")
    cost = draw(costs)
    money = AgentCost()
    if cost is not None and cost[1] in currencies:
        money = AgentCost(amount=cost[0], currency=cost[1], provenance=cost[2])
    # input and output come with every reported step; each detail field may be missing from it
    carried = {
        name: figure if name in ("input_tokens", "output_tokens") or draw(st.booleans()) else UsageFigure()
        for name in TOKEN_FIELDS
    }
    return AgentUsage(steps=1, cost=money, **carried)


usages = st.one_of(step_usages(), st.lists(step_usages(), max_size=4).map(lambda xs: total(*xs)), st.just(AgentUsage()))


@settings(max_examples=300)
@given(usages, usages, usages)
def test_addition_is_associative(a, b, c):
    assert (a + b) + c == a + (b + c)


@given(st.lists(step_usages(), min_size=1, max_size=8), st.data())
def test_any_grouping_gives_the_same_total(steps, data):
    split = data.draw(st.integers(0, len(steps)))
    assert total(*steps) == total(total(*steps[:split]), total(*steps[split:]))


@given(st.lists(step_usages(currencies=("USD",)), max_size=6), st.lists(step_usages(currencies=("USD",)), max_size=6))
def test_an_unreported_cost_anywhere_is_sticky(before, after):
    run = total(*before, AgentUsage.unreported(), *after)
    assert run.cost == AgentCost()
    assert run.cost.provenance == "unavailable"


@given(st.lists(step_usages(currencies=("USD",)), max_size=5), st.lists(step_usages(currencies=("USD",)), max_size=5))
def test_a_currency_mismatch_anywhere_is_unavailable(before, after):
    run = total(*before, step(cost="1.00", currency="USD"), *after, step(cost="1.00", currency="EUR"))
    assert run.cost.provenance == "unavailable"


@given(st.lists(step_usages(), min_size=1, max_size=8))
def test_each_field_sums_by_itself(steps):
    """Per field: unavailable where no step reported it, a floor where some step did not, exact otherwise."""
    run = total(*steps)
    for name in TOKEN_FIELDS:
        values = [getattr(s, name).value for s in steps]
        known = [v for v in values if v is not None]
        expected = (
            UsageFigure(value=sum(known), provenance="computed", floor=len(known) < len(values))
            if known
            else UsageFigure()
        )
        assert getattr(run, name) == expected, name


@given(st.lists(st.integers(0, 10**6), min_size=1, max_size=6))
def test_reported_totals_are_exact_sums(values):
    run = total(*(step(tokens=v, cost=str(v)) for v in values))
    assert run.output_tokens == UsageFigure(value=sum(values), provenance="computed")
    assert run.cost == AgentCost(amount=Decimal(sum(values)), currency="USD", provenance="computed")


# ------------------------------------------------------------------------------------------ from_response


def test_from_response_prices_a_known_model_as_an_estimate():
    usage = AgentUsage.from_response(response(GPT4O_USAGE, model_name="gpt-4o", provider_name="openai"))
    assert usage.cost.provenance == "estimated"
    assert usage.cost.currency == "USD"
    assert usage.cost.amount == Decimal("0.0040")  # 600 fresh + 400 cached input, 200 output at gpt-4o prices
    assert usage.input_tokens == UsageFigure(value=1000, provenance="provider-reported")


def test_from_response_takes_openrouters_reported_cost():
    r = response(
        GPT4O_USAGE,
        model_name="anthropic/claude-sonnet-4.5",
        provider_name="openrouter",
        provider_details={"cost": 0.0123},
    )
    usage = AgentUsage.from_response(r)
    assert usage.cost == AgentCost(amount=Decimal("0.0123"), currency="USD", provenance="provider-reported")


def test_from_response_takes_a_gateways_usage_cost():
    usage = RequestUsage(input_tokens=10, output_tokens=5, cost=Decimal("0.5"))
    assert AgentUsage.from_response(response(usage, model_name="x")).cost.provenance == "provider-reported"


def test_from_response_for_an_unknown_model_is_unavailable_without_raising():
    usage = AgentUsage.from_response(response(GPT4O_USAGE, model_name="my-local-model", provider_name="my-llm"))
    assert usage.cost == AgentCost()
    assert usage.input_tokens.provenance == "provider-reported"  # the tokens are still the provider's


def test_from_response_without_usage_is_an_unreported_step():
    for usage in (RequestUsage(), RequestUsage(unmeasured_requests=1)):
        result = AgentUsage.from_response(response(usage, model_name="gpt-4o", provider_name="openai"))
        assert result == AgentUsage.unreported()


def test_a_token_count_that_is_not_a_whole_number_is_unavailable_not_an_error():
    """A token is a whole number: a fractional (or negative, or non-finite) count from a provider is no
    usable figure. Money stays fractional."""
    for bad in (3.5, -1, float("nan"), float("inf")):
        usage = AgentUsage.from_request(RequestUsage(input_tokens=bad, output_tokens=10))  # type: ignore[arg-type]
        assert usage.input_tokens == UsageFigure()
        assert usage.output_tokens == UsageFigure(value=10, provenance="provider-reported")
        assert AgentUsage.model_validate_json(usage.model_dump_json()) == usage
    whole = AgentUsage.from_request(RequestUsage(input_tokens=7.0, output_tokens=10))  # type: ignore[arg-type]
    assert whole.input_tokens == UsageFigure(value=7, provenance="provider-reported")
    with pytest.raises(ValidationError):
        UsageFigure(value=3.5, provenance="provider-reported")  # type: ignore[arg-type]
    money = AgentCost(amount=Decimal("0.0125"), currency="USD", provenance="provider-reported")
    assert money.amount == Decimal("0.0125")


def test_from_response_ignores_a_malformed_reported_cost():
    r = response(GPT4O_USAGE, model_name="gpt-4o", provider_name="openai", provider_details={"cost": "n/a"})
    assert AgentUsage.from_response(r).cost.provenance == "estimated"


# ------------------------------------------------------ per-field provenance through the provider mappings

REPORTED, UNAVAILABLE = "provider-reported", "unavailable"
DETAILS = ("cache_read_tokens", "cache_write_tokens", "reasoning_tokens")
NONE_CARRIED = dict.fromkeys(DETAILS, UNAVAILABLE)


def provenance(usage: AgentUsage) -> dict[str, int | str | None]:
    """Each detail field as its value when provider-reported, else its provenance."""
    figures = {name: getattr(usage, name) for name in DETAILS}
    return {name: f.value if f.provenance == REPORTED else f.provenance for name, f in figures.items()}


def details(cache_read: Any = UNAVAILABLE, cache_write: Any = UNAVAILABLE, reasoning: Any = UNAVAILABLE) -> dict:
    return {"cache_read_tokens": cache_read, "cache_write_tokens": cache_write, "reasoning_tokens": reasoning}


def user_turn() -> list[ModelMessage]:
    return [ModelRequest(parts=[UserPromptPart("hi")])]


def mock_client(lib, payload: dict[str, Any], events: list[dict[str, Any]], *, named_events: bool = False):
    """An ``httpx`` (OpenAI SDK) or ``httpx2`` (Anthropic SDK) client that answers a streamed request with
    ``events`` as server-sent events and any other with ``payload`` as JSON."""

    def answer(request):
        if not json.loads(request.content).get("stream"):
            return lib.Response(200, json=payload)
        if named_events:
            body = "".join(f"event: {e['type']}\ndata: {json.dumps(e)}\n\n" for e in events)
        else:
            body = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
        return lib.Response(200, content=body.encode(), headers={"content-type": "text/event-stream"})

    return lib.AsyncClient(transport=lib.MockTransport(answer))


async def answer_once(model: Model, *, stream: bool) -> ModelResponse:
    """The model's answer to one user turn, requested or streamed (the runtime streams)."""
    if not stream:
        return await model.request(user_turn(), None, ModelRequestParameters())
    async with model.request_stream(user_turn(), None, ModelRequestParameters()) as s:
        async for _ in s:
            pass
        return s.get()


# --- OpenAI Chat Completions: `prompt_tokens_details` / `completion_tokens_details`


def openai_model(usage: dict[str, Any]) -> OpenAIChatModel:
    """gpt-4o answering "Hi", its usage ``usage`` (streamed: on the last chunk, as OpenAI sends it)."""
    usage = {"prompt_tokens": 1000, "completion_tokens": 200, "total_tokens": 1200, **usage}
    base = {"id": "chatcmpl-1", "created": 0, "model": "gpt-4o"}
    message = {"index": 0, "message": {"role": "assistant", "content": "Hi"}, "finish_reason": "stop"}
    delta = {"index": 0, "delta": {"role": "assistant", "content": "Hi"}, "finish_reason": "stop"}
    chunks = [
        {**base, "object": "chat.completion.chunk", "choices": [delta]},
        {**base, "object": "chat.completion.chunk", "choices": [], "usage": usage},
    ]
    client = mock_client(httpx, {**base, "object": "chat.completion", "choices": [message], "usage": usage}, chunks)
    sdk = AsyncOpenAI(api_key="test", base_url="https://api.openai.com/v1", http_client=client)
    return OpenAIChatModel("gpt-4o", provider=OpenAIProvider(openai_client=sdk))


@pytest.mark.parametrize("stream", [False, True], ids=["request", "stream"])
@pytest.mark.parametrize(
    ("usage", "expected"),
    [
        ({}, NONE_CARRIED),  # no *_details objects: nothing carried
        (
            {
                "prompt_tokens_details": {"cached_tokens": 0, "audio_tokens": 0},
                "completion_tokens_details": {"reasoning_tokens": 0, "audio_tokens": 0},
            },
            details(cache_read=0, reasoning=0),  # carried zeros are real zeros; no cache write was sent
        ),
        (
            {
                "prompt_tokens_details": {"cached_tokens": 400, "cache_write_tokens": 100},
                "completion_tokens_details": {"reasoning_tokens": 50},
            },
            details(400, 100, 50),
        ),
        ({"prompt_tokens_details": None, "completion_tokens_details": None}, NONE_CARRIED),
    ],
    ids=["bare", "zeros-carried", "all-carried", "details-null"],
)
async def test_openai_chat_reports_what_it_carried_and_the_rest_is_unavailable(usage, expected, stream):
    step_usage = AgentUsage.from_response(await answer_once(openai_model(usage), stream=stream))
    assert provenance(step_usage) == expected
    assert step_usage.input_tokens == UsageFigure(value=1000, provenance=REPORTED)
    assert step_usage.output_tokens == UsageFigure(value=200, provenance=REPORTED)
    assert step_usage.cost.provenance == "estimated"  # gpt-4o is in the price tables


def test_openai_chat_mapping_reads_zero_for_what_it_did_not_carry():
    """What the fix is about: pydantic-ai's numbers are 0 either way; only the fields its mapping set differ."""
    model = OpenAIChatModel("gpt-4o", provider=OpenAIProvider(api_key="test"))

    def mapped(**fields: Any) -> RequestUsage:
        usage = CompletionUsage(prompt_tokens=10, completion_tokens=2, total_tokens=12, **fields)
        return model._map_usage(
            ChatCompletion(id="c", choices=[], created=0, model="gpt-4o", object="chat.completion", usage=usage)
        )

    bare = mapped()
    carried = mapped(
        prompt_tokens_details=PromptTokensDetails(cached_tokens=0),
        completion_tokens_details=CompletionTokensDetails(reasoning_tokens=0),
    )
    assert (bare.cache_read_tokens, bare.output_reasoning_tokens) == (0, 0)
    assert (carried.cache_read_tokens, carried.output_reasoning_tokens) == (0, 0)
    assert provenance(AgentUsage.from_request(bare)) == NONE_CARRIED
    assert provenance(AgentUsage.from_request(carried)) == details(cache_read=0, reasoning=0)


def test_an_openai_compatible_server_without_details_leaves_them_unavailable():
    """Ollama, vLLM: the same mapping; genai-prices falls back to OpenAI's extractor."""
    usage = CompletionUsage(prompt_tokens=30, completion_tokens=4, total_tokens=34)
    completion = ChatCompletion(id="c", choices=[], created=0, model="llama3.2", object="chat.completion", usage=usage)
    mapped = openai_map_usage(completion, "ollama", "http://localhost:11434/v1", "llama3.2")
    r = response(mapped, model_name="llama3.2", provider_name="ollama", provider_url="http://localhost:11434/v1")
    step_usage = AgentUsage.from_response(r)
    assert provenance(step_usage) == NONE_CARRIED
    assert step_usage.input_tokens.value == 30 and step_usage.cost == AgentCost()


# --- OpenAI Responses: `input_tokens_details` / `output_tokens_details`


def openai_responses_usage(**fields: Any) -> RequestUsage:
    usage = ResponseUsage.model_construct(input_tokens=1000, output_tokens=200, total_tokens=1200, **fields)
    payload = OpenAIResponse.model_construct(id="resp_1", usage=usage, output=[], status="completed", model="gpt-4o")
    return openai_map_usage(payload, "openai", "https://api.openai.com/v1", "gpt-4o")


def test_openai_responses_reports_what_it_carried_and_the_rest_is_unavailable():
    full = openai_responses_usage(
        input_tokens_details=InputTokensDetails(cached_tokens=0, cache_write_tokens=0),
        output_tokens_details=OutputTokensDetails(reasoning_tokens=0),
    )
    assert provenance(AgentUsage.from_request(full)) == details(0, 0, 0)
    bare = openai_responses_usage()  # an OpenAI-compatible server that sends no details
    assert bare.details == {"reasoning_tokens": 0}  # filled in by the mapping, not by the server
    assert provenance(AgentUsage.from_request(bare)) == NONE_CARRIED


# --- Anthropic: `cache_read_input_tokens` / `cache_creation_input_tokens`; thinking only when non-zero


@pytest.mark.parametrize(
    ("usage", "expected"),
    [
        ({}, NONE_CARRIED),
        ({"cache_read_input_tokens": 0, "cache_creation_input_tokens": 0}, details(0, 0)),
        ({"cache_read_input_tokens": 100, "cache_creation_input_tokens": 20}, details(100, 20)),
        # the mapping keeps a thinking count only when it is non-zero: a carried 0 cannot be told from none
        ({"output_tokens_details": {"thinking_tokens": 0}}, NONE_CARRIED),
        ({"output_tokens_details": {"thinking_tokens": 2}}, details(reasoning=2)),
    ],
    ids=["bare", "cache-zeros", "cache", "thinking-zero", "thinking"],
)
def test_anthropic_mapping_reports_the_fields_it_carried(usage, expected):
    message = BetaMessage(
        id="msg_1",
        content=[],
        model="claude-sonnet-4-5",
        role="assistant",
        stop_reason="end_turn",
        type="message",
        usage=BetaUsage(input_tokens=10, output_tokens=3, **usage),
    )
    mapped = anthropic_map_usage(message, "anthropic", "https://api.anthropic.com", "claude-sonnet-4-5")
    assert provenance(AgentUsage.from_request(mapped)) == expected


def anthropic_model(usage: dict[str, int]) -> AnthropicModel:
    """Claude answering "Hi", with ``usage``'s cache fields (streamed: on ``message_start`` only)."""
    message = {"id": "msg_1", "type": "message", "role": "assistant", "model": "claude-sonnet-4-5"}
    payload = {
        **message,
        "content": [{"type": "text", "text": "Hi"}],
        "stop_reason": "end_turn",
        "stop_sequence": None,
        "usage": {"input_tokens": 10, "output_tokens": 5, **usage},
    }
    start = {**message, "content": [], "stop_reason": None, "stop_sequence": None}
    events = [
        {"type": "message_start", "message": {**start, "usage": {"input_tokens": 10, "output_tokens": 1, **usage}}},
        {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
        {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "Hi"}},
        {"type": "content_block_stop", "index": 0},
        # the final usage repeats none of the cache fields: the mapping keeps message_start's
        {"type": "message_delta", "delta": {"stop_reason": "end_turn"}, "usage": {"output_tokens": 5}},
        {"type": "message_stop"},
    ]
    sdk = AsyncAnthropic(api_key="test", http_client=mock_client(httpx2, payload, events, named_events=True))
    return AnthropicModel("claude-sonnet-4-5", provider=AnthropicProvider(anthropic_client=sdk))


@pytest.mark.parametrize("stream", [False, True], ids=["request", "stream"])
async def test_anthropic_end_to_end_reports_a_carried_zero_and_not_what_was_not_carried(stream):
    cache = {"cache_read_input_tokens": 0, "cache_creation_input_tokens": 30}
    cached = AgentUsage.from_response(await answer_once(anthropic_model(cache), stream=stream))
    assert provenance(cached) == details(cache_read=0, cache_write=30)
    assert cached.input_tokens.value == 40  # pydantic-ai's input total includes the cache write
    assert cached.output_tokens.value == 5
    bare = AgentUsage.from_response(await answer_once(anthropic_model({}), stream=stream))
    assert provenance(bare) == NONE_CARRIED


# --- Google, through GoogleModel's own response processing (google-genai is not a threadline dependency:
# `pydantic-ai-slim[google]`; without it these skip)


def gemini_chunk(text: str, *, finish: bool = False, **usage: int) -> Any:
    genai = pytest.importorskip("google.genai.types")
    candidate = genai.Candidate(
        content=genai.Content(role="model", parts=[genai.Part(text=text)]),
        finish_reason=genai.FinishReason.STOP if finish else None,
    )
    metadata = genai.GenerateContentResponseUsageMetadata(**usage) if usage else None
    return genai.GenerateContentResponse(
        model_version="gemini-2.5-flash", candidates=[candidate], usage_metadata=metadata
    )


def gemini_model() -> Any:
    google = pytest.importorskip("pydantic_ai.models.google", exc_type=ImportError)
    from pydantic_ai.providers.google import GoogleProvider

    return google.GoogleModel("gemini-2.5-flash", provider=GoogleProvider(api_key="test"))


async def gemini_stream(model: Any, chunks: list[Any]) -> ModelResponse:
    """What ``GoogleModel.request_stream`` yields for ``chunks`` as google-genai's stream."""

    async def source():
        for chunk in chunks:
            yield chunk

    stream = await model._process_streamed_response(source(), ModelRequestParameters())
    async for _ in stream:
        pass
    return stream.get()


GEMINI_BARE = {"prompt_token_count": 100, "candidates_token_count": 20}
GEMINI_ZEROS = {**GEMINI_BARE, "cached_content_token_count": 0, "thoughts_token_count": 0}
GEMINI_FULL = {**GEMINI_BARE, "cached_content_token_count": 64, "thoughts_token_count": 7}


async def test_google_streams_zero_fill_the_cache_fields_and_no_google_zero_is_reported():
    model = gemini_model()
    bare = await gemini_stream(model, [gemini_chunk("Hi"), gemini_chunk(" there", finish=True, **GEMINI_BARE)])
    assert bare.provider_name == "google"
    assert bare.usage.__dict__["cache_read_tokens"] == 0  # set by the mapping, never sent by Gemini
    assert provenance(AgentUsage.from_response(bare)) == NONE_CARRIED

    zeros = await gemini_stream(model, [gemini_chunk("Hi", finish=True, **GEMINI_ZEROS)])
    assert provenance(AgentUsage.from_response(zeros)) == NONE_CARRIED

    full = await gemini_stream(
        model, [gemini_chunk("Hi", **GEMINI_FULL), gemini_chunk("!", finish=True, **GEMINI_FULL)]
    )
    step_usage = AgentUsage.from_response(full)
    assert provenance(step_usage) == details(cache_read=64, reasoning=7)  # Gemini reports no cache writes
    assert step_usage.output_tokens.value == 27  # pydantic-ai's output total includes the thoughts


def test_google_requests_report_non_zero_counts_only():
    model = gemini_model()
    for usage, expected in [
        (GEMINI_BARE, NONE_CARRIED),
        (GEMINI_ZEROS, NONE_CARRIED),  # a Google zero is never trusted
        (GEMINI_FULL, details(cache_read=64, reasoning=7)),
    ]:
        r = model._process_response(gemini_chunk("Hi", finish=True, **usage), ModelRequestParameters())
        assert provenance(AgentUsage.from_response(r)) == expected


def test_a_zero_filling_provider_name_trusts_no_zero():
    carried_zero = RequestUsage(input_tokens=10, output_tokens=2, cache_read_tokens=0, output_reasoning_tokens=3)
    assert provenance(AgentUsage.from_request(carried_zero)) == details(cache_read=0, reasoning=3)
    for name in ("google", "google-cloud", "google-gla", "google-vertex"):
        assert provenance(AgentUsage.from_request(carried_zero, provider_name=name)) == details(reasoning=3)


# --- Bedrock, Groq, Mistral: each mapping is one `RequestUsage.extract` call on the wire usage. Their SDKs are
# not installed here; these are the calls `bedrock._map_usage`, `groq._map_usage` and `mistral._map_usage` make,
# with the names their providers give.

BEDROCK = ("bedrock", "https://bedrock-runtime.us-east-1.amazonaws.com", "anthropic.claude-sonnet-4-5")
GROQ = ("groq", "https://api.groq.com", "llama-3.3-70b-versatile")
MISTRAL = ("mistral", "https://api.mistral.ai", "mistral-large-latest")
OPENAI_STYLE = {"prompt_tokens": 10, "completion_tokens": 3, "total_tokens": 13}


@pytest.mark.parametrize(
    ("provider", "wire", "expected"),
    [
        (BEDROCK, {"inputTokens": 10, "outputTokens": 3, "totalTokens": 13}, NONE_CARRIED),
        (
            BEDROCK,
            {
                "inputTokens": 10,
                "outputTokens": 3,
                "totalTokens": 13,
                "cacheReadInputTokens": 0,
                "cacheWriteInputTokens": 8,
            },
            details(cache_read=0, cache_write=8),  # Converse reports no reasoning count
        ),
        (GROQ, OPENAI_STYLE, NONE_CARRIED),
        (GROQ, {**OPENAI_STYLE, "prompt_tokens_details": {"cached_tokens": 0}}, details(cache_read=0)),
        (MISTRAL, OPENAI_STYLE, NONE_CARRIED),
    ],
    ids=["bedrock-bare", "bedrock-cache", "groq-bare", "groq-cached", "mistral-bare"],
)
def test_genai_prices_extraction_sets_only_the_carried_fields(provider, wire, expected):
    name, url, model = provider
    mapped = RequestUsage.extract(
        dict(model=model, usage=wire), provider=name, provider_url=url, provider_fallback=name
    )
    r = response(mapped, model_name=model, provider_name=name, provider_url=url)
    assert provenance(AgentUsage.from_response(r)) == expected


# --- a zero-filled RequestUsage: one validated from JSON (a stored or replayed response)


def test_a_usage_validated_from_json_trusts_no_zero():
    stored = ModelMessagesTypeAdapter.validate_json(ModelMessagesTypeAdapter.dump_json([response(GPT4O_USAGE)]))[0]
    assert isinstance(stored, ModelResponse)
    assert stored.usage.__dict__["cache_write_tokens"] == 0  # validation sets every field
    assert provenance(AgentUsage.from_response(stored)) == details(cache_read=400, reasoning=50)
    assert AgentUsage.from_request(stored.usage).input_tokens.value == 1000


# --- FunctionModel and TestModel


async def test_function_and_test_models_report_input_and_output_only():
    def answer(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        return ModelResponse(parts=[TextPart("hello there")])

    async def stream_answer(messages: list[ModelMessage], info: AgentInfo):
        yield "hello "
        yield "there"

    for model in (FunctionModel(answer, stream_function=stream_answer), TestModel()):
        for stream in (False, True):
            step_usage = AgentUsage.from_response(await answer_once(model, stream=stream))
            assert step_usage.complete and step_usage.steps == 1
            # pydantic-ai's word-count estimate, labelled as the model's report
            assert step_usage.input_tokens.provenance == step_usage.output_tokens.provenance == REPORTED
            assert provenance(step_usage) == NONE_CARRIED
            assert step_usage.cost == AgentCost()  # "function" and "test" are not in the price tables


async def test_a_function_models_own_usage_reports_what_it_set():
    def answer(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        usage = RequestUsage(input_tokens=80, output_tokens=9, cache_read_tokens=0, cache_write_tokens=64)
        return ModelResponse(parts=[TextPart("hi")], usage=usage)

    r = await answer_once(FunctionModel(answer), stream=False)
    assert provenance(AgentUsage.from_response(r)) == details(cache_read=0, cache_write=64)


# --- the per-field rules over real steps


async def test_a_field_one_step_did_not_carry_sums_to_a_computed_floor():
    bare = AgentUsage.from_response(await answer_once(openai_model({}), stream=True))
    cached = AgentUsage.from_response(
        await answer_once(openai_model({"prompt_tokens_details": {"cached_tokens": 400}}), stream=True)
    )
    run = total(bare, cached)
    assert run.complete  # both steps reported their usage; only a detail is missing from one
    assert run.input_tokens == UsageFigure(value=2000, provenance="computed")
    assert run.cache_read_tokens == UsageFigure(value=400, provenance="computed", floor=True)
    assert run.cache_write_tokens == UsageFigure()  # neither step carried it: unavailable, not a floor
    assert run.cost.provenance == "estimated"
    assert total(bare, bare).cache_read_tokens == UsageFigure()
