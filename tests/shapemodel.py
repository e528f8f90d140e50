"""A shape-sensitive wrapper of a model: the bits of every position depend on the call.

MLX's CPU kernels give the same bits whatever a call's shape, so on CPU "resumed ==
fresh" would hold even for a wrong prefill schedule. Metal's kernels do not. This
wrapper gives the CPU Metal's teeth: each forward call adds a tiny perturbation that is
a function of (start offset, tokens in the call, batch size) to the input embeddings
(so it reaches every layer's keys and values, which the cache stores) and to the output
logits. A position computed by a decode step, by the chunk [0,8) or by [4,8) after
[0,4) then has different bits in its KV and logits.
"""

from __future__ import annotations

import dataclasses
import zlib
from typing import Any

import mlx.core as mx
from spy import offset

from mlxcache.model import LoadedModel

EPS = 1e-4


def shape_factor(start: int, n: int, batch: int) -> float:
    """A deterministic number in [0.5, 1.5) that differs between call shapes."""
    return 0.5 + zlib.crc32(f"{start},{n},{batch}".encode()) / 2**32


def _pattern(size: int, dtype: mx.Dtype) -> mx.array:
    return mx.sin(mx.arange(size, dtype=mx.float32) * 0.7 + 0.3).astype(dtype)


class Shaped:
    """Forwards to an mlx-lm model (one with `input_embeddings`), perturbed per call shape."""

    def __init__(self, model: Any) -> None:
        self._model = model

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)

    def __call__(self, x: mx.array, cache: list[Any]) -> mx.array:
        eps = EPS * shape_factor(offset(cache), int(x.shape[1]), int(x.shape[0]))
        h = self._model.model.embed_tokens(x)
        h = h + eps * _pattern(h.shape[-1], h.dtype)
        out = self._model(x, cache=cache, input_embeddings=h)
        return out + eps * _pattern(out.shape[-1], out.dtype)


def shaped(loaded: LoadedModel) -> LoadedModel:
    """The model made shape-sensitive (a key of its own: it computes other bits)."""
    return dataclasses.replace(loaded, model=Shaped(loaded.model), key=loaded.key + "-shaped")


class Checkpointed:
    """Forwards to a model whose first layer's cache is of a kind the store has no block
    layout for (ConcatenateKVCache): it keeps whole-state checkpoints for such a model."""

    def __init__(self, model: Any) -> None:
        self._model = model

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)

    def __call__(self, *args: Any, **kwargs: Any) -> mx.array:
        return self._model(*args, **kwargs)

    def make_cache(self) -> list[Any]:
        from mlx_lm.models.cache import ConcatenateKVCache, make_prompt_cache

        return [ConcatenateKVCache(), *make_prompt_cache(self._model)[1:]]


def checkpointed(loaded: LoadedModel) -> LoadedModel:
    """The model with a first-layer cache kind that makes the store keep whole-state
    checkpoints (of every layer: recurrent states included)."""
    return dataclasses.replace(loaded, model=Checkpointed(loaded.model))
