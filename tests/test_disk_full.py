"""A full disk can be freed by the commands meant to free it, and is named as such.

The full disk is injected: the index fails to write (SQLite's "database or disk is full")
for as long as the cache's block files are there, as it does on a file system with no
space left, where only deleting files first makes room."""

from __future__ import annotations

import errno
import sqlite3
from collections.abc import Callable
from pathlib import Path
from typing import Any

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
