"""The descriptor-anchored workspace core: spelling, opening, writing and walking, on real directories."""

from __future__ import annotations

import asyncio
import contextlib
import os
from pathlib import Path

import pytest

from threadline.coding.workspace import (
    WalkLimits,
    WalkStats,
    Workspace,
    WorkspaceBackslashError,
    WorkspaceChangedError,
    WorkspaceError,
    WorkspaceExistsError,
    WorkspaceForbiddenError,
    WorkspaceNotDirectoryError,
    WorkspaceNotFoundError,
    WorkspaceNotRegularFileError,
    WorkspacePathError,
    WorkspaceSymlinkError,
    WorkspaceUnavailableError,
    write_file_at,
)
from threadline.errors import AgentConfigError


@pytest.fixture
def tree(tmp_path: Path) -> tuple[Path, Path]:
    root = tmp_path / "ws"
    outside = tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    (outside / "secret.txt").write_text("outside secret")
    (root / "src").mkdir()
    (root / "src" / "a.py").write_text("print('a')\n")
    (root / "src" / "b.txt").write_text("bee\n")
    (root / "README.md").write_text("# readme\n")
    return root, outside


def test_root_must_be_absolute_and_a_directory(tmp_path: Path) -> None:
    with pytest.raises(AgentConfigError) as info:
        Workspace("relative/dir")
    assert info.value.field == "root"
    (tmp_path / "f").write_text("x")
    with pytest.raises(AgentConfigError):
        Workspace(tmp_path / "f")


@pytest.mark.parametrize(
    ("spelling", "error"),
    [
        ("", WorkspacePathError),
        ("a\x00b", WorkspacePathError),
        ("src\\a.py", WorkspaceBackslashError),
        ("src//a.py", WorkspacePathError),
        ("./src/a.py", WorkspacePathError),
        ("src/", WorkspacePathError),
        ("src/./a.py", WorkspacePathError),
        ("../outside/secret.txt", WorkspaceForbiddenError),
        ("src/../../outside/secret.txt", WorkspaceForbiddenError),
        ("x" * 256, WorkspacePathError),
        ("a/" * 2048 + "a", WorkspacePathError),
        (".", WorkspacePathError),
    ],
)
def test_spellings_refused_before_any_filesystem_access(tree, spelling: str, error: type[WorkspaceError]) -> None:
    root, _ = tree
    with pytest.raises(error) as info:
        Workspace(root).parse(spelling)
    assert info.value.code in ("BAD_REQUEST", "FORBIDDEN")
    assert str(root) not in str(info.value) and str(root) not in repr(info.value.details)


def test_backslash_hint_and_canonical_hint(tree) -> None:
    ws = Workspace(tree[0])
    with pytest.raises(WorkspaceBackslashError) as info:
        ws.parse("src\\a.py")
    assert info.value.code == "FORBIDDEN"
    assert "src/a.py" in (info.value.hint or "")
    with pytest.raises(WorkspacePathError) as info:
        ws.parse("./src//a.py")
    assert "'src/a.py'" in (info.value.hint or "")


def test_absolute_path_inside_root_carries_recovery_path(tree) -> None:
    root, outside = tree
    ws = Workspace(root)
    with pytest.raises(WorkspaceForbiddenError) as info:
        ws.parse(str(root / "src" / "a.py"))
    assert info.value.recovery_path == "src/a.py"
    assert info.value.details == {"recovery_path": "src/a.py"}
    with pytest.raises(WorkspaceForbiddenError) as info:
        ws.parse(str(root))
    assert info.value.recovery_path == "."
    with pytest.raises(WorkspaceForbiddenError) as info:
        ws.parse(str(outside / "secret.txt"))
    assert info.value.recovery_path is None
    with pytest.raises(WorkspaceForbiddenError) as info:  # lexically inside, escaping through '..'
        ws.parse(str(root) + "/../outside/secret.txt")
    assert info.value.recovery_path is None


def test_recovery_path_through_a_symlinked_declared_root(tree, tmp_path: Path) -> None:
    root, _ = tree
    alias = tmp_path / "alias"
    alias.symlink_to(root)
    ws = Workspace(alias)
    assert ws.path == str(root)
    with pytest.raises(WorkspaceForbiddenError) as info:
        ws.parse(str(alias / "README.md"))
    assert info.value.recovery_path == "README.md"
    with ws.open_file(ws.parse("README.md")) as opened:
        assert opened.read(0, 100) == b"# readme\n"


def test_open_file_reads_regular_files(tree) -> None:
    ws = Workspace(tree[0])
    with ws.open_file(("src", "a.py")) as opened:
        assert opened.size == len("print('a')\n")
        assert opened.read(0, 5) == b"print"
        assert opened.read(6, 1000) == b"'a')\n"
    assert ws.read_file(("README.md",), 100) == b"# readme\n"
    with pytest.raises(WorkspacePathError):
        ws.read_file(("README.md",), 3)


