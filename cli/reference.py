"""The CLI reference as Markdown, rendered from the Typer app itself so that it cannot drift
from what `-h` prints: every command's usage, help, arguments, options and examples.

The docs site builds its reference page with it (docs/hooks.py); `python -m
mlxcache_cli.reference` prints it.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator

import typer.main
from typer._click import core as click
from typer.core import TyperGroup

from mlxcache_cli.main import app

INTRO = """# CLI reference

Generated from the command-line app itself when the site is built: each section is what
`mlxcache COMMAND -h` says, as a table. Exit codes: 0 success, 1 a failed generation or
regression, 2 bad input.
"""


def commands(
    command: click.Command, ctx: click.Context
) -> Iterator[tuple[click.Command, click.Context]]:
    """Every command and group under `command`, depth first, in the order `-h` lists them."""
    yield command, ctx
    if isinstance(command, TyperGroup):
        for name in command.list_commands(ctx):
            sub = command.get_command(ctx, name)
            if sub is not None and not sub.hidden:
                yield from commands(
                    sub, sub.make_context(name, [], parent=ctx, resilient_parsing=True)
                )


def _cell(text: str) -> str:
    """Text for one table cell: on one line, its pipes escaped."""
    return " ".join(text.split()).replace("|", "\\|")


def _params(command: click.Command, ctx: click.Context) -> list[str]:
    """Each argument and option as `-h` lists it: names and value, then help and default."""
    rows = []
    for param in [*command.params, command.get_help_option(ctx)]:
        record = param.get_help_record(ctx) if param is not None else None
        if record is not None:  # None: hidden
            names, help_text = record
            rows.append(f"| `{' '.join(names.split())}` | {_cell(help_text)} |")  # | in code stays
    return ["| argument or option | what it does |", "|---|---|", *rows]


def section(command: click.Command, ctx: click.Context) -> str:
    """One command's section: usage, help, its parameters, and its examples."""
    level = "#" * min(ctx.command_path.count(" ") + 2, 4)
    lines = [f"{level} `{ctx.command_path}`", "", command.help or "", ""]
    lines += ["```text", command.get_usage(ctx), "```", ""]
    if isinstance(command, TyperGroup):
        for name in command.list_commands(ctx):
            sub = command.get_command(ctx, name)
            if sub is not None and not sub.hidden:
                lines.append(f"- `{ctx.command_path} {name}`: {sub.get_short_help_str(200)}")
        lines.append("")
    lines += [*_params(command, ctx), ""]
    if command.epilog:
        lines += ["```text", command.epilog.strip(), "```", ""]
    return "\n".join(lines)


def render() -> str:
    """The whole reference, the top-level command first."""
    root = typer.main.get_command(app)
    ctx = root.make_context("mlxcache", [], resilient_parsing=True)
    return "\n".join([INTRO, *(section(cmd, sub) for cmd, sub in commands(root, ctx))])


if __name__ == "__main__":
    sys.stdout.write(render())
