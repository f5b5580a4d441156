"""The Typer application behind ``threadline``: ``demo``, ``chat``, ``inspect``, ``recover``, ``worker``,
``serve``, ``schema``, and the ledger's ``export``, ``import`` and ``branch`` (:mod:`threadline.cli.ledger`).

Every command body runs inside :func:`_reported`: a :class:`~threadline.errors.ThreadlineError` (an
unreadable database, a missing credential, an unknown policy…) becomes one line ``error: <message>`` on
stderr and exit status 2, never a traceback.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated

import typer

from ..errors import ThreadlineError

EXIT_ERROR = 2
"""Exit status for a failure threadline reports (an unreadable database, a missing credential…)."""
EXIT_INTERRUPTED = 130


class _Group(typer.core.TyperGroup):
    """A command group whose ``--help`` flag defaults to ``False`` instead of ``None``: Typer (0.2x) builds a
    pydantic adapter to coerce a ``None`` flag, which costs every subcommand's start-up (and ``--help``)
    about a hundred milliseconds of importing pydantic before anything runs; a ``bool`` passes through."""

    def get_help_option(self, ctx: typer.Context) -> typer.core.TyperOption | None:  # type: ignore[override]
        option = super().get_help_option(ctx)
        if option is not None and option.default is None:
            option.default = False
        return option


app = typer.Typer(
    cls=_Group,
    name="threadline",
    help="Durable tool-using language-model conversations on SQLite or PostgreSQL.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_show_locals=False,
    rich_markup_mode=None,
)
inspect_app = typer.Typer(
    cls=_Group,
    name="inspect",
    help="Read a threadline database: conversations, runs, messages, events. Tables, or --json for scripts.",
    no_args_is_help=True,
    rich_markup_mode=None,
)
app.add_typer(inspect_app)


def _fail(message: str, status: int = EXIT_ERROR) -> typer.Exit:
    one_line = " ".join(str(message).split()) or "unknown error"
    typer.echo(f"error: {one_line}", err=True)
    return typer.Exit(status)


@contextmanager
def _reported() -> Iterator[None]:
    """Turn threadline's typed errors into one ``error:`` line and exit status 2; Ctrl-C into 130. The
    library's own log lines (a refused import, say) are not printed besides: the ``error:`` line says it."""
    quiet = logging.getLogger("threadline")
    silencer = None if quiet.handlers else logging.NullHandler()
    if silencer is not None:  # for this command only: a program calling it in-process keeps its logging
        quiet.addHandler(silencer)
    try:
        yield
    except ThreadlineError as error:
        raise _fail(str(error) or type(error).__name__) from None
    except KeyboardInterrupt:
        raise typer.Exit(EXIT_INTERRUPTED) from None
    except BrokenPipeError:  # `threadline demo | head`: the reader left; stop quietly
        with contextlib.suppress(OSError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        raise typer.Exit(1) from None
    finally:
        if silencer is not None:
            quiet.removeHandler(silencer)


DbOption = Annotated[
    Path | None,
    typer.Option("--db", help="SQLite database file (default ./threadline.db).", dir_okay=False),
]
DsnOption = Annotated[
    str | None,
    typer.Option("--dsn", help="PostgreSQL connection string instead of --db (needs threadline[postgres])."),
]
SchemaOption = Annotated[
    str | None,
    typer.Option(
        "--schema", help="With --dsn: the PostgreSQL schema holding the threadline tables (default threadline)."
    ),
]
ModelOption = Annotated[
    str | None,
    typer.Option(
        "--model",
        help="A pydantic-ai model name, e.g. openai:gpt-4.1-mini (default: the built-in scripted model, offline).",
    ),
]
BaseUrlOption = Annotated[
    str | None,
    typer.Option(
        "--base-url",
        help="An OpenAI-compatible server (Ollama, vLLM…); --model names the model there. "
        "Uses OPENAI_API_KEY when set.",
    ),
]
PaceOption = Annotated[
    float,
    typer.Option("--pace", help="Seconds between the scripted model's words.", min=0.0, max=1.0, hidden=True),
]


@app.callback()
def _root() -> None:
    """Durable tool-using language-model conversations on SQLite or PostgreSQL."""


# --------------------------------------------------------------------------------------------- schema


@app.command()
def schema(
    output: Annotated[
        Path | None,
        typer.Option(
            "--output",
            "-o",
            help="Write one <Name>.schema.json per record into this directory instead of printing.",
            file_okay=False,
            dir_okay=True,
        ),
    ] = None,
) -> None:
    """Print the JSON Schema (draft 2020-12) of every canonical record, keyed by record name."""
    with _reported():
        import json

        from ..records import export_json_schemas

        schemas = export_json_schemas()
        if output is None:
            typer.echo(json.dumps(schemas, indent=2))
            return
        try:
            output.mkdir(parents=True, exist_ok=True)
            for name, document in schemas.items():
                target = output / f"{name}.schema.json"
                target.write_text(json.dumps(document, indent=2) + "\n", encoding="utf-8")
                typer.echo(str(target))
        except OSError as error:
            raise _fail(f"cannot write schemas to {output}: {error.strerror or error}") from None


# ----------------------------------------------------------------------------------------------- demo


@app.command()
def demo(
    db: Annotated[
        Path,
        typer.Option("--db", help="SQLite database file to use (created if missing).", dir_okay=False),
    ] = Path("threadline.db"),
    pace: PaceOption = 0.03,
) -> None:
    """Watch the runtime offline: streaming with tools, the five input policies side by side, a crash
    and its recovery, and every run's terminal reason and usage. Uses a built-in scripted model."""
    with _reported():
        import asyncio

        from rich.console import Console

        from .demo import DemoCheckFailed, run_demo

        try:
            asyncio.run(run_demo(Console(highlight=False), db, pace=pace))
        except DemoCheckFailed as error:
            raise _fail(f"demo check failed: {error}", status=1) from None


@app.command("_demo-child", hidden=True)
def demo_child(
    db: Annotated[Path, typer.Option("--db", dir_okay=False)],
    conversation: Annotated[str, typer.Option("--conversation")],
    pace: PaceOption = 0.03,
) -> None:
    """The demo's crash scene runs this in a child process and kills it with SIGKILL mid-answer."""
    with _reported():
        import asyncio

        from .demo import run_demo_child

        asyncio.run(run_demo_child(db, conversation, pace=pace))


# ----------------------------------------------------------------------------------------------- chat


@app.command()
def chat(
    db: DbOption = None,
    dsn: DsnOption = None,
    schema_name: SchemaOption = None,
    conversation: Annotated[
        str | None,
        typer.Option("--conversation", "-c", help="Conversation id (default: the last one this database chatted in)."),
    ] = None,
    model: ModelOption = None,
    base_url: BaseUrlOption = None,
    policy: Annotated[
        str,
        typer.Option(
            "--policy",
            help="What a message typed while the model answers does to that answer: "
            "queue, inject, interrupt, interrupt-next or supersede.",
        ),
    ] = "queue",
    pace: PaceOption = 0.05,
    coding_root: Annotated[
        Path | None,
        typer.Option(
            "--coding-root",
            help="Give the model the coding tools (read, write, edit, list, glob, search) over this directory; "
            "no commands (needs threadline[coding]).",
            file_okay=False,
            exists=True,
        ),
    ] = None,
) -> None:
    """Chat in the terminal. Answers stream as they arrive; typing while the model answers applies
    --policy; Ctrl-C interrupts the answer durably and keeps the chat open; Ctrl-C twice (or Ctrl-C
    when idle, Ctrl-D, /quit) leaves. The conversation is stored, so restarting the command continues it."""
    with _reported():
        from .chat import run_chat
        from .common import check_policy

        check_policy(policy)
        status = run_chat(
            db=db,
            dsn=dsn,
            schema=schema_name,
            conversation=conversation,
            model=model,
            base_url=base_url,
            policy=policy,
            pace=pace,
            coding_root=coding_root,
        )
        raise typer.Exit(status)


# -------------------------------------------------------------------------------------------- recover


@app.command()
def recover(
    db: DbOption = None,
    dsn: DsnOption = None,
    schema_name: SchemaOption = None,
    abandon_stale: Annotated[
        bool,
        typer.Option(
            "--abandon-stale",
            help="Runs a dead process left running are abandoned (you assert their owner is gone). "
            "Default: skipped, and the runs queued behind them stay blocked.",
        ),
    ] = False,
    requeue: Annotated[
        bool,
        typer.Option(
            "--requeue",
            help="Runs a dead process left running are requeued and run again (you assert replaying their "
            "model request is safe: a tool effect may repeat).",
        ),
    ] = False,
    takeover_expired: Annotated[
        bool,
        typer.Option(
            "--takeover-expired",
            help="Runs whose lease expired (their owner stopped renewing it) are requeued and run again; runs "
            "with a live lease, or none, are skipped.",
        ),
    ] = False,
    conversation: Annotated[
        list[str] | None,
        typer.Option("--conversation", "-c", help="Only these conversations (repeatable); others are left alone."),
    ] = None,
    model: ModelOption = None,
    base_url: BaseUrlOption = None,
    pace: PaceOption = 0.0,
) -> None:
    """One recovery pass: queued runs are resumed and answered with --model (default the built-in
    scripted model); runs a dead process left running are skipped, abandoned or requeued. Prints one
    outcome per run."""
    with _reported():
        from .recover import run_recover

        status = run_recover(
            db=db,
            dsn=dsn,
            schema=schema_name,
            abandon_stale=abandon_stale,
            requeue=requeue,
            takeover_expired=takeover_expired,
            conversations=conversation or [],
            model=model,
            base_url=base_url,
            pace=pace,
        )
        raise typer.Exit(status)


@app.command()
def worker(
    db: DbOption = None,
    dsn: DsnOption = None,
    schema_name: SchemaOption = None,
    model: ModelOption = None,
    base_url: BaseUrlOption = None,
    lease: Annotated[float, typer.Option("--lease", help="Seconds of lease on each executing run.", min=1)] = 30.0,
    poll: Annotated[float, typer.Option("--poll", help="Seconds between sweeps for queued work.", min=0.05)] = 1.0,
    grace: Annotated[float, typer.Option("--grace", help="On SIGTERM: seconds runs may finish on their own.")] = 30.0,
    force: Annotated[float, typer.Option("--force", help="Then: seconds to wait for aborted runs to settle.")] = 5.0,
    takeover_expired: Annotated[
        bool,
        typer.Option(
            "--takeover-expired",
            help="Take over runs whose owner's lease expired (you assert replaying them is safe).",
        ),
    ] = False,
    gc_tuning: Annotated[
        bool,
        typer.Option(
            "--gc-tuning/--no-gc-tuning",
            help="After start-up, freeze what exists and collect the youngest generation every 50,000 "
            "allocations (docs/operations.md, Throughput); --no-gc-tuning keeps Python's defaults.",
        ),
    ] = True,
    live: Annotated[
        bool,
        typer.Option(
            "--live", help="Publish every run's stream through the store's live relay (for threadline serve --live)."
        ),
    ] = False,
) -> None:
    """Execute whatever is queued (runs admitted by any process) until SIGTERM, then close gracefully."""
    with _reported():
        import asyncio

        from .worker import run_worker

        status = asyncio.run(
            run_worker(
                db=db,
                dsn=dsn,
                schema=schema_name,
                model=model,
                base_url=base_url,
                lease=lease,
                poll=poll,
                grace=grace,
                force=force,
                replay_safe=takeover_expired,
                gc_tuning=gc_tuning,
                live=live,
            )
        )
        raise typer.Exit(status)


# ---------------------------------------------------------------------------------------------- serve


@app.command()
def serve(
    db: DbOption = None,
    dsn: DsnOption = None,
    schema_name: SchemaOption = None,
    host: Annotated[str, typer.Option("--host", help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", help="Port to listen on (0: any free port).", min=0, max=65535)] = 8000,
    model: ModelOption = None,
    base_url: BaseUrlOption = None,
    demo: Annotated[
        bool, typer.Option("--demo", help="Serve the built-in scripted model (offline) and print what to try.")
    ] = False,
    token: Annotated[
        str | None,
        typer.Option("--token", envvar="THREADLINE_TOKEN", help="Require this bearer token (env THREADLINE_TOKEN)."),
    ] = None,
    cors_origin: Annotated[
        list[str] | None, typer.Option("--cors-origin", help="A browser origin allowed to call (repeatable).")
    ] = None,
    stdio: Annotated[
        bool, typer.Option("--stdio", help="Speak the JSON-lines structured runner on stdin/stdout instead of HTTP.")
    ] = False,
    events: Annotated[bool, typer.Option("--events", help="With --stdio: also write every delivery event.")] = False,
    root: Annotated[
        list[str] | None,
        typer.Option(
            "--root",
            help="A file-resource root ID:KIND:/absolute/path, KIND instruction, skill or resource (repeatable; "
            "needs threadline[harness]). Instructions enter the prompt; skills and resources are read on demand.",
        ),
    ] = None,
    grace: Annotated[float, typer.Option("--grace", help="On stop: seconds runs may finish on their own.")] = 10.0,
    force: Annotated[float, typer.Option("--force", help="Then: seconds to wait for aborted runs to settle.")] = 5.0,
    admit_only: Annotated[
        bool,
        typer.Option("--admit-only", help="Only admit input; workers (threadline worker) execute the runs."),
    ] = False,
    live: Annotated[
        bool,
        typer.Option(
            "--live",
            help="Exchange run streams with other processes through the store's live relay (SQLite or "
            "PostgreSQL): with --admit-only, viewers see what a `threadline worker --live` streams.",
        ),
    ] = False,
) -> None:
    """Serve conversations over HTTP: the control protocol on a WebSocket, Server-Sent Events per
    conversation, the Vercel AI SDK chat stream and a REST surface (needs threadline[server]); or, with
    --stdio, as a JSON-lines runner for a supervisor. --demo answers with the built-in scripted model."""
    with _reported():
        import asyncio

        from .serve import run_serve

        status = asyncio.run(
            run_serve(
                db=db,
                dsn=dsn,
                schema=schema_name,
                host=host,
                port=port,
                model=model,
                base_url=base_url,
                demo=demo,
                token=token,
                cors_origins=cors_origin or [],
                stdio=stdio,
                events=events,
                grace=grace,
                force=force,
                roots=root or [],
                admit_only=admit_only,
                live=live,
            )
        )
        raise typer.Exit(status)


# -------------------------------------------------------------------------------------------- inspect

JsonOption = Annotated[bool, typer.Option("--json", help="Print JSON (one document) instead of a table.")]
ConversationFilter = Annotated[str | None, typer.Option("--conversation", "-c", help="Only this conversation.")]
StateFilter = Annotated[
    str | None,
    typer.Option(
        "--state",
        help="Only runs in this state (queued, running, interrupt_requested, completed, interrupted, "
        "superseded, cancelled, failed, abandoned); for messages, the message status.",
    ),
]
LimitOption = Annotated[int, typer.Option("--limit", help="At most this many rows.", min=1)]


def _inspect(
    view: str,
    db: Path | None,
    dsn: str | None,
    schema_name: str | None,
    conversation: str | None,
    state: str | None,
    as_json: bool,
    limit: int,
) -> None:
    """What every ``inspect`` subcommand does: read the store and print ``view`` (import on demand)."""
    with _reported():
        from .inspect import inspect_command

        inspect_command(
            view,
            db=db,
            dsn=dsn,
            schema=schema_name,
            conversation=conversation,
            state=state,
            as_json=as_json,
            limit=limit,
        )


@inspect_app.command("conversations")
def inspect_conversations(
    db: DbOption = None,
    dsn: DsnOption = None,
    schema_name: SchemaOption = None,
    state: StateFilter = None,
    as_json: JsonOption = False,
    limit: LimitOption = 1000,
) -> None:
    """Conversations: id, version, runs, messages, active runs, last change."""
    _inspect("conversations", db, dsn, schema_name, None, state, as_json, limit)


@inspect_app.command("runs")
def inspect_runs(
    db: DbOption = None,
    dsn: DsnOption = None,
    schema_name: SchemaOption = None,
    conversation: ConversationFilter = None,
    state: StateFilter = None,
    as_json: JsonOption = False,
    limit: LimitOption = 1000,
) -> None:
    """Runs: state, terminal reason, policy, priority, inputs, owner and fencing token."""
    _inspect("runs", db, dsn, schema_name, conversation, state, as_json, limit)


@inspect_app.command("messages")
def inspect_messages(
    db: DbOption = None,
    dsn: DsnOption = None,
    schema_name: SchemaOption = None,
    conversation: ConversationFilter = None,
    state: StateFilter = None,
    as_json: JsonOption = False,
    limit: LimitOption = 50,
) -> None:
    """The last --limit messages of each conversation (or of --conversation), in the order they happened."""
    _inspect("messages", db, dsn, schema_name, conversation, state, as_json, limit)


@inspect_app.command("events")
def inspect_events(
    db: DbOption = None,
    dsn: DsnOption = None,
    schema_name: SchemaOption = None,
    conversation: ConversationFilter = None,
    from_seq: Annotated[int, typer.Option("--from-seq", help="Start at this seq.", min=1)] = 1,
    as_json: JsonOption = False,
    limit: LimitOption = 1000,
    follow: Annotated[bool, typer.Option("--follow", "-f", help="Keep printing events as they are appended.")] = False,
) -> None:
    """The event ledger of --conversation (or of every conversation): each store transition, provider
    request, response and message body, and the events applications appended, in seq order."""
    with _reported():
        from .ledger import inspect_events_command

        inspect_events_command(
            db=db,
            dsn=dsn,
            schema=schema_name,
            conversation=conversation,
            from_seq=from_seq,
            limit=limit,
            as_json=as_json,
            follow=follow,
        )


# --------------------------------------------------------------------------- export / import / branch


@app.command("export")
def export(
    conversation: Annotated[str, typer.Option("--conversation", "-c", help="The conversation to export.")],
    out: Annotated[Path | None, typer.Option("--out", "-o", help="Write the archive here (default: stdout).")] = None,
    db: DbOption = None,
    dsn: DsnOption = None,
    schema_name: SchemaOption = None,
) -> None:
    """Write one conversation as a canonical archive: its ledger and runtime snapshot."""
    with _reported():
        from .ledger import export_command

        export_command(db=db, dsn=dsn, schema=schema_name, conversation=conversation, out=out)


@app.command("import")
def import_(
    archive: Annotated[Path, typer.Argument(help="An archive written by threadline export ('-': stdin).")],
    db: DbOption = None,
    dsn: DsnOption = None,
    schema_name: SchemaOption = None,
) -> None:
    """Restore an archived conversation under its own id, into a database that does not hold it."""
    with _reported():
        from .ledger import import_command

        import_command(db=db, dsn=dsn, schema=schema_name, archive=archive)


@app.command("branch")
def branch(
    request_key: Annotated[str, typer.Option("--request-key", help="Idempotency key of this branch request.")],
    destination: Annotated[str, typer.Option("--to", help="The new conversation id.")],
    source_conversation: Annotated[str | None, typer.Option("--from", help="The source conversation.")] = None,
    archive: Annotated[Path | None, typer.Option("--archive", help="Branch from an archive file instead.")] = None,
    through_run: Annotated[str | None, typer.Option("--through-run", help="Copy through this run's end.")] = None,
    artifact_authorization: Annotated[
        str | None,
        typer.Option(
            "--artifact-authorization",
            help="JSON: the fresh authorization a history with spills needs (a branch grants no source authority).",
        ),
    ] = None,
    db: DbOption = None,
    dsn: DsnOption = None,
    schema_name: SchemaOption = None,
    as_json: JsonOption = False,
) -> None:
    """Copy a settled prefix of a conversation (or archive) into a new conversation with new identities."""
    with _reported():
        from .ledger import branch_command

        branch_command(
            db=db,
            dsn=dsn,
            schema=schema_name,
            request_key=request_key,
            destination=destination,
            source_conversation=source_conversation,
            archive=archive,
            through_run=through_run,
            as_json=as_json,
            artifact_authorization=artifact_authorization,
        )