def test_missing_directory_and_non_directory_segments(tree) -> None:
    ws = Workspace(tree[0])
    with pytest.raises(WorkspaceNotFoundError) as info:
        ws.open_file(("src", "missing.py"))
    assert info.value.path == "src/missing.py"
    with pytest.raises(WorkspaceNotFoundError):
        ws.open_file(("nope", "a.py"))
    with pytest.raises(WorkspaceNotDirectoryError):
        ws.open_file(("README.md", "a.py"))
    with pytest.raises(WorkspaceNotRegularFileError):
        ws.open_file(("src",))


def test_symlinks_refuse_at_every_segment(tree) -> None:
    root, outside = tree
    (root / "link-dir").symlink_to(outside)
    (root / "link-file").symlink_to(outside / "secret.txt")
    (root / "src" / "inner-link").symlink_to(root / "README.md")  # even pointing inside
    ws = Workspace(root)
    for segments in (("link-dir", "secret.txt"), ("link-file",), ("src", "inner-link")):
        with pytest.raises(WorkspaceSymlinkError) as info:
            ws.open_file(segments)
        assert info.value.code == "FORBIDDEN"
    with pytest.raises(WorkspaceSymlinkError):
        ws.open_directory(("link-dir",))
    with pytest.raises(WorkspaceSymlinkError):
        ws.plan_missing_directories(("link-dir", "new", "f.txt"))


async def test_a_writerless_fifo_refuses_at_once(tree) -> None:
    root, _ = tree
    os.mkfifo(root / "pipe")
    ws = Workspace(root)

    async def attempt() -> None:
        with pytest.raises(WorkspaceNotRegularFileError):
            ws.open_file(("pipe",))

    await asyncio.wait_for(attempt(), timeout=5)


def test_root_replaced_after_declaration_is_unavailable(tree, tmp_path: Path) -> None:
    root, _ = tree
    ws = Workspace(root)
    root.rename(tmp_path / "moved")
    root.mkdir()
    with pytest.raises(WorkspaceUnavailableError) as info:
        ws.open_root()
    assert info.value.code is None


def test_identities_revalidate_after_a_swap(tree) -> None:
    root, outside = tree
    ws = Workspace(root)
    with ws.open_file(("src", "a.py")) as opened:
        assert ws.file_identity(("src", "a.py")) == opened.identity
        (root / "src" / "a.py").unlink()
        (root / "src" / "a.py").write_text("another file")
        assert ws.file_identity(("src", "a.py")) != opened.identity
    pinned = ws.directory_identity(("src",))
    (root / "src").rename(root / "old-src")
    (root / "src").symlink_to(outside)
    assert ws.directory_identity(("src",)) is None
    assert ws.file_identity(("src", "secret.txt")) is None
    assert pinned == ws.directory_identity(("old-src",))


def test_write_plan_names_missing_directories_and_creates_only_those(tree) -> None:
    root, _ = tree
    ws = Workspace(root)
    segments = ws.parse("src/new/deeper/f.txt")
    plan = ws.plan_missing_directories(segments)
    assert plan == ["src/new", "src/new/deeper"]
    assert not (root / "src" / "new").exists()
    fd, created = ws.open_parent(segments, create=plan)
    try:
        write_file_at(fd, "f.txt", b"hello", replace=False, relative="src/new/deeper/f.txt")
    finally:
        os.close(fd)
    assert created == plan
    assert (root / "src/new/deeper/f.txt").read_bytes() == b"hello"
    assert ws.plan_missing_directories(ws.parse("README.md")) == []
    with pytest.raises(WorkspaceNotDirectoryError):
        ws.plan_missing_directories(ws.parse("README.md/x/y"))


def test_an_ancestor_gone_after_the_plan_refuses_without_expanding_it(tree) -> None:
    root, _ = tree
    ws = Workspace(root)
    (root / "gone").mkdir()
    segments = ws.parse("gone/sub/f.txt")
    plan = ws.plan_missing_directories(segments)
    assert plan == ["gone/sub"]
    (root / "gone").rmdir()
    with pytest.raises(WorkspaceChangedError) as info:
        ws.open_parent(segments, create=plan)
    assert info.value.code == "CONFLICT"
    assert not (root / "gone").exists()


def test_write_file_at_refuses_existing_symlink_and_keeps_mode(tree) -> None:
    root, outside = tree
    ws = Workspace(root)
    (root / "link").symlink_to(outside / "secret.txt")
    (root / "script.sh").write_text("#!/bin/sh\n")
    os.chmod(root / "script.sh", 0o750)
    fd = ws.open_directory(())
    try:
        with pytest.raises(WorkspaceExistsError):
            write_file_at(fd, "README.md", b"x", replace=False, relative="README.md")
        with pytest.raises(WorkspaceSymlinkError):
            write_file_at(fd, "link", b"x", replace=True, relative="link")
        with pytest.raises(WorkspaceNotRegularFileError):
            write_file_at(fd, "src", b"x", replace=True, relative="src")
        write_file_at(fd, "script.sh", b"#!/bin/sh\necho hi\n", replace=True, relative="script.sh")
    finally:
        os.close(fd)
    assert (outside / "secret.txt").read_text() == "outside secret"
    assert (root / "script.sh").stat().st_mode & 0o777 == 0o750
    assert sorted(p.name for p in root.iterdir()) == ["README.md", "link", "script.sh", "src"]  # no temporaries


