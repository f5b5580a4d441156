"""list_directory, glob and search_files: shapes, coverage, budgets, denial and RE2 refusals."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from threadline.coding import AgentCodingToolLimits


async def test_list_directory_marks_excluded_lists_symlinks_and_names_denied(make_tools, workspace: Path) -> None:
    (workspace / "node_modules").mkdir()
    (workspace / ".env").write_text("TOKEN=1")
    (workspace / "escape").symlink_to(workspace.parent / "outside")
    tools = make_tools(deny=(".env",))
    result = await tools.call("list_directory")
    assert result["path"] == "."
    assert result["entries"] == [  # directories first, then the rest, each by name
        {"name": "node_modules", "kind": "directory", "excluded": True},
        {"name": "src", "kind": "directory"},
        {"name": "README.md", "kind": "file", "bytes": len("# Project\n\nSay hello.\n")},
        {"name": "escape", "kind": "symlink"},
    ]
    assert result["denied"] == [{"path": ".env", "kind": "file"}] and result["denied_truncated"] is False
    assert result["coverage"]["complete"] is False and result["coverage"]["reasons"] == ["denied"]
    assert result["coverage"]["scope"]["symlinks"] == "listed"
    assert tools.paths[0] == "."  # discovery rooted at '.' asks about '.'
    assert tools.asked == [{"operation": "list", "path": "."}]
    sub = await tools.call("list_directory", path="src")
    assert [e["name"] for e in sub["entries"]] == ["app.py", "util.py"]
    assert sub["coverage"]["complete"] is True
    assert (await tools.envelope("list_directory", path="missing"))["error"] == "NOT_FOUND"
    assert (await tools.envelope("list_directory", path="README.md"))["error"] == "BAD_REQUEST"
    assert (await tools.envelope("list_directory", path="escape"))["error"] == "FORBIDDEN"


async def test_list_directory_caps_entries(make_tools, workspace: Path) -> None:
    for n in range(30):
        (workspace / "src" / f"m{n:02}.py").write_text("x")
    tools = make_tools(limits=AgentCodingToolLimits(max_list_entries=10))
    result = await tools.call("list_directory", path="src")
    assert len(result["entries"]) == 10 and result["truncated"] is True
    assert result["coverage"]["reasons"] == ["max-list-entries"]
    # the smaller of max_list_entries and max_search_entries caps the read, and the reason names it
    entries = make_tools(limits=AgentCodingToolLimits(max_list_entries=10, max_search_entries=4))
    capped = await entries.call("list_directory", path="src")
    assert len(capped["entries"]) == 4 and capped["truncated"] is True
    assert capped["coverage"]["reasons"] == ["max-search-entries"] and capped["coverage"]["entries"] == 4


async def test_glob_matches_anchored_patterns_and_prunes_before_policy(make_tools, workspace: Path) -> None:
    (workspace / "docs").mkdir()
    (workspace / "docs" / "guide.py").write_text("x")
    (workspace / "src" / "deep" / "er").mkdir(parents=True)
    (workspace / "src" / "deep" / "er" / "x.py").write_text("x")
    (workspace / "node_modules" / "m").mkdir(parents=True)
    (workspace / "node_modules" / "m" / "i.py").write_text("x")
    tools = make_tools()
    result = await tools.call("glob", pattern="src/**/*.py")
    assert result["paths"] == ["src/app.py", "src/deep/er/x.py", "src/util.py"]
    assert result["coverage"]["complete"] is True and result["result_truncated"] is False
    assert "docs" not in tools.paths  # an incompatible prefix is pruned before the policy is asked
    assert result["skipped_directories"] == 0
    star = await tools.call("glob", pattern="*.py")
    assert star["paths"] == []  # '*' does not cross '/'
    everywhere = await tools.call("glob", pattern="**/*.py")
    assert everywhere["skipped_directories"] == 1  # node_modules: excluded, counted
    assert "node_modules/m/i.py" not in everywhere["paths"]
    scoped = await tools.call("glob", pattern="*.py", path="src")
    assert scoped["paths"] == ["src/app.py", "src/util.py"]
    assert tools.asked[-1] == {"operation": "glob", "pattern": "*.py", "path": "src"}
    bad = await tools.envelope("glob", pattern="../*")
    assert bad["error"] == "BAD_REQUEST"


async def test_glob_result_ceiling_is_conservative(make_tools, workspace: Path) -> None:
    for n in range(5):
        (workspace / f"f{n}.txt").write_text("x")
    tools = make_tools(limits=AgentCodingToolLimits(max_search_results=5))
    result = await tools.call("glob", pattern="*.txt")
    assert len(result["paths"]) == 5
    assert result["result_truncated"] is True and result["coverage"]["reasons"] == ["max-search-results"]


async def test_search_literal_regex_and_context(make_tools, workspace: Path) -> None:
    tools = make_tools()
    literal = await tools.call("search_files", query="hello")
    assert [(m["path"], m["line"], m["text"]) for m in literal["matches"]] == [
        ("README.md", 3, "Say hello."),
        ("src/app.py", 2, "    return 'hello'"),
    ]
    assert literal["coverage"]["complete"] is True and literal["scanned_files"] == 3
    assert tools.asked[-1] == {"operation": "search", "query": "hello", "mode": "content"}
    regex = await tools.call("search_files", query=r"^def \w+\(", regex=True, context=1)
    assert regex["matches"] == [
        {"path": "src/app.py", "line": 1, "text": "def main():", "before": [], "after": ["    return 'hello'"]}
    ]
    paths = await tools.call("search_files", query=r"util\.py$", regex=True, mode="path")
    assert paths["matches"] == [{"path": "src/util.py"}]


async def test_search_include_is_anchored_and_hints(make_tools) -> None:
    tools = make_tools()
    nothing = await tools.call("search_files", query="import", include="*.py")
    assert nothing["matches"] == [] and "'**/*.py'" in nothing["hint"]
    found = await tools.call("search_files", query="import", include="**/*.py")
    assert [m["path"] for m in found["matches"]] == ["src/util.py"]


async def test_search_refuses_unbounded_constructs_before_any_io(make_tools) -> None:
    tools = make_tools()
    for pattern in (r"(a)\1", r"foo(?=bar)", r"(?<!x)y", r"(?<name>a)\k<name>"):
        envelope = await tools.envelope("search_files", query=pattern, regex=True)
        assert envelope["error"] == "BAD_REQUEST", pattern
        assert "linear time" in envelope["_hint"]
    assert tools.asked == [] and tools.paths == []
    invalid = await tools.envelope("search_files", query="(unclosed", regex=True)
    assert invalid["error"] == "BAD_REQUEST" and "regex=false" in invalid["_hint"]
    # inside a class or escaped, those characters are ordinary
    ok = await tools.call("search_files", query=r"[(?=]x|\\1", regex=True)
    assert ok["coverage"]["complete"] is True


async def test_pathological_regex_on_a_long_line_finishes(make_tools, workspace: Path) -> None:
    (workspace / "long.txt").write_text("a" * 200_000 + "b\n")
    tools = make_tools()
    result = await asyncio.wait_for(tools.call("search_files", query="(a+)+$", regex=True), timeout=10)
    assert result["matches"] == [] and result["coverage"]["complete"] is True
    hit = await tools.call("search_files", query="(a+)+b$", regex=True)
    assert hit["matches"][0]["path"] == "long.txt" and hit["matches"][0]["text_truncated"] is True
    assert len(hit["matches"][0]["text"].encode()) <= 8192


async def test_search_coverage_reasons(make_tools, workspace: Path) -> None:
    (workspace / "blob.bin").write_bytes(b"hello \xff\xfe")
    (workspace / "nul.bin").write_bytes(b"hello\x00")
    (workspace / "big.txt").write_text("hello\n" * 100)
    tools = make_tools(limits=AgentCodingToolLimits(max_read_bytes=200), deny=("src/util.py",))
    result = await tools.call("search_files", query="hello")
    assert [m["path"] for m in result["matches"]] == ["README.md", "src/app.py"]
    assert set(result["coverage"]["reasons"]) == {"invalid-utf8", "binary", "max-read-bytes", "denied"}
    assert result["coverage"]["complete"] is False and result["truncated"] is True
    assert result["denied"] == [{"path": "src/util.py", "kind": "file"}]


async def test_search_results_and_output_ceilings(make_tools, workspace: Path) -> None:
    (workspace / "many.txt").write_text("needle " + "x" * 200 + "\n" * 1 + ("needle\n" * 300))
    limited = make_tools(limits=AgentCodingToolLimits(max_search_results=7))
    result = await limited.call("search_files", query="needle")
    assert len(result["matches"]) == 7 and "max-search-results" in result["coverage"]["reasons"]
    tight = make_tools(limits=AgentCodingToolLimits(max_search_output_bytes=2048))
    bounded = await tight.call("search_files", query="needle")
    assert len(json.dumps(bounded, ensure_ascii=False, separators=(",", ":")).encode()) <= 2048
    assert "max-search-output-bytes" in bounded["coverage"]["reasons"]
    long_include = "a" * 4000
    refused = await tight.envelope("search_files", query="x", include=long_include)
    assert refused["error"] == "BAD_REQUEST" and tight.asked == [
        {"operation": "search", "query": "needle", "mode": "content"}
    ]


async def test_discovery_budgets_stop_with_reasons(make_tools, workspace: Path) -> None:
    for d in range(6):
        (workspace / f"d{d}" / "e").mkdir(parents=True)
        (workspace / f"d{d}" / "e" / "f.txt").write_text("hello")
    checks = {
        "max-search-directories": AgentCodingToolLimits(max_search_directories=3),
        "max-search-depth": AgentCodingToolLimits(max_search_depth=1),
        "max-search-files": AgentCodingToolLimits(max_search_files=2),
        "max-search-entries": AgentCodingToolLimits(max_search_entries=5),
        "max-search-bytes": AgentCodingToolLimits(max_search_bytes=30),
    }
    for reason, limits in checks.items():
        tools = make_tools(limits=limits)
        result = await tools.call("search_files", query="hello")
        assert reason in result["coverage"]["reasons"], reason
        assert result["coverage"]["complete"] is False


def _serialized(result: dict) -> int:
    return len(json.dumps(result, ensure_ascii=False, separators=(",", ":")).encode())


async def test_denied_and_error_diagnostics_stay_within_the_output_ceiling(make_tools, workspace: Path) -> None:
    # the ceiling is the whole serialized result, diagnostics included: long denied names shorten the list
    for n in range(60):
        (workspace / f"deny_{'n' * 200}{n:02}").write_text("hello\n")
    denied = tuple(f"deny_{'n' * 200}{n:02}" for n in range(60))
    tools = make_tools(deny=denied, limits=AgentCodingToolLimits(max_search_output_bytes=1_024))
    for name, arguments in (
        ("list_directory", {}),
        ("glob", {"pattern": "**"}),
        ("search_files", {"query": "hello"}),
    ):
        result = await tools.call(name, **arguments)
        assert _serialized(result) <= 1_024, name
        assert len(result["denied"]) < 60 and result["denied_truncated"] is True, name
        assert "denied" in result["coverage"]["reasons"] and result["coverage"]["complete"] is False, name
    roomy = make_tools(deny=denied)
    listed = await roomy.call("list_directory")
    assert len(listed["denied"]) == 60 and listed["denied_truncated"] is False


async def test_a_listing_whose_smallest_result_cannot_fit_refuses_before_any_access(make_tools) -> None:
    tools = make_tools(limits=AgentCodingToolLimits(max_search_output_bytes=1_024))
    long_path = "/".join(["d" * 200] * 4)  # does not exist: the refusal comes before the filesystem is asked
    refused = await tools.envelope("list_directory", path=long_path)
    assert refused["error"] == "BAD_REQUEST" and refused["status"] == 400
    assert tools.paths == [] and tools.asked == []
    glob = await tools.envelope("glob", pattern="*", path=long_path)
    assert glob["error"] == "BAD_REQUEST" and tools.paths == [] and tools.asked == []
    assert (await tools.envelope("list_directory", path="missing"))["error"] == "NOT_FOUND"


async def test_pattern_and_query_limits_count_utf16_code_units(make_tools) -> None:
    # glob and include patterns: 4,096 UTF-16 code units; queries: 8,192 (a character beyond U+FFFF is two)
    tools = make_tools()
    wide = "\U0001f600"
    assert (await tools.call("glob", pattern=wide * 2_048))["paths"] == []
    assert (await tools.envelope("glob", pattern=wide * 2_049))["error"] == "BAD_REQUEST"
    assert (await tools.envelope("glob", pattern="a" * 4_097))["error"] == "BAD_REQUEST"
    assert (await tools.call("search_files", query="x", include=wide * 2_048))["matches"] == []
    assert (await tools.envelope("search_files", query="x", include=wide * 2_049))["error"] == "BAD_REQUEST"
    assert (await tools.envelope("search_files", query="x", include="a" * 4_097))["error"] == "BAD_REQUEST"
    assert (await tools.call("search_files", query="q" * 8_192))["matches"] == []
    assert (await tools.envelope("search_files", query="q" * 8_193))["error"] == "BAD_REQUEST"
    assert (await tools.envelope("search_files", query=wide * 4_097))["error"] == "BAD_REQUEST"
    assert (await tools.call("search_files", query=wide * 4_096))["matches"] == []
    properties = tools.by_name["search_files"].args_model.model_json_schema()["properties"]
    assert properties["query"]["maxLength"] == 8_192 and properties["include"]["maxLength"] == 4_096


async def test_regex_reads_javascript_escapes(make_tools, workspace: Path) -> None:
    (workspace / "notes.txt").write_text("Alpha \U0001f600 grin\nbell\x07 here\ntab\x08back\n")
    tools = make_tools()

    async def lines(pattern: str) -> list[int]:
        result = await tools.call("search_files", query=pattern, regex=True, include="*.txt")
        return [m["line"] for m in result["matches"]]

    assert await lines(r"\u0041lpha") == [1]
    assert await lines(r"\uD83D\uDE00 grin") == [1]  # a surrogate pair is one character
    assert await lines(r"bell\cG") == [2]
    assert await lines(r"tab[\b]back") == [3]  # in a class, \b is a backspace
    assert await lines(r"^b[^]ll") == [2]  # [^] is any character
    assert await lines(r"a[]") == []  # [] matches nothing
    lone = await tools.envelope("search_files", query=r"\uD83D", regex=True)
    assert lone["error"] == "BAD_REQUEST" and "surrogate" in lone["message"]
    assert await lines(r"(?i-s:ALPHA) \S+ (?ims-ims:grin)$") == [1]


async def test_the_include_hint_appears_only_when_the_include_produced_the_zero(make_tools, workspace: Path) -> None:
    tools = make_tools()
    # one directory at the top: '*.py' keeps it out, and the hint counts what the pattern rejected
    nothing = await tools.call("search_files", query="import", include="*.py")
    assert nothing["scanned_files"] == 0 and "rejected all 2 file" in nothing["hint"]
    (workspace / "top.py").write_text("import sys\n")
    only_top = await tools.call("search_files", query="nothing-here", include="*.md", mode="path")
    assert only_top["scanned_files"] == 1 and "hint" not in only_top  # README.md passed the include


async def test_no_include_hint_for_an_empty_workspace_or_files_the_host_refused(make_tools, tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    result = await make_tools(root=empty).call("search_files", query="needle", include="*.py")
    assert (result["matches"], result["scanned_files"]) == ([], 0) and "hint" not in result
    guarded = tmp_path / "guarded"
    guarded.mkdir()
    (guarded / "secret.py").write_text("needle = 1\n")
    tools = make_tools(root=guarded, deny=("secret.py",))
    refused = await tools.call("search_files", query="needle", include="**/*.py")
    assert (refused["matches"], refused["scanned_files"]) == ([], 0) and "hint" not in refused
    assert refused["denied"] == [{"path": "secret.py", "kind": "file"}]
