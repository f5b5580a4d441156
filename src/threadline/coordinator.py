"""Process-local lanes: one per conversation, running its queued runs one at a time in durable order.

A lane releases a run only after its terminal committed, so a successor never starts while its
predecessor still owns managed callbacks; a hung predecessor blocks its lane (by design). Input policies
act on the lane's executing run: ``interrupt``/``interrupt-next`` abort it as ``interrupted``,
``supersede`` as ``superseded``, ``inject`` offers the new input's queued run to join at the next step
boundary, ``queue`` leaves it alone.
"""

from __future__ import annotations

import asyncio
import enum
import logging
from collections.abc import Awaitable, Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from .errors import AgentConversationPurgedError, AgentRunOwnershipConflictError, AgentRunUnsettledError
from .loop import RunControl
from .records import INPUT_POLICIES as INPUT_POLICIES, Message, Run
from .store.aggregate import AgentRuntimeStore

T = TypeVar("T")

_ABORT_REASON = {"interrupt": "interrupted", "interrupt-next": "interrupted", "supersede": "superseded"}
MAX_REFUSALS = 64
"""Acquisitions of one run the store may refuse in a row (each refusal means another write moved the
conversation) before the lane gives up on it and says so, rather than spinning."""
_log = logging.getLogger("threadline.runtime")


class LaneHost(Protocol):
    """What a lane needs from the runtime that owns it (:class:`threadline.runtime.AgentRuntime`). The
    runtime stands on the lanes, never the other way round: this is the seam between the two."""

    store: AgentRuntimeStore
    closing: bool
    waiters: Waiters

    async def execute(self, lane: Lane, run: Run, context: Any) -> Step: ...

    async def retry_store(self, call: Callable[[], Awaitable[T]]) -> T: ...

    async def resolve_context_of(self, run: Run) -> tuple[bool, Any]: ...

    def result_from(self, run: Run, assistant: Message | None) -> Any: ...


class Step(enum.Enum):
    """What a lane does after :meth:`AgentRuntime.execute` handled one run."""

    DONE = "done"
    """The run ended or its ticket was settled: go on with the next one."""
    REFUSED = "refused"
    """The store refused the acquisition (the conversation moved): read the stored runs and look again."""
    STOP = "stop"
    """The run could not be settled: later runs wait behind it, and their tickets say so."""
    GONE = "gone"
    """The conversation was purged: nothing else here can run."""
    CLOSED = "closed"
    """The runtime is closing: queued runs stay queued for ``recover()``."""


