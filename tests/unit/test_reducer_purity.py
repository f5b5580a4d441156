"""The store reducer is pure and driver-independent (DESIGN §4: "one owner per state change").

Pins: ``threadline/store/reducer.py`` imports no I/O, clock, randomness or concurrency module (anywhere
in the file, not only at the top); and a reducer operation can be driven by hand — the test answers its
row requests itself, with no driver at all — yielding a known sequence of requests and returning the
decided result.
"""

from __future__ import annotations

import ast
from collections.abc import Generator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

import threadline.store.reducer as reducer_module
from threadline.errors import AgentIdempotencyConflictError
from threadline.records import Message, MessageDraft, Run, TextPart
from threadline.store import reducer
from threadline.store.driver import (
    HeadState,
    ListActiveRuns,
    LoadHead,
    LoadMessages,
    LoadReceipt,
    LoadReceiptByInput,
    LoadRuns,
    LoadRunsByAssistant,
    Mutation,
    Write,
)
from threadline.store.results import AcceptResult

FORBIDDEN = {"asyncio", "time", "datetime", "uuid", "random", "os", "sqlite3", "threading", "psycopg"}
REDUCER_PATH = Path(reducer_module.__file__)
NOW = datetime(2025, 1, 2, 3, 4, 5, tzinfo=UTC)


def imported_modules(source: str) -> list[tuple[str, int]]:
    """Every module an ``import`` or ``from … import`` names, anywhere in the tree, with its line."""
    found: list[tuple[str, int]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.extend((alias.name, node.lineno) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.module, node.lineno))
    return found


def forbidden_imports(source: str) -> list[str]:
    return [f"line {line}: {name}" for name, line in imported_modules(source) if name.split(".")[0] in FORBIDDEN]


def test_reducer_imports_no_io_clock_randomness_or_concurrency() -> None:
    assert forbidden_imports(REDUCER_PATH.read_text(encoding="utf-8")) == []


@pytest.mark.parametrize(
    "snippet",
    [
        "import asyncio",
        "import os.path",
        "from datetime import datetime",
        "from time import monotonic",
        "import uuid as _uuid",
        "def f():\n    import random\n",
        "class C:\n    def m(self):\n        from psycopg import sql\n",
        "if True:\n    import sqlite3, json\n",
        "try:\n    import threading\nexcept ImportError:\n    pass\n",
    ],
)
def test_the_import_check_catches_top_level_and_nested_imports(snippet: str) -> None:
    assert forbidden_imports(snippet), snippet


def test_the_import_check_allows_relative_and_harmless_imports() -> None:
    assert forbidden_imports("import json\nfrom .driver import LoadHead\nfrom ..records import Run\n") == []


# ------------------------------------------------------------------------------- driving by hand


def drive(operation: Generator[Any, Any, Any], answer: Any) -> tuple[list[Any], Any]:
    """Run ``operation`` answering each request with ``answer(request)``; return (requests, result)."""
    requests: list[Any] = []
    reply: Any = None
    try:
        while True:
            request = operation.send(reply)
            requests.append(request)
            reply = answer(request)
    except StopIteration as done:
        return requests, done.value


NEW_CONVERSATION: dict[type, Any] = {
    LoadHead: HeadState(None),
    LoadReceipt: None,
    LoadReceiptByInput: None,
    LoadMessages: [],
    ListActiveRuns: [],
    LoadRunsByAssistant: [],
    LoadRuns: [],
    Write: None,
}
"""Answers for an admission into a conversation that does not exist yet: nothing is found."""


def draft(message_id: str, text: str) -> MessageDraft:
    return MessageDraft(id=message_id, parts=(TextPart(text=text),))


