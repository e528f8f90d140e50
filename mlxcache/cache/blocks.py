"""KV blocks and whole-state checkpoints: hashing, cutting them out of mlx-lm caches, rebuilding.

A block holds B tokens of every layer's keys and values as one array of shape
(layers, 2, kv_heads, B, head_dim), so one block is one tensor in memory and on disk.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import mlx.core as mx
import numpy as np
import xxhash
from mlx.utils import tree_flatten, tree_map
from mlx_lm.models import cache as mlx_cache

from mlxcache.types import KVLayer, LayerCache, Layers

ROOT = b"mlxcache-block-v1"


def namespace(model_key: str, block_size: int, layout: str = "") -> str:
    """The key every stored block and entry is filed under.

    Besides the model key and block size it names the MLX build and device: kernels
    differ between versions and backends, and a KV computed by another build could
    break "resumed == fresh" bit for bit. `layout` names how blocks are laid out when
    that is not the plain stacked KV (whose namespace stays as it always was).
    """
    import mlx_lm

    parts = [
        model_key,
        str(block_size),
        getattr(mx, "__version__", "?"),
        mlx_lm.__version__,
        str(mx.default_device()),
        *([layout] if layout else []),
    ]
    return str(xxhash.xxh3_128_hexdigest("\0".join(parts).encode()))


def chain_hashes(tokens: np.ndarray, block_size: int, ns: str) -> list[str]:
    """Deterministic chained hashes of each full block: h_j = H(h_{j-1}, tokens of block j, ns)."""
    out: list[str] = []
    parent = ROOT + ns.encode()
    data = np.ascontiguousarray(tokens, dtype=np.int32)
    for start in range(0, len(data) - block_size + 1, block_size):
        digest = xxhash.xxh3_128_digest(parent + data[start : start + block_size].tobytes())
        out.append(digest.hex())
        parent = digest
    return out


def cut_block(layers: Sequence[KVLayer], start: int, stop: int) -> mx.array:
    """A copy of positions [start, stop) of every KV layer, stacked (never aliases `layers`)."""
    return mx.stack(
        [mx.stack([c.keys[0, :, start:stop, :], c.values[0, :, start:stop, :]]) for c in layers]
    )


def join_blocks(blocks: list[mx.array], n_layers: int) -> list[LayerCache]:
    """Fresh mlx-lm KV caches holding the concatenation of `blocks` (a new array per layer)."""
    whole = mx.concatenate(blocks, axis=3) if len(blocks) > 1 else blocks[0]
    layers = []
    for i in range(n_layers):
        c = mlx_cache.KVCache()
        # mx.array(...) gives each cache its own array objects: the cache's in-place
        # updates then never reach the stored block.
        c.keys = mx.array(whole[i, 0][None])
        c.values = mx.array(whole[i, 1][None])
        c.offset = whole.shape[3]
        layers.append(c)
    mx.eval([(c.keys, c.values) for c in layers])
    return cast("list[LayerCache]", layers)


def append(layers: Sequence[KVLayer], tail: mx.array) -> None:
    """Append `tail` (as `cut_block` cuts it) to fresh KV caches, as a prefill chunk would."""
    if tail.shape[3] == 0:
        return
    for i, c in enumerate(layers):
        c.update_and_fetch(tail[i, 0][None], tail[i, 1][None])
    mx.eval([(c.keys, c.values) for c in layers])


def _copy_state(state: Any) -> Any:
    # New array objects: a live cache's in-place updates never reach a stored state.
    return tree_map(lambda x: mx.array(x) if isinstance(x, mx.array) else x, state)


def snapshot(layers: Layers) -> list[Any]:
    """A whole-state checkpoint of any mlx-lm cache list (recurrent, rotating, ...)."""
    # Every mlx-lm cache class rebuilds itself from its state (`from_state`).
    copies = [cast(Any, type(c)).from_state(_copy_state(c.state)) for c in layers]
    mx.eval([c.state for c in copies])
    return copies


def from_snapshot(checkpoint: list[Any]) -> list[Any]:
    """Fresh caches equal to a checkpoint, sharing no array object with it."""
    return [type(c).from_state(_copy_state(c.state)) for c in checkpoint]


def state_nbytes(layers: Layers) -> int:
    """Bytes of the arrays in a cache list's states."""
    leaves = tree_flatten([c.state for c in layers])
    return sum(int(v.nbytes) for _, v in list(leaves) if isinstance(v, mx.array))
