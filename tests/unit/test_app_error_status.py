"""Every error code maps to one HTTP status, carried by AppError and its envelope and rebuilt from the wire."""

from __future__ import annotations

import json

import pytest

from threadline import APP_ERROR_STATUS, AppError, tool_error_from_result
from threadline.events import ToolStatusEvent
from threadline.tools import error_envelope


@pytest.mark.parametrize(
    ("code", "status"),
    [
        ("BAD_REQUEST", 400),
        ("FORBIDDEN", 403),
        ("NOT_FOUND", 404),
        ("CONFLICT", 409),
        ("SANDBOX_UNAVAILABLE", 503),
        ("SPILL_REFERENCE_UNKNOWN", 404),
        ("INVALID_ARGUMENTS", 400),
        ("SOMETHING_ELSE", 500),
    ],
)
def test_status_survives_a_process_boundary(code: str, status: int) -> None:
    error = AppError(code, "refused", {"path": "src/a.py"}, hint="do this next", retryable=True)
    assert error.status == status
    envelope = error_envelope(error)
    assert envelope["status"] == status
    wire = json.loads(json.dumps(envelope))
    rebuilt = tool_error_from_result(wire)
    assert (rebuilt.code, rebuilt.status, rebuilt.message, rebuilt.details, rebuilt.hint, rebuilt.retryable) == (
        code,
        status,
        "refused",
        {"path": "src/a.py"},
        "do this next",
        True,
    )
    # the status rides through the tool-status event too
    event = ToolStatusEvent(
        conversation_id="k",
        run_id="r",
        runtime_epoch="e",
        sequence=1,
        call_id="c",
        tool_name="t",
        status="failed",
        error=envelope,
    )
    assert event.model_dump()["error"]["status"] == status


def test_the_map_is_the_one_source_and_non_envelopes_are_internal() -> None:
    assert APP_ERROR_STATUS["CONFLICT"] == 409
    assert error_envelope(KeyError("cause")) == {"error": "INTERNAL_SERVER_ERROR", "retryable": False}
    for junk in (None, "text", {"message": "no code"}, {"error": 3}):
        rebuilt = tool_error_from_result(junk)
        assert (rebuilt.code, rebuilt.status) == ("INTERNAL_SERVER_ERROR", 500)
    assert tool_error_from_result({"error": "INTERNAL_SERVER_ERROR", "retryable": False}).status == 500
