"""The disk tier: a SQLite index (WAL) plus one safetensors file per block or checkpoint.

Files are content-addressed, written to a temporary name and renamed, so readers never
see half a file and two processes writing the same block write the same bytes. An entry's
new files, their index rows and the entry are added together: when any step fails (a full
disk), the files written for it are removed again, so no file is left that no row names.
Each file's checksum is kept in the index and verified on every read: a corrupt or missing
file is reported to the caller (which drops the entry and counts it), never used.
"""

from __future__ import annotations

import errno
import fcntl
import os
import shutil
import sqlite3
import time
from array import array
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import xxhash

from mlxcache.errors import (
    CacheStoreError,
    CorruptCacheFileError,
    CorruptIndexError,
    DiskFullError,
)

if TYPE_CHECKING:
    import mlx.core as mx
    import numpy as np

_SCHEMA = """
CREATE TABLE IF NOT EXISTS entries (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    ns TEXT NOT NULL,
    digest TEXT NOT NULL,
    tokens BLOB NOT NULL,
    trimmable INTEGER NOT NULL,
    nbytes INTEGER NOT NULL,
    created_ns INTEGER NOT NULL,
    used_ns INTEGER NOT NULL,
    UNIQUE (ns, digest)
);
CREATE TABLE IF NOT EXISTS files (
    name TEXT PRIMARY KEY,
    ns TEXT NOT NULL,
    nbytes INTEGER NOT NULL,
    checksum TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS entry_files (
    entry INTEGER NOT NULL REFERENCES entries(id) ON DELETE CASCADE,
    name TEXT NOT NULL,
    PRIMARY KEY (entry, name)
);
CREATE INDEX IF NOT EXISTS entry_files_name ON entry_files(name);
CREATE TABLE IF NOT EXISTS namespaces (
    ns TEXT PRIMARY KEY,
    model TEXT NOT NULL,
    path TEXT NOT NULL,
    block_size INTEGER NOT NULL
);
"""
_STALE_TMP_S = 600  # a temp file this old belongs to a writer that died
INDEX = "index.sqlite"
_FIX = "`mlxcache cache clear` resets the directory"


@dataclass(frozen=True, slots=True)
class DiskEntry:
    """One row of the entries table."""

    id: int
    ns: str
    raw: bytes
    """The token ids, int32 in the machine's byte order (as numpy wrote them)."""
    trimmable: bool
    nbytes: int
    created_ns: int
    used_ns: int

    @property
    def tokens(self) -> np.ndarray:
        import numpy as np  # here: listing the cache (`cache ls`) needs no numpy

        return np.frombuffer(self.raw, dtype=np.int32)

    @property
    def n_tokens(self) -> int:
        return len(self.raw) // 4

    def last_tokens(self, n: int) -> list[int]:
        """The last `n` token ids."""
        return list(array("i", self.raw[-4 * n :])) if n > 0 else []


def _checksum(data: bytes) -> str:
    return str(xxhash.xxh3_64_hexdigest(data))


def digest_tokens(tokens: np.ndarray) -> str:
    """Identity of an entry's token sequence (within a namespace)."""
    import numpy as np

    return str(xxhash.xxh3_128_hexdigest(np.ascontiguousarray(tokens, np.int32).tobytes()))


Writer = Callable[[Path], None]
"""Writes one file's content to the given (temporary) path."""


def index_error(root: Path, exc: Exception) -> CacheStoreError:
    """The domain error for an SQLite failure: a damaged index says how to recover."""
    # OperationalError (locked, read-only, disk full) is transient or environmental;
    # any other DatabaseError means the file itself is not a usable index.
    if isinstance(exc, sqlite3.DatabaseError) and not isinstance(exc, sqlite3.OperationalError):
        return CorruptIndexError(f"the cache index {root / INDEX} is damaged ({exc}); {_FIX}")
    if disk_full(root, exc):
        return DiskFullError(
            f"the disk holding {root} is full ({exc}): `mlxcache cache clear` or "
            "`cache prune --max-size SIZE` frees it"
        )
    return CacheStoreError(f"cannot use the disk cache at {root}: {exc}")


