"""The control protocol over a real WebSocket on loopback (issue 21 item 4): requests and responses correlate by
``request_id``, events of attached conversations stream, the controller lease holds across sockets, a bearer
token is required when configured (and its context replaces the message's), a slow socket is closed with
``resync-required``, and health and readiness answer."""

from __future__ import annotations

import asyncio
import json
import socket
from typing import Any

import httpx
import pytest
from websockets.asyncio.client import ClientConnection, connect
from websockets.client import ClientProtocol
from websockets.exceptions import InvalidStatus
from websockets.frames import Close, Opcode
from websockets.uri import parse_uri

from threadline.harness import HeadlessAgentHarness, create_agent_harness_control_server
from threadline.server import create_agent_harness_app, static_bearer_token

from .conftest import WAIT, Scripted, make_harness, serving, text, wait_for


class Socket:
    """A control-protocol client over one WebSocket."""

    def __init__(self, ws: ClientConnection) -> None:
        self.ws = ws
        self.responses: dict[str, asyncio.Future[dict[str, Any]]] = {}
        self.events: list[dict[str, Any]] = []
        self.messages: list[Any] = []  # as they arrived: one frame, or an array of event deliveries
        self.event_arrived = asyncio.Event()
        self.reader = asyncio.ensure_future(self._read())
        self.n = 0

    async def _read(self) -> None:
        async for raw in self.ws:
            data = json.loads(raw)
            self.messages.append(data)
            for frame in data if isinstance(data, list) else [data]:  # a list: deliveries that waited together
                if frame["type"] == "response":
                    self.responses.setdefault(
                        frame["request_id"], asyncio.get_running_loop().create_future()
                    ).set_result(frame)
                else:
                    self.events.append(frame)
                    self.event_arrived.set()

    async def request(self, operation: str, conversation_id: str = "c1", **fields: Any) -> dict[str, Any]:
        self.n += 1
        rid = f"r{self.n}"
        future = self.responses.setdefault(rid, asyncio.get_running_loop().create_future())
        payload = {"request_id": rid, "operation": operation, "conversation_id": conversation_id, **fields}
        await self.ws.send(json.dumps(payload))
        return await asyncio.wait_for(future, WAIT)

    async def until_event(self, predicate: Any) -> dict[str, Any]:
        async def look() -> dict[str, Any]:
            while True:
                for frame in self.events:
                    if predicate(frame):
                        return frame
                self.event_arrived.clear()
                await self.event_arrived.wait()

        return await asyncio.wait_for(look(), WAIT)


def terminal(frame: dict[str, Any]) -> bool:
    return frame["type"] == "event" and frame["event"]["type"] == "terminal"


async def test_the_control_protocol_over_a_websocket(scripted: Scripted) -> None:
    harness = make_harness(scripted)
    async with serving(create_agent_harness_app(harness)) as base:
        async with connect(f"ws://{base}/control") as ws1, connect(f"ws://{base}/control") as ws2:
            controller, observer = Socket(ws1), Socket(ws2)
            assert (await controller.request("snapshot"))["error"]["code"] == "NOT_ATTACHED"
            attached = await controller.request("attach", access="control")
            assert attached["outcome"] == "ok" and attached["snapshot"]["version"] == 0
            assert (await observer.request("attach", access="control"))["error"]["code"] == "LEASE_CONFLICT"
            assert (await observer.request("attach", access="observe"))["outcome"] == "ok"
            submitted = await controller.request(
                "submit", idempotency_key="k1", context={"user_id": "u1"}, parts=text("hello socket")
            )
            assert submitted["outcome"] == "ok" and submitted["run_id"]
            done = await observer.until_event(terminal)
            assert done["event"]["run_id"] == submitted["run_id"]
            assert done["event"]["assistant"]["parts"][0]["text"] == "answer to: hello socket"
            deltas = [f["event"]["delta"] for f in observer.events if f["event"]["type"] == "assistant-delta"]
            assert "".join(deltas) == "answer to: hello socket"
            malformed = await controller.request("attach", access="sideways")
            assert malformed["error"] == {
                "code": "REQUEST_REJECTED",
                "message": malformed["error"]["message"],
                "field": "access",
            }
        async with httpx.AsyncClient(base_url=f"http://{base}") as http:
            assert (await http.get("/healthz")).json() == {"status": "ok"}
            assert (await http.get("/readyz")).json() == {"status": "ready"}
            await harness.close()
            closing = await http.get("/readyz")
            assert closing.status_code == 503 and closing.json()["status"] == "closing"


async def test_a_bearer_token_is_required_and_its_context_is_the_one_that_runs(scripted: Scripted) -> None:
    harness = make_harness(scripted)
    app = create_agent_harness_app(harness, authenticate=static_bearer_token("s3cret", {"user_id": "from-token"}))
    async with serving(app) as base:
        with pytest.raises(InvalidStatus) as refused:
            async with connect(f"ws://{base}/control"):
                pass
        assert refused.value.response.status_code == 403
        with pytest.raises(InvalidStatus):
            async with connect(f"ws://{base}/control?access_token=wrong"):
                pass
        async with connect(f"ws://{base}/control", additional_headers={"Authorization": "Bearer s3cret"}) as ws:
            client = Socket(ws)
            await client.request("attach", access="control")
            submitted = await client.request(
                "submit", idempotency_key="k1", context={"user_id": "forged"}, parts=text("who am i")
            )
            assert submitted["outcome"] == "ok"
            await client.until_event(terminal)
        snapshot = await harness.snapshot("c1")
        async with httpx.AsyncClient(base_url=f"http://{base}") as http:
            assert (await http.get("/conversations/c1")).status_code == 401
            ok = await http.get("/conversations/c1", headers={"Authorization": "Bearer s3cret"})
            assert ok.status_code == 200 and ok.json()["version"] == snapshot.version
            assert (await http.get("/healthz")).status_code == 200, "probes need no token"
    await harness.close()


