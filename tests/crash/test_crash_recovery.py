"""Crash recovery with real processes: a child running real turns on a SQLite file SIGKILLs itself at a named
point (``_child.py``); the parent reopens the file with a fresh runtime, recovers, retries every submitted
key, and checks from the database that no admitted input was lost or answered twice.

Each point's child runs once; the parent then recovers two copies of the crashed files, one with
``requeue`` (replay-safe) and one with ``abandon`` (stale owner) as the policy for runs the dead child had
acquired. ``SECOND_CRASHES`` add a second process that recovers a crash and is killed itself while doing
so. Importing threadline takes about 2 s here, so kill-point children are forked by two fork servers
(``_child.py --serve``: real processes with their own loop, SQLite connection and threads) rather than
each being a fresh interpreter; the uninterrupted reference run is a fresh interpreter.

Checked after recovery and the retries, from the store: nothing is left to recover; every submitted key
is stored exactly once and belongs to exactly one terminal run (``success``, or ``abandoned`` only for a
run the dead process held under the abandon policy); a key the journal says was admitted keeps its run;
each run has one settled assistant that answers exactly its own inputs; each conversation is in causal
order; a tool effect happens at most once per call unless a requeue replayed the run (then it is noted).
"""

from __future__ import annotations

import asyncio
import itertools
import re
import shutil
import signal
import subprocess
import sys
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from threadline import AgentRuntimeStore, ConversationSnapshot, Run, create_sqlite_agent_runtime_store

from ._scenario import CONTEXT, CONVERSATIONS, INPUTS, POLICIES, Hooks, build_runtime, keys_in, submit

pytestmark = pytest.mark.subprocess

CHILD = Path(__file__).with_name("_child.py")
CHILD_TIMEOUT = 60.0
STEP_TIMEOUT = 10.0
ANSWER = re.compile(r"^(answer to (k\d+ ?)+: ok\.|tool said: noted (k\d+ ?)+ done\.)$")


@dataclass(frozen=True)
class Point:
    """A kill point in ``_child.py``'s syntax (store points name the call by what it is about) and why it
    matters."""

    name: str
    why: str


POINTS = [
    # admission of the first input
    Point("before:accept:c1:key=k0", "before the first admission commit"),
    Point("mid:accept:c1:key=k0", "first admission written, COMMIT not reached"),
    Point(
        "after:accept:c1:key=k0",
        "first admission committed, the caller never heard; nothing else ran in c1, so the same commit acquired "
        "the run with the empty draft and the request's admission: no call yet",
    ),
    # the first output of k0's run
    Point("after:checkpoint:c1:run=k0;parts=text;op=first-output", "first output recorded with the first batch"),
    # mid-stream, with the queued and coalesced successor admitted meanwhile
    Point("stream:c1:1:1", "mid-stream after 1 delta"),
    Point("after:checkpoint:c1:run=k0;parts=text;op=none", "periodic checkpoint mid-stream"),
    Point("before:accept:c1:key=k1", "second input submitted while k0 streams, not committed"),
    Point("after:accept:c1:key=k1", "second input queued while k0 streams"),
    Point("mid:accept:c1:key=k3", "coalescing admission written, COMMIT not reached"),
    Point("after:accept:c1:key=k3", "third input coalesced into the queued successor"),
    Point("stream:c1:1:3", "mid-stream after 3 deltas, coalesced successor queued"),
    # the first terminal
    Point("before:terminal:c1:run=k0", "before the first terminal commit (it also records the step's finish)"),
    Point("mid:terminal:c1:run=k0", "first terminal written, COMMIT not reached"),
    Point("after:terminal:c1:run=k0", "after the first terminal, successor not acquired"),
    # the coalesced successor: a tool call, the tool, then an answer
    Point("before:acquire:c1:run=k1+k3", "the queued successor, before its acquisition"),
    Point("after:acquire:c1:run=k1+k3", "coalesced successor acquired"),
    Point("stream:c1:2:1", "tool call streamed, before its structural checkpoint"),
    Point("mid:checkpoint:c1:run=k1+k3;parts=tool-call;op=completed", "step-finish checkpoint written, no COMMIT"),
    Point("after:checkpoint:c1:run=k1+k3;parts=tool-call;op=completed", "between the checkpoint and the tool"),
    Point("tool:before-effect:c1:1", "tool started, before its effect"),
    Point("tool:after-effect:c1:1", "tool effect applied, result not checkpointed"),
    Point(
        "after:checkpoint:c1:run=k1+k3;parts=tool-call,tool-result",
        "tool result checkpointed (with the next request), provider not called",
    ),
    Point("stream:c1:3:3", "mid-stream of the answer after the tool"),
    Point("before:terminal:c1:run=k1+k3", "before a later run's terminal commit"),
    Point("after:terminal:c1:run=k1+k3", "after a later run's terminal commit"),
    # the other conversation, running concurrently
    Point("tool:after-effect:c2:1", "c2's tool effect applied while c1 streams"),
    Point("after:terminal:c2:run=k2", "c2 answered, c1 still working"),
]


