"""The ledger's contract cases of :func:`~threadline.store.conformance.run_agent_store_conformance`: the
journal every mutation appends to, reading and appending, export → import, and branch.

A store whose driver does not keep the ledger (``driver.ledger`` false: a third-party driver written
before it) must say so — ``read_events`` raises :class:`~threadline.errors.AgentStoreCapabilityError` —
rather than fake it: these cases then check exactly that, and nothing else.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import rfc8785

from ..errors import (
    AgentArchiveRejectedError,
    AgentBranchRefusedError,
    AgentConversationPurgedError,
    AgentRecordValidationError,
    AgentStoreCapabilityError,
)
from ..ledger.digests import check_provider_requests, message_digest
from ..ledger.events import AgentStoreEvent, decode_agent_store_event
from ._conformance_kit import StoreFactory, _case, _Conv, _equal, _expect, _raises, _text
from .aggregate import AgentRuntimeStore, purge_agent_conversation

_MUTATIONS = ("accept", "acquire", "checkpoint", "terminal")


async def _journal(store: AgentRuntimeStore, cid: str) -> list[AgentStoreEvent]:
    out: list[AgentStoreEvent] = []
    seq: int | None = 1
    while seq is not None:
        page = await store.read_events(conversation_id=cid, from_seq=seq, limit=10_000)
        out.extend(page.items)
        seq = page.next_seq
    return out


async def _absent(store: AgentRuntimeStore) -> bool:
    """True when the store reports the ledger absent (and then it must refuse to read it)."""
    if store.ledger:
        return False
    await _raises(AgentStoreCapabilityError, "read_events without a ledger", store.read_events, conversation_id="x")
    return True


def _check_journal(events: list[AgentStoreEvent], cid: str, what: str) -> None:
    _equal([e.seq for e in events], list(range(1, len(events) + 1)), f"{what}: seq is contiguous from 1")
    _equal(len({e.event_id for e in events}), len(events), f"{what}: event ids are unique")
    for event in events:
        _equal(event.conversation_id, cid, f"{what}: event {event.seq} conversation")
        _expect(event.occurred_at.tzinfo is not None, f"{what}: occurred_at carries an offset")
        decode_agent_store_event(event)  # a known kind whose payload is its typed record


@_case("ledger_transitions")
async def case_ledger_transitions(store: AgentRuntimeStore) -> None:
    """Every mutation appends its runtime/transition in the same commit, numbered from 1 without a gap,
    recording the version it produced; a refused mutation appends nothing."""
    if await _absent(store):
        return
    c = _Conv(store, "ledger-transitions")
    run = (await c.admit("t1")).run
    run = await c.acquire(run)
    run = await c.checkpoint(run, "partial")
    result = await c.finish(run, text="final answer")
    events = await _journal(store, c.cid)
    _check_journal(events, c.cid, "journal")
    transitions = [decode_agent_store_event(e)[1] for e in events if e.kind == "runtime/transition"]
    _equal([t.type for t in transitions], list(_MUTATIONS), "one transition per mutation, in order")
    _equal([t.version for t in transitions], [1, 2, 3, 4], "each transition records the version it produced")
    _equal(transitions[-1].version, result.version, "the terminal's version")
    digest = transitions[2].input.assistant
    _equal((digest.status, digest.parts, digest.sha256 is not None), ("streaming", 1, True), "checkpoint digest")
    _expect("partial" not in json.dumps(events[2].payload), "a checkpoint record holds a digest, never the draft")
    _equal(
        sorted(events[2].payload["input"]["assistant"]),  # type: ignore[index]
        ["bytes", "id", "parts", "sha256", "status"],
        "a checkpoint's assistant record is its digest fields only",
    )
    _equal([p.text for p in transitions[3].input.parts], ["final answer"], "the terminal carries the full assistant")
    # a refused mutation (stale revision) appends nothing
    await _raises(Exception, "stale checkpoint", c.checkpoint, run, "late")
    _equal(len(await _journal(store, c.cid)), len(events), "a refused mutation appends nothing")


@_case("ledger_read_events")
async def case_ledger_read_events(store: AgentRuntimeStore) -> None:
    """read_events pages by seq: bounded limit, to_seq, next_seq only while more remain; bad arguments
    refused; an unknown conversation has none."""
    if await _absent(store):
        return
    c = _Conv(store, "ledger-read")
    for n in ("a", "b", "c"):
        await c.turn(n)
    events = await _journal(store, c.cid)
    total = len(events)
    _expect(total >= 12, f"three turns append at least twelve events, got {total}")
    page = await store.read_events(conversation_id=c.cid, from_seq=2, limit=5)
    _equal([e.seq for e in page.items], [2, 3, 4, 5, 6], "a page from seq 2")
    _equal(page.next_seq, 7, "next_seq")
    last = await store.read_events(conversation_id=c.cid, from_seq=total - 1, limit=5)
    _equal(([e.seq for e in last.items], last.next_seq), ([total - 1, total], None), "the last page")
    bounded = await store.read_events(conversation_id=c.cid, from_seq=3, to_seq=4)
    _equal(([e.seq for e in bounded.items], bounded.next_seq), ([3, 4], None), "to_seq bounds the range")
    _equal(page.items[0], events[1], "an event reads back the same")
    empty = await store.read_events(conversation_id="ledger-nobody")
    _equal((empty.items, empty.next_seq), ((), None), "an unknown conversation")
    for kwargs in ({"limit": 0}, {"limit": 10_001}, {"from_seq": 0}, {"from_seq": 3, "to_seq": 2}):
        await _raises(
            AgentRecordValidationError, f"read_events({kwargs})", store.read_events, conversation_id=c.cid, **kwargs
        )


@_case("ledger_append_event")
async def case_ledger_append_event(store: AgentRuntimeStore) -> None:
    """append_event takes declared kinds with their typed payloads; concurrent appends stay contiguous; a
    provider/message body is written once; the conversation version does not move."""
    if await _absent(store):
        return
    cid = "ledger-append"
    first = await store.append_event(conversation_id=cid, kind="state/set", payload={"name": "goal", "value": 1})
    _equal(first.seq, 1, "the first event of a new conversation")
    appended = await asyncio.gather(
        *(
            store.append_event(conversation_id=cid, kind="state/set", payload={"name": "goal", "value": n})
            for n in range(20)
        )
    )
    _equal(sorted(e.seq for e in appended), list(range(2, 22)), "twenty concurrent appends: contiguous, none lost")
    for kind, payload, field in (
        ("runtime/transition", {}, "kind"),
        ("no/such-kind", {}, "kind"),
        ("state/set", {"value": 1}, "payload"),
        ("provider/response", {"run_id": "r"}, "payload"),
    ):
        error = await _raises(
            AgentRecordValidationError,
            f"append {kind}",
            store.append_event,
            conversation_id=cid,
            kind=kind,
            payload=payload,
        )
        _expect(str(error.field).startswith(field), f"append {kind}: the error names {field}, got {error.field!r}")
    body = {"kind": "request", "parts": [{"content": "hi", "part_kind": "user-prompt"}]}
    sha = message_digest(body)
    once = await store.append_event(
        conversation_id=cid, kind="provider/message", payload={"sha256": sha, "message": body}
    )
    again = await store.append_event(
        conversation_id=cid, kind="provider/message", payload={"sha256": sha, "message": body}
    )
    _equal(again.seq, once.seq, "a provider/message body is written once")
    events = await _journal(store, cid)
    _check_journal(events, cid, "appended journal")
    _equal(len(events), 22, "nothing else appended")
    _equal((await store.list_active_runs(conversation_id=cid)).version, 0, "appends do not move the version")
    c = _Conv(store, cid)
    await c.turn("t1")  # the conversation goes on after plain events
    _check_journal(await _journal(store, cid), cid, "journal after a turn")
    _equal((await purge_agent_conversation(store, conversation_id=cid)).outcome, "purged", "purge")
    _equal((await store.read_events(conversation_id=cid)).items, (), "purge removes the ledger")
    await _raises(
        AgentConversationPurgedError,
        "append after purge",
        store.append_event,
        conversation_id=cid,
        kind="state/set",
        payload={"name": "goal"},
    )


@_case("ledger_provider_records")
async def case_ledger_provider_records(store: AgentRuntimeStore) -> None:
    """Records declared with an owned commit land before its transition, in the same commit; a body the
    ledger holds is not written again."""
    if await _absent(store):
        return
    c = _Conv(store, "ledger-provider")
    run = await c.acquire((await c.admit("t1")).run)
    body = {"kind": "request", "parts": [{"content": "input t1", "part_kind": "user-prompt"}]}
    sha = message_digest(body)
    message = {"kind": "provider/message", "payload": {"sha256": sha, "message": body}}
    request = {
        "kind": "provider/request",
        "payload": {
            "run_id": run.id,
            "attempt": 1,
            "step_number": 0,
            "instructions_sha256": "0" * 64,
            "prefix": {"count": 0, "sha256": "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"},
            "message_shas": [sha],
        },
    }
    result = await store.checkpoint_run_assistant(
        conversation_id=c.cid,
        run_id=run.id,
        expected_revision=run.revision,
        owner_id="owner-a",
        fencing_token=run.fencing_token,
        parts=_text("draft"),
        events=[message, message, request],
    )
    run = result.run
    await store.record_run_operation(
        conversation_id=c.cid,
        run_id=run.id,
        expected_revision=run.revision,
        owner_id="owner-a",
        fencing_token=run.fencing_token,
        operation={
            "kind": "model-request",
            "phase": "started",
            "operation_id": "op2",
            "step": 1,
            "started_at": "2030-01-01T00:00:00Z",
        },
        events=[message, {**request, "payload": {**request["payload"], "step_number": 1}}],
    )
    kinds = [e.kind for e in await _journal(store, c.cid)]
    _equal(
        kinds,
        [
            "runtime/transition",
            "runtime/transition",
            "provider/message",
            "provider/request",
            "runtime/transition",
            "provider/request",
            "runtime/transition",
        ],
        "declared records precede their commit's transition; a body is written once",
    )
    _equal(check_provider_requests(await _journal(store, c.cid)), [], "the requests check against their bodies")
    await _raises(
        AgentRecordValidationError,
        "a runtime kind declared",
        store.record_run_operation,
        conversation_id=c.cid,
        run_id=run.id,
        expected_revision=run.revision + 1,
        owner_id="owner-a",
        fencing_token=run.fencing_token,
        operation={
            "kind": "model-request",
            "phase": "started",
            "operation_id": "op3",
            "started_at": "2030-01-01T00:00:00Z",
        },
        events=[{"kind": "runtime/baseline", "payload": {}}],
    )


@_case("ledger_export_import")
async def case_ledger_export_import(store: AgentRuntimeStore, factory: StoreFactory) -> None:
    """Export → import into an empty store → export is byte-identical; receipts, queue order and the journal
    come back; an import into a store holding the conversation is refused, writing nothing."""
    if await _absent(store):
        return
    c = _Conv(store, "ledger-export")
    await c.turn("t1")
    await store.append_event(conversation_id=c.cid, kind="state/set", payload={"name": "topic", "value": "archive"})
    await c.turn("t2")
    await c.compact(["t1:in", "t1:out"], "s1")
    running = await c.acquire((await c.admit("t3")).run)
    await c.checkpoint(running, "half an answer")
    await c.admit("t4")  # queued behind t3
    await c.admit("t5", priority="urgent")
    data = await store.export_conversation(c.cid)
    _equal(data, rfc8785.dumps(json.loads(data)), "an archive is canonical JSON")
    error = await _raises(AgentArchiveRejectedError, "import into its own store", store.import_conversation, data)
    _equal(error.code, "IMPORT_TARGET_EXISTS", "the refusal names the offence")
    async with factory() as other:
        result = await other.import_conversation(data)
        _equal((result.conversation_id, result.events), (c.cid, len(await _journal(store, c.cid))), "import result")
        _equal(await other.export_conversation(c.cid), data, "export -> import -> export is byte-identical")
        _equal(
            await other.load_snapshot(conversation_id=c.cid),
            await store.load_snapshot(conversation_id=c.cid),
            "snapshot",
        )
        _equal(
            [r.id for r in (await other.list_active_runs(conversation_id=c.cid)).runs],
            [r.id for r in (await store.list_active_runs(conversation_id=c.cid)).runs],
            "queue order",
        )
        retry = await _Conv(other, c.cid).admit("t2")
        _equal((retry.outcome, retry.run.id), ("duplicate", c.run("t2")), "an idempotent retry resolves to its run")
        more = await other.append_event(conversation_id=c.cid, kind="state/set", payload={"name": "n", "value": 2})
        _equal(more.seq, result.events + 1, "the journal continues after the imported events")


def _tamper(data: bytes, change: Any) -> bytes:
    """The archive with ``change`` applied to its JSON and its digest made to match (a careful forger)."""
    import hashlib

    value = json.loads(data)
    value.pop("sha256")
    change(value)
    value["sha256"] = hashlib.sha256(rfc8785.dumps(value)).hexdigest()
    return rfc8785.dumps(value)


@_case("ledger_import_refusals")
async def case_ledger_import_refusals(store: AgentRuntimeStore, factory: StoreFactory) -> None:
    """A truncated, reordered, foreign, oversized, tampered or unknown-kind archive is refused with its
    code, and the target stays empty."""
    if await _absent(store):
        return
    c = _Conv(store, "ledger-refusals")
    await c.turn("t1")
    await c.turn("t2")
    data = await store.export_conversation(c.cid)

    def swap(v: Any) -> None:
        v["events"][1], v["events"][2] = v["events"][2], v["events"][1]

    def foreign(v: Any) -> None:
        v["events"][0]["conversation_id"] = "someone-else"

    def unknown(v: Any) -> None:
        v["events"][-1]["kind"] = "future/kind"

    def drop_last(v: Any) -> None:
        v["events"].pop()

    def rewrite_answer(v: Any) -> None:
        for m in v["snapshot"]["messages"]:
            if m["role"] == "assistant":
                m["parts"] = [{"type": "text", "text": "words nobody said"}]

    def rewrite_transition(v: Any) -> None:
        for e in v["events"]:
            if e["kind"] == "runtime/transition" and e["payload"]["type"] == "terminal":
                e["payload"]["input"]["parts"] = [{"type": "text", "text": "words nobody said"}]

    cases = [
        ("truncated", data[: len(data) // 2], "ARCHIVE_MALFORMED"),
        ("edited by hand", data.replace(b"answer t1", b"answer tX"), "ARCHIVE_DIGEST"),
        ("re-encoded", json.dumps(json.loads(data), indent=1).encode(), "ARCHIVE_MALFORMED"),
        ("reordered", _tamper(data, swap), "ARCHIVE_SEQUENCE"),
        ("foreign", _tamper(data, foreign), "ARCHIVE_FOREIGN"),
        ("unknown kind", _tamper(data, unknown), "ARCHIVE_UNKNOWN_KIND"),
        ("missing its last event", _tamper(data, drop_last), "ARCHIVE_SEQUENCE"),
        ("snapshot rewritten", _tamper(data, rewrite_answer), "ARCHIVE_SNAPSHOT"),
        ("journal rewritten", _tamper(data, rewrite_transition), "ARCHIVE_SNAPSHOT"),
    ]
    async with factory() as other:
        for what, bad, code in cases:
            error = await _raises(AgentArchiveRejectedError, f"a {what} archive", other.import_conversation, bad)
            _equal(error.code, code, f"a {what} archive")
        from ..ledger.archive import decode_archive

        error = await _raises(
            AgentArchiveRejectedError, "oversized", _async(decode_archive), data, max_bytes=len(data) - 1
        )
        _equal(error.code, "ARCHIVE_TOO_LARGE", "an oversized archive")
        _equal((await other.read_events(conversation_id=c.cid)).items, (), "nothing written by a refused import")
        _equal((await other.load_snapshot(conversation_id=c.cid)).version, 0, "nothing written by a refused import")


def _async(fn: Any) -> Any:
    async def call(*args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)

    return call


@_case("ledger_branch")
async def case_ledger_branch(store: AgentRuntimeStore) -> None:
    """A branch copies a settled prefix under new identities, returns the same receipt to a retry, refuses a
    changed request, an existing destination and a prefix with an active run, and the copy goes on."""
    if await _absent(store):
        return
    c = _Conv(store, "ledger-branch")
    await c.turn("t1")
    await store.append_event(conversation_id=c.cid, kind="state/set", payload={"name": "goal", "value": "ship"})
    await c.turn("t2")
    active = await c.acquire((await c.admit("t3")).run)  # a later active run
    source = {"kind": "conversation", "conversation_id": c.cid, "through_run_id": c.run("t2")}
    created = await store.branch_conversation(
        request_key="b1", destination_conversation_id="ledger-copy", source=source
    )
    _equal(created.outcome, "created", "a branch")
    receipt = created.receipt
    _equal(
        (receipt.source_conversation_id, receipt.through_run_id), (c.cid, c.run("t2")), "the receipt binds the source"
    )
    copy = await store.load_snapshot(conversation_id="ledger-copy")
    _equal(
        [(m.role, m.parts) for m in copy.messages],
        [(m.role, m.parts) for m in (await c.snapshot()).messages if m.run_id in (c.run("t1"), c.run("t2"))],
        "the copy holds the selected history",
    )
    _expect(not ({m.id for m in copy.messages} & {m.id for m in (await c.snapshot()).messages}), "new message ids")
    _expect(all(r.owner_id is None and r.fencing_token == 0 for r in copy.runs), "no owner or fence is copied")
    events = await _journal(store, "ledger-copy")
    _check_journal(events, "ledger-copy", "the copy's journal")
    _equal([e.kind for e in events[:1]], ["runtime/baseline"], "the copy's journal starts with its baseline")
    _expect(any(e.kind == "runtime/branch-observation" for e in events), "state facts are inert observations")
    again = await store.branch_conversation(request_key="b1", destination_conversation_id="ledger-copy", source=source)
    _equal((again.outcome, again.receipt), ("duplicate", receipt), "a retry returns the original receipt")
    error = await _raises(
        AgentBranchRefusedError,
        "a changed request",
        store.branch_conversation,
        request_key="b1",
        destination_conversation_id="ledger-copy",
        source={**source, "through_run_id": c.run("t1")},
    )
    _equal(error.code, "BRANCH_REQUEST_CONFLICT", "a changed request conflicts")
    error = await _raises(
        AgentBranchRefusedError,
        "an active prefix",
        store.branch_conversation,
        request_key="b2",
        destination_conversation_id="ledger-copy-2",
        source={"kind": "conversation", "conversation_id": c.cid},
    )
    _equal(error.code, "BRANCH_RUN_ACTIVE", "the tip has an active run")
    _equal((await store.read_events(conversation_id="ledger-copy-2")).items, (), "a refused branch writes nothing")
    error = await _raises(
        AgentBranchRefusedError,
        "through an active run",
        store.branch_conversation,
        request_key="b3",
        destination_conversation_id="ledger-copy-3",
        source={**source, "through_run_id": active.id},
    )
    _equal(error.code, "BRANCH_RUN_ACTIVE", "a run still active")
    error = await _raises(
        AgentBranchRefusedError,
        "an existing destination",
        store.branch_conversation,
        request_key="b4",
        destination_conversation_id=c.cid,
        source=source,
    )
    _equal(error.code, "BRANCH_DESTINATION_EXISTS", "never overwrites")
    follow = _Conv(store, "ledger-copy")
    await follow.turn("t9")  # the next ordinary admission continues the copy
    order = [m.role for m in (await follow.snapshot()).messages]
    _equal(order, ["user", "assistant", "user", "assistant", "user", "assistant"], "the copy continues")
    archive = await store.export_conversation(c.cid)
    from_archive = await store.branch_conversation(
        request_key="b5",
        destination_conversation_id="ledger-copy-4",
        source={"kind": "archive", "bytes": archive, "through_run_id": c.run("t1")},
    )
    _equal(from_archive.receipt.source_kind, "archive", "a branch from an archive")
    for selector in (
        {"kind": "archive", "bytes": archive, "through_run_id": ""},
        {"kind": "conversation", "conversation_id": c.cid, "through_run_id": ""},
    ):  # an empty run id is a mistake, never "the settled tip"
        await _raises(
            AgentRecordValidationError,
            f"an empty through_run_id ({selector['kind']})",
            store.branch_conversation,
            request_key="b6",
            destination_conversation_id="ledger-copy-6",
            source=selector,
        )


@_case("ledger_branch_copy_transfers")
async def case_ledger_branch_copy_transfers(store: AgentRuntimeStore, factory: StoreFactory) -> None:
    """A branched conversation is an ordinary conversation: with the records copied after its baseline and a
    turn of its own, it exports, imports into an empty store (export -> import -> export byte-identical)
    and branches again."""
    if await _absent(store):
        return
    c = _Conv(store, "ledger-branch-transfer")
    await c.turn("t1")
    await store.append_event(conversation_id=c.cid, kind="state/set", payload={"name": "goal", "value": "ship"})
    await c.turn("t2")
    copy = "ledger-branch-transfer-copy"
    await store.branch_conversation(
        request_key="x1", destination_conversation_id=copy, source={"kind": "conversation", "conversation_id": c.cid}
    )
    kinds = [e.kind for e in await _journal(store, copy)]
    _equal(kinds, ["runtime/baseline", "runtime/branch-observation"], "the copy's journal")
    await _Conv(store, copy).turn("t3")
    data = await store.export_conversation(copy)
    async with factory() as other:
        result = await other.import_conversation(data)
        _equal(result.conversation_id, copy, "the copy imports")
        _equal(await other.export_conversation(copy), data, "export -> import -> export is byte-identical")
        _equal(
            await other.load_snapshot(conversation_id=copy),
            await store.load_snapshot(conversation_id=copy),
            "the imported copy",
        )
    again = await store.branch_conversation(
        request_key="x2",
        destination_conversation_id="ledger-branch-transfer-again",
        source={"kind": "conversation", "conversation_id": copy},
    )
    _equal((again.outcome, again.receipt.source_conversation_id), ("created", copy), "a copy branches again")
    _equal(
        [m.parts for m in (await store.load_snapshot(conversation_id="ledger-branch-transfer-again")).messages],
        [m.parts for m in (await store.load_snapshot(conversation_id=copy)).messages],
        "the second copy holds the first copy's history",
    )


@_case("ledger_branch_approvals")
async def case_ledger_branch_approvals(store: AgentRuntimeStore) -> None:
    """A branch gives approvals new ids like every engine identity — a request and its response still match
    in the copy — and removes the request's signature."""
    if await _absent(store):
        return
    c = _Conv(store, "ledger-branch-approval")
    run = await c.acquire((await c.admit("t1")).run)
    await c.finish(
        run,
        parts=[
            {"type": "tool-call", "call_id": "call-1", "tool_name": "rm", "input": {"path": "x"}},
            {
                "type": "approval-request",
                "approval_id": "ap-source",
                "call_id": "call-1",
                "tool_name": "rm",
                "input": {"path": "x"},
                "signature": "signed-by-the-source",
            },
        ],
    )
    response = {"type": "approval-response", "approval_id": "ap-source", "call_id": "call-1", "approved": True}
    run = await c.acquire((await c.admit("t2", input={"id": c.inp("t2"), "role": "tool", "parts": [response]})).run)
    await c.finish(run, text="removed")
    await store.branch_conversation(
        request_key="a1",
        destination_conversation_id="ledger-branch-approval-copy",
        source={"kind": "conversation", "conversation_id": c.cid},
    )
    parts = [
        p for m in (await store.load_snapshot(conversation_id="ledger-branch-approval-copy")).messages for p in m.parts
    ]
    requests = [p for p in parts if p.type == "approval-request"]
    responses = [p for p in parts if p.type == "approval-response"]
    _equal((len(requests), len(responses)), (1, 1), "the copy holds the request and its response")
    _expect(requests[0].approval_id != "ap-source", "the approval has a new id")  # type: ignore[union-attr]
    _equal(requests[0].approval_id, responses[0].approval_id, "the request and its response still match")  # type: ignore[union-attr]
    _equal(requests[0].signature, None, "the signature is removed")  # type: ignore[union-attr]


