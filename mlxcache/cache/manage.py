"""Managing the disk tier without loading a model: report, list, clear, prune.

Looking (report, entries, prune) never creates the cache directory; a damaged index is
reported with its fix, and `clear` always gets the directory back to empty.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import stat
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mlxcache.cache.disk import INDEX, DiskEntry, DiskTier, index_error, remove_files, reset
from mlxcache.errors import CacheStoreError, CorruptIndexError, DiskFullError
from mlxcache.paths import kv_dir

if TYPE_CHECKING:
    from mlxcache.cache.index import Entry

Directory = str | os.PathLike[str] | None


@contextmanager
def _opened(directory: Directory) -> Iterator[DiskTier | None]:
    """The disk tier, or None when there is none yet; SQLite errors become domain errors.

    Raises:
        CorruptIndexError: the index is not a database or is damaged.
        CacheStoreError: it cannot be opened (permissions, locked).
    """
    root = kv_dir(directory)
    if not (root / INDEX).is_file():
        yield None
        return
    disk = DiskTier(root)
    try:
        yield disk
    except sqlite3.Error as exc:
        raise index_error(root, exc) from exc
    finally:
        disk.close()


def report(directory: Directory = None, check: bool = False) -> dict[str, Any]:
    """Entries, bytes, tokens and models of the disk tier; with `check`, verify every file.

    With `check`, a damaged index is listed under "problems" instead of raised.
    """
    try:
        with _opened(directory) as disk:
            return _report(disk, check) if disk else _empty(directory, check)
    except CorruptIndexError as exc:
        if not check:
            raise
        return {"directory": str(kv_dir(directory)), "problems": [str(exc)]}


def _empty(directory: Directory, check: bool) -> dict[str, Any]:
    out = {"directory": str(kv_dir(directory)), "entries": 0, "bytes": 0, "models": []}
    out |= {"tokens": 0}
    return {**out, "problems": []} if check else out


def _model_name(ns: str, names: dict[str, tuple[str, str, int]]) -> str:
    """A namespace's model name (a key prefix for entries of caches that named none)."""
    return names[ns][0] if ns in names else f"key {ns[:12]}"


def _report(disk: DiskTier, check: bool) -> dict[str, Any]:
    rows = disk.all_entries()
    names = disk.namespaces()
    n, nbytes = disk.usage()
    out: dict[str, Any] = {
        "directory": str(disk.root),
        "entries": n,
        "bytes": nbytes,
        "models": sorted({_model_name(r.ns, names) for r in rows}),
        "tokens": sum(r.n_tokens for r in rows),
    }
    if check:
        out["problems"] = disk.verify()
    return out


def entries(directory: Directory = None, preview_tokens: int = 0) -> list[dict[str, Any]]:
    """One dict per disk entry, by model, least recently used first within each.

    Times are Unix seconds. With `preview_tokens`, each entry's prompt ends with its last
    tokens as text ("preview"; None where the model's tokenizer cannot be loaded).
    """
    with _opened(directory) as disk:
        rows = disk.all_entries() if disk else []
        names = disk.namespaces() if disk else {}
    # Only the models with entries: loading a tokenizer costs tens of milliseconds.
    decode = (
        _decoders({ns: names[ns] for ns in {r.ns for r in rows} if ns in names})
        if preview_tokens
        else {}
    )
    return [
        {
            "id": r.id,
            "model": _model_name(r.ns, names),
            "block_size": names[r.ns][2] if r.ns in names else None,
            "tokens": r.n_tokens,
            "trimmable": r.trimmable,
            "bytes": r.nbytes,
            "created": r.created_ns / 1e9,
            "used": r.used_ns / 1e9,
            **(
                {"preview": _preview(decode.get(r.ns), r, preview_tokens)} if preview_tokens else {}
            ),
        }
        for r in rows
    ]


def _decoders(names: dict[str, tuple[str, str, int]]) -> dict[str, Callable[[list[int]], str]]:
    """A detokenizer per namespace whose model folder still has a tokenizer.json.

    The `tokenizers` library reads it directly: mlx-lm's loader imports transformers, which
    takes seconds, and a listing needs only the text of a few tokens.
    """
    from tokenizers import Tokenizer

    out: dict[str, Callable[[list[int]], str]] = {}
    for ns, (_, path, _) in names.items():
        file = Path(path) / "tokenizer.json"
        if not file.is_file():  # moved or deleted (and never a Hub download)
            continue
        try:
            out[ns] = partial(Tokenizer.from_file(str(file)).decode, skip_special_tokens=False)
        except Exception:  # a damaged or foreign file: no preview, the listing goes on
            continue
    return out


def _preview(decode: Callable[[list[int]], str] | None, row: DiskEntry, n: int) -> str | None:
    return None if decode is None else decode(row.last_tokens(n))


