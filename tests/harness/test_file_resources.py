"""File resources and skills (issue 21 item 2) on real directories: only declared absolute roots, symlinks refused
(never followed), provenance ``root_id:relative/path``, SKILL.md frontmatter through PyYAML's safe_load, instructions in
the prompt and skills/resources as summaries read later through ``read_resource``, the seeds' bounds, and one
immutable discovery generation per loader."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import pytest

from threadline import AgentConfigError
from threadline.harness import (
    AgentHarnessProfileEvent,
    AgentHarnessResourceError,
    create_agent_harness_file_resources,
)

from .conftest import WAIT, Scripted, make_harness, submit

SKILL = """---
name: pdf-forms
description: >
  Fill PDF forms
  from a mapping of fields.
---
# PDF forms

Step 1: open the form.
"""


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    (tmp_path / "instructions").mkdir()
    (tmp_path / "instructions" / "AGENTS.md").write_text("Always answer in French.\n")
    (tmp_path / "skills" / "pdf").mkdir(parents=True)
    (tmp_path / "skills" / "pdf" / "SKILL.md").write_text(SKILL)
    (tmp_path / "skills" / "pdf" / "helper.py").write_text("print('not a skill file')\n")
    (tmp_path / "docs" / "guides").mkdir(parents=True)
    (tmp_path / "docs" / "guides" / "style.md").write_text("Use short sentences.\n")
    return tmp_path


def loader(tree: Path, **limits: int) -> Any:
    return create_agent_harness_file_resources(
        roots=[
            {"id": "house", "path": str(tree / "instructions"), "kind": "instruction"},
            {"id": "skills", "path": str(tree / "skills"), "kind": "skill"},
            {"id": "docs", "path": str(tree / "docs"), "kind": "resource"},
        ],
        limits=limits or None,
    )


async def test_discovery_projects_instructions_skills_and_resources(tree: Path) -> None:
    loaded = await loader(tree).load()
    by_name = {r.name: r for r in loaded.resources}
    assert [(r.kind, r.name, r.provenance) for r in loaded.resources] == [
        ("instruction", "AGENTS.md", "house:AGENTS.md"),
        ("skill", "pdf-forms", "skills:pdf/SKILL.md"),
        ("resource", "guides/style.md", "docs:guides/style.md"),
    ]
    assert by_name["AGENTS.md"].text == "Always answer in French.\n", "instructions enter whole"
    assert "Fill PDF forms from a mapping of fields." in by_name["pdf-forms"].text
    assert "Step 1" not in by_name["pdf-forms"].text, "a skill enters as its summary"
    assert "short sentences" not in by_name["guides/style.md"].text
    assert loaded.diagnostics == ()


async def test_a_run_sees_the_summaries_and_reads_a_skill_through_read_resource(tree: Path) -> None:
    scripted = Scripted(tool="read_resource", tool_args='{"name": "pdf-forms"}')
    profiles: list[AgentHarnessProfileEvent] = []
    harness = make_harness(scripted, resources=loader(tree), on_profile=profiles.append)
    result = await asyncio.wait_for(submit(harness, "k1", "fill the form").result, WAIT)
    instructions = scripted.infos[0].instructions or ""
    assert "Always answer in French." in instructions and "pdf-forms" in instructions
    assert "Step 1" not in instructions
    returned = [p for m in scripted.calls[1] for p in getattr(m, "parts", ()) if p.part_kind == "tool-return"]
    assert returned[0].content["text"] == SKILL and returned[0].content["provenance"] == "skills:pdf/SKILL.md"
    assert result.terminal_reason == "success"
    assert profiles[0].tool_names == ("read_resource",)
    assert [r.provenance for r in profiles[0].resources] == [
        "house:AGENTS.md",
        "skills:pdf/SKILL.md",
        "docs:guides/style.md",
    ]
    await harness.close()


async def test_an_unknown_name_is_a_typed_refusal_the_model_sees(tree: Path) -> None:
    scripted = Scripted(tool="read_resource", tool_args='{"name": "nope"}')
    harness = make_harness(scripted, resources=loader(tree))
    await asyncio.wait_for(submit(harness, "k1", "read it").result, WAIT)
    returned = [p for m in scripted.calls[1] for p in getattr(m, "parts", ()) if p.part_kind == "tool-return"]
    assert "NOT_FOUND" in str(returned[0].content)
    await harness.close()


async def test_a_symlink_under_a_root_fails_the_load_and_nothing_outside_is_read(
    tree: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    outside = tmp_path_factory.mktemp("outside")
    (outside / "secret.md").write_text("the launch code")
    os.symlink(outside, tree / "docs" / "linked-dir")  # a symlinked directory: an escape from the root
    resources = loader(tree)
    with pytest.raises(AgentHarnessResourceError, match="refuses symlinks") as refused:
        await resources.load()
    assert refused.value.field == "symlink" and "'docs'" in str(refused.value)
    assert "launch code" not in str(refused.value)
    (tree / "docs" / "linked-dir").unlink()
    os.symlink(outside / "secret.md", tree / "docs" / "linked.md")  # a symlinked file too
    with pytest.raises(AgentHarnessResourceError, match="refuses symlinks"):
        await resources.load()
    (tree / "docs" / "linked.md").unlink()
    loaded = await resources.load()  # a refused discovery is not kept: the next load tries again
    assert all("launch code" not in r.text for r in loaded.resources) and loaded.diagnostics == ()


async def test_a_run_over_a_root_with_a_symlink_fails_before_any_provider_request(
    tree: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    outside = tmp_path_factory.mktemp("outside")
    os.symlink(outside, tree / "skills" / "escaped")
    scripted = Scripted()
    harness = make_harness(scripted, resources=loader(tree))
    result = await asyncio.wait_for(submit(harness, "k1", "hello").result, WAIT)
    assert result.terminal_reason == "runtime_failure" and scripted.calls == []
    await harness.close()


async def test_one_loader_is_one_immutable_generation(tree: Path) -> None:
    resources = loader(tree)
    first, concurrent = await asyncio.gather(resources.load(), resources.load())
    assert first is concurrent
    (tree / "docs" / "new.md").write_text("added later")
    (tree / "skills" / "pdf" / "SKILL.md").write_text(SKILL.replace("Step 1", "Step one"))
    assert await resources.load() is first
    assert "Step 1" in (await resources.read("pdf-forms")).text, "reads stay in the generation"
    fresh = await loader(tree).load()
    assert "new.md" in {r.name for r in fresh.resources}, "a new loader is a new generation"


@pytest.mark.parametrize(
    ("skill", "field"),
    [
        ("# no frontmatter\n", "frontmatter"),
        ("---\nname: [unclosed\n---\n", "frontmatter"),
        ("---\n- a list\n---\n", "frontmatter"),
        ("---\ndescription: only a description\n---\n", "name"),
        ("---\nname: x\ndescription: ''\n---\n", "description"),
        ("---\nname: !!python/object/apply:os.system ['true']\ndescription: d\n---\n", "frontmatter"),
        (f"---\nname: x\ndescription: {'d' * 1100}\n---\n", "description"),
    ],
    ids=["missing", "bad-yaml", "not-a-mapping", "no-name", "empty-description", "unsafe-tag", "too-long"],
)
async def test_invalid_skills_fail_the_load_naming_the_file(tree: Path, skill: str, field: str) -> None:
    (tree / "skills" / "pdf" / "SKILL.md").write_text(skill)
    with pytest.raises(AgentHarnessResourceError) as caught:
        await loader(tree).load()
    assert caught.value.field == field and "skills:pdf/SKILL.md" in str(caught.value)


async def test_bounds_and_bad_files_fail_the_load(tree: Path) -> None:
    with pytest.raises(AgentHarnessResourceError) as too_many:
        await loader(tree, max_files=2).load()
    assert too_many.value.field == "max_files"
    assert len((await loader(tree, max_files=3).load()).resources) == 3, "exactly at the bound is fine"
    with pytest.raises(AgentHarnessResourceError) as too_big:
        await loader(tree, max_file_bytes=10).load()
    assert too_big.value.field == "max_file_bytes"
    with pytest.raises(AgentHarnessResourceError) as too_much:
        await loader(tree, max_total_bytes=60).load()
    assert too_much.value.field == "max_total_bytes"
    (tree / "docs" / "binary.md").write_bytes(b"\xff\xfe not text")
    with pytest.raises(AgentHarnessResourceError) as not_text:
        await loader(tree).load()
    assert not_text.value.field == "encoding" and "docs:binary.md" in str(not_text.value)


async def test_depth_beyond_the_bound_is_reported_not_read(tree: Path) -> None:
    deep = tree / "docs" / "a" / "b"
    deep.mkdir(parents=True)
    (deep / "deep.md").write_text("deep")
    loaded = await loader(tree, max_depth=1).load()
    assert "a/b/deep.md" not in {r.name for r in loaded.resources}
    assert any("max-search-depth" in d.message for d in loaded.diagnostics)


async def test_a_missing_root_fails_the_load_and_the_next_load_tries_again(tree: Path) -> None:
    missing = tree / "later"
    resources = create_agent_harness_file_resources(roots=[{"id": "later", "path": str(missing), "kind": "resource"}])
    with pytest.raises(AgentHarnessResourceError):
        await resources.load()
    missing.mkdir()
    (missing / "now.md").write_text("here")
    assert [r.name for r in (await resources.load()).resources] == ["now.md"]


async def test_duplicate_names_across_roots_fail_the_load(tree: Path) -> None:
    (tree / "more").mkdir()
    (tree / "more" / "AGENTS.md").write_text("again")
    resources = create_agent_harness_file_resources(
        roots=[
            {"id": "a", "path": str(tree / "instructions"), "kind": "instruction"},
            {"id": "b", "path": str(tree / "more"), "kind": "resource"},
        ]
    )
    with pytest.raises(AgentHarnessResourceError) as caught:
        await resources.load()
    assert caught.value.field == "name" and "a:AGENTS.md" in str(caught.value)


@pytest.mark.parametrize(
    ("roots", "field"),
    [
        ([], "roots"),
        ([{"id": "x", "path": "relative/dir", "kind": "resource"}], "roots[0].path"),
        ([{"id": "../x", "path": "/tmp", "kind": "resource"}], "roots[0].id"),
        ([{"id": "x", "path": "/tmp", "kind": "secret"}], "roots[0].kind"),
        ([{"id": "x", "path": "/tmp", "kind": "resource"}, {"id": "x", "path": "/", "kind": "skill"}], "roots[1].id"),
    ],
)
def test_bad_roots_are_refused_when_declared(roots: list[dict[str, str]], field: str) -> None:
    with pytest.raises(AgentConfigError) as caught:
        create_agent_harness_file_resources(roots=roots)
    assert caught.value.field == field


def test_bad_limits_are_refused_when_declared(tree: Path) -> None:
    with pytest.raises(AgentConfigError) as caught:
        create_agent_harness_file_resources(
            roots=[{"id": "x", "path": str(tree), "kind": "resource"}], limits={"max_files": 0}
        )
    assert caught.value.field == "limits.max_files"
