"""``threadline serve`` as a real subprocess: the JSON-lines runner on stdin/stdout (``--stdio``) for a
supervisor, and ``--demo`` over HTTP on the scripted model, stopped with SIGTERM (issue 21 items 4 and 7)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from .conftest import WAIT

pytestmark = pytest.mark.subprocess

START = 60.0
"""Seconds a child has to start (the machine may be shared and slow to import)."""


class Runner:
    """A ``threadline serve --stdio`` child, one JSON object per line each way."""

    def __init__(self, process: asyncio.subprocess.Process) -> None:
        self.process = process
        self.lines: list[dict[str, Any]] = []

    async def send(self, obj: dict[str, Any] | str) -> None:
        text = obj if isinstance(obj, str) else json.dumps(obj)
        assert self.process.stdin is not None
        self.process.stdin.write(text.encode() + b"\n")
        await self.process.stdin.drain()

    async def until(self, predicate: Any, timeout: float = WAIT) -> dict[str, Any]:
        async def read() -> dict[str, Any]:
            for line in self.lines:
                if predicate(line):
                    return line
            assert self.process.stdout is not None
            while True:
                raw = await self.process.stdout.readline()
                if not raw:
                    raise EOFError("the runner closed its output")
                line = json.loads(raw)
                self.lines.append(line)
                if predicate(line):
                    return line

        return await asyncio.wait_for(read(), timeout)


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "threadline.cli", *args]


async def start(*args: str) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        *cli(*args),
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )


def of(request_id: str, kind: str) -> Any:
    return lambda line: line.get("request_id") == request_id and line["type"] == kind


async def test_the_stdio_runner_serves_a_supervisor(tmp_path: Path) -> None:
    db = tmp_path / "runner.db"
    runner = Runner(await start("serve", "--stdio", "--events", "--db", str(db)))
    try:
        await runner.send(
            {
                "type": "submit",
                "request_id": "s1",
                "conversation_id": "c1",
                "idempotency_key": "k1",
                "context": {},
                "parts": [{"type": "text", "text": "Plan a day in Porto"}],
            }
        )
        admitted = await runner.until(of("s1", "admitted"), START)
        run_id = admitted["admission"]["run"]["id"]
        terminal = await runner.until(of("s1", "terminal"))
        assert terminal["result"]["terminal_reason"] == "success"
        answer = "".join(p["text"] for p in terminal["result"]["assistant"]["parts"] if p["type"] == "text")
        assert "Porto" in answer
        events = [line["event"] for line in runner.lines if line["type"] == "event"]
        assert {"admission", "assistant-delta", "tool-status", "terminal"} <= {e["type"] for e in events}
        assert all(e["run_id"] == run_id for e in events)

        await runner.send("{this is not json")
        refused = await runner.until(lambda line: line["type"] == "error")
        assert refused["code"] == "REQUEST_REJECTED"
        await runner.send({"type": "submit", "request_id": "s2", "conversation_id": "c1", "idempotency_key": "k"})
        missing = await runner.until(of("s2", "error"))
        assert missing["field"] == "parts"
        await runner.send({"type": "interrupt", "request_id": "i1", "conversation_id": "c1", "run_id": run_id})
        interrupted = await runner.until(of("i1", "interrupted"))
        assert interrupted["result"]["outcome"] == "terminal", "the run had already ended"
        await runner.send({"type": "snapshot", "request_id": "n1", "conversation_id": "c1"})
        snapshot = await runner.until(of("n1", "snapshot"))
        assert [r["id"] for r in snapshot["snapshot"]["runs"]] == [run_id]
        await runner.send({"type": "close", "request_id": "x1", "grace_period": 1, "force_timeout": 5})
        closed = await runner.until(of("x1", "closed"))
        assert closed["result"]["settled"] is True
        assert await asyncio.wait_for(runner.process.wait(), WAIT) == 0
    finally:
        if runner.process.returncode is None:
            runner.process.kill()
            await runner.process.wait()


async def test_the_stdio_runner_ends_at_end_of_input_after_the_terminals_it_owes(tmp_path: Path) -> None:
    runner = Runner(await start("serve", "--stdio", "--db", str(tmp_path / "eof.db")))
    try:
        await runner.send(
            {
                "type": "submit",
                "request_id": "s1",
                "conversation_id": "c1",
                "idempotency_key": "k1",
                "context": {},
                "parts": [{"type": "text", "text": "hello"}],
            }
        )
        assert runner.process.stdin is not None
        await runner.until(of("s1", "admitted"), START)
        runner.process.stdin.close()
        terminal = await runner.until(of("s1", "terminal"))
        assert terminal["result"]["terminal_reason"] == "success"
        assert await asyncio.wait_for(runner.process.wait(), WAIT) == 0
    finally:
        if runner.process.returncode is None:
            runner.process.kill()
            await runner.process.wait()


async def test_serve_demo_answers_over_http_and_stops_on_sigterm(tmp_path: Path) -> None:
    process = await start("serve", "--demo", "--port", "0", "--db", str(tmp_path / "demo.db"))
    try:
        assert process.stdout is not None
        first = await asyncio.wait_for(process.stdout.readline(), START)
        assert first.startswith(b"threadline serve: listening on http://127.0.0.1:"), first
        url = first.decode().split("listening on ")[1].strip()
        banner = (await asyncio.wait_for(process.stdout.readuntil(b"Ctrl-C stops.\n"), WAIT)).decode()
        assert "scripted model" in banner and f"{url}/conversations/demo/events" in banner
        async with httpx.AsyncClient(base_url=url, timeout=WAIT) as client:
            assert (await client.get("/readyz")).json() == {"status": "ready"}
            async with client.stream("GET", "/conversations/demo/events") as response:
                lines = response.aiter_lines()
                assert await anext(lines) == "id: 0"
                admitted = await client.post(
                    "/conversations/demo/inputs", json={"idempotency_key": "1", "text": "Plan a day in Lisbon"}
                )
                assert admitted.status_code == 202
                async for line in lines:
                    if line.startswith("data: ") and '"type":"terminal"' in line:
                        terminal = json.loads(line[6:])
                        break
        assert terminal["terminal_reason"] == "success"
        assert "Lisbon" in "".join(p["text"] for p in terminal["assistant"]["parts"] if p["type"] == "text")
        process.send_signal(signal.SIGTERM)
        rest = (await asyncio.wait_for(process.stdout.read(), WAIT)).decode()
        assert "threadline serve: stopped" in rest
        assert await asyncio.wait_for(process.wait(), WAIT) == 0
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()


@pytest.mark.parametrize(
    ("root", "message"),
    [("nope", "--root is ID:KIND:/absolute/path"), ("docs:resource:relative/dir", "absolute path")],
)
async def test_a_bad_root_is_one_error_line(tmp_path: Path, root: str, message: str) -> None:
    process = await start("serve", "--stdio", "--db", str(tmp_path / "x.db"), "--root", root)
    _out, err = await asyncio.wait_for(process.communicate(b""), START)
    assert process.returncode == 2
    assert err.decode().startswith("error: ") and message in err.decode()
