"""The `mlxcache` command: registers subcommands and maps domain errors to exit codes."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Sequence
from typing import Annotated, Any

import typer
from typer._click import exceptions as click_errors
from typer.core import TyperArgument, TyperGroup, TyperOption

from mlxcache import __version__
from mlxcache.errors import MlxcacheError, UserInputError
from mlxcache.launch import following
from mlxcache_cli import bench, cache_cmd, coerce, lazycmd, models_cmd, regress_cmd, richhelp, ui
from mlxcache_cli.chat_cmd import chat_cmd
from mlxcache_cli.generate import generate
from mlxcache_cli.json_cmd import json_cmd
from mlxcache_cli.options import check_given, run_options
from mlxcache_cli.serve_cmd import serve_cmd
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
        except typer.Abort:
            ui.error("aborted")
            sys.exit(1)
        sys.exit(code if isinstance(code, int) else 0)


_display_type = TyperOption.display_type_rich


def _flag_display_type(self: TyperOption, ctx: Any) -> str | None:
    """Flags take no value: show nothing where Typer would print `<bool>`."""
    return None if self.is_flag else _display_type(self, ctx)


def _argument_usage_name(self: TyperArgument) -> str:
    """An argument in the usage line as click and every other command show one: SUITE when
    required (Typer draws {SUITE}), [PROMPT] when optional."""
    name = self.display_name_raw if self.required else f"[{self.display_name_raw}]"
    return name + ("..." if self.nargs != 1 else "")


TyperOption.display_type_rich = _flag_display_type  # type: ignore[method-assign]
# An argument's name is its metavar (SUITE, PROMPT): a type beside it (<path>) adds nothing.
TyperArgument.display_type_rich = lambda self, ctx: None  # type: ignore[method-assign]
TyperArgument._usage_display_name = _argument_usage_name  # type: ignore[method-assign]
coerce.install()
richhelp.install()
lazycmd.install()


MLX_LM_FLAGS = {
    "--prompt": "the prompt is the argument ('-' reads stdin) or --prompt-file",
    "--system-prompt": "--system",
    "--num-draft-tokens": "--draft-tokens",
    "--ignore-chat-template": "--raw",
    "--max-kv-size": "no cap is needed: the prompt cache keeps KV in --cache-mem",
    "--temperature": "--temp",
}
"""mlx-lm's flags that users bring along, and what says the same here."""


def usage_message(exc: click_errors.ClickException) -> str:
    """Click's message on one line, pointing at the help of the command it came from (and,
    for an mlx-lm flag, at ours)."""
    message = " ".join(exc.format_message().split())
    if isinstance(exc, click_errors.NoSuchOption) and exc.option_name in MLX_LM_FLAGS:
        hint = MLX_LM_FLAGS[exc.option_name]
        message = (
            f"No such option: {exc.option_name} ({'use ' if hint.startswith('--') else ''}{hint})"
        )
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


def command(
    fn: Callable[..., None], name: str | None = None, app: typer.Typer = app, examples: str = ""
) -> None:
    """Register `fn` with its examples, turning domain errors into one red line and an exit
    code. On a rank other than 0 of an `mlx.launch` run, a model-running command's body is
    rank 0's alone: this rank opens the same engine and makes rank 0's engine calls."""
    runs_model = getattr(fn, "runs_model", False)

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> None:
        try:
            check_given(kwargs)
            if runs_model and following():
                from mlxcache.distributed import follow

                follow(run_options(kwargs).engine())
            else:
                fn(*args, **kwargs)
        except MlxcacheError as exc:
            if _state["debug"]:
                raise
            ui.error(exc)
            raise typer.Exit(exit_code(exc)) from None
        except KeyboardInterrupt:
            ui.end_line()
            ui.error("interrupted")
            raise typer.Exit(130) from None

    epilog = "Examples:\n" + "\n".join(f"  {line}" for line in examples.strip().splitlines())
    app.command(name, epilog=epilog if examples else None)(wrapper)


command(
    generate,
    examples="""
mlxcache generate "Why is the sky blue?"
mlxcache generate -s @examples/rules.txt -n 512 -f examples/bio.txt
git diff | mlxcache generate --raw --stop "\\n\\n" -
mlxcache generate --json --temp 0.7 --top-k 40 --seed 1 "A haiku about caches"
""",
)
command(
    chat_cmd,
    "chat",
    examples="""
mlxcache chat -s "Answer in one sentence."
mlxcache chat --list
mlxcache chat --resume work -t 0.7
printf 'hi\\nand again\\n' | mlxcache chat
""",
)
command(
    json_cmd,
    "json",
    examples="""
mlxcache json --schema examples/person.json "Ada Lovelace, born 1815 in London"
mlxcache json -f examples/bio.txt   # no --schema: any JSON object
mlxcache json --schema examples/person.json --input examples/people.jsonl -o out.jsonl
""",
)
command(
    tools_cmd,
    "tools",
    examples="""
mlxcache tools --tools examples/tools.json "What is the weather in Paris?"
mlxcache tools --tools examples/tools.json --json "Weather in Paris?" | jq .messages > conv.json
mlxcache tools --tools examples/tools.json --messages conv.json --tool-result get_weather='{"c": 21}'
""",
)
command(
    serve_cmd,
    "serve",
    examples="mlxcache serve\nmlxcache serve --port 9000 --api-key secret -m ./model.gguf\n"
    "mlxcache serve -m smollm2-135m -m gemma3-270m --mem-limit 1G --keep-alive 10m\n"
    "mlxcache serve --models models.yaml --load-all",
)

