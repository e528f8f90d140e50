"""Several processes on one cache directory: concurrent writers, a writer killed mid-write.

Every child is started through the `spawn` fixture, which kills whatever is still running
when the test ends, passed or failed.
"""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from mlxcache.cache.disk import DiskTier
from mlxcache.cache.store import PromptCache
from mlxcache.config import CacheConfig
from mlxcache.engine import Engine, Request
from mlxcache.model import LoadedModel
from mlxcache.sampling import SamplingParams

pytestmark = pytest.mark.slow  # several processes sharing one disk tier

WRITER = str(Path(__file__).parent / "writer.py")
Spawn = Callable[..., "subprocess.Popen[str]"]


@pytest.fixture
def spawn(tiny: LoadedModel) -> Iterator[Spawn]:
    """Start writer.py children (tiny model, a cache root, seed, count, [disk bytes])."""
    procs: list[subprocess.Popen[str]] = []
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent)}

    def start(root: Path, seed: int, count: int, *extra: int) -> subprocess.Popen[str]:
        args = [str(tiny.path), str(root), str(seed), str(count), *map(str, extra)]
        proc = subprocess.Popen(
            [sys.executable, WRITER, *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        procs.append(proc)
        return proc

    try:
        yield start
    finally:
        for proc in procs:
            proc.kill()  # no-op for a child that has exited
            proc.communicate()


def finish(procs: list[subprocess.Popen[str]]) -> list[str]:
    """Wait for the children; each must exit 0 and report no disk error."""
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0] * len(procs), outs
    return [out.splitlines()[-1] for out, _ in outs]


def entries(root: Path) -> int:
    with sqlite3.connect(root / "index.sqlite", timeout=30) as db:
        return int(db.execute("SELECT COUNT(*) FROM entries").fetchone()[0])


def test_two_writers_at_once(tiny: LoadedModel, tmp_path: Path, spawn: Spawn) -> None:
    root = tmp_path / "kv"
    procs = [spawn(root, seed, 12) for seed in (1, 2)]
    assert finish(procs) == ["disk_errors 0", "disk_errors 0"]
    assert entries(root) == 24
    assert DiskTier(root).verify() == []
    # A third process sees both writers' entries and resumes from them.
    cache = PromptCache(tiny.model, tiny.key, CacheConfig(block_size=4), root=root)
    prompt = np.random.default_rng(2).integers(3, 250, size=24).tolist()
    result = Engine(tiny, cache).complete(Request([*prompt, 7], SamplingParams(max_tokens=1)))
    assert result.stats.cached_tokens == 24


def test_writer_killed_mid_write_leaves_a_consistent_directory(
    tiny: LoadedModel, tmp_path: Path, spawn: Spawn
) -> None:
    root = tmp_path / "kv"
    proc = spawn(root, 3, 100_000)
    assert proc.stdout is not None
    # The child says when each entry is kept: no polling of an index being created.
    lines = [proc.stdout.readline() for _ in range(5)]
    assert lines == [f"kept {n}\n" for n in range(1, 6)], lines
    proc.kill()  # somewhere in the middle of writing the next entries
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
    tiny: LoadedModel, tmp_path: Path, spawn: Spawn
) -> None:
    """A small disk budget: each process removes entries (and files) while the other writes
    and links files of its own, some of them the very blocks being removed."""
    root = tmp_path / "kv"
    procs = [spawn(root, seed, 15, 40_000) for seed in (5, 5)]  # same prompts: shared blocks
    assert finish(procs) == ["disk_errors 0", "disk_errors 0"]
    assert DiskTier(root).verify() == []
    assert 0 < entries(root) < 15
