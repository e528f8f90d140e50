"""`mlxcache models ls | info`: converted models and what a model spec resolves to."""

from __future__ import annotations

from typing import Any

from rich.table import Table

from mlxcache_cli import options as o
from mlxcache_cli import ui


def ls(cache_dir: o.CacheDir = None, as_json: o.Json = False) -> None:
    """GGUF files converted into the cache directory (sizes in bytes with --json)."""
    from mlxcache.model.loader import converted

    rows = converted(cache_dir)
    if as_json:
        ui.out_json(rows)
        return
    table = Table("folder", "from", "size")
    for r in rows:
        table.add_row(r["folder"], r["gguf"] or "?", ui.human_bytes(r["bytes"]))
    ui.out_table(table)


def info(model: o.Model = None, cache_dir: o.CacheDir = None, as_json: o.Json = False) -> None:
    """Load the model given with -m (default: the embedded SmolLM2; a GGUF is converted once)
    and show its name, key, context length, quantization, and whether this device keeps a
    reply's decode KV and decodes requests as one batch (measured once)."""
    from mlxcache.config import CacheConfig
    from mlxcache.model import load
    from mlxcache.model.loader import describe
    from mlxcache.runtime import measured

    with ui.progress_bar() as update:
        loaded = load(model, cache_root=cache_dir, progress=update)
    allowed = measured(loaded, CacheConfig(directory=cache_dir))
    summary = {
        **describe(loaded),
        # What this device computes exactly (measured once, for chat and serve).
        "decode_kv": "kept" if allowed["decode"] else "re-prefilled",
        "batched_decode": allowed["batch"],
    }
    if as_json:
        ui.out_json(summary)
        return
    table = Table("", "", show_header=False, box=None)
    for key, value in summary.items():
        table.add_row(key, quantization(value) if key == "quantization" else str(value))
    ui.out_table(table)


def quantization(value: Any) -> str:
    """mlx-lm's quantization settings as text: `4-bit, groups of 32` (none: `none`)."""
    if not isinstance(value, dict):
        return "none" if value is None else str(value)
    text = f"{value['bits']}-bit" if "bits" in value else ""
    if "group_size" in value:
        text += f", groups of {value['group_size']}"
    extra = {k: v for k, v in value.items() if k not in ("bits", "group_size")}
    text += "".join(f", {k} {v}" for k, v in extra.items())
    return text.lstrip(", ") or "none"
