"""The ``threadline`` command (Typer + Rich).

``main()`` is the console-script entry point. The Typer application lives in :mod:`threadline.cli.commands`
and is imported on first use, so importing this package stays cheap.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import typer

__all__ = ["app", "main"]


def main(argv: list[str] | None = None) -> Any:
    """Run the ``threadline`` command with ``argv`` (default: ``sys.argv[1:]``)."""
    from .commands import app

    return app(args=argv, prog_name="threadline")


def __getattr__(name: str) -> typer.Typer:
    if name == "app":
        from .commands import app

        return app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
