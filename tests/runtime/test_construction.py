"""Mistakes fail where they are made: every argument of ``create_agent_runtime``, ``define_model_registry``,
``compose_agent_prompt``, ``define_agent_protocol`` and the config sections is checked when it is given, with
an ``AgentConfigError`` naming the field and the fix — never at the first run. And the shortcuts people
reach for work: a registry as ``models=``, a model itself, ``prompt="..."``, a store handle as ``store=``."""

from __future__ import annotations

import asyncio
import math
from typing import Any

import pytest
from pydantic import BaseModel
from pydantic_ai.models.test import TestModel

from threadline import (
    AgentConfigError,
    AgentRuntimeUsageError,
    HistoryConfig,
    LoopConfig,
    RunsConfig,
    StopPolicy,
    compose_agent_prompt,
    create_agent_runtime,
    create_memory_agent_runtime_store,
    create_sqlite_agent_runtime_store,
    define_agent_protocol,
    define_agent_tool,
    define_model_registry,
)

from .conftest import Context, Script

WAIT = 10


@define_agent_tool
async def search(query: str) -> str:
    """Searches."""
    return query


async def plain_function(query: str) -> str:
    return query


def build(**overrides: Any) -> Any:
    script = Script()
    arguments: dict[str, Any] = {
        "protocol": define_agent_protocol(context=Context),
        "store": create_memory_agent_runtime_store(),
        "models": {"resolve": lambda: script.model},
    }
    arguments.update(overrides)
    return create_agent_runtime(**arguments)


BAD_ARGUMENTS = [
    ({"protocol": Context}, "protocol"),
    ({"store": "threadline.db"}, "store"),
    ({"models": None}, "models.resolve"),
    ({"models": {"resolve": lambda: None, "fallback": 1}}, "models.fallback"),
    ({"models": {"resolve": lambda: None, "preflight": "yes"}}, "models.preflight"),
    ({"prompt": ["You are helpful."]}, "prompt"),
    ({"prompt": "   "}, "prompt"),
    ({"tools": search}, "tools"),
    ({"tools": [search, plain_function]}, "tools[1]"),
    ({"tools": [search, search]}, "tools"),
    ({"tools": "search"}, "tools"),
    ({"publish": "stdout"}, "publish"),
    ({"operator_publish": 3}, "operator_publish"),
    ({"include_internal_cause": "yes"}, "include_internal_cause"),
    ({"runs": {"input_policy": "drop"}}, "runs.input_policy"),
    ({"runs": {"coalesce_pending": "yes"}}, "runs.coalesce_pending"),
    ({"runs": {"owner_id": "worker\x001"}}, "runs.owner_id"),
    ({"runs": {"watch_interval": 0}}, "runs.watch_interval"),
    ({"runs": {"lease_duration": math.inf}}, "runs.lease_duration"),
    ({"runs": {"max_input_bytes": 0}}, "runs.max_input_bytes"),
    ({"runs": {"resolve_context": {"user": "u"}}}, "runs.resolve_context"),
    ({"runs": {"input_polcy": "queue"}}, "runs.input_polcy"),
    ({"runs": ["queue"]}, "runs"),
    ({"loop": {"checkpoint_every_events": 0}}, "loop.checkpoint_every_events"),
    ({"loop": {"idle_timeout": math.nan}}, "loop.idle_timeout"),
    ({"loop": {"max_steps": True}}, "loop.max_steps"),
    ({"loop": {"stop_policies": [{"name": "max-steps", "should_stop": bool}]}}, "loop.stop_policies[0].name"),
    ({"loop": {"stop_policies": [lambda ctx: True]}}, "loop.stop_policies[0]"),
    ({"loop": {"prepare_step": "trim"}}, "loop.prepare_step"),
    ({"loop": {"model_settings": ["temperature"]}}, "loop.model_settings"),
    ({"loop": {"retry": {"max_attempt": 3}}}, "loop.retry.max_attempt"),
    ({"loop": {"retry": {"max_attempts": -1}}}, "loop.retry.max_attempts"),
    ({"loop": {"tool_approval": "delete_file", "tool_approval_secret": "s"}}, "loop.tool_approval"),
    ({"loop": {"tool_approval": ["delete_file"]}}, "loop.tool_approval_secret"),
    ({"loop": {"tool_lifecycle": {"before": print}}}, "loop.tool_lifecycle"),
    ({"loop": {"step_durability": "steps.db"}}, "loop.step_durability"),
    ({"history": {"interrupted_assistant": "drop"}}, "history.interrupted_assistant"),
    ({"history": {"unresolved_file": "skip"}}, "history.unresolved_file"),
    ({"history": {"resolve_file": "files/"}}, "history.resolve_file"),
    ({"history": {"compaction": {"keep_recent": 2}}}, "history.compaction"),
    ({"history": {"evidence_policy": {"nonsense": True}}}, "history.evidence_policy.nonsense"),
]