@_case("ledger_branch_metadata_reference")
async def case_ledger_branch_metadata_reference(store: AgentRuntimeStore) -> None:
    """Message metadata and a part's provider metadata are copied as they are: a key in them that names an
    engine identity (a run id, say, at any depth) refuses the branch before anything is written, naming the
    message and the path; other metadata is copied unchanged."""
    if await _absent(store):
        return
    c = _Conv(store, "ledger-branch-ref")
    run = await c.acquire(
        (await c.admit("t1", input={"metadata": {"ticket": {"links": [{"run_id": "run-from-elsewhere"}]}}})).run
    )
    await c.finish(run, text="answer t1")
    source = {"kind": "conversation", "conversation_id": c.cid}
    error = await _raises(
        AgentBranchRefusedError,
        "metadata naming a run",
        store.branch_conversation,
        request_key="r1",
        destination_conversation_id="ledger-branch-ref-copy",
        source=source,
    )
    _equal(error.code, "BRANCH_METADATA_REFERENCE", "a runtime reference key in metadata")
    _expect("metadata.ticket.links[0]" in str(error) and c.inp("t1") in str(error), "the error names the place")
    _equal(
        (await store.read_events(conversation_id="ledger-branch-ref-copy")).items, (), "a refused branch writes nothing"
    )
    plain = _Conv(store, "ledger-branch-plain")
    run = await plain.acquire(
        (await plain.admit("t1", input={"metadata": {"ticket": {"id": "T-7", "links": ["x"]}}})).run
    )
    await plain.finish(run, text="answer t1")
    await store.branch_conversation(
        request_key="r2",
        destination_conversation_id="ledger-branch-plain-copy",
        source={"kind": "conversation", "conversation_id": plain.cid},
    )
    copied = (await store.load_snapshot(conversation_id="ledger-branch-plain-copy")).messages
    _equal(copied[0].metadata, {"ticket": {"id": "T-7", "links": ["x"]}}, "other metadata is copied unchanged")
    # provider metadata on a part (its envelope) is opaque data under the same guard, and otherwise retained
    envelope = _Conv(store, "ledger-branch-envelope")
    for n, data in (("t1", {"item": "rs_1", "signature": "abc"}), ("t2", {"items": [{"runId": "run-elsewhere"}]})):
        run = await envelope.acquire((await envelope.admit(n)).run)
        await envelope.finish(
            run,
            parts=[
                {"type": "reasoning", "text": "thinking", "envelope": {"provider": "openai", "data": data}},
                {"type": "text", "text": f"answer {n}"},
            ],
        )
    error = await _raises(
        AgentBranchRefusedError,
        "provider metadata naming a run",
        store.branch_conversation,
        request_key="r3",
        destination_conversation_id="ledger-branch-envelope-copy",
        source={"kind": "conversation", "conversation_id": envelope.cid},
    )
    _equal(error.code, "BRANCH_METADATA_REFERENCE", "a runtime reference key in a part's provider metadata")
    place = "parts[0].envelope.data.items[0]"
    _expect(place in str(error) and envelope.out("t2") in str(error), "the error names the place")
    _equal(
        (await store.read_events(conversation_id="ledger-branch-envelope-copy")).items,
        (),
        "a refused branch writes nothing",
    )
    await store.branch_conversation(
        request_key="r4",
        destination_conversation_id="ledger-branch-envelope-early",
        source={"kind": "conversation", "conversation_id": envelope.cid, "through_run_id": envelope.run("t1")},
    )
    answer = (await store.load_snapshot(conversation_id="ledger-branch-envelope-early")).messages[1]
    _equal(
        answer.parts[0].envelope.data,  # type: ignore[union-attr]
        {"item": "rs_1", "signature": "abc"},
        "provider metadata is retained",
    )


