"""The conformance kit: the case registry, the runner and the helpers every case uses (both the store's
cases in :mod:`threadline.store.conformance` and the ledger's in :mod:`threadline.store.conformance_ledger`)."""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import traceback
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, TypeAlias, TypeVar

from ..records import ConversationSnapshot, Message, Run
from .aggregate import AgentRuntimeStore
from .results import AcceptResult, TerminalResult

StoreFactory: TypeAlias = Callable[[], contextlib.AbstractAsyncContextManager[AgentRuntimeStore]]
"""Each call yields a fresh, empty store (closed when the context exits)."""

ConformanceCase: TypeAlias = Callable[[AgentRuntimeStore], Awaitable[None]]
"""One contract check: raises :class:`AssertionError` on a violation."""

CONFORMANCE_CASES: dict[str, ConformanceCase] = {}
"""Every case by name, in the order the suite runs them."""

_T0 = datetime(2030, 1, 1, tzinfo=UTC)
_FIRST_REQUEST = {
    "kind": "model-request",
    "phase": "started",
    "operation_id": "op-first",
    "step": 0,
    "attempt": 1,
    "started_at": _T0,
}
"""Step 0's ``model-request`` admission, as a caller passes it with an acquisition."""
"""A fixed timestamp for operation records and leases."""

E = TypeVar("E", bound=BaseException)
C = TypeVar("C", bound=ConformanceCase)


def _case(name: str) -> Callable[[C], C]:
    def register(fn: C) -> C:
        if name in CONFORMANCE_CASES:  # pragma: no cover - a programming error in this module
            raise RuntimeError(f"duplicate conformance case {name!r}")
        CONFORMANCE_CASES[name] = fn
        return fn

    return register


# ---------------------------------------------------------------------------------------------- report


@dataclass(frozen=True)
class ConformanceFailure:
    """One failed case: its name, the exception it raised and the formatted traceback. When the store's
    clean-up (leaving the factory's context) failed too, ``error`` is still the case's own failure and
    ``cleanup_error`` / ``cleanup_traceback`` hold the clean-up's; a case that passed but whose clean-up
    failed reports the clean-up error as ``error``."""

    name: str
    error: BaseException
    traceback: str
    cleanup_error: BaseException | None = None
    cleanup_traceback: str | None = None

    def __str__(self) -> str:
        text = f"{self.name}: {type(self.error).__name__}: {self.error}"
        if self.cleanup_error is not None:
            text += f" (and the clean-up failed: {type(self.cleanup_error).__name__}: {self.cleanup_error})"
        return text


@dataclass
class ConformanceReport:
    """What a conformance run found: the names that passed and the failures, in run order."""

    passed: list[str] = field(default_factory=list)
    failures: list[ConformanceFailure] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.failures

    @property
    def failed(self) -> list[str]:
        return [f.name for f in self.failures]

    def summary(self) -> str:
        total = len(self.passed) + len(self.failures)
        lines = [f"store conformance: {len(self.passed)} of {total} cases passed"]
        lines += [f"  FAILED {failure}" for failure in self.failures]
        return "\n".join(lines)

    def details(self) -> str:
        """The summary followed by every failure's traceback."""
        parts = [self.summary()]
        for failure in self.failures:
            parts.append(f"\n---- {failure.name} ----\n{failure.traceback}")
            if failure.cleanup_traceback is not None:
                parts.append(f"---- {failure.name}: clean-up ----\n{failure.cleanup_traceback}")
        return "\n".join(parts)


class AgentStoreConformanceError(AssertionError):
    """Raised by :func:`run_agent_store_conformance` when a case failed; ``report`` holds every result."""

    def __init__(self, report: ConformanceReport) -> None:
        super().__init__(report.details())
        self.report = report


async def run_agent_store_conformance(factory: StoreFactory, *, only: Iterable[str] | None = None) -> ConformanceReport:
    """Run every case (or those named in ``only``), each on its own fresh store from ``factory``.

    Returns the report when every case passed; otherwise raises :class:`AgentStoreConformanceError` (an
    :class:`AssertionError`) whose message names each failing case with its traceback and whose ``report``
    attribute is the full report. ``only`` naming an unknown case raises :class:`ValueError`.

    Cancellation: cancelling the caller cancels the running case and propagates; no report is returned.
    """
    names = list(CONFORMANCE_CASES) if only is None else list(dict.fromkeys(only))
    unknown = [n for n in names if n not in CONFORMANCE_CASES]
    if unknown:
        raise ValueError(f"unknown conformance cases {unknown}; known: {sorted(CONFORMANCE_CASES)}")
    report = ConformanceReport()
    for name in names:
        failure = await _run_case(name, factory)
        if failure is None:
            report.passed.append(name)
        else:
            report.failures.append(failure)
    if report.failures:
        raise AgentStoreConformanceError(report)
    return report


