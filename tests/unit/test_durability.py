"""Durable steps (``threadline.durability``) on the process-local ledger and without any ledger.

Pins. Value: only lossless JSON is accepted (exact ``None``/``bool``/``int``/finite ``float`` but not
``-0.0``/valid ``str``/``list``/``dict`` with ``str`` keys); everything else is refused with
:class:`AgentStepValueError` naming the path, *after* the body ran exactly once; a refused value leaves a
bare intent. Detachment: the first result and every replay are copies — mutating them, or the body's own
object, changes neither the record nor a later replay. Replay: the same ``(conversation, run, effect)``
key never runs the body again; a new run, conversation or effect name does. Bare intent: no body run;
``reconcile`` turns it into an accepted proof, or returns ``None`` → :class:`AgentStepUncertainError`,
as does the absence of ``reconcile``. Both errors are ``AppError``s with a safe envelope. Without a ledger
the body runs every time and the value rules still hold.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import enum
import math
from collections import OrderedDict
from decimal import Decimal
from typing import Any

import pytest

from threadline.durability import (
    STEP_UNCERTAIN,
    STEP_VALUE_REFUSED,
    AgentStepDurability,
    AgentStepKey,
    AgentStepRecord,
    AgentStepUncertainError,
    AgentStepValueError,
    LocalStepDurability,
    create_local_step_durability,
    run_agent_step,
)
from threadline.errors import AgentRuntimeUsageError, AgentStoreUnavailableError
from threadline.tools import AgentToolContext, AppError, define_agent_tool, error_envelope


def context(durability: LocalStepDurability | None, *, conversation_id: str = "c", run_id: str = "r"):
    return AgentToolContext(
        conversation_id=conversation_id,
        run_id=run_id,
        call_id="call-1",
        tool_name="tool",
        context=None,
        _durability=durability,
    )


class Counted:
    """A body that counts its calls and returns what it is told (a fresh object each time)."""

    def __init__(self, make: Any) -> None:
        self.make = make
        self.calls = 0

    async def __call__(self) -> Any:
        self.calls += 1
        return self.make()


def write_bare_intent(durability: LocalStepDurability, conversation_id: str, run_id: str, effect_name: str) -> None:
    """What a process that died between the intent's commit and the proof's leaves behind."""
    assert (
        durability._ledger.claim((AgentStepKey(conversation_id, run_id, effect_name),), "2025-01-01T00:00:00+00:00")
        is None
    )


@pytest.fixture
async def ledger() -> Any:
    async with create_local_step_durability() as durability:
        yield durability


class Opaque:
    pass


class Color(enum.Enum):
    RED = "red"


class Name(str):
    pass


cycle_list: list[Any] = []
cycle_list.append(cycle_list)

REFUSED = {
    "tuple": (1, 2),
    "set": {1},
    "frozenset": frozenset({1}),
    "datetime": dt.datetime(2025, 1, 2, tzinfo=dt.UTC),
    "date": dt.date(2025, 1, 2),
    "decimal": Decimal("1.5"),
    "bytes": b"x",
    "bytearray": bytearray(b"x"),
    "object": Opaque(),
    "enum": Color.RED,
    "str-subclass": Name("x"),
    "ordered-dict": OrderedDict(a=1),
    "negative-zero": -0.0,
    "nan": math.nan,
    "inf": math.inf,
    "-inf": -math.inf,
    "lone-surrogate": "a\ud800b",
    "int-key": {1: "x"},
    "cycle": cycle_list,
    "function": len,
}


# ----------------------------------------------------------------------------------------- lossless JSON


@pytest.mark.parametrize("durable", [True, False], ids=["ledger", "no-ledger"])
@pytest.mark.parametrize("kind", sorted(REFUSED))
async def test_refused_after_the_body_ran_naming_the_path(kind: str, durable: bool) -> None:
    durability = create_local_step_durability() if durable else None
    body = Counted(lambda: {"items": [0, 1, {"when": REFUSED[kind]}]})
    with pytest.raises(AgentStepValueError) as caught:
        await context(durability).step("effect", body)
    assert body.calls == 1  # the effect happened before the refusal
    error = caught.value
    path = "$.items[2].when[0]" if kind == "cycle" else "$.items[2].when"  # where the list re-enters itself
    assert error.path == path
    assert error.effect_name == "effect"
    assert path in str(error)
    assert isinstance(error, AppError) and error.code == STEP_VALUE_REFUSED and not error.retryable
    if durability is not None:
        record = await durability.read("c", "r", "effect")
        assert record is not None and record.state == "intent"  # no proof: the key is uncertain now
        with pytest.raises(AgentStepUncertainError):
            await context(durability).step("effect", body)
        assert body.calls == 1


@pytest.mark.parametrize(
    ("value", "path"),
    [
        (math.nan, "$"),
        ({"a b": [1, math.inf]}, '$["a b"][1]'),
        ({"ok": {"nested": [[0, [(1,)]]]}}, "$.ok.nested[0][1][0]"),
        ({"k": {2: 1}}, "$.k"),
        ([{"é": {b"k": 1}}], "$[0].é"),
    ],
)
async def test_paths(value: Any, path: str) -> None:
    with pytest.raises(AgentStepValueError) as caught:
        await context(None).step("effect", lambda: value)
    assert caught.value.path == path


ACCEPTED = {
    "none": None,
    "true": True,
    "false": False,
    "zero": 0,
    "positive-zero": 0.0,
    "int": -17,
    "big-int": 2**200,
    "float": 0.1,
    "tiny": 5e-324,
    "huge": 1.7976931348623157e308,
    "str": "héllo ✓ \U0001f600",
    "empty": {"list": [], "dict": {}, "str": ""},
    "nested": {"order": {"id": "o-1", "lines": [{"sku": "a", "qty": 2, "price": 9.99}], "paid": True, "note": None}},
    "odd-keys": {"a b": 1, "": 2, "$": [3]},
}


@pytest.mark.parametrize("kind", sorted(ACCEPTED))
async def test_accepted_values_round_trip(ledger: LocalStepDurability, kind: str) -> None:
    value = ACCEPTED[kind]
    first = await context(ledger).step(kind, lambda: value)
    replay = await context(ledger).step(kind, lambda: pytest.fail("replayed"))
    record = await ledger.read("c", "r", kind)
    for got in (first, replay, record.value if record else None):
        assert got == value
        assert repr(got) == repr(value)  # same types all the way down (1 vs 1.0, True vs 1)
    assert record is not None and record.state == "accepted" and not record.reconciled


async def test_detached_copies(ledger: LocalStepDurability) -> None:
    produced = {"items": [1, 2], "meta": {"n": 1}}
    ctx = context(ledger)
    first = await ctx.step("effect", lambda: produced)
    assert first == produced and first is not produced and first["items"] is not produced["items"]
    first["items"].append(3)
    first["meta"]["n"] = 99
    produced["items"].clear()  # the body's own object, changed after the step returned
    replay = await ctx.step("effect", lambda: pytest.fail("replayed"))
    assert replay == {"items": [1, 2], "meta": {"n": 1}}
    replay["items"].append(4)
    record = await ledger.read("c", "r", "effect")
    assert record is not None and record.value == {"items": [1, 2], "meta": {"n": 1}}
    record.value["items"].append(5)
    assert await ctx.step("effect", lambda: pytest.fail("replayed")) == {"items": [1, 2], "meta": {"n": 1}}


async def test_detached_without_a_ledger() -> None:
    produced = {"items": [1]}
    got = await context(None).step("effect", lambda: produced)
    got["items"].append(2)
    assert produced == {"items": [1]}


# ------------------------------------------------------------------------------------------------ replay


async def test_same_key_replays_without_running_the_body(ledger: LocalStepDurability) -> None:
    body = Counted(lambda: {"charged": 10})
    assert await context(ledger).step("charge", body) == {"charged": 10}
    # a fresh context for the same run: the tool ran again, e.g. after the run was requeued
    assert await context(ledger).step("charge", body) == {"charged": 10}
    assert body.calls == 1


@pytest.mark.parametrize(
    ("conversation_id", "run_id", "name"),
    [("c", "r2", "charge"), ("c", "r", "charge-2"), ("c2", "r", "charge")],
    ids=["new-run", "new-effect-name", "new-conversation"],
)
async def test_a_new_key_runs_the_body(
    ledger: LocalStepDurability, conversation_id: str, run_id: str, name: str
) -> None:
    body = Counted(lambda: body.calls)
    assert await context(ledger).step("charge", body) == 1
    assert await context(ledger, conversation_id=conversation_id, run_id=run_id).step(name, body) == 2
    assert body.calls == 2


async def test_sync_bodies_and_awaitable_results(ledger: LocalStepDurability) -> None:
    async def fetch() -> str:
        return "async"

    assert await context(ledger).step("sync", lambda: "sync") == "sync"
    assert await context(ledger).step("lambda-coroutine", lambda: fetch()) == "async"
    assert await context(ledger).step("async-def", fetch) == "async"


async def test_a_coroutine_object_is_refused_before_anything_is_recorded(ledger: LocalStepDurability) -> None:
    async def fetch() -> int:
        return 1

    with pytest.raises(AgentRuntimeUsageError):
        await context(ledger).step("effect", fetch())  # type: ignore[arg-type]
    with pytest.raises(AgentRuntimeUsageError):
        await context(ledger).step("", fetch)
    assert await ledger.read("c", "r", "effect") is None


async def test_without_a_ledger_the_body_runs_every_time() -> None:
    body = Counted(lambda: {"n": body.calls})
    reconciled: list[Any] = []
    ctx = context(None)
    assert await ctx.step("effect", body, reconcile=reconciled.append) == {"n": 1}
    assert await ctx.step("effect", body, reconcile=reconciled.append) == {"n": 2}
    assert reconciled == []


async def test_same_key_concurrently_runs_the_body_once(ledger: LocalStepDurability) -> None:
    release = asyncio.Event()
    calls = 0

    async def body() -> dict[str, int]:
        nonlocal calls
        calls += 1
        await release.wait()
        return {"id": 7}

    first = asyncio.ensure_future(context(ledger).step("effect", body))
    second = asyncio.ensure_future(context(ledger).step("effect", body))
    await asyncio.sleep(0)
    release.set()
    assert await asyncio.gather(first, second) == [{"id": 7}, {"id": 7}]
    assert calls == 1


# -------------------------------------------------------------------------------------------- bare intent


async def test_a_bare_intent_is_uncertain_and_the_body_is_not_run(ledger: LocalStepDurability) -> None:
    write_bare_intent(ledger, "c", "r", "charge")
    body = Counted(lambda: "charged")
    with pytest.raises(AgentStepUncertainError) as caught:
        await context(ledger).step("charge", body)
    assert body.calls == 0
    error = caught.value
    assert error.key == AgentStepKey("c", "r", "charge") and not error.reconcile_attempted
    assert error.record.state == "intent"
    envelope = error_envelope(error)
    assert envelope["error"] == STEP_UNCERTAIN and envelope["retryable"] is False
    assert envelope["details"] == {"effect_name": "charge"}
    assert (await ledger.read("c", "r", "charge")).state == "intent"  # type: ignore[union-attr]


async def test_a_raising_body_leaves_a_bare_intent(ledger: LocalStepDurability) -> None:
    async def body() -> None:
        raise TimeoutError("the request may have reached the provider")

    with pytest.raises(TimeoutError):
        await context(ledger).step("charge", body)
    with pytest.raises(AgentStepUncertainError):
        await context(ledger).step("charge", lambda: pytest.fail("ran again"))


async def test_a_cancelled_body_leaves_a_bare_intent(ledger: LocalStepDurability) -> None:
    started = asyncio.Event()

    async def body() -> None:
        started.set()
        await asyncio.Event().wait()

    task = asyncio.ensure_future(context(ledger).step("charge", body))
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert (await ledger.read("c", "r", "charge")).state == "intent"  # type: ignore[union-attr]


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
async def test_reconcile_turns_a_bare_intent_into_the_accepted_proof(
    ledger: LocalStepDurability, asynchronous: bool
) -> None:
    write_bare_intent(ledger, "c", "r", "charge")
    seen: list[AgentStepRecord] = []

    def found(record: AgentStepRecord) -> dict[str, Any]:
        seen.append(record)
        return {"charge_id": "ch_1"}

    async def found_async(record: AgentStepRecord) -> dict[str, Any]:
        return found(record)

    body = Counted(lambda: "charged")
    got = await context(ledger).step("charge", body, reconcile=found_async if asynchronous else found)
    assert got == {"charge_id": "ch_1"} and body.calls == 0
    assert [(r.key, r.state) for r in seen] == [(AgentStepKey("c", "r", "charge"), "intent")]
    record = await ledger.read("c", "r", "charge")
    assert record is not None and record.state == "accepted" and record.reconciled
    assert record.value == {"charge_id": "ch_1"} and record.accepted_at is not None
    # accepted now: replays without body or reconcile
    assert await context(ledger).step("charge", body, reconcile=lambda r: pytest.fail("reconciled")) == got
    assert body.calls == 0


async def test_reconcile_returning_none_is_uncertain(ledger: LocalStepDurability) -> None:
    write_bare_intent(ledger, "c", "r", "charge")
    body = Counted(lambda: "charged")
    with pytest.raises(AgentStepUncertainError) as caught:
        await context(ledger).step("charge", body, reconcile=lambda record: None)
    assert caught.value.reconcile_attempted and body.calls == 0
    assert (await ledger.read("c", "r", "charge")).state == "intent"  # type: ignore[union-attr]


async def test_a_reconciled_value_obeys_the_value_rules(ledger: LocalStepDurability) -> None:
    write_bare_intent(ledger, "c", "r", "charge")
    with pytest.raises(AgentStepValueError) as caught:
        await context(ledger).step("charge", lambda: 1, reconcile=lambda record: {"at": record.intent_at})
    assert caught.value.path == "$.at"
    assert (await ledger.read("c", "r", "charge")).state == "intent"  # type: ignore[union-attr]


# ------------------------------------------------------------------------------------- ledger operations


async def test_read_purge_and_close() -> None:
    durability = create_local_step_durability()
    assert isinstance(durability, AgentStepDurability)
    assert await durability.read("c", "r", "nothing") is None
    await run_agent_step(durability, "c", "r", "a", lambda: 1)
    await run_agent_step(durability, "c", "r2", "b", lambda: 2)
    await run_agent_step(durability, "other", "r", "a", lambda: 3)
    assert await durability.purge("c") == 2
    assert await durability.read("c", "r", "a") is None
    assert (await durability.read("other", "r", "a")).value == 3  # type: ignore[union-attr]
    body = Counted(lambda: 4)
    assert await run_agent_step(durability, "c", "r", "a", body) == 4 and body.calls == 1  # purged: a new key
    await durability.close()
    await durability.close()
    with pytest.raises(AgentStoreUnavailableError):
        await durability.read("other", "r", "a")


async def test_a_tool_uses_its_context_step(ledger: LocalStepDurability) -> None:
    effects: list[str] = []

    @define_agent_tool
    async def refund(ctx: AgentToolContext, order_id: str) -> Any:
        async def effect() -> dict[str, str]:
            effects.append(order_id)
            return {"refund": f"rf-{order_id}"}

        return await ctx.step(f"refund:{order_id}", effect)

    ctx = context(ledger)
    for _ in range(2):
        assert await refund.call(ctx, refund.validate({"order_id": "o1"})) == {"refund": "rf-o1"}
    assert effects == ["o1"]
