"""``threadline serve``: a headless harness over a store, served over HTTP (Starlette + uvicorn) or, with
``--stdio``, as the JSON-lines structured runner for a supervisor.

HTTP routes are those of :func:`threadline.server.create_agent_harness_app`. ``--demo`` uses the built-in
scripted model (offline, word by word) with its two tools and prints what to try. The server also executes
runs left queued in the store (by another process, or before a restart), like ``threadline worker``.

On SIGTERM/SIGINT the server stops accepting, then the harness closes with ``--grace`` and ``--force``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
import sys
from collections.abc import AsyncIterator, Iterator, Sequence
from pathlib import Path
from typing import Any

import typer

from .common import CliContext, CliUsageError, check_model, choose_model, clock_tool, lookup_tool, open_store

_log = logging.getLogger("threadline.cli")

DEMO_PACE = 0.04
"""Seconds between the demo model's words: slow enough to watch the answer stream."""
LOOPBACK = ("127.0.0.1", "localhost", "::1")


def _harness(
    store: Any, model: Any, *, tools: Sequence[Any], resources: Any = None, execute: bool = True, publish: Any = None
) -> Any:
    from ..harness import create_headless_agent_harness
    from ..models import define_model_registry
    from ..protocol import define_agent_protocol

    registry = define_model_registry(models={"model": {"model": model, "context_window": None}})
    return create_headless_agent_harness(
        protocol=define_agent_protocol(context=CliContext),
        store=store,
        models={"preflight": lambda: registry.preflight("model"), "resolve": lambda: registry.resolve("model")},
        resources=resources,
        tools=list(tools),
        runs={"resolve_context": lambda _run: CliContext(), "input_policy": input_policy, "execute": execute},
        publish=publish,
    )


def input_policy(raw: Any) -> str:
    """The policy an input asks for in ``input_metadata.policy`` (the web inspector's policy selector),
    else ``queue``; an unknown name is refused by the runtime, naming the policies."""
    metadata = raw.input_metadata
    policy = metadata.get("policy") if isinstance(metadata, dict) else None
    return policy if isinstance(policy, str) else "queue"


async def _stdin_lines() -> AsyncIterator[bytes]:
    from ..harness import HEADLESS_AGENT_RUNNER_MAX_LINE_BYTES

    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=HEADLESS_AGENT_RUNNER_MAX_LINE_BYTES + 1)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    while True:
        try:
            line = await reader.readuntil(b"\n")
        except asyncio.IncompleteReadError as end:
            if end.partial:
                yield end.partial
            return
        except asyncio.LimitOverrunError:
            # a line beyond the bound: discard it up to its newline and let the runner refuse it
            await reader.readexactly(HEADLESS_AGENT_RUNNER_MAX_LINE_BYTES + 1)
            while True:
                try:
                    await reader.readuntil(b"\n")
                    break
                except asyncio.LimitOverrunError as more:
                    await reader.readexactly(more.consumed)
            yield b"x" * (HEADLESS_AGENT_RUNNER_MAX_LINE_BYTES + 1)
            continue
        yield line


def _stdout_writer() -> Any:
    def write(obj: dict[str, Any]) -> None:
        sys.stdout.write(json.dumps(obj, separators=(",", ":"), ensure_ascii=False) + "\n")
        sys.stdout.flush()

    return write


async def _serve_http(
    harness: Any, *, host: str, port: int, token: str | None, cors_origins: Sequence[str], banner: list[str]
) -> None:
    try:
        import uvicorn

        from ..server import create_agent_harness_app, static_bearer_token
    except ImportError as error:
        raise CliUsageError(f"{error}") from None
    authenticate = static_bearer_token(token, CliContext().model_dump()) if token else None
    app = create_agent_harness_app(harness, authenticate=authenticate, cors_origins=tuple(cors_origins))

    class Server(uvicorn.Server):
        """uvicorn's server, stopped by SIGTERM/SIGINT through the event loop — without uvicorn re-raising
        the signal once it stopped, which would kill the process before the harness closes its runs."""

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            loop = asyncio.get_running_loop()
            installed = []
            for signum in (signal.SIGINT, signal.SIGTERM):
                with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
                    loop.add_signal_handler(signum, self.stop, signum)
                    installed.append(signum)
            try:
                yield
            finally:
                for signum in installed:
                    loop.remove_signal_handler(signum)

        def stop(self, signum: int) -> None:
            if self.should_exit and signum == signal.SIGINT:
                self.force_exit = True  # a second Ctrl-C: stop waiting for open connections
            self.should_exit = True

    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level="warning",
        lifespan="on",
        ws="websockets-sansio",
        ws_max_size=1_048_576,
        # per-message compression keeps a zlib stream per socket: with many viewers of one conversation it
        # would cost each event a compression per viewer, where an uncompressed frame is encoded once
        ws_per_message_deflate=False,
        timeout_graceful_shutdown=5,
    )
    server = Server(config)
    serving = asyncio.ensure_future(server.serve())
    while not server.started:
        if serving.done():
            serving.result()  # a bind failure raises here (uvicorn exits through SystemExit)
            raise CliUsageError(f"could not listen on {host}:{port}")
        await asyncio.sleep(0.02)
    bound = server.servers[0].sockets[0].getsockname()
    url = f"http://{host if ':' not in host else f'[{host}]'}:{bound[1]}"
    typer.echo(f"threadline serve: listening on {url}")
    for line in banner:
        typer.echo(line.replace("{url}", url))
    sys.stdout.flush()
    await serving


