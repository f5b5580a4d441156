"""The ``threadline`` command: ``schema``, ``demo``, ``inspect``, ``recover`` and bad invocations.

Pins: ``schema`` prints (or writes) the JSON Schema of every canonical record; ``demo`` runs every scene
through the real runtime on a real SQLite file, shows each scene's key fact, and runs again on the same
file; ``inspect --json`` is parseable and agrees with the store; ``recover`` on a file with an orphan
skips it (and blocks what waits behind it), abandons it with ``--abandon-stale``, requeues it with
``--requeue``; bad invocations (unknown policy, unreadable database, missing credential…) print one
``error:`` line and exit non-zero, never a traceback. (``chat`` is driven in a terminal by
``tests/integration/test_cli_chat.py``.)
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from typer.testing import CliRunner

from threadline import create_sqlite_agent_runtime_store
from threadline.cli import app
from threadline.records import RECORD_MODELS, export_json_schemas

runner = CliRunner()


def cli(*args: str, timeout: float = 120, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run ``python -m threadline.cli`` the way a user's shell would (its own process, piped output)."""
    base = {**os.environ, "COLUMNS": "200", "NO_COLOR": "1"}
    return subprocess.run(
        [sys.executable, "-m", "threadline.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env if env is not None else base,
        check=False,
    )


class Ran:
    """What an in-process run of the command printed (the shape of ``subprocess.CompletedProcess``)."""

    def __init__(self, returncode: int, stdout: str, stderr: str) -> None:
        self.returncode, self.stdout, self.stderr = returncode, stdout, stderr


def invoke(*args: str) -> Ran:
    """Run the command in this process (much faster than a new interpreter) with a 200-column console."""
    result = runner.invoke(app, list(args), env={"COLUMNS": "200", "NO_COLOR": "1"})
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return Ran(result.exit_code, result.stdout, result.stderr)


def one_error_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1, stderr
    assert lines[0].startswith("error: "), stderr
    return lines[0]


# ------------------------------------------------------------------------------------------- schema


def test_schema_prints_one_json_object_keyed_by_record_name() -> None:
    result = runner.invoke(app, ["schema"])
    assert result.exit_code == 0, result.output
    printed = json.loads(result.stdout)
    assert set(printed) == set(RECORD_MODELS)
    assert printed == export_json_schemas()
    assert result.stdout.startswith("{\n  ")  # indented


def test_schema_output_writes_one_file_per_record(tmp_path: Path) -> None:
    target = tmp_path / "schemas" / "nested"
    result = runner.invoke(app, ["schema", "--output", str(target)])
    assert result.exit_code == 0, result.output
    written = sorted(p.name for p in target.iterdir())
    assert written == sorted(f"{name}.schema.json" for name in RECORD_MODELS)
    schemas = export_json_schemas()
    for name in RECORD_MODELS:
        assert json.loads((target / f"{name}.schema.json").read_text(encoding="utf-8")) == schemas[name]


def test_schema_output_under_a_file_is_one_error_line(tmp_path: Path) -> None:
    occupied = tmp_path / "occupied"
    occupied.write_text("x")
    result = runner.invoke(app, ["schema", "--output", str(occupied / "sub")])
    assert result.exit_code == 2
    assert one_error_line(result.stderr).startswith("error: cannot write schemas")
    assert "Traceback" not in result.output


def test_help_lists_the_commands() -> None:
    result = runner.invoke(app, ["--help"])
    assert result.exit_code == 0
    for command in ("demo", "chat", "inspect", "recover", "schema"):
        assert command in result.output
    assert "_demo-child" not in result.output
    events = runner.invoke(app, ["inspect", "events", "--help"])
    assert "The event ledger of --conversation" in " ".join(events.output.split())
    for command in ("export", "import", "branch"):
        assert command in result.output


LOADED = """
import sys
from threadline.cli import main
try:
    main(sys.argv[1:])
except SystemExit:
    pass
print(" ".join(sorted({m.split(".")[0] for m in sys.modules} & {"pydantic", "pydantic_ai", "rich", "psycopg"})))
"""


@pytest.mark.subprocess
@pytest.mark.parametrize(
    "command",
    [[], ["chat"], ["demo"], ["recover"], ["worker"], ["schema"], ["inspect"], ["inspect", "runs"]],
    ids=lambda c: " ".join(c) or "threadline",
)
def test_help_loads_neither_pydantic_nor_rich(command: list[str]) -> None:
    """What keeps ``--help`` fast (bench/startup.py measures it): no model library, no records, no Rich."""
    done = subprocess.run(
        [sys.executable, "-c", LOADED, *command, "--help"], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "", done.stdout.splitlines()[-1]


@pytest.mark.subprocess
def test_inspect_into_a_pipe_loads_no_model_library_and_no_rich(tmp_path: Path) -> None:
    db = tmp_path / "orphan.db"
    asyncio.run(orphan_database(db))
    done = subprocess.run(
        [sys.executable, "-c", LOADED, "inspect", "runs", "--db", str(db)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "orphaned" in done.stdout
    assert done.stdout.splitlines()[-1] == "pydantic"  # the records; never pydantic_ai, Rich or psycopg


# -------------------------------------------------------------------------------- bad invocations


@pytest.mark.parametrize(
    "args",
    [["nosuchcommand"], ["schema", "--bogus"], ["demo", "--pace", "-1"], ["inspect"], ["inspect", "nothing"]],
)
def test_usage_errors_exit_2_without_a_traceback(args: list[str]) -> None:
    result = runner.invoke(app, args)
    assert result.exit_code == 2
    assert "Traceback" not in result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["chat", "--policy", "sometimes"], "unknown policy 'sometimes'"),
        (["chat", "--db", "x.db", "--dsn", "postgresql://nobody@127.0.0.1:1/x"], "--db or --dsn"),
        (["chat", "--base-url", "http://127.0.0.1:1/v1"], "--base-url needs --model"),
        (["chat", "--model", "nosuchprovider:model"], "unavailable"),
        (["inspect", "runs", "--db", "missing.db"], "no database at missing.db"),
        (["inspect", "runs", "--db", "missing.db", "--state", "sleeping"], "unknown run state 'sleeping'"),
        (["inspect", "messages", "--db", "missing.db", "--state", "sleeping"], "unknown message status"),
        (["recover", "--db", "missing.db"], "no database at missing.db"),
        (["recover", "--abandon-stale", "--requeue"], "choose one of"),
        (["inspect", "runs", "--schema", "s"], "--schema is for PostgreSQL"),
    ],
)
def test_bad_invocations_are_one_error_line(
    args: list[str], expected: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    result = runner.invoke(app, args)
    assert result.exit_code == 2, result.output
    assert expected in one_error_line(result.stderr)
    assert result.stdout == ""
    assert not (tmp_path / "x.db").exists() and not (tmp_path / "threadline.db").exists()


def test_a_missing_credential_names_the_variable_and_writes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in [k for k in os.environ if k.startswith("OPENAI")]:
        monkeypatch.delenv(name)
    db = tmp_path / "chat.db"
    for command in (["chat"], ["recover"]):
        result = invoke(*command, "--db", str(db), "--model", "openai:gpt-4.1-mini")
        assert result.returncode == 2, result.stderr
        line = one_error_line(result.stderr)
        assert "OPENAI_API_KEY" in line and "Traceback" not in result.stderr
        assert result.stdout == ""
    assert not db.exists()


def test_an_unreachable_base_url_names_the_url(tmp_path: Path) -> None:
    import socket

    with socket.socket() as closed:  # bound, never listening: connecting is refused
        closed.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{closed.getsockname()[1]}/v1"
        db = tmp_path / "chat.db"
        for command in (["chat"], ["recover"]):
            result = invoke(*command, "--db", str(db), "--base-url", url, "--model", "llama3.2")
            assert result.returncode == 2 and result.stdout == ""
            assert f"cannot reach the model server at {url}" in one_error_line(result.stderr)
    assert not db.exists()


@pytest.mark.subprocess
def test_a_missing_credential_in_a_shell(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OPENAI")}
    result = cli("chat", "--db", str(tmp_path / "chat.db"), "--model", "openai:gpt-4.1-mini", env=env)
    assert result.returncode == 2 and result.stdout == ""
    assert "OPENAI_API_KEY" in one_error_line(result.stderr)


def test_an_unreadable_database_is_one_error_line(tmp_path: Path) -> None:
    garbage = tmp_path / "garbage.db"
    garbage.write_bytes(b"this is not a database\x00\xff" * 200)
    for command in (
        ["demo", "--db", str(garbage), "--pace", "0"],
        ["inspect", "conversations", "--db", str(garbage)],
        ["recover", "--db", str(garbage)],
    ):
        result = invoke(*command)
        assert result.returncode == 2, (command, result.stdout, result.stderr)
        one_error_line(result.stderr)
        assert result.stdout == ""
    chat = runner.invoke(app, ["chat", "--db", str(garbage)], input="hello\n")
    assert chat.exit_code == 2 and chat.stdout == ""
    one_error_line(chat.stderr)


@pytest.mark.subprocess
def test_an_unreadable_database_in_a_shell(tmp_path: Path) -> None:
    garbage = tmp_path / "garbage.db"
    garbage.write_bytes(b"\x00\x01not sqlite" * 500)
    result = cli("demo", "--db", str(garbage), "--pace", "0")
    assert result.returncode == 2 and result.stdout == ""
    one_error_line(result.stderr)


# --------------------------------------------------------------------------------------------- demo

SCENES = {
    "header": ["threadline demo", "built-in scripted model", "offline"],
    "1 · streaming": [
        "1 · A streamed answer with a tool call",
        "① ▸ Let me check my notes on Lisbon.",
        '⚙ lookup started {"topic": "Lisbon"}',
        "⚙ lookup completed",
        "A day in Lisbon: Belém tower at nine",
        "⟨success⟩",
        "✓ streamed live, tool status as it happened",
        "✓ usage: in 100 (computed) · out 38 (computed) · cost unavailable · 2 steps",
    ],
    "2 · policies": [
        "2 · Five input policies, side by side, on the same three inputs",
        "queue ",
        "interrupt ",
        "interrupt-next ",
        "supersede ",
        "inject ",
        "① ⟨interrupted⟩",
        "① ⟨superseded⟩",
        "(arrives mid-answer: interrupt-next)",
        "(My previous answer was cut off; picking up from here.)",
        "the same three inputs under each policy",
        "✓ queue answers all three in turn",
    ],
    "3 · crash": [
        "3 · A crash mid-answer, and the recovery",
        "(child)",
        "⟨saved⟩",
        "with SIGKILL (exit status -9) mid-answer",
        "on disk: ① running",
        "draft 'A day in Lisbon: Belém tower at nine,' (streaming); ② queued",
        "runtime.recover(policy=…)",
        "recover() reported: ① requeued, ② resumed",
        "✓ recovered: ① requeued and answered in full, ② answered after it",
    ],
    "4 · runs": [
        "4 · Every run of this demo, read back from the database",
        "tokens in/out",
        "computed",
        "unavailable",
        "✓ 18 runs, each with exactly one terminal reason",
    ],
}

POLICY_TABLE = {  # policy: (①, ②, ③, answers in order, what ② saw of ①)
    "queue": ("success", "success", "success", "①②③", "the complete answer"),
    "interrupt": ("interrupted", "success", "success", "②③", "partial + cut-off marker"),
    "interrupt-next": ("interrupted", "success", "success", "③②", "partial + cut-off marker"),
    "supersede": ("superseded", "success", "success", "②③", "nothing (left out)"),
    "inject": ("success", "success", "absorbed into ①", "①②", "the complete answer"),
}

RUNS_TABLE = [  # conversation, input, state, terminal reason
    ("stream", "①", "completed", "success"),
    *[
        (policy, mark, *row)
        for policy, rows in {
            "queue": [("completed", "success")] * 3,
            "interrupt": [("interrupted", "interrupted"), ("completed", "success"), ("completed", "success")],
            "interrupt-next": [("interrupted", "interrupted"), ("completed", "success"), ("completed", "success")],
            "supersede": [("superseded", "superseded"), ("completed", "success"), ("completed", "success")],
            "inject": [("completed", "success"), ("completed", "success"), ("superseded", "absorbed")],
        }.items()
        for mark, row in zip("①②③", rows, strict=True)
    ],
    ("crash", "①", "completed", "success"),
    ("crash", "②", "completed", "success"),
]


def scene(output: str, title: str, following: str | None) -> str:
    start = output.index(title)
    end = output.index(following, start) if following else len(output)
    return output[start:end]


def table_rows(text: str, first_cells: set[str]) -> list[list[str]]:
    """Rows of a box-less Rich table whose first cell is one of ``first_cells`` (cells split on 2+ spaces)."""
    import re

    rows = []
    for line in text.splitlines():
        cells = [c for c in re.split(r"\s{2,}|│", line.strip()) if c.strip()]
        if cells and cells[0].strip() in first_cells:
            rows.append([c.strip() for c in cells])
    return rows


@pytest.fixture(scope="module")
def demo_runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess[str], str]:
    """The demo, run twice on the same file (output of both runs)."""
    db = tmp_path_factory.mktemp("demo") / "demo.db"
    first = cli("demo", "--db", str(db), "--pace", "0")
    second = cli("demo", "--db", str(db), "--pace", "0")
    return db, first, second.stdout + second.stderr + f"\n[exit {second.returncode}]"


@pytest.mark.subprocess
def test_demo_shows_every_scene_and_its_key_fact(demo_runs: tuple[Path, subprocess.CompletedProcess[str], str]) -> None:
    _, first, _ = demo_runs
    assert first.returncode == 0, first.stdout + first.stderr
    assert first.stderr == "" and "Traceback" not in first.stdout
    out = first.stdout
    titles = [facts[0] for facts in SCENES.values()]
    order = [out.index(t) for t in titles]
    assert order == sorted(order), "the scenes come in order"
    sections = list(SCENES.items())
    for i, (name, facts) in enumerate(sections):
        following = sections[i + 1][1][0] if i + 1 < len(sections) else None
        text = scene(out, facts[0], following)
        for fact in facts:
            assert fact in text, f"scene {name}: missing {fact!r} in:\n{text}"


@pytest.mark.subprocess
def test_demo_policies_side_by_side(demo_runs: tuple[Path, subprocess.CompletedProcess[str], str]) -> None:
    _, first, _ = demo_runs
    text = scene(first.stdout, "the same three inputs under each policy", "3 · A crash")
    rows = {r[0]: tuple(r[1:]) for r in table_rows(text, set(POLICY_TABLE))}
    assert rows == POLICY_TABLE


@pytest.mark.subprocess
def test_demo_table_reads_back_every_run(demo_runs: tuple[Path, subprocess.CompletedProcess[str], str]) -> None:
    _, first, _ = demo_runs
    text = scene(first.stdout, "4 · Every run of this demo", None)
    rows = table_rows(text, {"stream", "crash", *POLICY_TABLE})
    assert [tuple(r[:4]) for r in rows] == RUNS_TABLE
    for row in rows:
        if row[3] == "absorbed":
            assert row[4:] == ["in ①'s run", "—"]
        else:
            tokens, provenance = row[4].split(" ")
            assert all(n.isdigit() for n in tokens.split("/")) and provenance == "computed"
            assert row[5] == "unavailable"


@pytest.mark.subprocess
def test_demo_runs_again_on_the_same_file(demo_runs: tuple[Path, subprocess.CompletedProcess[str], str]) -> None:
    db, _, second = demo_runs
    assert second.endswith("[exit 0]"), second
    assert "✓ 18 runs" in second
    listed = json.loads(invoke("inspect", "conversations", "--db", str(db), "--json").stdout)
    names = [c["conversation_id"] for c in listed]
    prefixes = {n.split("-", 3)[2] for n in names}  # demo-<stamp>-<random>-<scene>
    assert len(names) == 14 and len(prefixes) == 2, names
    assert all(not c["active_runs"] for c in listed), "every run of both demos ended"


# ------------------------------------------------------------------------------------------ inspect


def test_inspect_json_agrees_with_the_store(demo_runs: tuple[Path, subprocess.CompletedProcess[str], str]) -> None:
    db, _, _ = demo_runs
    conversations = json.loads(invoke("inspect", "conversations", "--db", str(db), "--json").stdout)
    crash = next(c["conversation_id"] for c in conversations if c["conversation_id"].endswith("-crash"))
    inject = next(c["conversation_id"] for c in conversations if c["conversation_id"].endswith("-inject"))

    runs = json.loads(invoke("inspect", "runs", "--db", str(db), "--json").stdout)
    assert len(runs) == 36
    assert {r["terminal_reason"] for r in runs} == {"success", "interrupted", "superseded", "absorbed"}

    absorbed = json.loads(
        invoke("inspect", "runs", "--db", str(db), "-c", inject, "--state", "superseded", "--json").stdout
    )
    assert [r["terminal_reason"] for r in absorbed] == ["absorbed"]

    messages = json.loads(invoke("inspect", "messages", "--db", str(db), "-c", crash, "--json").stdout)
    assert [(m["role"], m["status"]) for m in messages] == [
        ("user", "committed"),
        ("assistant", "completed"),
        ("user", "committed"),
        ("assistant", "completed"),
    ]
    assert [m["position"] for m in messages] == [1, 2, 3, 4]

    events = json.loads(invoke("inspect", "events", "--db", str(db), "-c", crash, "--json").stdout)
    transitions = [e["payload"]["type"] for e in events if e["kind"] == "runtime/transition"]
    assert transitions.count("accept") == 2 and transitions.count("terminal") == 2
    assert [e["seq"] for e in events] == list(range(1, len(events) + 1))
    assert {e["conversation_id"] for e in events} == {crash}

    table = invoke("inspect", "runs", "--db", str(db), "-c", crash)
    assert table.returncode == 0 and "completed" in table.stdout and "success" in table.stdout
    empty = invoke("inspect", "runs", "--db", str(db), "--state", "running")
    assert empty.returncode == 0 and "(no runs)" in empty.stdout


ISO_Z = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d{1,6})?Z$")


def timestamps(value: object, key: str = "") -> list[str]:
    """Every timestamp in a JSON document (values of keys ``at`` or ``*_at``)."""
    if isinstance(value, dict):
        return [t for k, v in value.items() for t in timestamps(v, k)]
    if isinstance(value, list):
        return [t for v in value for t in timestamps(v, key)]
    return [value] if (key == "at" or key.endswith("_at")) and value is not None else []


def test_inspect_json_has_one_timestamp_format_and_structured_events(
    demo_runs: tuple[Path, subprocess.CompletedProcess[str], str],
) -> None:
    db, _, _ = demo_runs
    for kind in ("conversations", "runs", "messages", "events"):
        document = json.loads(invoke("inspect", kind, "--db", str(db), "--json").stdout)
        stamps = timestamps(document)
        assert stamps, kind
        assert all(isinstance(t, str) and ISO_Z.match(t) for t in stamps), (kind, stamps[:5])
    events = json.loads(invoke("inspect", "events", "--db", str(db), "--json").stdout)
    for event in events:  # the ledger's envelope, as stored: nothing derived, nothing left out
        assert {"schema_version", "event_id", "conversation_id", "seq", "kind", "occurred_at"} <= set(event), event
    terminals = [
        e["payload"]["input"]
        for e in events
        if e["kind"] == "runtime/transition" and e["payload"]["type"] == "terminal"
    ]
    assert terminals and all(t["terminal_reason"] for t in terminals)
    by_conversation: dict[str, list[int]] = {}
    for event in events:
        by_conversation.setdefault(event["conversation_id"], []).append(event["seq"])
    assert all(seqs == list(range(1, len(seqs) + 1)) for seqs in by_conversation.values()), by_conversation


async def long_text_database(path: Path) -> tuple[str, str]:
    """One conversation whose only input is a long line of text with a newline in it."""
    async with create_sqlite_agent_runtime_store(filename=path) as sqlite:
        accepted = await sqlite.store.accept_input_and_assign_run(
            conversation_id="chat-20260101-long",
            idempotency_key="k1",
            input={"id": "m1", "role": "user", "parts": [{"type": "text", "text": LONG_TEXT}]},
        )
        return accepted.run.id, accepted.run.input_message_ids[0]


LONG_TEXT = "Plan a whole week in Lisbon, " * 12 + "please.\nAnd Porto too."


@pytest.mark.subprocess
def test_inspect_into_a_pipe_never_truncates_and_shows_full_ids(tmp_path: Path) -> None:
    db = tmp_path / "long.db"
    run_id, _ = asyncio.run(long_text_database(db))
    env = {**os.environ, "COLUMNS": "40"}  # a narrow terminal setting must not narrow a pipe
    for kind, expected in (
        ("messages", LONG_TEXT.replace("\n", "\\n")),
        ("runs", run_id),
        ("events", run_id),
        ("conversations", run_id),
    ):
        result = cli("inspect", kind, "--db", str(db), env=env)
        assert result.returncode == 0, result.stderr
        assert expected in result.stdout, (kind, result.stdout)
        assert "…" not in result.stdout
    lines = cli("inspect", "messages", "--db", str(db), env=env).stdout.splitlines()
    assert len(lines) == 2 and lines[0].split() == ["conversation", "pos", "role", "status", "run", "text"]
    assert lines[1].split()[:5] == ["chat-20260101-long", "—", "user", "committed", run_id]


def in_a_terminal(*args: str, columns: int) -> str:
    """What ``python -m threadline.cli *args`` shows when stdout is a real (pseudo-)terminal."""
    import fcntl
    import pty
    import struct
    import termios

    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 50, columns, 0, 0))  # rows, columns
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    env.update({"TERM": "xterm-256color", "NO_COLOR": "1"})
    with subprocess.Popen(
        [sys.executable, "-m", "threadline.cli", *args], stdout=follower, stderr=subprocess.PIPE, env=env
    ) as proc:
        os.close(follower)
        chunks = []
        while True:
            try:
                chunk = os.read(leader, 65536)
            except OSError:  # EIO: the child closed the terminal
                break
            if not chunk:
                break
            chunks.append(chunk)
        assert proc.wait(timeout=60) == 0, proc.stderr.read() if proc.stderr else ""
    os.close(leader)
    return re.sub(r"\x1b\[[0-9;]*m", "", b"".join(chunks).decode())  # bold headers: not text