def clear(
    directory: Directory = None, on_warning: Callable[[str], None] | None = None
) -> dict[str, int]:
    """Delete every entry and file; returns how many entries went ("removed") and the bytes
    of block and checkpoint files deleted ("bytes_freed"; the index is not counted, as in
    `prune`).

    Without a usable index (none, or damaged: `on_warning` says so) the directory is reset
    to empty and no entry is counted. What mlxcache does not write there (a directory, a
    link) is left as it is, links never followed; `on_warning` says so in one line.
    """
    warn = on_warning or (lambda _message: None)
    root = kv_dir(directory)
    before = _file_bytes(root / "files")
    n, left = 0, list[str]()
    try:
        _stray_file(root / "files")
        try:
            n, left = _clear(directory, root)
        except DiskFullError:  # the index cannot even open: make room, then clear it
            remove_files(root / "files")
            n, left = _clear(directory, root)
    except CorruptIndexError as exc:
        left = reset(root)
        warn(f"the cache index was damaged ({exc.__cause__}): deleted it and every block file")
    if left:
        more = f" and {len(left) - 1} more" if len(left) > 1 else ""
        warn(f"left {left[0]}{more} as it is: not a file mlxcache wrote (links are not followed)")
    return {"removed": n, "bytes_freed": max(0, before - _file_bytes(root / "files"))}


def _stray_file(files: Path) -> None:
    """Delete a regular file where the block folder goes (our own path name): the index
    cannot open while it stands there (links are left, as everywhere)."""
    try:
        if files.is_file() and not files.is_symlink():
            files.unlink()
    except OSError as exc:
        raise CacheStoreError(f"cannot delete {files}: {exc}") from exc


def _clear(directory: Directory, root: Path) -> tuple[int, list[str]]:
    with _opened(directory) as disk:
        if disk:
            return disk.clear()
    return 0, reset(root) if root.exists() else []  # block files that no index names


def _file_bytes(root: Path) -> int:
    """Bytes of the regular files under `root`, or of `root` if it is one (links neither
    followed nor counted)."""
    if root.is_symlink():
        return 0
    if root.is_file():
        return root.stat().st_size
    total = 0
    for folder, _dirs, files in os.walk(root):  # os.walk follows no link to a directory
        for name in files:
            with contextlib.suppress(OSError):  # gone meanwhile (another process)
                st = os.lstat(os.path.join(folder, name))
                total += st.st_size if stat.S_ISREG(st.st_mode) else 0
    return total


def prune(max_bytes: int, directory: Directory = None) -> dict[str, int]:
    """Evict until the disk tier's files (blocks and checkpoints; not the index) take at most
    `max_bytes`; returns the entries removed and the bytes before and after.

    Within a model (namespace) the index's victim order decides; across models, the victim
    whose entry was used longest ago (wall clock: processes share no logical clock).

    On a disk too full for the index to open, the first victims' files go first, one entry
    at a time until it opens (read from the index as its file holds it); their entries are
    then removed with the rest.

    Raises:
        DiskFullError: deleting every entry's files did not make room for the index.
    """
    root = kv_dir(directory)
    freed: list[int] = []  # entries whose files went before the index could open
    while True:
        try:
            with _opened(directory) as disk:
                if disk is None:
                    return {"removed": 0, "bytes_before": 0, "bytes_after": 0}
                before = disk.usage()[1]
                for entry_id in freed:
                    disk.remove_entry(entry_id)
                removed = len(freed) + _prune(disk, max_bytes)
                return {"removed": removed, "bytes_before": before, "bytes_after": disk.usage()[1]}
        except DiskFullError as exc:
            if not _free_next(root, freed):
                raise DiskFullError(
                    f"the disk holding {root} is full, and deleting every "
                    "cached entry's files did not make room for the cache index: free space "
                    "on it"
                ) from exc


def _free_next(root: Path, freed: list[int]) -> bool:
    """Delete the files of the entry `prune` evicts first of those not in `freed` (added
    to it), read from the index as its file holds it; False when none is left."""
    disk = DiskTier.frozen(root)
    try:
        for row in _victims(disk.all_entries()):
            if row.id not in freed:
                disk.delete_own_files(row.id)
                freed.append(row.id)
                return True
        return False
    except sqlite3.Error as exc:
        raise index_error(root, exc) from exc
    finally:
        disk.close()


def _prune(disk: DiskTier, max_bytes: int) -> int:
    removed = 0
    for row in _victims(disk.all_entries()):
        if disk.usage()[1] <= max_bytes:
            break
        disk.remove_entry(row.id)
        removed += 1
    return removed


def _victims(rows: list[DiskEntry]) -> Iterator[DiskEntry]:
    """`rows` (oldest use first) in the order `prune` evicts them."""
    from mlxcache.cache.index import PromptIndex  # here: it needs numpy, `cache ls` does not

    indexes: dict[str, tuple[PromptIndex, dict[Entry, DiskEntry]]] = {}  # per namespace
    for row in rows:  # oldest use first: each index's clock follows it
        index, found = indexes.setdefault(row.ns, (PromptIndex(block_size=1), {}))
        found[index.add(row.tokens, trimmable=row.trimmable, nbytes=row.nbytes)] = row
    while True:
        victims = [(idx, found, v) for idx, found in indexes.values() if (v := idx.victim())]
        if not victims:
            return
        index, found, victim = min(victims, key=lambda c: (c[1][c[2]].used_ns, c[1][c[2]].id))
        index.remove(victim)
        yield found.pop(victim)
