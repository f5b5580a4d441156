"""The worker side of ``bench/crashfuzz.py``: a fork server that runs one seeded kill point per request.

    python bench/_crashfuzz_child.py --serve   # one JSON job per stdin line, one JSON result per stdout line

The server imports threadline once, then for each point forks, one after another (each a real process
with its own event loop, store connection and threads):

1. the **reference run**: the point's scenario without a kill. It counts the events the scenario reaches
   and, once its runtime has closed normally, checks the live-runtime invariant (nothing it admitted is
   left queued or running);
2. the **kill run**: the same scenario, SIGKILLed at one event index drawn from the reference's events
   (startup: an event of opening the store; run: any later event). A kill index beyond the events this
   run reaches lets it finish (``DONE``): then the live-runtime invariant is checked on it too;
3. for recovery points, a **second process** that recovers the crashed store (``requeue`` with
   ``replay_safe``, or ``abandon`` with ``stale_owner``), retries every journaled key, and is SIGKILLed
   at an event index of its own (startup points: while it opens the store);
4. the **checker** (the parent, which never crashes): it reopens the store, recovers to completion,
   retries every journaled key twice, runs a final recovery pass and checks the invariants from the
   database (see ``check_point``).

Events (one trace line each, ``<n> <name> <detail>``): ``open:begin``/``open:sql:<verb>``/``open:end``
(every SQL statement the store runs while it opens), ``before|mid|after:<op>:<conversation>`` around every
store mutation (``mid``: every row written inside its transaction, ``COMMIT`` not reached),
``delta:<conversation>:<call>:<k>`` after the loop consumed the k-th delta of the conversation's call-th
model request, ``tool:before-effect|after-effect|after-step:<effect>``.

The scenario (``make_scenario``) is drawn from ``random.Random(seed + point)``. Every input names its key,
policy, tool rounds and answer length in its text, so the scripted model decides from the prompt alone
and a recovering runtime answers exactly as the crashed one would have. The tool ``record_effect(effect)``
appends ``<conversation> <effect> <run> <call> <pid>`` to ``effects.log`` (fsynced); the model always names
a logical effect ``<input key>:<round>``, so a repeated application is recognisable whoever made it.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import os
import random
import re
import select
import shutil
import signal
import sqlite3
import sys
import tempfile
import threading
import time
import traceback
from collections import Counter, defaultdict
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from pydantic import BaseModel
from pydantic_ai.messages import ModelResponse, RetryPromptPart, ToolReturnPart, UserPromptPart
from pydantic_ai.models.function import AgentInfo, DeltaToolCall, FunctionModel

import threadline
from threadline import (
    AgentRuntime,
    AgentRuntimeStore,
    AgentToolContext,
    ConversationSnapshot,
    create_agent_runtime,
    create_agent_runtime_store,
    create_local_step_durability,
    create_sqlite_agent_runtime_store,
    define_agent_protocol,
    define_agent_tool,
    define_model_registry,
)

POLICIES = ("queue", "inject", "interrupt", "interrupt-next", "supersede")
RECOVERY: dict[str, dict[str, Any]] = {
    "requeue": {"action": "requeue", "replay_safe": True},
    "abandon": {"action": "abandon", "stale_owner": True},
}
PHASES = ("startup", "run", "recovery")
PHASE_WEIGHTS = (1, 6, 3)
CONTEXT = {"user_id": "u1"}
TOOL_NAME = "record_effect"
INPUT = re.compile(r"\b(c\d+)-k\d+ policy=(\S+) tools=(\d+) chunks=(\d+)")
KEY = re.compile(r"\bc\d+-k\d+\b")
STEP_TIMEOUT = 10.0  # one admission, result or recovery pass; a bug that hangs is reported, never waited out
QUIET = 0.3  # seconds without any store operation or event before a live child decides nothing moves
CHILD_TIMEOUT = 60.0
CHECK_TIMEOUT = 120.0
EXIT_FAILED = 3
MUTATIONS = {
    "accept_input_and_assign_run": "accept",
    "acquire_run": "acquire",
    "checkpoint_run_assistant": "checkpoint",
    "record_run_operation": "record",
    "renew_run_lease": "renew",
    "request_run_interrupt": "interrupt",
    "commit_run_terminal": "terminal",
    "recover_run": "recover",
}


class Context(BaseModel):
    user_id: str


# ----------------------------------------------------------------------------------------- scenario


@dataclass(frozen=True)
class Input:
    key: str  # ``c2-k3``: the idempotency key, named in the text so every answer says what it answers
    conversation_id: str
    policy: str
    tools: int  # tool rounds the input asks for
    chunks: int  # text deltas of its answer
    trigger: str  # "delta": once the conversation's model calls streamed ``after`` deltas (0: at once);
    # "terminal": right after the conversation's ``after``-th terminal commit, before its lane moves on
    after: int

    @property
    def text(self) -> str:
        return f"{self.key} policy={self.policy} tools={self.tools} chunks={self.chunks}"


@dataclass(frozen=True)
class Scenario:
    inputs: tuple[Input, ...]
    coalesce: bool

    @property
    def conversations(self) -> list[str]:
        return list(dict.fromkeys(i.conversation_id for i in self.inputs))

    @property
    def by_key(self) -> dict[str, Input]:
        return {i.key: i for i in self.inputs}


def make_scenario(rng: random.Random) -> Scenario:
    """1–3 conversations of 2–6 inputs each, a policy per input, some asking for 1–2 tool rounds, each
    submitted after a drawn number of the conversation's deltas (while its runs are in progress) or right
    after one of its terminal commits (while its lane picks the next run)."""
    coalesce = rng.random() < 0.5
    inputs: list[Input] = []
    for c in range(1, rng.randint(1, 3) + 1):
        after = 0
        for k in range(rng.randint(2, 6)):
            tools = rng.choice((0, 0, 1, 2))
            policy, chunks = rng.choice(POLICIES), rng.randint(2, 5)
            if k and rng.random() < 0.3:
                inputs.append(Input(f"c{c}-k{k}", f"c{c}", policy, tools, chunks, "terminal", rng.randint(1, k)))
                continue
            inputs.append(Input(f"c{c}-k{k}", f"c{c}", policy, tools, chunks, "delta", after))
            after += rng.randint(0, 6)
    return Scenario(tuple(inputs), coalesce)


@dataclass(frozen=True)
class Plan:
    """Where the point kills: the first process at event ``first`` (None: never), then for recovery and
    reopening points a second process recovering with ``second_policy``, killed at its event ``second``."""

    phase: str
    first: int | None
    parent_policy: str
    second_policy: str | None = None
    second: int | None = None


def plan_point(rng: random.Random, events: list[str], reopen_events: int) -> Plan:
    """Draw the kill points from the reference run's events (``reopen_events``: how many events opening
    the existing store took)."""
    opening = next((i for i, name in enumerate(events) if not name.startswith("open:")), len(events))
    total = len(events)
    phase = rng.choices(PHASES, weights=PHASE_WEIGHTS)[0]
    parent = rng.choice(tuple(RECOVERY))
    if phase == "startup" and rng.random() < 0.5:  # creating the store
        return Plan("startup", rng.randint(1, max(1, opening)), parent)
    first = rng.randint(opening + 1, max(opening + 1, total))
    if phase == "run":
        return Plan("run", first, parent)
    policy = rng.choice(tuple(RECOVERY))
    if phase == "startup":  # reopening the crashed store
        return Plan("startup", first, parent, policy, rng.randint(1, max(1, reopen_events)))
    second = rng.randint(reopen_events + 1, reopen_events + max(4, total - first))
    return Plan("recovery", first, parent, policy, second)


# --------------------------------------------------------------------------------------- files


def append_line(path: str | Path, line: str, *, fsync: bool = True) -> None:
    """One ``write`` with ``O_APPEND``: it survives a SIGKILL right after; fsynced, a power loss too."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, (line + "\n").encode())
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)


