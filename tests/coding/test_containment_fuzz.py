"""Containment fuzzer: hypothesis builds trees of files, directories, symlinks (to outside and inside), hard
links and FIFOs, spells paths adversarially, and races the tree while the host decides: a directory swapped
for a symlink to outside while ``authorize`` is deciding, or — during a walk or a segment-wise check — the
entry the async ``authorize_path`` policy is being asked about, or its parent directory, swapped for a symlink
to outside while that policy is pending. Whatever happens, nothing outside the root is ever read, written,
listed or created: the outside zone's snapshot never changes, no result carries an outside secret or an
outside-only name, and every path a result names was reached inside the root without a symlink (a path under
the directory swapped during that call is checked where the directory was moved to, inside the root).

Hard links: a hard link inside the root *is* a name inside the root for that inode, so reading through it is
allowed (those inodes carry a different marker); writing through it must never change the shared inode.

CI runs a slice of ``THREADLINE_CODING_FUZZ_CASES`` cases (default 2,000, well under a minute); set it to
10000 for the full run. The case, call, swap and escape counts are printed (``-s``) and escapes must be 0.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import stat
import tempfile
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, given, settings, strategies as st

from threadline.coding import create_agent_coding_tools
from threadline.tools import AgentToolContext, error_envelope

CASES = int(os.environ.get("THREADLINE_CODING_FUZZ_CASES", "2000"))
SECRET = "OUTSIDE-SECRET"
OUTSIDE_ONLY = {"secret.txt", "linked.txt", "outside-zone"}  # names that exist only outside the root
LINKED = "HARDLINKED-CONTENT"
NAMES = ["a", "b", "A", "dir", "x.txt", "link", "sub"]

STATS = {"cases": 0, "calls": 0, "escapes": 0, "refusals": 0, "authorize_swaps": 0, "path_swaps": 0}


def snapshot(path: Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for current, dirs, files in os.walk(path):
        for name in sorted(dirs + files):
            full = Path(current) / name
            st_ = full.lstat()
            content = full.read_bytes() if stat.S_ISREG(st_.st_mode) else None
            out[str(full.relative_to(path))] = (stat.S_IFMT(st_.st_mode), stat.S_IMODE(st_.st_mode), content)
    return out


segment = st.sampled_from([*NAMES, "..", ".", "", "a\\b", "a\x00", "CAPS"])
spelling = st.one_of(
    st.lists(st.sampled_from(NAMES), min_size=1, max_size=3).map("/".join),
    st.just("."),
    st.lists(segment, min_size=1, max_size=4).map("/".join),
    st.sampled_from(["/", "//", "/etc/passwd", "OUTSIDE_ABS", "ROOT_ABS", "ROOT_ABS_DOTDOT"]),
)
node = st.tuples(
    st.sampled_from(
        ["dir", "file", "symlink-out", "symlink-outdir", "symlink-in", "symlink-dotdot", "hardlink", "fifo"]
    ),
    st.lists(st.sampled_from(NAMES), min_size=1, max_size=3),
)
call = st.tuples(
    st.sampled_from(["read_file", "write_file", "edit_file", "list_directory", "glob", "search_files"]),
    spelling,
    st.booleans(),
)


def build(root: Path, outside: Path, nodes: list[tuple[str, list[str]]]) -> None:
    for kind, parts in nodes:
        target = root.joinpath(*parts)
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            if target.exists() or target.is_symlink():
                continue
            if kind == "dir":
                target.mkdir()
            elif kind == "file":
                target.write_text(f"inside {'/'.join(parts)}\nneedle\n")
            elif kind == "symlink-out":
                target.symlink_to(outside / "secret.txt")
            elif kind == "symlink-outdir":
                target.symlink_to(outside)
            elif kind == "symlink-in":
                target.symlink_to(root)
            elif kind == "symlink-dotdot":
                target.symlink_to(os.path.relpath(outside, target.parent))
            elif kind == "hardlink":
                os.link(outside / "linked.txt", target)
            elif kind == "fifo":
                os.mkfifo(target)
        except (FileExistsError, NotADirectoryError, FileNotFoundError):
            continue


def resolve(spelling_: str, root: Path, outside: Path) -> str:
    return {
        "OUTSIDE_ABS": str(outside / "secret.txt"),
        "ROOT_ABS": str(root / "a"),
        "ROOT_ABS_DOTDOT": f"{root}/../{outside.name}/secret.txt",
    }.get(spelling_, spelling_)


def check_result(result: Any, root: Path, outside: Path, moved: tuple[str, str] | None) -> None:
    """No outside secret, no host path, no outside-only name, and every named path reached inside the root
    without a symlink. ``moved`` is ``(path, moved_to)`` of the entry swapped for a symlink during this call:
    a path under it names what the call reached before the swap, which now lives at ``moved_to``."""
    text = json.dumps(result, ensure_ascii=False)
    assert SECRET not in text, text
    assert str(outside) not in text and str(root) not in text, text
    named: list[str] = []
    if isinstance(result, dict):
        named += [e["path"] for e in result.get("matches", [])]
        named += list(result.get("paths", []))
        if "path" in result and "error" not in result:
            named.append(result["path"])
        base = result.get("path", ".")
        named += [e["name"] if base == "." else f"{base}/{e['name']}" for e in result.get("entries", [])]
    for path in named:
        assert not OUTSIDE_ONLY & set(path.split("/")), path
        if moved is not None and (path == moved[0] or path.startswith(moved[0] + "/")):
            path = moved[1] + path[len(moved[0]) :]
        current = root
        for part in path.split("/") if path != "." else []:
            assert part not in ("", ".", ".."), path
            current = current / part
            if current.is_symlink():
                # only list_directory may *name* a symlink (as kind symlink); nothing goes through it
                assert current == root / path, path
        assert os.path.lexists(root / path), path
        real = os.path.realpath(root / path)
        if not (root / path).is_symlink():
            assert real == str(root) or real.startswith(str(root) + os.sep), path


class Zone:
    """One root and one outside zone for the whole run: each case empties the root, rebuilds the tree and the
    outside zone, and reuses two tool sets (without and with the async path policy) whose callbacks read the
    case's race settings."""

    def __init__(self) -> None:
        # on tmpfs where there is one: the writes' fsync is then free, and the fuzzer measures logic, not disks
        shm = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
        self.base = Path(tempfile.mkdtemp(prefix="tl-fuzz-", dir=shm))
        self.root, self.outside = self.base / "root", self.base / "outside-zone"
        self.root.mkdir()
        self.race: str = "none"
        self.trigger = 0
        self.target = "asked"
        self.questions = 0
        self.swapped = False
        self.moved: tuple[str, str] | None = None
        self.plain = {t.name: t for t in create_agent_coding_tools(root=self.root, authorize=self.authorize)}
        self.policed = {
            t.name: t
            for t in create_agent_coding_tools(
                root=self.root, authorize=self.authorize, authorize_path=self.authorize_path
            )
        }

    def swap(self, relative: str, kind: str) -> None:
        """Replace the entry at ``relative`` by a symlink to outside, keeping it inside its parent."""
        victim = self.root / relative
        moved = victim.with_name(f".moved-{victim.name}")
        victim.rename(moved)
        victim.symlink_to(self.outside if kind == "dir" else self.outside / "secret.txt")
        self.swapped = True
        self.moved = (relative, str(moved.relative_to(self.root)))

    def reached_inside(self, relative: str) -> bool:
        """Whether ``relative`` names a directory or regular file reached without a symlink (the fuzzer itself
        must never rename something outside through a symlink the tree holds)."""
        current = self.root
        for part in relative.split("/"):
            current = current / part
            if current.is_symlink() or not current.exists():
                return False
        return current.is_dir() or current.is_file()

    def authorize(self, payload: dict[str, Any]) -> bool:
        # the race: while the host decides, swap a directory the call may be using for a symlink outside
        if self.race == "authorize" and not self.swapped:
            for name in ("a", "dir", "sub"):
                victim = self.root / name
                if victim.is_dir() and not victim.is_symlink():
                    self.swap(name, "dir")
                    STATS["authorize_swaps"] += 1
                    break
        return True

    async def authorize_path(self, payload: dict[str, Any]) -> bool:
        # the race: the policy is pending (it yields to the loop) while the entry it is asked about, or that
        # entry's parent, is swapped for a symlink to outside
        self.questions += 1
        if self.race == "path" and not self.swapped and self.questions > self.trigger:
            candidate = payload["path"]
            if self.target == "parent":
                candidate = candidate.rpartition("/")[0] or "."
            if candidate != "." and self.reached_inside(candidate):
                victim = self.root / candidate
                self.swap(candidate, "dir" if victim.is_dir() else "file")
                STATS["path_swaps"] += 1
        await asyncio.sleep(0)
        return True

    def reset(self, race: str, trigger: int, target: str) -> None:
        for child in list(self.root.iterdir()):
            if child.is_dir() and not child.is_symlink():
                shutil.rmtree(child)
            else:
                child.unlink()
        shutil.rmtree(self.outside, ignore_errors=True)
        self.outside.mkdir()
        (self.outside / "secret.txt").write_text(f"{SECRET}\nneedle\n")
        (self.outside / "linked.txt").write_text(f"{LINKED}\nneedle\n")
        (self.outside / "a").mkdir()
        (self.outside / "a" / "x.txt").write_text(f"{SECRET} nested\nneedle\n")
        self.race, self.trigger, self.target = race, trigger, target
        self.questions, self.swapped = 0, False


