"""The bubblewrap launcher with real bwrap: only the workspace is writable, no network, a private /tmp, and no
process outlives the command. CI installs bubblewrap (.ci/run)."""

from __future__ import annotations

import asyncio
import socket
import sys
from pathlib import Path

import pytest

from threadline.coding import AgentCodingToolLimits, AgentSandboxUnavailableError
from threadline.coding.sandbox import create_bubblewrap_launcher
from threadline.coding.workspace import Workspace

pytestmark = pytest.mark.subprocess

PY = sys.executable


def test_a_missing_bwrap_refuses_construction(workspace: Path) -> None:
    with pytest.raises(AgentSandboxUnavailableError) as info:
        create_bubblewrap_launcher(Workspace(workspace), {"py": PY}, bwrap=str(workspace / "no-bwrap"))
    assert (info.value.code, info.value.status) == ("SANDBOX_UNAVAILABLE", 503)
    assert "bubblewrap" in info.value.hint


async def test_commands_see_only_the_workspace_writable(make_tools, workspace: Path, tmp_path: Path) -> None:
    outside = tmp_path / "outside" / "secret.txt"
    marker = tmp_path / "host-marker"
    marker.write_text("host")
    tools = make_tools(executables={"py": PY}, sandbox="bubblewrap")
    script = f"""
import os, pathlib
pathlib.Path('made-inside.txt').write_text('ok')
results = []
for target in ({str(outside)!r}, '/usr/evil', {str(tmp_path / "evil.txt")!r}):
    try:
        open(target, 'w').write('x')
        results.append('wrote')
    except OSError as error:
        results.append(type(error).__name__)
print(os.getcwd())
print(results)
print(os.path.exists({str(marker)!r}), os.path.exists({str(outside)!r}))
"""
    result = await asyncio.wait_for(tools.call("run_command", executable="py", args=["-c", script], cwd="src"), 30)
    assert result["exit_code"] == 0, result
    cwd, results, visible = result["stdout"].splitlines()
    assert cwd == str(workspace / "src")
    # outside the workspace: the host's files are invisible, /usr is read-only, and what is written to the
    # sandbox's private /tmp never reaches the host
    assert results == "['FileNotFoundError', 'OSError', 'wrote']"
    assert visible == "False False"
    assert (workspace / "src" / "made-inside.txt").read_text() == "ok"
    assert outside.read_text() == "outside secret\n" and not (tmp_path / "evil.txt").exists()


async def test_no_network_in_the_sandbox(make_tools) -> None:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    port = server.getsockname()[1]
    try:
        tools = make_tools(executables={"py": PY}, sandbox="bubblewrap")
        script = (
            f"import socket\ntry:\n    socket.create_connection(('127.0.0.1', {port}), timeout=3)\n"
            "    print('connected')\nexcept OSError as e:\n    print('refused', type(e).__name__)"
        )
        result = await asyncio.wait_for(tools.call("run_command", executable="py", args=["-c", script]), 30)
    finally:
        server.close()
    assert result["stdout"].startswith("refused"), result


async def test_an_escaped_background_process_dies_with_the_sandbox(make_tools, workspace: Path) -> None:
    # the child leaves the process group (setsid); the PID namespace still ends it with the command
    script = (
        "import subprocess, sys\n"
        'subprocess.Popen([sys.executable, \'-c\', \'import time; time.sleep(30); open("late.txt","w").write("x")\'],'
        " start_new_session=True)\n"
        "print('leader done')"
    )
    tools = make_tools(executables={"py": PY}, sandbox="bubblewrap", limits=AgentCodingToolLimits(shell_timeout=20))
    result = await asyncio.wait_for(tools.call("run_command", executable="py", args=["-c", script]), 30)
    assert result["stdout"] == "leader done\n" and result["outcome"] == "exited"
    assert not (workspace / "late.txt").exists()


async def test_an_executable_under_the_hosts_tmp_still_runs(make_tools, tmp_path: Path) -> None:
    # a virtual environment under /tmp (a CI clone's): its interpreter is bound on top of the private /tmp,
    # not hidden by it, and the rest of the host's /tmp stays invisible
    link = tmp_path / "venv" / "bin" / "python"
    link.parent.mkdir(parents=True)
    link.symlink_to(PY)
    assert str(link).startswith("/tmp/")
    tools = make_tools(executables={"py": str(link)}, sandbox="bubblewrap")
    script = f"import os; print('ran', os.path.exists({str(tmp_path / 'host-only')!r}))"
    (tmp_path / "host-only").write_text("x")
    result = await asyncio.wait_for(tools.call("run_command", executable="py", args=["-c", script]), 30)
    assert (result["exit_code"], result["stdout"]) == (0, "ran False\n"), result