@pytest.mark.subprocess
def test_inspect_in_a_terminal_fits_it_and_cuts_nothing(tmp_path: Path) -> None:
    """stdout a real terminal: the Rich table, ids in full on a wide one; on a narrow one every cell folds
    onto more lines (the long text too), and nothing ends in an ellipsis."""
    db = tmp_path / "long.db"
    run_id, _ = asyncio.run(long_text_database(db))
    wide = in_a_terminal("inspect", "runs", "--db", str(db), columns=160)
    assert run_id in wide and "chat-20260101-long" in wide
    for columns in (60, 120):
        screen = in_a_terminal("inspect", "messages", "--db", str(db), columns=columns)
        assert "…" not in screen
        assert max(len(line.rstrip()) for line in screen.splitlines()) <= columns
        folded = " ".join(screen.split())
        for word in ("Plan a whole week in Lisbon,", "please.", "And Porto too."):
            assert word in folded, (columns, screen)
        assert all(piece in "".join(screen.split()) for piece in (run_id[:8], run_id[-8:]))
        if columns == 120:  # room for the ids: they stay whole, the text folds
            assert run_id in screen


def test_inspect_conversation_takes_a_unique_prefix(
    demo_runs: tuple[Path, subprocess.CompletedProcess[str], str],
) -> None:
    db, _, _ = demo_runs
    listed = json.loads(invoke("inspect", "conversations", "--db", str(db), "--json").stdout)
    crash = next(c["conversation_id"] for c in listed if c["conversation_id"].endswith("-crash"))
    by_prefix = json.loads(invoke("inspect", "runs", "--db", str(db), "-c", crash[:-2], "--json").stdout)
    assert {r["conversation_id"] for r in by_prefix} == {crash} and len(by_prefix) == 2

    ambiguous = invoke("inspect", "runs", "--db", str(db), "-c", "demo-")
    assert ambiguous.returncode == 2 and ambiguous.stdout == ""
    line = one_error_line(ambiguous.stderr)
    assert "starts 14 conversation ids" in line and "give more of it" in line

    missing = invoke("inspect", "runs", "--db", str(db), "-c", "nosuch")
    assert missing.returncode == 2 and "no conversation 'nosuch'" in one_error_line(missing.stderr)


