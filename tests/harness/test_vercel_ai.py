"""The Vercel AI SDK UI message stream endpoint, read by the real ``ai`` npm package (issue 21 item 4).

The test installs ``ai`` from the npm registry into a cache directory (``THREADLINE_NODE_CACHE``, default
``~/.cache/threadline-tests``) and drives ``/api/chat`` with its ``DefaultChatTransport`` and
``readUIMessageStream`` — what ``useChat`` does — so an existing front end needs no custom client. Without
Node or npm the test skips with the reason, except in CI (``CI`` set), where that is a failure."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from threadline import define_agent_tool
from threadline.server import create_agent_harness_app, static_bearer_token

from .conftest import SECRET, WAIT, Scripted, make_harness, serving

AI_VERSION = "6.0.325"
CLIENT = Path(__file__).parent / "node" / "use_chat.mjs"


def _unavailable(reason: str) -> None:
    if os.environ.get("CI"):
        pytest.fail(reason)
    pytest.skip(reason)


@pytest.fixture(scope="session")
def ai_client() -> Path:
    """A directory holding ``ai`` (installed from npm once) and the client script."""
    node, npm = shutil.which("node"), shutil.which("npm")
    if node is None or npm is None:
        _unavailable("Node.js and npm are needed to read the stream with the ai package")
    cache = Path(os.environ.get("THREADLINE_NODE_CACHE") or Path.home() / ".cache" / "threadline-tests")
    directory = cache / f"ai-{AI_VERSION}"
    if not (directory / "node_modules" / "ai" / "package.json").exists():
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "package.json").write_text('{"name": "threadline-ai-client", "private": true, "type": "module"}')
        installed = subprocess.run(
            [npm, "install", "--no-audit", "--no-fund", "--silent", f"ai@{AI_VERSION}"],
            cwd=directory,
            capture_output=True,
            text=True,
            timeout=600,
        )
        if installed.returncode != 0:
            _unavailable(f"npm install ai@{AI_VERSION} failed: {installed.stderr[-500:]}")
    shutil.copy(CLIENT, directory / CLIENT.name)
    return directory


async def use_chat(client: Path, request: dict[str, Any], tmp_path: Path) -> dict[str, Any]:
    payload = tmp_path / f"request-{os.urandom(4).hex()}.json"
    payload.write_text(json.dumps(request))
    process = await asyncio.create_subprocess_exec(
        "node",
        str(client / CLIENT.name),
        str(payload),
        cwd=client,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        out, err = await asyncio.wait_for(process.communicate(), WAIT * 3)
    except TimeoutError:
        process.kill()
        await process.wait()
        raise
    assert process.returncode == 0, err.decode()
    return json.loads(out)


def user(message_id: str, text: str) -> dict[str, Any]:
    return {"id": message_id, "role": "user", "parts": [{"type": "text", "text": text}]}


async def test_use_chat_reads_the_answer_stream(ai_client: Path, tmp_path: Path, scripted: Scripted) -> None:
    harness = make_harness(scripted)
    async with serving(create_agent_harness_app(harness)) as base:
        request = {"api": f"http://{base}/api/chat", "chatId": "chat-1", "messages": [user("u-1", "hello vercel")]}
        read = await use_chat(ai_client, request, tmp_path)
        snapshot = await harness.snapshot("chat-1")
        stored = snapshot.messages[-1]
        assert read["message"]["id"] == stored.id, "the message id is the stored assistant's"
        texts = [p["text"] for p in read["message"]["parts"] if p["type"] == "text"]
        assert texts == ["answer to: hello vercel"]
        assert read["chunks"][0] == "start" and read["chunks"][-1] == "finish"
        assert {"start-step", "text-start", "text-delta", "text-end", "finish-step"} <= set(read["chunks"])

        again = await use_chat(ai_client, request, tmp_path)  # the same message id: the same run, its stored answer
        assert [p["text"] for p in again["message"]["parts"] if p["type"] == "text"] == texts
        assert len((await harness.snapshot("chat-1")).runs) == 1
    await harness.close()


async def test_tool_calls_and_approvals_round_trip_through_use_chat(ai_client: Path, tmp_path: Path) -> None:
    effects: list[int] = []

    @define_agent_tool
    async def charge(amount: int) -> str:
        effects.append(amount)
        return f"charged {amount}"

    scripted = Scripted(tool="charge", tool_args='{"amount": 9}')
    harness = make_harness(scripted, tools=[charge], loop={"tool_approval": ["charge"], "tool_approval_secret": SECRET})
    app = create_agent_harness_app(harness, authenticate=static_bearer_token("tok", {"user_id": "u1"}))
    async with serving(app) as base:
        api = f"http://{base}/api/chat"
        first = await use_chat(
            ai_client, {"api": api, "chatId": "c", "messages": [user("u-1", "pay 9")], "token": "tok"}, tmp_path
        )
        [tool] = [p for p in first["message"]["parts"] if p["type"] == "tool-charge"]
        assert tool["state"] == "approval-requested" and tool["input"] == {"amount": 9}
        assert effects == [] and "tool-approval-request" in first["chunks"]

        answered = {**first["message"]}
        answered["parts"] = [
            {**p, "state": "approval-responded", "approval": {"id": p["approval"]["id"], "approved": True}}
            if p["type"] == "tool-charge"
            else p
            for p in first["message"]["parts"]
        ]
        second = await use_chat(
            ai_client,
            {"api": api, "chatId": "c", "messages": [user("u-1", "pay 9"), answered], "token": "tok"},
            tmp_path,
        )
        assert effects == [9], "the approved call ran once, behind its fence"
        parts = second["message"]["parts"]
        outputs = [p for p in parts if p["type"] == "tool-charge" and p["state"] == "output-available"]
        assert outputs and outputs[0]["output"] == "charged 9"
        assert [p["text"] for p in parts if p["type"] == "text"][-1] == "the tool said: charged 9"
    await harness.close()


async def test_bad_chat_requests_are_refused_naming_the_field(tmp_path: Path, scripted: Scripted) -> None:
    import httpx

    harness = make_harness(scripted)
    async with (
        serving(create_agent_harness_app(harness)) as base,
        httpx.AsyncClient(base_url=f"http://{base}") as client,
    ):
        regenerate = await client.post("/api/chat", json={"trigger": "regenerate-message", "id": "c", "messages": []})
        assert regenerate.status_code == 422 and regenerate.json()["error"]["field"] == "trigger"
        no_trigger = await client.post("/api/chat", json={"id": "c", "messages": []})
        assert no_trigger.status_code == 422 and no_trigger.json()["error"]["field"] == "trigger"
        empty = await client.post("/api/chat", json={"trigger": "submit-message", "id": "c", "messages": []})
        assert empty.status_code == 422 and empty.json()["error"]["field"] == "messages"
        malformed = await client.post(
            "/api/chat", json={"trigger": "submit-message", "id": "c", "messages": [{"id": "x", "role": "user"}]}
        )
        assert malformed.status_code == 422 and malformed.json()["error"]["field"] == "messages.0.parts"
    await harness.close()