def test_overwriting_a_hard_link_never_writes_into_the_shared_inode(tree) -> None:
    root, outside = tree
    os.link(outside / "secret.txt", root / "hard.txt")
    ws = Workspace(root)
    fd = ws.open_directory(())
    try:
        write_file_at(fd, "hard.txt", b"replaced", replace=True, relative="hard.txt")
    finally:
        os.close(fd)
    assert (outside / "secret.txt").read_text() == "outside secret"
    assert (root / "hard.txt").read_text() == "replaced"


async def _collect(ws: Workspace, base=(), **kwargs) -> tuple[list[str], WalkStats]:
    stats = WalkStats()
    limits = kwargs.pop("limits", WalkLimits())
    async with contextlib.aclosing(ws.walk(base, limits=limits, stats=stats, **kwargs)) as walk:
        paths = [entry.path async for entry in walk]
    return paths, stats


async def test_walk_yields_files_in_lexical_order_and_skips_symlinks(tree) -> None:
    root, outside = tree
    (root / "escape").symlink_to(outside)
    (root / "src" / "sub").mkdir()
    (root / "src" / "sub" / "c.py").write_text("c")
    os.mkfifo(root / "src" / "fifo")
    ws = Workspace(root)
    paths, stats = await _collect(ws)
    assert paths == ["README.md", "src/a.py", "src/b.txt", "src/sub/c.py"]
    assert stats.skipped_symlinks == 1
    assert stats.reasons == []
    assert stats.directories == 3
    scoped, _ = await _collect(ws, ("src",))
    assert scoped == ["src/a.py", "src/b.txt", "src/sub/c.py"]


async def test_walk_excludes_prunes_and_records_denials(tree) -> None:
    root, _ = tree
    (root / "node_modules").mkdir()
    (root / "node_modules" / "x.js").write_text("x")
    (root / "credentials").mkdir()
    (root / "credentials" / "key").write_text("k")
    (root / "credentials-backup").write_text("b")
    asked: list[tuple[str, str]] = []

    async def admit(path: str, kind: str) -> bool:
        asked.append((path, kind))
        return path != "credentials"

    ws = Workspace(root)
    paths, stats = await _collect(
        ws, exclude=lambda rel, name: name == "node_modules", admit=admit, include=lambda rel: not rel.endswith(".txt")
    )
    assert paths == ["README.md", "credentials-backup", "src/a.py"]
    assert stats.excluded_directories == 1
    assert stats.denied == [{"path": "credentials", "kind": "directory"}]
    assert "denied" in stats.reasons
    assert ("credentials/key", "file") not in asked and ("node_modules", "directory") not in asked
    assert ("src/b.txt", "file") not in asked  # include filters before the host is asked
    pruned, stats = await _collect(ws, prune=lambda rel: rel == "src")
    assert pruned == ["README.md", "credentials-backup", "src/a.py", "src/b.txt"]
    assert stats.pruned_directories == 2


@pytest.mark.parametrize(
    ("limits", "reason"),
    [
        (WalkLimits(max_files=2), "max-search-files"),
        (WalkLimits(max_depth=1), "max-search-depth"),
        (WalkLimits(max_directories=2), "max-search-directories"),
        (WalkLimits(max_entries=3), "max-search-entries"),
        (WalkLimits(deadline=0.0), "timeout"),
    ],
)
async def test_walk_limits_stop_with_a_reason(tmp_path: Path, limits: WalkLimits, reason: str) -> None:
    for d in ("a", "b", "c/d/e"):
        (tmp_path / d).mkdir(parents=True)
        for n in range(3):
            (tmp_path / d / f"f{n}").write_text("x")
    paths, stats = await _collect(Workspace(tmp_path), limits=limits)
    assert reason in stats.reasons
    assert len(paths) < 12
    assert stats.files == len(paths)


async def test_walk_closes_every_descriptor_when_abandoned(tree) -> None:
    root, _ = tree
    for n in range(5):
        (root / f"d{n}").mkdir()
        (root / f"d{n}" / "f").write_text("x")
    ws = Workspace(root)
    before = len(os.listdir("/proc/self/fd"))
    stats = WalkStats()
    async with contextlib.aclosing(ws.walk((), limits=WalkLimits(), stats=stats)) as walk:
        async for entry in walk:
            if entry.path.startswith("d2"):
                break
    assert len(os.listdir("/proc/self/fd")) == before
