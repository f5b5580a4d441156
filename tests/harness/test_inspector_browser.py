"""The web inspector in a real headless Chromium (Debian's ``chromium``, driven by Playwright's Python
package with ``executable_path``; Playwright downloads no browser).

A person's session: open the page, submit, watch the answer stream, interrupt it, ask for something that
needs approval, approve it, reload and find the same state (and the ledger's timeline). And the page's
control-view rules (its JavaScript reducer) give what :mod:`threadline.delivery` gives on the same events,
a gap included.

Outside CI a missing ``chromium`` or ``playwright`` skips with the reason; ``.ci/run`` installs both and sets
``THREADLINE_REQUIRE_BROWSER=1``, which turns the skip into a failure.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
from collections.abc import AsyncIterator
from typing import Any

import pytest
from pydantic_ai.messages import ModelRequest, ToolReturnPart
from pydantic_ai.models.function import AgentInfo, DeltaToolCall, FunctionModel

from threadline import (
    AgentToolContext,
    create_memory_agent_runtime_store,
    define_agent_protocol,
    define_agent_tool,
    define_model_registry,
)
from threadline.delivery import reduce_agent_control_event, reduce_agent_control_snapshot
from threadline.harness import create_headless_agent_harness

from .conftest import SECRET, WAIT, Context, last_user_text, serving

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
MS = int(WAIT * 1000)


def _browser_or_skip() -> Any:
    problem = None
    try:
        from playwright.async_api import async_playwright
    except ImportError:
        problem = "Playwright's Python package is not installed (pip install -e '.[dev]')"
        async_playwright = None
    if problem is None and not (os.path.exists(CHROMIUM) or shutil.which("chromium")):
        problem = f"Debian's chromium is not installed at {CHROMIUM} (apt-get install -y chromium)"
    if problem is not None:
        if os.environ.get("THREADLINE_REQUIRE_BROWSER") == "1":
            pytest.fail(problem)
        pytest.skip(problem)
    return async_playwright


@define_agent_tool
async def refund(ctx: AgentToolContext, order_id: str) -> str:
    """Refund an order (needs a person's approval)."""
    return f"refunded {order_id}"


class Model:
    """``story``: a few words, then it waits (until interrupted). ``refund``: a call to ``refund``, then
    what the tool said. Anything else: an echo."""

    def __init__(self) -> None:
        self.never = asyncio.Event()
        self.model = FunctionModel(stream_function=self._stream, model_name="scripted")

    async def _stream(self, messages: list[Any], info: AgentInfo) -> AsyncIterator[Any]:
        last = messages[-1]
        returns = [p for p in last.parts if isinstance(p, ToolReturnPart)] if isinstance(last, ModelRequest) else []
        if returns:
            yield f"done: {returns[0].content}"
            return
        said = last_user_text(messages)
        if "refund" in said:
            yield {0: DeltaToolCall(name="refund", json_args=json.dumps({"order_id": "A1"}), tool_call_id="call-r")}
            return
        if "story" in said:
            for word in ("once ", "upon ", "a ", "time "):
                yield word
            await self.never.wait()
        for word in f"echo: {said}".split(" "):
            yield word + " "


def inspector_harness(model: Model) -> Any:
    registry = define_model_registry(models={"m": {"model": model.model, "context_window": 100_000}})
    return create_headless_agent_harness(
        protocol=define_agent_protocol(context=Context),
        store=create_memory_agent_runtime_store(),
        models={"resolve": lambda: registry.resolve("m")},
        tools=[refund],
        loop={"tool_approval": ["refund"], "tool_approval_secret": SECRET},
        runs={
            "resolve_context": lambda _run: Context(),
            "input_policy": lambda raw: (raw.input_metadata or {}).get("policy", "queue"),
        },
    )


@pytest.fixture
async def chromium() -> AsyncIterator[Any]:
    async_playwright = _browser_or_skip()
    async with async_playwright() as playwright:
        browser = await playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            yield browser
        finally:
            await browser.close()


async def test_a_session_in_the_inspector_survives_a_reload(chromium: Any) -> None:
    from threadline.server import create_agent_harness_app

    model = Model()
    harness = inspector_harness(model)
    async with serving(create_agent_harness_app(harness)) as address:
        page = await chromium.new_page()
        page.set_default_timeout(MS)
        await page.goto(f"http://{address}/")
        await page.fill("#open-id", "browser")
        await page.click("#open-form button")
        await page.wait_for_selector("#access:has-text('control')")

        # submit; watch the answer stream
        await page.fill("#composer-text", "tell me a story")
        await page.select_option("#policy", "queue")
        await page.click("#send")
        await page.wait_for_selector("#streaming .streaming-text:has-text('once upon a time')")
        assert await page.is_enabled("#interrupt")

        # interrupt it: the partial answer stays, marked
        await page.click("#interrupt")
        interrupted = page.locator("#messages .message[data-status='interrupted']")
        await interrupted.wait_for()
        assert "once upon a time" in await interrupted.inner_text()
        assert await page.locator("#streaming .message").count() == 0

        # something that needs approval; approve it; the tool runs and the model answers
        await page.fill("#composer-text", "please refund my order")
        await page.select_option("#policy", "interrupt")
        await page.click("#send")
        approve = page.locator(".approval button", has_text="Approve")
        await approve.wait_for()
        await approve.click()
        await page.wait_for_selector("#messages .message[data-role='assistant']:has-text('done: refunded A1')")

        async def shown() -> dict[str, Any]:
            return {
                "messages": await page.locator("#messages .message").evaluate_all(
                    "nodes => nodes.map(n => [n.dataset.role, n.dataset.status, n.innerText])"
                ),
                "runs": await page.locator("#runs tbody tr").evaluate_all(
                    "rows => rows.map(r => [r.querySelector('.state').textContent, "
                    "r.querySelector('.reason').textContent])"
                ),
            }

        before = await shown()
        reasons = sorted(reason for _state, reason in before["runs"])
        assert reasons == ["interrupted", "provider_stop", "success"]
        assert any(status == "interrupted" for _role, status, _text in before["messages"])

        # reload: the page attaches again and renders the same state from the snapshot
        await page.reload()
        await page.wait_for_selector("#messages .message[data-role='assistant']:has-text('done: refunded A1')")
        await page.wait_for_function(f"document.querySelectorAll('#runs tbody tr').length === {len(before['runs'])}")
        after = await shown()
        assert after == before
        # the ledger's timeline: every transition the store committed, in seq order
        await page.wait_for_selector("#ledger tr[data-kind='runtime/transition'] >> text=terminal")
        timeline = await page.locator("#ledger tr").evaluate_all(
            "rows => rows.map(r => [Number(r.cells[0].textContent), r.cells[3].textContent])"
        )
        seqs = [seq for seq, _summary in timeline]
        assert seqs == sorted(seqs) and seqs[0] == 1
        commands = [summary.split(" · ")[0] for _seq, summary in timeline]
        assert {"accept", "interrupt", "terminal"} <= set(commands)
        assert await page.locator("#conversations a[aria-current='true']").inner_text() == "browser"
        assert await page.locator(".approval").count() == 0
        model.never.set()
    await harness.close(grace_period=1, force_timeout=1)


async def test_the_pages_reducer_follows_the_delivery_rules(chromium: Any) -> None:
    """The JavaScript reducer against :mod:`threadline.delivery` on the events of a real run (replayed with
    one delta lost, so the gap rule is exercised too)."""
    from threadline.server import create_agent_harness_app

    model = Model()
    harness = inspector_harness(model)
    events: list[Any] = []
    harness.subscribe(events.append)
    ticket = harness.submit(
        conversation_id="rules", idempotency_key="k", context={}, parts=[{"type": "text", "text": "hello there"}]
    )
    await asyncio.wait_for(ticket.result, WAIT)
    snapshot = await harness.snapshot("rules")
    lost = next(e for e in events if e.type == "assistant-delta")
    replays = {"whole": events, "gap": [e for e in events if e is not lost]}

    async with serving(create_agent_harness_app(harness)) as address:
        page = await chromium.new_page()
        await page.goto(f"http://{address}/")
        await page.wait_for_function("window.ThreadlineControlView !== undefined")
        for name, replay in replays.items():
            expected = None
            for event in replay:
                expected = reduce_agent_control_event(expected, event)
            assert expected is not None
            python = expected.conversations["rules"].model_dump(mode="json")
            script = await page.evaluate(
                "events => { let view = null; for (const e of events) view = "
                "window.ThreadlineControlView.reduceEvent(view, e); return view.conversations['rules']; }",
                [e.model_dump(mode="json") for e in replay],
            )
            assert script["resync_required"] == python["resync_required"] == (name == "gap")
            assert script["run_states"] == python["run_states"]
            assert [m["id"] for m in script["messages"]] == [m["id"] for m in python["messages"]]
            assert script["version"] == python["version"]
        # the snapshot rule: reset, with the cursor at the snapshot's version
        python_view = reduce_agent_control_snapshot(snapshot).conversations["rules"].model_dump(mode="json")
        script_view = await page.evaluate(
            "s => window.ThreadlineControlView.reduceSnapshot(s, null).conversations['rules']",
            snapshot.model_dump(mode="json"),
        )
        assert script_view["run_states"] == python_view["run_states"]
        assert [m["id"] for m in script_view["messages"]] == [m["id"] for m in python_view["messages"]]
        duplicate = await page.evaluate(
            "([s, e]) => { const C = window.ThreadlineControlView; const v = C.reduceSnapshot(s, null);"
            " return C.reduceEvent(v, e) === v; }",
            [snapshot.model_dump(mode="json"), events[0].model_dump(mode="json")],
        )
        assert duplicate  # an event older than the snapshot changes nothing
    await harness.close(grace_period=1, force_timeout=1)