@dataclass
class Lane:
    """The process-local execution lane of one conversation."""

    runtime: LaneHost
    conversation_id: str
    control: RunControl | None = None
    contexts: dict[str, Any] = field(default_factory=dict)
    admitted: dict[str, Run] = field(default_factory=dict)
    """The run records this process's admissions returned, newest per run: a hint, never authority."""
    task: asyncio.Task[None] | None = None
    blocked_on: str | None = None
    started: dict[str, tuple[Run, int, Any]] = field(default_factory=dict)
    """Runs this process's admissions acquired in the same commit (run, version, the first request's
    operation): they are executed without an acquisition."""
    successor: bool = False
    """This runtime committed a terminal here: it starts the next queued run too, whoever admitted it."""

    @property
    def busy(self) -> bool:
        return self.task is not None and not self.task.done()

    def wake(self) -> None:
        """Make sure the lane worker runs (it exits when nothing it can run is queued). A run an admission
        started is executed even while the runtime closes (it then ends at once)."""
        if not self.busy and (not self.runtime.closing or self.started):
            self.task = asyncio.get_running_loop().create_task(
                self._work(), name=f"threadline-lane-{self.conversation_id}"
            )

    def apply_policy(self, policy: str, run_id: str) -> None:
        """Apply an admitted input's policy to the run this lane is executing (if any)."""
        control = self.control
        if control is None or control.run_id == run_id:
            return
        if policy == "inject":
            control.offer_injection(run_id)
        elif policy in _ABORT_REASON:
            control.abort(_ABORT_REASON[policy])

    async def _settle_ended(self, active: Sequence[Run]) -> None:
        """Runs this lane was asked to run that ended elsewhere (another process, a recovery pass): their
        waiters settle from the canonical record instead of waiting for ever."""
        still = {run.id for run in active}
        for run_id in [r for r in self.contexts if r not in still]:
            self.contexts.pop(run_id, None)
            loaded = await self.runtime.retry_store(
                lambda run_id=run_id: self.runtime.store.load_run(conversation_id=self.conversation_id, run_id=run_id)
            )
            if loaded is not None and loaded.run.terminal:
                self.runtime.waiters.resolve(run_id, self.runtime.result_from(loaded.run, loaded.assistant))

    async def _work(self) -> None:
        try:
            await self._run_queue()
        except Exception as error:  # a defect: never leave a ticket waiting for ever
            for run_id in list(self.contexts):
                self.runtime.waiters.reject(run_id, error)
            self.contexts.clear()
            raise
        finally:
            for run_id in [r for r in self.admitted if r not in self.contexts]:
                del self.admitted[run_id]

    def _sole_admitted(self) -> Run | None:
        """The one queued run this lane was asked to run, as its admission returned it, when that is all
        the lane knows of. Acquiring it checks durable order and revision anyway; if another run goes
        first or it changed since, the acquisition is refused and the lane reads the active runs."""
        if len(self.contexts) != 1:
            return None
        (run_id,) = self.contexts
        run = self.admitted.get(run_id)
        return run if run is not None and (run.state == "queued" or run_id in self.started) else None

    async def _run_queue(self) -> None:
        runtime = self.runtime
        hint = self._sole_admitted()
        refused: tuple[str, int] = ("", 0)  # (run, refusals in a row)
        while (self.contexts or self.successor) and (not runtime.closing or self.started):
            if hint is not None:
                # the common case: one input, nothing ahead of it here; skip the read of the active runs
                head, hint = hint, None
            else:
                found = await self._stored_head()
                if found is None:
                    return
                head = found
            self.admitted.pop(head.id, None)
            step = await runtime.execute(self, head, self.contexts[head.id])
            if step is Step.REFUSED:
                # every refusal is the store saying the conversation moved: look at the stored runs again
                count = refused[1] + 1 if refused[0] == head.id else 1
                refused = (head.id, count)
                if count < MAX_REFUSALS:
                    continue
                _log.warning("run %s: the store refused its acquisition %d times in a row", head.id, count)
                self._strand(head, gone=False)  # its own tickets too: nothing settled them
                return
            self.contexts.pop(head.id, None)
            if step is Step.CLOSED:
                return
            if step is not Step.DONE:
                self._strand(head, gone=step is Step.GONE)
                return

    def _strand(self, head: Run, *, gone: bool) -> None:
        """The lane cannot go on behind ``head``: settle the tickets of what it was asked to run here."""
        runtime = self.runtime
        for run_id in list(self.contexts):
            self.contexts.pop(run_id, None)
            if gone:
                runtime.waiters.reject(run_id, AgentConversationPurgedError(self.conversation_id))
                continue
            why = (
                "the store kept refusing its acquisition"
                if run_id == head.id
                else f"it is queued behind run {head.id}, which could not be settled here"
            )
            runtime.waiters.reject(
                run_id,
                AgentRunUnsettledError(
                    f"run {run_id} did not run: {why}; recover() or resume() runs it",
                    run=self.admitted.get(run_id, head),
                    owner_id=None,
                ),
            )

    async def _stored_head(self) -> Run | None:
        """The first active run in durable order, if this lane may run it now; otherwise None, with the
        tickets that cannot run here now settled."""
        runtime = self.runtime
        active = await runtime.retry_store(lambda: runtime.store.list_active_runs(conversation_id=self.conversation_id))
        await self._settle_ended(active.runs)
        successor, self.successor = self.successor, False
        if not active.runs:
            return None
        head = active.runs[0]
        if head.id in self.started:  # acquired by this process's own admission: run it
            self.blocked_on = None
            return head
        if successor and head.state == "queued" and head.id not in self.contexts:
            # queued behind the run this runtime just ended, admitted elsewhere: run it here if its context
            # can be resolved (its admitter's lane saw the run ahead held by this runtime and let it be)
            resolved, context = await runtime.resolve_context_of(head)
            if resolved:
                self.contexts[head.id] = context
                self.blocked_on = None
                return head
        if head.acquired or head.id not in self.contexts:
            # another executor holds it, or an orphan from an earlier process: recovery decides.
            # Inputs waiting behind it cannot run here now; their tickets say so.
            self.blocked_on = head.id
            if head.acquired and head.id in self.contexts:
                # another executor acquired the run this process meant to run (e.g. a concurrent
                # recovery pass elsewhere): the record is that executor's now
                self.contexts.pop(head.id, None)
                runtime.waiters.reject(
                    head.id,
                    AgentRunOwnershipConflictError(
                        f"run {head.id} was acquired by {head.owner_id}",
                        conversation_id=self.conversation_id,
                        run_id=head.id,
                        actual_revision=head.revision,
                        run=head,
                    ),
                )
            for run in active.runs[1:]:
                if run.id in self.contexts:
                    runtime.waiters.reject(
                        run.id,
                        AgentRunUnsettledError(
                            f"run {run.id} is queued behind run {head.id} ({head.state}, owner {head.owner_id}); "
                            "recover() or resume() runs it once that run has ended",
                            run=run,
                            owner_id=None,
                        ),
                    )
            return None
        self.blocked_on = None
        return head


