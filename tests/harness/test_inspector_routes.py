"""The inspector's files over real HTTP: the page at ``/``, its scripts, constants generated from the Python
rules, nothing else under ``/inspector/``, and no page when the app is built without it."""

from __future__ import annotations

import httpx

from threadline.delivery import REASONING_SEPARATOR
from threadline.events import DURABLE_EVENT_TYPES
from threadline.records import ACTIVE_RUN_STATES, INPUT_POLICIES, RUN_STATE_FOR_REASON
from threadline.server import create_agent_harness_app

from .conftest import WAIT, Scripted, make_harness, serving


async def test_the_page_and_its_files() -> None:
    harness = make_harness(Scripted())
    async with (
        serving(create_agent_harness_app(harness)) as address,
        httpx.AsyncClient(base_url=f"http://{address}", timeout=WAIT) as client,
    ):
        page = await client.get("/")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        for name in ("app.js", "reducer.js", "constants.js", "style.css"):
            assert f"inspector/{name}" in page.text
            asset = await client.get(f"/inspector/{name}")
            assert asset.status_code == 200 and asset.headers["x-content-type-options"] == "nosniff"
        constants = (await client.get("/inspector/constants.js")).text
        for values in (ACTIVE_RUN_STATES, DURABLE_EVENT_TYPES, INPUT_POLICIES, RUN_STATE_FOR_REASON):
            assert all(f'"{value}"' in constants for value in values)
        assert REASONING_SEPARATOR.encode("unicode_escape").decode() in constants
        assert (await client.get("/inspector/secrets.py")).status_code == 404
    async with (
        serving(create_agent_harness_app(harness, inspector=False)) as address,
        httpx.AsyncClient(base_url=f"http://{address}", timeout=WAIT) as client,
    ):
        assert (await client.get("/")).status_code == 404
    await harness.close(grace_period=1, force_timeout=1)


async def test_the_ledger_timeline_is_paged_and_refuses_bad_bounds() -> None:
    from .conftest import submit

    harness = make_harness(Scripted())
    result = await submit(harness, "k1", "hello").result
    assert result.terminal_reason == "success"
    async with (
        serving(create_agent_harness_app(harness)) as address,
        httpx.AsyncClient(base_url=f"http://{address}", timeout=WAIT) as client,
    ):
        first = (await client.get("/conversations/c1/ledger", params={"limit": 2})).json()
        assert [e["seq"] for e in first["items"]] == [1, 2] and first["next_seq"] == 3
        assert first["items"][0]["kind"] == "runtime/transition"
        assert first["items"][0]["summary"].startswith("accept")
        rest = (await client.get("/conversations/c1/ledger", params={"from_seq": 3, "limit": 200})).json()
        assert rest["next_seq"] is None
        assert any(e["summary"].startswith("terminal") for e in rest["items"])
        for params, field in (({"limit": 0}, "limit"), ({"limit": 201}, "limit"), ({"from_seq": "x"}, "from_seq")):
            refused = await client.get("/conversations/c1/ledger", params=params)
            assert refused.status_code == 422 and refused.json()["error"]["field"] == field
        assert (await client.get("/conversations/unknown/ledger")).json() == {"items": [], "next_seq": None}
    await harness.close(grace_period=1, force_timeout=1)