def read_lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


def read_events(path: Path) -> list[str]:
    """The event names of a trace, in order (``KILL`` lines left out)."""
    return [line.split(" ", 2)[1] for line in read_lines(path) if line and not line.startswith("KILL")]


@dataclass
class Journal:
    submitted: list[str]
    admitted: dict[str, str]
    conflicts: list[str]

    @classmethod
    def read(cls, path: Path) -> Journal:
        submitted: list[str] = []
        admitted: dict[str, str] = {}
        conflicts: list[str] = []
        for line in read_lines(path):
            kind, key, *rest = line.split()
            if kind == "submitted" and key not in submitted:
                submitted.append(key)
            elif kind == "admitted" and admitted.setdefault(key, rest[0]) != rest[0]:
                conflicts.append(f"{key} was journaled admitted to {admitted[key]} and then to {rest[0]}")
        return cls(submitted, admitted, conflicts)


# ------------------------------------------------------------------------------------------ tracing


class Tracer:
    """Counts the events this process reaches (one trace line each) and SIGKILLs it at the ``kill_at``-th.
    Events come from the event loop and from store threads, hence the lock."""

    def __init__(self, path: Path, kill_at: int | None) -> None:
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self.kill_at = kill_at
        self.count = 0
        self.in_flight = 0  # store operations and tool calls under way (what a quiet moment must lack)
        self.last = time.monotonic()
        self._lock = threading.Lock()

    def _next(self, name: str) -> int:
        with self._lock:
            self.count += 1
            os.write(self.fd, f"{self.count} {name}\n".encode())
            self.last = time.monotonic()
            return self.count

    def reach(self, name: str) -> None:
        n = self._next(name)
        if n == self.kill_at:
            self.die(n, name)

    def reserve(self, name: str) -> tuple[int, str] | None:
        """Count an event that happens a moment later (inside a transaction); the event if it is the kill."""
        n = self._next(name)
        return (n, name) if n == self.kill_at else None

    def touch(self) -> None:
        self.last = time.monotonic()

    @contextlib.contextmanager
    def working(self) -> Iterator[None]:
        self.in_flight += 1
        self.touch()
        try:
            yield
        finally:
            self.in_flight -= 1
            self.touch()

    def close(self) -> None:
        os.close(self.fd)

    def die(self, n: int, name: str) -> None:
        os.write(self.fd, f"KILL {n} {name}\n".encode())
        os.kill(os.getpid(), signal.SIGKILL)


class CrashDriver:
    """The real driver behind the store's one seam (``run``): counts operations in flight (a live child's
    quiescence test) and, when armed, drives the next write to its end inside its transaction and dies
    before ``COMMIT``. Everything else is the real driver's."""

    def __init__(self, inner: Any, tracer: Tracer) -> None:
        self.inner = inner
        self.tracer = tracer
        self.armed: tuple[int, str] | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def run(self, operation: Any, *, access: str, stats: Any) -> Any:
        if self.armed is not None and access == "write":
            event, self.armed = self.armed, None
            operation = _dying(operation, self.tracer, event)
        with self.tracer.working():
            return await self.inner.run(operation, access=access, stats=stats)


def _dying(operation: Any, tracer: Tracer, event: tuple[int, str]) -> Any:
    def drive(op: Any) -> Any:
        result = yield from op
        tracer.die(*event)  # every row is written in the open transaction; its COMMIT never comes
        return result

    return (lambda: drive(operation())) if callable(operation) else drive(operation)


class RunNames:
    """Names runs by their inputs' keys in trace lines (``run=c1-k0+c1-k2``)."""

    def __init__(self) -> None:
        self.keys: dict[str, list[str]] = {}

    def learn_admission(self, key: str, run_id: str) -> None:
        keys = self.keys.setdefault(run_id, [])
        if key not in keys:
            keys.append(key)

    def learn_snapshot(self, snapshot: ConversationSnapshot) -> None:
        texts = {m.id: text_of(m) for m in snapshot.messages}
        for run in snapshot.runs:
            self.keys[run.id] = [k for mid in run.input_message_ids for k in KEY.findall(texts.get(mid, ""))]

    def detail(self, op: str, kw: dict[str, Any]) -> str:
        if op == "accept":
            return f"key={kw.get('idempotency_key')}"
        detail = "run=" + "+".join(self.keys.get(kw.get("run_id", ""), ["?"]))
        if op == "terminal":
            detail += f";reason={kw.get('terminal_reason')}"
        elif op == "recover":
            detail += f";action={kw.get('action')}"
        elif op in ("checkpoint", "record") and kw.get("operation") is not None:
            detail += f";op={getattr(kw['operation'], 'phase', None) or kw['operation'].get('phase')}"
        return detail


Committed = Callable[[str, str], None]  # (op, conversation id) after a mutation committed


def instrument(
    store: AgentRuntimeStore, driver: CrashDriver, names: RunNames, committed: Committed | None = None
) -> None:
    """Put kill points around every store mutation (instance attributes over the public methods)."""
    for method, op in MUTATIONS.items():
        call = getattr(store, method, None)
        if call is not None:
            setattr(store, method, _guarded(op, call, driver, names, committed))


def _guarded(
    op: str, call: Callable[..., Any], driver: CrashDriver, names: RunNames, committed: Committed | None
) -> Callable[..., Any]:
    tracer = driver.tracer

    async def guarded(**kw: Any) -> Any:
        where = f"{op}:{kw.get('conversation_id', '?')} {names.detail(op, kw)}"
        tracer.reach(f"before:{where}")
        armed = tracer.reserve(f"mid:{where}")
        driver.armed = armed or driver.armed
        try:
            result = await call(**kw)
        except BaseException:
            if armed is not None:
                tracer.die(*armed)  # refused before its commit: nothing of it is durable either
            raise
        if armed is not None:  # it never reached the driver's write seam: die right after it
            driver.armed = None
            tracer.die(*armed)
        if op == "accept":
            names.learn_admission(kw["idempotency_key"], result.run.id)
        tracer.reach(f"after:{where}")
        if committed is not None:
            committed(op, kw.get("conversation_id", "?"))
        return result

    return guarded