def test_inspect_opens_sqlite_read_only(tmp_path: Path) -> None:
    """inspect changes no byte of the database, creates no schema in an empty file, and leaves a database
    of an earlier schema version unmigrated (an error saying so)."""
    import hashlib
    import shutil

    db = tmp_path / "orphan.db"
    asyncio.run(orphan_database(db))
    digest = hashlib.sha256(db.read_bytes()).hexdigest()
    for kind in ("conversations", "runs", "messages", "events"):
        assert invoke("inspect", kind, "--db", str(db)).returncode == 0
    assert hashlib.sha256(db.read_bytes()).hexdigest() == digest

    empty = tmp_path / "empty.db"
    empty.write_bytes(b"")
    result = invoke("inspect", "runs", "--db", str(empty))
    assert result.returncode == 2 and "no threadline tables" in one_error_line(result.stderr)
    assert empty.read_bytes() == b""

    old = tmp_path / "v1.db"
    shutil.copy(Path(__file__).resolve().parents[1] / "fixtures" / "sqlite-schema-v1.db", old)
    before = old.read_bytes()
    result = invoke("inspect", "runs", "--db", str(old))
    assert result.returncode == 2 and "schema version 1" in one_error_line(result.stderr)
    assert old.read_bytes() == before


# ------------------------------------------------------------------------------------------ recover


