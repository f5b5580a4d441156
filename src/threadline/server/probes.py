"""``GET /healthz`` (the process answers) and ``GET /readyz`` (the harness admits and its store answers).
Neither needs authentication: they say nothing about any conversation."""

from __future__ import annotations

import asyncio
import logging

from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from .state import server_state

_log = logging.getLogger("threadline.server")

READINESS_TIMEOUT = 2.0
"""Seconds the store has to answer a readiness read."""


async def healthz(request: Request) -> JSONResponse:
    return JSONResponse({"status": "ok"})


async def readyz(request: Request) -> JSONResponse:
    state = server_state(request.app)
    if state.harness.closing:
        return JSONResponse({"status": "closing"}, status_code=503)
    try:
        await asyncio.wait_for(state.conversations.list(limit=1), READINESS_TIMEOUT)
    except Exception as error:
        _log.warning("readiness: the store did not answer", exc_info=True)
        return JSONResponse({"status": "store-unavailable", "detail": type(error).__name__}, status_code=503)
    return JSONResponse({"status": "ready"})


def routes() -> list[Route]:
    return [Route("/healthz", healthz, methods=["GET"]), Route("/readyz", readyz, methods=["GET"])]