@contextlib.contextmanager
def traced_open(tracer: Tracer | None, store: str) -> Iterator[None]:
    """Every SQL statement the store runs while it opens is an event (a kill point inside its schema
    transaction): SQLite through a trace callback on each new connection, PostgreSQL around
    ``AsyncCursor.execute``. Only this process is patched, and only while it opens."""
    if tracer is None:
        yield
        return
    if store == "sqlite":
        real_connect = sqlite3.connect
        opening = [True]

        def connect(*args: Any, **kwargs: Any) -> sqlite3.Connection:
            conn = real_connect(*args, **kwargs)
            conn.set_trace_callback(lambda sql: opening[0] and tracer.reach(f"open:sql:{_verb(sql)}"))
            return conn

        sqlite3.connect = connect  # type: ignore[assignment]
        try:
            yield
        finally:
            sqlite3.connect = real_connect
            opening[0] = False
        return
    import psycopg

    real_execute = psycopg.AsyncCursor.execute

    async def execute(self: Any, query: Any, *args: Any, **kwargs: Any) -> Any:
        tracer.reach(f"open:sql:{_verb(query if isinstance(query, str) else type(query).__name__)}")
        return await real_execute(self, query, *args, **kwargs)

    psycopg.AsyncCursor.execute = execute  # type: ignore[method-assign]
    try:
        yield
    finally:
        psycopg.AsyncCursor.execute = real_execute  # type: ignore[method-assign]


def _verb(sql: str) -> str:
    words = sql.split(None, 1)
    return words[0].upper() if words else "?"


# ------------------------------------------------------------------------------------ the store


@dataclass(frozen=True)
class Spec:
    """What one process of a point works on."""

    store: str  # sqlite | postgres
    tool: str  # direct | step
    workdir: str
    dsn: str = ""
    schema: str = ""
    keep: bool = False

    @property
    def path(self) -> Path:
        return Path(self.workdir)


async def open_store(spec: Spec, tracer: Tracer | None = None) -> tuple[Any, AgentRuntimeStore, CrashDriver | None]:
    """Open (creating if needed) the point's store: ``(handle, store, crash driver)``. With a tracer the
    opening is traced and the store carries the kill points."""
    if tracer is not None:
        tracer.reach("open:begin")
    with traced_open(tracer, spec.store):
        if spec.store == "sqlite":
            handle: Any = create_sqlite_agent_runtime_store(spec.path / "threadline.db")
        else:
            from threadline.store.postgres import create_postgres_agent_runtime_store

            handle = create_postgres_agent_runtime_store(spec.dsn, schema=spec.schema, max_size=4)
            await handle.open()
    if tracer is None:
        return handle, handle.store, None
    tracer.reach("open:end")
    driver = CrashDriver(handle.driver, tracer)
    store = create_agent_runtime_store(driver)  # type: ignore[arg-type]
    return handle, store, driver


async def snapshots(store: AgentRuntimeStore, scenario: Scenario) -> dict[str, ConversationSnapshot]:
    return {cid: await store.load_snapshot(conversation_id=cid) for cid in scenario.conversations}


def drop_schema(spec: Spec) -> None:
    if spec.store != "postgres" or spec.keep:
        return
    import psycopg

    with psycopg.connect(spec.dsn, autocommit=True, connect_timeout=5) as conn:
        conn.execute(f'DROP SCHEMA IF EXISTS "{spec.schema}" CASCADE')


def text_of(message: Any) -> str:
    return "".join(p.text for p in message.parts if p.type == "text")


# ------------------------------------------------------------------------------ model, tool, runtime