@_case("ledger_branch_provider_records")
async def case_ledger_branch_provider_records(store: AgentRuntimeStore) -> None:
    """A branch checks the selected provider records as an import does: a request naming digests no body
    before it holds (appended by hand) refuses the branch before anything is written, so no copy exists
    that an import would refuse; a prefix selected before that record still branches."""
    if await _absent(store):
        return
    c = _Conv(store, "ledger-branch-provider")
    await c.turn("t1")
    await store.append_event(
        conversation_id=c.cid,
        kind="provider/request",
        payload={
            "run_id": c.run("t1"),
            "attempt": 1,
            "step_number": 0,
            "instructions_sha256": "0" * 64,
            "prefix": {"count": 2, "sha256": "1" * 64},
            "message_shas": ["2" * 64],
        },
    )
    await c.turn("t2")
    error = await _raises(
        AgentBranchRefusedError,
        "unchecked provider records",
        store.branch_conversation,
        request_key="p1",
        destination_conversation_id="ledger-branch-provider-copy",
        source={"kind": "conversation", "conversation_id": c.cid},
    )
    _equal(error.code, "BRANCH_SOURCE_INVALID", "provider records that do not check")
    _equal(
        (await store.read_events(conversation_id="ledger-branch-provider-copy")).items,
        (),
        "a refused branch writes nothing",
    )
    earlier = await store.branch_conversation(
        request_key="p2",
        destination_conversation_id="ledger-branch-provider-early",
        source={"kind": "conversation", "conversation_id": c.cid, "through_run_id": c.run("t1")},
    )
    _equal(earlier.outcome, "created", "a prefix before the bad record")


