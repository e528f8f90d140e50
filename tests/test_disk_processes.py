"""Several processes on one cache directory: concurrent writers, a writer killed mid-write."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from mlxcache.cache.disk import DiskTier
from mlxcache.cache.store import PromptCache
from mlxcache.config import CacheConfig
from mlxcache.engine import Engine, Request
from mlxcache.model import LoadedModel
from mlxcache.sampling import SamplingParams

WRITER = str(Path(__file__).parent / "writer.py")


def writer(
    tiny: LoadedModel, root: Path, seed: int, count: int, *extra: int
) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent)}
    return subprocess.Popen(
        [
            sys.executable,
            WRITER,
            str(tiny.path),
            str(root),
            str(seed),
            str(count),
            *map(str, extra),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def entries(root: Path) -> int:
    with sqlite3.connect(root / "index.sqlite", timeout=30) as db:
        return int(db.execute("SELECT COUNT(*) FROM entries").fetchone()[0])


def test_two_writers_at_once(tiny: LoadedModel, tmp_path: Path) -> None:
    root = tmp_path / "kv"
    procs = [writer(tiny, root, seed, 12) for seed in (1, 2)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert [o[0].strip() for o in outs] == ["0", "0"]  # no disk errors in either
    assert entries(root) == 24
    assert DiskTier(root).verify() == []
    # A third process sees both writers' entries and resumes from them.
    cache = PromptCache(tiny.model, tiny.key, CacheConfig(block_size=4), root=root)
    prompt = np.random.default_rng(2).integers(3, 250, size=24).tolist()
    result = Engine(tiny, cache).complete(Request([*prompt, 7], SamplingParams(max_tokens=1)))
    assert result.stats.cached_tokens == 24


def test_writer_killed_mid_write_leaves_a_consistent_directory(
    tiny: LoadedModel, tmp_path: Path
) -> None:
    root = tmp_path / "kv"
    proc = writer(tiny, root, 3, 100_000)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and (
        not (root / "index.sqlite").exists() or entries(root) < 5
    ):
        time.sleep(0.2)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    disk = DiskTier(root)
    assert disk.verify() == []
    kept = entries(root)
    assert kept >= 5
    # The next process works on it and adds to it.
    cache = PromptCache(tiny.model, tiny.key, CacheConfig(block_size=4), root=root)
    Engine(tiny, cache).complete(Request(list(range(10, 30)), SamplingParams(max_tokens=1)))
    assert cache.report()["disk_errors"] == 0 and entries(root) == kept + 1


def test_writers_evicting_each_other_keep_the_directory_consistent(
    tiny: LoadedModel, tmp_path: Path
) -> None:
    """A small disk budget: each process removes entries (and files) while the other writes
    and links files of its own, some of them the very blocks being removed."""
    root = tmp_path / "kv"
    procs = [writer(tiny, root, seed, 15, 40_000) for seed in (5, 5)]  # same prompts: shared blocks
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert [o[0].strip() for o in outs] == ["0", "0"]
    assert DiskTier(root).verify() == []
    assert 0 < entries(root) < 15
