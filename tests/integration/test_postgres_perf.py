"""The PostgreSQL driver's round-trip shortcuts on a real server: what a steady turn costs in round trips
(counted, never timed), and that every shortcut gives way to the rows themselves when they moved.

- *prefetch*: the rows an operation is foreseen to ask for travel in the round trip of the first request;
- a read ends its snapshot in that round trip, and checks the conversation head when it must go on;
- a write answers from the rows it last saw, each guarded (SHA-256 of its stored JSON, under the
  conversation lock) in the round trip that carries the writes; a failed guard, or an operation that
  gave up on such answers, runs the operation again on the rows read from the server.

Every test works in its own schema, dropped afterwards.
"""

from __future__ import annotations

import json
import re
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from threadline.errors import AgentIdempotencyConflictError, AgentRunRevisionConflictError

psycopg = pytest.importorskip("psycopg")
pytest.importorskip("psycopg_pool")

from psycopg_pool import AsyncConnectionPool  # noqa: E402
from test_postgres_store import Rows, handle_for, sql  # noqa: E402
from test_sqlite_store import Clock, text, turn  # noqa: E402

from threadline.store.postgres import (  # noqa: E402
    PostgresAgentRuntimeStoreHandle,
    create_postgres_agent_runtime_store,
)

pytestmark = pytest.mark.postgres

OWNER = "owner-1"  # the owner test_sqlite_store.turn acquires with


async def trips(pg: PostgresAgentRuntimeStoreHandle, call: Callable[[], Awaitable[Any]]) -> tuple[int, Any]:
    before = pg.driver.round_trips
    result = await call()
    return pg.driver.round_trips - before, result


# ------------------------------------------------------------------------------------------ round trips


async def test_a_steady_turn_costs_one_round_trip_per_operation(postgres_dsn: str, schema: str) -> None:
    async with handle_for(postgres_dsn, schema, max_size=1) as pg:
        store = pg.store
        for n in ("t0", "t1"):  # the driver has now seen this conversation, and prepared what a turn needs
            await turn(store, "c", n)
        n, accepted = await trips(
            pg,
            lambda: store.accept_input_and_assign_run(
                conversation_id="c",
                idempotency_key="key-t2",
                input={"id": "t2:in", "parts": text("question t2")},
                run_id="t2:run",
                assistant_message_id="t2:out",
            ),
        )
        assert n == 1  # guarded: this head, no admission under this key, no message or run with these ids
        n, acquired = await trips(
            pg,
            lambda: store.acquire_run(
                conversation_id="c", run_id="t2:run", expected_revision=accepted.run.revision, owner_id=OWNER
            ),
        )
        assert n == 1
        run = acquired.run
        for k in range(3):
            n, checkpointed = await trips(
                pg,
                lambda run=run, k=k: store.checkpoint_run_assistant(
                    conversation_id="c",
                    run_id=run.id,
                    expected_revision=run.revision,
                    owner_id=OWNER,
                    fencing_token=run.fencing_token,
                    parts=text(f"draft {k}"),
                ),
            )
            assert n == 1  # the first one is guarded on its draft not existing yet
            run = checkpointed.run
        n, loaded = await trips(pg, lambda: store.load_run(conversation_id="c", run_id="t2:run"))
        assert n == 1 and loaded is not None and loaded.run.revision == run.revision
        n, ended = await trips(
            pg,
            lambda: store.commit_run_terminal(
                conversation_id="c",
                run_id=run.id,
                expected_revision=run.revision,
                owner_id=OWNER,
                fencing_token=run.fencing_token,
                terminal_reason="success",
                parts=text("answer t2"),
            ),
        )
        assert n == 1 and ended.outcome == "committed"
        n, changes = await trips(pg, lambda: store.load_changes(conversation_id="c", since_version=accepted.version))
        assert n == 1 and changes.version == ended.version
        assert pg.driver.retries == 0 and pg.driver.restarts == 0
        # and what it wrote is what a fresh store reads
        async with handle_for(postgres_dsn, schema) as fresh:
            assert await fresh.store.load_snapshot(conversation_id="c") == await store.load_snapshot(
                conversation_id="c"
            )