class Hooks:
    """What the scripted model and the tool report (the checker's: nothing)."""

    def model_call(self, conversation_id: str) -> int:
        return 0

    async def after_delta(self, conversation_id: str, call: int, k: int) -> None:
        return None

    def tool_stage(self, stage: str, effect: str) -> None:
        return None

    def working(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()


class TracedHooks(Hooks):
    """Every delta and tool stage is an event."""

    def __init__(self, tracer: Tracer) -> None:
        self.tracer = tracer
        self.calls: Counter[str] = Counter()

    def model_call(self, conversation_id: str) -> int:
        self.calls[conversation_id] += 1
        return self.calls[conversation_id]

    async def after_delta(self, conversation_id: str, call: int, k: int) -> None:
        self.tracer.reach(f"delta:{conversation_id}:{call}:{k}")

    def tool_stage(self, stage: str, effect: str) -> None:
        self.tracer.reach(f"tool:{stage}:{effect}")

    def working(self) -> contextlib.AbstractContextManager[None]:
        return self.tracer.working()


@dataclass
class Turn:
    """What the prompt asks for: the trailing block of user inputs, the last one's request, and how many
    tool results came back since it."""

    conversation_id: str
    keys: list[str]
    key: str
    tools: int
    chunks: int
    rounds: int

    @property
    def effect(self) -> str:
        return f"{self.key}:{self.rounds + 1}"

    def answer(self) -> list[str]:
        return [f"answer to {' '.join(self.keys)}", *(f" part {i}" for i in range(1, self.chunks))]


def read_turn(messages: list[Any]) -> Turn:
    tokens: list[tuple[str, str]] = []
    for message in messages:
        for part in message.parts:
            if isinstance(message, ModelResponse):
                tokens.append(("answer", ""))
            elif isinstance(part, UserPromptPart) and isinstance(part.content, str):
                tokens.append(("user", part.content))
            elif isinstance(part, ToolReturnPart) or (isinstance(part, RetryPromptPart) and part.tool_name):
                tokens.append(("return", ""))
    users = [i for i, (kind, _) in enumerate(tokens) if kind == "user"]
    if not users:
        return Turn("?", [], "?", 0, 1, 0)
    last = first = users[-1]
    while first > 0 and tokens[first - 1][0] == "user":
        first -= 1
    keys = [k for _, text in tokens[first : last + 1] for k in KEY.findall(text)]
    found = INPUT.search(tokens[last][1])
    rounds = sum(1 for kind, _ in tokens[last + 1 :] if kind == "return")
    if found is None or not keys:
        return Turn("?", keys or ["?"], "?", 0, 1, rounds)
    return Turn(found[1], keys, keys[-1], int(found[3]), int(found[4]), rounds)


def make_model(hooks: Hooks) -> FunctionModel:
    async def stream(messages: list[Any], info: AgentInfo) -> AsyncIterator[Any]:
        turn = read_turn(messages)
        call = hooks.model_call(turn.conversation_id)
        if turn.rounds < turn.tools:
            effect = turn.effect
            arguments = json.dumps({"effect": effect})
            yield {0: DeltaToolCall(name=TOOL_NAME, json_args=arguments, tool_call_id=f"call-{turn.key}-{turn.rounds}")}
            await hooks.after_delta(turn.conversation_id, call, 1)
            return
        for k, chunk in enumerate(turn.answer(), 1):
            yield chunk
            await hooks.after_delta(turn.conversation_id, call, k)

    return FunctionModel(stream_function=stream, model_name="crashfuzz-scripted")


def make_tool(hooks: Hooks, effects: Path, step: bool) -> Any:
    @define_agent_tool(name=TOOL_NAME)
    async def record_effect(ctx: AgentToolContext, effect: str) -> str:
        """Apply one external effect, named by its logical id."""

        def apply() -> str:
            append_line(effects, f"{ctx.conversation_id} {effect} {ctx.run_id} {ctx.call_id} {os.getpid()}")
            hooks.tool_stage("after-effect", effect)
            return f"applied {effect}"

        with hooks.working():  # the step ledger works on a thread of its own: not idle meanwhile
            hooks.tool_stage("before-effect", effect)
            if not step:
                return apply()
            value = await ctx.step(effect, apply)  # keyed (conversation, run, effect): a replay finds the proof
            hooks.tool_stage("after-step", effect)
            return str(value)

    return record_effect


def policy_of(raw: Any) -> str:
    """The input policy an input names in its text."""
    part = raw.parts[0]
    text = part["text"] if isinstance(part, dict) else getattr(part, "text", "")
    found = INPUT.search(text)
    return found[2] if found else "queue"


def build_runtime(
    store: AgentRuntimeStore, hooks: Hooks, scenario: Scenario, spec: Spec, owner: str, ledger: Any
) -> AgentRuntime:
    registry = define_model_registry(models={"m": {"model": make_model(hooks), "context_window": 100_000}})
    loop: dict[str, Any] = {"checkpoint_every_events": 2}
    if ledger is not None:
        loop["step_durability"] = ledger
    return create_agent_runtime(
        protocol=define_agent_protocol(context=Context),
        store=store,
        models={"preflight": lambda: registry.preflight("m"), "resolve": lambda: registry.resolve("m")},
        tools=[make_tool(hooks, spec.path / "effects.log", spec.tool in ("step", "ledger-step"))],
        runs={"input_policy": policy_of, "coalesce_pending": scenario.coalesce, "owner_id": owner},
        loop=loop,
    )


def open_ledger(spec: Spec, store: AgentRuntimeStore) -> Any:
    """``--tool step``: the steps in their own SQLite file; ``ledger-step``: in the store's event ledger."""
    if spec.tool == "ledger-step":
        return create_local_step_durability(store=store)
    return create_local_step_durability(spec.path / "steps.db") if spec.tool == "step" else None


def submit(runtime: AgentRuntime, item: Input) -> Any:
    return runtime.submit(
        conversation_id=item.conversation_id,
        idempotency_key=item.key,
        context=CONTEXT,
        parts=[{"type": "text", "text": item.text}],
    )


async def bounded(awaitable: Any, timeout: float = STEP_TIMEOUT) -> Any:
    """Await at most ``timeout`` seconds (a ticket's future is shielded: giving up does not cancel it)."""
    if isinstance(awaitable, asyncio.Future):
        awaitable = asyncio.shield(awaitable)
    return await asyncio.wait_for(awaitable, timeout)


# ---------------------------------------------------------------------------- the live child


class Feed:
    """Submits each conversation's inputs in order, each once its trigger is met (or everything submitted
    there is answered, or nothing moves any more: ``forced``). Submitting happens right where the trigger
    is met, in the hook that met it: a stream that reaches a delta trigger then waits until the inputs due
    are admitted, so they arrive while its run is in progress whatever the machine's speed; a terminal
    trigger submits while the lane that committed the terminal goes on to pick its next run."""

    def __init__(self, runtime: AgentRuntime, scenario: Scenario, journal: Path) -> None:
        self.runtime = runtime
        self.scenario = scenario
        self.journal = journal
        self.counts: dict[str, Counter[str]] = {"delta": Counter(), "terminal": Counter()}
        self.tickets: dict[str, Any] = {}
        self.admitted: set[str] = set()
        self.errors: list[str] = []
        self.forced = False
        self._waiters: list[asyncio.Event] = []

    def notify(self) -> None:
        waiters, self._waiters = self._waiters, []
        for event in waiters:
            event.set()

    async def wait_change(self, timeout: float | None = None) -> None:
        event = asyncio.Event()
        self._waiters.append(event)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(event.wait(), timeout)

    async def until(self, condition: Callable[[], bool]) -> None:
        while not condition():
            await self.wait_change()

    def inputs(self, cid: str) -> list[Input]:
        return [i for i in self.scenario.inputs if i.conversation_id == cid]

    def answered(self, cid: str) -> bool:
        return all(self.tickets[i.key].result.done() for i in self.inputs(cid) if i.key in self.tickets)

    def due(self, item: Input) -> bool:
        cid = item.conversation_id
        return self.forced or self.counts[item.trigger][cid] >= item.after or self.answered(cid)

    def pending_due(self, cid: str) -> bool:
        """The conversation's next input to admit is due (a later one waits for it, due or not)."""
        waiting = [i for i in self.inputs(cid) if i.key not in self.admitted]
        return bool(waiting) and self.due(waiting[0])

    def send_due(self, cid: str) -> None:
        """Submit the conversation's next input now if it is due and the one before it was admitted."""
        waiting = [i for i in self.inputs(cid) if i.key not in self.tickets]
        if not waiting or not self.due(waiting[0]):
            return
        previous = [i for i in self.inputs(cid) if i.key in self.tickets]
        if previous and previous[-1].key not in self.admitted:
            return
        item = waiting[0]
        append_line(self.journal, f"submitted {item.key}")
        ticket = self.tickets[item.key] = submit(self.runtime, item)
        ticket.result.add_done_callback(lambda _: self.notify())
        self.notify()

    async def feed(self, cid: str) -> None:
        """Journal each input's admission, in order (the hooks submit them)."""
        for item in self.inputs(cid):
            while item.key not in self.tickets:
                self.send_due(cid)
                if item.key not in self.tickets:
                    await self.wait_change()
            try:
                admission = await bounded(self.tickets[item.key].admission)
                append_line(self.journal, f"admitted {item.key} {admission.run_id}")
            except Exception as error:
                self.errors.append(f"{item.key}: admission failed: {error!r}")
            self.admitted.add(item.key)
            self.send_due(cid)
            self.notify()

    async def hold(self, cid: str) -> None:
        self.counts["delta"][cid] += 1
        self.send_due(cid)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.until(lambda: not self.pending_due(cid)), STEP_TIMEOUT)

    def committed(self, op: str, cid: str) -> None:
        if op == "terminal":
            self.counts["terminal"][cid] += 1
            self.send_due(cid)


class ChildHooks(TracedHooks):
    def __init__(self, tracer: Tracer) -> None:
        super().__init__(tracer)
        self.feed: Feed | None = None

    async def after_delta(self, conversation_id: str, call: int, k: int) -> None:
        await super().after_delta(conversation_id, call, k)
        if self.feed is not None:
            await self.feed.hold(conversation_id)


async def quiet(tracer: Tracer) -> bool:
    """Nothing moves: no store operation or tool call in flight, no event or operation for ``QUIET``
    seconds, and none during twenty more turns of the event loop (so a task that is merely ready is not
    mistaken for idle)."""
    if tracer.in_flight or time.monotonic() - tracer.last < QUIET:
        return False
    mark = tracer.count
    for _ in range(20):
        await asyncio.sleep(0)
    return tracer.in_flight == 0 and tracer.count == mark