def test_accept_input_on_a_new_conversation_driven_by_hand() -> None:
    op = reducer.accept_input_and_assign_run(
        conversation_id="c_1",
        idempotency_key="k_1",
        input=draft("m_1", "hello"),
        run_id="run_1",
        assistant_message_id="a_1",
        now=NOW,
    )
    answers = NEW_CONVERSATION
    requests, result = drive(op, lambda r: answers[type(r)])

    assert [type(r) for r in requests] == [
        LoadHead,
        LoadReceipt,
        LoadReceiptByInput,
        LoadMessages,
        ListActiveRuns,
        LoadRunsByAssistant,
        LoadRuns,
        LoadMessages,
        Write,
    ]
    assert requests[0] == LoadHead("c_1")
    assert requests[1] == LoadReceipt("c_1", "k_1")
    assert requests[2] == LoadReceiptByInput("c_1", "m_1")
    assert requests[3] == LoadMessages("c_1", ("m_1",))
    # caller-chosen ids are not any run's answer id (one indexed read for both)
    assert requests[5] == LoadRunsByAssistant("c_1", ("m_1", "a_1"))
    assert requests[6] == LoadRuns("c_1", ("run_1",))
    assert requests[7] == LoadMessages("c_1", ("a_1",))  # a caller-chosen assistant id is checked too

    mutation: Mutation = requests[-1].mutation
    assert mutation.head is not None
    assert (mutation.head.version, mutation.head.message_seq, mutation.head.admission_seq) == (1, 1, 1)
    (run,) = mutation.runs
    assert (run.id, run.state, run.revision, run.input_message_ids, run.admission_sequence) == (
        "run_1",
        "queued",
        1,
        ("m_1",),
        1,
    )
    (message,) = mutation.messages
    assert (message.id, message.role, message.status, message.run_id, message.position) == (
        "m_1",
        "user",
        "committed",
        "run_1",
        None,
    )
    (receipt,) = mutation.receipts
    assert (receipt.idempotency_key, receipt.run_id, receipt.assistant_message_id) == ("k_1", "run_1", "a_1")
    assert mutation.seeds == ()

    assert isinstance(result, AcceptResult)
    assert result.outcome == "accepted" and not result.coalesced
    assert result.run == run and result.receipt == receipt and result.version == 1


def test_ids_drawn_fresh_are_not_looked_up() -> None:
    """Ids the caller just drew at random cannot exist yet: the reads that look for them are skipped, and
    only for those ids."""
    answers = NEW_CONVERSATION

    def requests_with(fresh: frozenset[str]) -> list[type]:
        op = reducer.accept_input_and_assign_run(
            conversation_id="c_1",
            idempotency_key="k_1",
            input=draft("m_1", "hello"),
            run_id="run_1",
            assistant_message_id="a_1",
            now=NOW,
            fresh_ids=fresh,
        )
        requests, result = drive(op, lambda r: answers[type(r)])
        assert result.outcome == "accepted" and result.run.id == "run_1"
        return [type(r) for r in requests]

    assert requests_with(frozenset({"m_1", "run_1", "a_1"})) == [LoadHead, LoadReceipt, ListActiveRuns, Write]
    assert requests_with(frozenset({"m_1", "run_1"})) == [
        LoadHead,
        LoadReceipt,
        ListActiveRuns,
        LoadRunsByAssistant,
        LoadMessages,
        Write,
    ]
    assert requests_with(frozenset({"run_1", "a_1"})) == [
        LoadHead,
        LoadReceipt,
        LoadReceiptByInput,
        LoadMessages,
        ListActiveRuns,
        LoadRunsByAssistant,
        Write,
    ]
    assert requests_with(frozenset({"m_1", "a_1"})) == [LoadHead, LoadReceipt, ListActiveRuns, LoadRuns, Write]
    assert requests_with(frozenset({"someone-else"})) == [
        LoadHead,
        LoadReceipt,
        LoadReceiptByInput,
        LoadMessages,
        ListActiveRuns,
        LoadRunsByAssistant,
        LoadRuns,
        LoadMessages,
        Write,
    ]


