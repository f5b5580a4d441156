"""Reading a bounded JSON request body into a model."""

from __future__ import annotations

import json
from typing import TypeVar

from pydantic import BaseModel, TypeAdapter, ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse

from ..harness.control_schema import validation_field
from .responses import error_response

M = TypeVar("M")


class BodyRefused(Exception):
    def __init__(self, response: JSONResponse) -> None:
        super().__init__("body refused")
        self.response = response


async def read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise BodyRefused(error_response(413, "REQUEST_REJECTED", f"the body is at most {limit} bytes"))
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise BodyRefused(error_response(413, "REQUEST_REJECTED", f"the body is at most {limit} bytes"))
        chunks.append(chunk)
    return b"".join(chunks)


async def parse_body(request: Request, limit: int, model: type[M] | TypeAdapter[M]) -> M:
    """The body as ``model``, or :class:`BodyRefused` carrying a 413/422 naming the first field at fault."""
    raw = await read_body(request, limit)
    try:
        data = json.loads(raw or b"{}")
    except ValueError as error:
        raise BodyRefused(error_response(422, "REQUEST_REJECTED", f"the body is one JSON object: {error}")) from None
    try:
        if isinstance(model, TypeAdapter):
            return model.validate_python(data)
        assert isinstance(model, type) and issubclass(model, BaseModel)
        return model.model_validate(data)  # type: ignore[return-value]
    except ValidationError as error:
        where, message = validation_field(error, data)
        where = where or "body"
        raise BodyRefused(error_response(422, "REQUEST_REJECTED", f"{where}: {message}", field=where)) from None
