"""Quantized KV (`--kv-bits`): attention layers keep their keys and values quantized, as
mlx-lm's `QuantizedKVCache` does, and attention runs on the quantized cache.

Exact by construction: a position's quantized keys and values depend only on its own keys
and values (the groups run along the head dimension), and they are quantized from token 0,
as each prefill chunk or decode step computes them (never "from token N of this request",
as mlx-lm's `--quantized-kv-start`): a resumed prompt and a cold one hold the same bits,
and the prompt cache keeps quantized blocks (`cache.layout`: on SmolLM2's float32 KV,
3.5x the prefixes per byte at 8 bits and 6.4x at 4; in their own namespace). Layers mlx-lm has no quantized form for (sliding windows,
recurrent states) stay in full precision, said once.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, cast

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.models.cache import KVCache, make_prompt_cache

from mlxcache.config import KV_GROUP_SIZES
from mlxcache.errors import UserInputError
from mlxcache.model.loader import LoadedModel
from mlxcache.types import as_module, new_layers


class QuantizedKV:
    """Forwards to an mlx-lm model whose plain KV layers' caches are quantized."""

    def __init__(self, model: Any, bits: int, group_size: int) -> None:
        self._model = model
        self.bits = bits
        self.group_size = group_size

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._model(*args, **kwargs)

    def make_cache(self) -> list[Any]:
        return [
            c.to_quantized(self.group_size, self.bits) if type(c) is KVCache else c
            for c in make_prompt_cache(self._model)
        ]


_FLOAT_TYPES: dict[str, str] = {}
"""Model key -> the float type of its parameters (the key covers the dtype): found once."""


def kv_width(loaded: LoadedModel) -> str:
    """What `loaded`'s plain KV layers keep an element in (`Stats.kv`): its quantization's
    bits, else the float type of its parameters, which its activations take ("" where it
    has none)."""
    model = loaded.model
    if isinstance(model, QuantizedKV):
        return f"{model.bits}-bit"
    if loaded.key not in _FLOAT_TYPES:
        arrays = cast(list[tuple[str, Any]], tree_flatten(as_module(model).parameters()))
        floats = (v.dtype for _, v in arrays if mx.issubdtype(v.dtype, mx.floating))
        _FLOAT_TYPES[loaded.key] = str(next(floats, "")).removeprefix("mlx.core.")
    return _FLOAT_TYPES[loaded.key]


def quantize_kv(
    loaded: LoadedModel,
    bits: int,
    group_size: int,
    on_warning: Callable[[str], None] | None = None,
) -> LoadedModel:
    """`loaded` with its plain KV layers quantized to `bits` in groups of `group_size`.

    Raises:
        UserInputError: the group size does not divide the model's attention head size.
    """
    fresh = new_layers(loaded.model)
    plain = sum(type(c) is KVCache for c in fresh)
    warn = on_warning or (lambda _msg: None)
    if plain == 0:
        warn(f"--kv-bits: no layer of {loaded.name} keeps plain KV: its KV stays full precision")
        return loaded
    config = loaded.config
    heads = int(config.get("num_attention_heads") or 1)
    head_dim = int(config.get("head_dim") or int(config.get("hidden_size") or 0) // heads)
    if head_dim % group_size:
        fits = [g for g in KV_GROUP_SIZES if head_dim % g == 0]
        hint = f": try --kv-group-size {fits[-1]}" if fits else ""
        raise UserInputError(
            f"--kv-group-size {group_size} does not divide {loaded.name}'s attention head "
            f"size ({head_dim}){hint}"
        )
    if plain < len(fresh):
        warn(
            f"--kv-bits: {len(fresh) - plain} of {loaded.name}'s {len(fresh)} layers (sliding "
            "window or recurrent) have no quantized form: they stay full precision"
        )
    return dataclasses.replace(loaded, model=QuantizedKV(loaded.model, bits, group_size))