def _demo_banner(token: str | None) -> list[str]:
    auth = f' -H "Authorization: Bearer {token}"' if token else ""
    return [
        "The demo model is threadline's built-in scripted model: offline, answering word by word.",
        "Watch a conversation (Server-Sent Events):",
        f"  curl -N{auth} {{url}}/conversations/demo/events",
        "Then, in another terminal, say something to it:",
        f"  curl{auth} -X POST {{url}}/conversations/demo/inputs -H 'content-type: application/json' \\",
        '       -d \'{"idempotency_key": "1", "text": "Plan a day in Lisbon"}\'',
        "Also: ws://…/control (the control protocol), POST {url}/api/chat (Vercel AI SDK useChat),",
        "      GET {url}/conversations, {url}/healthz, {url}/readyz. Ctrl-C stops.",
    ]


def _file_resources(specs: Sequence[str]) -> Any:
    """``--root ID:KIND:/absolute/path`` options as a file-resource loader."""
    from ..harness import create_agent_harness_file_resources

    roots = []
    for spec in specs:
        root_id, _, rest = spec.partition(":")
        kind, _, path = rest.partition(":")
        if not root_id or not kind or not path:
            raise CliUsageError(f"--root is ID:KIND:/absolute/path, got {spec!r}")
        roots.append({"id": root_id, "path": path, "kind": kind})
    return create_agent_harness_file_resources(roots=roots)


async def run_serve(
    *,
    db: Path | None,
    dsn: str | None,
    schema: str | None,
    host: str,
    port: int,
    model: str | None,
    base_url: str | None,
    demo: bool,
    token: str | None,
    cors_origins: Sequence[str],
    stdio: bool,
    events: bool,
    grace: float,
    force: float,
    pace: float | None = None,
    roots: Sequence[str] = (),
    admit_only: bool = False,
    live: bool = False,
) -> int:
    if demo and (model or base_url):
        raise CliUsageError("--demo uses the built-in scripted model; leave out --model and --base-url")
    if host not in LOOPBACK and not token and not stdio:
        typer.echo(f"warning: serving on {host} without --token: anyone who reaches it can run the model", err=True)
    resources = _file_resources(roots) if roots else None
    choice = choose_model(model, base_url, pace=DEMO_PACE if demo and pace is None else (pace or 0.0))
    check_model(choice, model or "scripted")
    tools = [lookup_tool(), clock_tool()] if (demo or choice.scripted is not None) else [lookup_tool()]
    async with open_store(db, dsn, schema=schema) as opened, contextlib.AsyncExitStack() as stack:
        relay = None
        if live:
            from ..live import create_agent_live_relay

            relay = await stack.enter_async_context(create_agent_live_relay(opened.store))
        harness = _harness(
            opened.store,
            choice.model,
            tools=tools,
            resources=resources,
            execute=not admit_only,
            publish=relay.publish if relay is not None else None,
        )
        if relay is not None:
            await relay.subscribe(harness)  # other processes' streams reach this server's viewers
        sweeping = (
            asyncio.ensure_future(harness.serve(resolve_context=lambda _run: CliContext(), poll_interval=1.0))
            if not admit_only
            else asyncio.ensure_future(asyncio.Event().wait())
        )
        try:
            if stdio:
                from ..harness import run_headless_agent_runner

                await run_headless_agent_runner(
                    harness,
                    input=_stdin_lines(),
                    write=_stdout_writer(),
                    events=events,
                    close_grace_period=grace,
                    close_force_timeout=force,
                )
            else:
                banner = [f"model: {choice.label}; store: {opened.where}"]
                if admit_only:
                    banner.append("admitting only: `threadline worker` processes execute the runs")
                if relay is not None:
                    banner.append(f"live relay: {relay.where}")
                if demo:
                    banner += _demo_banner(token)
                await _serve_http(harness, host=host, port=port, token=token, cors_origins=cors_origins, banner=banner)
        finally:
            closed = await harness.close(grace_period=grace, force_timeout=force)
            sweeping.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await sweeping
        if not stdio:
            typer.echo(
                "threadline serve: stopped"
                + ("" if closed.settled else f" with {closed.remaining} run(s) still in flight (force budget spent)")
            )
        return 0 if closed.settled else 1
