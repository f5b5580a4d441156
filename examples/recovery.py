"""A process killed mid-answer, and the recovery that answers what it left behind — offline.

The script starts itself as a child process on ``recovery.db``. The child admits two inputs, streams part
of the first answer (checkpointed), then hangs; the parent kills it with SIGKILL. The parent reopens the
file and finds the first run still ``running`` under the dead owner, its draft on disk, the second run
queued behind it. It knows the owner is dead (it killed it) and that the run invoked no tool, so replaying
the model request is safe: ``recover(policy=...)`` requeues the first run and resumes the second; both
are answered. Then ``close()`` and a purge.

    python examples/recovery.py
"""

import asyncio
import os
import signal
import sys

from pydantic import BaseModel
from pydantic_ai.messages import UserPromptPart
from pydantic_ai.models.function import FunctionModel

from threadline import (
    create_agent_runtime,
    create_sqlite_agent_runtime_store,
    define_agent_protocol,
    define_model_registry,
    purge_agent_conversation,
)

DB = "recovery.db"


class Context(BaseModel):
    user_id: str


def build_runtime(store, *, hang: bool, publish=None, owner_id=None):
    async def model(messages, info):
        question = next(p.content for p in messages[-1].parts if isinstance(p, UserPromptPart))
        words = f"Here is a careful answer to '{question}', in several words.".split(" ")
        for i, word in enumerate(words):
            yield word if i == 0 else " " + word
            if hang and i == 2:  # right after the 3rd word, which completes a checkpoint
                await asyncio.Event().wait()  # mid-answer, for ever: the parent kills this process

    registry = define_model_registry(models={"m": {"model": FunctionModel(stream_function=model)}})
    runs = {"owner_id": owner_id} if owner_id else {}
    return create_agent_runtime(
        protocol=define_agent_protocol(context=Context),
        store=store,
        models={"resolve": lambda: registry.resolve("m")},
        runs=runs,
        loop={"checkpoint_every_events": 3},  # checkpoint the growing draft every 3 stream events
        publish=publish,
    )


async def child() -> None:
    checkpointed = asyncio.Event()

    def publish(event):
        if event.type == "assistant-checkpoint" and any(p.type == "text" for p in event.parts):
            checkpointed.set()

    async with create_sqlite_agent_runtime_store(filename=DB) as sqlite:
        runtime = build_runtime(sqlite.store, hang=True, publish=publish, owner_id=f"child-{os.getpid()}")
        for key, text in (("q1", "what is durable?"), ("q2", "and recovery?")):
            ticket = runtime.submit(
                conversation_id="c1",
                idempotency_key=key,
                context={"user_id": "u1"},
                parts=[{"type": "text", "text": text}],
            )
            await ticket.accepted
            if key == "q1":
                await checkpointed.wait()
        print("READY", flush=True)
        await asyncio.Event().wait()


async def parent() -> None:
    for leftover in (DB, DB + "-wal", DB + "-shm"):
        if os.path.exists(leftover):
            os.remove(leftover)
    proc = await asyncio.create_subprocess_exec(sys.executable, __file__, "child", stdout=asyncio.subprocess.PIPE)
    line = await asyncio.wait_for(proc.stdout.readline(), 60)
    assert line.strip() == b"READY", line
    proc.send_signal(signal.SIGKILL)
    print(f"child killed: exit status {await proc.wait()}")

    async with create_sqlite_agent_runtime_store(filename=DB) as sqlite:
        store = sqlite.store
        active = await store.list_active_runs(conversation_id="c1")
        snapshot = await store.load_snapshot(conversation_id="c1")
        drafts = {m.id: m for m in snapshot.messages}
        for run in active.runs:
            draft = drafts.get(run.assistant_message_id)
            text = "".join(p.text for p in draft.parts if p.type == "text") if draft else ""
            print(f"on disk: {run.state:<8} owner={run.owner_id} draft={text!r}")

        runtime = build_runtime(store, hang=False)
        outcomes = await runtime.recover(
            resolve_context=lambda run: {"user_id": "u1"},
            policy=lambda run: {"action": "requeue", "replay_safe": True},  # we killed its owner; no tool ran
        )
        for outcome in outcomes:
            result = await outcome.result
            answer = "".join(p.text for p in result.assistant.parts if p.type == "text")
            print(f"recovered: {outcome.outcome:<8} {result.terminal_reason}: {answer}")
        closed = await runtime.close(grace_period=5, force_timeout=5)
        print(f"close: settled={closed.settled} remaining={closed.remaining}")
        purged = await purge_agent_conversation(store, conversation_id="c1")
        print(f"purge: {purged.outcome}")


if __name__ == "__main__":
    asyncio.run(child() if sys.argv[1:] == ["child"] else parent())
