"""A model wrapper that records every forward call, to check the prefill schedule itself."""

from __future__ import annotations

import dataclasses
from typing import Any

import mlx.core as mx

from mlxcache.model import LoadedModel


class Spy:
    """Forwards to the model; records each call's (start position, tokens in the call), its
    batch size, which cache list it ran on (one per lane) and its last logits."""

    def __init__(self, model: Any) -> None:
        self._model = model
        self.calls: list[tuple[int, int]] = []
        self.batch_sizes: list[int] = []
        self.lanes: list[int] = []  # id() of each call's cache list
        self._held: list[Any] = []  # ...kept alive, so that no other lane reuses an id
        self.last_logits: list[mx.array] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)

    def __call__(self, x: mx.array, cache: list[Any]) -> mx.array:
        self.calls.append((offset(cache), int(x.shape[1])))
        self.batch_sizes.append(int(x.shape[0]))
        self.lanes.append(id(cache))
        self._held.append(cache)
        out = self._model(x, cache=cache)
        self.last_logits.append(out[:, -1, :])
        return out

    def reset(self) -> None:
        self.calls.clear()
        self.batch_sizes.clear()
        self.lanes.clear()
        self._held.clear()
        self.last_logits.clear()


def offset(cache: list[Any]) -> int:
    """Tokens the caches hold: an attention layer's offset (a recurrent layer has none; a
    batch of rows: its longest row's)."""
    held = next(c.offset for c in cache if hasattr(c, "offset"))
    return int(mx.max(held).item()) if isinstance(held, mx.array) else int(held)


def spied(loaded: LoadedModel) -> tuple[LoadedModel, Spy]:
    spy = Spy(loaded.model)
    return dataclasses.replace(loaded, model=spy), spy
