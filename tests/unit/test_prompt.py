"""``compose_agent_prompt`` and the prompt budget (``threadline.history.prompt``).

Pins: contributions render in order, skip empty ones, keep name, stability, source and index, and count
tokens with provenance (measured / estimated / unavailable); ``adapt_instructions`` (sync, async, per
call) and the per-contribution pydantic-ai ``InstructionPart`` s; what a request sends
(``agent_instructions``, ``with_history_system``, ``request_instruction_parts``): the parts in order, the
history's system channel as one more part, text a ``prepare_step`` replaced as one part, and adapter results
that are no instruction part refused by name; usage errors. The seed's budget edge
cases exactly ("Prompt budgeting keeps reservation deficits signed"): fixed parts over the window are
``oversized`` with a negative ``available_history_tokens`` even with empty history; ``compact`` only when
removing history could make it fit; exact equality fits, including a zero window with zero everything;
any unavailable component keeps the decision ``unavailable``.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from pydantic_ai.messages import InstructionPart

from threadline.errors import AgentRuntimeUsageError
from threadline.history.prompt import (
    AgentInstructions,
    AgentPrompt,
    AgentPromptBudget,
    AgentPromptContribution,
    RenderedContribution,
    agent_instructions,
    compose_agent_prompt,
    decide_prompt_budget,
    estimate_tokens,
    estimate_tool_schema_tokens,
    request_instruction_parts,
    with_history_system,
)

CTX = SimpleNamespace(context=SimpleNamespace(user_id="u1"), conversation_id="c", run=None, model=None)


# ---------------------------------------------------------------------------------------------- budget

COMPONENTS = (
    "reserved_output",
    "instructions_tokens",
    "tool_schema_tokens",
    "attachment_tokens",
    "provider_overhead_tokens",
)


@pytest.mark.parametrize("component", COMPONENTS)
def test_fixed_parts_over_the_window_are_oversized_with_a_signed_deficit_even_with_empty_history(
    component: str,
) -> None:
    budget = decide_prompt_budget(context_window=100, history_tokens=0, **{component: 101})
    assert budget == AgentPromptBudget("oversized", -1, 0, 101, 0)
    assert budget.available_history_tokens is not None and budget.available_history_tokens < 0
    assert budget.context_decision == "oversized"  # the decision under its contextDecision name


def test_reservation_deficit_sums_every_fixed_part() -> None:
    budget = decide_prompt_budget(
        context_window=1000,
        reserved_output=400,
        instructions_tokens=300,
        tool_schema_tokens=200,
        attachment_tokens=150,
        provider_overhead_tokens=50,
        history_tokens=0,
    )
    assert (budget.decision, budget.available_history_tokens, budget.fixed_tokens) == ("oversized", -100, 1100)
    # removable history cannot rescue a deficit of the fixed parts
    rescue = decide_prompt_budget(context_window=10, reserved_output=11, history_tokens=5, removable_history_tokens=5)
    assert (rescue.decision, rescue.available_history_tokens) == ("oversized", -1)


def test_compact_only_when_removing_history_could_make_it_fit() -> None:
    base = {"context_window": 100, "reserved_output": 20, "instructions_tokens": 30}  # 50 left for history
    assert decide_prompt_budget(**base, history_tokens=70, removable_history_tokens=20).decision == "compact"
    assert decide_prompt_budget(**base, history_tokens=70, removable_history_tokens=19).decision == "oversized"
    assert decide_prompt_budget(**base, history_tokens=70, removable_history_tokens=0).decision == "oversized"
    # without a removable figure all history counts as removable
    assert decide_prompt_budget(**base, history_tokens=70).decision == "compact"
    compact = decide_prompt_budget(**base, history_tokens=70, removable_history_tokens=20)
    assert compact == AgentPromptBudget("compact", 50, 70, 50, 20)


def test_exact_equality_fits() -> None:
    assert decide_prompt_budget(
        context_window=100, reserved_output=25, instructions_tokens=25, history_tokens=50
    ) == AgentPromptBudget("fits", 50, 50, 50, 50)
    assert decide_prompt_budget(context_window=100, reserved_output=25, history_tokens=76).decision == "compact"
    # a zero window with zero reservations and zero history fits, with nothing left over
    zero = decide_prompt_budget(
        context_window=0,
        reserved_output=0,
        instructions_tokens=0,
        tool_schema_tokens=0,
        attachment_tokens=0,
        provider_overhead_tokens=0,
        history_tokens=0,
    )
    assert zero == AgentPromptBudget("fits", 0, 0, 0, 0)
    assert decide_prompt_budget(context_window=0, history_tokens=1).decision == "compact"
    assert decide_prompt_budget(context_window=0, history_tokens=1, removable_history_tokens=0).decision == "oversized"


@pytest.mark.parametrize("component", ("context_window", *COMPONENTS, "history_tokens"))
def test_any_unavailable_component_keeps_the_decision_unavailable(component: str) -> None:
    known = {"context_window": 10, "reserved_output": 50, "history_tokens": 5}  # would be oversized
    budget = decide_prompt_budget(**{**known, component: None})
    assert budget.decision == "unavailable"
    assert budget.available_history_tokens is None and budget.fixed_tokens is None
    assert budget.unavailable == (component,)


def test_budget_rejects_nonsense_counts() -> None:
    with pytest.raises(AgentRuntimeUsageError):
        decide_prompt_budget(context_window=-1)
    with pytest.raises(AgentRuntimeUsageError):
        decide_prompt_budget(context_window=10, reserved_output=1.5)  # type: ignore[arg-type]
    with pytest.raises(AgentRuntimeUsageError):
        decide_prompt_budget(context_window=10, history_tokens=2, removable_history_tokens=3)


def test_estimates() -> None:
    assert [estimate_tokens(t) for t in ("", "a", "abcd", "abcde")] == [0, 1, 1, 2]
    tools = [
        SimpleNamespace(name="lookup", description="Find it", parameters_json_schema={"type": "object"}),
        {"name": "lookup", "description": "Find it", "parameters_json_schema": {"type": "object"}},
    ]
    one = estimate_tool_schema_tokens(tools[:1])
    assert one > 0 and estimate_tool_schema_tokens(tools) == 2 * one
    assert estimate_tool_schema_tokens([]) == 0


# ----------------------------------------------------------------------------------------- composing


async def test_contributions_render_in_order_with_provenance() -> None:
    async def dynamic(ctx: Any) -> str:
        return f"Now helping {ctx.context.user_id}."

    prompt = compose_agent_prompt(
        [
            {"name": "product", "stability": "stable", "render": lambda ctx: "You are terse.", "source": "AGENTS.md"},
            {"name": "skipped", "stability": "session", "render": lambda ctx: None},
            AgentPromptContribution("user", "dynamic", dynamic, source="app:user"),
            {"name": "conversation", "stability": "session", "render": lambda ctx: f"Thread {ctx.conversation_id}."},
        ]
    )
    rendered = await prompt(CTX)
    assert isinstance(rendered, AgentPrompt)
    assert rendered.instructions == "You are terse.\n\nNow helping u1.\n\nThread c."
    assert [(c.name, c.stability, c.source, c.index) for c in rendered.contributions] == [
        ("product", "stable", "AGENTS.md", 0),
        ("user", "dynamic", "app:user", 2),
        ("conversation", "session", "application", 3),
    ]
    assert all(c.token_provenance == "estimated" for c in rendered.contributions)
    assert rendered.contributions[0] == RenderedContribution(
        "product", "stable", "You are terse.", "AGENTS.md", 0, estimate_tokens("You are terse."), "estimated"
    )
    assert (rendered.instructions_tokens, rendered.token_provenance) == (
        estimate_tokens(rendered.instructions),
        "estimated",
    )
    assert rendered.adapted is None
    parts = rendered.instruction_parts()
    assert [(p.content, p.dynamic) for p in parts] == [
        ("You are terse.", False),
        ("Now helping u1.", True),
        ("Thread c.", False),
    ]


async def test_measured_and_unavailable_token_counts() -> None:
    contributions = [{"name": "a", "stability": "stable", "render": lambda ctx: "one two three"}]
    measured = await compose_agent_prompt(contributions, count_tokens=lambda text: len(text.split()))(CTX)
    assert (measured.instructions_tokens, measured.token_provenance) == (3, "measured")
    assert measured.contributions[0].tokens == 3
    unknown = await compose_agent_prompt(contributions, count_tokens=lambda text: None)(CTX)
    assert (unknown.instructions_tokens, unknown.token_provenance) == (None, "unavailable")
    assert unknown.decide_budget(context_window=100).decision == "unavailable"
    empty = await compose_agent_prompt([])(CTX)
    assert (empty.instructions, empty.instructions_tokens, empty.contributions) == ("", 0, ())


async def test_prompt_decides_its_budget() -> None:
    prompt = await compose_agent_prompt(
        [{"name": "a", "stability": "stable", "render": lambda ctx: "x" * 40}], count_tokens=lambda t: 10
    )(CTX)
    assert prompt.decide_budget(context_window=100, reserved_output=40, history_tokens=50) == AgentPromptBudget(
        "fits", 50, 50, 50, 50
    )
    over = prompt.decide_budget(context_window=100, reserved_output=91, tool_schema_tokens=0, history_tokens=0)
    assert (over.decision, over.available_history_tokens) == ("oversized", -1)


async def test_adapt_instructions_hook() -> None:
    contributions = [{"name": "a", "stability": "stable", "render": lambda ctx: "Be brief."}]

    def openrouter(content: str) -> dict[str, Any]:
        return {
            "role": "system",
            "content": content,
            "provider_options": {"openrouter": {"cache_control": {"type": "ephemeral"}}},
        }

    adapted = await compose_agent_prompt(contributions, adapt_instructions=openrouter)(CTX)
    assert adapted.instructions == "Be brief."
    assert adapted.adapted["content"] == "Be brief." and adapted.adapted["role"] == "system"

    async def parts(content: str) -> list[InstructionPart]:
        return [InstructionPart(content=content)]

    per_call = await compose_agent_prompt(contributions, adapt_instructions=openrouter)(CTX, adapt_instructions=parts)
    assert [p.content for p in per_call.adapted] == ["Be brief."]


SPLIT = [
    {"name": "product", "stability": "stable", "render": lambda ctx: "You are terse."},
    {"name": "user", "stability": "dynamic", "render": lambda ctx: "Now helping u1."},
]


def contents(parts: Any) -> list[tuple[str, bool]]:
    return [(p.content, p.dynamic) for p in parts or ()]


async def test_a_request_sends_the_split_and_the_history_system_as_its_own_part() -> None:
    prompt = await compose_agent_prompt(SPLIT)(CTX)
    instructions = agent_instructions(prompt)
    assert isinstance(instructions, str) and instructions == "You are terse.\n\nNow helping u1."
    step = with_history_system(instructions, ["earlier: they met", "be brief"])
    assert step == "You are terse.\n\nNow helping u1.\n\nearlier: they met\n\nbe brief"  # the text, as before
    assert contents(request_instruction_parts(step)) == [
        ("You are terse.", False),
        ("Now helping u1.", True),
        ("earlier: they met\n\nbe brief", False),
    ]
    assert with_history_system(instructions, []) is instructions


async def test_text_in_place_of_the_instructions_is_sent_as_it_is() -> None:
    step = with_history_system(agent_instructions(await compose_agent_prompt(SPLIT)(CTX)), ["be brief"])
    assert contents(request_instruction_parts(step.upper())) == [(step.upper(), False)]  # any edit is plain text
    assert request_instruction_parts("") is None
    assert request_instruction_parts(agent_instructions(None)) is None
    plain = with_history_system("  Be kind.  ", [])  # a prompt that is a plain callable returning text
    assert plain == "Be kind." and contents(request_instruction_parts(plain)) == [("Be kind.", False)]
    assert contents(request_instruction_parts(with_history_system("", ["SUMMARY"]))) == [("SUMMARY", False)]


@pytest.mark.parametrize(
    ("adapted", "expected"),
    [
        (InstructionPart(content="one", dynamic=True), [("one", True)]),
        ("as text", [("as text", False)]),
        ({"role": "system", "content": "a system message"}, [("a system message", False)]),
        (["first", {"content": "second", "dynamic": True}], [("first", False), ("second", True)]),
    ],
)
async def test_adapted_instructions_become_the_parts(adapted: Any, expected: list[tuple[str, bool]]) -> None:
    prompt = await compose_agent_prompt(SPLIT, adapt_instructions=lambda text: adapted)(CTX)
    assert contents(prompt.request_parts()) == expected
    assert contents(agent_instructions(prompt).parts) == expected
    assert agent_instructions(prompt) == prompt.instructions


@pytest.mark.parametrize(
    ("adapted", "names"),
    [
        ({"role": "system", "content": "x", "provider_options": {}}, "provider_options"),
        ({"role": "user", "content": "x"}, "'user'"),
        ({"content": 3}, "'content'"),
        ([InstructionPart(content="ok"), 3], r"adapt_instructions\(\.\.\.\)\[1\] is a int"),
    ],
)
async def test_an_adapter_result_that_is_no_instruction_part_is_refused_by_name(adapted: Any, names: str) -> None:
    prompt = await compose_agent_prompt(SPLIT, adapt_instructions=lambda text: adapted)(CTX)
    with pytest.raises(AgentRuntimeUsageError, match=names):
        agent_instructions(prompt)


def test_instructions_of_another_kind_are_refused() -> None:
    with pytest.raises(AgentRuntimeUsageError, match="AgentPrompt, not int"):
        agent_instructions(3)  # type: ignore[arg-type]
    assert AgentInstructions("x", ()).parts == ()


@pytest.mark.parametrize(
    "contributions",
    [
        [{"name": "", "stability": "stable", "render": lambda ctx: "x"}],
        [{"name": "a", "stability": "forever", "render": lambda ctx: "x"}],
        [{"name": "a", "stability": "stable", "render": "not callable"}],
        [{"name": "a", "stability": "stable", "render": lambda ctx: "x", "colour": "red"}],
        [{"name": "a", "stability": "stable", "render": lambda ctx: "x", "source": ""}],
        [
            {"name": "a", "stability": "stable", "render": lambda ctx: "x"},
            {"name": "a", "stability": "dynamic", "render": lambda ctx: "y"},
        ],
        ["not a contribution"],
    ],
)
def test_composition_errors(contributions: list[Any]) -> None:
    with pytest.raises(AgentRuntimeUsageError):
        compose_agent_prompt(contributions)


def test_hook_errors() -> None:
    with pytest.raises(AgentRuntimeUsageError):
        compose_agent_prompt([], adapt_instructions="system")  # type: ignore[arg-type]
    with pytest.raises(AgentRuntimeUsageError):
        compose_agent_prompt([], count_tokens=3)  # type: ignore[arg-type]


async def test_render_failure_propagates() -> None:
    def broken(ctx: Any) -> str:
        raise KeyError("missing template")

    with pytest.raises(KeyError):
        await compose_agent_prompt([{"name": "p", "stability": "stable", "render": broken}])(CTX)