async def orphan_database(
    path: Path, conversation_id: str = "orphaned", lease_expires_at: datetime | None = None
) -> tuple[str, str]:
    """A file where a process that is gone left ``o1``'s run running, with ``o2`` queued behind it."""
    async with create_sqlite_agent_runtime_store(filename=path) as sqlite:
        store = sqlite.store
        first = await store.accept_input_and_assign_run(
            conversation_id=conversation_id,
            idempotency_key="o1",
            input={"id": "m1", "role": "user", "parts": [{"type": "text", "text": "Plan a day in Lisbon."}]},
        )
        await store.acquire_run(
            conversation_id=conversation_id,
            run_id=first.run.id,
            expected_revision=first.run.revision,
            owner_id="gone",
            lease_expires_at=lease_expires_at,
        )
        second = await store.accept_input_and_assign_run(
            conversation_id=conversation_id,
            idempotency_key="o2",
            input={"id": "m2", "role": "user", "parts": [{"type": "text", "text": "Also suggest a restaurant."}]},
        )
        return first.run.id, second.run.id


def outcome_rows(stdout: str) -> list[list[str]]:
    return table_rows(stdout, {"orphaned"})


def test_recover_skips_an_orphan_by_default_then_abandons_it(tmp_path: Path) -> None:
    db = tmp_path / "orphan.db"
    first, second = asyncio.run(orphan_database(db))

    skipped = invoke("recover", "--db", str(db))
    assert skipped.returncode == 0, skipped.stdout + skipped.stderr
    rows = outcome_rows(skipped.stdout)
    assert [r[1:3] for r in rows] == [[first[:10], "skipped"], [second[:10], "blocked"]]
    assert "--abandon-stale" in skipped.stdout and "recovery pass: 1 skipped, 1 blocked" in skipped.stdout

    abandoned = invoke("recover", "--db", str(db), "--abandon-stale")
    assert abandoned.returncode == 0, abandoned.stdout + abandoned.stderr
    rows = outcome_rows(abandoned.stdout)
    assert [r[1:4] for r in rows] == [[first[:10], "abandoned", "abandoned"], [second[:10], "resumed", "success"]]
    assert "For dinner in Lisbon" in abandoned.stdout  # the queued input was answered (scripted model)

    runs = json.loads(invoke("inspect", "runs", "--db", str(db), "--json").stdout)
    assert [(r["id"], r["state"], r["terminal_reason"]) for r in runs] == [
        (first, "abandoned", "abandoned"),
        (second, "completed", "success"),
    ]
    again = invoke("recover", "--db", str(db))
    assert again.returncode == 0 and "nothing to recover" in again.stdout