async def settle(feed: Feed, feeders: list[asyncio.Task[None]], tracer: Tracer, names: RunNames) -> list[str]:
    """Until everything was submitted and answered, or nothing moves any more. Nothing moving while an
    admitted input waits for its answer is a stall (a live runtime that dropped a run): it is reported,
    then the remaining inputs are submitted anyway (a later admission may wake the lane again)."""
    stalls: list[str] = []
    while not (all(f.done() for f in feeders) and all(t.result.done() for t in feed.tickets.values())):
        await feed.wait_change(0.05)
        if not await quiet(tracer):
            continue
        waiting = sorted(k for k, t in feed.tickets.items() if not t.result.done() and k in feed.admitted)
        if waiting:
            stalls.append(await describe_stall(feed, waiting, names))
        if all(f.done() for f in feeders):
            break
        feed.forced = True
        feed.notify()
    return stalls


async def describe_stall(feed: Feed, waiting: list[str], names: RunNames) -> str:
    active = []
    for cid in feed.scenario.conversations:
        for run in (await feed.runtime.store.list_active_runs(conversation_id=cid)).runs:
            active.append(f"{'+'.join(names.keys.get(run.id, ['?']))} {run.state}")
    return (
        f"nothing moved for {QUIET} s while {', '.join(waiting)} waited for an answer "
        f"(active runs: {', '.join(active) or 'none'})"
    )


async def run_child(spec: Spec, scenario: Scenario, kill_at: int | None) -> dict[str, Any]:
    """The scenario on a live runtime; SIGKILLed at event ``kill_at`` unless it finishes first."""
    tracer = Tracer(spec.path / "trace.log", kill_at)
    handle, store, driver = await open_store(spec, tracer)
    assert driver is not None
    ledger = open_ledger(spec, store)
    hooks = ChildHooks(tracer)
    runtime = build_runtime(store, hooks, scenario, spec, "child", ledger)
    feed = hooks.feed = Feed(runtime, scenario, spec.path / "journal.log")
    names = RunNames()
    instrument(store, driver, names, feed.committed)
    feeders = [asyncio.ensure_future(feed.feed(cid)) for cid in scenario.conversations]
    stalls = await settle(feed, feeders, tracer, names)
    for feeder in feeders:
        feeder.cancel()
    unresolved = sorted(k for k, t in feed.tickets.items() if not t.result.done())
    reasons = Counter(_reason(t.result) for t in feed.tickets.values())
    closed = await bounded(runtime.close(force_timeout=STEP_TIMEOUT), 3 * STEP_TIMEOUT)
    if ledger is not None:
        await ledger.close()
    await handle.close()
    tracer.close()
    events = tracer.count
    live, reopen_events = await live_check(spec, scenario, unresolved, closed.settled)
    return {
        "status": "DONE",
        "events": events,
        "reopen_events": reopen_events,
        "unresolved": unresolved,
        "reasons": dict(reasons),
        "errors": feed.errors,
        "live": [f"stalled: {stall}" for stall in stalls] + live,
    }


def _reason(result: asyncio.Future[Any]) -> str:
    if not result.done():
        return "unresolved"
    if result.exception() is not None:
        return type(result.exception()).__name__
    return str(result.result().terminal_reason)


async def live_check(spec: Spec, scenario: Scenario, unresolved: list[str], settled: bool) -> tuple[list[str], int]:
    """The live-runtime invariant, from the database, without any recovery: after the runtime finished and
    closed normally nothing it admitted is left queued or running. Opening the store again is traced (no
    kill) to count the events a reopening takes."""
    tracer = Tracer(spec.path / "reopen.log", None)
    handle, store, _ = await open_store(spec, tracer)
    try:
        left = []
        for cid, snapshot in (await snapshots(store, scenario)).items():
            texts = {m.id: text_of(m) for m in snapshot.messages}
            for run in snapshot.runs:
                if run.active:
                    keys = "+".join(k for mid in run.input_message_ids for k in KEY.findall(texts.get(mid, "")))
                    left.append(f"{cid}: run {run.id} ({keys}, priority {run.priority}) left {run.state}")
    finally:
        await handle.close()
        tracer.close()
    if left:
        tail = f"; close settled={settled}; tickets never resolved: {', '.join(unresolved) or 'none'}"
        left = [reason + tail for reason in left]
    return left, tracer.count


# ------------------------------------------------------------------------------ the second process


async def recover_child(spec: Spec, scenario: Scenario, kill_at: int | None, policy: str) -> dict[str, Any]:
    """A second process recovering the crashed store with ``policy``, then retrying every journaled key;
    SIGKILLed at its own event ``kill_at``."""
    tracer = Tracer(spec.path / "trace2.log", kill_at)
    handle, store, driver = await open_store(spec, tracer)
    assert driver is not None
    names = RunNames()
    for snapshot in (await snapshots(store, scenario)).values():
        names.learn_snapshot(snapshot)
    instrument(store, driver, names)
    ledger = open_ledger(spec, store)
    runtime = build_runtime(store, TracedHooks(tracer), scenario, spec, "recoverer", ledger)
    errors: list[str] = []
    decision = RECOVERY[policy]
    outcomes = await bounded(runtime.recover(resolve_context=lambda _run: CONTEXT, policy=lambda _run: decision))
    for outcome in outcomes:
        if outcome.result is not None:
            with contextlib.suppress(Exception):
                await bounded(outcome.result)
    journal = spec.path / "journal.log"
    for key in Journal.read(journal).submitted:
        append_line(journal, f"submitted {key}")
        ticket = submit(runtime, scenario.by_key[key])
        try:
            admission = await bounded(ticket.admission)
            append_line(journal, f"admitted {key} {admission.run_id}")
            await bounded(ticket.result)
        except Exception as error:
            errors.append(f"{key}: {error!r}")
    await bounded(runtime.close(force_timeout=STEP_TIMEOUT), 3 * STEP_TIMEOUT)
    if ledger is not None:
        await ledger.close()
    await handle.close()
    tracer.close()
    return {"status": "DONE", "events": tracer.count, "errors": errors, "outcomes": [o.outcome for o in outcomes]}


# ------------------------------------------------------------------------------------ the checker


