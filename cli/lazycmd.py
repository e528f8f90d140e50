"""Commands built when used, not when the app is: `mlxcache --help` and one-shot commands
start faster.

Typer turns every registered command into a Click command whenever the app runs: it reads
each one's signature and evaluates its annotations (~60 options, 29 commands), although a
run uses one command and the top-level help only names them. Here a command is a stand-in
until something reads more of it than the help's list does (its name, help, panel, and
whether it is hidden or deprecated); it then builds the real command, as Typer would, and
passes everything on to it.
"""

from __future__ import annotations

import inspect
from typing import Any

import typer.main
from typer.models import CommandInfo

_build = typer.main.get_command_from_info


class Deferred:
    """A command as Typer would build it from `info`, built on first use."""

    def __init__(self, command_info: CommandInfo, **settings: Any) -> None:
        info = command_info  # Typer passes it by name
        assert info.callback is not None, "A command must have a callback function"
        self.name = info.name or typer.main.get_command_name(info.callback.__name__)
        self.help = (
            inspect.getdoc(info.callback) if info.help is None else inspect.cleandoc(info.help)
        )
        self.short_help = info.short_help
        self.hidden = info.hidden
        self.deprecated = info.deprecated
        self.rich_help_panel = info.rich_help_panel
        self._info, self._settings = info, settings
        self._real: Any = None

    def __getattr__(self, name: str) -> Any:  # only what __init__ did not set
        if self._real is None:
            self._real = _build(command_info=self._info, **self._settings)
        return getattr(self._real, name)


def install() -> None:
    """Make Typer build each command as a `Deferred` (once, at import of `main`)."""
    typer.main.get_command_from_info = Deferred  # type: ignore[assignment]
