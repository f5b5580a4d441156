"""run_command with real subprocesses: process groups, timeouts, output bounds, artifacts and cancellation."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

import pytest

from threadline import AppError
from threadline.coding import (
    AgentCodingToolLimits,
    create_agent_coding_tools,
    create_memory_agent_coding_artifact_store,
    create_sqlite_agent_coding_artifact_store,
)
from threadline.tools import AgentToolContext

pytestmark = pytest.mark.subprocess

PY = sys.executable


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie is dead for our purposes
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().split(") ")[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


async def wait_dead(pid: int, timeout: float = 5.0) -> bool:
    async def poll() -> None:
        while alive(pid):
            await asyncio.sleep(0.02)

    try:
        await asyncio.wait_for(poll(), timeout)
    except TimeoutError:
        return False
    return True


async def test_runs_an_alias_with_arguments_in_the_pinned_cwd_and_only_the_given_environment(
    make_tools, workspace: Path
) -> None:
    os.environ["THREADLINE_TEST_LEAK"] = "leaked"
    try:
        tools = make_tools(executables={"py": PY}, environment={"ONLY": "this"})
        code = "import os,sys; print(os.getcwd()); print(sorted(os.environ)); sys.stderr.write('err'); sys.exit(3)"
        result = await tools.call("run_command", executable="py", args=["-c", code], cwd="src")
    finally:
        del os.environ["THREADLINE_TEST_LEAK"]
    lines = result["stdout"].splitlines()
    assert lines[0] == str(workspace / "src")
    assert "THREADLINE_TEST_LEAK" not in lines[1] and "'ONLY'" in lines[1]
    assert result["stderr"] == "err"
    assert (result["exit_code"], result["signal"], result["outcome"]) == (3, None, "exited")
    assert tools.asked[-1] == {"operation": "shell", "executable": "py", "args": ["-c", code], "cwd": "src"}
    assert tools.paths == []  # path admission does not constrain run_command


async def test_refusals_before_spawning(make_tools, tmp_path: Path) -> None:
    marker = tmp_path / "spawned"
    tools = make_tools(executables={"py": PY}, refuse_operations=("shell",))
    spawn = ["-c", f"open({str(marker)!r}, 'w')"]
    assert (await tools.envelope("run_command", executable="py", args=spawn))["error"] == "FORBIDDEN"
    allowed = make_tools(executables={"py": PY}, limits=AgentCodingToolLimits(max_shell_arguments=2))
    assert (await allowed.envelope("run_command", executable="sh", args=[]))["error"] == "INVALID_ARGUMENTS"
    assert (await allowed.envelope("run_command", executable="py", args=["a", "b", "c"]))["error"] == "BAD_REQUEST"
    assert (await allowed.envelope("run_command", executable="py", args=["a\x00"]))["error"] == "BAD_REQUEST"
    assert (await allowed.envelope("run_command", executable="py", cwd="../"))["error"] == "FORBIDDEN"
    # the working directory is held to the file tools' spelling: a backslash or a '..' segment is FORBIDDEN
    (tmp_path / "ws" / "work").mkdir()
    for cwd in ("work\\nested", "work/../work"):
        assert (await allowed.envelope("run_command", executable="py", cwd=cwd))["error"] == "FORBIDDEN", cwd
    assert (await allowed.envelope("run_command", executable="py", cwd="nope"))["error"] == "NOT_FOUND"
    assert not marker.exists()


async def test_stdin_reaches_the_command(make_tools) -> None:
    tools = make_tools(executables={"py": PY})
    result = await tools.call(
        "run_command", executable="py", args=["-c", "import sys; print(sys.stdin.read().upper())"], stdin="hi"
    )
    assert result["stdout"] == "HI\n"


async def test_background_children_die_when_the_leader_exits(make_tools, tmp_path: Path) -> None:
    pidfile = tmp_path / "child.pid"
    script = (
        "import subprocess,sys;"
        f"p=subprocess.Popen([sys.executable,'-c','import time; time.sleep(60)']);"
        f"open({str(pidfile)!r},'w').write(str(p.pid));print('leader done')"
    )
    tools = make_tools(executables={"py": PY}, limits=AgentCodingToolLimits(shell_timeout=20))
    result = await asyncio.wait_for(tools.call("run_command", executable="py", args=["-c", script]), timeout=15)
    assert result["outcome"] == "exited" and result["stdout"] == "leader done\n"
    assert await wait_dead(int(pidfile.read_text()))


async def test_timeout_kills_the_whole_group(make_tools, tmp_path: Path) -> None:
    pidfile = tmp_path / "child.pid"
    script = (
        "import subprocess,sys,time;"
        f"p=subprocess.Popen([sys.executable,'-c','import time; time.sleep(60)']);"
        f"open({str(pidfile)!r},'w').write(str(p.pid));print('started',flush=True);time.sleep(60)"
    )
    tools = make_tools(executables={"py": PY}, limits=AgentCodingToolLimits(shell_timeout=1.0))
    result = await asyncio.wait_for(tools.call("run_command", executable="py", args=["-c", script]), timeout=15)
    assert result["outcome"] == "timeout" and result["signal"] == "SIGKILL" and result["exit_code"] is None
    assert result["stdout"] == "started\n"
    assert await wait_dead(int(pidfile.read_text()))


async def test_cancellation_during_a_run_kills_every_process_of_the_group_and_propagates(
    make_tools, tmp_path: Path
) -> None:
    pidfile = tmp_path / "pids"
    script = (
        "import os,subprocess,sys,time;"
        "p=subprocess.Popen([sys.executable,'-c','import time; time.sleep(60)']);"
        f"open({str(pidfile)!r},'w').write(f'{{os.getpid()}} {{p.pid}}');time.sleep(60)"
    )
    tools = make_tools(executables={"py": PY})
    task = asyncio.create_task(tools.call("run_command", executable="py", args=["-c", script]))

    async def started() -> None:
        while not pidfile.exists() or len(pidfile.read_text().split()) < 2:
            await asyncio.sleep(0.02)

    await asyncio.wait_for(started(), timeout=10)
    leader, child = map(int, pidfile.read_text().split())
    assert alive(leader) and alive(child)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, timeout=10)
    assert await wait_dead(leader) and await wait_dead(child)


async def test_output_limit_without_a_store(make_tools) -> None:
    tools = make_tools(executables={"py": PY}, limits=AgentCodingToolLimits(max_shell_output_bytes=1000))
    script = "import sys,time\nwhile True:\n    sys.stdout.write('é' * 500); sys.stdout.flush()"
    result = await asyncio.wait_for(tools.call("run_command", executable="py", args=["-c", script]), timeout=15)
    assert result["outcome"] == "output-limit" and "artifact" not in result
    assert len(result["stdout"].encode()) <= 1000 and set(result["stdout"]) == {"é"}  # cut on a boundary


@pytest.mark.parametrize("kind", ["memory", "sqlite"])
async def test_output_beyond_the_preview_goes_to_an_artifact(make_tools, tmp_path: Path, kind: str) -> None:
    store = (
        create_memory_agent_coding_artifact_store()
        if kind == "memory"
        else create_sqlite_agent_coding_artifact_store(str(tmp_path / "artifacts.db"))
    )
    tools = make_tools(
        executables={"py": PY}, artifacts=store, limits=AgentCodingToolLimits(max_shell_output_bytes=2000)
    )
    assert {"read_output", "search_output"} <= set(tools.by_name)
    script = "for n in range(1, 2001): print(f'line {n}')"
    result = await tools.call("run_command", executable="py", args=["-c", script])
    artifact = result["artifact"]
    assert result["outcome"] == "exited" and artifact["truncated"] is False
    assert result["stdout"].startswith("line 1\n") and result["stdout"].endswith("line 2000\n")
    # the preview is the head and the tail joined; the cut is described by the artifact, not inlined
    assert "omitted" not in result["stdout"]
    assert len(result["stdout"].encode()) == artifact["head_bytes"] + artifact["tail_bytes"]
    assert artifact["omitted_bytes"] > 0 and artifact["head_bytes"] + artifact["tail_bytes"] <= 2000
    first = await tools.call("read_output", reference=artifact["reference"], max_bytes=30)
    assert first["text"].startswith("--- stdout ---\nline 1\n") and first["next_offset"] == 30
    assert first["total_bytes"] == artifact["bytes"]
    found = await tools.call("search_output", reference=artifact["reference"], query="line 1500")
    assert found["matches"] == [{"line": 1501, "text": "line 1500"}]
    assert tools.asked[-2]["operation"] == "artifact-search"
    assert tools.asked[-1]["operation"] == "shell"  # the originating authorization is asked again
    unknown = await tools.envelope("read_output", reference="art_nope")
    assert (unknown["error"], unknown["status"]) == ("SPILL_REFERENCE_UNKNOWN", 404)
    assert "art_nope" in unknown["message"] and unknown["_hint"]
    # another conversation cannot see it: absent exactly like an unknown reference, not forbidden
    with pytest.raises(AppError) as info:
        await tools.call("read_output", conversation_id="other", reference=artifact["reference"])
    assert info.value.code == "SPILL_REFERENCE_UNKNOWN"
    if kind == "sqlite":
        store.close()


async def test_signal_of_a_killed_leader_is_named(make_tools) -> None:
    tools = make_tools(executables={"py": PY})
    result = await tools.call(
        "run_command", executable="py", args=["-c", "import os,signal; os.kill(os.getpid(), signal.SIGTERM)"]
    )
    assert (result["exit_code"], result["signal"], result["outcome"]) == (None, signal.SIGTERM.name, "exited")


async def test_a_call_whose_task_is_already_cancelled_returns_cancelled_without_asking_or_spawning(
    make_tools, tmp_path: Path
) -> None:
    marker = tmp_path / "spawned"
    tools = make_tools(executables={"py": PY})
    seen: list[dict] = []

    async def aborted_before_the_call() -> None:
        asyncio.current_task().cancel()  # the request is pending: it lands at this task's next await
        seen.append(await tools.call("run_command", executable="py", args=["-c", f"open({str(marker)!r}, 'w')"]))
        await asyncio.sleep(0)  # the cancellation was not swallowed: it lands here

    task = asyncio.create_task(aborted_before_the_call())
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, timeout=10)
    assert seen == [
        {"executable": "py", "exit_code": None, "signal": None, "stdout": "", "stderr": "", "outcome": "cancelled"}
    ]
    assert tools.asked == [] and not marker.exists()


def run_command_of(root: Path, authorize, args: list[str]):
    """The ``run_command`` call of a tool set whose host answers with ``authorize`` (a coroutine to await)."""
    (tool,) = [
        t
        for t in create_agent_coding_tools(root=root, authorize=authorize, executables={"py": PY})
        if t.name == "run_command"
    ]
    ctx = AgentToolContext(conversation_id="c", run_id="r", call_id="k", tool_name="run_command", context=None)
    return tool.call(ctx, tool.validate({"executable": "py", "args": args}))


async def test_an_abort_requested_while_the_host_decides_returns_cancelled_without_spawning(
    workspace: Path, tmp_path: Path
) -> None:
    marker = tmp_path / "spawned"
    asked: list[str] = []

    def authorize(payload: dict) -> bool:
        asked.append(payload["operation"])
        asyncio.current_task().cancel()  # e.g. the host stopped the run from its callback, then said yes
        return True

    spawn = run_command_of(workspace, authorize, ["-c", f"open({str(marker)!r}, 'w')"])
    seen: list[dict] = []

    async def call() -> None:
        seen.append(await spawn)
        await asyncio.sleep(0)

    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(asyncio.create_task(call()), timeout=10)
    assert asked == ["shell"] and seen[0]["outcome"] == "cancelled" and seen[0]["exit_code"] is None
    assert not marker.exists()


async def test_a_cancellation_delivered_while_the_host_decides_propagates_and_spawns_nothing(
    workspace: Path, tmp_path: Path
) -> None:
    marker = tmp_path / "spawned"
    deciding = asyncio.Event()
    cancelled: list[str] = []

    async def authorize(payload: dict) -> bool:
        deciding.set()
        try:
            await asyncio.Event().wait()  # a host that never answers
        except asyncio.CancelledError:
            cancelled.append(payload["operation"])
            raise
        return True

    task = asyncio.create_task(run_command_of(workspace, authorize, ["-c", f"open({str(marker)!r}, 'w')"]))
    await asyncio.wait_for(deciding.wait(), timeout=10)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, timeout=10)
    assert cancelled == ["shell"] and not marker.exists()
