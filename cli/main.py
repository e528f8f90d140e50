"""The `mlxcache` command: registers subcommands and maps domain errors to exit codes."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Annotated, Any

import typer

from mlxcache.errors import MlxcacheError
from mlxcache_cli import bench, cache_cmd, models_cmd, regress_cmd, ui
from mlxcache_cli.chat_cmd import chat_cmd
from mlxcache_cli.generate import generate
from mlxcache_cli.json_cmd import json_cmd
from mlxcache_cli.tools_cmd import tools_cmd

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


def command(fn: Callable[..., None], name: str | None = None, app: typer.Typer = app) -> None:
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
command(chat_cmd, "chat")

cache_app = typer.Typer(help="Show and manage the prompt cache's disk tier.", no_args_is_help=True)
for fn in (cache_cmd.stats, cache_cmd.ls, cache_cmd.clear, cache_cmd.prune):
    command(fn, app=cache_app)
app.add_typer(cache_app, name="cache")

bench_app = typer.Typer(
    help="Benchmarks: one JSON line each, against a baseline run beside.", no_args_is_help=True
)
for fn in (bench.decode, bench.index, bench.resume, bench.json):
    command(fn, app=bench_app)
app.add_typer(bench_app, name="bench")

models_app = typer.Typer(help="Converted models and what a model spec loads.", no_args_is_help=True)
for fn in (models_cmd.ls, models_cmd.info):
    command(fn, app=models_app)
app.add_typer(models_app, name="models")

regress_app = typer.Typer(
    help="Byte-identical regression runs against a golden file.", no_args_is_help=True
)
for fn in (regress_cmd.record, regress_cmd.check):
    command(fn, app=regress_app)
app.add_typer(regress_app, name="regress")
command(json_cmd, "json")
command(tools_cmd, "tools")
