"""SSE per conversation with ``Last-Event-ID`` resume through the durable snapshot, the REST surface, bearer
authentication and CORS, over real HTTP on loopback (issue 21 item 4)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from threadline import define_agent_tool
from threadline.server import AgentServerSettings, create_agent_harness_app, static_bearer_token

from .conftest import SECRET, WAIT, Scripted, make_harness, serving


class Stream:
    """One SSE response read event by event."""

    def __init__(self, response: httpx.Response) -> None:
        self.response = response
        self.lines = response.aiter_lines()

    async def next(self) -> dict[str, Any]:
        async def read() -> dict[str, Any]:
            event: dict[str, Any] = {}
            async for line in self.lines:
                if line == "":
                    if "event" in event:
                        return event
                    event = {}
                    continue
                if line.startswith(":"):
                    continue
                name, _, value = line.partition(": ")
                event[name] = json.loads(value) if name == "data" else value
            raise EOFError("the stream ended")

        return await asyncio.wait_for(read(), WAIT)

    async def until(self, kind: str) -> list[dict[str, Any]]:
        seen = []
        while True:
            event = await self.next()
            seen.append(event)
            if event["event"] == kind:
                return seen


@pytest.fixture
async def http(scripted: Scripted) -> AsyncIterator[tuple[httpx.AsyncClient, Any]]:
    harness = make_harness(scripted)
    async with (
        serving(create_agent_harness_app(harness)) as base,
        httpx.AsyncClient(base_url=f"http://{base}") as client,
    ):
        yield client, harness
    await harness.close()


async def post_input(client: httpx.AsyncClient, key: str, text: str, conversation: str = "c1") -> dict[str, Any]:
    response = await client.post(
        f"/conversations/{conversation}/inputs",
        json={"idempotency_key": key, "text": text, "context": {"user_id": "u1"}},
    )
    assert response.status_code == 202, response.text
    return response.json()


async def test_sse_streams_a_snapshot_then_live_events(http: Any) -> None:
    client, _harness = http
    async with client.stream("GET", "/conversations/c1/events") as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        stream = Stream(response)
        first = await stream.next()
        assert first["event"] == "snapshot" and first["data"]["version"] == 0 and first["id"] == "0"
        admission = await post_input(client, "k1", "hello stream")
        events = await stream.until("terminal")
    kinds = [e["event"] for e in events]
    assert kinds[0] == "admission" and events[0]["data"]["run"]["id"] == admission["run"]["id"]
    assert "".join(e["data"]["delta"] for e in events if e["event"] == "assistant-delta") == "answer to: hello stream"
    versions = [int(e["id"].split(":")[0]) for e in events]
    assert versions == sorted(versions), "ids carry the version the stream reached"
    transient = [e for e in events if e["event"] == "assistant-delta"]
    assert all(e["id"].split(":")[1] == admission["run"]["id"] for e in transient)


async def test_resuming_with_the_last_event_id_skips_the_snapshot_only_when_nothing_was_missed(http: Any) -> None:
    client, _harness = http
    async with client.stream("GET", "/conversations/c1/events") as response:
        stream = Stream(response)
        await stream.next()
        await post_input(client, "k1", "first")
        last = (await stream.until("terminal"))[-1]["id"]

    async with client.stream("GET", "/conversations/c1/events", headers={"Last-Event-ID": last}) as response:
        stream = Stream(response)
        await post_input(client, "k2", "second")
        resumed = await stream.next()
        assert resumed["event"] == "admission", "caught up: the stream goes on without a snapshot"
        await stream.until("terminal")

    async with client.stream("GET", "/conversations/c1/events", headers={"Last-Event-ID": last}) as response:
        first = await Stream(response).next()
        assert first["event"] == "snapshot", "behind: the snapshot comes first"
        assert [r["terminal_reason"] for r in first["data"]["runs"]] == ["success", "success"]


async def test_resuming_mid_run_continues_the_sequence_or_resyncs() -> None:
    scripted = Scripted()
    scripted.gate(0)  # the answer stops after its first word until released
    harness = make_harness(scripted)
    async with (
        serving(create_agent_harness_app(harness)) as base,
        httpx.AsyncClient(base_url=f"http://{base}") as client,
    ):
        async with client.stream("GET", "/conversations/c1/events") as response:
            stream = Stream(response)
            await stream.next()
            await post_input(client, "k1", "one two three")
            first_delta = (await stream.until("assistant-delta"))[-1]
        _version, run_id, epoch, sequence = first_delta["id"].split(":")

        async with client.stream(
            "GET", "/conversations/c1/events", headers={"Last-Event-ID": first_delta["id"]}
        ) as response:
            stream = Stream(response)
            scripted.gates[0].set()
            events = await stream.until("terminal")
        assert events[0]["event"] != "snapshot", "at the live position: no snapshot"
        sequences = [int(e["id"].split(":")[3]) for e in events if e["id"].count(":") == 3]
        assert sequences[0] == int(sequence) + 1, "the transient sequence goes on without a gap"

        stale = f"{_version}:{run_id}:{epoch}:{int(sequence) - 1 if int(sequence) > 1 else 99}"
        async with client.stream("GET", "/conversations/c1/events", headers={"Last-Event-ID": stale}) as response:
            assert (await Stream(response).next())["event"] == "snapshot"
    await harness.close()


async def test_the_rest_surface(http: Any) -> None:
    client, _harness = http
    admission = await post_input(client, "k1", "hello rest")
    snapshot = await client.get("/conversations/c1")
    assert snapshot.status_code == 200 and snapshot.json()["conversation_id"] == "c1"
    again = await post_input(client, "k1", "hello rest")
    assert again["outcome"] == "duplicate" and again["run"]["id"] == admission["run"]["id"]
    page = await client.get("/conversations", params={"limit": 10})
    assert [c["conversation_id"] for c in page.json()["items"]] == ["c1"]
    assert (await client.get("/conversations", params={"limit": 0})).json()["error"]["field"] == "limit"

    bad = await client.post("/conversations/c1/inputs", json={"idempotency_key": "k2"})
    assert bad.status_code == 422 and bad.json()["error"]["code"] == "REQUEST_REJECTED"
    wrong_part = await client.post(
        "/conversations/c1/inputs", json={"idempotency_key": "k2", "parts": [{"type": "text"}], "context": {}}
    )
    assert wrong_part.status_code == 422 and wrong_part.json()["error"]["field"] == "parts.0.text"
    huge = await client.post("/conversations/c1/inputs", content=b"x" * 2_000_000)
    assert huge.status_code == 413
    missing = await client.post("/conversations/c1/runs/nope/interrupt")
    assert missing.status_code == 404
    assert (await client.get("/conversations/c1/approvals")).json() == {"approvals": []}


async def test_approvals_and_interrupts_over_rest() -> None:
    effects: list[int] = []

    @define_agent_tool
    async def charge(amount: int) -> str:
        effects.append(amount)
        return f"charged {amount}"

    scripted = Scripted(tool="charge", tool_args='{"amount": 3}')
    harness = make_harness(scripted, tools=[charge], loop={"tool_approval": ["charge"], "tool_approval_secret": SECRET})
    async with (
        serving(create_agent_harness_app(harness)) as base,
        httpx.AsyncClient(base_url=f"http://{base}") as client,
    ):
        async with client.stream("GET", "/conversations/c1/events") as response:
            stream = Stream(response)
            await stream.next()
            await post_input(client, "k1", "charge me")
            await stream.until("terminal")
            [pending] = (await client.get("/conversations/c1/approvals")).json()["approvals"]
            answered = await client.post(
                f"/conversations/c1/approvals/{pending['approval_id']}", json={"approved": True, "context": {}}
            )
            assert answered.status_code == 202
            done = (await stream.until("terminal"))[-1]
        assert done["data"]["terminal_reason"] == "success" and effects == [3]
        twice = await client.post(f"/conversations/c1/approvals/{pending['approval_id']}", json={"approved": True})
        assert twice.status_code == 400 and "AgentApprovalError" in twice.json()["error"]["message"]

    gated = Scripted()
    gated.gate(0)
    other = make_harness(gated)
    async with serving(create_agent_harness_app(other)) as base, httpx.AsyncClient(base_url=f"http://{base}") as client:
        admission = await post_input(client, "k1", "long")
        await gated.wait_entered(0)
        interrupted = await client.post(f"/conversations/c1/runs/{admission['run']['id']}/interrupt")
        assert interrupted.json()["outcome"] == "requested"
    await harness.close()
    await other.close()


async def test_bearer_tokens_guard_every_route_but_the_probes(scripted: Scripted) -> None:
    harness = make_harness(scripted)
    app = create_agent_harness_app(harness, authenticate=static_bearer_token("tok", {"user_id": "u1"}))
    async with serving(app) as base, httpx.AsyncClient(base_url=f"http://{base}") as client:
        for method, path in [
            ("GET", "/conversations"),
            ("GET", "/conversations/c1"),
            ("POST", "/conversations/c1/inputs"),
            ("GET", "/conversations/c1/events"),
            ("POST", "/api/chat"),
        ]:
            refused = await client.request(method, path, headers={"Authorization": "Bearer nope"})
            assert refused.status_code == 401, path
            assert refused.headers["www-authenticate"].startswith("Bearer")
        assert (await client.get("/conversations", params={"access_token": "tok"})).status_code == 401, (
            "the query token is for WebSocket and SSE only"
        )
        ok = await client.get("/conversations", headers={"Authorization": "Bearer tok"})
        assert ok.status_code == 200
        async with client.stream("GET", "/conversations/c1/events", params={"access_token": "tok"}) as response:
            assert (await Stream(response).next())["event"] == "snapshot"
        assert (await client.get("/readyz")).status_code == 200
    await harness.close()


async def test_cors_allows_the_configured_origins_only(scripted: Scripted) -> None:
    harness = make_harness(scripted)
    app = create_agent_harness_app(harness, settings=AgentServerSettings(cors_origins=("http://app.example",)))
    async with serving(app) as base, httpx.AsyncClient(base_url=f"http://{base}") as client:
        preflight = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization"}
        allowed = await client.options("/api/chat", headers={"Origin": "http://app.example", **preflight})
        assert allowed.status_code == 200
        assert allowed.headers["access-control-allow-origin"] == "http://app.example"
        refused = await client.options("/api/chat", headers={"Origin": "http://evil.example", **preflight})
        assert "access-control-allow-origin" not in refused.headers
        simple = await client.get("/healthz", headers={"Origin": "http://app.example"})
        assert simple.headers["access-control-allow-origin"] == "http://app.example"
    await harness.close()


async def test_an_sse_reader_that_falls_behind_gets_resync_required_and_the_stream_ends() -> None:
    import socket

    from threadline.harness import create_agent_harness_control_server

    from .conftest import wait_for

    scripted = Scripted()
    # a 6 MB input (the scripted model streams it back) is above the 1 MiB default admission limit
    harness = make_harness(
        scripted, loop={"checkpoint_every_events": 1_000_000}, runs={"max_input_bytes": 8 * 1024 * 1024}
    )
    control = create_agent_harness_control_server(harness, max_pending_events=8)
    async with serving(create_agent_harness_app(harness, control=control)) as base:
        host, port = base.split(":")
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8192)  # a small window that does not grow
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, (host, int(port)))
        reader, writer = await asyncio.open_connection(sock=sock)
        writer.write(f"GET /conversations/c1/events HTTP/1.1\r\nHost: {base}\r\n\r\n".encode())
        await writer.drain()
        head = await asyncio.wait_for(reader.readuntil(b"event: snapshot"), WAIT)
        assert head.startswith(b"HTTP/1.1 200")
        # the reader stops reading: the server's writes back up until the connection overflows
        ticket = harness.submit(
            conversation_id="c1",
            idempotency_key="k",
            context={"user_id": "u1"},
            parts=[{"type": "text", "text": " ".join(["w" * 2000] * 3_000)}],
        )
        await wait_for(lambda: control.connection_count == 0, "the overflow to detach the stalled stream")
        rest = b""
        while True:
            chunk = await asyncio.wait_for(reader.read(1 << 20), WAIT)
            if not chunk:
                break
            rest += chunk
            if b"event: resync-required" in rest and rest.endswith(b"0\r\n\r\n"):
                break  # the chunked body ended after the resync notice
        assert b"event: resync-required" in rest
        assert (await asyncio.wait_for(ticket.result, WAIT * 3)).terminal_reason == "success"
        writer.close()
        await writer.wait_closed()
        sock.close()
    await harness.close()


def _chunks(body: bytes) -> list[bytes]:
    """The chunks of a chunked HTTP body read so far (an incomplete last chunk is left out)."""
    chunks, at = [], 0
    while True:
        end = body.find(b"\r\n", at)
        if end < 0:
            return chunks
        size = int(body[at:end], 16)
        if len(body) < end + 2 + size + 2:
            return chunks
        chunks.append(body[end + 2 : end + 2 + size])
        at = end + 2 + size + 2


async def test_sse_events_that_waited_together_go_out_in_one_write(scripted: Scripted) -> None:
    from threadline.events import AssistantDeltaEvent

    harness = make_harness(scripted)
    async with serving(create_agent_harness_app(harness)) as base:
        host, port = base.split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(f"GET /conversations/c1/events HTTP/1.1\r\nHost: {base}\r\n\r\n".encode())
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), WAIT)
        assert head.startswith(b"HTTP/1.1 200") and b"transfer-encoding: chunked" in head.lower()
        body = b""
        while not any(b"event: snapshot" in c for c in _chunks(body)):
            body += await asyncio.wait_for(reader.read(65536), WAIT)
        for n in (1, 2, 3):  # published in one turn of the server's event loop
            harness.events.publish(
                AssistantDeltaEvent(conversation_id="c1", run_id="r1", runtime_epoch="e", sequence=n, delta=f"w{n}")
            )
        while sum(c.count(b"event: assistant-delta") for c in _chunks(body)) < 3:
            body += await asyncio.wait_for(reader.read(65536), WAIT)
        written = [c for c in _chunks(body) if b"assistant-delta" in c]
        assert len(written) == 1, "one write"
        ids = [line for line in written[0].split(b"\n") if line.startswith(b"id: ")]
        assert ids == [b"id: 0:r1:e:1", b"id: 0:r1:e:2", b"id: 0:r1:e:3"]
        writer.close()
        await writer.wait_closed()
    await harness.close()
