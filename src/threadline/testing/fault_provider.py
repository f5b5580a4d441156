"""A real OpenAI-compatible Chat Completions server on loopback whose every answer is scripted.

``create_fault_provider_server()`` serves ``POST /v1/chat/completions`` over HTTP/1.1 (JSON or SSE with
chunked transfer encoding) on ``127.0.0.1`` and a free port. Each request consumes the next scripted
behaviour: a normal text or tool-call stream, or a fault — 429 with ``Retry-After``, a 5xx, a stream that
hangs, a chunk that is not a valid Chat Completions chunk, a TCP connection closed mid-stream, a stream
that ends with ``finish_reason='length'``. Every request's JSON body is recorded, and so is every client
that went away before its response ended, so a test can assert what the model was sent and that the
client really hung up.

It is built on asyncio's own server (no ASGI stack) so that it can do what a real provider's network
does and a framework hides: drop the TCP connection between two chunks, or hold a response open for
ever. It only ever listens on loopback::

    async with create_fault_provider_server() as server:
        server.script([stream_text(["Hel", "lo"], usage=(12, 2)), rate_limited(retry_after=1)])
        model = server.model()            # OpenAIChatModel -> OpenAIProvider(base_url=server.base_url)
        ...
        assert server.requests[0].body["messages"][0]["role"] == "system"

A script that runs out answers 500 with a message that says so (and the request is still recorded).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import TracebackType
from typing import TYPE_CHECKING, Any, Literal

from ..errors import AgentRuntimeUsageError

if TYPE_CHECKING:
    from pydantic_ai.models.openai import OpenAIChatModel

__all__ = (
    "DropAfter",
    "FaultBehaviour",
    "FaultProviderServer",
    "FinishLength",
    "Hang",
    "Malformed",
    "RateLimited",
    "RecordedRequest",
    "ServerError",
    "StreamText",
    "StreamToolCalls",
    "create_fault_provider_server",
    "drop_after",
    "finish_length",
    "hang",
    "malformed",
    "rate_limited",
    "server_error",
    "stream_text",
    "stream_tool_calls",
)

LOOPBACK = "127.0.0.1"
CREATED = 1_700_000_000  # a fixed `created` stamp: responses are byte-for-byte reproducible
MAX_HEADER_BYTES = 64 * 1024
MAX_BODY_BYTES = 32 * 1024 * 1024
MALFORMED_VARIANTS = ("invalid-json", "wrong-shape", "error-event")

UsageSpec = tuple[int, int] | Mapping[str, Any] | None
"""Usage as ``(prompt_tokens, completion_tokens)`` or an OpenAI ``usage`` object sent verbatim."""


# ------------------------------------------------------------------------------------------ behaviours


@dataclass(frozen=True)
class StreamText:
    """A normal answer: ``chunks`` as content deltas, then ``finish_reason``, then usage (when given)."""

    chunks: tuple[str, ...]
    usage: UsageSpec = None
    finish_reason: str = "stop"
    provider: str | None = None
    """A gateway's upstream as OpenRouter names it: every chunk carries ``"provider": <this>``."""
    kind: Literal["stream-text"] = "stream-text"


@dataclass(frozen=True)
class StreamToolCalls:
    """Optional text, then each ``(call_id, tool_name, args_json)`` (arguments in two deltas), then
    ``finish_reason='tool_calls'`` and usage."""

    calls: tuple[tuple[str, str, str], ...]
    text: str | None = None
    usage: UsageSpec = None
    kind: Literal["stream-tool-calls"] = "stream-tool-calls"


@dataclass(frozen=True)
class RateLimited:
    """HTTP 429 with a ``Retry-After`` header (seconds) and an OpenAI error body."""

    retry_after: float = 1
    kind: Literal["rate-limited"] = "rate-limited"


@dataclass(frozen=True)
class ServerError:
    """An HTTP error status (500 by default) with an OpenAI error body."""

    status: int = 500
    message: str = "the fault provider failed on purpose"
    kind: Literal["server-error"] = "server-error"


@dataclass(frozen=True)
class Hang:
    """Accept the request, send the response headers (unless ``headers=False``) and ``chunks``, then
    send nothing more until the client disconnects or the server closes."""

    chunks: tuple[str, ...] = ()
    headers: bool = True
    kind: Literal["hang"] = "hang"


