"""Shared fixtures: one cache root per test session, the embedded model, a tiny random model."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from tinymodel import write_sliding, write_tiny_gguf

from mlxcache.bench.families import FAMILIES, build
from mlxcache.model import LoadedModel, load

if TYPE_CHECKING:  # imported where used: other tests need not import what it imports
    from guarantees import Variant


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


@pytest.fixture(scope="session")
def wide_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with room for tool definitions in its prompt (context 4096)."""
    path = tmp_path_factory.mktemp("wide") / "wide.gguf"
    write_tiny_gguf(path, context=4096)
    return path


@pytest.fixture(scope="session")
def wide(wide_gguf: Path, cache_root: Path) -> LoadedModel:
    return load(str(wide_gguf), cache_root=cache_root)


@pytest.fixture(scope="session")
def sliding(tiny: LoadedModel, tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    """The tiny model with a sliding-window first layer (8 wide): a ring buffer, which
    cannot be rewound once it has dropped a position."""
    return load(str(write_sliding(tiny.path, tmp_path_factory.mktemp("sliding") / "model")))


@pytest.fixture(scope="session")
def recurrent(tiny: LoadedModel, tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    """A tiny random LFM2 (mlx-lm's class): attention, then two recurrent conv layers."""
    return load(str(build(tmp_path_factory.mktemp("lfm2") / "model", tiny.path, FAMILIES["lfm2"])))


@pytest.fixture(scope="session")
def quantizable(tmp_path_factory: pytest.TempPathFactory, cache_root: Path) -> LoadedModel:
    """The tiny model with one attention head of 64 (quantization groups of 32 and of 64
    fit it)."""
    path = tmp_path_factory.mktemp("heads") / "heads.gguf"
    write_tiny_gguf(path, heads=1, kv_heads=1)
    return load(str(path), cache_root=cache_root)


@pytest.fixture(scope="session")
def adapted(tiny: LoadedModel, tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    """The tiny model with a random LoRA adapter on both its layers (tests/adapters.py)."""
    from adapters import write_adapter

    adapter = write_adapter(tiny.path, tmp_path_factory.mktemp("adapted") / "adapter")
    return load(str(tiny.path), adapter=adapter)


@pytest.fixture(scope="session")
def variants(
    tiny: LoadedModel,
    sliding: LoadedModel,
    recurrent: LoadedModel,
    quantizable: LoadedModel,
    adapted: LoadedModel,
) -> dict[str, Variant]:
    """The models the exactness checks run on (tests/guarantees.py): the tiny model, its
    sliding-window version, a recurrent hybrid, a checkpoint-only cache kind and the tiny
    model with an adapter, each plain and shape-sensitive (tests/shapemodel.py)."""
    from guarantees import Variant

    return Variant.all(tiny, sliding, recurrent, quantizable, adapted)


@pytest.fixture(scope="session")
def other_variants(
    tmp_path_factory: pytest.TempPathFactory, cache_root: Path, tiny: LoadedModel
) -> dict[str, Variant]:
    """The same variants of a second tiny model (other weights), for two models in one
    cache directory."""
    folder = tmp_path_factory.mktemp("other")
    write_tiny_gguf(folder / "other.gguf", seed=9)
    other = load(str(folder / "other.gguf"), cache_root=cache_root)
    from guarantees import Variant

    sliding = load(str(write_sliding(other.path, folder / "sliding")))
    recurrent = load(str(build(folder / "lfm2", other.path, FAMILIES["lfm2"], seed=9)))
    write_tiny_gguf(folder / "heads.gguf", seed=9, heads=1, kv_heads=1)
    quantizable = load(str(folder / "heads.gguf"), cache_root=cache_root)
    # The adapter's other: the same base weights under another adapter (its own namespace).
    from adapters import write_adapter

    adapter = write_adapter(tiny.path, folder / "adapter", seed=9)
    adapted = load(str(tiny.path), adapter=adapter)
    return Variant.all(other, sliding, recurrent, quantizable, adapted)


@pytest.fixture(autouse=True)
def _data_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Saved chat sessions go to the test's own directory, never the user's data directory
    (a test that gives `--cache-dir tmp_path` finds them where older versions put them)."""
    monkeypatch.setenv("MLXCACHE_DATA_DIR", str(tmp_path))
