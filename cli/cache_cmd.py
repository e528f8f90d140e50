"""`mlxcache cache stats | ls | clear | prune`: the disk tier, without loading a model."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.table import Table

from mlxcache.cache import manage
from mlxcache.config import parse_size
from mlxcache.errors import UserInputError
from mlxcache_cli import options as o
from mlxcache_cli import ui


def stats(
    cache_dir: o.CacheDir = None,
    check: Annotated[bool, typer.Option("--check", help="Verify every file's checksum.")] = False,
    as_json: o.Json = False,
) -> None:
    """Entries, bytes and models in the disk cache; with --check, exit 1 on any problem."""
    info = manage.report(cache_dir, check=check)
    if as_json:
        ui.out_json(info)
    else:
        table = Table("", "", show_header=False, box=None)
        for key, value in info.items():
            table.add_row(
                key, "\n".join(value) or "none" if isinstance(value, list) else str(value)
            )
        ui.out_table(table)
    if info.get("problems"):
        ui.error(f"the check found {len(info['problems'])} problem(s), listed on stdout")
        raise typer.Exit(1)


def ls(cache_dir: o.CacheDir = None, as_json: o.Json = False) -> None:
    """List disk cache entries, least recently used first."""
    rows = manage.entries(cache_dir)
    if as_json:
        ui.out_json(rows)
        return
    table = Table("id", "model", "tokens", "bytes", "trimmable")
    for r in rows:
        table.add_row(
            str(r["id"]), r["namespace"], str(r["tokens"]), str(r["bytes"]), str(r["trimmable"])
        )
    ui.out_table(table)


def clear(cache_dir: o.CacheDir = None, as_json: o.Json = False) -> None:
    """Delete every cached entry."""
    n = manage.clear(cache_dir, on_warning=ui.warn)
    ui.out_json({"removed": n}) if as_json else ui.out_text(f"removed {n} entries\n")


def prune(
    max_size: Annotated[
        str, typer.Option("--max-size", help="Evict until the disk tier fits, e.g. 5G.")
    ],
    cache_dir: o.CacheDir = None,
    as_json: o.Json = False,
) -> None:
    """Evict least useful entries until the disk tier fits --max-size."""
    try:
        limit = parse_size(max_size)
    except ValueError as exc:
        raise UserInputError(str(exc)) from exc
    n = manage.prune(limit, cache_dir)
    ui.out_json({"removed": n}) if as_json else ui.out_text(f"removed {n} entries\n")
