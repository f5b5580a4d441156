"""Every store driver passes the same contract suite (DESIGN §4, §6).

Each conformance case is its own test item per driver (``test_case[memory-duplicate_admission]``), so a
failure names the driver and the contract. ``run_agent_store_conformance`` itself is checked end to end
on the memory driver, and against a deliberately broken driver to show the suite catches it.
"""

from __future__ import annotations

import inspect
import itertools
import uuid
from collections.abc import AsyncIterator, Callable, Generator
from contextlib import asynccontextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from threadline.errors import ThreadlineError
from threadline.store import (
    AgentRuntimeStore,
    MemoryStoreDriver,
    create_agent_runtime_store,
    create_memory_agent_runtime_store,
)
from threadline.store.conformance import (
    CONFORMANCE_CASES,
    AgentStoreConformanceError,
    StoreFactory,
    run_agent_store_conformance,
)
from threadline.store.driver import Access, Operation, OperationStats, Write


@asynccontextmanager
async def memory_store() -> AsyncIterator[AgentRuntimeStore]:
    store = create_memory_agent_runtime_store()
    try:
        yield store
    finally:
        await store.aclose()


def sqlite_factory(tmp_path: Path) -> StoreFactory:
    """A factory of fresh SQLite stores, one database file per call."""
    try:
        from threadline.store.sqlite import create_sqlite_agent_runtime_store
    except ModuleNotFoundError as error:
        if error.name != "threadline.store.sqlite":
            raise
        pytest.skip("threadline.store.sqlite is not available yet")
    counter = itertools.count()

    @asynccontextmanager
    async def factory() -> AsyncIterator[AgentRuntimeStore]:
        handle: Any = create_sqlite_agent_runtime_store(filename=tmp_path / f"store-{next(counter)}.db")
        if inspect.isawaitable(handle) and not hasattr(handle, "__aenter__"):
            handle = await handle
        async with handle as entered:
            target = entered if entered is not None else handle
            yield target if isinstance(target, AgentRuntimeStore) else target.store

    return factory


def postgres_factory(dsn: str) -> StoreFactory:
    """A factory of fresh PostgreSQL stores: each call gets its own schema, dropped when it closes."""
    import psycopg

    from threadline.store.postgres import create_postgres_agent_runtime_store

    @asynccontextmanager
    async def factory() -> AsyncIterator[AgentRuntimeStore]:
        schema = f"threadline_test_{uuid.uuid4().hex}"
        try:
            async with create_postgres_agent_runtime_store(dsn, schema=schema, max_size=4) as pg:
                yield pg.store
        finally:
            async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
                await conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')

    return factory