@dataclass
class Waiters:
    """Futures waiting for runs: ``result`` per run id, ``acquired`` per run id."""

    results: dict[str, list[asyncio.Future[Any]]] = field(default_factory=dict)
    acquired: dict[str, list[asyncio.Future[Any]]] = field(default_factory=dict)

    def add_result(self, run_id: str, future: asyncio.Future[Any]) -> None:
        self.results.setdefault(run_id, []).append(future)

    def add_acquired(self, run_id: str, future: asyncio.Future[Any]) -> None:
        self.acquired.setdefault(run_id, []).append(future)

    @staticmethod
    def _settle(futures: list[asyncio.Future[Any]], value: Any = None, error: BaseException | None = None) -> None:
        for future in futures:
            if future.done():
                continue
            if error is not None:
                future.set_exception(error)
            else:
                future.set_result(value)

    def waiting(self, run_id: str) -> bool:
        """Whether anything still waits for this run's result."""
        return run_id in self.results

    def resolve(self, run_id: str, value: Any) -> None:
        self._settle(self.results.pop(run_id, []), value)
        self._settle(self.acquired.pop(run_id, []), error=RuntimeError(f"run {run_id} ended before it was acquired"))

    def reject(self, run_id: str, error: BaseException) -> None:
        self._settle(self.results.pop(run_id, []), error=error)
        self._settle(self.acquired.pop(run_id, []), error=error)

    def mark_acquired(self, run_id: str, value: Any) -> None:
        self._settle(self.acquired.pop(run_id, []), value)

    def reject_all(self, error_for: Callable[[str], BaseException], keep: Collection[str] = ()) -> None:
        for run_id in {*self.results, *self.acquired} - set(keep):
            self.reject(run_id, error_for(run_id))


def quiet(future: asyncio.Future[Any]) -> asyncio.Future[Any]:
    """Mark a future's exception retrieved, so an unawaited ticket field never logs a warning."""
    future.add_done_callback(_retrieve)
    return future


def _retrieve(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()


async def call_maybe_async(fn: Callable[..., Any], *args: Any) -> Any:
    value = fn(*args)
    if isinstance(value, Awaitable):
        value = await value
    return value
