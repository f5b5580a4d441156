"""read_file, write_file and edit_file: shapes, payloads, refusals and the per-target lock."""

from __future__ import annotations

import asyncio
import hashlib
import os
from pathlib import Path

import pytest

from threadline.coding import create_agent_coding_tools
from threadline.errors import AgentConfigError
from threadline.tools import AgentToolContext, error_envelope


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


async def test_the_tool_set_and_its_schemas(make_tools) -> None:
    tools = make_tools()
    assert sorted(tools.by_name) == [
        "edit_file",
        "glob",
        "list_directory",
        "read_file",
        "search_files",
        "write_file",
    ]
    schema = tools.by_name["edit_file"].definition().parameters_json_schema
    assert set(schema["properties"]) == {"path", "old_text", "new_text", "replace_all", "expected_sha256", "dry_run"}
    assert schema["additionalProperties"] is False


def test_construction_refuses_bad_configuration(workspace: Path) -> None:
    with pytest.raises(AgentConfigError) as info:
        create_agent_coding_tools(root="relative", authorize=lambda p: True)
    assert info.value.field == "root"
    with pytest.raises(AgentConfigError) as info:
        create_agent_coding_tools(root=workspace, authorize=lambda p: True, executables={"py": "python3"})
    assert info.value.field == "executables"
    with pytest.raises(AgentConfigError) as info:
        create_agent_coding_tools(root=workspace, authorize=lambda p: True, limits={"max_search_output_bytes": 10})
    assert info.value.field == "limits"
    with pytest.raises(AgentConfigError):
        create_agent_coding_tools(root=workspace, authorize=None)  # type: ignore[arg-type]


async def test_read_file_returns_text_digest_and_asks_in_order(make_tools, workspace: Path) -> None:
    tools = make_tools()
    result = await tools.call("read_file", path="src/app.py")
    content = (workspace / "src" / "app.py").read_bytes()
    assert result == {
        "path": "src/app.py",
        "text": content.decode(),
        "bytes": len(content),
        "sha256": sha(content),
        "truncated": False,
    }
    assert tools.paths == ["src", "src/app.py"]  # outermost first
    assert tools.asked == [{"operation": "read", "path": "src/app.py"}]


async def test_read_file_windows_cut_on_character_boundaries(make_tools, workspace: Path) -> None:
    text = "aé€😀" * 50  # 1-, 2-, 3- and 4-byte characters
    data = text.encode()
    (workspace / "u.txt").write_bytes(data)
    tools = make_tools()
    pieces, offset = [], 0
    while True:
        window = await tools.call("read_file", path="u.txt", offset=offset, max_bytes=7)
        assert window["sha256"] == sha(data)
        pieces.append(window["text"])
        if not window["truncated"]:
            break
        assert window["next_offset"] > offset
        offset = window["next_offset"]
    assert "".join(pieces) == text
    # a resumed offset inside a character starts at the next character
    inside = await tools.call("read_file", path="u.txt", offset=2, max_bytes=3)
    assert inside["text"] == "€"


async def test_read_file_refusals(make_tools, workspace: Path) -> None:
    (workspace / "bin.dat").write_bytes(b"\xff\xfe\x00")
    (workspace / "link").symlink_to(workspace.parent / "outside" / "secret.txt")
    os.mkfifo(workspace / "pipe")
    tools = make_tools(deny=("src/util.py",))
    cases = {
        "missing.txt": ("NOT_FOUND", 404),
        "src": ("BAD_REQUEST", 400),
        "bin.dat": ("BAD_REQUEST", 400),
        "link": ("FORBIDDEN", 403),
        "../outside/secret.txt": ("FORBIDDEN", 403),
        "src\\app.py": ("FORBIDDEN", 403),
        "src/util.py": ("FORBIDDEN", 403),
        "README.md/x": ("BAD_REQUEST", 400),
    }
    for path, (code, status) in cases.items():
        envelope = await asyncio.wait_for(tools.envelope("read_file", path=path), timeout=5)
        assert (envelope["error"], envelope["status"]) == (code, status), path
        assert envelope["_hint"]
        assert str(workspace) not in repr(envelope)
    envelope = await asyncio.wait_for(tools.envelope("read_file", path="pipe"), timeout=5)
    assert envelope["error"] == "BAD_REQUEST" and envelope["_hint"]


async def test_every_ordinary_refusal_names_the_next_move(make_tools) -> None:
    tools = make_tools()
    for name, arguments in (
        ("read_file", {"path": "."}),
        ("write_file", {"path": ".", "content": "x"}),
        ("edit_file", {"path": ".", "old_text": "a", "new_text": "b"}),
        ("read_file", {"path": "src//app.py"}),
        ("read_file", {"path": ""}),
        ("list_directory", {"path": "README.md"}),
        ("glob", {"pattern": "../*"}),
    ):
        envelope = await tools.envelope(name, **arguments)
        assert envelope["error"] == "BAD_REQUEST" and envelope["status"] == 400, (name, arguments)
        assert envelope["_hint"], (name, arguments)