@pytest.mark.parametrize(("overrides", "field"), BAD_ARGUMENTS, ids=[f for _, f in BAD_ARGUMENTS])
def test_a_bad_argument_is_refused_at_construction_naming_its_field(overrides: dict[str, Any], field: str) -> None:
    with pytest.raises(AgentConfigError) as refused:
        build(**overrides)
    assert refused.value.field == field
    assert isinstance(refused.value, AgentRuntimeUsageError)  # what callers already catch


@pytest.mark.parametrize(
    ("make", "field"),
    [
        (lambda: RunsConfig(watch_interval=-1), "runs.watch_interval"),
        (lambda: RunsConfig(max_input_bytes=1.5), "runs.max_input_bytes"),
        (lambda: LoopConfig(max_steps=0), "loop.max_steps"),
        (lambda: LoopConfig(stop_policies=[StopPolicy("", lambda ctx: True)]), "loop.stop_policies[0].name"),
        (lambda: HistoryConfig(incomplete_tool_turn="keep"), "history.incomplete_tool_turn"),  # type: ignore[arg-type]
    ],
)
def test_a_config_section_checks_itself_when_built(make: Any, field: str) -> None:
    with pytest.raises(AgentConfigError) as refused:
        make()
    assert refused.value.field == field


def test_messages_say_what_is_accepted() -> None:
    with pytest.raises(AgentConfigError, match=r"write tools=\[search\]"):
        build(tools=search)
    with pytest.raises(AgentConfigError, match="declare it with @define_agent_tool"):
        build(tools=[plain_function])
    with pytest.raises(AgentConfigError, match=r"write \['delete_file'\]"):
        build(loop={"tool_approval": "delete_file", "tool_approval_secret": "s"})
    with pytest.raises(AgentConfigError, match=r"known: \[.*'input_policy'.*\]"):
        build(runs={"input_polcy": "queue"})


@pytest.mark.parametrize(
    ("models", "default", "field"),
    [
        ({}, None, "models"),
        ([("m", {"model": "test"})], None, "models"),
        ({"m": "openai:gpt-4.1-mini"}, None, "models['m']"),
        ({"m": {"model": "test", "window": 10}}, None, "models['m'].window"),
        ({"m": {"model": 42}}, None, "models['m'].model"),
        ({"m": {"model": "test", "context_window": 0}}, None, "models['m'].context_window"),
        ({"m": {"model": "test", "context_window": True}}, None, "models['m'].context_window"),
        ({"m": {"model": "test", "capabilities": "tools"}}, None, "models['m'].capabilities"),
        ({"m": {"model": "test"}}, "n", "default"),
    ],
)
def test_define_model_registry_checks_every_field(models: Any, default: Any, field: str) -> None:
    with pytest.raises(AgentConfigError) as refused:
        define_model_registry(models=models, default=default)
    assert refused.value.field == field


def test_a_missing_capability_refuses_the_model_before_its_provider_is_built(monkeypatch: pytest.MonkeyPatch) -> None:
    from threadline import models as model_module

    built: list[str] = []

    def build(name: str) -> TestModel:
        built.append(name)
        return TestModel()

    monkeypatch.setattr(model_module, "infer_model", build)
    registry = define_model_registry(
        models={"text": {"model": "test:text-only", "context_window": 1_000, "capabilities": []}}
    )
    for check in (registry.resolve, registry.preflight):
        with pytest.raises(model_module.AgentModelUnavailableError, match=r"lacks capabilities \['vision'\]"):
            check("text", ["vision"])
    assert built == []  # no provider constructed, no credential read
    assert registry.resolve("text").capabilities == frozenset() and built == ["test:text-only"]


