"""The Typer application behind ``threadline``.

Every command body runs inside :func:`_reported`: a :class:`~threadline.errors.ThreadlineError` becomes one
line ``error: <message>`` on stderr and exit status 2, never a traceback.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated

import typer

from ..errors import ThreadlineError

EXIT_ERROR = 2
"""Exit status for a failure threadline reports (an unreadable database, an unwritable directory…)."""

app = typer.Typer(
    name="threadline",
    help="Durable tool-using language-model conversations on SQLite or PostgreSQL.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_show_locals=False,
)


def _fail(message: str, status: int = EXIT_ERROR) -> typer.Exit:
    one_line = " ".join(str(message).split()) or "unknown error"
    typer.echo(f"error: {one_line}", err=True)
    return typer.Exit(status)


@contextmanager
def _reported() -> Iterator[None]:
    """Turn threadline's typed errors into one ``error:`` line and exit status 2."""
    try:
        yield
    except ThreadlineError as error:
        raise _fail(str(error) or type(error).__name__) from None


@app.callback()
def _root() -> None:
    """Durable tool-using language-model conversations on SQLite or PostgreSQL."""


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


@app.command()
def demo(
    db: Annotated[
        Path,
        typer.Option("--db", help="SQLite database file to use (created if missing).", dir_okay=False),
    ] = Path("threadline.db"),
    pace: Annotated[
        float,
        typer.Option("--pace", help="Seconds between simulated tokens.", min=0.0, max=1.0, hidden=True),
    ] = 0.03,
) -> None:
    """Show the durable store at work on a real SQLite file (the store driven directly; no model yet)."""
    with _reported():
        import asyncio

        from rich.console import Console

        from .demo import DemoCheckFailed, run_demo

        try:
            asyncio.run(run_demo(Console(highlight=False), db, pace=pace))
        except DemoCheckFailed as error:
            raise _fail(f"demo check failed: {error}", status=1) from None
