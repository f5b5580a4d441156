"""The crash child: runs the scenario of ``_scenario.py`` on a SQLite file and SIGKILLs itself at one point.

Usage: ``python _child.py <workdir> <point> [<policy>]``, or ``python _child.py --serve`` (a fork server: it
imports once, then for each ``<workdir> <point> [<policy>]`` line on stdin forks a child process that runs
with its own event loop, SQLite connection and threads, waits for it and answers ``<exit code> <point>``;
a child killed by SIGKILL answers ``-9``). With a ``<policy>`` (``requeue`` or ``abandon``) the child does
not run the scenario: it is a second process recovering the crashed ``<workdir>`` with that policy for
acquired runs, then retrying every key of the journal, and it dies at ``<point>`` too.

``<workdir>`` holds ``threadline.db`` and receives ``journal.log`` (``submitted <key>`` fsynced before each
submit, ``admitted <key> <run_id>`` after its admission resolved), ``effects.log`` (the tool's effects) and
``trace.log`` (every store mutation, model delta and tool stage reached, with what it was about, then
``KILL <point>``). With point ``none`` it runs to the end and prints ``DONE``.

Points:

- ``<when>:<op>:<conv>:<fields>[#<n>]`` — at the n-th (default first) ``<op>`` call of conversation
  ``<conv>`` whose trace detail has all of ``<fields>`` (``;``-separated ``name=value``). ``<when>`` is
  ``before`` (before it is handed to the store), ``mid`` (inside its transaction, every row written,
  before ``COMMIT``) or ``after`` (right after it returned: committed). ``<op>`` and its detail fields:
  ``accept`` (accept_input_and_assign_run: ``key``), ``acquire`` (acquire_run: ``run``), ``checkpoint``
  (checkpoint_run_assistant: ``run``, ``parts`` (part types), ``op`` (the operation phase committed with
  it, or ``none``)), ``record`` (record_run_operation: ``run``, ``phase``, ``step``), ``terminal``
  (commit_run_terminal: ``run``, ``reason``), ``recover`` (recover_run: ``run``, ``action``); ``run`` names
  a run by its inputs' keys, e.g. ``run=k1+k3``. Matching by meaning, not by call count, keeps a point
  where it is when the loop changes how many store calls a turn makes.
- ``stream:<conv>:<call>:<k>`` — after the loop consumed k deltas of the conversation's call-th model call;
- ``tool:<before-effect|after-effect>:<conv>:<n>`` — around the conversation's n-th tool effect.

The schedule is deterministic per conversation: k0 and k2 are submitted together; once k0's model call
started, k1 then k3 are submitted (k3 coalesces into k1's queued run) while k0's stream waits after its
second delta; then it goes on.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import threading
import time
import traceback
from collections import Counter
from collections.abc import Awaitable, Callable, Generator
from typing import Any

from _scenario import CONTEXT, CONVERSATIONS, INPUTS, POLICIES, Hooks, append_line, build_runtime, keys_in, submit

from threadline import AgentRuntimeStore, create_sqlite_agent_runtime_store

WHEN = ("before", "mid", "after")


class Tracer:
    """Writes the trace and decides whether this process dies here."""

    def __init__(self, workdir: str, point: str) -> None:
        self.path = os.path.join(workdir, "trace.log")
        self.point = point
        self.store_point: tuple[str, str, str, set[str], int] | None = None
        when, _, rest = point.partition(":")
        if when in WHEN:
            op, conversation_id, spec = rest.split(":", 2)
            fields, _, nth = spec.partition("#")
            self.store_point = (when, op, conversation_id, set(fields.split(";")) - {""}, int(nth or 1))
        self.matched = 0

    def reach(self, name: str, detail: str) -> None:
        """Note that ``name`` (a model or tool point) was reached; die if it is the point."""
        append_line(self.path, f"{name} {detail}", fsync=False)
        if self.point == name:
            self.die()

    def store_call(self, op: str, conversation_id: str, n: int, detail: str) -> str | None:
        """Note a store call; return ``before``/``mid``/``after`` when it is the point."""
        append_line(self.path, f"{op}:{conversation_id}:{n} {detail}", fsync=False)
        if self.store_point is None:
            return None
        when, p_op, p_conversation, fields, nth = self.store_point
        if (op, conversation_id) != (p_op, p_conversation) or not fields <= set(detail.split(";")):
            return None
        self.matched += 1
        return when if self.matched == nth else None

    def die(self) -> None:
        append_line(self.path, f"KILL {self.point}", fsync=False)
        os.kill(os.getpid(), signal.SIGKILL)


def _die_before_commit(operation: Generator[Any, Any, Any], tracer: Tracer) -> Generator[Any, Any, Any]:
    """Drive the reducer operation to its end (all its writes done in the open transaction), then die in
    the driver's thread before the driver's ``COMMIT``."""
    result = yield from operation
    tracer.die()
    return result


def _types(parts: Any) -> str:
    return ",".join(p.type if hasattr(p, "type") else p["type"] for p in parts or ())


class CrashStore(AgentRuntimeStore):
    """The store facade with kill points around its mutations."""

    def __init__(self, driver: Any, tracer: Tracer) -> None:
        super().__init__(driver)
        self.tracer = tracer
        self.counts: Counter[tuple[str, str]] = Counter()
        self.run_keys: dict[str, list[str]] = {}
        self._mid = False

    def _run_name(self, run_id: str) -> str:
        return "run=" + "+".join(self.run_keys.get(run_id, ["?"]))

    async def _guard(self, op: str, kw: dict[str, Any], call: Callable[..., Awaitable[Any]], detail: str) -> Any:
        cid = kw["conversation_id"]
        self.counts[(op, cid)] += 1
        when = self.tracer.store_call(op, cid, self.counts[(op, cid)], detail)
        if when == "before":
            self.tracer.die()
        self._mid = when == "mid"  # read by _run, which the call reaches before its first suspension
        try:
            result = await call(**kw)
        finally:
            self._mid = False
        if op == "accept":
            keys = self.run_keys.setdefault(result.run.id, [])
            if kw["idempotency_key"] not in keys:
                keys.append(kw["idempotency_key"])
        if when == "after":
            self.tracer.die()
        return result

    async def _run(self, name: str, operation: Any, access: Any) -> Any:
        if self._mid:
            self._mid = False
            make = operation
            operation = lambda: _die_before_commit(make(), self.tracer)  # noqa: E731
        return await super()._run(name, operation, access)

    async def accept_input_and_assign_run(self, **kw: Any) -> Any:
        detail = f"key={kw['idempotency_key']}"
        return await self._guard("accept", kw, super().accept_input_and_assign_run, detail)

    async def acquire_run(self, **kw: Any) -> Any:
        return await self._guard("acquire", kw, super().acquire_run, self._run_name(kw["run_id"]))

    async def checkpoint_run_assistant(self, **kw: Any) -> Any:
        operation = kw.get("operation")
        phase = operation.phase if operation is not None else "none"
        detail = f"{self._run_name(kw['run_id'])};parts={_types(kw['parts'])};op={phase}"
        return await self._guard("checkpoint", kw, super().checkpoint_run_assistant, detail)

    async def record_run_operation(self, **kw: Any) -> Any:
        operation = kw["operation"]
        detail = f"{self._run_name(kw['run_id'])};phase={operation.phase};step={operation.step}"
        return await self._guard("record", kw, super().record_run_operation, detail)

    async def commit_run_terminal(self, **kw: Any) -> Any:
        detail = f"{self._run_name(kw['run_id'])};reason={kw['terminal_reason']}"
        return await self._guard("terminal", kw, super().commit_run_terminal, detail)

    async def recover_run(self, **kw: Any) -> Any:
        detail = f"{self._run_name(kw['run_id'])};action={kw['action']}"
        return await self._guard("recover", kw, super().recover_run, detail)

    async def learn_runs(self) -> None:
        """Name the runs already in the database by their inputs' keys (for a recovering process)."""
        for cid in CONVERSATIONS:
            snapshot = await self.load_snapshot(conversation_id=cid)
            texts = {m.id: "".join(p.text for p in m.parts if p.type == "text") for m in snapshot.messages}
            for run in snapshot.runs:
                self.run_keys[run.id] = [k for mid in run.input_message_ids for k in keys_in(texts.get(mid, ""))]


