"""A model wrapper that records every forward call, to check the prefill schedule itself."""

from __future__ import annotations

import dataclasses
from typing import Any

import mlx.core as mx

from mlxcache.model import LoadedModel


class Spy:
    """Forwards to the model; records (start position, tokens in the call, last logits)."""

    def __init__(self, model: Any) -> None:
        self._model = model
        self.calls: list[tuple[int, int]] = []
        self.last_logits: list[mx.array] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)

    def __call__(self, x: mx.array, cache: list[Any]) -> mx.array:
        self.calls.append((int(cache[0].offset), int(x.shape[1])))
        out = self._model(x, cache=cache)
        self.last_logits.append(out[:, -1, :])
        return out

    def reset(self) -> None:
        self.calls.clear()
        self.last_logits.clear()


def spied(loaded: LoadedModel) -> tuple[LoadedModel, Spy]:
    spy = Spy(loaded.model)
    return dataclasses.replace(loaded, model=spy), spy
