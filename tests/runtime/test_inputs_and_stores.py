"""What ``submit`` takes and refuses (before anything is written), the one id rule on every store, and the
one shape of every store: the same options (``clock=`` included), closed the same way (``aclose()`` and
``async with``)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from threadline import (
    AgentRecordValidationError,
    AgentStoreUnavailableError,
    create_memory_agent_runtime_store,
    create_postgres_agent_runtime_store,
    create_sqlite_agent_runtime_store,
)
from threadline.config import MAX_INPUT_BYTES

from .conftest import Script, make_runtime

WAIT = 10
FIXED = datetime(2030, 1, 2, 3, 4, 5, tzinfo=UTC)


async def refused(runtime: Any, **submit: Any) -> AgentRecordValidationError:
    ticket = runtime.submit(**{"conversation_id": "c1", "context": {"user_id": "u1"}, **submit})
    with pytest.raises(AgentRecordValidationError) as error:
        await asyncio.wait_for(ticket.admission, WAIT)
    return error.value


async def nothing_written(store: Any, conversation_id: str = "c1") -> bool:
    return (await store.load_snapshot(conversation_id=conversation_id)).version == 0


# ------------------------------------------------------------------------------------------------ parts


async def test_a_bare_string_is_one_text_part_and_strings_in_the_list_too(store: Any) -> None:
    script = Script()
    runtime = make_runtime(store, script)
    one = runtime.submit(conversation_id="c1", context={}, parts="hello")
    two = runtime.submit(conversation_id="c2", context={}, parts=["hello", {"type": "text", "text": "again"}])
    first, second = await asyncio.wait_for(asyncio.gather(one.admission, two.admission), WAIT)
    await asyncio.wait_for(asyncio.gather(one.result, two.result), WAIT)
    await runtime.close()
    assert [(p.type, p.text) for p in first.input.parts] == [("text", "hello")]
    assert [p.text for p in second.input.parts] == ["hello", "again"]


@pytest.mark.parametrize(
    ("parts", "field", "says"),
    [
        ([{"type": "image"}], "parts[0]", "type 'image'; an input carries parts of type 'text', 'file'"),
        ([{"text": "no type"}], "parts[0]", "a dict without a type"),
        ([{"type": "text"}], "parts[0].text", "Field required (a 'text' part)"),
        ([{"type": "file", "reference": "r"}], "parts[0].media_type", "Field required (a 'file' part)"),
        ({"type": "text", "text": "not in a list"}, "parts", "is a list of parts"),
        (42, "parts", "is a list of parts"),
    ],
)
async def test_a_wrong_part_names_what_an_input_may_carry(store: Any, parts: Any, field: str, says: str) -> None:
    runtime = make_runtime(store, Script())
    error = await refused(runtime, parts=parts)
    await runtime.close()
    assert error.field == field
    assert says in str(error)
    assert "TextPart" not in str(error) and "ReasoningPart" not in str(error)  # no internal class names
    assert await nothing_written(store)


async def test_an_input_over_max_input_bytes_is_refused_and_nothing_is_written(store: Any) -> None:
    runtime = make_runtime(store, Script(), runs={"max_input_bytes": 1000})
    error = await refused(runtime, parts=[{"type": "text", "text": "é" * 600}])  # 1,200 bytes of UTF-8
    assert error.field == "parts" and "runs.max_input_bytes allows 1000" in str(error)
    assert await nothing_written(store)
    fits = runtime.submit(conversation_id="c1", context={}, parts="é" * 400)  # about 830 bytes stored
    await asyncio.wait_for(fits.result, WAIT)
    await runtime.close()


async def test_the_default_input_limit_is_one_mebibyte(store: Any) -> None:
    assert MAX_INPUT_BYTES == 1024 * 1024
    runtime = make_runtime(store, Script())
    assert runtime.runs.max_input_bytes == MAX_INPUT_BYTES
    error = await refused(runtime, parts="x" * MAX_INPUT_BYTES)
    await runtime.close()
    assert error.field == "parts" and f"allows {MAX_INPUT_BYTES}" in str(error)
    assert await nothing_written(store)


async def test_metadata_counts_toward_the_input_size(store: Any) -> None:
    runtime = make_runtime(store, Script(), runs={"max_input_bytes": 500})
    error = await refused(runtime, parts="short", input_metadata={"blob": "m" * 600})
    await runtime.close()
    assert error.field == "parts"
    assert await nothing_written(store)


# ---------------------------------------------------------------------------------- idempotency keys


async def test_submit_without_a_key_draws_one_and_a_retry_with_it_is_the_same_input(store: Any) -> None:
    script = Script()
    runtime = make_runtime(store, script)
    first = runtime.submit(conversation_id="c1", context={}, parts="hello")
    assert first.idempotency_key is not None and first.idempotency_key.startswith("key_")
    answered = await asyncio.wait_for(first.result, WAIT)
    again = runtime.submit(conversation_id="c1", context={}, parts="hello", idempotency_key=first.idempotency_key)
    assert (await asyncio.wait_for(again.admission, WAIT)).outcome == "duplicate"
    # without the key, the same text is another input: that is what a keyless retry costs
    other = runtime.submit(conversation_id="c1", context={}, parts="hello")
    assert (await asyncio.wait_for(other.admission, WAIT)).outcome == "accepted"
    await asyncio.wait_for(other.result, WAIT)
    await runtime.close()
    assert other.idempotency_key != first.idempotency_key
    assert (await asyncio.wait_for(again.result, WAIT)).run.id == answered.run.id
    assert len(script.calls) == 2


# -------------------------------------------------------------------------------- the stores, all three


@pytest.fixture(params=["memory", "sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
async def any_store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Any]:
    """Each store factory with the same option, ``clock=``, and closed by ``async with``."""
    clock = lambda: FIXED  # noqa: E731
    if request.param == "memory":
        async with create_memory_agent_runtime_store(clock=clock) as store:
            yield store
    elif request.param == "sqlite":
        async with create_sqlite_agent_runtime_store(tmp_path / "ids.db", clock=clock) as handle:
            yield handle.store
    else:
        dsn, schema = request.getfixturevalue("postgres_dsn"), f"threadline_test_{uuid.uuid4().hex}"
        try:
            async with create_postgres_agent_runtime_store(dsn, schema=schema, clock=clock) as handle:
                yield handle.store
        finally:
            await drop_schema(dsn, schema)


async def drop_schema(dsn: str, schema: str) -> None:
    import psycopg

    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        await conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


BAD_IDS = [
    ("nul", "a\x00b"),
    ("newline", "a\nb"),
    ("delete", "a\x7fb"),
    ("empty", ""),
    ("too-long", "x" * 513),
    ("not-a-str", 7),
]


@pytest.mark.parametrize(("name", "bad"), BAD_IDS, ids=[n for n, _ in BAD_IDS])
@pytest.mark.parametrize("where", ["conversation_id", "idempotency_key", "run_id", "input.id", "assistant_message_id"])
async def test_one_id_rule_on_every_store(any_store: Any, where: str, name: str, bad: Any) -> None:
    arguments: dict[str, Any] = {
        "conversation_id": "c1",
        "idempotency_key": "k1",
        "input": {"role": "user", "parts": [{"type": "text", "text": "hi"}]},
    }
    if where == "input.id":
        arguments["input"] = {**arguments["input"], "id": bad}
    else:
        arguments[where] = bad
    with pytest.raises(AgentRecordValidationError) as refused_id:
        await any_store.accept_input_and_assign_run(**arguments)
    assert refused_id.value.field == where
    assert await nothing_written(any_store)


async def test_unicode_ids_up_to_the_limit_are_accepted_everywhere(any_store: Any) -> None:
    conversation = "gespräch-会话-" + "x" * 490
    assert len(conversation) <= 512
    accepted = await any_store.accept_input_and_assign_run(
        conversation_id=conversation,
        idempotency_key="clé 🔑",
        input={"id": "msg-ü", "role": "user", "parts": [{"type": "text", "text": "hi"}]},
        run_id="run-ü",
        assistant_message_id="msg-antwort",
    )
    assert accepted.run.id == "run-ü"
    assert accepted.run.created_at == FIXED  # the injected clock
    loaded = await any_store.load_run(conversation_id=conversation, run_id="run-ü")
    assert loaded is not None and loaded.run.input_message_ids == ("msg-ü",)


async def test_reads_refuse_a_bad_id_too(any_store: Any) -> None:
    with pytest.raises(AgentRecordValidationError) as refused_id:
        await any_store.load_run(conversation_id="c1", run_id="r\x00")
    assert refused_id.value.field == "run_id"


@pytest.mark.parametrize("kind", ["memory", "sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
async def test_every_store_closes_the_same_way(kind: str, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    if kind == "memory":
        handle: Any = create_memory_agent_runtime_store()
        store = handle
    elif kind == "sqlite":
        handle = create_sqlite_agent_runtime_store(tmp_path / "close.db")
        store = handle.store
    else:
        dsn, schema = request.getfixturevalue("postgres_dsn"), f"threadline_test_{uuid.uuid4().hex}"
        handle = await create_postgres_agent_runtime_store(dsn, schema=schema).open()
        store = handle.store
    try:
        await store.accept_input_and_assign_run(
            conversation_id="c1", idempotency_key="k", input={"role": "user", "parts": [{"type": "text", "text": "hi"}]}
        )
        await handle.aclose()
        await handle.aclose()  # idempotent
        with pytest.raises(AgentStoreUnavailableError):
            await store.load_snapshot(conversation_id="c1")
    finally:
        if kind == "postgres":
            await drop_schema(dsn, schema)


# ------------------------------------------------------------------------------------------- recovery


async def test_a_recovery_policy_may_be_async(store: Any) -> None:
    orphan = await store.accept_input_and_assign_run(
        conversation_id="c1", idempotency_key="k", input={"role": "user", "parts": [{"type": "text", "text": "hi"}]}
    )
    await store.acquire_run(
        conversation_id="c1", run_id=orphan.run.id, expected_revision=orphan.run.revision, owner_id="gone"
    )
    asked: list[str] = []

    async def policy(run: Any) -> dict[str, Any]:
        await asyncio.sleep(0)
        asked.append(run.id)
        return {"action": "requeue", "replay_safe": True}

    async def resolve(run: Any) -> dict[str, str]:
        await asyncio.sleep(0)
        return {"user_id": "u1"}

    runtime = make_runtime(store, Script())
    outcomes = await asyncio.wait_for(runtime.recover(resolve_context=resolve, policy=policy), WAIT)
    assert [(o.run_id, o.outcome) for o in outcomes] == [(orphan.run.id, "requeued")]
    result = await asyncio.wait_for(outcomes[0].result, WAIT)  # type: ignore[arg-type]
    await runtime.close()
    assert asked == [orphan.run.id] and result.text == "answer to: hi"