async def test_the_context_of_a_run_comes_from_the_token_not_the_message() -> None:
    seen: list[Any] = []
    scripted = Scripted()
    harness = make_harness(scripted, resources=lambda request: seen.append(request.context) or {})
    app = create_agent_harness_app(harness, authenticate=static_bearer_token("t", {"user_id": "from-token"}))
    async with serving(app) as base, connect(f"ws://{base}/control?access_token=t") as ws:
        client = Socket(ws)
        await client.request("attach", access="control")
        await client.request("submit", idempotency_key="k", context={"user_id": "forged"}, parts=text("hi"))
        await client.until_event(terminal)
    assert [c.user_id for c in seen] == ["from-token"]
    await harness.close()


async def test_a_socket_that_falls_behind_is_closed_with_resync_required() -> None:
    """A raw client (websockets' sans-I/O protocol over a socket with a small receive window) that stops
    reading: the server's sends back up, its queue overflows, the run goes on, and the socket is closed with
    4008 ``resync-required`` once the client reads again."""
    scripted = Scripted()
    # a long input (the scripted model streams it back) is above the 1 MiB default admission limit
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
        client = ClientProtocol(parse_uri(f"ws://{base}/control"), max_size=None)
        client.send_request(client.connect())
        writer.write(b"".join(client.data_to_send()))
        handshake: list[Any] = []
        while not handshake:
            client.receive_data(await asyncio.wait_for(reader.read(4096), WAIT))
            handshake = client.events_received()
        attach = {"request_id": "a", "operation": "attach", "conversation_id": "c1", "access": "observe"}
        client.send_text(json.dumps(attach).encode())
        writer.write(b"".join(client.data_to_send()))
        await writer.drain()
        await wait_for(lambda: control.connection_count == 1, "the socket's control connection")
        # from here the client reads nothing until the server has given up on it
        long_answer = " ".join(["w" * 2000] * 3_000)  # far more bytes than the socket buffers hold
        ticket = harness.submit(
            conversation_id="c1", idempotency_key="k", context={"user_id": "u1"}, parts=text(long_answer)
        )
        await wait_for(lambda: control.connection_count == 0, "the overflow to detach the stalled socket")
        closed = None
        while closed is None:
            data = await asyncio.wait_for(reader.read(65536), WAIT)
            if not data:
                break
            client.receive_data(data)
            for frame in client.events_received():
                if frame.opcode is Opcode.CLOSE:
                    closed = Close.parse(frame.data)
        assert closed is not None and (closed.code, closed.reason) == (4008, "resync-required")
        result = await asyncio.wait_for(ticket.result, WAIT * 3)
        assert result.terminal_reason == "success", "the run was not held up by the stalled socket"
        writer.close()
        await writer.wait_closed()
        sock.close()
    await harness.close()


async def test_requests_beyond_the_socket_limit_answer_request_capacity(harness_with_gate: Any) -> None:
    harness, release = harness_with_gate
    from threadline.server import AgentServerSettings

    app = create_agent_harness_app(harness, settings=AgentServerSettings(max_pending_requests=1))
    async with serving(app) as base, connect(f"ws://{base}/control") as ws:
        client = Socket(ws)
        await ws.send(
            json.dumps({"request_id": "slow", "operation": "attach", "conversation_id": "c1", "access": "observe"})
        )
        refused = await client.request("attach", "c2", access="observe")
        assert refused["error"]["code"] == "REQUEST_CAPACITY"
        release.set()
        slow = await asyncio.wait_for(
            client.responses.setdefault("slow", asyncio.get_running_loop().create_future()), WAIT
        )
        assert slow["outcome"] == "ok"


@pytest.fixture
def harness_with_gate(scripted: Scripted) -> tuple[HeadlessAgentHarness, asyncio.Event]:
    harness = make_harness(scripted)
    original = harness.snapshot
    release = asyncio.Event()

    async def snapshot(conversation_id: str) -> Any:
        await release.wait()
        return await original(conversation_id)

    harness.snapshot = snapshot  # type: ignore[method-assign]
    return harness, release


async def test_events_that_waited_together_arrive_as_one_message_holding_a_json_array(scripted: Scripted) -> None:
    from threadline.events import AssistantDeltaEvent

    harness = make_harness(scripted)
    async with serving(create_agent_harness_app(harness)) as base, connect(f"ws://{base}/control") as ws:
        client = Socket(ws)
        assert (await client.request("attach", access="observe"))["outcome"] == "ok"
        for n in (1, 2, 3):  # published in one turn of the server's event loop
            harness.events.publish(
                AssistantDeltaEvent(conversation_id="c1", run_id="r1", runtime_epoch="e", sequence=n, delta=f"w{n}")
            )
        await client.until_event(lambda frame: frame["event"]["sequence"] == 3)
        batch = client.messages[-1]
        assert isinstance(batch, list), "one message: an array of the deliveries, in order"
        assert [(f["type"], f["event"]["sequence"]) for f in batch] == [("event", 1), ("event", 2), ("event", 3)]
        harness.events.publish(
            AssistantDeltaEvent(conversation_id="c1", run_id="r1", runtime_epoch="e", sequence=4, delta="w4")
        )
        await client.until_event(lambda frame: frame["event"]["sequence"] == 4)
        assert client.messages[-1]["type"] == "event", "alone, a delivery is its own message"
    await harness.close()