@dataclass(frozen=True)
class SecondCrash:
    """The scenario child died at ``first``; a second child recovering that file with ``policy`` (then
    retrying every journaled key) dies at ``point`` (matched in its own process)."""

    first: str
    policy: str
    point: Point

    @property
    def name(self) -> str:
        return f"{self.first} > {self.policy} > {self.point.name}"


SECOND_CRASHES = [
    SecondCrash("stream:c1:1:3", "requeue", Point("after:recover:c1:run=k0;action=requeue", "requeued, not rerun")),
    SecondCrash("stream:c1:1:3", "requeue", Point("after:acquire:c1:run=k0", "requeued run re-acquired")),
    SecondCrash("after:terminal:c1:run=k0", "requeue", Point("before:terminal:c1:run=k1+k3", "resumed run's terminal")),
    SecondCrash("tool:after-effect:c1:1", "requeue", Point("tool:after-effect:c1:1", "the replay's effect applied")),
    SecondCrash("after:acquire:c1:run=k1+k3", "abandon", Point("mid:recover:c1:run=k1+k3", "abandon not committed")),
    SecondCrash("before:accept:c1:key=k1", "requeue", Point("after:accept:c1:key=k1", "the retry's admission")),
]


@dataclass(frozen=True)
class ChildRun:
    name: str
    point: str
    workdir: Path
    returncode: int | str
    stdout: str
    stderr: str

    @property
    def trace(self) -> list[str]:
        path = self.workdir / "trace.log"
        return path.read_text().splitlines() if path.exists() else []

    def describe(self) -> str:
        tail = "\n".join(self.trace[-6:])
        return (
            f"child {self.name!r}: exit {self.returncode}\nstdout: {self.stdout.strip()}\n"
            f"stderr: {self.stderr.strip()[-2000:]}\ntrace tail:\n{tail}"
        )


def _workdir(root: Path, name: str) -> Path:
    return root / re.sub(r"[^A-Za-z0-9]+", "_", name)


def run_fresh_child(root: Path, point: str) -> ChildRun:
    """The child as a fresh interpreter: ``python _child.py <workdir> <point>``."""
    workdir = _workdir(root, point)
    workdir.mkdir()
    proc = subprocess.run(
        [sys.executable, str(CHILD), str(workdir), point],
        capture_output=True,
        text=True,
        timeout=CHILD_TIMEOUT,
        cwd=str(CHILD.parent),
    )
    return ChildRun(point, point, workdir, proc.returncode, proc.stdout, proc.stderr)


