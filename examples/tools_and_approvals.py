"""Tools, the error envelope, progress, a human approval and a durable step — offline, with a scripted model.

- ``get_order`` reports progress and raises ``AppError`` for an unknown order: the model sees the safe
  envelope ``{error, message, retryable}``, never a traceback.
- ``refund`` needs approval (``loop.tool_approval``): the run stores a signed request and ends
  ``provider_stop`` without running it. ``pending_approvals`` finds it in the stored history (it would
  survive a restart); ``respond_to_approval`` queues a successor run that verifies the signature, runs the
  tool behind its fence, and lets the model continue.
- Inside ``refund`` the external effect is a durable step (``ctx.step``): its intent and proof are recorded
  by a step ledger, so a replayed run would return the proof instead of paying twice.

    python examples/tools_and_approvals.py
"""

import asyncio
import json

from pydantic import BaseModel
from pydantic_ai.messages import ModelRequest, ToolReturnPart
from pydantic_ai.models.function import DeltaToolCall, FunctionModel

from threadline import (
    AgentToolContext,
    AppError,
    create_agent_runtime,
    create_local_step_durability,
    create_memory_agent_runtime_store,
    define_agent_protocol,
    define_agent_tool,
    define_model_registry,
)

ORDERS = {"A1": {"item": "kettle", "paid": 39.0}}
PAYMENTS: list[str] = []  # the outside world: what the payment provider did


class Context(BaseModel):
    user_id: str


@define_agent_tool
async def get_order(ctx: AgentToolContext, order_id: str) -> dict:
    """Look an order up."""
    ctx.report_progress(message=f"looking up {order_id}", progress=1, total=1)
    if order_id not in ORDERS:
        raise AppError("NOT_FOUND", f"no order {order_id}", hint="ask the customer for the order id")
    return ORDERS[order_id]


@define_agent_tool
async def refund(ctx: AgentToolContext, order_id: str) -> str:
    """Refund an order (needs a human's approval)."""

    def pay() -> dict:
        PAYMENTS.append(order_id)
        return {"refund_id": f"rf-{order_id}", "amount": ORDERS[order_id]["paid"]}

    proof = await ctx.step(f"refund:{order_id}", pay)
    return f"refunded {proof['amount']} as {proof['refund_id']}"


def tool_results(messages) -> list[ToolReturnPart]:
    last = messages[-1]
    return [p for p in last.parts if isinstance(p, ToolReturnPart)] if isinstance(last, ModelRequest) else []


async def scripted(messages, info):
    results = tool_results(messages)
    names = [r.tool_name for r in results]
    if not results:  # look both orders up
        yield {0: DeltaToolCall(name="get_order", json_args=json.dumps({"order_id": "A1"}), tool_call_id="g1")}
        yield {1: DeltaToolCall(name="get_order", json_args=json.dumps({"order_id": "ZZ"}), tool_call_id="g2")}
    elif names == ["get_order", "get_order"]:
        yield f"ZZ: {results[1].content['error']}. Refunding A1. "
        yield {1: DeltaToolCall(name="refund", json_args=json.dumps({"order_id": "A1"}), tool_call_id="r1")}
    else:
        yield f"Done: {results[-1].content}."


def show(event) -> None:
    if event.type == "tool-status":
        detail = {"started": event.input, "completed": event.output, "failed": event.error}.get(event.status)
        print(f"  tool {event.tool_name} {event.status}: {json.dumps(detail)}")
    elif event.type == "tool-progress":
        print(f"  tool {event.tool_name} progress: {event.message}")


async def main() -> None:
    registry = define_model_registry(models={"m": {"model": FunctionModel(stream_function=scripted)}})
    steps = create_local_step_durability()  # in memory here; pass a filename to keep it across restarts
    runtime = create_agent_runtime(
        protocol=define_agent_protocol(context=Context),
        store=create_memory_agent_runtime_store(),
        models={"resolve": lambda: registry.resolve("m")},
        tools=[get_order, refund],
        loop={"tool_approval": ["refund"], "tool_approval_secret": "change-me", "step_durability": steps},
        publish=show,
    )
    context = {"user_id": "u1"}
    ticket = runtime.submit(
        conversation_id="c1", idempotency_key="k1", context=context, parts=[{"type": "text", "text": "refund A1"}]
    )
    first = await ticket.result
    said = " ".join(p.text for p in first.assistant.parts if p.type == "text")
    print(f"run 1: {first.terminal_reason}: {said} (payments so far: {PAYMENTS})")

    [pending] = await runtime.pending_approvals("c1")
    print(f"pending approval: {pending.tool_name}({json.dumps(pending.input)})")
    approved = await runtime.respond_to_approval(
        conversation_id="c1", approval_id=pending.approval_id, approved=True, context=context
    )
    second = await approved.result
    answer = " ".join(p.text for p in second.assistant.parts if p.type == "text")
    print(f"run 2: {second.terminal_reason}: {answer}")
    print(f"payments: {PAYMENTS}; pending approvals: {len(await runtime.pending_approvals('c1'))}")
    await runtime.close()
    await steps.close()


asyncio.run(main())
