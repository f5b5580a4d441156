"""The command line, end to end: ``threadline serve --admit-only --live`` admits and serves viewers, a
``threadline worker --live`` executes; a viewer of the server's SSE stream sees the worker's answer stream
in, and the server's page is the inspector."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from pathlib import Path

import httpx
import pytest

from .conftest import WAIT

pytestmark = pytest.mark.subprocess


async def start(*args: str) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "threadline.cli",
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )


async def stop(process: asyncio.subprocess.Process) -> None:
    if process.returncode is None:
        process.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(process.wait(), WAIT)
        except TimeoutError:
            process.kill()
            await process.wait()


async def test_an_admit_only_server_streams_what_a_live_worker_executes(tmp_path: Path) -> None:
    db = str(tmp_path / "live.db")
    server = await start("serve", "--admit-only", "--live", "--port", "0", "--db", db)
    worker = None
    try:
        assert server.stdout is not None
        first = (await asyncio.wait_for(server.stdout.readline(), WAIT * 2)).decode()
        assert first.startswith("threadline serve: listening on "), first
        url = first.split("listening on ")[1].strip()
        banner = (await asyncio.wait_for(server.stdout.readline(), WAIT)).decode()
        banner += (await asyncio.wait_for(server.stdout.readline(), WAIT)).decode()
        assert "admitting only" in banner
        worker = await start("worker", "--live", "--db", db, "--poll", "0.05", "--no-gc-tuning")
        assert worker.stdout is not None
        assert (await asyncio.wait_for(worker.stdout.readline(), WAIT * 2)).startswith(b"worker ")

        async with httpx.AsyncClient(base_url=url, timeout=WAIT) as client:
            page = await client.get("/")
            assert page.status_code == 200 and "threadline inspector" in page.text
            kinds: list[str] = []
            async with client.stream("GET", "/conversations/c1/events") as response:
                lines = response.aiter_lines()
                admitted = await client.post(
                    "/conversations/c1/inputs", json={"idempotency_key": "1", "text": "Plan a day in Lisbon"}
                )
                assert admitted.status_code == 202
                async with asyncio.timeout(WAIT):
                    async for line in lines:
                        if not line.startswith("data: "):
                            continue
                        event = json.loads(line[6:])
                        kinds.append(event.get("type", "snapshot"))
                        if event.get("type") == "terminal":
                            break
        assert event["terminal_reason"] == "success"
        assert "Lisbon" in "".join(p["text"] for p in event["assistant"]["parts"] if p["type"] == "text")
        # the worker's stream, relayed: the server executes nothing itself
        assert "assistant-delta" in kinds and kinds.index("assistant-delta") < kinds.index("terminal")
    finally:
        if worker is not None:
            await stop(worker)
        await stop(server)
