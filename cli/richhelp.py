"""Typer's Rich help renderer without the two Rich modules it imports and never uses here.

`typer.rich_utils`, imported when help is drawn, imports rich.markdown (markdown-it and
pygments, ~0.1 s of `mlxcache --help`) for help written in Markdown (`rich_markup_mode=
"markdown"`; ours is "rich") and rich.traceback (attrs) for pretty exceptions (disabled).
While it is imported, those two names are stand-ins: classes that import the real ones on
first use, so a Typer that does use them still works, only later. Every other import is
left alone.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import sys
import types
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

RENDERER = "typer.rich_utils"
DEFERRED = {"rich.markdown": "Markdown", "rich.traceback": "Traceback"}
"""Module -> the one name the renderer imports from it."""


class _Later(type):
    """A stand-in class: building one, or reading an attribute, imports the real class."""

    _module: str

    def _real(cls) -> Any:
        return getattr(importlib.import_module(cls._module), cls.__name__)

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        return cls._real()(*args, **kwargs)

    def __getattr__(cls, name: str) -> Any:
        return getattr(cls._real(), name)


@contextmanager
def _stand_ins() -> Iterator[None]:
    """The DEFERRED modules not imported yet, as stand-ins in sys.modules meanwhile."""
    placed = {}
    for module, name in DEFERRED.items():
        if module not in sys.modules:
            stand_in = types.ModuleType(module)
            setattr(stand_in, name, _Later(name, (), {"_module": module}))
            placed[module] = sys.modules[module] = stand_in
    try:
        yield
    finally:
        for module, stand_in in placed.items():
            if sys.modules.get(module) is stand_in:
                del sys.modules[module]  # the next import of it is the real one


class _Finder:
    """A meta path finder: finds the renderer as Python would, and runs its module among
    the stand-ins."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: types.ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != RENDERER:
            return None
        sys.meta_path.remove(self)  # imported once
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module: types.ModuleType) -> None:
            with _stand_ins():
                run(module)

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def install() -> None:
    """Defer the renderer's unused imports (once, before the app runs; nothing to do when
    it is imported already)."""
    if RENDERER not in sys.modules and not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
