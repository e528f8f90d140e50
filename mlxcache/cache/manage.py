"""Managing the disk tier without loading a model: report, list, clear, prune."""

from __future__ import annotations

import os
from typing import Any

from mlxcache.cache.disk import DiskEntry, DiskTier
from mlxcache.cache.index import Entry, PromptIndex
from mlxcache.paths import kv_dir


def _open(directory: str | os.PathLike[str] | None) -> DiskTier:
    return DiskTier(kv_dir(directory))


def report(directory: str | os.PathLike[str] | None = None, check: bool = False) -> dict[str, Any]:
    """Entries, bytes and namespaces of the disk tier; with `check`, verify every file."""
    disk = _open(directory)
    try:
        rows = disk.all_entries()
        n, nbytes = disk.usage()
        out: dict[str, Any] = {
            "directory": str(disk.root),
            "entries": n,
            "bytes": nbytes,
            "namespaces": len({r.ns for r in rows}),
            "tokens": sum(len(r.tokens) for r in rows),
        }
        if check:
            out["problems"] = disk.verify()
        return out
    finally:
        disk.close()


def entries(directory: str | os.PathLike[str] | None = None) -> list[dict[str, Any]]:
    """One dict per disk entry, least recently used first within each namespace."""
    disk = _open(directory)
    try:
        return [
            {
                "id": r.id,
                "namespace": r.ns[:12],
                "tokens": len(r.tokens),
                "trimmable": r.trimmable,
                "bytes": r.nbytes,
                "created_ns": r.created_ns,
                "used_ns": r.used_ns,
            }
            for r in disk.all_entries()
        ]
    finally:
        disk.close()


def clear(directory: str | os.PathLike[str] | None = None) -> int:
    """Delete every entry and file; returns how many entries went."""
    disk = _open(directory)
    try:
        return disk.clear()
    finally:
        disk.close()


def prune(max_bytes: int, directory: str | os.PathLike[str] | None = None) -> int:
    """Evict until the disk tier is under `max_bytes`; returns how many entries went.

    Within a model (namespace) the index's victim order decides; across models, the victim
    whose entry was used longest ago (wall clock: processes share no logical clock).
    """
    disk = _open(directory)
    removed = 0
    try:
        indexes: dict[str, tuple[PromptIndex, dict[Entry, DiskEntry]]] = {}  # per namespace
        for row in disk.all_entries():  # oldest use first: each index's clock follows it
            index, rows = indexes.setdefault(row.ns, (PromptIndex(block_size=1), {}))
            rows[index.add(row.tokens, trimmable=row.trimmable, nbytes=row.nbytes)] = row
        while disk.usage()[1] > max_bytes:
            victims = [(idx, rows, v) for idx, rows in indexes.values() if (v := idx.victim())]
            if not victims:
                break
            index, rows, victim = min(victims, key=lambda c: (c[1][c[2]].used_ns, c[1][c[2]].id))
            row = rows.pop(victim)
            index.remove(victim)
            disk.remove_entry(row.id)
            removed += 1
        return removed
    finally:
        disk.close()
