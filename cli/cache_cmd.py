"""`mlxcache cache stats | ls | clear | prune`: the disk tier, without loading a model."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated, Any

import typer

from mlxcache.config import parse_size
from mlxcache.errors import UserInputError
from mlxcache_cli import options as o
from mlxcache_cli import ui
from mlxcache_cli.remote import ServerUrl, client, refuse_in_process_only


def stats(
    cache_dir: o.CacheDir = None,
    check: Annotated[bool, typer.Option("--check", help="Verify every file's checksum.")] = False,
    as_json: o.Json = False,
    server: ServerUrl = None,
) -> None:
    """Entries, bytes and models in the disk cache; with --check, exit 1 on any problem.
    With --server: the running server's cache, its process's memory and budget."""
    from rich.table import Table

    from mlxcache.cache import manage

    if server is not None:
        refuse_in_process_only()
        info = _served(server)
    else:
        info = manage.report(cache_dir, check=check)
    if as_json:
        ui.out_json(info)
    else:
        table = Table("", "", show_header=False, box=None)
        for key, value in info.items():
            if isinstance(value, list):
                value = "\n".join(value) or "none"
            elif value is None:
                value = "none"
            elif isinstance(value, int) and (key == "bytes" or key.endswith("_bytes")):
                value = ui.human_bytes(value)
            table.add_row(key, str(value))
        ui.out_table(table)
    if info.get("problems"):
        ui.error(f"the check found {len(info['problems'])} problem(s), listed on stdout")
        raise typer.Exit(1)


def _served(url: str) -> dict[str, Any]:
    """The server's `/v1/cache` report."""
    with client(url) as server:
        return server.get("/v1/cache")


def ls(cache_dir: o.CacheDir = None, as_json: o.Json = False) -> None:
    """List disk cache entries by model, least recently used first; the prompt's end shown.

    An entry's size counts every block it resumes; entries that share a prefix share its
    blocks, so the sizes add up to more than the disk holds (the total under the table).
    --json gives times as Unix seconds, and each entry's id.
    """
    from rich.table import Table

    from mlxcache.cache import manage

    rows = manage.entries(cache_dir, preview_tokens=12)
    if as_json:
        ui.out_json(rows)
        return
    if not rows:
        ui.out_text("no cached entries\n")
        return
    table = Table("model", "block", "tokens", "size", "used", "prompt ends with")
    now = time.time()
    for r in rows:
        preview = "" if r["preview"] is None else "…" + ui.preview(r["preview"], 40)
        table.add_row(
            r["model"],
            str(r["block_size"] or "?"),
            str(r["tokens"]),
            ui.human_bytes(r["bytes"]),
            ui.age(now - r["used"]) + " ago",
            preview,
        )
    ui.out_table(table)
    total = ui.human_bytes(manage.report(cache_dir)["bytes"])
    ui.out_text(
        f"{ui.plural(len(rows), 'entry')}, {total} on disk (an entry's size counts every block it resumes; "
        "entries that share a prefix share its blocks)\n"
    )


def clear(
    cache_dir: o.CacheDir = None,
    models: Annotated[
        bool,
        typer.Option(
            "--models", help="Delete the converted models too (converted again when used)."
        ),
    ] = False,
    yes: Annotated[
        bool, typer.Option("--yes", "-y", help="Do not ask first (only a terminal is asked).")
    ] = False,
    as_json: o.Json = False,
) -> None:
    """Delete every cached prompt; converted models stay (but with --models). On a
    terminal, asks first."""
    from mlxcache.cache import manage
    from mlxcache.paths import cache_dir as directory
    from mlxcache.paths import kv_dir

    if not yes and ui.stdin_is_terminal():
        also = f" and every converted model in {directory(cache_dir) / 'models'}" if models else ""
        if not typer.confirm(f"Delete every cached prompt in {kv_dir(cache_dir)}{also}?", err=True):
            ui.info("nothing deleted")
            return
    done: dict[str, int] = manage.clear(cache_dir, on_warning=ui.warn)
    gone = _clear_models(cache_dir) if models else []
    if models:
        done.update(models_removed=len(gone), models_bytes_freed=sum(r["bytes"] for r in gone))
    if as_json:
        ui.out_json(done)
        return
    ui.out_text(
        f"removed {ui.plural(done['removed'], 'entry')} ({ui.human_bytes(done['bytes_freed'])} freed)\n"
    )
    if models:
        ui.out_text(
            f"removed {ui.plural(len(gone), 'converted model')} "
            f"({ui.human_bytes(done['models_bytes_freed'])} freed)\n"
        )


def _clear_models(cache_dir: Path | None) -> list[dict[str, Any]]:
    """Delete every converted model in the cache directory (`models rm`, each by name)."""
    from mlxcache.model.loader import converted, remove_converted

    return [row for r in converted(cache_dir) for row in remove_converted(r["name"], cache_dir)]


def prune(
    max_size: Annotated[
        str,
        typer.Option(
            "--max-size",
            metavar="SIZE",
            help="Evict until the cached blocks and checkpoints take at most SIZE, e.g. 5G "
            "(the index itself is not counted).",
        ),
    ],
    cache_dir: o.CacheDir = None,
    as_json: o.Json = False,
) -> None:
    """Evict least recently used entries until the disk tier fits --max-size."""
    from mlxcache.cache import manage

    try:
        limit = parse_size(max_size)
    except ValueError as exc:
        raise UserInputError(str(exc)) from exc
    done = manage.prune(limit, cache_dir)
    if as_json:
        ui.out_json(done)
        return
    ui.out_text(
        f"removed {ui.plural(done['removed'], 'entry')}: {ui.human_bytes(done['bytes_before'])} -> "
        f"{ui.human_bytes(done['bytes_after'])} of blocks and checkpoints "
        f"(limit {ui.human_bytes(limit)})\n"
    )