async def _run_case(name: str, factory: StoreFactory) -> ConformanceFailure | None:
    """One case on a fresh store. The case's own failure is what the report names first: a clean-up that
    fails after it is attached, never in its place (``async with`` would report the clean-up instead)."""
    try:
        manager = factory()
        store = await manager.__aenter__()
    except Exception as error:
        return ConformanceFailure(name, error, traceback.format_exc())
    failure: ConformanceFailure | None = None
    case = CONFORMANCE_CASES[name]
    try:
        if len(inspect.signature(case).parameters) == 2:  # a case that needs a second, empty store
            await case(store, factory)  # type: ignore[call-arg]
        else:
            await case(store)
    except Exception as error:
        failure = ConformanceFailure(name, error, traceback.format_exc())
    try:
        await manager.__aexit__(None, None, None)
    except Exception as error:
        if failure is None:
            return ConformanceFailure(name, error, traceback.format_exc())
        failure = dataclasses.replace(failure, cleanup_error=error, cleanup_traceback=traceback.format_exc())
    return failure


# --------------------------------------------------------------------------------------------- helpers


def _expect(condition: object, message: str) -> None:
    if not condition:
        raise AssertionError(message)


def _equal(actual: object, expected: object, what: str) -> None:
    if actual != expected:
        raise AssertionError(f"{what}: expected {expected!r}, got {actual!r}")


def _text(text: str) -> list[dict[str, Any]]:
    return [{"type": "text", "text": text}]


def _texts(message: Message | None) -> str:
    if message is None:
        return "<no message>"
    return "".join(getattr(p, "text", "") for p in message.parts)


async def _raises(error: type[E], what: str, fn: Callable[..., Awaitable[Any]], /, *args: Any, **kwargs: Any) -> E:
    """``fn(*args, **kwargs)`` raises ``error`` (or a subclass)."""
    try:
        result = await fn(*args, **kwargs)
    except error as caught:
        return caught
    except Exception as other:
        raise AssertionError(f"{what}: expected {error.__name__}, got {type(other).__name__}: {other}") from other
    raise AssertionError(f"{what}: expected {error.__name__}, but the call returned {result!r}")


async def _snapshots(store: AgentRuntimeStore, cids: Sequence[str]) -> list[ConversationSnapshot]:
    return [await store.load_snapshot(conversation_id=cid) for cid in cids]


async def _refused(
    store: AgentRuntimeStore,
    cids: str | Sequence[str],
    error: type[E],
    what: str,
    fn: Callable[..., Awaitable[Any]],
    /,
    *args: Any,
    **kwargs: Any,
) -> E:
    """``fn(*args, **kwargs)`` raises ``error`` and writes nothing to the conversations ``cids``."""
    cids = [cids] if isinstance(cids, str) else list(cids)
    before = await _snapshots(store, cids)
    caught = await _raises(error, what, fn, *args, **kwargs)
    after = await _snapshots(store, cids)
    for b, a in zip(before, after, strict=True):
        _expect(a == b, f"{what}: the refused call wrote to {b.conversation_id!r} (version {b.version} -> {a.version})")
    return caught


async def _writes_nothing(
    store: AgentRuntimeStore, cid: str, what: str, fn: Callable[..., Awaitable[Any]], /, *args: Any, **kwargs: Any
) -> Any:
    """``fn(*args, **kwargs)`` returns without changing the conversation ``cid``."""
    before = await store.load_snapshot(conversation_id=cid)
    result = await fn(*args, **kwargs)
    after = await store.load_snapshot(conversation_id=cid)
    _expect(after == before, f"{what}: the call wrote (version {before.version} -> {after.version})")
    return result


