"""``run_command``: one host-declared executable, an argument list (never a shell string), bounded time and output.

The command runs with only the configured environment (empty by default), in its own session and process
group, with the pinned working directory handed over as ``/proc/self/fd/N`` (the application process never
changes its own cwd). When the leader exits, times out, overflows its output budget or the calling task is
cancelled, every process still in the group is killed (SIGKILL) and the pipes are drained for at most
``shell_termination_grace`` seconds — a background child cannot turn a finished command into an unbounded
one. A process that deliberately leaves the group (``setsid``) is outside this guarantee; the bubblewrap
launcher's PID namespace closes that gap.

Output: stdout and stderr are returned inline up to ``max_shell_output_bytes`` together. With an artifact store
the rest (up to ``max_artifact_bytes``) is kept in an artifact and the inline text becomes a head + tail
preview cut on UTF-8 boundaries; ``read_output`` / ``search_output`` read the artifact. Without a store the
command stops at the inline budget (``outcome: "output-limit"``).

Cancellation. A run's abort reaches its tool call as the cancellation of the task executing it (the loop's
``RunControl.abort`` cancels that task; :class:`~threadline.AgentToolContext` carries no separate signal). A
call whose task already has a cancellation request pending — the run was aborted before the command was
launched, e.g. by a host callback that stopped the run — returns ``outcome: "cancelled"`` without spawning
anything and without swallowing the request: it is still delivered at the caller's next ``await``. A
cancellation delivered while the host is deciding propagates as it is (nothing was spawned). Once the
command runs, cancelling the call kills the group, waits (shielded) for its settlement within the grace, and
re-raises: nothing keeps running after a cancelled call.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import signal
from typing import Any, Literal

from pydantic import ConfigDict, Field, create_model

from ..tools import AgentTool, AgentToolContext, define_agent_tool
from .policy import CodingConfig, authorize, maybe, refuse, workspace_refusals
from .workspace import PROC_FD, join_segments

logger = logging.getLogger("threadline.coding")

_STDOUT_HEADER = b"--- stdout ---\n"
_STDERR_HEADER = b"\n--- stderr ---\n"
_CHUNK = 65_536


def _head(data: bytes, budget: int) -> bytes:
    cut = min(budget, len(data))
    while 0 < cut < len(data) and data[cut] & 0xC0 == 0x80:
        cut -= 1
    return data[:cut]


def _tail(data: bytes, budget: int) -> bytes:
    start = max(0, len(data) - budget)
    while start < len(data) and data[start] & 0xC0 == 0x80:
        start += 1
    return data[start:]


class _Output:
    """Bytes kept from one command's stdout and stderr, within ``keep`` bytes together."""

    def __init__(self, keep: int) -> None:
        self.keep = keep
        self.stdout = bytearray()
        self.stderr = bytearray()
        self.overflowed = asyncio.Event()

    async def pump(self, stream: asyncio.StreamReader | None, target: bytearray) -> None:
        if stream is None:
            return
        while True:
            chunk = await stream.read(_CHUNK)
            if not chunk:
                return
            room = self.keep - len(self.stdout) - len(self.stderr)
            if room > 0:
                target += chunk[:room]
            if len(chunk) > room:
                self.overflowed.set()


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


async def _feed(process: asyncio.subprocess.Process, data: bytes | None) -> None:
    if process.stdin is None:
        return
    with contextlib.suppress(BrokenPipeError, ConnectionResetError):
        if data:
            process.stdin.write(data)
            await process.stdin.drain()
        process.stdin.close()


