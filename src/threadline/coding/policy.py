"""What every coding tool shares: its configuration, refusals, host authorization and per-target locks.

Refusals are :class:`~threadline.AppError` with the seeds' codes (``BAD_REQUEST``, ``FORBIDDEN``,
``NOT_FOUND``, ``CONFLICT``, ``SANDBOX_UNAVAILABLE``, ``SPILL_REFERENCE_UNKNOWN``), a workspace-relative
``path`` in ``details`` when there is one, and a ``hint``. Everything else a tool raises is a host-level
cause: the loop scrubs it to ``INTERNAL_SERVER_ERROR`` and only the lifecycle's ``on_error`` sees it.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import weakref
from collections.abc import Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, NoReturn

from ..tools import AppError
from .contract import AgentCodingArtifactStore, AgentCodingToolLimits
from .workspace import HostDecisionTimeout, Workspace, WorkspaceError, await_decision, join_segments

logger = logging.getLogger("threadline.coding")

Authorize = Callable[[dict[str, Any]], Any]
AuthorizePath = Callable[[dict[str, Any]], Any]


@dataclass
class CodingConfig:
    """The resolved configuration one tool set shares (built by ``create_agent_coding_tools``)."""

    workspace: Workspace
    authorize: Authorize
    authorize_path: AuthorizePath | None
    limits: AgentCodingToolLimits
    excluded: frozenset[str]
    executables: dict[str, str] = field(default_factory=dict)
    environment: dict[str, str] = field(default_factory=dict)
    artifacts: AgentCodingArtifactStore | None = None
    launcher: Any = None
    locks: weakref.WeakValueDictionary[str, asyncio.Lock] = field(default_factory=weakref.WeakValueDictionary)


async def maybe(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value


def refuse(code: str, message: str, *, path: str | None = None, hint: str | None = None, **details: Any) -> NoReturn:
    """Raise the refusal a model can act on. The message travels inside ``details`` too, so a structured
    detail never displaces the sentence."""
    body: dict[str, Any] = {"message": message}
    if path is not None:
        body["path"] = path
    body.update(details)
    raise AppError(code, message, body, hint)


def refusal_from(error: WorkspaceError) -> AppError | WorkspaceError:
    """The :class:`AppError` of a workspace refusal; a host-level workspace error stays as it is (scrubbed)."""
    if error.code is None:
        return error
    body: dict[str, Any] = {"message": error.message}
    if error.path is not None:
        body["path"] = error.path
    body.update(error.details)
    return AppError(error.code, error.message, body, error.hint)


@asynccontextmanager
async def workspace_refusals() -> Any:
    """Turn :class:`WorkspaceError` raised inside the block into its refusal."""
    try:
        yield
    except WorkspaceError as error:
        converted = refusal_from(error)
        if converted is error:
            logger.warning("coding tool: the workspace root is unavailable: %s", error)
            raise
        raise converted from None


def decision_timed_out(config: CodingConfig, what: str, *, path: str | None = None) -> NoReturn:
    """The refusal of a host decision still pending at the discovery deadline (``search_timeout``)."""
    seconds = config.limits.search_timeout
    body: dict[str, Any] = {"message": f"the host did not decide on this {what} within {seconds:g} s"}
    if path is not None:
        body["path"] = path
    body["timeout_seconds"] = seconds
    raise AppError(
        "TIMEOUT",
        body["message"],
        body,
        "call again later or narrow the request; the host can raise limits.search_timeout",
        retryable=True,
    )


async def authorize(config: CodingConfig, payload: dict[str, Any], *, deadline: float | None = None) -> None:
    """Ask the host's ``authorize`` callback; a falsy answer refuses ``FORBIDDEN``. A callback that raises
    propagates with its own cause (an :class:`AppError` it raises reaches the model as it is). With a
    ``deadline`` (discovery: the call's start plus ``search_timeout``) an async answer still pending there is
    cancelled and the call refuses ``TIMEOUT``; a sync callback cannot be interrupted. Cancelling the call
    cancels a pending async answer."""
    try:
        admitted = await await_decision(config.authorize(payload), deadline)
    except HostDecisionTimeout:
        decision_timed_out(config, f"{payload['operation']} operation", path=payload.get("path"))
    if not admitted:
        refuse(
            "FORBIDDEN",
            f"the host did not authorize this {payload['operation']} operation",
            path=payload.get("path") or payload.get("cwd"),
            hint="do not retry the same call; choose another approach or ask the user",
            operation=payload["operation"],
        )


def path_decision(config: CodingConfig, relative: str) -> Any:
    """The host path policy's raw answer about ``relative`` (a value, or an awaitable from an async policy);
    ``True`` without one. For :meth:`Workspace.walk`'s ``admit``, which bounds it by the walk's deadline."""
    if config.authorize_path is None:
        return True
    return config.authorize_path({"path": relative})


async def path_admitted(config: CodingConfig, relative: str, *, deadline: float | None = None) -> bool:
    """The host's operation-independent path policy (``authorize_path``); every path is admitted without one.
    Raises :class:`HostDecisionTimeout` when an async answer is still pending at ``deadline``."""
    if config.authorize_path is None:
        return True
    return bool(await await_decision(config.authorize_path({"path": relative}), deadline))


async def authorize_path_chain(
    config: CodingConfig, segments: Sequence[str], *, root: bool = False, deadline: float | None = None
) -> None:
    """Ask ``authorize_path`` about each named ancestor and the entry itself, outermost first, stopping at the
    first refusal (a path of depth N costs N questions; ``root=True`` asks about ``.`` first, as discovery
    rooted at ``.`` does). Denial is segment-wise, so denying ``credentials`` denies everything under it
    and not ``credentials-backup``. An async answer still pending at ``deadline`` refuses ``TIMEOUT``."""
    if config.authorize_path is None:
        return
    chain = (["."] if root else []) + [join_segments(segments[: i + 1]) for i in range(len(segments))]
    for relative in chain:
        try:
            admitted = await path_admitted(config, relative, deadline=deadline)
        except HostDecisionTimeout:
            decision_timed_out(config, "path", path=relative)
        if not admitted:
            refuse(
                "FORBIDDEN",
                "the host's path policy denies this path",
                path=join_segments(segments),
                hint="this path and everything under it is off limits; work elsewhere",
                denied=relative,
            )


@asynccontextmanager
async def target_lock(config: CodingConfig, relative: str) -> Any:
    """One process-local lock per target file: edits read, count, build and write under it, so two concurrent
    edits of one file never build from the same base (two processes over one workspace are not covered)."""
    key = f"{config.workspace.identity}:{relative}"
    lock = config.locks.get(key)
    if lock is None:
        lock = asyncio.Lock()
        config.locks[key] = lock
    async with lock:
        yield
