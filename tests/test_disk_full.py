"""A full disk can be freed by the commands meant to free it, and is named as such.

The full disk is injected: the index fails to write (SQLite's "database or disk is full")
for as long as the cache's block files are there, as it does on a file system with no
space left, where only deleting files first makes room."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import sqlite3
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from test_cli_cache import gen
from typer.testing import CliRunner

import mlxcache.cache.disk as disk_mod
from mlxcache.cache.disk import DiskTier, disk_full, index_error
from mlxcache.errors import DiskFullError
from mlxcache_cli.main import app

runner = CliRunner()
FULL = "database or disk is full"


def _files(root: Path) -> list[Path]:
    return [p for p in (root / "kv" / "files").iterdir() if p.is_file()]


def _filled(tiny_gguf: Path, directory: Path) -> int:
    for text in ("abcdefghijklmnop", "qrstuvwxyzabcdef", "ponmlkjihgfedcba"):
        gen(tiny_gguf, directory, text)
    return len(_files(directory))


def test_clear_on_a_full_disk_deletes_files_first(
    cache_root: Path, tiny_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert _filled(tiny_gguf, tmp_path) > 0
    opened = DiskTier.__init__

    def full_open(self: DiskTier, root: Path) -> None:  # the index cannot even open
        if _files(tmp_path):
            raise index_error(root, sqlite3.OperationalError(FULL))
        opened(self, root)

    monkeypatch.setattr(DiskTier, "__init__", full_open)
    result = runner.invoke(app, ["cache", "clear", "--cache-dir", str(tmp_path), "--json"])
    assert result.exit_code == 0, result.stderr
    assert _files(tmp_path) == []


def test_prune_on_a_full_disk_evicts(
    cache_root: Path, tiny_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert _filled(tiny_gguf, tmp_path) > 0
    monkeypatch.setattr(DiskTier, "_drop_rows", _while_own_files(DiskTier._drop_rows))
    result = runner.invoke(
        app, ["cache", "prune", "--max-size", "0", "--cache-dir", str(tmp_path), "--json"]
    )
    assert result.exit_code == 0, result.stderr
    assert _files(tmp_path) == []
    listed = runner.invoke(app, ["cache", "ls", "--cache-dir", str(tmp_path), "--json"])
    assert listed.exit_code == 0 and listed.stdout.strip() == "[]"


def _while_own_files(drop: Callable[..., Any]) -> Callable[..., Any]:
    """`_drop_rows` failing as on a full disk while the entry's own files are there."""

    def full(self: DiskTier, entry_id: int) -> list[str]:
        if any(self._path(name).exists() for name in self._own_files(entry_id)):
            raise sqlite3.OperationalError(FULL)
        result: list[str] = drop(self, entry_id)
        return result

    return full


def test_a_full_disk_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    error = index_error(tmp_path, sqlite3.OperationalError(FULL))
    assert isinstance(error, DiskFullError)
    assert str(error).startswith(f"the disk holding {tmp_path} is full")
    assert "cache clear" in str(error)
    assert disk_full(tmp_path, OSError(errno.ENOSPC, "No space left on device"))
    io = sqlite3.OperationalError("disk I/O error")
    assert not disk_full(tmp_path, io)  # plenty of room here: another I/O error
    monkeypatch.setattr(disk_mod.shutil, "disk_usage", lambda _p: type("U", (), {"free": 0})())
    assert disk_full(tmp_path, io)


def _five_entries(root: Path) -> list[str]:
    """A disk tier of five entries of one 40 kB block each, used in order; their files."""
    disk = DiskTier(root / "kv")
    disk.name_namespace("ns", "m", "/m", 8)
    for i in range(5):
        tokens = np.arange(10 * i, 10 * i + 8, dtype=np.int32)
        disk.add_entry(
            "ns", tokens, True, {f"b{i}": lambda p, i=i: p.write_bytes(bytes([i]) * 40_000)}, 8
        )
    disk.close()
    return [f"b{i}.safetensors" for i in range(5)]


def _names(root: Path) -> list[str]:
    return sorted(p.name for p in _files(root))


@pytest.mark.parametrize(("limit", "left"), [("1G", 3), ("100K", 2), ("0", 0)])
def test_prune_frees_a_disk_too_full_to_open_the_index(
    cache_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, limit: str, left: int
) -> None:
    """The index opens only once two entries' files are gone: prune deletes its first
    victims' files first, then removes their entries with the rest (issue 53, item 13)."""
    names = _five_entries(tmp_path)
    opened = DiskTier.__init__

    def full_open(self: DiskTier, root: Path) -> None:
        if len(_files(tmp_path)) > 3:
            raise index_error(root, sqlite3.OperationalError(FULL))
        opened(self, root)

    monkeypatch.setattr(DiskTier, "__init__", full_open)
    result = runner.invoke(
        app, ["cache", "prune", "--max-size", limit, "--cache-dir", str(tmp_path), "--json"]
    )
    assert result.exit_code == 0, result.stderr
    assert json.loads(result.stdout) == {
        "removed": 5 - left,
        "bytes_before": 200_000,
        "bytes_after": 40_000 * left,
    }
    assert _names(tmp_path) == names[5 - left :]  # the least recently used went
    listed = runner.invoke(app, ["cache", "ls", "--json", "--cache-dir", str(tmp_path)])
    assert [row["tokens"] for row in json.loads(listed.stdout)] == [8] * left


def test_prune_that_cannot_make_room_says_so(
    cache_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Prune deletes every entry's files; when the index still cannot open, the error says
    so and does not send the user to prune again."""
    _five_entries(tmp_path)

    def full_open(self: DiskTier, root: Path) -> None:
        raise index_error(root, sqlite3.OperationalError(FULL))

    monkeypatch.setattr(DiskTier, "__init__", full_open)
    result = runner.invoke(app, ["cache", "prune", "--max-size", "0", "--cache-dir", str(tmp_path)])
    assert (result.exit_code, result.stdout, _files(tmp_path)) == (1, "", [])
    assert result.stderr == (
        f"error: the disk holding {tmp_path / 'kv'} is full, and deleting every "
        "cached entry's files did not make room for the cache index: free space on it\n"
    )


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A 512 kB tmpfs mounted for the test (root on Linux only)."""
    if sys.platform != "linux" or os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root on Linux; the injected tests above cover it")
    mount = tmp_path / "tmpfs"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=512k", "tmpfs", str(mount)], check=True)
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def test_prune_and_clear_free_a_real_full_disk(cache_root: Path, tmpfs: Path) -> None:
    """On a tmpfs filled to its last byte (where SQLite cannot even map the index's shared
    memory), prune and then clear free it, each in one process."""
    names = _five_entries(tmpfs)
    with contextlib.suppress(OSError), (tmpfs / "filler").open("wb") as out:
        while True:
            out.write(b"\0" * 4096)
            out.flush()
    cut = [sys.executable, "-m", "mlxcache_cli", "cache"]
    where = ["--cache-dir", str(tmpfs), "--json"]
    pruned = subprocess.run(
        [*cut, "prune", "--max-size", "100K", *where], capture_output=True, text=True, timeout=120
    )
    assert pruned.returncode == 0, pruned.stderr
    assert json.loads(pruned.stdout)["removed"] == 3
    assert _names(tmpfs) == names[3:]
    cleared = subprocess.run([*cut, "clear", *where], capture_output=True, text=True, timeout=120)
    assert (cleared.returncode, json.loads(cleared.stdout)["removed"], _files(tmpfs)) == (0, 2, [])