cache_app = typer.Typer(help="Show and manage the prompt cache's disk tier.", no_args_is_help=True)
command(
    cache_cmd.stats, app=cache_app, examples="mlxcache cache stats\nmlxcache cache stats --check"
)
command(cache_cmd.ls, app=cache_app, examples="mlxcache cache ls\nmlxcache cache ls --json | jq .")
command(
    cache_cmd.clear,
    app=cache_app,
    examples="mlxcache cache clear\nmlxcache cache clear --models --yes",
)
command(cache_cmd.prune, app=cache_app, examples="mlxcache cache prune --max-size 5G")
app.add_typer(cache_app, name="cache")

bench_app = typer.Typer(
    help="Benchmarks: one JSON line each, against a baseline run beside.", no_args_is_help=True
)
command(bench.decode, app=bench_app, examples="mlxcache bench decode --tokens 64 --rounds 5")
command(bench.adapter, app=bench_app, examples="mlxcache bench adapter --adapter ./adapters")
command(bench.index, app=bench_app, examples="mlxcache bench index --slots 500")
command(bench.resume, app=bench_app, examples="mlxcache bench resume --turns 6")
command(bench.json, app=bench_app, examples="mlxcache bench json --lines 12")
command(bench.chunks, app=bench_app, examples="mlxcache bench chunks --tokens 256")
command(bench.chat, app=bench_app, examples="mlxcache bench chat --max-tokens 80")
command(bench.schemas, app=bench_app, examples="mlxcache bench schemas schemas/ --generate 12")
command(bench.serve, app=bench_app, examples="mlxcache bench serve --turns 2 --tokens 30")
command(bench.reuse, app=bench_app, examples="mlxcache bench reuse --block-size 16")
command(bench.startup, app=bench_app, examples="mlxcache bench startup --rounds 5")
command(bench.distributed, app=bench_app, examples="mlxcache bench distributed --ranks 1,3")
command(bench.spec, app=bench_app, examples="mlxcache bench spec --lines 30 --tokens 80")
command(bench.agent, app=bench_app, examples="mlxcache bench agent --agents 2 --turns 4")
command(bench.models, app=bench_app, examples="mlxcache bench models --minutes 3")
command(
    bench.memory,
    app=bench_app,
    examples="mlxcache bench memory --minutes 5\nmlxcache bench memory --hours 4 --only soak",
)
app.add_typer(bench_app, name="bench")

models_app = typer.Typer(help="Converted models and what a model spec loads.", no_args_is_help=True)
command(models_cmd.ls, app=models_app, examples="mlxcache models ls")
command(
    models_cmd.info,
    app=models_app,
    examples="mlxcache models info\nmlxcache models info -m ./llama-3.2-1b.Q4_0.gguf --json",
)
command(
    models_cmd.rm,
    app=models_app,
    examples="mlxcache models rm SmolLM2-135M-Instruct.Q4_1-1dff70ef9e211d0a-v2\n"
    "mlxcache models rm ./llama-3.2-1b.Q4_0.gguf",
)
command(
    models_cmd.default,
    app=models_app,
    examples="mlxcache models default\nmlxcache models default ./llama-3.2-1b.Q4_0.gguf\n"
    "mlxcache models default --reset",
)
command(
    models_cmd.ps,
    app=models_app,
    examples="mlxcache models ps --server http://127.0.0.1:8080",
)
app.add_typer(models_app, name="models")
command(models_cmd.ps, "ps", examples="mlxcache ps --server http://127.0.0.1:8080")

regress_app = typer.Typer(
    help="Byte-identical regression runs against a golden file.", no_args_is_help=True
)
command(
    regress_cmd.record,
    app=regress_app,
    examples="mlxcache regress record examples/quick.yaml -o quick.golden.json",
)
command(
    regress_cmd.check,
    app=regress_app,
    examples="mlxcache regress check examples/quick.yaml quick.golden.json\n"
    "mlxcache regress check examples/quick.yaml quick.golden.json --variants cold,warm --json",
)
app.add_typer(regress_app, name="regress")