async def test_rows_a_write_knows_exist_are_updated_in_place_and_new_rows_inserted(
    postgres_dsn: str, schema: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A row read under the lock, or vouched for by the guard, is rewritten with a plain UPDATE (no insert
    attempt, no row lock, no purge-guard trigger); a row the write has not seen is upserted."""
    sent: list[str] = []
    execute = psycopg.AsyncCursor.execute

    async def recording(self: Any, query: Any, *args: Any, **kwargs: Any) -> Any:
        sent.append(query.decode() if isinstance(query, bytes) else str(query))
        return await execute(self, query, *args, **kwargs)

    async with handle_for(postgres_dsn, schema) as pg:
        await turn(pg.store, "c", "t0")  # a new conversation: read under the lock, head inserted
        monkeypatch.setattr(psycopg.AsyncCursor, "execute", recording)
        await turn(pg.store, "c", "t1")  # steady: every known row answered from hints, under guard
        monkeypatch.undo()
        verbs = [
            (verb, table)
            for query in sent
            for verb, table in re.findall(r"EXECUTE tl_[0-9a-f]+_(update|upsert)_(head|run|message)\(", query)
        ]
        new, known = "upsert", "update"
        assert verbs == [
            (known, "head"), (new, "run"), (new, "message"),  # admission: a new run and input
            (known, "head"), (known, "run"),  # acquire
            (known, "head"), (known, "run"), (new, "message"),  # the first checkpoint creates the draft
            (known, "head"), (known, "run"), (known, "message"), (known, "message"),  # terminal
        ]  # fmt: skip
        with_plain = handle_for(postgres_dsn, f"{schema}_plain")
        async with with_plain as plain:
            try:
                plain.driver.prefetch = plain.driver.speculate = False  # every row read under the lock
                for n in ("t0", "t1"):
                    await turn(plain.store, "c", n)
                a = await pg.store.load_snapshot(conversation_id="c")
                b = await plain.store.load_snapshot(conversation_id="c")
                assert a.model_dump(exclude={"conversation_id"}) == b.model_dump(exclude={"conversation_id"})
            finally:
                await sql(postgres_dsn, f'DROP SCHEMA IF EXISTS "{schema}_plain" CASCADE')


async def test_without_shortcuts_the_same_answers(postgres_dsn: str, schema: str) -> None:
    async with handle_for(postgres_dsn, schema) as fast, handle_for(postgres_dsn, f"{schema}_plain") as plain:
        try:
            plain.driver.prefetch = plain.driver.speculate = False
            for pg in (fast, plain):
                for n in ("t1", "t2", "t3"):
                    await turn(pg.store, "c", n)
            a = await fast.store.load_snapshot(conversation_id="c")
            b = await plain.store.load_snapshot(conversation_id="c")
            assert a.model_dump(exclude={"conversation_id"}) == b.model_dump(exclude={"conversation_id"})
            assert fast.driver.round_trips < plain.driver.round_trips
        finally:
            await sql(postgres_dsn, f'DROP SCHEMA IF EXISTS "{schema}_plain" CASCADE')


# ------------------------------------------------------------------------ shortcuts give way to the rows


async def test_a_write_answered_from_stale_rows_runs_again_on_the_stored_ones(postgres_dsn: str, schema: str) -> None:
    async with handle_for(postgres_dsn, schema) as one, handle_for(postgres_dsn, schema) as two:
        accepted = await one.store.accept_input_and_assign_run(
            conversation_id="c", idempotency_key="k", input={"id": "in", "parts": text("q")}, run_id="r"
        )
        acquired = await one.store.acquire_run(
            conversation_id="c", run_id="r", expected_revision=accepted.run.revision, owner_id=OWNER
        )
        run = acquired.run
        # another process moves the run on: what `one` saw of it is stale now
        moved = await two.store.checkpoint_run_assistant(
            conversation_id="c",
            run_id="r",
            expected_revision=run.revision,
            owner_id=OWNER,
            fencing_token=run.fencing_token,
            parts=text("elsewhere"),
        )
        # answered from its stale rows the operation would refuse this revision; it must not
        done = await one.store.checkpoint_run_assistant(
            conversation_id="c",
            run_id="r",
            expected_revision=moved.run.revision,
            owner_id=OWNER,
            fencing_token=run.fencing_token,
            parts=text("here"),
        )
        assert done.run.revision == moved.run.revision + 1
        assert [p.text for p in done.assistant.parts] == ["here"]  # type: ignore[union-attr]
        assert one.driver.restarts == 1 and one.driver.retries == 0
        # and the other way round: answered from stale rows it would accept a revision it must refuse
        with pytest.raises(AgentRunRevisionConflictError):
            await two.store.checkpoint_run_assistant(
                conversation_id="c",
                run_id="r",
                expected_revision=moved.run.revision,
                owner_id=OWNER,
                fencing_token=run.fencing_token,
                parts=text("late"),
            )
        assert two.driver.restarts == 1
        loaded = await one.store.load_run(conversation_id="c", run_id="r")
        assert loaded is not None and loaded.run.revision == done.run.revision


async def test_guesses_that_an_id_is_new_give_way_to_the_stored_rows(postgres_dsn: str, schema: str) -> None:
    async with handle_for(postgres_dsn, schema) as one, handle_for(postgres_dsn, schema) as two:
        await turn(one.store, "c", "t1")
        await turn(two.store, "c", "t2")  # `one` never saw t2's rows
        # the key was used: `one` guesses it was not, its guard fails, the duplicate is found
        again = await one.store.accept_input_and_assign_run(
            conversation_id="c",
            idempotency_key="key-t2",
            input={"id": "t2:in", "parts": text("question t2")},
            run_id="t2:run",
            assistant_message_id="t2:out",
        )
        assert again.outcome == "duplicate" and again.run.id == "t2:run"
        assert one.driver.restarts == 1
        # a new key for an input id that exists: refused, as without guesses
        with pytest.raises(AgentIdempotencyConflictError):
            await one.store.accept_input_and_assign_run(
                conversation_id="c", idempotency_key="key-new", input={"id": "t2:in", "parts": text("question t2")}
            )
        assert one.driver.retries == 0 and two.driver.retries == 0


async def test_a_row_changed_behind_the_store_fails_the_guard(postgres_dsn: str, schema: str) -> None:
    async with handle_for(postgres_dsn, schema) as pg:
        accepted = await pg.store.accept_input_and_assign_run(
            conversation_id="c", idempotency_key="k", input={"id": "in", "parts": text("q")}, run_id="r"
        )
        run = (
            await pg.store.acquire_run(
                conversation_id="c", run_id="r", expected_revision=accepted.run.revision, owner_id=OWNER
            )
        ).run
        # the run row alone changes (its head does not): the driver's memory of it is wrong now
        runs = f'"{schema}".threadline_runs'
        [(body,)] = await sql(postgres_dsn, f"SELECT body FROM {runs} WHERE run_id = 'r'")
        record = json.loads(body)
        record["revision"] += 5
        await sql(postgres_dsn, f"UPDATE {runs} SET body = %s WHERE run_id = 'r'", (json.dumps(record),))
        with pytest.raises(AgentRunRevisionConflictError):
            await pg.store.checkpoint_run_assistant(
                conversation_id="c",
                run_id="r",
                expected_revision=run.revision,
                owner_id=OWNER,
                fencing_token=run.fencing_token,
                parts=text("draft"),
            )
        assert pg.driver.restarts == 1
        done = await pg.store.checkpoint_run_assistant(
            conversation_id="c",
            run_id="r",
            expected_revision=run.revision + 5,
            owner_id=OWNER,
            fencing_token=run.fencing_token,
            parts=text("draft"),
        )
        assert done.run.revision == run.revision + 6


@pytest.mark.parametrize("moved", [False, True])
async def test_a_read_that_goes_on_checks_the_head_in_its_second_snapshot(
    postgres_dsn: str, schema: str, moved: bool
) -> None:
    async with handle_for(postgres_dsn, schema) as one:
        await turn(one.store, "c", "t1")
        async with handle_for(postgres_dsn, schema) as two:  # knows nothing of "c": foresees too little
            calls = []

            async def write_between(rows: Any, request: Any) -> Any:
                calls.append(request)
                if moved and len(calls) == 1:  # between the first snapshot and the second
                    await one.store.accept_input_and_assign_run(
                        conversation_id="c", idempotency_key="k2", input={"id": "in2", "parts": text("q2")}
                    )
                return await rows.load_runs(request)

            two.driver.rows_wrapper = lambda rows: Rows(rows, {"load_runs": write_between})
            loaded = await two.store.load_run(conversation_id="c", run_id="t1:run")
            two.driver.rows_wrapper = None
            assert loaded is not None and loaded.run.state == "completed" and loaded.assistant is not None
            assert loaded.version == (await one.store.load_run(conversation_id="c", run_id="t1:run")).version  # type: ignore[union-attr]
            assert two.driver.restarts == (1 if moved else 0)
            assert len(calls) == (2 if moved else 1)


async def test_statements_dropped_by_a_pool_reset_are_prepared_again(postgres_dsn: str, schema: str) -> None:
    async def discard(conn: Any) -> None:
        await conn.execute("DISCARD ALL")

    async with (
        AsyncConnectionPool(
            postgres_dsn, min_size=1, max_size=1, kwargs={"autocommit": True}, reset=discard, open=False
        ) as pool,
        create_postgres_agent_runtime_store(pool=pool, schema=schema, clock=Clock()) as pg,
    ):
        await turn(pg.store, "c", "t1")
        await turn(pg.store, "c", "t2")
        loaded = await pg.store.load_run(conversation_id="c", run_id="t2:run")
        assert loaded is not None and loaded.run.state == "completed"
        assert pg.driver.retries > 0  # each found its statements gone, and prepared them again


async def test_a_fault_in_the_hints_is_loud_not_a_silent_extra_round_trip(
    postgres_dsn: str, schema: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A probe may fail on guessed rows (that only costs a round trip); the driver's own hint code failing
    is a bug, and the operation reports it instead of quietly reading the rows itself."""
    from threadline.store.postgres._hints import Hints

    async with handle_for(postgres_dsn, schema) as pg:
        await turn(pg.store, "c", "t0")  # the driver now remembers this conversation: the next turn predicts

        def broken(self: Any, request: Any) -> Any:
            raise LookupError("a bug in the hints")

        monkeypatch.setattr(Hints, "answer", broken)
        with pytest.raises(LookupError, match="a bug in the hints"):  # a read foresees its requests
            await pg.store.load_run(conversation_id="c", run_id="t0:run")