def test_recover_requeue_runs_the_orphan_again(tmp_path: Path) -> None:
    db = tmp_path / "orphan.db"
    first, second = asyncio.run(orphan_database(db))
    elsewhere = invoke("recover", "--db", str(db), "--requeue", "-c", "another")
    assert [r[2] for r in outcome_rows(elsewhere.stdout)] == ["left alone", "left alone"]
    requeued = invoke("recover", "--db", str(db), "--requeue", "-c", "orphaned")
    assert requeued.returncode == 0, requeued.stdout + requeued.stderr
    rows = outcome_rows(requeued.stdout)
    assert [r[1:4] for r in rows] == [[first[:10], "requeued", "success"], [second[:10], "resumed", "success"]]
    messages = json.loads(invoke("inspect", "messages", "--db", str(db), "-c", "orphaned", "--json").stdout)
    assert [m["status"] for m in messages if m["role"] == "assistant"] == ["completed", "completed"]


def test_recover_takeover_expired_requeues_only_expired_leases(tmp_path: Path) -> None:
    db = tmp_path / "leases.db"
    expired = asyncio.run(orphan_database(db, "expired", datetime.now(UTC) - timedelta(seconds=5)))
    live = asyncio.run(orphan_database(db, "live", datetime.now(UTC) + timedelta(hours=1)))
    result = invoke("recover", "--db", str(db), "--takeover-expired")
    assert result.returncode == 0, result.stdout + result.stderr
    rows = {r[1]: r[2:4] for r in table_rows(result.stdout, {"expired", "live"})}
    assert rows[expired[0][:10]] == ["requeued", "success"] and rows[expired[1][:10]] == ["resumed", "success"]
    assert rows[live[0][:10]] == ["skipped", "—"] and rows[live[1][:10]] == ["blocked", "—"]


