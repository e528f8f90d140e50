"""The import graph: no cycle, and no layer imports one above it (function-level and
type-only imports count too: a lazy import is still a dependency, and a type named across
a cycle is a design that has not settled where the type lives)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {"mlxcache": ROOT / "mlxcache", "mlxcache_cli": ROOT / "cli"}

# module (prefix) -> modules (prefixes) it must never import
FORBIDDEN = {
    "mlxcache": ["mlxcache_cli", "typer", "rich"],
    "mlxcache.cache": [
        "mlxcache.engine",
        "mlxcache.modes",
        "mlxcache.server",
        "mlxcache.remote",
        "mlxcache.regress",
        "mlxcache.bench",
        "mlxcache.distributed",
        "mlxcache.runtime",
        "mlxcache.worker",
    ],
    "mlxcache.engine": [
        "mlxcache.distributed",
        "mlxcache.modes",
        "mlxcache.server",
        "mlxcache.remote",
        "mlxcache.runtime",
        "mlxcache.worker",
    ],
    "mlxcache.scheduler": ["mlxcache.engine", "mlxcache.cache", "mlx"],
    "mlxcache.server": ["mlxcache.remote", "mlxcache.regress", "mlxcache.bench"],
    "mlxcache.modes": ["mlxcache.server", "mlxcache.remote", "mlxcache.regress"],
}


def _modules() -> dict[str, Path]:
    found = {}
    for package, folder in PACKAGES.items():
        for file in folder.rglob("*.py"):
            parts = (package, *file.relative_to(folder).with_suffix("").parts)
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            found[name] = file
    return found


def _imports(name: str, file: Path, modules: set[str]) -> set[str]:
    """Every module `file` imports, at any depth, under `if TYPE_CHECKING` too. `from
    package import module` is an edge to the module alone (the package's `__init__` runs
    first for any of its modules: no dependency of this one)."""
    package = name if file.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(file.read_text())):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*up, *([node.module] if node.module else [])])
            named = {f"{base}.{alias.name}" for alias in node.names}
            out |= named
            if not named <= modules:
                out.add(base)
    return out


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, file, set(modules)) for name, file in modules.items()}


def _within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def test_no_layer_imports_one_above_it(graph: dict[str, set[str]]) -> None:
    wrong = [
        f"{module} imports {target}"
        for module, targets in graph.items()
        for layer, banned in FORBIDDEN.items()
        if _within(module, layer)
        for target in targets
        for ban in banned
        if _within(target, ban)
    ]
    assert wrong == []


def test_no_import_cycle(graph: dict[str, set[str]]) -> None:
    edges = {m: {t for t in targets if t in graph and t != m} for m, targets in graph.items()}
    cycles: list[list[str]] = []
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def walk(module: str) -> None:
        state[module] = 1
        path.append(module)
        for target in sorted(edges[module]):
            if state.get(target) == 1:
                cycles.append([*path[path.index(target) :], target])
            elif target not in state:
                walk(target)
        path.pop()
        state[module] = 2

    for module in sorted(edges):
        if module not in state:
            walk(module)
    assert cycles == []


def test_the_engine_stays_a_driver() -> None:
    """`Engine` drives lanes; what a lane does is `lanes.py`'s, whose turn it is the
    scheduler's. A class past 250 lines has taken some of their work back."""
    tree = ast.parse((ROOT / "mlxcache" / "engine.py").read_text())
    engine = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Engine")
    assert engine.end_lineno is not None
    assert engine.end_lineno - engine.lineno + 1 <= 250
