"""A conversation's live KV: the layers its last reply (or warm-ahead) left, held by
reference so that the next turn continues from them with nothing restored or joined.

Only where the device was measured to compute decode KV canonically (the engine's
`decode_matches_prefill`: the store is asked `restore(decode_matches_prefill=True)`), and
only for layers that rewind by moving an offset (plain and quantized KV): then the held KV is bit for bit what
restoring the kept blocks and tail would give, without the copies.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.models.cache import KVCache, QuantizedKVCache

from mlxcache.cache.radix import common_prefix
from mlxcache.types import Layers


def rewinds(layers: Layers) -> bool:
    """Whether every layer rewinds by its offset alone (no state, no ring)."""
    return all(type(c) in (KVCache, QuantizedKVCache) for c in layers)


@dataclass(slots=True)
class Live:
    """`layers` holding exactly the KV of `tokens` (one owner: the cache, until taken)."""

    tokens: np.ndarray
    layers: Layers

    @classmethod
    def hold(cls, tokens: np.ndarray, layers: Layers) -> Live:
        """`layers` held for the next turn, evaluated now: a row that left a batched decode
        holds lazy copies of the batch's arrays, which would keep every row's KV alive."""
        mx.eval(_arrays(layers))
        return cls(np.array(tokens, np.int32), layers)

    @property
    def nbytes(self) -> int:
        """The bytes these layers hold (as allocated): what dropping them frees."""
        return sum(a.nbytes for a in _arrays(self.layers))

    def reach(self, tokens: np.ndarray, limit: int) -> int:
        """How far these layers follow `tokens`, at most `limit` tokens."""
        return min(common_prefix(self.tokens, tokens), limit)

    def take(self, k: int) -> Layers:
        """The layers, rewound to their first `k` tokens (handed over: no copy)."""
        for c in self.layers:
            cast(KVCache, c).trim(len(self.tokens) - k)
        return self.layers


def _arrays(layers: Layers) -> list[mx.array]:
    """Every array of the layers' KV, as allocated (quantized KV: its parts)."""
    leaves = tree_flatten([(getattr(c, "keys", None), getattr(c, "values", None)) for c in layers])
    return [leaf[1] for leaf in leaves if isinstance(leaf[1], mx.array)]