def test_chat_continues_its_conversation_and_takes_over_an_expired_lease(tmp_path: Path) -> None:
    """A chat killed mid-answer left its run holding a lease that expired: the next chat (default
    conversation: the latest ``chat-…`` one) requeues it and answers both inputs, then leaves at end of input."""
    db = tmp_path / "chat.db"
    first, second = asyncio.run(orphan_database(db, "chat-earlier", datetime.now(UTC) - timedelta(seconds=1)))
    result = runner.invoke(
        app, ["chat", "--db", str(db), "--pace", "0"], input="", env={"COLUMNS": "200", "NO_COLOR": "1"}
    )
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert "conversation  chat-earlier " in out and "(new)" not in out
    assert "lease expired" in out and "answering 2 message(s) left queued" in out
    assert "A day in Lisbon" in out and "For dinner in Lisbon" in out
    assert "bye — conversation chat-earlier is saved." in out
    runs = json.loads(invoke("inspect", "runs", "--db", str(db), "--json").stdout)
    assert [(r["id"], r["terminal_reason"]) for r in runs] == [(first, "success"), (second, "success")]


@pytest.mark.subprocess
def test_chat_from_a_pipe_echoes_each_line_and_says_nothing_is_queued(tmp_path: Path) -> None:
    """stdin a pipe (a script): no prompts, each line echoed with its policy, answered, and the last line
    read back from the store after the close."""
    done = subprocess.run(
        [sys.executable, "-m", "threadline.cli", "chat", "--db", str(tmp_path / "c.db"), "--pace", "0"],
        input="Plan a day in Lisbon.\n",
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "COLUMNS": "200", "NO_COLOR": "1"},
        check=False,
    )
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "you › Plan a day in Lisbon.  (policy queue)" in out
    assert out.count("you ›") == 1  # the echo; no prompt into a pipe
    assert "A day in Lisbon" in out and "⟨success⟩" in out
    assert out.rstrip().endswith("is saved. Nothing is queued.")


