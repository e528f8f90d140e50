"""The `mlxcache` command: registers subcommands and maps domain errors to exit codes."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Annotated, Any

import typer

from mlxcache.errors import MlxcacheError
from mlxcache_cli import ui
from mlxcache_cli.generate import generate

app = typer.Typer(
    name="mlxcache",
    help="Local LLM inference that resumes from cached prompt prefixes.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
_state = {"debug": False}


@app.callback()
def main(
    debug: Annotated[bool, typer.Option("--debug", help="Show tracebacks on errors.")] = False,
) -> None:
    """Local LLM inference that resumes from cached prompt prefixes."""
    _state["debug"] = debug


def command(fn: Callable[..., None], name: str | None = None) -> None:
    """Register `fn`, turning domain errors into one red line and an exit code."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> None:
        try:
            fn(*args, **kwargs)
        except MlxcacheError as exc:
            if _state["debug"]:
                raise
            ui.error(str(exc))
            raise typer.Exit(exc.exit_code) from None
        except KeyboardInterrupt:
            ui.error("interrupted")
            raise typer.Exit(130) from None

    app.command(name)(wrapper)


command(generate)