async def test_absolute_path_refusal_names_the_recovery_path(make_tools, workspace: Path) -> None:
    tools = make_tools()
    envelope = await tools.envelope("read_file", path=str(workspace / "src" / "app.py"))
    assert envelope["error"] == "FORBIDDEN"
    assert envelope["details"]["recovery_path"] == "src/app.py"
    assert tools.paths == [] and tools.asked == []  # refused before any host policy
    retried = await tools.call("read_file", path=envelope["details"]["recovery_path"])
    assert retried["path"] == "src/app.py"
    outside = await tools.envelope("read_file", path=str(workspace.parent / "outside" / "secret.txt"))
    assert outside["error"] == "FORBIDDEN" and "recovery_path" not in outside["details"]


async def test_path_policy_denies_recursively_and_segment_wise(make_tools, workspace: Path) -> None:
    (workspace / "credentials").mkdir()
    (workspace / "credentials" / "key.pem").write_text("KEY")
    (workspace / "credentials-backup").write_text("old")
    tools = make_tools(deny=("credentials",))
    denied = await tools.envelope("read_file", path="credentials/key.pem")
    assert denied["error"] == "FORBIDDEN" and denied["details"]["denied"] == "credentials"
    assert tools.paths == ["credentials"]  # stopped at the first refusal
    assert tools.asked == []
    # a missing file under a denied directory is denied too, not NOT_FOUND
    assert (await tools.envelope("read_file", path="credentials/nothing"))["error"] == "FORBIDDEN"
    assert (await tools.call("read_file", path="credentials-backup"))["text"] == "old"


async def test_host_refusal_is_forbidden(make_tools) -> None:
    tools = make_tools(refuse_operations=("read",))
    envelope = await tools.envelope("read_file", path="README.md")
    assert envelope["error"] == "FORBIDDEN" and envelope["details"]["operation"] == "read"


async def test_write_file_plans_directories_before_authorization(workspace: Path) -> None:
    asked: list[tuple[dict, bool]] = []

    def authorize(payload):
        asked.append((payload, (workspace / "pkg").exists()))
        return True

    tools = {t.name: t for t in create_agent_coding_tools(root=workspace, authorize=authorize)}
    tool = tools["write_file"]
    ctx = AgentToolContext(conversation_id="c", run_id="r", call_id="k", tool_name="write_file", context=None)
    result = await tool.call(ctx, tool.validate({"path": "pkg/sub/mod.py", "content": "x = 1\n"}))
    assert result == {"path": "pkg/sub/mod.py", "bytes": 6, "created_directories": ["pkg", "pkg/sub"]}
    payload = {
        "operation": "write",
        "path": "pkg/sub/mod.py",
        "bytes": 6,
        "overwrite": False,
        "creates_directories": ["pkg", "pkg/sub"],
    }
    assert asked == [(payload, False)]  # nothing was created before the host approved
    assert (workspace / "pkg" / "sub" / "mod.py").read_text() == "x = 1\n"


async def test_write_file_refused_by_host_creates_nothing(make_tools, workspace: Path) -> None:
    tools = make_tools(refuse_operations=("write",))
    envelope = await tools.envelope("write_file", path="new/dir/f.txt", content="x")
    assert envelope["error"] == "FORBIDDEN"
    assert not (workspace / "new").exists()


async def test_write_file_conflicts_and_overwrite(make_tools, workspace: Path) -> None:
    tools = make_tools()
    exists = await tools.envelope("write_file", path="README.md", content="new")
    assert exists["error"] == "CONFLICT" and tools.asked == []  # the host is not asked about a doomed write
    blocked = await tools.envelope("write_file", path="README.md/inner.txt", content="new")
    assert blocked["error"] == "CONFLICT"
    done = await tools.call("write_file", path="README.md", content="new", overwrite=True)
    assert done["created_directories"] == []
    assert (workspace / "README.md").read_text() == "new"
    too_big = await tools.envelope("write_file", path="big.txt", content="x" * 262_145)
    assert too_big["error"] == "BAD_REQUEST" and too_big["details"]["max_write_bytes"] == 262_144


async def test_write_never_goes_through_a_symlink(make_tools, workspace: Path) -> None:
    outside = workspace.parent / "outside"
    (workspace / "out").symlink_to(outside)
    (workspace / "file-link").symlink_to(outside / "secret.txt")
    tools = make_tools()
    assert (await tools.envelope("write_file", path="out/new.txt", content="x"))["error"] == "FORBIDDEN"
    envelope = await tools.envelope("write_file", path="file-link", content="x", overwrite=True)
    assert envelope["error"] == "FORBIDDEN"
    assert sorted(os.listdir(outside)) == ["secret.txt"]
    assert (outside / "secret.txt").read_text() == "outside secret\n"


