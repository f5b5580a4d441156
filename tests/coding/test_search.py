"""search_files reads each file into one shared buffer and searches the bytes before decoding them: what that
must never change (stale bytes of a previous file, matches past the binary probe, line boundaries), and the
one deliberate effect — a file that holds no match is searched whatever its encoding."""

from __future__ import annotations

from pathlib import Path


def found(result: dict) -> list[tuple[str, int, str]]:
    return [(m["path"], m["line"], m["text"]) for m in result["matches"]]


async def test_a_smaller_file_never_matches_the_bytes_a_larger_one_left_in_the_buffer(
    make_tools, workspace: Path
) -> None:
    (workspace / "a_big.txt").write_text("x" * 100_000 + "\nneedle at the end\n")
    (workspace / "b_small.txt").write_text("short\n")  # the buffer still holds a_big.txt's bytes past these
    (workspace / "c_mid.txt").write_text("y" * 70_000 + "\n")
    tools = make_tools()
    for query, regex in (("needle", False), ("ne+dle", True), ("x{50}", True)):
        result = await tools.call("search_files", query=query, regex=regex, include="*.txt")
        assert [m["path"] for m in result["matches"]] == ["a_big.txt"], (query, result["matches"])
        assert result["scanned_files"] == 3 and result["coverage"]["complete"] is True
    tail = await tools.call("search_files", query="y$", regex=True, include="*.txt")
    assert [(m["path"], m["line"]) for m in tail["matches"]] == [("c_mid.txt", 1)]


async def test_a_match_past_the_binary_probe_is_found_and_a_late_nul_is_content(make_tools, workspace: Path) -> None:
    (workspace / "late.txt").write_bytes(b"a\n" * 40_000 + b"\x00 needle\n")  # the NUL is past the first 64 KiB
    tools = make_tools()
    result = await tools.call("search_files", query="needle", include="*.txt")
    assert found(result) == [("late.txt", 40_001, "\x00 needle")]
    assert result["coverage"]["bytes"] == 80_009


async def test_a_file_without_a_match_is_searched_whatever_its_encoding(make_tools, workspace: Path) -> None:
    (workspace / "latin1.txt").write_bytes("café menu\n".encode("latin-1"))
    tools = make_tools()
    miss = await tools.call("search_files", query="absent")
    # no match in its bytes is an exact answer: nothing is withheld, the search is complete
    assert miss["matches"] == [] and miss["scanned_files"] == 4 and miss["coverage"]["complete"] is True
    hit = await tools.call("search_files", query="menu")
    # a match in a file that is not UTF-8 is withheld, and coverage says so
    assert hit["matches"] == [] and hit["scanned_files"] == 3
    assert hit["coverage"]["complete"] is False and hit["coverage"]["reasons"] == ["invalid-utf8"]


async def test_every_line_is_reported_once_and_nothing_after_the_last_newline(make_tools, workspace: Path) -> None:
    (workspace / "lines.txt").write_text("x\ny\n")
    (workspace / "empty.txt").write_text("")
    (workspace / "tail.txt").write_text("no newline")
    tools = make_tools()
    anchored = await tools.call("search_files", query="^", regex=True, include="*.txt")
    assert found(anchored) == [("lines.txt", 1, "x"), ("lines.txt", 2, "y"), ("tail.txt", 1, "no newline")]
    ends = await tools.call("search_files", query="$", regex=True, include="*.txt")
    assert found(ends) == found(anchored)
    # a literal spanning a newline is still found (reported on the line it starts on)
    spanning = await tools.call("search_files", query="x\ny", include="*.txt")
    assert found(spanning) == [("lines.txt", 1, "x")]


async def test_literal_text_is_matched_byte_for_byte(make_tools, workspace: Path) -> None:
    (workspace / "chars.txt").write_text("a.b\naxb\n(a+)+\nnaïve\nNAÏVE\n")
    tools = make_tools()
    assert found(await tools.call("search_files", query="a.b", include="*.txt")) == [("chars.txt", 1, "a.b")]
    assert found(await tools.call("search_files", query="(a+)+", include="*.txt")) == [("chars.txt", 3, "(a+)+")]
    assert found(await tools.call("search_files", query="ï", include="*.txt")) == [("chars.txt", 4, "naïve")]