class ChildHooks(Hooks):
    def __init__(self, tracer: Tracer) -> None:
        self.tracer = tracer
        self.calls: Counter[str] = Counter()
        self.tools: Counter[str] = Counter()
        self.k0_started = asyncio.Event()
        self.c1_queued = asyncio.Event()

    async def model_call(self, conversation_id: str, keys: list[str]) -> int:
        self.calls[conversation_id] += 1
        call = self.calls[conversation_id]
        if (conversation_id, call) == ("c1", 1):
            self.k0_started.set()
        return call

    async def after_chunk(self, conversation_id: str, call: int, k: int, keys: list[str]) -> None:
        self.tracer.reach(f"stream:{conversation_id}:{call}:{k}", "run=" + "+".join(keys))
        if (conversation_id, call, k) == ("c1", 1, 2):
            await self.c1_queued.wait()  # k1 and k3 are admitted while k0 is mid-stream

    def tool(self, conversation_id: str, stage: str, call_id: str) -> None:
        if stage == "before-effect":
            self.tools[conversation_id] += 1
        self.tracer.reach(f"tool:{stage}:{conversation_id}:{self.tools[conversation_id]}", f"call={call_id}")


async def main(workdir: str, point: str, policy: str | None = None) -> int:
    tracer = Tracer(workdir, point)
    journal = os.path.join(workdir, "journal.log")
    handle = create_sqlite_agent_runtime_store(os.path.join(workdir, "threadline.db"))
    store = CrashStore(handle.driver, tracer)
    hooks = ChildHooks(tracer)
    owner_id = "child" if policy is None else "recoverer"
    runtime = build_runtime(store, hooks, os.path.join(workdir, "effects.log"), owner_id=owner_id)
    tickets: dict[str, Any] = {}
    if policy is not None:
        return await recover_then_retry(runtime, store, hooks, tracer, journal, policy, handle)

    def send(key: str) -> None:
        append_line(journal, f"submitted {key}")
        tickets[key] = submit(runtime, key)

    async def admitted(key: str) -> None:
        admission = await tickets[key].admission
        append_line(journal, f"admitted {key} {admission.run_id}")

    send("k0")
    send("k2")
    await admitted("k0")
    await admitted("k2")
    await asyncio.wait_for(hooks.k0_started.wait(), 10)
    send("k1")
    await admitted("k1")
    send("k3")
    await admitted("k3")
    hooks.c1_queued.set()
    failures = []
    for key in INPUTS:
        result = await asyncio.wait_for(tickets[key].result, 10)
        if result.terminal_reason != "success":
            failures.append(f"{key}: {result.terminal_reason}")
    await runtime.close()
    await handle.close()
    print("DONE" if not failures else f"FAILED {failures}")
    return 0 if not failures else 1