FULL_BELOW = 1 << 20
"""Free bytes under which a failed write is put down to a full disk."""


def disk_full(root: Path, exc: BaseException) -> bool:
    """Whether `exc` (an SQLite or OS error under `root`) comes from a full disk: SQLite says
    so ("database or disk is full"), or says "disk I/O error" with next to no space left."""
    if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
        return True
    if "full" in str(exc):
        return True
    try:
        return "I/O error" in str(exc) and shutil.disk_usage(root).free < FULL_BELOW
    except OSError:
        return False


class DiskTier:
    """Blocks and checkpoints of every namespace under one directory.

    Raises:
        CorruptIndexError: the index file is not a database (`reset` recovers).
        CacheStoreError: the directory or its index cannot be opened or created.
    """

    def __init__(self, root: Path) -> None:
        self.root = root
        self.files = root / "files"
        try:
            self.files.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise CacheStoreError(f"cannot open the disk cache at {root}: {exc}") from exc
        try:
            # Opened where the engine is built, then used by the engine worker's thread
            # (one thread at a time): sqlite3's same-thread check would refuse that.
            self._db = sqlite3.connect(
                root / INDEX, timeout=30, isolation_level=None, check_same_thread=False
            )
            # Two processes opening a new directory at once would both switch it to WAL and
            # create the tables: one at a time, as every other write to the index.
            with self._writer():
                self._db.execute("PRAGMA journal_mode=WAL")
                self._db.executescript(_SCHEMA)
            self._db.execute("PRAGMA foreign_keys=ON")
        except (sqlite3.Error, OSError) as exc:  # OSError: the lock file cannot be opened
            raise index_error(root, exc) from exc
        self._sweep_temp()

    @classmethod
    def frozen(cls, root: Path) -> DiskTier:
        """The index at `root` as its file holds it, read only, without locks or the WAL's
        shared memory (SQLite's `immutable`): readable on a full disk, where opening it
        to write fails. Rows only the WAL holds are not seen; only reads work.

        Raises:
            CacheStoreError: the file cannot be read as an index.
        """
        disk = cls.__new__(cls)
        disk.root, disk.files = root, root / "files"
        try:
            uri = f"{(root / INDEX).absolute().as_uri()}?immutable=1"
            disk._db = sqlite3.connect(uri, uri=True, check_same_thread=False)
        except sqlite3.Error as exc:
            raise index_error(root, exc) from exc
        return disk

    def close(self) -> None:
        self._db.close()

    @contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        self._db.execute("BEGIN IMMEDIATE")
        try:
            yield self._db
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        self._db.execute("COMMIT")

    def _sweep_temp(self) -> None:
        """Remove temp files left by writers killed mid-write (the index never names them)."""
        now = time.time()
        for tmp in self.files.glob("*.tmp*"):
            try:
                if now - tmp.stat().st_mtime > _STALE_TMP_S:
                    tmp.unlink()
            except OSError:
                pass

    # -- reading ----------------------------------------------------------------------------

    def entries(self, ns: str, after_id: int = 0) -> list[DiskEntry]:
        """Entries of `ns` newer than `after_id`, oldest use first."""
        rows = self._db.execute(
            "SELECT id, ns, tokens, trimmable, nbytes, created_ns, used_ns FROM entries "
            "WHERE ns = ? AND id > ? ORDER BY used_ns, id",
            (ns, after_id),
        ).fetchall()
        return [_row(r) for r in rows]

    def all_entries(self) -> list[DiskEntry]:
        rows = self._db.execute(
            "SELECT id, ns, tokens, trimmable, nbytes, created_ns, used_ns FROM entries "
            "ORDER BY ns, used_ns, id"
        ).fetchall()
        return [_row(r) for r in rows]

    def _path(self, name: str) -> Path:
        return self.files / f"{name}.safetensors"

    def _read(self, name: str) -> Path:
        row = self._db.execute("SELECT checksum FROM files WHERE name = ?", (name,)).fetchone()
        path = self._path(name)
        try:
            data = path.read_bytes()
        except OSError as exc:
            raise CorruptCacheFileError(f"{name}: {exc}") from exc
        if row is None or _checksum(data) != row[0]:
            raise CorruptCacheFileError(f"{name}: checksum mismatch")
        return path

    def read_block(self, name: str) -> dict[str, mx.array]:
        """The block's arrays stored under `name` (checksum verified)."""
        import mlx.core as mx  # here: listing and managing the cache (`cache ls`) needs no MLX

        path = self._read(name)
        try:
            arrays = mx.load(str(path))
        except Exception as exc:  # MLX raises plain RuntimeError on a bad file
            raise CorruptCacheFileError(f"{name}: {exc}") from exc
        if not isinstance(arrays, dict) or not arrays:
            raise CorruptCacheFileError(f"{name}: no tensors")
        return arrays

    def read_checkpoint(self, name: str) -> list[Any]:
        """The cache list stored under `name` (checksum verified)."""
        from mlx_lm.models.cache import load_prompt_cache  # not at import: see checkpoint_writer

        path = self._read(name)
        try:
            return list(load_prompt_cache(str(path)))
        except Exception as exc:
            raise CorruptCacheFileError(f"{name}: {exc}") from exc

    def stored(self, names: list[str]) -> list[str]:
        """Those of `names` that have a file, in the order given."""
        have = set()
        for i in range(0, len(names), 500):  # SQLite's limit on bound parameters
            part = names[i : i + 500]
            marks = ",".join("?" * len(part))
            rows = self._db.execute(f"SELECT name FROM files WHERE name IN ({marks})", part)
            have |= {r[0] for r in rows}
        return [n for n in names if n in have]

    def name_namespace(self, ns: str, model: str, path: str, block_size: int) -> None:
        """Record which model (name, folder) and block size a namespace holds, for listings."""
        self._db.execute(
            "INSERT OR REPLACE INTO namespaces (ns, model, path, block_size) VALUES (?, ?, ?, ?)",
            (ns, model, path, block_size),
        )

    def namespaces(self) -> dict[str, tuple[str, str, int]]:
        """ns -> (model name, model folder, block size), for namespaces a cache has named."""
        rows = self._db.execute("SELECT ns, model, path, block_size FROM namespaces").fetchall()
        return {r[0]: (r[1], r[2], int(r[3])) for r in rows}

    def usage(self, ns: str | None = None) -> tuple[int, int]:
        """(entries, bytes) of one namespace, or of all."""
        where, args = ("WHERE ns = ?", (ns,)) if ns else ("", ())
        n = self._db.execute(f"SELECT COUNT(*) FROM entries {where}", args).fetchone()[0]
        b = self._db.execute(
            f"SELECT COALESCE(SUM(nbytes), 0) FROM files {where}", args
        ).fetchone()[0]
        return int(n), int(b)

    def verify(self) -> list[str]:
        """Problems found: a damaged index, indexed files missing or failing their checksum,
        dangling links."""
        damage = [r[0] for r in self._db.execute("PRAGMA quick_check").fetchall()]
        if damage != ["ok"]:
            return [f"the cache index {self.root / INDEX} is damaged ({damage[0]}); {_FIX}"]
        problems = []
        for (name,) in self._db.execute("SELECT name FROM files").fetchall():
            try:
                self._read(name)
            except CorruptCacheFileError as exc:
                problems.append(str(exc))
        dangling = self._db.execute(
            "SELECT COUNT(*) FROM entry_files WHERE name NOT IN (SELECT name FROM files)"
        ).fetchone()[0]
        if dangling:
            problems.append(f"{dangling} entry links name no indexed file")
        return problems

    # -- writing ----------------------------------------------------------------------------

    def _write_file(self, name: str, write: Writer) -> tuple[int, str]:
        """Write a file by calling write(tmp_path), then rename it into place.

        Returns its size and checksum. Raises CacheStoreError when it cannot be written
        (MLX reports a full disk as a plain RuntimeError); nothing is left behind then.
        """
        final = self._path(name)
        tmp = self.files / f"{name}.tmp{os.getpid()}.safetensors"
        try:
            write(tmp)
            data = tmp.read_bytes()
            os.replace(tmp, final)
        except BaseException as exc:
            tmp.unlink(missing_ok=True)
            if isinstance(exc, Exception):
                raise CacheStoreError(f"cannot write {final}: {exc}") from exc
            raise
        return len(data), _checksum(data)

    @contextmanager
    def _writer(self) -> Iterator[None]:
        """One writer at a time across processes (an OS file lock, gone with a dead process).

        Writing a file, indexing it and linking it to its entry happen under it, and so does
        removing orphan files: another process can never unlink a file between its write
        and its link.
        """
        with (self.root / "write.lock").open("a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def add_entry(
        self,
        ns: str,
        tokens: np.ndarray,
        trimmable: bool,
        files: dict[str, Writer],
        nbytes: int,
    ) -> int:
        """Write the entry's missing files, index them and the entry; returns its row id.

        All or nothing: if a write or the index update fails, the files written here are
        removed (under the writer lock no other process can have linked them yet).

        Raises:
            CacheStoreError: a file or the index could not be written.
        """
        with self._writer():
            written: dict[str, tuple[int, str]] = {}
            try:
                for name, write in files.items():
                    if not self._db.execute(
                        "SELECT 1 FROM files WHERE name = ?", (name,)
                    ).fetchone():
                        written[name] = self._write_file(name, write)
                return self._link(ns, tokens, trimmable, list(files), nbytes, written)
            except BaseException as exc:
                self._unlink(list(written))
                if isinstance(exc, sqlite3.Error):
                    raise index_error(self.root, exc) from exc
                raise

    def _link(
        self,
        ns: str,
        tokens: np.ndarray,
        trimmable: bool,
        names: list[str],
        nbytes: int,
        written: dict[str, tuple[int, str]],
    ) -> int:
        """Index the new files, the entry and its links in one transaction."""
        import numpy as np

        now = time.time_ns()
        data = np.ascontiguousarray(tokens, np.int32).tobytes()
        with self._tx() as db:
            db.executemany(
                "INSERT OR IGNORE INTO files (name, ns, nbytes, checksum) VALUES (?, ?, ?, ?)",
                [(name, ns, size, checksum) for name, (size, checksum) in written.items()],
            )
            db.execute(
                "INSERT INTO entries (ns, digest, tokens, trimmable, nbytes, created_ns, used_ns)"
                " VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT (ns, digest) DO UPDATE SET used_ns = ?",
                (ns, digest_tokens(tokens), data, int(trimmable), nbytes, now, now, now),
            )
            row = db.execute(
                "SELECT id FROM entries WHERE ns = ? AND digest = ?", (ns, digest_tokens(tokens))
            ).fetchone()
            db.executemany(
                "INSERT OR IGNORE INTO entry_files (entry, name) VALUES (?, ?)",
                [(row[0], n) for n in names],
            )
        return int(row[0])

    def touch(self, entry_id: int) -> None:
        self._db.execute("UPDATE entries SET used_ns = ? WHERE id = ?", (time.time_ns(), entry_id))

    def remove_entry(self, entry_id: int) -> None:
        """Drop an entry and every file no other entry uses. On a full disk, where the
        index cannot write until space is freed, those files go first (an index row whose
        file is gone is dropped when read, never served)."""
        with self._writer():
            try:
                self._unlink(self._drop_rows(entry_id))
            except sqlite3.OperationalError as exc:
                if not disk_full(self.root, exc):
                    raise
                self.delete_own_files(entry_id)
                self._unlink(self._drop_rows(entry_id))

    def delete_own_files(self, entry_id: int) -> None:
        """Delete the files of an entry that no other entry uses, its rows left (a read:
        works on a full disk, and on a `frozen` index); `remove_entry` drops them later."""
        self._unlink(self._own_files(entry_id))

    def _own_files(self, entry_id: int) -> list[str]:
        """The files of an entry that no other entry uses (a read: no page written)."""
        rows = self._db.execute(
            "SELECT name FROM entry_files WHERE entry = ? AND name NOT IN "
            "(SELECT name FROM entry_files WHERE entry != ?)",
            (entry_id, entry_id),
        )
        return [r[0] for r in rows]

    def _unlink(self, names: list[str]) -> None:
        for name in names:
            self._path(name).unlink(missing_ok=True)

    def _drop_rows(self, entry_id: int) -> list[str]:
        """Delete an entry's rows; returns the files no entry uses any more."""
        with self._tx() as db:
            names = [
                r[0]
                for r in db.execute("SELECT name FROM entry_files WHERE entry = ?", (entry_id,))
            ]
            db.execute("DELETE FROM entries WHERE id = ?", (entry_id,))
            orphans = [
                n
                for n in names
                if not db.execute("SELECT 1 FROM entry_files WHERE name = ?", (n,)).fetchone()
            ]
            db.executemany("DELETE FROM files WHERE name = ?", [(n,) for n in orphans])
        return orphans

    def clear(self) -> tuple[int, list[str]]:
        """Remove every entry and file; returns how many entries there were and what was
        left (`remove_files`). The files go first: on a full disk the index can only write
        once they are gone."""
        with self._writer():
            left = remove_files(self.files)
            with self._tx() as db:
                n = int(db.execute("SELECT COUNT(*) FROM entries").fetchone()[0])
                db.execute("DELETE FROM entry_files")
                db.execute("DELETE FROM entries")
                db.execute("DELETE FROM files")
            return n, left


