"""``threadline chat`` driven as a person would, in tmux, against the fault provider server.

A real terminal (a tmux pane, 200×50) runs ``python -m threadline.cli chat --base-url <fault server>``; the
test types with ``send-keys`` and reads the screen with ``capture-pane``. It types, watches the answer
stream in, presses Ctrl-C while an answer hangs mid-stream, types again, leaves, restarts the command and
finds the conversation where it left it. Every wait polls the screen for the expected text with a bound:
the verdict is the text on the screen, never the timing.
"""

from __future__ import annotations

import asyncio
import os
import re
import shlex
import shutil
import sys
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from threadline.history.projection import INTERRUPTED_MARKER
from threadline.testing import create_fault_provider_server, hang, stream_text

pytestmark = pytest.mark.subprocess

WAIT = 30.0
"""Upper bound for one expected text to appear (a broken build fails instead of hanging)."""


class Tmux:
    """One private tmux server (its own socket, no user configuration) with one pane."""

    def __init__(self) -> None:
        self.socket = f"threadline-test-{uuid.uuid4().hex[:8]}"
        self.session = ""
        self.started = 0

    async def tmux(self, *args: str) -> str:
        proc = await asyncio.create_subprocess_exec(
            "tmux",
            "-L",
            self.socket,
            "-f",
            "/dev/null",
            *args,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        out, err = await proc.communicate()
        assert proc.returncode == 0, f"tmux {args}: {err.decode()}"
        return out.decode()

    async def start(self, command: list[str], cwd: Path, env: dict[str, str]) -> None:
        """Run ``command`` in a fresh 200×50 pane. The pane's shell waits for it, then prints
        ``[exited <status>]`` and stays (tmux does not always reap a pane's process promptly, so the exit
        status is read from the screen, from the shell that waited for it). The shell's own trap keeps
        Ctrl-C for the command: the command still starts with the default SIGINT handling."""
        exports = [f"-e{key}={value}" for key, value in env.items()]
        previous, self.started = self.session, self.started + 1
        self.session = f"chat{self.started}"
        script = f"trap 'true' INT; {shlex.join(command)}; echo \"[exited $?]\"; exec sleep 3600"
        await self.tmux(
            "new-session", "-d", "-s", self.session, "-x", "200", "-y", "50", "-c", str(cwd), *exports, script
        )
        if previous:  # after the new one exists: killing the last session would stop the server
            await self.tmux("kill-session", "-t", previous)

    async def type(self, text: str) -> None:
        await self.tmux("send-keys", "-t", self.session, "-l", text)
        await self.tmux("send-keys", "-t", self.session, "Enter")

    async def key(self, key: str) -> None:
        await self.tmux("send-keys", "-t", self.session, key)

    async def screen(self) -> str:
        """The pane and its scrollback, wrapped lines joined."""
        return await self.tmux("capture-pane", "-p", "-J", "-S", "-500", "-t", self.session)

    async def wait_for(self, text: str, *, after: str = "", count: int = 1) -> str:
        """Wait until ``text`` shows ``count`` times (after the last ``after``, when given)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + WAIT
        screen = ""
        while loop.time() < deadline:
            screen = await self.screen()
            tail = screen.rsplit(after, 1)[-1] if after else screen
            if tail.count(text) >= count:
                return screen
            await asyncio.sleep(0.1)
        raise AssertionError(f"{text!r} did not appear within {WAIT}s; the screen:\n{screen}")

    async def wait_prompt(self) -> str:
        """Wait until the chat shows its prompt on the last line (ready for input)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + WAIT
        screen = ""
        while loop.time() < deadline:
            screen = await self.screen()
            if screen.rstrip().endswith("you ›"):
                return screen
            await asyncio.sleep(0.1)
        raise AssertionError(f"no prompt within {WAIT}s; the screen:\n{screen}")

    async def exit_status(self) -> int:
        """The command's exit status, once its shell printed it."""
        screen = await self.wait_for("[exited ")
        return int(re.findall(r"\[exited (\d+)\]", screen)[-1])

    async def kill(self) -> None:
        proc = await asyncio.create_subprocess_exec(
            "tmux",
            "-L",
            self.socket,
            "kill-server",
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.DEVNULL,
        )
        await proc.wait()


@pytest.fixture
async def tmux() -> AsyncIterator[Tmux]:
    if shutil.which("tmux") is None:
        reason = "tmux is not installed (.ci/run installs it)"
        if os.environ.get("THREADLINE_REQUIRE_TMUX") == "1":  # set by .ci/run: a skip there is a failure
            pytest.fail(reason)
        pytest.skip(reason)
    pane = Tmux()
    try:
        yield pane
    finally:
        await pane.kill()


def chat_command(base_url: str, db: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "threadline.cli",
        "chat",
        "--db",
        str(db),
        "--base-url",
        base_url,
        "--model",
        "fault-model",
        "--policy",
        "queue",
    ]


def clean_env() -> dict[str, str]:
    env = {
        "COLUMNS": "200",
        "LINES": "50",
        "TERM": "xterm-256color",
        "PYTHONUNBUFFERED": "1",
        "PYTHONFAULTHANDLER": "1",
    }
    env["PATH"] = os.environ.get("PATH", "/usr/bin:/bin")
    return env


async def test_chat_streams_interrupts_and_continues_after_a_restart(tmp_path: Path, tmux: Tmux) -> None:
    db = tmp_path / "chat.db"
    async with create_fault_provider_server() as server:
        server.script(
            [
                stream_text(["Hello", " from", " the fault", " server."], usage=(12, 5)),
                hang(["Once upon", " a time"]),
                stream_text(["Still here", " after the interrupt."], usage=(30, 6)),
                stream_text(["Welcome", " back."], usage=(41, 2)),
            ]
        )
        command = chat_command(server.base_url, db)

        # first session: a new conversation
        await tmux.start(command, tmp_path, clean_env())
        screen = await tmux.wait_prompt()
        assert "(new)" in screen and "policy queue" in screen
        await tmux.type("hi there")
        screen = await tmux.wait_for("Hello from the fault server.")
        screen = await tmux.wait_for("usage:", after="Hello from the fault server.")
        assert "in 12" in screen and "out 5" in screen and "⟨success⟩" in screen

        # an answer that hangs mid-stream: Ctrl-C interrupts it durably, the chat stays open
        await tmux.wait_prompt()
        await tmux.type("tell me a story")
        await tmux.wait_for("Once upon a time")
        await tmux.key("C-c")
        screen = await tmux.wait_for("⟨interrupted⟩", after="Once upon a time")
        assert "interrupt requested (durable)" in screen
        await asyncio.wait_for(server.wait_for_disconnect(1), WAIT)  # the provider call really ended

        # type again: the next answer streams, and the model saw the cut-off answer, marked
        await tmux.wait_prompt()
        await tmux.type("still there?")
        await tmux.wait_for("Still here after the interrupt.")
        sent = server.requests[2].messages
        assert [m["content"] for m in sent if m["role"] == "user"] == ["hi there", "tell me a story", "still there?"]
        answers = " ".join(str(m.get("content")) for m in sent if m["role"] == "assistant")
        assert "Once upon a time" in answers and INTERRUPTED_MARKER in answers

        # leave: Ctrl-C when nothing is answering
        await tmux.wait_prompt()
        await tmux.key("C-c")
        await tmux.wait_for("bye")
        assert await tmux.exit_status() == 0

        # restart the command: the same conversation, its history on screen, and it continues
        await tmux.start(command, tmp_path, clean_env())
        screen = await tmux.wait_prompt()
        assert "(new)" not in screen
        history = screen.split("last ", 1)[1]
        assert "still there?" in history and "Still here after the interrupt." in history
        assert "(interrupted)" in history
        await tmux.type("hello again")
        await tmux.wait_for("Welcome back.")
        sent = server.requests[3].messages
        assert [m["content"] for m in sent if m["role"] == "user"][-2:] == ["still there?", "hello again"]
        await tmux.wait_prompt()
        await tmux.type("/quit")
        await tmux.wait_for("bye", after="Welcome back.")
        assert await tmux.exit_status() == 0
        assert server.remaining == 0


async def test_chat_without_a_credential_is_one_line(tmp_path: Path, tmux: Tmux) -> None:
    """In a real terminal too: a missing key is one line naming the variable, and a non-zero exit."""
    env = {k: v for k, v in clean_env().items() if not k.startswith("OPENAI")}
    await tmux.start(
        [
            sys.executable,
            "-m",
            "threadline.cli",
            "chat",
            "--db",
            str(tmp_path / "x.db"),
            "--model",
            "openai:gpt-4.1-mini",
        ],
        tmp_path,
        env,
    )
    assert await tmux.exit_status() == 2
    lines = [line for line in (await tmux.screen()).splitlines() if line.strip() and "[exited" not in line]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "OPENAI_API_KEY" in lines[0], lines
    assert not (tmp_path / "x.db").exists()


async def test_two_chat_windows_on_one_conversation_leave_nothing_unanswered(tmp_path: Path) -> None:
    """Two `threadline chat` processes on one SQLite conversation. The second window's message queues behind
    the answer the first one is giving; when that answer ends (here: interrupted with Ctrl-C), the first
    window's runtime — the one that committed the terminal — answers the queued message too, and the
    second window shows that answer from the store. Nothing stays queued with nobody running it."""
    if shutil.which("tmux") is None:
        if os.environ.get("THREADLINE_REQUIRE_TMUX") == "1":
            pytest.fail("tmux is not installed (.ci/run installs it)")
        pytest.skip("tmux is not installed (.ci/run installs it)")
    db = tmp_path / "chat.db"
    one, two = Tmux(), Tmux()
    try:
        async with create_fault_provider_server() as server:
            server.script([hang(["Once upon", " a time"]), stream_text(["The end", " of the story."], usage=(9, 4))])
            command = chat_command(server.base_url, db)
            await one.start(command, tmp_path, clean_env())
            await one.wait_prompt()
            await one.type("tell me a story")
            await one.wait_for("Once upon a time")

            await two.start(command, tmp_path, clean_env())  # continues the same (most recent) conversation
            screen = await two.wait_prompt()
            assert "in another process" in screen
            await two.type("and then?")
            await two.wait_for("another window is giving")

            await one.key("C-c")  # the first answer ends; its runtime answers the queued message next
            await one.wait_for("⟨interrupted⟩")
            await one.wait_for("The end of the story.")
            await two.wait_for("The end of the story.")
            assert [m["content"] for m in server.requests[1].messages if m["role"] == "user"] == [
                "tell me a story",
                "and then?",
            ]
            for pane in (one, two):
                await pane.wait_prompt()
                await pane.type("/quit")
                assert await pane.exit_status() == 0
    finally:
        await one.kill()
        await two.kill()
    from threadline import create_sqlite_agent_runtime_store

    handle = create_sqlite_agent_runtime_store(db)
    try:
        page = await handle.store.conversations.list(limit=10)
        (head,) = page.items
        active = await handle.store.list_active_runs(conversation_id=head.conversation_id)
        assert active.runs == (), "nothing is left queued or running"
    finally:
        await handle.close()


async def test_typing_while_the_answer_streams_stays_below_it(tmp_path: Path, tmux: Tmux) -> None:
    """Keys typed while an answer streams land on the input line below the answer, never inside it; the
    line sent is echoed as the user's message with the policy it got; leaving says what is still queued,
    as the store has it."""
    db = tmp_path / "chat.db"
    async with create_fault_provider_server() as server:
        server.script([hang(["Once upon", " a time", " there was"])])
        await tmux.start(chat_command(server.base_url, db), tmp_path, clean_env())
        await tmux.wait_prompt()
        await tmux.type("tell me a story")
        screen = await tmux.wait_for("Once upon a time there was")
        assert "you › tell me a story  (policy queue)" in screen

        # type without Enter while the answer is on screen: the text sits on the input line, below it
        await tmux.tmux("send-keys", "-t", tmux.session, "-l", "and then?")
        screen = await tmux.wait_for("you › and then?")
        lines = [line.rstrip() for line in screen.splitlines() if line.strip()]
        answer = next(i for i, line in enumerate(lines) if "Once upon a time there was" in line)
        assert lines[answer].endswith("assistant ▸ Once upon a time there was")  # nothing typed inside it
        assert lines[-1] == "you › and then?" and answer < len(lines) - 1

        await tmux.key("Enter")  # sent while the answer streams: queued behind it
        await tmux.wait_for("you › and then?  (policy queue: waits for the answer in progress)")

        # leave while it still answers: the answer ends `shutdown`, the second message stays queued
        await tmux.type("/quit")
        screen = await tmux.wait_for("bye")
        assert "⟨shutdown⟩" in screen
        assert "1 message still queued: the next chat on it answers them." in " ".join(screen.split())
        assert await tmux.exit_status() == 0

    from threadline import create_sqlite_agent_runtime_store

    handle = create_sqlite_agent_runtime_store(db)
    try:
        (head,) = (await handle.store.conversations.list(limit=10)).items
        active = await handle.store.list_active_runs(conversation_id=head.conversation_id)
        assert [r.state for r in active.runs] == ["queued"]
    finally:
        await handle.close()