@dataclass(frozen=True)
class Malformed:
    """Stream ``chunks``, then one SSE event that is not a usable chunk: ``'invalid-json'`` (truncated
    JSON), ``'wrong-shape'`` (valid JSON, but ``choices`` is not a list of choices) or ``'error-event'``
    (an in-stream ``{"error": ...}`` object, as some providers send when they fail mid-answer). The
    stream then ends normally."""

    variant: Literal["invalid-json", "wrong-shape", "error-event"] = "invalid-json"
    chunks: tuple[str, ...] = ()
    kind: Literal["malformed"] = "malformed"


@dataclass(frozen=True)
class DropAfter:
    """Stream the first ``n_chunks`` of ``chunks`` as content deltas, then close the TCP connection
    without ending the chunked body (no finish chunk, no ``[DONE]``)."""

    n_chunks: int
    chunks: tuple[str, ...]
    kind: Literal["drop-after"] = "drop-after"


@dataclass(frozen=True)
class FinishLength:
    """Stream ``chunks``, then ``finish_reason='length'``: the provider stopped at its token limit."""

    chunks: tuple[str, ...]
    usage: UsageSpec = None
    kind: Literal["finish-length"] = "finish-length"


FaultBehaviour = StreamText | StreamToolCalls | RateLimited | ServerError | Hang | Malformed | DropAfter | FinishLength


def _chunks(chunks: str | Iterable[str]) -> tuple[str, ...]:
    return (chunks,) if isinstance(chunks, str) else tuple(chunks)


def stream_text(
    chunks: str | Iterable[str], usage: UsageSpec = None, *, finish_reason: str = "stop", provider: str | None = None
) -> StreamText:
    """Answer with text streamed as ``chunks``; ``usage`` is ``(prompt_tokens, completion_tokens)`` or an
    OpenAI ``usage`` mapping (sent when the client asked for ``stream_options.include_usage``).
    ``provider``: answer as OpenRouter does, naming the upstream that served the request in every chunk."""
    return StreamText(_chunks(chunks), usage, finish_reason, provider)


def stream_tool_calls(
    calls: Iterable[tuple[str, str, str]], text: str | None = None, usage: UsageSpec = None
) -> StreamToolCalls:
    """Answer with tool calls ``[(call_id, tool_name, args_json), ...]``, optionally after ``text``."""
    return StreamToolCalls(tuple((str(i), str(n), str(a)) for i, n, a in calls), text, usage)


def rate_limited(retry_after: float = 1) -> RateLimited:
    """Refuse with HTTP 429 and ``Retry-After: <retry_after>``."""
    return RateLimited(retry_after)


def server_error(status: int = 500, message: str = "the fault provider failed on purpose") -> ServerError:
    """Fail with HTTP ``status`` (5xx by default) and an OpenAI error body."""
    if not 400 <= status <= 599:
        raise AgentRuntimeUsageError(f"server_error status is an HTTP error status (400-599), got {status}")
    return ServerError(status, message)


def hang(chunks: str | Iterable[str] = (), *, headers: bool = True) -> Hang:
    """Send headers (and ``chunks``), then hold the connection open until the client leaves."""
    return Hang(_chunks(chunks), headers)


def malformed(
    variant: Literal["invalid-json", "wrong-shape", "error-event"] = "invalid-json",
    chunks: str | Iterable[str] = (),
) -> Malformed:
    """Stream ``chunks``, then one SSE event that is not a valid Chat Completions chunk."""
    if variant not in MALFORMED_VARIANTS:
        raise AgentRuntimeUsageError(
            f"malformed variant is 'invalid-json', 'wrong-shape' or 'error-event', got {variant!r}"
        )
    return Malformed(variant, _chunks(chunks))


def drop_after(n_chunks: int, chunks: str | Iterable[str] | None = None) -> DropAfter:
    """Stream ``n_chunks`` content deltas (``chunks`` or ``'part0 '``, ``'part1 '``, ...), then drop the
    TCP connection mid-stream."""
    if n_chunks < 0:
        raise AgentRuntimeUsageError("drop_after needs n_chunks >= 0")
    sent = _chunks(chunks) if chunks is not None else tuple(f"part{i} " for i in range(n_chunks))
    if len(sent) < n_chunks:
        raise AgentRuntimeUsageError(f"drop_after({n_chunks}) needs at least {n_chunks} chunks, got {len(sent)}")
    return DropAfter(n_chunks, sent[:n_chunks])