def test_coalescing_into_the_queued_successor_driven_by_hand() -> None:
    first = accept_by_hand(head=None, active=[], message_id="m_1", key="k_1", run_id="run_1")
    head1 = first[0][-1].mutation.head
    running = first[1].run.model_copy(
        update={"state": "running", "owner_id": "w", "execution_sequence": 1, "revision": 2}
    )
    second_requests, second = accept_by_hand(
        head=head1, active=[running], message_id="m_2", key="k_2", run_id="run_2", coalesce=True
    )
    assert second.outcome == "accepted" and not second.coalesced and second.run.id == "run_2"
    head2 = second_requests[-1].mutation.head

    third_requests, third = accept_by_hand(
        head=head2, active=[running, second.run], message_id="m_3", key="k_3", run_id="run_3", coalesce=True
    )
    # coalescing reuses the queued run, so the reducer never asks whether the proposed run id exists
    assert [type(r) for r in third_requests] == [
        LoadHead,
        LoadReceipt,
        LoadReceiptByInput,
        LoadMessages,
        ListActiveRuns,
        LoadRunsByAssistant,
        Write,
    ]
    assert third.coalesced and third.run.id == "run_2"
    assert third.run.input_message_ids == ("m_2", "m_3")
    assert third.run.revision == second.run.revision + 1
    assert third.receipt.run_id == "run_2"
    written_head = third_requests[-1].mutation.head
    assert written_head.admission_seq == head2.admission_seq  # no new admission
    assert written_head.version == head2.version + 1 == head1.version + 2


def accept_by_hand(
    *,
    head: Any,
    active: list[Run],
    message_id: str,
    key: str,
    run_id: str,
    coalesce: bool = False,
) -> tuple[list[Any], AcceptResult]:
    op = reducer.accept_input_and_assign_run(
        conversation_id="c_1",
        idempotency_key=key,
        input=draft(message_id, f"text of {message_id}"),
        run_id=run_id,
        assistant_message_id=f"a_{run_id}",
        coalesce=coalesce,
        now=NOW,
    )
    answers: dict[type, Any] = {
        LoadHead: HeadState(head),
        LoadReceipt: None,
        LoadReceiptByInput: None,
        LoadMessages: [],
        ListActiveRuns: active,
        LoadRunsByAssistant: [],
        LoadRuns: [],
        Write: None,
    }
    return drive(op, lambda r: answers[type(r)])


def test_a_retried_key_is_answered_from_the_receipt_without_writing() -> None:
    requests, accepted = accept_by_hand(head=None, active=[], message_id="m_1", key="k_1", run_id="run_1")
    head = requests[-1].mutation.head
    op = reducer.accept_input_and_assign_run(
        conversation_id="c_1",
        idempotency_key="k_1",
        input=draft("m_1", "text of m_1"),
        run_id="run_other",
        assistant_message_id="a_other",
        now=NOW,
    )
    answers: dict[type, Any] = {
        LoadHead: HeadState(head),
        LoadReceipt: accepted.receipt,
        LoadRuns: [accepted.run],
    }
    replay, result = drive(op, lambda r: answers[type(r)])
    assert [type(r) for r in replay] == [LoadHead, LoadReceipt, LoadRuns]
    assert not any(isinstance(r, Write) for r in replay)
    assert result.outcome == "duplicate" and result.receipt == accepted.receipt and result.answer is None


def test_a_key_reused_for_different_input_raises_before_any_write() -> None:
    requests, accepted = accept_by_hand(head=None, active=[], message_id="m_1", key="k_1", run_id="run_1")
    op = reducer.accept_input_and_assign_run(
        conversation_id="c_1",
        idempotency_key="k_1",
        input=draft("m_1", "something else"),
        run_id="run_2",
        assistant_message_id="a_2",
        now=NOW,
    )
    assert isinstance(next(op), LoadHead)
    assert isinstance(op.send(HeadState(requests[-1].mutation.head)), LoadReceipt)
    with pytest.raises(AgentIdempotencyConflictError):
        op.send(accepted.receipt)


def test_the_same_decision_from_the_same_rows() -> None:
    """Purity: the same answers give an equal result, however many times the operation runs."""
    results = [accept_by_hand(head=None, active=[], message_id="m_1", key="k_1", run_id="run_1") for _ in range(3)]
    assert all(r == results[0] for r in results)
    assert isinstance(results[0][1].receipt.input, Message)
