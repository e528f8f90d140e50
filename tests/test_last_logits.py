"""A prefill's last logits with the LM head over the last position only (`last_logits`)."""

from __future__ import annotations

import importlib
import threading
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models.cache import make_prompt_cache

from mlxcache.bench.families import FAMILIES
from mlxcache.last_logits import _backbone_of, _LastPosition, last_logits
from mlxcache.model.kvquant import QuantizedKV

IDS = mx.array([[5, 17, 3, 99, 42, 7, 200, 11, 64]])


def _family(name: str) -> Any:
    config = FAMILIES[name]
    module = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    mx.random.seed(0)
    return module.Model(module.ModelArgs.from_dict(config))


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_family_gets_the_same_logits_and_kv(family: str) -> None:
    """The whole forward's last row, and bitwise the same layers (the backbone's work is
    unchanged), for every kind of layer the store keeps; the head is cut in each."""
    model = _family(family)
    assert _backbone_of(model) is not None  # the head is cut here, not run whole
    whole_layers, cut_layers = make_prompt_cache(model), make_prompt_cache(model)
    whole = model(IDS, cache=whole_layers)[:, -1, :]
    cut = last_logits(model, IDS, cut_layers)
    mx.eval(whole, cut)
    assert cut.shape == whole.shape
    assert mx.allclose(cut, whole, rtol=1e-5, atol=1e-5).item()
    assert mx.argmax(cut).item() == mx.argmax(whole).item()
    for a, b in zip(whole_layers, cut_layers, strict=True):
        x, y = tree_flatten(a.state), tree_flatten(b.state)
        assert [k for k, _ in x] == [k for k, _ in y]
        same = (u is v or mx.array_equal(u, v).item() for (_, u), (_, v) in zip(x, y, strict=True))
        assert all(same)


class _Backbone(nn.Module):
    def __call__(self, inputs: mx.array, cache: Any = None) -> mx.array:
        return mx.broadcast_to(inputs[..., None].astype(mx.float32), (*inputs.shape, 4))


class _Net(nn.Module):
    """A backbone and a head that records the positions it is given."""

    def __init__(self, fail: bool = False) -> None:
        super().__init__()
        self.model = _Backbone()
        self.fail = fail
        self.heads: list[int] = []

    def __call__(self, inputs: mx.array, cache: Any = None) -> mx.array:
        h = self.model(inputs, cache)
        self.heads.append(h.shape[1])
        if self.fail:
            raise RuntimeError("forward failed")
        return h * 2


def test_the_head_sees_the_last_position_alone_and_the_model_is_left_as_it_was() -> None:
    net = _Net()
    got = last_logits(net, IDS, [])
    assert net.heads == [1]
    assert got.tolist() == [[128.0] * 4]  # 2 x the last id
    assert "model" not in vars(net) and isinstance(net.model, _Backbone)
    net(IDS)
    assert net.heads == [1, IDS.shape[1]]  # a forward after it is whole again


def test_a_failed_forward_leaves_the_model_as_it_was() -> None:
    net = _Net(fail=True)
    with pytest.raises(RuntimeError, match="forward failed"):
        last_logits(net, IDS, [])
    assert "model" not in vars(net) and isinstance(net.model, _Backbone)


def test_the_cut_reaches_through_a_forwarding_wrapper() -> None:
    net = _Net()
    got = last_logits(QuantizedKV(net, 8, 32), IDS, [])
    assert net.heads == [1] and got.tolist() == [[128.0] * 4]


def test_a_model_without_a_backbone_is_run_whole() -> None:
    def bare(inputs: mx.array, cache: Any = None) -> mx.array:
        return mx.broadcast_to(inputs[..., None].astype(mx.float32), (*inputs.shape, 3))

    assert last_logits(bare, IDS, []).tolist() == [[64.0] * 3]  # type: ignore[arg-type]


def test_another_thread_sees_the_backbone_whole() -> None:
    """Only the thread that cut it gets the last position (a model is driven by one thread,
    but nothing else may see the cut meanwhile)."""
    cut = _LastPosition(_Backbone())
    shapes: list[tuple[int, ...]] = []
    other = threading.Thread(target=lambda: shapes.append(tuple(cut(IDS).shape)))
    other.start()
    other.join()
    shapes.append(tuple(cut(IDS).shape))
    assert shapes == [(1, IDS.shape[1], 4), (1, 1, 4)]