# ---------------------------------------------------------------------------------------- postgres


@pytest.mark.postgres
def test_inspect_and_recover_over_postgres(postgres_dsn: str) -> None:
    import uuid

    import psycopg

    from threadline.store.postgres import create_postgres_agent_runtime_store

    schema = f"cli_{uuid.uuid4().hex[:8]}"

    async def seed() -> str:
        async with create_postgres_agent_runtime_store(postgres_dsn, schema=schema) as pg:
            accepted = await pg.store.accept_input_and_assign_run(
                conversation_id="pg-chat",
                idempotency_key="k1",
                input={"id": "m1", "role": "user", "parts": [{"type": "text", "text": "Plan a day in Porto."}]},
            )
            return accepted.run.id

    try:
        run_id = asyncio.run(seed())
        where = ["--dsn", postgres_dsn, "--schema", schema]
        queued = json.loads(invoke("inspect", "runs", *where, "--state", "queued", "--json").stdout)
        assert [r["id"] for r in queued] == [run_id]
        recovered = invoke("recover", *where)
        assert recovered.returncode == 0, recovered.stdout + recovered.stderr
        assert [r[2:4] for r in table_rows(recovered.stdout, {"pg-chat"})] == [["resumed", "success"]]
        messages = json.loads(invoke("inspect", "messages", *where, "-c", "pg-chat", "--json").stdout)
        assert "A day in Porto" in messages[-1]["parts"][0]["text"]
    finally:
        with psycopg.connect(postgres_dsn, autocommit=True) as conn:
            conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


