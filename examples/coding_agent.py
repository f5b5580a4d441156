"""A coding agent on threadline's coding tools — offline, with a scripted model, in a scratch workspace.

The model finds the code (``glob``, ``search_files``), reads it (``read_file``), fixes a bug with an exact
snippet (``edit_file``, chained by the digest ``read_file`` returned) and runs the tests (``run_command``:
an alias for this Python, never a shell string). The host's ``authorize`` callback sees every operation's
payload and prints it; a path policy hides ``secrets/``. A refusal is an ordinary tool result the model can
act on: the first edit names a snippet that is not in the file and comes back ``NOT_FOUND`` with a hint.

    python examples/coding_agent.py
"""

import asyncio
import json
import sys
import tempfile
from pathlib import Path

from pydantic_ai.messages import ModelRequest, ToolReturnPart
from pydantic_ai.models.function import DeltaToolCall, FunctionModel

from threadline import (
    create_agent_runtime,
    create_memory_agent_runtime_store,
    define_agent_protocol,
    define_model_registry,
)
from threadline.coding import create_agent_coding_tools, create_memory_agent_coding_artifact_store

PLAN = [
    ("glob", {"pattern": "**/*.py"}),
    ("search_files", {"query": r"def \w+\(", "regex": True, "include": "**/*.py"}),
    ("read_file", {"path": "calc/core.py"}),
    ("edit_file", {"path": "calc/core.py", "old_text": "return a - b  # add", "new_text": "return a + b"}),
    ("edit_file", {"path": "calc/core.py", "old_text": "return a - b", "new_text": "return a + b"}),
    ("run_command", {"executable": "python", "args": ["-m", "unittest", "-q", "test_core"], "cwd": "calc"}),
    ("list_directory", {"path": "."}),
]


def results_of(messages) -> list[ToolReturnPart]:
    last = messages[-1]
    return [p for p in last.parts if isinstance(p, ToolReturnPart)] if isinstance(last, ModelRequest) else []


async def scripted(messages, info):
    done = sum(len(results_of([m])) for m in messages if isinstance(m, ModelRequest))
    if done < len(PLAN):
        name, arguments = PLAN[done]
        if name == "edit_file" and done == 4:  # chain the digest read_file returned
            read = next(r for m in messages for r in results_of([m]) if r.tool_name == "read_file")
            arguments = {**arguments, "expected_sha256": read.content["sha256"]}
        yield {0: DeltaToolCall(name=name, json_args=json.dumps(arguments), tool_call_id=f"call-{done}")}
    else:
        yield "Fixed add() in calc/core.py; the tests pass."


def show(event) -> None:
    if event.type != "tool-status" or event.status == "started":
        return
    if event.status == "failed":
        print(f"  {event.tool_name} refused: {event.error['error']} — {event.error['_hint']}")
        return
    out = event.output
    summary = {
        "glob": lambda: f"{out['paths']}",
        "search_files": lambda: f"{[(m['path'], m['line'], m['text']) for m in out['matches']]}",
        "read_file": lambda: f"{out['bytes']} bytes, sha256 {out['sha256'][:12]}…",
        "edit_file": lambda: f"{out['replacements']} replacement, sha256 {out['sha256'][:12]}…",
        "run_command": lambda: f"exit {out['exit_code']} ({out['outcome']}): {out['stderr'].strip().splitlines()[-1]}",
        "list_directory": lambda: f"{[e['name'] for e in out['entries']]}, denied {out.get('denied')}",
    }[event.tool_name]()
    print(f"  {event.tool_name}: {summary}")


async def main() -> None:
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch)
        (root / "calc").mkdir()
        (root / "calc" / "core.py").write_text("def add(a, b):\n    return a - b\n")
        (root / "calc" / "test_core.py").write_text(
            "import unittest\nfrom core import add\n\n"
            "class T(unittest.TestCase):\n    def test_add(self):\n        self.assertEqual(add(2, 3), 5)\n"
        )
        (root / "secrets").mkdir()
        (root / "secrets" / "token.txt").write_text("do not read")

        def authorize(payload: dict) -> bool:
            print(f"  authorize {json.dumps(payload)[:110]}")
            return True

        tools = create_agent_coding_tools(
            root=root,
            authorize=authorize,
            authorize_path=lambda payload: payload["path"] != "secrets",
            executables={"python": sys.executable},
            environment={"PYTHONDONTWRITEBYTECODE": "1"},
            artifacts=create_memory_agent_coding_artifact_store(),
        )
        registry = define_model_registry(models={"m": {"model": FunctionModel(stream_function=scripted)}})
        runtime = create_agent_runtime(
            protocol=define_agent_protocol(),
            store=create_memory_agent_runtime_store(),
            models={"resolve": lambda: registry.resolve("m")},
            tools=tools,
            publish=show,
        )
        ticket = runtime.submit(
            conversation_id="c1",
            idempotency_key="k1",
            context={},
            parts=[{"type": "text", "text": "add() is wrong; fix it"}],
        )
        result = await ticket.result
        answer = " ".join(p.text for p in result.assistant.parts if p.type == "text")
        print(f"run: {result.terminal_reason}: {answer}")
        print(f"calc/core.py now: {(root / 'calc' / 'core.py').read_text()!r}")
        await runtime.close()


asyncio.run(main())