@pytest.fixture(params=["memory", "sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def store_factory(request: pytest.FixtureRequest, tmp_path: Path) -> StoreFactory:
    if request.param == "memory":
        return memory_store
    if request.param == "postgres":
        return postgres_factory(request.getfixturevalue("postgres_dsn"))
    return sqlite_factory(tmp_path)


@pytest.mark.parametrize("case_name", list(CONFORMANCE_CASES))
async def test_case(store_factory: StoreFactory, case_name: str) -> None:
    case = CONFORMANCE_CASES[case_name]
    async with store_factory() as store:
        if len(inspect.signature(case).parameters) == 2:  # it needs a second, empty store
            await case(store, store_factory)  # type: ignore[call-arg]
        else:
            await case(store)  # type: ignore[call-arg]


def test_every_case_names_its_contract() -> None:
    for name, case in CONFORMANCE_CASES.items():
        assert case.__doc__ and len(case.__doc__.split()) >= 10, f"case {name!r} has no contract docstring"


async def test_run_agent_store_conformance_on_memory() -> None:
    report = await run_agent_store_conformance(memory_store)
    assert report.ok
    assert report.passed == list(CONFORMANCE_CASES)
    assert report.failures == []


async def test_only_selects_cases_and_rejects_unknown_names() -> None:
    report = await run_agent_store_conformance(memory_store, only=["duplicate_admission", "terminal_race"])
    assert report.passed == ["duplicate_admission", "terminal_race"]
    with pytest.raises(ValueError, match="no_such_case"):
        await run_agent_store_conformance(memory_store, only=["no_such_case"])


def _drop_run_updates(operation: Operation[Any], known: set[tuple[str, str]]) -> Generator[Any, Any, Any]:
    """Pass every request through, but strip rows of runs already written once: new runs are stored,
    later transitions of them (acquire, checkpoint, terminal, ...) are silently lost."""
    answer: Any = None
    try:
        while True:
            request = operation.send(answer)
            if isinstance(request, Write):
                runs = tuple(r for r in request.mutation.runs if (r.conversation_id, r.id) not in known)
                known.update((r.conversation_id, r.id) for r in runs)
                request = Write(replace(request.mutation, runs=runs))
            answer = yield request
    except StopIteration as done:
        return done.value


class RunUpdateDroppingDriver(MemoryStoreDriver):
    """A broken memory driver whose writes store new runs but silently drop updates to existing ones."""

    def __init__(self) -> None:
        super().__init__()
        self._known: set[tuple[str, str]] = set()

    async def run(self, operation: Callable[[], Operation[Any]], *, access: Access, stats: OperationStats) -> Any:
        return await super().run(lambda: _drop_run_updates(operation(), self._known), access=access, stats=stats)


@asynccontextmanager
async def broken_store() -> AsyncIterator[AgentRuntimeStore]:
    store = create_agent_runtime_store(RunUpdateDroppingDriver())
    try:
        yield store
    finally:
        await store.aclose()


async def test_a_driver_that_drops_run_updates_fails() -> None:
    with pytest.raises(AgentStoreConformanceError) as caught:
        await run_agent_store_conformance(broken_store)
    report = caught.value.report
    assert isinstance(caught.value, AssertionError)
    assert not report.ok
    must_catch = ("coalesced_admission", "stale_checkpoint", "terminal_race", "interrupt_then_terminal", "absorption")
    for name in must_catch:
        assert name in report.failed, f"{name} should catch a driver that drops run updates"
        failure = next(f for f in report.failures if f.name == name)
        # a contract violation or a typed store error, never a wiring error such as a TypeError
        assert isinstance(failure.error, AssertionError | ThreadlineError), f"{name}: wrong failure {failure}"
        assert f"FAILED {name}:" in str(caught.value)
    assert set(report.passed) | set(report.failed) == set(CONFORMANCE_CASES)
    assert all(f.traceback and f.name in str(caught.value) for f in report.failures)


async def test_a_failing_case_is_reported_first_when_its_clean_up_fails_too(monkeypatch: pytest.MonkeyPatch) -> None:
    """A driver author must see what broke: the case's own failure, with the clean-up's attached — not a
    clean-up error standing in for it (``async with`` would report the clean-up instead)."""

    async def broken_case(store: AgentRuntimeStore) -> None:
        raise AssertionError("the case's own failure")

    @asynccontextmanager
    async def factory() -> AsyncIterator[AgentRuntimeStore]:
        store = create_memory_agent_runtime_store()
        try:
            yield store
        finally:
            raise RuntimeError("the clean-up failed")

    monkeypatch.setitem(CONFORMANCE_CASES, "zz_broken", broken_case)
    with pytest.raises(AgentStoreConformanceError) as caught:
        await run_agent_store_conformance(factory, only=["zz_broken", "duplicate_admission"])
    report = caught.value.report
    (failure,) = [f for f in report.failures if f.name == "zz_broken"]
    assert isinstance(failure.error, AssertionError) and str(failure.error) == "the case's own failure"
    assert isinstance(failure.cleanup_error, RuntimeError)
    summary = report.summary()
    assert summary.index("the case's own failure") < summary.index("the clean-up failed")
    assert "the case's own failure" in caught.value.args[0]
    # a case that passed but whose store could not be cleaned up is still a failure, named by the clean-up
    (other,) = [f for f in report.failures if f.name == "duplicate_admission"]
    assert isinstance(other.error, RuntimeError) and other.cleanup_error is None
