"""How ledger bodies are written: stored compressed and read back, blobs of an earlier format still read, and
the canonical bytes a provider message's digest is taken of."""

from __future__ import annotations

import hashlib
import json
import zlib
from datetime import UTC, datetime

import pytest
from pydantic_ai.messages import BinaryContent, ModelRequest, ModelResponse, ToolCallPart, UserPromptPart

from threadline.ledger import AgentStoreEvent
from threadline.ledger.digests import PrefixDigests, canonical, message_body, message_digest
from threadline.store.codec import _DICTIONARY_1, PACK_FROM, encode_event, encode_event_bytes, pack, unpack


def _event(payload: dict) -> AgentStoreEvent:
    return AgentStoreEvent(
        event_id="evt_1",
        conversation_id="c1",
        seq=3,
        kind="state/set",
        occurred_at=datetime(2026, 12, 2, 10, 0, 0, 123456, tzinfo=UTC),
        payload=payload,
    )


def test_a_long_body_is_stored_compressed_and_read_back_exactly() -> None:
    body = json.dumps({"name": "notes", "value": "é" * 400}, ensure_ascii=False).encode()
    stored = pack(body)
    assert isinstance(stored, bytes) and stored[:1] == b"\x02" and len(stored) < len(body) // 4
    assert unpack(stored) == body
    assert pack(body.decode()) == stored  # text or its bytes: the same blob


def test_a_short_body_stays_text() -> None:
    assert pack(b'{"a":1}') == '{"a":1}' and len('{"a":1}') < PACK_FROM


def test_a_blob_of_the_earlier_zlib_format_is_still_read() -> None:
    body = json.dumps({"kind": "runtime/transition", "x": "y" * 300}).encode()
    packer = zlib.compressobj(1, zlib.DEFLATED, 12, 5, zlib.Z_DEFAULT_STRATEGY, _DICTIONARY_1)
    assert unpack(b"\x01" + packer.compress(body) + packer.flush()) == body


def test_a_blob_that_is_not_ours_is_handed_back_for_the_decoder_to_refuse() -> None:
    assert unpack(b"\x02not zstd at all") == b"\x02not zstd at all"


def test_an_event_is_written_as_pydantic_writes_it() -> None:
    event = _event({"name": "n", "value": {"big": 2**70, "t": "ü", "f": 0.1}})
    written = json.loads(encode_event(event))
    assert written["occurred_at"] == "2026-12-02T10:00:00.123456Z"  # UTC as Z, like every stored record
    # an integer beyond 64 bits (which orjson cannot write) exactly, through the standard library's encoder
    assert written["payload"]["value"] == {"big": 2**70, "t": "ü", "f": 0.1}
    assert encode_event_bytes(event) == encode_event(event).encode()
    assert AgentStoreEvent.model_validate_json(encode_event(event)) == event


def test_canonical_bytes_sort_keys_and_keep_what_orjson_cannot_write() -> None:
    assert canonical({"b": 1, "a": [1.5, "x"]}) == b'{"a":[1.5,"x"],"b":1}'
    # a lone surrogate and an integer beyond 64 bits take the standard library's path, the same every time
    assert canonical({"s": "\ud800"}) == '{"s":"\ud800"}'.encode("utf-8", "surrogatepass")
    assert canonical({"n": 2**70}) == b'{"n":1180591620717411303424}'


def test_a_body_leaves_out_bookkeeping_and_records_binary_content_by_digest() -> None:
    data = b"\x89PNG" + bytes(100)
    request = ModelRequest(parts=[UserPromptPart(content=["look", BinaryContent(data=data, media_type="image/png")])])
    body = message_body(request)
    assert "timestamp" not in json.dumps(body)
    assert body["parts"][0]["content"][1] == {"binary": True, "sha256": hashlib.sha256(data).hexdigest(), "bytes": 104}
    response = ModelResponse(parts=[ToolCallPart("lookup", {"q": "x"}, tool_call_id="c1")], model_name="m")
    assert message_body(response) == {
        "parts": [{"tool_name": "lookup", "args": {"q": "x"}, "tool_call_id": "c1", "part_kind": "tool-call"}],
        "model_name": "m",
        "kind": "response",
    }


def test_a_tail_message_is_digested_once_per_object() -> None:
    state = PrefixDigests()
    message = ModelRequest(parts=[UserPromptPart(content="hello")])
    first = state.tail_digest(message)
    assert state.tail_digest(message) is not None and state.tail_digest(message)[1] == first[1]
    assert first[1] == message_digest(message_body(message))
    twin = ModelRequest(parts=[UserPromptPart(content="hello")])
    assert state.tail_digest(twin)[1] == first[1]  # a different object with the same content: the same digest
    assert len(state.tail) == 2


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_a_float_json_cannot_spell_is_written_null(value: float) -> None:
    assert json.loads(encode_event(_event({"name": "n", "value": value})))["payload"]["value"] is None
    assert canonical({"v": value}) == b'{"v":null}'


async def test_an_appended_payload_with_a_float_json_cannot_spell_is_refused_with_nothing_written() -> None:
    from threadline import create_memory_agent_runtime_store
    from threadline.errors import AgentRecordValidationError

    store = create_memory_agent_runtime_store()
    with pytest.raises(AgentRecordValidationError) as info:
        await store.append_event(conversation_id="c1", kind="state/set", payload={"name": "n", "value": float("nan")})
    assert info.value.field == "payload"
    assert (await store.read_events(conversation_id="c1")).items == ()
    kept = await store.append_event(conversation_id="c1", kind="state/set", payload={"name": "n", "value": 1.5})
    assert kept.payload == {"name": "n", "value": 1.5}