ZONE: Zone | None = None


async def run_case(nodes, calls, race: str, trigger: int, target: str) -> None:
    global ZONE
    if ZONE is None:
        ZONE = Zone()
    zone = ZONE
    zone.reset(race, trigger, target)
    root, outside = zone.root, zone.outside
    tools = zone.policed if race == "path" else zone.plain
    try:
        build(root, outside, nodes)
        before = snapshot(outside)
        for name, raw, flag in calls:
            path = resolve(raw, root, outside)
            arguments: dict[str, Any] = {
                "read_file": {"path": path},
                "write_file": {"path": path, "content": "written\n", "overwrite": flag},
                "edit_file": {"path": path, "old_text": "needle", "new_text": "pin", "replace_all": flag},
                "list_directory": {"path": path},
                "glob": {"pattern": "**/*" if flag else "*", "path": path},
                "search_files": {"query": "needle|SECRET" if flag else "needle", "regex": flag},
            }[name]
            tool = tools[name]
            ctx = AgentToolContext(conversation_id="c", run_id="r", call_id="k", tool_name=name, context=None)
            STATS["calls"] += 1
            swapped_before = zone.swapped
            try:
                result = await asyncio.wait_for(tool.call(ctx, tool.validate(arguments)), timeout=10)
            except Exception as error:  # refusals and scrubbed causes: the envelope must not leak either
                STATS["refusals"] += 1
                result = error_envelope(error)
            moved = zone.moved if zone.swapped and not swapped_before else None
            check_result(result, root, outside, moved)
            assert snapshot(outside) == before, f"{name} {arguments} changed the outside zone"
        assert (outside / "linked.txt").read_text() == f"{LINKED}\nneedle\n"
    except AssertionError:
        STATS["escapes"] += 1
        raise
    STATS["cases"] += 1


@settings(
    max_examples=CASES,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    database=None,
)
@given(
    nodes=st.lists(node, min_size=0, max_size=6),
    calls=st.lists(call, min_size=1, max_size=3),
    race=st.sampled_from(["none", "authorize", "path"]),
    trigger=st.integers(0, 3),
    target=st.sampled_from(["asked", "parent"]),
)
def test_nothing_outside_the_root_is_ever_read_written_listed_or_created(nodes, calls, race, trigger, target) -> None:
    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(run_case(nodes, calls, race, trigger, target))
    finally:
        loop.close()


def test_the_fuzzer_ran_its_cases_without_an_escape() -> None:
    # runs after the fuzzer in file order; alone (-k) it has nothing to check
    if ZONE is not None:
        shutil.rmtree(ZONE.base, ignore_errors=True)
    if STATS["cases"] == 0:
        return
    print(f"containment fuzzer: {STATS}")
    assert STATS["escapes"] == 0
    assert STATS["cases"] >= CASES, STATS
    assert STATS["authorize_swaps"] > 0 and STATS["path_swaps"] > 0, STATS  # both races really happened