async def test_edit_file_replaces_one_exact_snippet_and_chains(make_tools, workspace: Path) -> None:
    tools = make_tools()
    before = (workspace / "src" / "app.py").read_bytes()
    first = await tools.call("edit_file", path="src/app.py", old_text="'hello'", new_text="'$& $$ \\1'")
    after = (workspace / "src" / "app.py").read_bytes()
    assert after == before.replace(b"'hello'", b"'$& $$ \\1'")  # inserted literally
    assert first == {
        "path": "src/app.py",
        "base_sha256": sha(before),
        "sha256": sha(after),
        "replacements": 1,
        "bytes": len(after),
        "applied": True,
    }
    assert tools.asked[-1] == {
        "operation": "edit",
        "path": "src/app.py",
        "base_sha256": sha(before),
        "result_sha256": sha(after),
        "result_bytes": len(after),
        "replacements": 1,
        "dry_run": False,
    }
    second = await tools.call(
        "edit_file",
        path="src/app.py",
        old_text="main()",
        new_text="run()",
        replace_all=True,
        expected_sha256=first["sha256"],
    )
    assert second["replacements"] == 2 and second["base_sha256"] == first["sha256"]


async def test_edit_file_refusals(make_tools, workspace: Path) -> None:
    tools = make_tools()
    ambiguous = await tools.envelope("edit_file", path="src/app.py", old_text="main()", new_text="x")
    assert ambiguous["error"] == "CONFLICT" and ambiguous["details"]["occurrences"] == 2
    missing = await tools.envelope("edit_file", path="src/app.py", old_text="nowhere", new_text="x")
    assert missing["error"] == "NOT_FOUND" and missing["details"]["occurrences"] == 0
    asked = len(tools.asked)
    stale = await tools.envelope(
        "edit_file", path="src/app.py", old_text="'hello'", new_text="x", expected_sha256="0" * 64
    )
    assert stale["error"] == "CONFLICT" and stale["details"]["expected_sha256"] == "0" * 64
    assert len(tools.asked) == asked  # a stale digest refuses before the host is asked
    gone = await tools.envelope("edit_file", path="src/none.py", old_text="a", new_text="b")
    assert gone["error"] == "NOT_FOUND"
    dry = await tools.call("edit_file", path="src/util.py", old_text="VALUE = 1", new_text="VALUE = 2", dry_run=True)
    assert dry["applied"] is False and (workspace / "src" / "util.py").read_text().endswith("VALUE = 1\n")
    invalid = await tools.envelope("edit_file", path="src/util.py", old_text="", new_text="b")
    assert invalid["error"] == "INVALID_ARGUMENTS"


async def test_concurrent_edits_of_one_file_never_erase_each_other(make_tools, workspace: Path) -> None:
    lines = [f"line {n}\n" for n in range(20)]
    (workspace / "many.txt").write_text("".join(lines))
    gate = asyncio.Event()

    async def slow_authorize(payload):
        await gate.wait()
        return True

    tools = create_agent_coding_tools(root=workspace, authorize=slow_authorize)
    by_name = {t.name: t for t in tools}

    async def edit(n: int) -> None:
        tool = by_name["edit_file"]
        ctx = AgentToolContext(conversation_id="c", run_id="r", call_id=str(n), tool_name="edit_file", context=None)
        await tool.call(ctx, tool.validate({"path": "many.txt", "old_text": f"line {n}\n", "new_text": f"LINE {n}\n"}))

    tasks = [asyncio.create_task(edit(n)) for n in range(20)]
    await asyncio.sleep(0.01)
    gate.set()
    await asyncio.wait_for(asyncio.gather(*tasks), timeout=30)
    assert (workspace / "many.txt").read_text() == "".join(f"LINE {n}\n" for n in range(20))


async def test_a_host_callback_error_keeps_its_cause(workspace: Path) -> None:
    def broken(payload):
        raise RuntimeError("host policy crashed")

    tool = next(t for t in create_agent_coding_tools(root=workspace, authorize=broken) if t.name == "read_file")
    ctx = AgentToolContext(conversation_id="c", run_id="r", call_id="k", tool_name="read_file", context=None)
    with pytest.raises(RuntimeError, match="host policy crashed") as info:
        await tool.call(ctx, tool.validate({"path": "README.md"}))
    assert error_envelope(info.value) == {"error": "INTERNAL_SERVER_ERROR", "retryable": False}


async def test_a_backslash_spelling_under_a_denied_directory_is_forbidden_and_writes_nothing(
    make_tools, workspace: Path
) -> None:
    (workspace / "credentials").mkdir()
    (workspace / "credentials" / "token.txt").write_text("SECRET=1\n")
    tools = make_tools(deny=("credentials",))
    for name, arguments in (
        ("read_file", {"path": "credentials\\token.txt"}),
        ("write_file", {"path": "credentials\\token.txt", "content": "changed", "overwrite": True}),
        ("edit_file", {"path": "credentials\\token.txt", "old_text": "SECRET=1", "new_text": "x"}),
        ("list_directory", {"path": "credentials\\nested"}),
    ):
        envelope = await tools.envelope(name, **arguments)
        assert (envelope["error"], envelope["status"]) == ("FORBIDDEN", 403), name
        assert "credentials/token.txt" in envelope["_hint"] or name == "list_directory"
    assert (workspace / "credentials" / "token.txt").read_text() == "SECRET=1\n"
    assert tools.paths == []  # refused by its spelling: no policy was asked about another decomposition
