"""Shared fixtures: one cache root per test session, the embedded model, a tiny random model."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from tinymodel import write_tiny_gguf

from mlxcache.model import LoadedModel, load


@pytest.fixture(scope="session")
def cache_root(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Converted models live here for the whole session (conversion is done once)."""
    root = tmp_path_factory.mktemp("cache-root")
    old = os.environ.get("MLXCACHE_CACHE_DIR")
    os.environ["MLXCACHE_CACHE_DIR"] = str(root)
    yield root
    if old is None:
        os.environ.pop("MLXCACHE_CACHE_DIR", None)
    else:
        os.environ["MLXCACHE_CACHE_DIR"] = old


@pytest.fixture(scope="session")
def smol(cache_root: Path) -> LoadedModel:
    """The embedded default model (SmolLM2-135M-Instruct, Q4_1 GGUF)."""
    return load(cache_root=cache_root)


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny") / "tiny.gguf"
    write_tiny_gguf(path)
    return path


@pytest.fixture(scope="session")
def tiny(tiny_gguf: Path, cache_root: Path) -> LoadedModel:
    """A tiny random-weight llama (2 layers, vocab 262, context 256)."""
    return load(str(tiny_gguf), cache_root=cache_root)