class ForkServer:
    """``python _child.py --serve``: imports once (about 2 s here), then forks one child process per run.
    Each child opens the SQLite file itself and dies by its own SIGKILL; the server reports its exit code."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(CHILD), "--serve"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=str(CHILD.parent),
        )

    def run(self, name: str, workdir: Path, point: str, policy: str = "") -> ChildRun:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(f"{workdir} {point} {policy}\n")
        self.proc.stdin.flush()
        answer = self.proc.stdout.readline().split()
        if not answer or answer[1:] != [point]:
            raise RuntimeError(f"the fork server answered {answer!r} for {name!r} (exit {self.proc.poll()})")
        code: int | str = int(answer[0]) if answer[0].lstrip("-").isdigit() else answer[0]
        out, err = (workdir / "stdout.log", workdir / "stderr.log")
        return ChildRun(
            name, point, workdir, code, out.read_text() if out.exists() else "", err.read_text() if err.exists() else ""
        )

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=CHILD_TIMEOUT)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()


@pytest.fixture(scope="module")
def children(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Callable[[str], ChildRun]]:
    """Runs every selected child once, starting all of them at first use: ``none`` as a fresh interpreter,
    the kill points (then the second crashes, which start from a copy of their first crash) through two
    fork servers, one per core."""
    root = tmp_path_factory.mktemp("crash")
    seconds = {c.name: c for c in SECOND_CRASHES}
    wanted: list[str] = []
    for item in request.session.items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        for job in (params.get("point"), params.get("crash")):
            if isinstance(job, SecondCrash) and job.first not in wanted:
                wanted.append(job.first)
            if isinstance(job, Point | SecondCrash) and job.name not in wanted:
                wanted.append(job.name)
    wanted.sort(key=lambda name: name in seconds)  # first crashes before the second ones that need them
    futures: dict[str, Future[ChildRun]] = {name: Future() for name in ["none", *wanted]}
    pending = list(wanted)
    lock = threading.Lock()

    def job(server: ForkServer, name: str) -> ChildRun:
        second = seconds.get(name)
        if second is None:
            workdir = _workdir(root, name)
            workdir.mkdir()
            return server.run(name, workdir, name)
        first = futures[second.first].result(timeout=CHILD_TIMEOUT * 3)
        if first.returncode != -signal.SIGKILL:
            raise RuntimeError(f"the first crash did not happen:\n{first.describe()}")
        workdir = _workdir(root, name)
        shutil.copytree(first.workdir, workdir)
        return server.run(name, workdir, second.point.name, second.policy)

    def serve() -> None:
        server = ForkServer()
        try:
            while True:
                with lock:
                    if not pending:
                        return
                    name = pending.pop(0)
                try:
                    futures[name].set_result(job(server, name))
                except BaseException as error:
                    futures[name].set_exception(error)
        finally:
            server.close()

    def fresh() -> None:
        try:
            futures["none"].set_result(run_fresh_child(root, "none"))
        except BaseException as error:
            futures["none"].set_exception(error)

    threads = [threading.Thread(target=fresh, daemon=True)]
    threads += [threading.Thread(target=serve, daemon=True) for _ in range(2)]
    for thread in threads:
        thread.start()
    try:
        yield lambda name: futures[name].result(timeout=CHILD_TIMEOUT * 3)
    finally:
        with lock:
            pending.clear()
        for thread in threads:
            thread.join(timeout=CHILD_TIMEOUT)


# -------------------------------------------------------------------------------------- journal, state


@dataclass
class Journal:
    submitted: list[str]
    admitted: dict[str, str]

    @classmethod
    def read(cls, path: Path) -> Journal:
        submitted: list[str] = []
        admitted: dict[str, str] = {}
        for line in path.read_text().splitlines() if path.exists() else []:
            kind, key, *rest = line.split()
            if kind == "submitted" and key not in submitted:
                submitted.append(key)
            elif kind == "admitted":
                assert admitted.setdefault(key, rest[0]) == rest[0], f"{key} was admitted to two runs"
        return cls(submitted, admitted)


def text_of(message: Any) -> str:
    return "".join(p.text for p in message.parts if p.type == "text")


def input_keys(run: Run, snapshot: ConversationSnapshot) -> list[str]:
    by_id = {m.id: m for m in snapshot.messages}
    return [k for mid in run.input_message_ids if mid in by_id for k in keys_in(text_of(by_id[mid]))]


async def snapshots(store: AgentRuntimeStore) -> dict[str, ConversationSnapshot]:
    return {cid: await store.load_snapshot(conversation_id=cid) for cid in CONVERSATIONS}


async def scan_all(store: AgentRuntimeStore) -> list[Run]:
    runs: list[Run] = []
    cursor = None
    while True:
        page = await store.scan_recoverable(cursor=cursor, limit=2)
        runs.extend(page.runs)
        if page.next_cursor is None:
            return runs
        cursor = page.next_cursor


def store_point(name: str) -> tuple[str, str, str, dict[str, str]] | None:
    """``after:checkpoint:c1:run=k0;op=started`` → ``('after', 'checkpoint', 'c1', {'run': 'k0', ...})``."""
    when, _, rest = name.partition(":")
    if when not in ("before", "mid", "after"):
        return None
    op, cid, spec = rest.split(":", 2)
    fields = dict(f.split("=", 1) for f in spec.partition("#")[0].split(";") if f)
    return when, op, cid, fields


def reaches(trace: list[str], name: str) -> bool:
    """Whether a trace (of a run without a kill) passes the point ``name``."""
    parsed = store_point(name)
    if parsed is None:
        return any(line.split(" ", 1)[0] == name for line in trace)
    _, op, cid, fields = parsed
    for line in trace:
        where, _, detail = line.partition(" ")
        if where.rsplit(":", 1)[0] == f"{op}:{cid}" and set(detail.split(";")) >= {
            f"{k}={v}" for k, v in fields.items()
        }:
            return True
    return False


def check_kill(run: ChildRun, point: Point) -> None:
    """The child died by SIGKILL exactly at ``point``."""
    assert run.returncode == -signal.SIGKILL, run.describe()
    assert run.trace and run.trace[-1] == f"KILL {point.name}", run.describe()


def check_crash_state(point: Point, snaps: dict[str, ConversationSnapshot]) -> None:
    """What the point itself implies about the database the child left: a ``before:`` or ``mid:``
    transaction never shows, an ``after:`` one always does."""
    parsed = store_point(point.name)
    if parsed is None:
        return
    when, op, cid, fields = parsed
    snap = snaps[cid]
    if op == "accept":
        key = fields["key"]
        stored = [m for m in snap.messages if m.role == "user" and key in keys_in(text_of(m))]
        assert len(stored) == (1 if when == "after" else 0), f"{point.name}: input {key} stored {len(stored)}x"
    if op == "terminal":
        keys = fields["run"].split("+")
        [run] = [r for r in snap.runs if input_keys(r, snap) == keys]
        assert run.terminal == (when == "after"), f"{point.name}: run {keys} is {run.state}"


# ---------------------------------------------------------------------------------------------- tests


def test_the_child_reaches_every_point_and_finishes(children: Callable[[str], ChildRun]) -> None:
    """Without a kill (and as a fresh interpreter) the scenario answers everything and passes every point."""
    run = children("none")
    assert run.returncode == 0 and run.stdout.strip() == "DONE", run.describe()
    assert len(POINTS) >= 20 and len({p.name for p in POINTS}) == len(POINTS)
    for point in POINTS:
        assert reaches(run.trace, point.name), f"{point.name} is never reached"
    effects = (run.workdir / "effects.log").read_text().splitlines()
    assert sorted(line.split()[2] for line in effects) == ["call-k1-k3", "call-k2"]


@pytest.mark.parametrize("policy", list(POLICIES))
@pytest.mark.parametrize("point", POINTS, ids=lambda p: p.name)
async def test_sigkill_then_recover(
    point: Point, policy: str, children: Callable[[str], ChildRun], tmp_path: Path, crash_notes: list[str]
) -> None:
    run = children(point.name)
    check_kill(run, point)
    await recover_and_check(run, point, policy, tmp_path, crash_notes)


@pytest.mark.parametrize("policy", list(POLICIES))
@pytest.mark.parametrize("crash", SECOND_CRASHES, ids=lambda c: c.name)
async def test_sigkill_during_recovery_then_recover(
    crash: SecondCrash, policy: str, children: Callable[[str], ChildRun], tmp_path: Path, crash_notes: list[str]
) -> None:
    """A second process recovering the first crash dies too; a third (the parent) still finds every
    admitted input answered exactly once or recoverable."""
    run = children(crash.name)
    check_kill(run, crash.point)
    await recover_and_check(run, None, policy, tmp_path, crash_notes, replayed=crash.policy == "requeue")


async def recover_and_check(
    run: ChildRun, point: Point | None, policy: str, tmp_path: Path, notes: list[str], *, replayed: bool = False
) -> None:
    """Reopen a copy of the crashed files with a fresh runtime (owner ``parent``), recover with ``policy``
    for runs the dead process had acquired, retry every key the journal says was submitted (twice), and
    check the database. ``point`` (first crashes only) adds what the point implies about the crash state;
    ``replayed`` says an earlier recovery already requeued (replayed) runs."""
    work = tmp_path / "work"
    shutil.copytree(run.workdir, work)  # each policy recovers its own copy of the same crash
    journal = Journal.read(work / "journal.log")
    effects_path = work / "effects.log"

    handle = create_sqlite_agent_runtime_store(work / "threadline.db")
    store = handle.store
    try:
        # ---- the state the dead process left
        crashed = await snapshots(store)
        if point is not None:
            check_crash_state(point, crashed)
        committed = {k for s in crashed.values() for m in s.messages if m.role == "user" for k in keys_in(text_of(m))}
        for key, run_id in journal.admitted.items():
            assert key in committed, f"{key} was reported admitted ({run_id}) but is not in the database"
        assert committed <= set(journal.submitted), f"inputs nobody submitted: {committed - set(journal.submitted)}"
        already_abandoned = {r.id for s in crashed.values() for r in s.runs if r.terminal_reason == "abandoned"}
        active = await scan_all(store)
        orphans = {r.id for r in active if r.acquired}

        # ---- a fresh runtime recovers, then the client retries every key it had submitted
        runtime = build_runtime(store, Hooks(), str(effects_path), owner_id="parent")
        decision = POLICIES[policy]
        outcomes = await runtime.recover(resolve_context=lambda _run: CONTEXT, policy=lambda _run: decision)
        assert sorted(o.run_id for o in outcomes) == sorted(r.id for r in active)
        for outcome in outcomes:
            expected = ("requeued" if policy == "requeue" else "abandoned") if outcome.run_id in orphans else "resumed"
            assert outcome.outcome == expected, (outcome, outcome.error)
            if outcome.result is not None:
                result = await asyncio.wait_for(outcome.result, STEP_TIMEOUT)
                assert result.terminal_reason == "success", result

        admissions: dict[str, Any] = {}
        results: dict[str, Any] = {}
        for key in journal.submitted:
            ticket = submit(runtime, key)
            admissions[key] = await asyncio.wait_for(ticket.admission, STEP_TIMEOUT)
            results[key] = await asyncio.wait_for(ticket.result, STEP_TIMEOUT)
        for key in journal.submitted:  # a second retry changes nothing
            ticket = submit(runtime, key)
            again = await asyncio.wait_for(ticket.admission, STEP_TIMEOUT)
            first = admissions[key]
            assert (again.outcome, again.run_id, again.input.id) == ("duplicate", first.run_id, first.input.id)
        close = await runtime.close(force_timeout=STEP_TIMEOUT)
        assert close.settled, close

        # ---- nothing left to recover; every admitted input answered exactly once
        assert await scan_all(store) == []
        final = await snapshots(store)
        for cid, snap in final.items():
            assert (await store.list_active_runs(conversation_id=cid)).runs == ()
            assert all(r.terminal for r in snap.runs), [(r.id, r.state) for r in snap.runs]
        may_be_abandoned = already_abandoned | (orphans if policy == "abandon" else set())
        for key in journal.submitted:
            admission, result = admissions[key], results[key]
            assert admission.outcome == ("duplicate" if key in committed else "accepted"), (key, admission.outcome)
            if key in journal.admitted:
                assert admission.run_id == journal.admitted[key], f"{key} moved to another run"
            snap = final[INPUTS[key].conversation_id]
            stored = [m for m in snap.messages if m.role == "user" and keys_in(text_of(m)) == [key]]
            assert [m.id for m in stored] == [admission.input.id], f"{key} is stored {len(stored)}x"
            answering = [r for r in snap.runs if admission.input.id in r.input_message_ids]
            assert [r.id for r in answering] == [admission.run_id], f"{key} belongs to {len(answering)} runs"
            answer_run = answering[0]
            assert result.run.id == answer_run.id and result.terminal_reason == answer_run.terminal_reason
            if answer_run.terminal_reason == "abandoned":
                assert answer_run.id in may_be_abandoned, f"{key}: {answer_run.id} abandoned, yet not an orphan"
            else:
                assert answer_run.terminal_reason == "success", (key, answer_run.terminal_reason)
        for snap in final.values():
            assert {k for m in snap.messages if m.role == "user" for k in keys_in(text_of(m))} <= set(journal.submitted)
            check_answers(snap)
            check_causal_order(snap)

        # ---- tool effects: at most once per call unless a run was replayed (requeue)
        lines = effects_path.read_text().splitlines() if effects_path.exists() else []
        effects = Counter(tuple(line.split()[1:]) for line in lines)
        for (run_id, call_id), count in effects.items():
            if count > 1:
                assert policy == "requeue" or replayed, f"{call_id} of {run_id} applied {count}x without a replay"
                notes.append(
                    f"{run.name} [{policy}]: {call_id} of {run_id} applied {count}x "
                    "(a requeued run replays its tool calls: the documented at-least-once boundary)"
                )
        for snap in final.values():
            for r in snap.runs:
                if r.terminal_reason != "success":
                    continue
                answer = next(m for m in snap.messages if m.id == r.assistant_message_id)
                for call_id in (p.call_id for p in answer.parts if p.type == "tool-call"):
                    assert effects[(r.id, call_id)] >= 1, f"{r.id} answered from {call_id} with no effect"
    finally:
        await handle.close()


def check_answers(snap: ConversationSnapshot) -> None:
    """Each run has exactly one settled assistant; a successful one answers exactly its own inputs (no
    text or tool call left over from a crashed attempt)."""
    for run in snap.runs:
        answers = [m for m in snap.messages if m.role == "assistant" and m.run_id == run.id]
        assert [m.id for m in answers] == [run.assistant_message_id], f"run {run.id}: {len(answers)} assistants"
        answer = answers[0]
        assert answer.position is not None, f"run {run.id}'s answer is not settled"
        if run.terminal_reason == "abandoned":
            assert answer.status == "failed"
            continue
        assert answer.status == "completed", (run.id, answer.status)
        text = text_of(answer)
        assert ANSWER.match(text), f"run {run.id} answered {text!r}"
        assert set(input_keys(run, snap)) <= set(keys_in(text)), f"run {run.id} answered {text!r}"
        calls = [p.call_id for p in answer.parts if p.type == "tool-call"]
        returned = [p.call_id for p in answer.parts if p.type == "tool-result"]
        assert calls == returned and len(set(calls)) == len(calls) <= 1, f"run {run.id}: {answer.parts}"


def check_causal_order(snap: ConversationSnapshot) -> None:
    """Settled positions strictly increase, ids are unique, and each run's inputs are immediately followed
    by its own assistant before the next run's input."""
    messages = snap.messages
    ids = [m.id for m in messages]
    assert len(set(ids)) == len(ids), "duplicate message ids"
    positions = [m.position for m in messages]
    assert None not in positions, positions
    assert all(a < b for a, b in itertools.pairwise(positions)), positions  # type: ignore[operator]
    groups: list[tuple[str | None, list[str]]] = []
    for m in messages:
        if not groups or groups[-1][0] != m.run_id:
            groups.append((m.run_id, []))
        groups[-1][1].append(m.role)
    owners = [run_id for run_id, _ in groups]
    assert len(set(owners)) == len(owners), f"a run's messages are interleaved with another's: {owners}"
    for run_id, roles in groups:
        assert roles[-1] == "assistant" and set(roles[:-1]) == {"user"}, f"run {run_id}: {roles}"
