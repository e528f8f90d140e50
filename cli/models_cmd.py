"""`mlxcache models ls | info`: converted models and what a model spec resolves to."""

from __future__ import annotations

from rich.table import Table

from mlxcache.model import load
from mlxcache.model.loader import converted, describe
from mlxcache_cli import options as o
from mlxcache_cli import ui


def ls(cache_dir: o.CacheDir = None, as_json: o.Json = False) -> None:
    """GGUF files converted into the cache directory."""
    rows = converted(cache_dir)
    if as_json:
        ui.out_json(rows)
        return
    table = Table("folder", "from", "bytes")
    for r in rows:
        table.add_row(r["folder"], r["gguf"] or "?", str(r["bytes"]))
    ui.out_table(table)


def info(model: o.Model = None, cache_dir: o.CacheDir = None, as_json: o.Json = False) -> None:
    """Load MODEL (converting a GGUF once) and show its key, context and quantization."""
    with ui.progress_bar() as update:
        summary = describe(load(model, cache_root=cache_dir, progress=update))
    if as_json:
        ui.out_json(summary)
        return
    table = Table("", "", show_header=False, box=None)
    for key, value in summary.items():
        table.add_row(key, str(value))
    ui.out_table(table)
