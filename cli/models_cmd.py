"""`mlxcache models ls | info | rm | default`: converted models, what a model spec resolves
to, and the model used when none is given."""

from __future__ import annotations

import time
from typing import Annotated, Any

import typer

from mlxcache.errors import UserInputError
from mlxcache_cli import options as o
from mlxcache_cli import ui


def ls(cache_dir: o.CacheDir = None, as_json: o.Json = False) -> None:
    """GGUF files converted into the cache directory, by name (what `models rm` takes);
    --json gives sizes in bytes, times as Unix seconds and each one's folder."""
    from rich.table import Table
    from rich.text import Text

    from mlxcache.model.loader import converted, default_spec

    rows = converted(cache_dir)
    if as_json:
        ui.out_json(rows)
        return
    table = Table("name", "size", "converted", "from")
    now = time.time()
    for r in rows:
        name = r["name"] if r["current"] else f"{r['name']} (older converter: unused)"
        table.add_row(
            Text(name, overflow="fold"),
            ui.human_bytes(r["bytes"]),
            ui.age(now - r["created"]) + " ago",
            Text(r["gguf"] or "?", overflow="fold"),  # a path is never cut short
        )
    ui.out_table(table)
    total = ui.human_bytes(sum(r["bytes"] for r in rows))
    ui.out_text(f"{len(rows)} converted, {total} · default model: {default_spec()}\n")


def rm(
    name: Annotated[
        str,
        typer.Argument(
            metavar="NAME",
            help="A name from `mlxcache models ls`, or a GGUF file (all of its conversions).",
        ),
    ],
    cache_dir: o.CacheDir = None,
    as_json: o.Json = False,
) -> None:
    """Delete converted models from the cache directory (a model used again is converted
    again; prompts cached for it stay in the disk tier: see `mlxcache cache prune`)."""
    from mlxcache.model.loader import remove_converted

    removed = remove_converted(name, cache_dir)
    if as_json:
        ui.out_json(removed)
        return
    for row in removed:
        ui.out_text(f"removed {row['name']} ({ui.human_bytes(row['bytes'])})\n")


def default(
    model: Annotated[
        str | None,
        typer.Argument(
            metavar="MODEL",
            help="A .gguf file, an mlx-lm folder, a Hub id or smollm2-135m.",
        ),
    ] = None,
    reset: Annotated[
        bool, typer.Option("--reset", help="Go back to the embedded smollm2-135m.")
    ] = False,
) -> None:
    """Show the model commands use without -m; with MODEL, make it that model (a file or
    folder is kept by its absolute path)."""
    from mlxcache.model.loader import default_spec, set_default

    if model is not None and reset:
        raise UserInputError("give MODEL or --reset, not both")
    if model is None and not reset:
        ui.out_text(default_spec() + "\n")
        return
    spec = set_default(model)
    ui.out_text(f"default model: {spec}\n")


def info(
    model: o.Model = None,
    adapter: o.AdapterOpt = None,
    chat_template: o.ChatTemplate = None,
    chat_template_args: o.ChatTemplateArgs = None,
    cache_dir: o.CacheDir = None,
    as_json: o.Json = False,
) -> None:
    """Load the model given with -m (default: `models default`; a GGUF is converted once)
    and show its name, key, context length, quantization, and whether this device keeps a
    reply's decode KV and decodes requests as one batch (measured once)."""
    from rich.table import Table

    from mlxcache.config import CacheConfig
    from mlxcache.model import load
    from mlxcache.model.loader import default_spec, describe
    from mlxcache.runtime import measured

    with ui.progress_bar() as update:
        loaded = load(
            model or default_spec(),
            cache_root=cache_dir,
            progress=update,
            adapter=adapter,
            chat_template=chat_template,
            chat_template_args=chat_template_args,
        )
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
        table.add_row(key, quantization(value) if key == "quantization" else shown(value))
    ui.out_table(table)


def shown(value: Any) -> str:
    """A summary's value in the table: a mapping as `k v, k v` (the adapter's path, type,
    digest), nothing as `none`."""
    if isinstance(value, dict):
        return ", ".join(f"{k} {v}" for k, v in value.items()) or "none"
    return "none" if value is None else str(value)


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


def ps(
    server: Annotated[
        str | None,
        typer.Option(
            "--server",
            envvar="MLXCACHE_SERVER",
            metavar="URL",
            help="The running `mlxcache serve` to ask (e.g. http://127.0.0.1:8080).",
        ),
    ] = None,
    as_json: o.Json = False,
) -> None:
    """The models a running server serves: which are loaded, their memory and idle time."""
    from rich.table import Table

    from mlxcache_cli.remote import client

    if server is None:
        raise UserInputError("ps asks a running server: give --server URL (or $MLXCACHE_SERVER)")
    with client(server) as remote:
        doc = remote.get("/v1/ps")
    rows = doc.get("models") if isinstance(doc, dict) else None
    if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
        raise UserInputError(f"the server at {server} does not list its models (/v1/ps)")
    if as_json:
        ui.out_json(doc)
        return
    table = Table("NAME", "LOADED", "SIZE", "IDLE", "LOADS", "ALIASES")
    for row in rows:
        size = row.get("size_bytes")
        idle = row.get("idle_s")
        name = str(row.get("name")) + (" (default)" if row.get("default") else "")
        table.add_row(
            name,
            "failed" if row.get("error") else ("yes" if row.get("loaded") else "no"),
            ui.human_bytes(size) if isinstance(size, int) else "-",
            f"{idle:.0f} s" if isinstance(idle, int | float) else "-",
            str(row.get("loads", "")),
            ", ".join(str(a) for a in row.get("aliases") or []),
        )
    ui.out_table(table)
    limit = doc.get("mem_limit_bytes")
    held = doc.get("resident_bytes")
    if isinstance(held, int):
        budget = f" of {ui.human_bytes(limit)}" if isinstance(limit, int) else ""
        ui.info(f"resident: {ui.human_bytes(held)}{budget}")
