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

import numpy as np
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

    def reach(self, tokens: np.ndarray, limit: int) -> int:
        """How far these layers follow `tokens`, at most `limit` tokens."""
        return min(common_prefix(self.tokens, tokens), limit)

    def take(self, k: int) -> Layers:
        """The layers, rewound to their first `k` tokens (handed over: no copy)."""
        for c in self.layers:
            cast(KVCache, c).trim(len(self.tokens) - k)
        return self.layers