@dataclass
class Findings:
    violations: list[dict[str, str]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def add(self, invariant: str, reason: str) -> None:
        self.violations.append({"invariant": invariant, "reason": reason})


async def check_point(spec: Spec, scenario: Scenario, policy: str, killed_at: str | None) -> dict[str, Any]:
    """The parent: reopen the store, recover to completion with ``policy`` for orphaned runs, retry every
    journaled key (twice), run a final recovery pass, then check the invariants from the database.
    ``killed_at``: the event the only process before it died at (what it implies is checked too)."""
    found = Findings()
    journal = Journal.read(spec.path / "journal.log")
    for conflict in journal.conflicts:
        found.add("admitted-once", conflict)
    handle, store, _ = await open_store(spec)
    ledger = open_ledger(spec, store)
    try:
        crashed = await snapshots(store, scenario)
        check_integrity(crashed, "crash state", found)
        if killed_at is not None:
            check_kill_state(killed_at, crashed, found)
        runtime = build_runtime(store, Hooks(), scenario, spec, "parent", ledger)
        first_pass = await recover_pass(runtime, policy, found)
        await retry_journal(runtime, scenario, journal, found)
        final_pass = await recover_pass(runtime, policy, found)
        closed = await bounded(runtime.close(force_timeout=STEP_TIMEOUT), 3 * STEP_TIMEOUT)
        if not closed.settled:
            found.add("terminal-answered", f"the parent's runtime did not settle on close: {closed}")
        final = await snapshots(store, scenario)
        check_admitted_once(journal, final, found)
        check_answered(final, found)
        check_order(final, found)
        check_integrity(final, "after recovery", found)
        effects = classify_effects(read_lines(spec.path / "effects.log"), scenario, final)
        figures = {
            "recovered_runs": first_pass,
            "final_pass_runs": final_pass,
            "terminal_reasons": dict(Counter(r.terminal_reason or r.state for s in final.values() for r in s.runs)),
            **effects,
            **tool_results(final, effects["applied_ids"]),
        }
    finally:
        if ledger is not None:
            await ledger.close()
        await handle.close()
    if spec.store == "sqlite":
        check_sqlite_file(spec.path / "threadline.db", found)
    drop_schema(spec)
    figures.pop("applied_ids")
    return {"violations": found.violations, "notes": found.notes, "figures": figures}


async def recover_pass(runtime: AgentRuntime, policy: str, found: Findings) -> int:
    """One ``recover`` pass, waiting (bounded) for every run it resumed or requeued; returns how many runs
    it reported."""
    decision = RECOVERY[policy]
    try:
        outcomes = await bounded(runtime.recover(resolve_context=lambda _run: CONTEXT, policy=lambda _run: decision))
    except TimeoutError:
        found.add("terminal-answered", f"recover() did not return within {STEP_TIMEOUT} s")
        return 0
    for outcome in outcomes:
        if outcome.outcome in ("failed", "blocked", "skipped"):
            found.notes.append(f"recover: {outcome.run_id} {outcome.outcome} {outcome.error!r}")
        if outcome.result is None:
            continue
        try:
            await bounded(outcome.result)
        except TimeoutError:
            found.add("terminal-answered", f"recovered run {outcome.run_id} did not end within {STEP_TIMEOUT} s")
        except Exception as error:
            found.notes.append(f"recover: {outcome.run_id} result {error!r}")
    return len(outcomes)


async def retry_journal(runtime: AgentRuntime, scenario: Scenario, journal: Journal, found: Findings) -> None:
    """Retry every journaled key with its key and input, twice: the first retry is a duplicate naming the
    journaled run (or the first admission, for a key whose admission the child never saw), the second a
    duplicate naming the same run as the first."""
    first: dict[str, Any] = {}
    for attempt in (1, 2):
        for key in journal.submitted:
            ticket = submit(runtime, scenario.by_key[key])
            try:
                admission = await bounded(ticket.admission)
            except Exception as error:
                found.add("admitted-once", f"{key}: retry {attempt} was refused: {error!r}")
                continue
            expected = journal.admitted.get(key) if attempt == 1 else getattr(first.get(key), "run_id", None)
            if expected is not None and (admission.outcome, admission.run_id) != ("duplicate", expected):
                found.add(
                    "admitted-once",
                    f"{key}: retry {attempt} answered {admission.outcome} run {admission.run_id}, "
                    f"expected a duplicate of run {expected}",
                )
            first.setdefault(key, admission)
            try:
                await bounded(ticket.result)
            except TimeoutError:
                found.add("terminal-answered", f"{key}: its run {admission.run_id} did not end after the retry")
            except Exception as error:
                found.notes.append(f"{key}: retry result {error!r}")


def run_keys(snapshot: ConversationSnapshot) -> dict[str, list[str]]:
    texts = {m.id: text_of(m) for m in snapshot.messages}
    return {r.id: [k for mid in r.input_message_ids for k in KEY.findall(texts.get(mid, ""))] for r in snapshot.runs}


def check_admitted_once(journal: Journal, final: dict[str, ConversationSnapshot], found: Findings) -> None:
    """Every journaled key is stored exactly once, and nothing nobody submitted is."""
    stored: Counter[str] = Counter()
    for snapshot in final.values():
        for message in snapshot.messages:
            if message.role == "user":
                stored.update(KEY.findall(text_of(message)))
    for key in journal.submitted:
        if stored[key] != 1:
            found.add("admitted-once", f"{key} is stored {stored[key]} times")
    for key in set(stored) - set(journal.submitted):
        found.add("admitted-once", f"{key} is stored but nobody submitted it")


def check_answered(final: dict[str, ConversationSnapshot], found: Findings) -> None:
    """Every run is terminal and every input answerable: its run ended (completed, or any terminal reason)
    or it was absorbed into a run that completed."""
    for cid, snapshot in final.items():
        runs = {r.id: r for r in snapshot.runs}
        names = run_keys(snapshot)
        for run in snapshot.runs:
            if not run.terminal:
                found.add("terminal-answered", f"{cid}: run {run.id} ({'+'.join(names[run.id])}) is still {run.state}")
        for message in snapshot.messages:
            if message.role != "user":
                continue
            owner = owning_run(message.id, snapshot.runs)
            label = "+".join(KEY.findall(text_of(message))) or message.id
            if isinstance(owner, str):
                found.add("terminal-answered", f"{cid}: input {label} {owner}")
                continue
            if owner.terminal_reason == "absorbed":
                into = runs.get(owner.absorbed_into_run_id or "")
                if into is None or into.state != "completed":
                    state = into.terminal_reason if into else "missing"
                    found.add("terminal-answered", f"{cid}: input {label} was absorbed into a run that is {state}")


def owning_run(message_id: str, runs: Sequence[Any]) -> Any:
    """The run an input was admitted to, or why there is none. An absorbing run may list the inputs it
    absorbed beside their own (absorbed) run's listing: that is still one owner."""
    owners = [r for r in runs if message_id in r.input_message_ids]
    absorbed = [r for r in owners if r.terminal_reason == "absorbed"]
    if len(owners) == 2 and len(absorbed) == 1 and absorbed[0].absorbed_into_run_id in {r.id for r in owners}:
        return absorbed[0]
    return owners[0] if len(owners) == 1 else f"belongs to {len(owners)} runs"


def check_order(final: dict[str, ConversationSnapshot], found: Findings) -> None:
    """Runs started in durable order: execution sequences are unique, and a run admitted later started
    earlier only if it was urgent (``interrupt-next``) and the one it overtook ordinary."""
    for cid, snapshot in final.items():
        started = [r for r in snapshot.runs if r.execution_sequence is not None]
        sequences = [r.execution_sequence for r in started]
        if len(set(sequences)) != len(sequences):
            found.add("queue-order", f"{cid}: execution sequences repeat: {sorted(sequences)}")  # type: ignore[type-var]
        names = run_keys(snapshot)
        for a in started:
            for b in started:
                overtook = a.admission_sequence < b.admission_sequence and a.execution_sequence > b.execution_sequence  # type: ignore[operator]
                if overtook and not (b.priority == "urgent" and a.priority == "ordinary"):
                    found.add(
                        "queue-order",
                        f"{cid}: run {'+'.join(names[b.id])} ({b.priority}, admitted #{b.admission_sequence}) started "
                        f"#{b.execution_sequence}, before {'+'.join(names[a.id])} ({a.priority}, admitted "
                        f"#{a.admission_sequence}, started #{a.execution_sequence})",
                    )


def check_integrity(snaps: dict[str, ConversationSnapshot], when: str, found: Findings) -> None:
    """Settled positions unique; every terminal run that was not absorbed has its settled assistant; no
    message of an active run has a position."""
    for cid, snapshot in snaps.items():
        messages = {m.id: m for m in snapshot.messages}
        positions = [m.position for m in snapshot.messages if m.position is not None]
        if len(set(positions)) != len(positions):
            found.add("integrity", f"{when}: {cid}: settled positions repeat")
        if len(messages) != len(snapshot.messages):
            found.add("integrity", f"{when}: {cid}: message ids repeat")
        for run in snapshot.runs:
            answer = messages.get(run.assistant_message_id)
            if run.active:
                mine = [messages[m] for m in run.input_message_ids if m in messages] + ([answer] if answer else [])
                if any(m.position is not None for m in mine):
                    found.add("integrity", f"{when}: {cid}: a message of active run {run.id} has a position")
            elif run.terminal_reason != "absorbed" and (
                answer is None or answer.role != "assistant" or answer.run_id != run.id or answer.position is None
            ):
                found.add("integrity", f"{when}: {cid}: {run.terminal_reason} run {run.id} has no settled assistant")


KILLED_AT = re.compile(r"(before|mid|after):(accept|acquire|terminal):(\S+) (\S+)")


def check_kill_state(event: str, crashed: dict[str, ConversationSnapshot], found: Findings) -> None:
    """What the kill point implies about the state the process left: a mutation killed ``before`` it or
    ``mid`` its transaction never shows, one killed ``after`` it always does."""
    matched = KILLED_AT.match(event.split(" ", 1)[1] if event[:1].isdigit() else event)
    if matched is None or matched[3] not in crashed:
        return
    when, op, cid, detail = matched.groups()
    fields = dict(f.split("=", 1) for f in detail.split(";") if "=" in f)
    snapshot = crashed[cid]
    shows: bool | None = None
    if op == "accept":
        shows = any(m.role == "user" and fields.get("key") in KEY.findall(text_of(m)) for m in snapshot.messages)
    else:
        keys = fields.get("run", "?").split("+")
        runs = [r for r, named in run_keys(snapshot).items() if named == keys]
        state = {r.id: r for r in snapshot.runs}
        if len(runs) == 1:
            run = state[runs[0]]
            shows = run.terminal if op == "terminal" else run.state != "queued"
    if shows is not None and shows != (when == "after"):
        found.add("integrity", f"killed at {event}: the crash state {'shows' if shows else 'lacks'} it")


def check_sqlite_file(path: Path, found: Findings) -> None:
    conn = sqlite3.connect(path)
    try:
        result = [row[0] for row in conn.execute("PRAGMA integrity_check")]
    finally:
        conn.close()
    if result != ["ok"]:
        found.add("integrity", f"PRAGMA integrity_check: {'; '.join(result)[:300]}")


def classify_effects(lines: list[str], scenario: Scenario, final: dict[str, ConversationSnapshot]) -> dict[str, Any]:
    """Count applications per logical effect id and classify every extra one: ``requeue`` (a run that had
    applied it applied it again: a replay), ``inject`` (another run of the conversation: the run that took
    the injected input, then the input's own run) or ``other``."""
    applied: dict[str, list[tuple[str, str]]] = defaultdict(list)
    for line in lines:
        _cid, effect, run_id, _call, pid = line.split()
        applied[effect].append((run_id, pid))
    policy_of_run = {r.id: r.input_policy for s in final.values() for r in s.runs}
    runs_of: dict[str, list[str]] = defaultdict(list)  # an absorbing run may list the input too
    for snapshot in final.values():
        for run_id, keys in run_keys(snapshot).items():
            for key in keys:
                runs_of[key].append(run_id)
    extra: Counter[str] = Counter()
    others: list[str] = []
    for effect, appliers in applied.items():
        key = effect.rsplit(":", 1)[0]
        injected = scenario.by_key[key].policy == "inject" or any(policy_of_run[r] == "inject" for r in runs_of[key])
        for i, (run_id, pid) in enumerate(appliers[1:], 1):
            earlier = appliers[:i]
            if any(r == run_id and p != pid for r, p in earlier):
                extra["requeue"] += 1
            elif injected and all(r != run_id for r, _ in earlier):
                extra["inject"] += 1
            else:
                extra["other"] += 1
                others.append(f"{effect} applied again by run {run_id} (pid {pid}) after {earlier}")
    return {
        "effects_applied": len(lines),
        "effects_distinct": len(applied),
        "effects_extra": {k: extra[k] for k in ("requeue", "inject", "other")},
        "effects_other": others,
        "applied_ids": set(applied),
    }


def tool_results(final: dict[str, ConversationSnapshot], applied: set[str]) -> dict[str, int]:
    """Settled tool results without an applied effect (a success must come from an application) and
    step results the ledger found uncertain (an intent without proof: the effect may or may not be lost)."""
    missing = uncertain = 0
    for snapshot in final.values():
        for message in snapshot.messages:
            calls = {p.call_id: p.input for p in message.parts if p.type == "tool-call"}
            for part in message.parts:
                if part.type != "tool-result":
                    continue
                effect = (calls.get(part.call_id) or {}).get("effect")  # type: ignore[union-attr]
                if part.outcome == "success" and effect not in applied:
                    missing += 1
                if part.outcome == "error" and "STEP_UNCERTAIN" in json.dumps(part.output):
                    uncertain += 1
    return {"results_without_effect": missing, "step_uncertain": uncertain}


# ------------------------------------------------------------------------------------ the fork server


@dataclass
class Outcome:
    """How a forked process ended: ``exit`` code (``-9``: SIGKILL, ``None``: timed out), its report and
    the last event of its trace."""

    exit: int | None
    report: dict[str, Any] | None
    last: str
    stderr: str
    seconds: float

    @property
    def killed(self) -> bool:
        return self.exit == -signal.SIGKILL and self.last.startswith("KILL")


def fork_run(work: Callable[[], Any], workdir: Path, name: str, trace: str, timeout: float) -> Outcome:
    """Run ``work`` (a coroutine function) in a forked child with its own stdio files and event loop; the
    child writes its report to ``<name>.json``."""
    if threading.active_count() != 1:
        raise RuntimeError("the fork server must stay single-threaded")
    started = time.monotonic()
    pid = os.fork()
    if pid == 0:
        _forked(work, workdir, name)
    code = _wait(pid, timeout)
    seconds = round(time.monotonic() - started, 3)
    report_path = workdir / f"{name}.json"
    report = json.loads(report_path.read_text()) if report_path.exists() else None
    lines = read_lines(workdir / trace)
    stderr = workdir / f"{name}.stderr"
    return Outcome(
        code, report, lines[-1] if lines else "", stderr.read_text()[-1500:] if stderr.exists() else "", seconds
    )


def _forked(work: Callable[[], Any], workdir: Path, name: str) -> None:
    code = EXIT_FAILED
    try:
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        for fd, suffix in ((1, "stdout"), (2, "stderr")):
            out = os.open(workdir / f"{name}.{suffix}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(out, fd)
        sys.stdout = open(1, "w", closefd=False)  # noqa: SIM115
        sys.stderr = open(2, "w", closefd=False)  # noqa: SIM115
        report = asyncio.run(work())
        (workdir / f"{name}.json").write_text(json.dumps(report))
        code = 0
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _wait(pid: int, timeout: float) -> int | None:
    """The child's exit code, or None after SIGKILLing it at ``timeout``."""
    fd = os.pidfd_open(pid)
    try:
        ready, _, _ = select.select([fd], [], [], timeout)
    finally:
        os.close(fd)
    if not ready:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        return None
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def run_point(job: dict[str, Any]) -> dict[str, Any]:
    """One kill point: reference run, kill run, maybe a second process, then the checker."""
    started = time.monotonic()
    seed, point = job["seed"], job["point"]
    rng = random.Random(seed + point)
    scenario = make_scenario(rng)
    root = Path(job["root"]) / f"p{point}"
    base = Spec(job["store"], job["tool"], "", job.get("dsn", ""), "", job.get("keep", False))
    ref = _spec(base, root / "ref", f"{job['tag']}_{point}_ref")
    kill = _spec(base, root / "kill", f"{job['tag']}_{point}_kill")
    result: dict[str, Any] = {"seed": seed, "point": point, "violations": [], "notes": [], "figures": {}}
    result["scenario"] = {"coalesce": scenario.coalesce, "inputs": [asdict(i) for i in scenario.inputs]}
    try:
        _run_phases(rng, scenario, ref, kill, result)
    except Exception:
        result["violations"].append({"invariant": "harness", "reason": traceback.format_exc(limit=3)[-600:]})
    finally:
        if not base.keep:
            shutil.rmtree(root, ignore_errors=True)
    result["seconds"] = round(time.monotonic() - started, 3)
    return result


def _spec(base: Spec, workdir: Path, schema: str) -> Spec:
    workdir.mkdir(parents=True, exist_ok=True)
    return replace(base, workdir=str(workdir), schema=schema)


def _run_phases(rng: random.Random, scenario: Scenario, ref: Spec, kill: Spec, result: dict[str, Any]) -> None:
    violations = result["violations"]
    reference = fork_run(
        lambda: _with_drop(ref, run_child(ref, scenario, None)), ref.path, "child", "trace.log", CHILD_TIMEOUT
    )
    if reference.report is None:
        violations.append(_harness("the reference run", reference))
        return
    violations += [{"invariant": "live-runtime", "reason": f"reference run: {r}"} for r in reference.report["live"]]
    plan = plan_point(rng, read_events(ref.path / "trace.log"), reference.report["reopen_events"])
    result["plan"] = asdict(plan)
    result["reference"] = {"events": reference.report["events"], "seconds": reference.seconds}
    first = fork_run(lambda: run_child(kill, scenario, plan.first), kill.path, "child", "trace.log", CHILD_TIMEOUT)
    result["first"] = _summary(first, violations, "kill run")
    if plan.second_policy is not None:
        policy = plan.second_policy
        second = fork_run(
            lambda: recover_child(kill, scenario, plan.second, policy),
            kill.path,
            "recoverer",
            "trace2.log",
            CHILD_TIMEOUT,
        )
        result["second"] = _summary(second, violations, "second process")
    killed_at = result["first"].get("event") if plan.second_policy is None else None
    checked = fork_run(
        lambda: check_point(kill, scenario, plan.parent_policy, killed_at), kill.path, "check", "none", CHECK_TIMEOUT
    )
    if checked.report is None:
        violations.append(_harness("the checker", checked))
        return
    result["check_seconds"] = checked.seconds
    violations += checked.report["violations"]
    result["notes"] += checked.report["notes"]
    result["figures"] = checked.report["figures"]


async def _with_drop(spec: Spec, work: Any) -> Any:
    report = await work
    drop_schema(spec)
    return report


def _summary(outcome: Outcome, violations: list[dict[str, str]], what: str) -> dict[str, Any]:
    if outcome.killed:
        return {"status": "killed", "event": outcome.last.split(" ", 1)[1], "seconds": outcome.seconds}
    if outcome.report is None:
        violations.append(_harness(what, outcome))
        return {"status": "failed" if outcome.exit is not None else "hang"}
    violations.extend(
        {"invariant": "live-runtime", "reason": f"{what} (DONE): {r}"} for r in outcome.report.get("live", [])
    )
    return {"status": "finished", "events": outcome.report["events"], "seconds": outcome.seconds}


def _harness(what: str, outcome: Outcome) -> dict[str, str]:
    if outcome.exit is None:
        return {"invariant": "hang", "reason": f"{what} did not end within its timeout; last event {outcome.last!r}"}
    tail = outcome.stderr.strip().splitlines()[-1:] or [""]
    return {"invariant": "harness", "reason": f"{what} exited {outcome.exit}: {tail[0][:300]}"}


def warm_up(store: str, tool: str, dsn: str, tag: str) -> None:
    """Run a small scenario here, in the server, before the first fork: a forked child then inherits the
    lazily imported modules and every first-call cache instead of paying for them (about 0.25 s of a
    0.35 s child). The store's threads end with it; the server must be single-threaded again. Then
    ``gc.freeze()``: the collector no longer walks (and so copies) the inherited heap in every child."""
    root = Path(tempfile.mkdtemp(prefix="crashfuzz-warm-"))
    spec = Spec(store, tool, str(root), dsn, f"{tag}_warm_{os.getpid()}")  # one schema per server
    inputs = (Input("c1-k0", "c1", "queue", 1, 2, "delta", 0), Input("c1-k1", "c1", "inject", 0, 2, "delta", 1))
    try:
        asyncio.run(bounded(_with_drop(spec, run_child(spec, Scenario(inputs, True), None)), CHILD_TIMEOUT))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    deadline = time.monotonic() + 10
    while threading.active_count() > 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    if threading.active_count() > 1:
        raise RuntimeError(f"threads left after the warm-up: {[t.name for t in threading.enumerate()]}")
    gc.freeze()


def serve() -> int:
    print(json.dumps({"threadline": threadline.__file__, "pid": os.getpid()}), flush=True)
    warmed = False
    for line in sys.stdin:
        if not line.strip():
            continue
        job = json.loads(line)
        if not warmed:
            warm_up(job["store"], job["tool"], job.get("dsn", ""), job["tag"])
            warmed = True
        print(json.dumps(run_point(job)), flush=True)
    return 0


if __name__ == "__main__":
    if sys.argv[1:] != ["--serve"]:
        sys.exit("usage: _crashfuzz_child.py --serve (run by bench/crashfuzz.py)")
    sys.exit(serve())