async def recover_then_retry(
    runtime: Any, store: CrashStore, hooks: ChildHooks, tracer: Tracer, journal: str, policy: str, handle: Any
) -> int:
    """The second process: recover the crashed file with ``policy``, then retry every journaled key."""
    append_line(tracer.path, f"--- recover {policy}", fsync=False)
    hooks.c1_queued.set()  # nothing to wait for in this process
    await store.learn_runs()
    decision = POLICIES[policy]
    outcomes = await runtime.recover(resolve_context=lambda _run: CONTEXT, policy=lambda _run: decision)
    failures = [f"{o.run_id}: {o.outcome} {o.error!r}" for o in outcomes if o.outcome in ("failed", "blocked")]
    for outcome in outcomes:
        if outcome.result is not None:
            await asyncio.wait_for(outcome.result, 10)
    with open(journal) as lines:
        keys = list(dict.fromkeys(line.split()[1] for line in lines if line.startswith("submitted ")))
    for key in keys:
        append_line(journal, f"submitted {key}")
        ticket = submit(runtime, key)
        admission = await ticket.admission
        append_line(journal, f"admitted {key} {admission.run_id}")
        await asyncio.wait_for(ticket.result, 10)
    await runtime.close()
    await handle.close()
    print("DONE" if not failures else f"FAILED {failures}")
    return 0 if not failures else 1


def _forked(workdir: str, point: str, policy: str | None) -> None:
    """In the forked child: own stdio files, own event loop; never returns into the server's code."""
    code = 70
    try:
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        for fd, name in ((1, "stdout.log"), (2, "stderr.log")):
            out = os.open(os.path.join(workdir, name), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(out, fd)
        sys.stdin = open(0, closefd=False)  # noqa: SIM115
        sys.stdout = open(1, "w", closefd=False)  # noqa: SIM115
        sys.stderr = open(2, "w", closefd=False)  # noqa: SIM115
        code = asyncio.run(main(workdir, point, policy))
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def serve(timeout: float = 60.0) -> int:
    """The fork server (see the module docstring). Forks only while it has a single thread."""
    for line in sys.stdin:
        workdir, point, *policy = line.split()
        if threading.active_count() != 1:
            raise RuntimeError("the fork server must stay single-threaded")
        pid = os.fork()
        if pid == 0:
            _forked(workdir, point, policy[0] if policy else None)
        deadline = time.monotonic() + timeout
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                answer = str(os.waitstatus_to_exitcode(status))
                break
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                answer = "timeout"
                break
            time.sleep(0.005)
        print(f"{answer} {point}", flush=True)
    return 0


if __name__ == "__main__":
    if sys.argv[1:] == ["--serve"]:
        sys.exit(serve())
    sys.exit(asyncio.run(main(sys.argv[1], sys.argv[2], *sys.argv[3:4])))