def _abort_pending() -> bool:
    """Whether the calling task has a cancellation request it has not received yet (asyncio delivers it at
    the next suspension): the call's run was aborted and nothing may be launched."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


def _cancelled(executable: str) -> dict[str, Any]:
    """The result of a call aborted before launch: nothing ran."""
    return {
        "executable": executable,
        "exit_code": None,
        "signal": None,
        "stdout": "",
        "stderr": "",
        "outcome": "cancelled",
    }


async def _leader_exit(process: asyncio.subprocess.Process) -> None:
    """Return when the leader has exited and been reaped. (``Process.wait()`` on Python 3.11 also waits for
    the pipes to close, which a background child holding stdout would delay forever.) A pidfd signals the
    exit without polling; the child watcher sets the return code right after."""
    try:
        pidfd = os.pidfd_open(process.pid)
    except (OSError, AttributeError):
        pidfd = None
    if pidfd is not None:
        loop = asyncio.get_running_loop()
        exited = loop.create_future()
        loop.add_reader(pidfd, lambda: exited.done() or exited.set_result(None))
        try:
            await exited
        finally:
            loop.remove_reader(pidfd)
            os.close(pidfd)
    while process.returncode is None:
        await asyncio.sleep(0.005)


async def _settle(process: asyncio.subprocess.Process, pumps: list[asyncio.Task[Any]], grace: float) -> None:
    """Kill whatever remains of the group, then wait (bounded) for the leader and the pipes."""
    _kill_group(process.pid)
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(_leader_exit(process), timeout=grace)
    _, pending = await asyncio.wait(pumps, timeout=grace)
    for task in pending:  # a descendant that escaped the group holds a pipe: stop reading it
        task.cancel()
    if pending:
        await asyncio.wait(pending)
    if process.returncode is None:  # not reaped within the grace: the kernel will, we do not wait longer
        logger.warning("run_command: pid %s did not exit within the termination grace", process.pid)


def create_command_tools(config: CodingConfig) -> list[AgentTool]:
    limits, workspace = config.limits, config.workspace
    aliases = sorted(config.executables)
    args_model = create_model(
        "run_command_args",
        __config__=ConfigDict(extra="forbid"),
        executable=(Literal[tuple(aliases)], Field(description="One of the host's executable aliases.")),  # type: ignore[valid-type]
        args=(list[str], Field(default_factory=list, description="Arguments, one string each (no shell).")),
        cwd=(str, Field(".", description="Workspace-relative working directory.")),
        stdin=(str | None, Field(None, description="Text written to the command's standard input.")),
    )

    @define_agent_tool(
        name="run_command",
        args=args_model,
        description=(
            f"Run one of the host's executables ({', '.join(aliases)}) with an argument list (never a shell "
            "string), bounded time and output. Returns exit_code, signal, stdout, stderr and outcome "
            "(exited, timeout, output-limit, cancelled); long output is previewed and kept in an artifact."
        ),
    )
    async def run_command(
        ctx: AgentToolContext, executable: str, args: list[str], cwd: str = ".", stdin: str | None = None
    ) -> dict[str, Any]:
        if len(args) > limits.max_shell_arguments:
            refuse(
                "BAD_REQUEST",
                f"{len(args)} arguments, over the limit of {limits.max_shell_arguments}",
                hint="pass fewer arguments",
            )
        if any("\x00" in a for a in args):
            refuse("BAD_REQUEST", "an argument cannot contain a NUL byte", hint="remove the NUL byte")
        try:
            argument_bytes = sum(len(a.encode()) for a in args)
            stdin_bytes = stdin.encode() if stdin is not None else None
        except UnicodeEncodeError:
            refuse("BAD_REQUEST", "arguments and stdin must be valid Unicode text", hint="fix the text")
        if argument_bytes > limits.max_shell_argument_bytes:
            refuse(
                "BAD_REQUEST",
                f"the arguments are {argument_bytes} bytes, over the {limits.max_shell_argument_bytes}-byte limit",
                hint="pass less data on the command line (write a file and pass its path)",
            )
        if stdin_bytes is not None and len(stdin_bytes) > limits.max_write_bytes:
            refuse("BAD_REQUEST", "stdin is over the write limit", hint="write the input to a file instead")
        if _abort_pending():  # aborted before execution: the host is not asked, nothing is spawned
            return _cancelled(executable)
        async with workspace_refusals():
            segments = workspace.parse(cwd, allow_root=True, max_path_bytes=limits.max_path_bytes)
            relative = join_segments(segments)
            directory = workspace.open_directory(segments)
        try:
            payload = {"operation": "shell", "executable": executable, "args": list(args), "cwd": relative}
            await authorize(config, payload)
            pinned = os.fstat(directory)
            if workspace.directory_identity(segments) != (pinned.st_dev, pinned.st_ino):
                refuse(
                    "CONFLICT",
                    "the working directory was replaced while the command was being authorized",
                    path=relative,
                    hint="call run_command again",
                )
            program = config.executables[executable]
            if config.launcher is not None:
                argv, spawn_cwd = await maybe(config.launcher.prepare(program, list(args), directory))
            else:
                argv, spawn_cwd = [program, *args], f"{PROC_FD}/{directory}"
            if _abort_pending():  # aborted while the host decided (e.g. its callback stopped the run)
                return _cancelled(executable)
            process = await asyncio.create_subprocess_exec(
                *argv,
                cwd=spawn_cwd,
                env=dict(config.environment),
                stdin=asyncio.subprocess.PIPE if stdin_bytes is not None else asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                start_new_session=True,  # its own session and process group: pgid == pid
            )
        finally:
            os.close(directory)
        keep = limits.max_shell_output_bytes
        if config.artifacts is not None:
            keep = limits.max_artifact_bytes - len(_STDOUT_HEADER) - len(_STDERR_HEADER)
        output = _Output(keep)
        pumps = [
            asyncio.create_task(output.pump(process.stdout, output.stdout)),
            asyncio.create_task(output.pump(process.stderr, output.stderr)),
        ]
        feeder = asyncio.create_task(_feed(process, stdin_bytes))
        overflow = asyncio.create_task(output.overflowed.wait())
        leader = asyncio.create_task(_leader_exit(process))
        outcome = "exited"
        try:
            done, _ = await asyncio.wait(
                {leader, overflow}, timeout=limits.shell_timeout, return_when="FIRST_COMPLETED"
            )
            if overflow in done:
                outcome = "output-limit"
            elif leader not in done:
                outcome = "timeout"
        except asyncio.CancelledError:
            await asyncio.shield(_settle(process, pumps, limits.shell_termination_grace))
            raise
        finally:
            overflow.cancel()
            feeder.cancel()
            await asyncio.shield(_settle(process, pumps, limits.shell_termination_grace))
            leader.cancel()
        if outcome == "exited" and output.overflowed.is_set():
            outcome = "output-limit"
        code = process.returncode
        return await _result(config, ctx, executable, code, outcome, output, payload)

    return [run_command]


async def _result(
    config: CodingConfig,
    ctx: AgentToolContext,
    executable: str,
    code: int | None,
    outcome: str,
    output: _Output,
    payload: dict[str, Any],
) -> dict[str, Any]:
    limits = config.limits
    stdout, stderr = bytes(output.stdout), bytes(output.stderr)
    if outcome in ("timeout", "output-limit", "cancelled"):
        exit_code, signal_name = None, None
        if code is not None and code < 0:
            signal_name = signal.Signals(-code).name
    else:
        exit_code = code if code is not None and code >= 0 else None
        signal_name = signal.Signals(-code).name if code is not None and code < 0 else None
    result: dict[str, Any] = {"executable": executable, "exit_code": exit_code, "signal": signal_name}
    inline = limits.max_shell_output_bytes
    total = len(stdout) + len(stderr)
    if config.artifacts is None or total <= inline:
        # no store, or everything fits: the inline text is what was kept (cut on a character boundary)
        result["stdout"] = _head(stdout, inline).decode("utf-8", "replace")
        result["stderr"] = _head(stderr, max(0, inline - len(stdout))).decode("utf-8", "replace")
        result["outcome"] = outcome
        return result
    data = _STDOUT_HEADER + stdout + _STDERR_HEADER + stderr
    reference = await maybe(
        config.artifacts.write(
            scope=ctx.conversation_id, media_type="text/plain; charset=utf-8", data=data, authorization=payload
        )
    )
    stdout_budget = inline if not stderr else math.ceil(inline / 2)
    stderr_budget = inline if not stdout else inline // 2
    heads = tails = omitted = 0
    for name, stream, budget in (("stdout", stdout, stdout_budget), ("stderr", stderr, stderr_budget)):
        if len(stream) <= budget:
            result[name] = stream.decode("utf-8", "replace")
            heads += len(stream)
            continue
        head, tail = _head(stream, math.ceil(budget / 2)), _tail(stream, budget // 2)
        skipped = len(stream) - len(head) - len(tail)
        # the head and the tail, joined: where and how much was cut is in ``artifact`` (head_bytes,
        # omitted_bytes), and read_output has every byte
        result[name] = head.decode("utf-8", "replace") + tail.decode("utf-8", "replace")
        heads, tails, omitted = heads + len(head), tails + len(tail), omitted + skipped
    result["outcome"] = outcome
    result["artifact"] = {
        "reference": reference,
        "bytes": len(data),
        "truncated": outcome == "output-limit",
        "head_bytes": heads,
        "tail_bytes": tails,
        "omitted_bytes": omitted,
    }
    return result