@_case("ledger_durable_steps")
async def case_ledger_durable_steps(store: AgentRuntimeStore, factory: StoreFactory) -> None:
    """Durable steps kept in the ledger (what ``create_local_step_durability(store=)`` stands on,
    :mod:`threadline.store.effects`): a claim commits an intent under every key or returns what a key
    holds; a proof is committed once per key; keys are found with the same work at any conversation
    length; intents and proofs survive compaction and export → import into another store; a branch keeps
    them only as inert observations; applications cannot append them, and an archive with a second proof
    of one key is refused."""
    from .effects import accept_step_effect, claim_step_effect, read_step_effect

    if await _absent(store):
        await _raises(
            AgentStoreCapabilityError,
            "durable steps without a ledger",
            read_step_effect,
            store,
            conversation_id="x",
            run_id="r",
            effect_name="e",
        )
        return
    c = _Conv(store, "ledger-steps")
    await c.turn("t1")
    run, joined = c.run("t1"), c.run("t2")
    proof = json.dumps({"refund": "R-7", "cents": 2**60})

    async def claim(name: str, *run_ids: str) -> Any:
        return await claim_step_effect(store, conversation_id=c.cid, run_ids=run_ids or (run,), effect_name=name)

    async def accept(name: str, value: str, *run_ids: str, reconciled: bool = False) -> Any:
        return await accept_step_effect(
            store,
            conversation_id=c.cid,
            run_ids=run_ids or (run,),
            effect_name=name,
            value_json=value,
            reconciled=reconciled,
        )

    _equal(await claim("refund:7"), None, "a new key is claimed")
    intent = await claim("refund:7")
    _expect(intent is not None and intent.accepted is None, "a second claim sees the bare intent")
    _equal(await accept("refund:7", proof), None, "the proof is committed")
    again = await accept("refund:7", "1")
    _expect(again is not None and again.accepted is not None, "a second proof is not written")
    _equal(again.accepted.payload["value_json"], proof, "the first proof stands")
    _equal(await claim("mail:1"), None, "another effect: a bare intent is left")
    _equal(await claim("ticket", run, joined), None, "one claim for a run and the run it joined")
    _equal(await accept("ticket", '"T-1"', run, joined), None, "one proof for both")
    held = await claim("ticket", joined)
    _expect(held is not None and held.run_id == joined and held.accepted is not None, "the joined run's key")
    events = await _journal(store, c.cid)
    steps = [decode_agent_store_event(e)[1] for e in events if e.kind == "durability/effect"]
    _equal(
        [(s.run_id, s.effect_name, s.status) for s in steps],
        [
            (run, "refund:7", "intent"),
            (run, "refund:7", "accepted"),
            (run, "mail:1", "intent"),
            (run, "ticket", "intent"),
            (joined, "ticket", "intent"),
            (run, "ticket", "accepted"),
            (joined, "ticket", "accepted"),
        ],
        "intents before proofs, under every key",
    )
    error = await _raises(
        AgentRecordValidationError,
        "append a durability/effect",
        store.append_event,
        conversation_id=c.cid,
        kind="durability/effect",
        payload={"run_id": run, "effect_name": "forged", "status": "accepted", "value_json": "1"},
    )
    _equal(error.field, "kind", "durable steps are the store's to write")

    async def claim_rows(name: str) -> int:  # a new key: its lookup and its intent
        before = store.metrics["claim_step_effect"].rows_read
        await claim(name)
        return store.metrics["claim_step_effect"].rows_read - before

    short = await claim_rows("short")
    for n in range(2, 8):
        await c.turn(f"t{n}")
    _equal(await claim_rows("long"), short, "rows read by a claim do not grow with the conversation")
    await c.compact(["t1:in", "t1:out", "t2:in", "t2:out"], "s1")

    async def check(target: AgentRuntimeStore, where: str) -> None:
        found = await read_step_effect(target, conversation_id=c.cid, run_id=run, effect_name="refund:7")
        _expect(found is not None and found.accepted is not None, f"{where}: the proof")
        _equal(found.accepted.payload["value_json"], proof, f"{where}: the proof's value")
        found = await read_step_effect(target, conversation_id=c.cid, run_id=joined, effect_name="ticket")
        _expect(found is not None and found.accepted is not None, f"{where}: the joined run's proof")
        found = await read_step_effect(target, conversation_id=c.cid, run_id=run, effect_name="mail:1")
        _expect(found is not None and found.intent is not None and found.accepted is None, f"{where}: bare intent")

    await check(store, "after compaction")
    data = await store.export_conversation(c.cid)
    async with factory() as other:
        await other.import_conversation(data)
        await check(other, "after import")
        held = await claim_step_effect(other, conversation_id=c.cid, run_ids=(run,), effect_name="mail:1")
        _expect(held is not None and held.accepted is None, "after import: a claim finds the bare intent")
        _equal(
            await accept_step_effect(
                other,
                conversation_id=c.cid,
                run_ids=(run,),
                effect_name="mail:1",
                value_json='"sent"',
                reconciled=True,
            ),
            None,
            "after import: the bare intent takes its (reconciled) proof",
        )
    await check(store, "the source, unchanged by the import's proof")

    def second_proof(v: Any) -> None:  # a forged proof for a key that has one
        first = next(
            e for e in v["events"] if e["kind"] == "durability/effect" and e["payload"]["status"] == "accepted"
        )
        v["events"].append({**first, "event_id": "evt_forged", "seq": len(v["events"]) + 1})
        v["snapshot"]["head"]["event_seq"] += 1

    async with factory() as other:
        error = await _raises(
            AgentArchiveRejectedError, "a second proof", other.import_conversation, _tamper(data, second_proof)
        )
        _equal(error.code, "ARCHIVE_DUPLICATE_ID", "one intent and one proof per key")

    copy = await store.branch_conversation(
        request_key="steps",
        destination_conversation_id="ledger-steps-copy",
        source={"kind": "conversation", "conversation_id": c.cid},
    )
    copied = await _journal(store, copy.receipt.destination_conversation_id)
    _expect(not any(e.kind == "durability/effect" for e in copied), "a branch inherits no durable step")
    observed = [e.payload for e in copied if e.kind == "runtime/branch-observation"]
    _expect(any(p["kind"] == "durability/effect" for p in observed), "... it keeps them as inert observations")