class _Conv:
    """One conversation of a case, with ids derived from short names: ``t1`` -> ``<cid>:t1:in`` etc."""

    def __init__(self, store: AgentRuntimeStore, cid: str) -> None:
        self.store = store
        self.cid = cid

    # ids
    def key(self, n: str) -> str:
        return f"{self.cid}:{n}:key"

    def inp(self, n: str) -> str:
        return f"{self.cid}:{n}:in"

    def run(self, n: str) -> str:
        return f"{self.cid}:{n}:run"

    def out(self, n: str) -> str:
        return f"{self.cid}:{n}:out"

    def mid(self, n: str) -> str:
        return f"{self.cid}:{n}"

    def short(self, message_id: str) -> str:
        return message_id.removeprefix(f"{self.cid}:")

    def draft(self, n: str, text: str | None = None) -> dict[str, Any]:
        return {"id": self.inp(n), "role": "user", "parts": _text(text if text is not None else f"input {n}")}

    # reads
    async def version(self) -> int:
        return (await self.store.list_active_runs(conversation_id=self.cid)).version

    async def snapshot(self) -> ConversationSnapshot:
        return await self.store.load_snapshot(conversation_id=self.cid)

    async def order(self) -> list[str]:
        return [self.short(m.id) for m in (await self.snapshot()).messages]

    async def active(self) -> list[str]:
        return [r.id for r in (await self.store.list_active_runs(conversation_id=self.cid)).runs]

    async def load(self, run_id: str) -> Run:
        loaded = await self.store.load_run(conversation_id=self.cid, run_id=run_id)
        _expect(loaded is not None, f"load_run({run_id!r}) found nothing")
        assert loaded is not None
        return loaded.run

    # mutations
    async def admit(
        self, n: str, *, text: str | None = None, input: dict[str, Any] | None = None, **kwargs: Any
    ) -> AcceptResult:
        """Admit turn ``n``: its input is :meth:`draft` (``input`` replaces or adds fields of it)."""
        kwargs.setdefault("run_id", self.run(n))
        kwargs.setdefault("assistant_message_id", self.out(n))
        return await self.store.accept_input_and_assign_run(
            conversation_id=self.cid,
            idempotency_key=self.key(n),
            input={**self.draft(n, text), **(input or {})},
            **kwargs,
        )

    async def acquire(self, run: Run, owner: str = "owner-a") -> Run:
        result = await self.store.acquire_run(
            conversation_id=self.cid, run_id=run.id, expected_revision=run.revision, owner_id=owner
        )
        return result.run

    async def checkpoint(self, run: Run, text: str) -> Run:
        result = await self.store.checkpoint_run_assistant(
            conversation_id=self.cid,
            run_id=run.id,
            expected_revision=run.revision,
            owner_id=run.owner_id or "",
            fencing_token=run.fencing_token,
            parts=_text(text),
        )
        return result.run

    async def finish(self, run: Run, reason: str = "success", text: str | None = None, **kwargs: Any) -> TerminalResult:
        """Commit ``run``'s terminal as its owner: ``text`` as one text part, or ``parts=`` as given."""
        parts = kwargs.pop("parts", _text(text) if text is not None else None)
        return await self.store.commit_run_terminal(
            conversation_id=self.cid,
            run_id=run.id,
            expected_revision=run.revision,
            owner_id=run.owner_id or "",
            fencing_token=run.fencing_token,
            terminal_reason=reason,
            parts=parts,
            **kwargs,
        )

    async def requeue(self, run: Run) -> Run:
        result = await self.store.recover_run(
            conversation_id=self.cid, run_id=run.id, expected_revision=run.revision, action="requeue", replay_safe=True
        )
        return result.run

    async def turn(self, n: str) -> TerminalResult:
        """Admit, acquire, checkpoint and complete one turn ``n``."""
        run = await self.acquire((await self.admit(n)).run)
        run = await self.checkpoint(run, f"draft {n}")
        result = await self.finish(run, text=f"answer {n}")
        _equal(result.outcome, "committed", f"terminal of turn {n}")
        return result

    async def compact(self, names: Sequence[str], summary: str) -> Any:
        return await self.store.replace_compacted_range(
            conversation_id=self.cid,
            expected_version=await self.version(),
            replaced_message_ids=[self.mid(n) for n in names],
            summary={"id": self.mid(summary), "role": "summary", "parts": _text(f"summary {summary}")},
        )