def finish_length(chunks: str | Iterable[str], usage: UsageSpec = None) -> FinishLength:
    """Stream ``chunks``, then stop with ``finish_reason='length'``."""
    return FinishLength(_chunks(chunks), usage)


# ------------------------------------------------------------------------------------------- records


@dataclass
class RecordedRequest:
    """One request the server received. ``behaviour`` is what answered it (None: the script had run
    out, or the path was not the Chat Completions endpoint). ``client_disconnected`` is true when the
    client went away before the response was complete."""

    index: int
    method: str
    path: str
    headers: dict[str, str]
    body: Any
    behaviour: FaultBehaviour | None = None
    client_disconnected: bool = False
    _disconnected: asyncio.Event = field(default_factory=asyncio.Event, repr=False, compare=False)

    @property
    def messages(self) -> list[dict[str, Any]]:
        """The ``messages`` the client sent."""
        return list(self.body.get("messages", [])) if isinstance(self.body, dict) else []

    @property
    def tools(self) -> list[dict[str, Any]]:
        """The ``tools`` the client declared."""
        return list(self.body.get("tools", [])) if isinstance(self.body, dict) else []

    @property
    def system_messages(self) -> list[str]:
        """The text of every ``system`` (or ``developer``) message, in order."""
        texts = []
        for m in self.messages:
            if m.get("role") in ("system", "developer"):
                content = m.get("content")
                if isinstance(content, list):
                    content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
                texts.append(content or "")
        return texts

    def tool_messages(self) -> list[dict[str, Any]]:
        """Every ``tool`` message (a tool result sent back), in order."""
        return [m for m in self.messages if m.get("role") == "tool"]


class _Disconnected(Exception):
    """The client closed its end while a response was in progress."""


# -------------------------------------------------------------------------------------------- server