@pytest.mark.parametrize(
    ("contributions", "field"),
    [
        ("You are helpful.", "contributions"),
        ([{"name": "a", "render": lambda ctx: "x", "stable": True}], "contributions[0].stable"),
        ([{"name": "", "render": lambda ctx: "x"}], "contributions[0].name"),
        ([{"name": "a", "render": "x"}], "contributions[0].render"),
        ([{"name": "a", "render": lambda ctx: "x", "stability": "forever"}], "contributions[0].stability"),
        ([{"name": "a", "render": lambda ctx: "x"}, {"name": "a", "render": lambda ctx: "y"}], "contributions"),
        ([42], "contributions[0]"),
    ],
)
def test_compose_agent_prompt_checks_every_contribution(contributions: Any, field: str) -> None:
    with pytest.raises(AgentConfigError) as refused:
        compose_agent_prompt(contributions)
    assert refused.value.field == field


def test_define_agent_protocol_checks_its_arguments() -> None:
    with pytest.raises(AgentConfigError, match="the class, not an instance") as refused:
        define_agent_protocol(context=Context())  # type: ignore[arg-type]
    assert refused.value.field == "context"
    with pytest.raises(AgentConfigError) as refused:
        define_agent_protocol(terminal_acceptance="require-text")  # type: ignore[arg-type]
    assert refused.value.field == "terminal_acceptance"


# ------------------------------------------------------------------------------- the shortcuts that work


async def answer(runtime: Any, text: str = "hello") -> Any:
    try:
        return await asyncio.wait_for(runtime.submit(conversation_id="c1", parts=text, context={}).result, WAIT)
    finally:
        await runtime.close()


async def test_a_registry_with_a_default_model_is_models_itself() -> None:
    fast, slow = Script(), Script()
    registry = define_model_registry(
        models={"fast": {"model": fast.model, "context_window": 1000}, "slow": {"model": slow.model}}, default="fast"
    )
    result = await answer(build(models=registry))
    assert result.text == "answer to: hello" and len(fast.calls) == 1 and slow.calls == []
    assert result.run.last_operation is not None


async def test_a_registry_of_one_model_needs_no_default() -> None:
    only = Script()
    result = await answer(build(models=define_model_registry(models={"only": {"model": only.model}})))
    assert (result.text, len(only.calls)) == ("answer to: hello", 1)


def test_a_registry_of_several_models_without_a_default_is_refused_with_the_spelling_to_use() -> None:
    registry = define_model_registry(models={"fast": {"model": "test"}, "slow": {"model": "test"}})
    with pytest.raises(AgentConfigError) as refused:
        build(models=registry)
    assert refused.value.field == "models"
    assert "define_model_registry(models=..., default='fast')" in str(refused.value)
    assert "models={'resolve': lambda ctx: registry.resolve('fast')}" in str(refused.value)


async def test_a_pydantic_ai_model_is_models_itself() -> None:
    result = await answer(build(models=TestModel(custom_output_text="from the test model")))
    assert result.text == "from the test model"


async def test_prompt_text_is_one_stable_instruction_in_every_request() -> None:
    script = Script()
    result = await answer(build(models={"resolve": lambda: script.model}, prompt="You are helpful."))
    assert result.terminal_reason == "success"
    assert script.infos[0].instructions == "You are helpful."
    parts = script.infos[0].model_request_parameters.instruction_parts
    assert [(p.content, p.dynamic) for p in parts] == [("You are helpful.", False)]


async def test_a_store_handle_is_store_itself(tmp_path: Any) -> None:
    script = Script()
    async with create_sqlite_agent_runtime_store(tmp_path / "t.db") as handle:
        result = await answer(build(models={"resolve": lambda: script.model}, store=handle))
        stored = await handle.store.load_run(conversation_id="c1", run_id=result.run.id)
    assert stored is not None and stored.run.terminal_reason == "success"


async def test_a_protocol_without_context_needs_no_context_and_parts_may_be_text() -> None:
    script = Script()
    runtime = build(protocol=define_agent_protocol(), models={"resolve": lambda: script.model})
    ticket = runtime.submit(conversation_id="c1", parts="just text")
    result = await asyncio.wait_for(ticket.result, WAIT)
    await runtime.close()
    assert result.text == "answer to: just text"
    admission = await ticket.admission
    assert [(p.type, p.text) for p in admission.input.parts] == [("text", "just text")]


class Strict(BaseModel):
    tenant: str


async def test_a_run_never_starts_with_a_mistake_a_construction_check_would_have_caught() -> None:
    """Nothing is written when construction refuses: no runtime exists to write it."""
    store = create_memory_agent_runtime_store()
    with pytest.raises(AgentConfigError):
        create_agent_runtime(
            protocol=define_agent_protocol(context=Strict),
            store=store,
            models={"resolve": lambda: TestModel()},
            loop={"max_steps": 0},
        )
    assert (await store.conversations.list()).items == ()
