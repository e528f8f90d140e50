"""Managing the disk tier without loading a model: report, list, clear, prune."""

from __future__ import annotations

import os
from typing import Any

from mlxcache.cache.disk import DiskTier
from mlxcache.cache.index import Entry, PromptIndex
from mlxcache.paths import cache_dir
from mlxcache.runtime import KV_DIR


def _open(directory: str | os.PathLike[str] | None) -> DiskTier:
    return DiskTier(cache_dir(directory) / KV_DIR)


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
    """Evict by the index's victim order (per namespace, by last use) until under `max_bytes`."""
    disk = _open(directory)
    removed = 0
    try:
        indexes: dict[str, tuple[PromptIndex, dict[Entry, int]]] = {}
        for row in disk.all_entries():  # ordered by last use: the logical clock follows it
            index, ids = indexes.setdefault(row.ns, (PromptIndex(block_size=1), {}))
            ids[index.add(row.tokens, trimmable=row.trimmable, nbytes=row.nbytes)] = row.id
        while disk.usage()[1] > max_bytes:
            candidates = [(ns, idx.victim()) for ns, (idx, _) in indexes.items()]
            live = [(ns, v) for ns, v in candidates if v is not None]
            if not live:
                break
            ns, victim = min(live, key=lambda c: (c[1].last_used, c[1].born))
            index, ids = indexes[ns]
            index.remove(victim)
            disk.remove_entry(ids.pop(victim))
            removed += 1
        return removed
    finally:
        disk.close()