def _usage_object(usage: UsageSpec) -> dict[str, Any] | None:
    if usage is None:
        return None
    if isinstance(usage, Mapping):
        return dict(usage)
    prompt, completion = usage
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _error_body(message: str, type_: str, code: str | None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": None, "code": code}}


class FaultProviderServer:
    """The server behind :func:`create_fault_provider_server`; use it as an async context manager."""

    def __init__(self) -> None:
        self.requests: list[RecordedRequest] = []
        self.disconnects: list[int] = []
        """Indexes (into ``requests``) of requests whose client went away before the response ended."""
        self._script: deque[FaultBehaviour] = deque()
        self._server: asyncio.Server | None = None
        self._handlers: set[asyncio.Task[None]] = set()
        self._writers: set[asyncio.StreamWriter] = set()
        self._clients: list[Any] = []
        self._closing = False
        self.port: int | None = None

    # ---------------------------------------------------------------------------------- lifecycle

    async def __aenter__(self) -> FaultProviderServer:
        await self.start()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    async def start(self) -> FaultProviderServer:
        if self._server is not None:
            raise AgentRuntimeUsageError("the fault provider server is already started")
        self._closing = False
        self._server = await asyncio.start_server(self._connection, LOOPBACK, 0, limit=MAX_HEADER_BYTES)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def close(self) -> None:
        """Stop listening, end every open connection (hanging responses included), close the clients
        :meth:`model` created."""
        server, self._server = self._server, None
        if server is None:
            return
        self._closing = True
        server.close()
        for writer in list(self._writers):
            writer.transport.abort()
        handlers = list(self._handlers)
        for task in handlers:
            task.cancel()
        if handlers:
            await asyncio.gather(*handlers, return_exceptions=True)
        await server.wait_closed()
        clients, self._clients = self._clients, []
        for client in clients:
            with contextlib.suppress(Exception):
                await client.close()

    @property
    def base_url(self) -> str:
        """``http://127.0.0.1:<port>/v1``, what an OpenAI client takes as its base URL."""
        if self.port is None:
            raise AgentRuntimeUsageError("the fault provider server is not started (use `async with`)")
        return f"http://{LOOPBACK}:{self.port}/v1"

    # ------------------------------------------------------------------------------------- script

    def script(self, behaviours: Iterable[FaultBehaviour]) -> FaultProviderServer:
        """Queue behaviours; each POST to ``/v1/chat/completions`` consumes the next one."""
        queued = list(behaviours)
        for b in queued:
            if not isinstance(b, FaultBehaviour):
                raise AgentRuntimeUsageError(
                    f"script() takes fault behaviours (stream_text(...), hang(), ...), got {b!r}"
                )
        self._script.extend(queued)
        return self

    @property
    def remaining(self) -> int:
        """Behaviours queued and not consumed yet."""
        return len(self._script)

    def model(self, name: str = "fault-model", **kwargs: Any) -> OpenAIChatModel:
        """A pydantic-ai ``OpenAIChatModel`` talking to this server through ``OpenAIProvider`` (placeholder
        key ``'test'``: no real credential is ever read). Its HTTP client is closed with the server."""
        from pydantic_ai.models.openai import OpenAIChatModel
        from pydantic_ai.providers.openai import OpenAIProvider

        provider = OpenAIProvider(base_url=self.base_url, api_key="test")
        self._clients.append(provider.client)
        return OpenAIChatModel(name, provider=provider, **kwargs)

    async def wait_for_disconnect(self, index: int) -> None:
        """Wait until the client of request ``index`` went away mid-response (bound it with
        ``asyncio.wait_for`` so that a broken build fails instead of hanging)."""
        await self.requests[index]._disconnected.wait()

    # ------------------------------------------------------------------------------------- HTTP

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._handlers.add(task)
        self._writers.add(writer)
        try:
            while await self._one_request(reader, writer):
                pass
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError, _Disconnected):
            pass  # the client went away between requests, or sent something that is not HTTP
        except asyncio.CancelledError:
            if not self._closing:
                raise
            # the server is closing: end quietly (a cancelled handler task makes asyncio log an error)
        finally:
            self._writers.discard(writer)
            self._handlers.discard(task)
            writer.transport.abort()

    async def _one_request(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        """Serve one request; False when the connection must close afterwards."""
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError as error:
            if error.partial:
                raise
            return False  # a clean close between requests
        lines = head.decode("latin-1").split("\r\n")
        try:
            method, target, _version = lines[0].split(" ", 2)
        except ValueError:
            await self._json(writer, 400, _error_body("malformed request line", "invalid_request_error", None))
            return False
        headers: dict[str, str] = {}
        for line in lines[1:]:
            if ":" in line:
                key, value = line.split(":", 1)
                headers[key.strip().lower()] = value.strip()
        raw = await self._read_body(reader, headers)
        path = target.split("?", 1)[0]
        try:
            body: Any = json.loads(raw) if raw else None
        except ValueError:
            body = raw.decode("utf-8", "replace")
        record = RecordedRequest(len(self.requests), method, path, headers, body)
        self.requests.append(record)
        keep_alive = headers.get("connection", "").lower() != "close"

        if method != "POST" or path.rstrip("/") != "/v1/chat/completions":
            await self._json(writer, 404, _error_body(f"no route {method} {path}", "invalid_request_error", None))
            return keep_alive
        if not isinstance(body, dict):
            await self._json(writer, 400, _error_body("the body is not a JSON object", "invalid_request_error", None))
            return keep_alive
        if not self._script:
            message = (
                f"fault provider script exhausted: request #{record.index} has no scripted behaviour "
                f"({record.index} request(s) before it; queue more with server.script([...]))"
            )
            await self._json(writer, 500, _error_body(message, "fault_provider_script_exhausted", None))
            return keep_alive
        record.behaviour = self._script.popleft()
        try:
            return await self._respond(record, reader, writer) and keep_alive
        except (ConnectionError, _Disconnected):
            if not self._closing:  # the server ending a held response is not the client leaving
                self._mark_disconnected(record)
            return False

    async def _read_body(self, reader: asyncio.StreamReader, headers: dict[str, str]) -> bytes:
        if headers.get("transfer-encoding", "").lower() == "chunked":
            body = bytearray()
            while True:
                size = int((await reader.readuntil(b"\r\n")).split(b";", 1)[0].strip(), 16)
                if size == 0:
                    await reader.readuntil(b"\r\n")  # no trailers are expected
                    return bytes(body)
                body += await reader.readexactly(size)
                await reader.readexactly(2)
                if len(body) > MAX_BODY_BYTES:
                    raise ConnectionError("request body too large")
        length = int(headers.get("content-length") or 0)
        if length > MAX_BODY_BYTES:
            raise ConnectionError("request body too large")
        return await reader.readexactly(length) if length else b""

    def _mark_disconnected(self, record: RecordedRequest) -> None:
        if not record.client_disconnected:
            record.client_disconnected = True
            self.disconnects.append(record.index)
            record._disconnected.set()

    @staticmethod
    def _head(status: int, headers: Mapping[str, str]) -> bytes:
        reason = {200: "OK", 400: "Bad Request", 404: "Not Found", 429: "Too Many Requests"}.get(status, "Error")
        lines = [f"HTTP/1.1 {status} {reason}", *(f"{k}: {v}" for k, v in headers.items())]
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")

    async def _json(
        self, writer: asyncio.StreamWriter, status: int, payload: Any, extra: Mapping[str, str] | None = None
    ) -> None:
        data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
        headers = {"content-type": "application/json", "content-length": str(len(data)), **(extra or {})}
        writer.write(self._head(status, headers) + data)
        await writer.drain()

    # ---------------------------------------------------------------------------------- answers

    async def _respond(
        self, record: RecordedRequest, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> bool:
        b = record.behaviour
        if isinstance(b, RateLimited):
            retry = f"{b.retry_after:g}"
            body = _error_body("rate limited by the fault provider", "rate_limit_error", "rate_limit_exceeded")
            await self._json(writer, 429, body, {"retry-after": retry})
            return True
        if isinstance(b, ServerError):
            await self._json(writer, b.status, _error_body(b.message, "server_error", None))
            return True
        body = record.body
        stream = bool(body.get("stream"))
        wants_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        sse = _Sse(
            writer,
            reader,
            model=str(body.get("model") or "fault-model"),
            response_id=f"chatcmpl-fault-{record.index}",
            provider=b.provider if isinstance(b, StreamText) else None,
        )

        if isinstance(b, Hang):
            if b.headers:
                if stream:
                    await sse.open()
                    for i, text in enumerate(b.chunks):
                        await sse.content(text, first=i == 0)
                else:
                    writer.write(self._head(200, {"content-type": "application/json", "content-length": "1000000"}))
                    await writer.drain()
            await sse.wait_for_client_to_leave()
            raise _Disconnected()
        if isinstance(b, DropAfter):
            if stream:
                await sse.open()
                for i, text in enumerate(b.chunks):
                    await sse.content(text, first=i == 0)
            else:
                writer.write(self._head(200, {"content-type": "application/json", "content-length": "1000000"}))
                await writer.drain()
            writer.transport.abort()
            return False

        if not stream:
            return await self._complete(record, writer)
        await sse.open()
        if isinstance(b, StreamText | FinishLength):
            for i, text in enumerate(b.chunks):
                await sse.content(text, first=i == 0)
            await sse.finish(b.finish_reason if isinstance(b, StreamText) else "length")
            usage = b.usage
        elif isinstance(b, StreamToolCalls):
            first = True
            if b.text:
                await sse.content(b.text, first=True)
                first = False
            for n, (call_id, name, args) in enumerate(b.calls):
                opening = {"index": n, "id": call_id, "type": "function", "function": {"name": name, "arguments": ""}}
                await sse.delta({"role": "assistant", "tool_calls": [opening]} if first else {"tool_calls": [opening]})
                first = False
                half = len(args) // 2
                for piece in (args[:half], args[half:]):
                    if piece:
                        await sse.delta({"tool_calls": [{"index": n, "function": {"arguments": piece}}]})
            await sse.finish("tool_calls")
            usage = b.usage
        elif isinstance(b, Malformed):
            for i, text in enumerate(b.chunks):
                await sse.content(text, first=i == 0)
            if b.variant == "invalid-json":
                await sse.event(
                    '{"id": "chatcmpl-fault", "object": "chat.completion.chunk", "choices": [{"index": 0, "de'
                )
            elif b.variant == "wrong-shape":
                await sse.event(json.dumps({**sse.envelope(), "choices": "not-a-list"}))
            else:
                await sse.event(json.dumps(_error_body("the fault provider failed mid-stream", "server_error", None)))
            usage = None
        else:  # pragma: no cover - every behaviour is handled above
            raise AssertionError(f"unhandled behaviour {b!r}")
        usage_object = _usage_object(usage)
        if usage_object is not None and wants_usage:
            await sse.event(json.dumps({**sse.envelope(), "choices": [], "usage": usage_object}))
        await sse.event("[DONE]")
        await sse.end()
        return True

    async def _complete(self, record: RecordedRequest, writer: asyncio.StreamWriter) -> bool:
        """A non-streaming answer (``stream`` false) for the behaviours that have one."""
        b = record.behaviour
        message: dict[str, Any] = {"role": "assistant", "content": None}
        usage: UsageSpec = None
        if isinstance(b, StreamText | FinishLength):
            message["content"] = "".join(b.chunks)
            finish = b.finish_reason if isinstance(b, StreamText) else "length"
            usage = b.usage
        elif isinstance(b, StreamToolCalls):
            message["content"] = b.text
            message["tool_calls"] = [
                {"id": i, "type": "function", "function": {"name": n, "arguments": a}} for i, n, a in b.calls
            ]
            finish, usage = "tool_calls", b.usage
        else:  # Malformed
            await self._json(writer, 200, b'{"id": "chatcmpl-fault", "choices": [')
            return True
        payload = {
            "id": f"chatcmpl-fault-{record.index}",
            "object": "chat.completion",
            "created": CREATED,
            "model": str(record.body.get("model") or "fault-model"),
            "choices": [{"index": 0, "message": message, "finish_reason": finish, "logprobs": None}],
        }
        usage_object = _usage_object(usage)
        if usage_object is not None:
            payload["usage"] = usage_object
        await self._json(writer, 200, payload)
        return True


class _Sse:
    """One streamed (chunked, ``text/event-stream``) response."""

    def __init__(
        self,
        writer: asyncio.StreamWriter,
        reader: asyncio.StreamReader,
        *,
        model: str,
        response_id: str,
        provider: str | None = None,
    ):
        self.writer = writer
        self.reader = reader
        self.model = model
        self.response_id = response_id
        self.provider = provider

    def envelope(self) -> dict[str, Any]:
        out = {"id": self.response_id, "object": "chat.completion.chunk", "created": CREATED, "model": self.model}
        if self.provider is not None:
            out["provider"] = self.provider
        return out

    async def _write(self, data: bytes) -> None:
        if self.writer.transport.is_closing():
            raise _Disconnected()
        self.writer.write(data)
        await self.writer.drain()

    async def open(self) -> None:
        headers = {"content-type": "text/event-stream", "cache-control": "no-cache", "transfer-encoding": "chunked"}
        await self._write(FaultProviderServer._head(200, headers))

    async def event(self, data: str) -> None:
        payload = f"data: {data}\n\n".encode()
        await self._write(b"%x\r\n" % len(payload) + payload + b"\r\n")

    async def delta(self, delta: dict[str, Any], finish_reason: str | None = None) -> None:
        choice = {"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}
        await self.event(json.dumps({**self.envelope(), "choices": [choice]}))

    async def content(self, text: str, *, first: bool) -> None:
        await self.delta({"role": "assistant", "content": text} if first else {"content": text})

    async def finish(self, reason: str) -> None:
        await self.delta({}, reason)

    async def end(self) -> None:
        await self._write(b"0\r\n\r\n")

    async def wait_for_client_to_leave(self) -> None:
        """Hold the response open; return when the client closed its end (EOF or reset)."""
        with contextlib.suppress(ConnectionError):
            while await self.reader.read(65536):
                pass  # a well-behaved HTTP/1.1 client sends nothing more until the response ends


def create_fault_provider_server() -> FaultProviderServer:
    """A scripted OpenAI-compatible Chat Completions server on ``127.0.0.1`` and a free port, started by
    ``async with`` and stopped (every connection closed) on exit."""
    return FaultProviderServer()
