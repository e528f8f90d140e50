"""Typer's option coercion without pydantic for values that need no conversion.

Typer (0.2x) checks every option value with a pydantic TypeAdapter, built on first use:
importing pydantic takes ~0.3 s, more than the rest of `mlxcache cache ls`. A value that
already has its type (a default), a string for a `str` option, a string for a plain
`Path` option and a plain decimal number for an `int` or `float` option without bounds
come out of that check as `Path(value)`, `int(value)`, `float(value)`, so they skip it
here; anything else (bounded numbers, lists, bad values and their messages) still goes
through Typer's own coercion, built only then.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from typer import core as typer_core

try:  # Typer's internals: present in the versions that coerce through pydantic
    from typer._coercion import RuntimeParam, TypeDescriptor, build_runtime_param
    from typer._param_types import coerce_cli_path
except ImportError:  # an older Typer (click types, no pydantic): nothing to speed up
    RuntimeParam = None  # type: ignore[assignment,misc]

# What pydantic reads the same as int() / float() (ASCII digits only: int() also takes other
# scripts' digits, and underscores, which pydantic refuses).
_NUMBERS = {
    int: re.compile(r"[+-]?[0-9]+"),
    float: re.compile(r"[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?"),
}

if RuntimeParam is not None:

    @dataclass(frozen=True)
    class _Plain(RuntimeParam):
        """Values that already have the option's type pass; the rest goes to Typer."""

        descriptor: TypeDescriptor | None = None

        def _coerce_value(self, value: Any, param: Any, ctx: Any) -> Any:
            kind, info = self.annotation, self.parameter_info
            assert self.descriptor is not None
            if type(value) is kind and not self.descriptor.is_ranged:
                return value
            if kind is str and isinstance(value, str):
                return value
            number = _NUMBERS.get(kind)
            ranged = self.descriptor.is_ranged
            if number and isinstance(value, str) and number.fullmatch(value) and not ranged:
                return kind(value)
            if kind is Path and isinstance(value, str) and info.path_type is None:
                # Typer's own path checks (exists, readable, ...) on what pydantic makes
                # of a string: Path(value).
                return coerce_cli_path(Path(value), info, path_type=Path, param=param, ctx=ctx)
            if (
                kind == list[str]
                and isinstance(value, list | tuple)
                and all(isinstance(v, str) for v in value)
            ):
                return list(value)
            typer_param = build_runtime_param(self.descriptor)  # built when needed only
            return typer_param._coerce_value(value, param=param, ctx=ctx)

    def _runtime_param(self: Any) -> Any:
        if self._runtime_param is None:
            desc = self.type_descriptor
            plain = desc.file_annotation is None and desc.parameter_info.parser is None
            self._runtime_param = (
                _Plain(desc.parameter_info, desc.annotation, desc)
                if plain
                else build_runtime_param(desc)
            )
        return self._runtime_param


def install() -> None:
    """Use the fast path for every Typer parameter (once, before the app runs)."""
    if RuntimeParam is not None and hasattr(typer_core._TyperParameter, "get_runtime_param"):
        typer_core._TyperParameter.get_runtime_param = _runtime_param  # type: ignore[method-assign]
