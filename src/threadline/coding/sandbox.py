"""The optional bubblewrap launcher: ``run_command`` under ``bwrap`` (Debian package ``bubblewrap``).

Beyond the seeds (which leave process isolation to the host), and in the way Claude Code and Codex CLI
sandbox commands on Linux: each command runs in fresh namespaces (``--unshare-all``: no network but a private
loopback, its own PID, IPC and UTS namespaces), sees the system directories (``/usr`` and the ``/lib*``,
``/bin`` links), the configured executables and their installation prefixes **read-only**, a private
``/tmp``, its own ``/proc`` and a minimal ``/dev``, and exactly one writable tree: the workspace root, at its
own path. Nothing else of the host's filesystem is visible. ``--die-with-parent`` plus the PID namespace
make every process of the command die with it, even one that left the process group.

Availability is decided once, at construction: ``bwrap`` must be installed and able to create its
namespaces here (a probe runs ``/usr/bin/true`` inside). Where it cannot, construction raises
:class:`AgentSandboxUnavailableError` (``SANDBOX_UNAVAILABLE``, HTTP 503) — threadline never falls back to
running commands unsandboxed. A failure to start the sandbox for one command later refuses that call with the
same code.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
from collections.abc import Mapping

from ..tools import AppError
from .workspace import Workspace

__all__ = ("AgentSandboxUnavailableError", "BubblewrapLauncher", "create_bubblewrap_launcher")

logger = logging.getLogger("threadline.coding")

_SYSTEM = ("/usr", "/bin", "/sbin", "/lib", "/lib64", "/lib32", "/libx32")
_SYSTEM_FILES = ("/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/ld.so.conf.d", "/etc/alternatives", "/etc/localtime")


class AgentSandboxUnavailableError(AppError):
    """The process sandbox cannot run here (``SANDBOX_UNAVAILABLE``); the message says why, the hint what to
    install or enable."""

    def __init__(self, message: str, hint: str) -> None:
        super().__init__("SANDBOX_UNAVAILABLE", message, {"message": message, "sandbox": "bubblewrap"}, hint)


def _under(path: str, roots: list[str]) -> bool:
    return any(path == root or path.startswith(root.rstrip("/") + "/") for root in roots)


class BubblewrapLauncher:
    """Builds the ``bwrap`` command line of one command. Built by :func:`create_bubblewrap_launcher`."""

    def __init__(self, bwrap: str, workspace: Workspace, mounts: list[str]) -> None:
        self.bwrap = bwrap
        self.workspace = workspace
        self.mounts = mounts

    def argv(self, program: str, args: list[str], cwd: str) -> list[str]:
        root = self.workspace.path
        return [
            self.bwrap,
            "--unshare-all",
            "--die-with-parent",
            "--new-session",
            # the private /tmp first: bwrap mounts in order, so an executable bound from under the host's /tmp
            # (a virtual environment there) lands on top of it instead of being hidden by it
            "--tmpfs",
            "/tmp",
            *self.mounts,
            "--proc",
            "/proc",
            "--dev",
            "/dev",
            "--bind",
            root,
            root,
            "--chdir",
            cwd,
            "--",
            program,
            *args,
        ]

    def prepare(self, program: str, args: list[str], directory: int) -> tuple[list[str], str]:
        """The argv for ``program`` and the spawn cwd. The pinned directory's path is captured here, at the
        handoff, and must still lie inside the root (a directory moved away refuses ``CONFLICT``)."""
        current = os.readlink(f"/proc/self/fd/{directory}")
        root = self.workspace.path
        if current != root and not current.startswith(root.rstrip("/") + "/"):
            raise AppError(
                "CONFLICT",
                "the working directory moved out of the workspace before the command started",
                {"message": "the working directory moved out of the workspace"},
                "call run_command again",
            )
        return self.argv(program, args, current), "/"


def create_bubblewrap_launcher(
    workspace: Workspace, executables: Mapping[str, str], *, bwrap: str | None = None
) -> BubblewrapLauncher:
    """Detect and probe bubblewrap for this workspace and these executables. Raises
    :class:`AgentSandboxUnavailableError` when ``bwrap`` is missing or cannot create its namespaces here."""
    binary = bwrap or shutil.which("bwrap") or "/usr/bin/bwrap"
    if not (os.path.isfile(binary) and os.access(binary, os.X_OK)):
        raise AgentSandboxUnavailableError(
            "bubblewrap (bwrap) is not installed", "install it (Debian: apt-get install bubblewrap) or drop sandbox="
        )
    mounts: list[str] = []
    bound: list[str] = []
    for directory in _SYSTEM:
        if os.path.islink(directory):
            mounts += ["--symlink", os.readlink(directory), directory]
        elif os.path.isdir(directory):
            mounts += ["--ro-bind", directory, directory]
            bound.append(directory)
    for path in _SYSTEM_FILES:
        if os.path.exists(path):
            mounts += ["--ro-bind", path, path]
    for program in executables.values():
        real = os.path.realpath(program)
        if not os.path.isfile(real):
            raise AgentSandboxUnavailableError(
                "a configured executable does not exist", "fix the executables mapping to existing absolute paths"
            )
        if _under(real, bound):
            continue
        # an executable outside the system directories: its installation prefix (…/bin/x → …) read-only
        prefix = os.path.dirname(os.path.dirname(real))
        if prefix in ("", "/"):
            prefix = os.path.dirname(real)
        mounts += ["--ro-bind", prefix, prefix]
        bound.append(prefix)
        if program != real and not _under(program, bound):
            mounts += ["--ro-bind", program, program]
    launcher = BubblewrapLauncher(binary, workspace, mounts)
    probe = launcher.argv("/usr/bin/true" if os.path.exists("/usr/bin/true") else "/bin/true", [], workspace.path)
    try:
        completed = subprocess.run(probe, env={}, capture_output=True, timeout=20, check=False)
    except (OSError, subprocess.TimeoutExpired) as error:
        logger.warning("bubblewrap probe failed: %s", error)
        raise AgentSandboxUnavailableError(
            "bubblewrap could not be started here", "check that bwrap runs on this host"
        ) from error
    if completed.returncode != 0:
        logger.warning("bubblewrap probe exited %s: %s", completed.returncode, completed.stderr[:500])
        raise AgentSandboxUnavailableError(
            "bubblewrap cannot create its namespaces here (user namespaces are probably disabled)",
            "enable unprivileged user namespaces (kernel.unprivileged_userns_clone=1) or run without sandbox=",
        )
    return launcher
