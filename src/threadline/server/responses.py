"""Error bodies every route answers with: ``{"error": {"code", "message", "field"}}``."""

from __future__ import annotations

from typing import Any

from starlette.responses import JSONResponse


def error_response(status: int, code: str, message: str, *, field: str | None = None, **headers: str) -> JSONResponse:
    return JSONResponse(
        {"error": {"code": code, "message": message, "field": field}}, status_code=status, headers=headers or None
    )


def unauthorized() -> JSONResponse:
    return error_response(
        401, "FORBIDDEN", "a valid bearer token is required", **{"WWW-Authenticate": 'Bearer realm="threadline"'}
    )


def model_json(value: Any) -> Any:
    dump = getattr(value, "model_dump", None)
    return dump(mode="json") if dump is not None else value