def remove_files(folder: Path) -> list[str]:
    """Delete the regular files in `folder` (blocks, checkpoints, temp files); returns the
    paths of what stays: directories, links and the like, which mlxcache never writes there.
    A link is never followed, `folder` itself included: what it points to is not the cache's.
    """
    if folder.is_symlink():
        return [str(folder)]
    left = []
    with os.scandir(folder) as found:
        for entry in found:
            if entry.is_file(follow_symlinks=False):
                Path(entry.path).unlink(missing_ok=True)
            else:
                left.append(entry.path)
    return left


def reset(root: Path) -> list[str]:
    """Delete the index and every block file of the disk tier at `root`, whatever state
    they are in (the way out of a damaged index). Holds the writer lock meanwhile.

    Returns:
        What was left (`remove_files`): never a link's target.

    Raises:
        CacheStoreError: the files cannot be removed (e.g. a read-only directory).
    """
    try:
        if root.exists() and not root.is_dir():
            root.unlink()  # our own path name, taken by a stray file
        root.mkdir(parents=True, exist_ok=True)
        with (root / "write.lock").open("a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            for name in (INDEX, f"{INDEX}-wal", f"{INDEX}-shm"):
                path = root / name
                if path.is_file() or path.is_symlink():
                    path.unlink()
            files = root / "files"
            left = remove_files(files) if files.is_dir() or files.is_symlink() else []
            if not left and files.is_dir():
                files.rmdir()
            elif not left:
                files.unlink(missing_ok=True)  # a stray file where the folder goes
            return left
    except OSError as exc:
        raise CacheStoreError(f"cannot reset the disk cache at {root}: {exc}") from exc


def block_writer(block: dict[str, mx.array]) -> Writer:
    """How to write one block file (its arrays by name, see `layout.Layout`)."""
    import mlx.core as mx

    return lambda path: mx.save_safetensors(str(path), block)


def checkpoint_writer(layers: list[Any]) -> Writer:
    """How to write one whole-state checkpoint file."""
    # Imported here: mlx_lm imports transformers (seconds), and `mlxcache cache ...` reads
    # this module without running a model.
    from mlx_lm.models.cache import save_prompt_cache

    return lambda path: save_prompt_cache(str(path), layers)


def _row(r: tuple[Any, ...]) -> DiskEntry:
    return DiskEntry(int(r[0]), str(r[1]), bytes(r[2]), bool(r[3]), int(r[4]), int(r[5]), int(r[6]))
