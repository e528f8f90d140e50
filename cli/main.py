"""The `mlxcache` command: registers subcommands and maps domain errors to exit codes."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Sequence
from typing import Annotated, Any

import typer
from typer._click import exceptions as click_errors
from typer.core import TyperGroup, TyperOption

from mlxcache import __version__
from mlxcache.errors import MlxcacheError, UserInputError
from mlxcache_cli import bench, cache_cmd, models_cmd, regress_cmd, ui
from mlxcache_cli.chat_cmd import chat_cmd
from mlxcache_cli.generate import generate
from mlxcache_cli.json_cmd import json_cmd
from mlxcache_cli.tools_cmd import tools_cmd


class Group(TyperGroup):
    """The top-level group: a usage error is one `error: ...` line (exit 2), bare help exits 0.

    Typer's own handling draws a box around usage errors; scripts and terminals both read a
    single line better, and asking for help (`mlxcache`, `mlxcache cache`) is not an error.
    """

    def main(  # type: ignore[override]
        self,
        args: Sequence[str] | None = None,
        prog_name: str | None = None,
        complete_var: str | None = None,
        standalone_mode: bool = True,
        **extra: Any,
    ) -> Any:
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, False, **extra)
        try:
            code = super().main(args, prog_name, complete_var, False, **extra)
        except click_errors.NoArgsIsHelpError as exc:
            sys.stdout.write(exc.ctx.get_help() + "\n")
            sys.exit(0)
        except click_errors.ClickException as exc:
            ui.error(usage_message(exc))
            sys.exit(exc.exit_code)
        except click_errors.Abort:
            ui.error("aborted")
            sys.exit(1)
        sys.exit(code if isinstance(code, int) else 0)


_display_type = TyperOption.display_type_rich


def _flag_display_type(self: TyperOption, ctx: Any) -> str | None:
    """Flags take no value: show nothing where Typer would print `<bool>`."""
    return None if self.is_flag else _display_type(self, ctx)


TyperOption.display_type_rich = _flag_display_type  # type: ignore[method-assign]


def usage_message(exc: click_errors.ClickException) -> str:
    """Click's message on one line, pointing at the help of the command it came from."""
    message = " ".join(exc.format_message().split())
    ctx = getattr(exc, "ctx", None)
    if isinstance(exc, click_errors.UsageError) and ctx is not None:
        message += f" (see '{ctx.command_path} --help')"
    return message


app = typer.Typer(
    name="mlxcache",
    cls=Group,
    help="Local LLM inference that resumes from cached prompt prefixes.",
    epilog="Examples:  mlxcache generate 'Why is the sky blue?'  ·  mlxcache chat  ·  "
    "mlxcache <command> -h",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)
_state = {"debug": False}


def _version(value: bool) -> None:
    if value:
        sys.stdout.write(f"mlxcache {__version__}\n")
        raise typer.Exit()


@app.callback()
def main(
    debug: Annotated[bool, typer.Option("--debug", help="Show tracebacks on errors.")] = False,
    version: Annotated[
        bool,
        typer.Option(
            "--version", "-V", callback=_version, is_eager=True, help="Print the version."
        ),
    ] = False,
) -> None:
    """Local LLM inference that resumes from cached prompt prefixes."""
    _state["debug"] = debug


def exit_code(exc: MlxcacheError) -> int:
    """2 for a request that is wrong as given, 1 for a failure while serving it."""
    return 2 if isinstance(exc, UserInputError) else 1


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
            raise typer.Exit(exit_code(exc)) from None
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
