"""1,000 live viewers of one conversation: WebSocket observers (the control protocol) and SSE clients.

Two configurations (``--configs``, both by default):

- ``split`` — what the docs recommend: a **worker** process executes the runs (``publish=relay.publish``
  on a SQLite store) and a **web** process, ``threadline serve --admit-only --live``, serves the viewers
  the live relay brings the worker's events to. The worker drives the turns itself, so its per-turn time
  is what the viewers might slow down.
- ``single`` — for comparison: one process executes the runs *and* serves the viewers (the harness app
  under uvicorn, in this process).

The viewers run in separate processes (``--client-procs``), each a raw asyncio connection per viewer (a
minimal WebSocket frame reader or an SSE line reader) so the load generator costs as little CPU as
possible. Measured, per configuration and transport:

- ``p50_ms``/``p99_ms``/``max_ms``: delta latency from the event's ``emitted_at`` (set when the executing
  runtime publishes it) to the moment a viewer read it (same machine, same wall clock), over every
  ``assistant-delta`` every viewer received;
- ``lost``: deltas the viewers that stayed attached did not receive (must be 0); ``detached``: viewers the
  server detached with ``resync-required`` for falling behind (their deltas are not counted as lost:
  they reload the snapshot);
- ``rss_per_conn_kb``: the serving process's resident memory with the viewers attached and idle, minus
  before, per connection;
- ``turn_ms_alone``/``turn_ms_watched``/``turn_ratio``: the executing process's per-turn time (submit to
  result, median of ``--turns``) without viewers and with them (the target: a ratio of at most 1.10), for a
  model streaming ``--words`` words ``--pace`` seconds apart (a provider's stream).

    .venv/bin/python bench/fanout.py [--configs split,single] [--transports ws,sse] [--viewers 1000]
                                     [--turns 10] [--words 40] [--pace 0.01] [--client-procs 1]
                                     [--client-runtime python|node] [--profile-web FILE]

Each line ends with ``additions_s`` (ten million Python integer additions timed just before): the
machine's speed that minute (``workload.additions_s``).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import json
import os
import shutil
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
TYPE = b'"type":"'
DELTA_TYPE = b'"type":"assistant-delta"'
CONVERSATION = "bench"
WAIT = 180.0
CLIENT = [sys.executable, __file__, "--role", "client", "--client"]
WORKER = [sys.executable, __file__, "--role", "worker"]
HERE = Path(__file__).resolve().parent
NODE = shutil.which("node")


def cpu_s(pid: int | str = "self") -> float:
    """User plus system CPU seconds the process has used."""
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_kb(pid: int | str = "self") -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


# ------------------------------------------------------------------------------------------------ client


class Viewer(asyncio.Protocol):
    """One viewer: reads WebSocket frames (``ws``) or SSE events (``sse``) and timestamps every delta. A
    WebSocket message may hold one delivery or a JSON array of them; an SSE write may hold several events."""

    def __init__(self, kind: str, ready: asyncio.Future[None]) -> None:
        self.kind = kind
        self.ready = ready
        self.buffer = bytearray()
        self.handshaken = False
        self.seen: list[tuple[float, bytes]] = []
        self.detached = False
        self.transport: Any = None

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def connection_lost(self, exc: Exception | None) -> None:
        self.detached = True

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
        if b"resync-required" in payload:
            self.detached = True
        if DELTA_TYPE in payload:  # parsed after the run: the load generator stays cheap while it runs
            self.seen.append((now, payload))

    def deltas(self) -> list[float]:
        """The latency of every delta received."""
        latencies = []
        for now, payload in self.seen:
            start = payload.find(EMITTED)
            while start >= 0:
                start += len(EMITTED)
                end = payload.find(b'"', start)
                kind = payload.find(TYPE, end)
                if kind >= 0 and payload.startswith(DELTA_TYPE, kind):
                    at = datetime.fromisoformat(payload[start:end].decode().replace("Z", "+00:00")).timestamp()
                    latencies.append(now - at)
                start = payload.find(EMITTED, end)
        return latencies

    def _frames(self, now: float) -> None:
        buffer = self.buffer
        while len(buffer) >= 2:
            opcode = buffer[0] & 0x0F
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
            payload = bytes(buffer[offset : offset + length])
            del buffer[: offset + length]
            if opcode == 0x8:  # close: 4008 resync-required, or the end
                self.detached = True
                continue
            self._seen(payload, now)

    def _events(self, now: float) -> None:
        end = self.buffer.rfind(b"\n\n")
        if end < 0:
            return
        self._seen(bytes(self.buffer[: end + 2]), now)
        del self.buffer[: end + 2]


ATTACH = b'{"request_id":"a","operation":"attach","conversation_id":"bench","access":"observe"}'


def _masked_text(payload: bytes) -> bytes:
    mask = os.urandom(4)
    masked = bytes(b ^ mask[i % 4] for i, b in enumerate(payload))
    assert len(payload) < 126
    return bytes([0x81, 0x80 | len(payload)]) + mask + masked


async def run_client(kind: str, host: str, port: int, viewers: int) -> None:
    loop = asyncio.get_running_loop()
    protocols: list[Viewer] = []
    # attach in batches: the control server reads at most max_pending_attachments (32) snapshots at once
    for batch in range(0, viewers, 16):
        pending = []
        for _ in range(min(16, viewers - batch)):
            ready: asyncio.Future[None] = loop.create_future()
            _transport, protocol = await loop.create_connection(lambda r=ready: Viewer(kind, r), host, port)
            if kind == "ws":
                key = base64.b64encode(os.urandom(16)).decode()
                request = (
                    f"GET /control HTTP/1.1\r\nHost: {host}:{port}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                    f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n"
                )
            else:
                request = (
                    f"GET /conversations/{CONVERSATION}/events HTTP/1.1\r\nHost: {host}:{port}\r\n"
                    "Accept: text/event-stream\r\n\r\n"
                )
            protocol.transport.write(request.encode())
            pending.append(ready)
            protocols.append(protocol)
        await asyncio.wait_for(asyncio.gather(*pending), WAIT)
    print("ready", flush=True)
    # run until the parent closes stdin, then report
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    await reader.read()
    for protocol in protocols:
        protocol.transport.close()
    per_viewer = [(p.detached, p.deltas()) for p in protocols]
    report = {
        "latencies": [t for _, latencies in per_viewer for t in latencies],
        "received": [len(latencies) for detached, latencies in per_viewer if not detached],
        "detached": sum(detached for detached, _ in per_viewer),
    }
    print(json.dumps(report), flush=True)


class Clients:
    """``procs`` client processes sharing ``viewers`` viewers."""

    def __init__(self, kind: str, port: int, viewers: int, procs: int, runtime: str = "python") -> None:
        shares = [viewers // procs + (1 if i < viewers % procs else 0) for i in range(procs)]

        def command(share: int) -> list[str]:
            if runtime == "node":
                return [NODE or "node", str(HERE / "fanout_client.mjs"), kind, str(port), str(share)]
            return [*CLIENT, kind, "--port", str(port), "--viewers", str(share)]

        self.procs = [
            subprocess.Popen(
                command(share),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
            for share in shares
            if share
        ]

    async def ready(self) -> None:
        for proc in self.procs:
            line = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), WAIT)  # type: ignore[union-attr]
            assert line.strip() == "ready", line

    async def report(self) -> dict[str, Any]:
        merged: dict[str, Any] = {"latencies": [], "received": [], "detached": 0}
        for proc in self.procs:
            proc.stdin.close()  # type: ignore[union-attr]
            text = await asyncio.wait_for(asyncio.to_thread(proc.stdout.read), WAIT)  # type: ignore[union-attr]
            proc.wait(timeout=WAIT)
            part = json.loads(text)
            merged["latencies"] += part["latencies"]
            merged["received"] += part["received"]
            merged["detached"] += part["detached"]
        return merged


# ------------------------------------------------------------------------------------------------ runs


def scripted(words: int, pace: float) -> Any:
    from pydantic_ai.models.function import FunctionModel

    async def stream(messages: list[Any], info: Any) -> AsyncIterator[str]:
        for i in range(words):
            yield "word" if i == 0 else " word"
            if pace:
                await asyncio.sleep(pace)

    return FunctionModel(stream_function=stream, model_name="bench")


async def turns(runtime: Any, count: int, start: int) -> list[float]:
    times = []
    for i in range(count):
        began = time.perf_counter()
        ticket = runtime.submit(
            conversation_id=CONVERSATION,
            idempotency_key=f"t{start + i}",
            context={},
            parts=[{"type": "text", "text": "go"}],
        )
        result = await ticket.result
        assert result.terminal_reason == "success", result.terminal_reason
        times.append(time.perf_counter() - began)
    return times


def _registry(args: argparse.Namespace) -> Any:
    from threadline import define_model_registry

    return define_model_registry(models={"m": {"model": scripted(args.words, args.pace), "context_window": None}})


async def run_worker(args: argparse.Namespace) -> None:
    """The split configuration's worker: executes (and submits) the turns, publishing through the relay.
    Commands on stdin: ``turns N START`` (prints the times as JSON), ``quit``."""
    from threadline import create_agent_runtime, define_agent_protocol
    from threadline.live import create_agent_live_relay

    registry = _registry(args)
    async with _open_store(args) as handle, create_agent_live_relay(handle) as relay:
        runtime = create_agent_runtime(
            protocol=define_agent_protocol(),
            store=handle.store,
            models={"resolve": lambda: registry.resolve("m")},
            publish=relay.publish,
        )
        print("READY", flush=True)
        while True:
            line = await asyncio.to_thread(sys.stdin.readline)
            words = line.split()
            if not words or words[0] == "quit":
                break
            times = await turns(runtime, int(words[1]), int(words[2]))
            await relay.flush()
            print(json.dumps(times), flush=True)
        await runtime.close()


@contextlib.asynccontextmanager
async def _open_store(args: argparse.Namespace) -> AsyncIterator[Any]:
    if args.db is not None:
        from threadline import create_sqlite_agent_runtime_store

        async with create_sqlite_agent_runtime_store(filename=args.db) as handle:
            yield handle
        return
    from threadline import create_postgres_agent_runtime_store

    async with create_postgres_agent_runtime_store(args.dsn, schema=args.schema) as handle:
        yield handle


def _store_args(where: list[str]) -> list[str]:
    """``--db FILE`` or ``--dsn DSN --schema NAME``: the same store for the worker and the web process."""
    return ["--db", where[0]] if len(where) == 1 else ["--dsn", where[0], "--schema", where[1]]


class Worker:
    def __init__(self, where: list[str], args: argparse.Namespace) -> None:
        self.proc = subprocess.Popen(
            [*WORKER, *_store_args(where), "--words", str(args.words), "--pace", str(args.pace)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )

    async def line(self) -> str:
        return await asyncio.wait_for(asyncio.to_thread(self.proc.stdout.readline), WAIT)  # type: ignore[union-attr]

    async def turns(self, count: int, start: int) -> list[float]:
        self.proc.stdin.write(f"turns {count} {start}\n")  # type: ignore[union-attr]
        self.proc.stdin.flush()  # type: ignore[union-attr]
        return json.loads(await self.line())  # type: ignore[no-any-return]

    def stop(self) -> None:
        with contextlib.suppress(Exception):
            self.proc.stdin.write("quit\n")  # type: ignore[union-attr]
            self.proc.stdin.close()  # type: ignore[union-attr]
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def _threadline_cli() -> list[str]:
    return [sys.executable, "-m", "threadline.cli"]


class Web:
    """``threadline serve --admit-only --live`` on the store."""

    def __init__(self, where: list[str]) -> None:
        self.proc = subprocess.Popen(
            [*_threadline_cli(), "serve", "--admit-only", "--live", *_store_args(where), "--port", "0"],
            stdout=subprocess.PIPE,
            text=True,
        )
        self.port = 0

    async def started(self) -> int:
        while True:
            line = await asyncio.wait_for(asyncio.to_thread(self.proc.stdout.readline), WAIT)  # type: ignore[union-attr]
            if not line:
                raise RuntimeError("threadline serve exited")
            if "listening on" in line:
                self.port = int(line.rsplit(":", 1)[1])
                return self.port

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


# ------------------------------------------------------------------------------------------------ configs


def profiler(pid: int, output: str | None) -> subprocess.Popen[bytes] | None:
    """``--profile-web FILE``: py-spy samples the web process (collapsed stacks) during the watched turns."""
    if output is None:
        return None
    spy = str(Path(sys.executable).parent / "py-spy")
    return subprocess.Popen([spy, "record", "-r", "250", "-f", "raw", "-o", output, "--pid", str(pid)])


def _figures(
    config: str, kind: str, args: argparse.Namespace, report: dict[str, Any], rss: tuple[int, int], times: Any
) -> dict[str, Any]:
    latencies = sorted(report["latencies"])
    expected = args.turns * args.words
    attached = len(report["received"])

    def pct(q: float) -> float:
        return latencies[min(len(latencies) - 1, int(q * len(latencies)))] * 1000 if latencies else float("nan")

    alone, watched = times
    return {
        "config": config,
        "transport": kind,
        "viewers": args.viewers,
        "client": args.client_runtime,
        "detached": report["detached"],
        "deltas": len(latencies),
        "lost": sum(max(0, expected - r) for r in report["received"]),
        "p50_ms": pct(0.50),
        "p99_ms": pct(0.99),
        "max_ms": latencies[-1] * 1000 if latencies else float("nan"),
        "rss_per_conn_kb": (rss[1] - rss[0]) / max(1, attached + report["detached"]),
        "turn_ms_alone": statistics.median(alone) * 1000,
        "turn_ms_watched": statistics.median(watched) * 1000,
        "turn_ratio": statistics.median(watched) / statistics.median(alone),
        **{f"cpu_{name}": share for name, share in report["cpu"].items()},
        # the serving process's CPU time per delta delivered to one viewer: what the fan-out costs, mostly
        # independent of how busy the machine is (unlike the latencies)
        "cpu_us_per_delivery": report["cpu"]["web"] * report["elapsed"] / max(1, len(latencies)) * 1e6,
    }


@contextlib.asynccontextmanager
async def _split_store(args: argparse.Namespace) -> AsyncIterator[list[str]]:
    """A fresh store for the split configuration, its schema made before two processes open it at once."""
    if args.backend == "sqlite":
        with tempfile.TemporaryDirectory() as directory:
            args.db = Path(directory) / "fanout.db"
            async with _open_store(args):
                pass
            yield [str(args.db)]
            args.db = None
        return
    import psycopg

    args.schema = f"bench_fanout_{os.getpid()}"
    async with _open_store(args):
        pass
    try:
        yield [args.dsn, args.schema]
    finally:
        with psycopg.connect(args.dsn, autocommit=True) as conn:
            conn.execute(f'DROP SCHEMA IF EXISTS "{args.schema}" CASCADE')


async def measure_split(kind: str, args: argparse.Namespace) -> dict[str, Any]:
    async with _split_store(args) as where:
        worker, web = Worker(where, args), Web(where)
        try:
            assert (await worker.line()).strip() == "READY"
            port = await web.started()
            await worker.turns(3, 10_000)  # warm up (and the conversation exists before viewers attach)
            alone = await worker.turns(args.turns, 0)
            before = rss_kb(web.proc.pid)
            clients = Clients(kind, port, args.viewers, args.client_procs, args.client_runtime)
            await clients.ready()
            await asyncio.sleep(1.0)
            after = rss_kb(web.proc.pid)
            spy = profiler(web.proc.pid, args.profile_web)
            pids = {"web": [web.proc.pid], "worker": [worker.proc.pid], "clients": [c.pid for c in clients.procs]}
            cpu = {name: sum(cpu_s(p) for p in group) for name, group in pids.items()}
            began = time.perf_counter()
            watched = await worker.turns(args.turns, 1_000)
            elapsed = time.perf_counter() - began
            cpu = {name: (sum(cpu_s(p) for p in pids[name]) - used) / elapsed for name, used in cpu.items()}
            if spy is not None:
                spy.send_signal(2)  # py-spy writes what it sampled while the viewers watched
                spy.wait(timeout=60)
            await asyncio.sleep(1.0)  # let the last deltas reach the viewers
            report = await clients.report()
            report["cpu"], report["elapsed"] = cpu, elapsed
        finally:
            worker.stop()
            web.stop()
    return _figures(f"split-{args.backend}", kind, args, report, (before, after), (alone, watched))


@contextlib.asynccontextmanager
async def uvicorn_server(app: Any) -> AsyncIterator[int]:
    import uvicorn

    config = uvicorn.Config(
        app,
        host="127.0.0.1",
        port=0,
        log_level="error",
        lifespan="on",
        ws="websockets-sansio",
        ws_per_message_deflate=False,  # as threadline serve
        backlog=4096,
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


async def measure_single(kind: str, args: argparse.Namespace) -> dict[str, Any]:
    from threadline import create_sqlite_agent_runtime_store, define_agent_protocol
    from threadline.harness import create_headless_agent_harness
    from threadline.server import create_agent_harness_app

    registry = _registry(args)
    with tempfile.TemporaryDirectory() as directory:
        async with create_sqlite_agent_runtime_store(filename=Path(directory) / "fanout.db") as handle:
            harness = create_headless_agent_harness(
                protocol=define_agent_protocol(), store=handle.store, models={"resolve": lambda: registry.resolve("m")}
            )
            async with uvicorn_server(create_agent_harness_app(harness)) as port:
                await turns(harness, 3, 10_000)
                alone = await turns(harness, args.turns, 0)
                before = rss_kb()
                clients = Clients(kind, port, args.viewers, args.client_procs, args.client_runtime)
                await clients.ready()
                await asyncio.sleep(1.0)
                after = rss_kb()
                spy = profiler(os.getpid(), args.profile_web)
                used, began = cpu_s(), time.perf_counter()
                client_used = sum(cpu_s(c.pid) for c in clients.procs)
                watched = await turns(harness, args.turns, 1_000)
                elapsed = time.perf_counter() - began
                cpu = {
                    "web": (cpu_s() - used) / elapsed,
                    "clients": (sum(cpu_s(c.pid) for c in clients.procs) - client_used) / elapsed,
                }
                if spy is not None:
                    spy.send_signal(2)
                    spy.wait(timeout=60)
                await asyncio.sleep(1.0)
                report = await clients.report()
                report["cpu"], report["elapsed"] = cpu, elapsed
            await harness.close()
    return _figures("single", kind, args, report, (before, after), (alone, watched))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--configs", default="split,single")
    parser.add_argument("--transports", default="ws,sse")
    parser.add_argument("--viewers", type=int, default=1000)
    parser.add_argument("--client-procs", type=int, default=1)
    parser.add_argument(
        "--client-runtime",
        choices=["python", "node"],
        default="python",
        help="the viewers' load generator: this script's Python client, or bench/fanout_client.mjs (Node.js, the "
        "same protocol; about two thirds of the Python client's CPU over WebSocket, to check that the figures "
        "are the server's and not the load generator's)",
    )
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--words", type=int, default=40)
    parser.add_argument("--pace", type=float, default=0.01, help="seconds between the model's words")
    parser.add_argument("--profile-web", help="py-spy collapsed stacks of the serving process while viewers watch")
    parser.add_argument("--role", choices=["main", "worker", "client"], default="main", help=argparse.SUPPRESS)
    parser.add_argument("--client", choices=["ws", "sse"], help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--backend", choices=["sqlite", "postgres"], default="sqlite", help="split: the store")
    parser.add_argument("--dsn", default="postgresql://postgres@127.0.0.1:5432/test", help="with --backend postgres")
    parser.add_argument("--db", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--schema", help=argparse.SUPPRESS)
    args = parser.parse_args()
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(soft, 8192)), hard))
    if args.role == "client":
        asyncio.run(run_client(args.client, "127.0.0.1", args.port, args.viewers))
        return
    if args.role == "worker":
        asyncio.run(run_worker(args))
        return
    from workload import additions_s, machine_line

    print(machine_line(), flush=True)
    for config in args.configs.split(","):
        for kind in args.transports.split(","):
            speed = additions_s()
            measure = measure_split if config == "split" else measure_single
            figures = asyncio.run(measure(kind, args))
            print(
                " ".join(f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}" for k, v in figures.items())
                + f" additions_s={speed:.2f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
