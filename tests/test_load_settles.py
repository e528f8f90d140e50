"""A model load leaves nothing lazy behind in MLX's global PRNG key: building a model
draws initial weights from it (replaced by the loaded ones), each draw a lazy split of the
key before, and an unevaluated chain of them grew by ~1 MB per load in a server that loads
and unloads models (`bench models`: its idle size crept until a model was refused)."""

from __future__ import annotations

import io
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest
from adapters import write_adapter

from mlxcache.model import LoadedModel, load


def pending_edges() -> int:
    """The edges of the lazy graph behind the global key (0: evaluated)."""
    dot = io.StringIO()
    mx.export_to_dot(dot, mx.random.state[0])
    return dot.getvalue().count("->")


def test_the_check_sees_a_lazy_key() -> None:
    nn.Linear(4, 4)  # its weight drawn from the global key, lazily
    assert pending_edges() > 0


@pytest.mark.parametrize("adapted", [False, True])
def test_a_load_leaves_the_global_key_evaluated(
    tiny: LoadedModel, tmp_path: Path, adapted: bool
) -> None:
    adapter = write_adapter(tiny.path, tmp_path / "adapter") if adapted else None
    nn.Linear(4, 4)
    load(str(tiny.path), adapter=adapter)
    assert pending_edges() == 0
