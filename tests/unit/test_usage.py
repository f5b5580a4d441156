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
"""

from __future__ import annotations

import functools
import operator
from decimal import Decimal

import pytest
from hypothesis import given, settings, strategies as st
from pydantic import ValidationError
from pydantic_ai.messages import ModelResponse, TextPart
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
    for name in TOKEN_FIELDS:
        assert getattr(run, name).provenance == "computed"
        assert not getattr(run, name).floor
    assert run.input_tokens.value == 1000


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
    return AgentUsage(steps=1, cost=money, **dict.fromkeys(TOKEN_FIELDS, figure))


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


def test_from_response_ignores_a_malformed_reported_cost():
    r = response(GPT4O_USAGE, model_name="gpt-4o", provider_name="openai", provider_details={"cost": "n/a"})
    assert AgentUsage.from_response(r).cost.provenance == "estimated"
