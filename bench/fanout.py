"""1,000 live viewers of one conversation: WebSocket observers (the control protocol) and SSE clients.

The server (this process) runs ``threadline serve``'s app over a SQLite harness with a scripted model; the
viewers run in a separate process (``--client``), each a raw asyncio connection (a minimal WebSocket frame
reader, or an SSE line reader) so the load generator costs as little CPU as possible on a 2-core machine.

Measured, per transport:

- ``p50_ms``/``p99_ms``: delta delivery latency, from the event's ``emitted_at`` (set when the runtime
  publishes it) to the moment a viewer read the frame (same machine, same wall clock), over every
  ``assistant-delta`` every viewer received;
- ``rss_per_conn_kb``: the server's resident memory with the viewers attached and idle, minus before, per
  connection;
- ``turn_ms``: a run's per-turn time (submit to result, median of ``--turns``) without viewers and with them,
  and their ratio (the target: within 10%), for a model that streams ``--words`` words ``--pace`` seconds
  apart (a provider's stream) and for a zero-latency model (``--pace 0``), whose turn is pure CPU shared
  with the fan-out.

    .venv/bin/python bench/fanout.py [--viewers 1000] [--turns 10] [--words 40] [--pace 0.01]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from datetime import datetime
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent / "src"))

EMITTED = b'"emitted_at":"'
DELTA = b'"type":"assistant-delta"'


def rss_kb() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def emitted_at(payload: bytes) -> float | None:
    start = payload.find(EMITTED)
    if start < 0:
        return None
    start += len(EMITTED)
    end = payload.find(b'"', start)
    return datetime.fromisoformat(payload[start:end].decode().replace("Z", "+00:00")).timestamp()


# ------------------------------------------------------------------------------------------------ client


class Viewer(asyncio.Protocol):
    """One viewer: reads frames (``ws``) or SSE events (``sse``), timestamps every delta."""

    def __init__(self, kind: str, latencies: list[float], ready: asyncio.Future[None]) -> None:
        self.kind = kind
        self.latencies = latencies
        self.ready = ready
        self.buffer = bytearray()
        self.handshaken = False
        self.closed = asyncio.get_running_loop().create_future()

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.closed.done():
            self.closed.set_result(None)

    def data_received(self, data: bytes) -> None:
        now = time.time()
        self.buffer += data
        if not self.handshaken:
            end = self.buffer.find(b"\r\n\r\n")
            if end < 0:
                return
            del self.buffer[: end + 4]
            self.handshaken = True
            if self.kind == "ws":
                self.transport.write(_masked_text(ATTACH))
        if self.kind == "ws":
            self._frames(now)
        else:
            self._events(now)

    def _seen(self, payload: bytes, now: float) -> None:
        if not self.ready.done() and (b'"outcome":"ok"' in payload or b"event: snapshot" in payload):
            self.ready.set_result(None)
        if DELTA in payload:
            at = emitted_at(payload)
            if at is not None:
                self.latencies.append(now - at)

    def _frames(self, now: float) -> None:
        buffer = self.buffer
        while len(buffer) >= 2:
            length = buffer[1] & 0x7F
            offset = 2
            if length == 126:
                if len(buffer) < 4:
                    return
                length, offset = int.from_bytes(buffer[2:4], "big"), 4
            elif length == 127:
                if len(buffer) < 10:
                    return
                length, offset = int.from_bytes(buffer[2:10], "big"), 10
            if len(buffer) < offset + length:
                return
            self._seen(bytes(buffer[offset : offset + length]), now)
            del buffer[: offset + length]

    def _events(self, now: float) -> None:
        while True:
            end = self.buffer.find(b"\n\n")
            if end < 0:
                return
            self._seen(bytes(self.buffer[:end]), now)
            del self.buffer[: end + 2]


ATTACH = b'{"request_id":"a","operation":"attach","conversation_id":"bench","access":"observe"}'


def _masked_text(payload: bytes) -> bytes:
    mask = os.urandom(4)
    masked = bytes(b ^ mask[i % 4] for i, b in enumerate(payload))
    assert len(payload) < 126
    return bytes([0x81, 0x80 | len(payload)]) + mask + masked


async def run_client(kind: str, host: str, port: int, viewers: int) -> None:
    loop = asyncio.get_running_loop()
    latencies: list[float] = []
    protocols: list[Viewer] = []
    # attach in batches: the control server reads at most max_pending_attachments (32) snapshots at once
    for batch in range(0, viewers, 16):
        pending = []
        for _ in range(min(16, viewers - batch)):
            ready: asyncio.Future[None] = loop.create_future()
            _transport, protocol = await loop.create_connection(lambda r=ready: Viewer(kind, latencies, r), host, port)
            if kind == "ws":
                key = base64.b64encode(os.urandom(16)).decode()
                request = (
                    f"GET /control HTTP/1.1\r\nHost: {host}:{port}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                    f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n"
                )
            else:
                request = (
                    f"GET /conversations/bench/events HTTP/1.1\r\nHost: {host}:{port}\r\n"
                    "Accept: text/event-stream\r\n\r\n"
                )
            protocol.transport.write(request.encode())
            pending.append(ready)
            protocols.append(protocol)
        await asyncio.wait_for(asyncio.gather(*pending), 120)
    print("ready", flush=True)
    # run until the parent closes stdin, then report
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    await reader.read()
    for protocol in protocols:
        protocol.transport.close()
    print(json.dumps({"latencies": latencies}), flush=True)


# ------------------------------------------------------------------------------------------------ server


def scripted(words: int, pace: float) -> Any:
    from pydantic_ai.models.function import FunctionModel

    async def stream(messages: list[Any], info: Any) -> AsyncIterator[str]:
        for i in range(words):
            yield "word" if i == 0 else " word"
            if pace:
                await asyncio.sleep(pace)

    return FunctionModel(stream_function=stream, model_name="bench")


@contextlib.asynccontextmanager
async def server(app: Any) -> AsyncIterator[int]:
    import uvicorn

    config = uvicorn.Config(
        app, host="127.0.0.1", port=0, log_level="error", lifespan="on", ws="websockets-sansio", backlog=4096
    )
    srv = uvicorn.Server(config)
    srv.capture_signals = contextlib.nullcontext  # type: ignore[method-assign]
    task = asyncio.ensure_future(srv.serve())
    while not srv.started:
        await asyncio.sleep(0.01)
    try:
        yield srv.servers[0].sockets[0].getsockname()[1]
    finally:
        srv.should_exit = True
        srv.force_exit = True
        await task


async def turns(harness: Any, count: int, start: int) -> list[float]:
    times = []
    for i in range(count):
        began = time.perf_counter()
        ticket = harness.submit(
            conversation_id="bench", idempotency_key=f"t{start + i}", context={}, parts=[{"type": "text", "text": "go"}]
        )
        result = await ticket.result
        assert result.terminal_reason == "success", result.terminal_reason
        times.append(time.perf_counter() - began)
    return times


async def measure(kind: str, args: argparse.Namespace, pace: float) -> dict[str, Any]:
    from threadline import create_sqlite_agent_runtime_store, define_agent_protocol, define_model_registry
    from threadline.harness import create_agent_harness_control_server, create_headless_agent_harness
    from threadline.server import create_agent_harness_app

    with tempfile.TemporaryDirectory() as directory:
        async with create_sqlite_agent_runtime_store(filename=Path(directory) / "fanout.db") as handle:
            registry = define_model_registry(
                models={"m": {"model": scripted(args.words, pace), "context_window": None}}
            )
            harness = create_headless_agent_harness(
                protocol=define_agent_protocol(),
                store=handle.store,
                models={"resolve": lambda: registry.resolve("m")},
            )
            control = create_agent_harness_control_server(harness, max_pending_events=args.max_pending_events)
            app = create_agent_harness_app(harness, control=control)
            async with server(app) as port:
                await turns(harness, 3, 10_000)  # warm up
                alone = await turns(harness, args.turns, 0)
                before = rss_kb()
                client = subprocess.Popen(
                    [sys.executable, __file__, "--client", kind, "--port", str(port), "--viewers", str(args.viewers)],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    text=True,
                )
                assert client.stdout is not None and client.stdin is not None
                line = await asyncio.get_running_loop().run_in_executor(None, client.stdout.readline)
                assert line.strip() == "ready", line
                await asyncio.sleep(1.0)
                attached = control.connection_count
                after = rss_kb()
                watched = await turns(harness, args.turns, 1_000)
                await asyncio.sleep(1.0)  # let the last deltas reach the viewers
                client.stdin.close()
                report = await asyncio.get_running_loop().run_in_executor(None, client.stdout.read)
                client.wait(timeout=60)
                attached_end = control.connection_count
            await harness.close()
    latencies = sorted(json.loads(report)["latencies"])
    expected = args.turns * args.words * args.viewers

    def pct(q: float) -> float:
        return latencies[min(len(latencies) - 1, int(q * len(latencies)))] * 1000 if latencies else float("nan")

    return {
        "transport": kind,
        "pace_s": pace,
        "viewers": args.viewers,
        "attached": attached,
        "still_attached": attached_end,
        "deltas_received": len(latencies),
        "deltas_expected": expected,
        "p50_ms": pct(0.50),
        "p99_ms": pct(0.99),
        "max_ms": latencies[-1] * 1000 if latencies else float("nan"),
        "rss_per_conn_kb": (after - before) / max(1, attached),
        "turn_ms_alone": statistics.median(alone) * 1000,
        "turn_ms_watched": statistics.median(watched) * 1000,
        "turn_ratio": statistics.median(watched) / statistics.median(alone),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--viewers", type=int, default=1000)
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--words", type=int, default=40)
    parser.add_argument("--pace", type=float, default=0.01, help="seconds between the model's words")
    parser.add_argument("--max-pending-events", type=int, default=128)
    parser.add_argument("--transports", default="ws,sse")
    parser.add_argument("--zero-latency", action="store_true", help="also measure with --pace 0")
    parser.add_argument("--client", choices=["ws", "sse"], help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.client:
        asyncio.run(run_client(args.client, "127.0.0.1", args.port, args.viewers))
        return
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(soft, 8192)), hard))
    from workload import additions_s

    print(f"# loadavg={os.getloadavg()[0]:.2f} cpus={os.cpu_count()} python={sys.version.split()[0]}")
    paces = [args.pace] + ([0.0] if args.zero_latency and args.pace else [])
    for pace in paces:
        for kind in args.transports.split(","):
            speed = additions_s()
            figures = asyncio.run(measure(kind, args, pace))
            print(
                " ".join(f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}" for k, v in figures.items())
                + f" additions_s={speed:.2f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