@pytest.mark.postgres
def test_inspect_never_creates_a_postgres_schema(postgres_dsn: str) -> None:
    import uuid

    import psycopg

    schema = f"cli_missing_{uuid.uuid4().hex[:8]}"
    for command in (["inspect", "runs"], ["inspect", "conversations", "--json"], ["recover"]):
        result = invoke(*command, "--dsn", postgres_dsn, "--schema", schema)
        assert result.returncode == 2 and result.stdout == ""
        line = one_error_line(result.stderr)
        assert f"no schema '{schema}'" in line and "nothing was created" in line
        assert "postgres@" not in line  # the connection string's user is not repeated
    with psycopg.connect(postgres_dsn, autocommit=True) as conn:
        assert conn.execute("SELECT 1 FROM pg_namespace WHERE nspname = %s", (schema,)).fetchone() is None
        conn.execute(f'CREATE SCHEMA "{schema}"')
    try:
        result = invoke("inspect", "runs", "--dsn", postgres_dsn, "--schema", schema)
        assert result.returncode == 2 and "holds no threadline tables" in one_error_line(result.stderr)
        with psycopg.connect(postgres_dsn, autocommit=True) as conn:
            tables = conn.execute("SELECT count(*) FROM pg_tables WHERE schemaname = %s", (schema,)).fetchone()
        assert tables == (0,)
    finally:
        with psycopg.connect(postgres_dsn, autocommit=True) as conn:
            conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
