"""A prompt's last logits without the LM head over every position.

An mlx-lm model's forward runs its backbone, then its head (the vocabulary projection, a
softcap or a scale: all per position) over every position it was fed. A prefill needs the
logits of the last position only, and MLX computes the head's whole (positions x vocab)
product before a slice of it is read: on SmolLM2 the head is about a fifth of a forward's
work, so a 37-token prompt paid ~0.8 s for 36 rows nobody reads. mlx-lm's own
`generate_step` never evaluates the head over the prompt (its last token runs alone).

`last_logits` cuts the backbone's output to the last position for the duration of one
forward, so the head runs on that row alone. The backbone's work, and so every layer's
KV, is unchanged; the row's logits are computed by the same head over the same hidden
state (every prefill's last logits are computed this way, so a resumed prompt's and a
fresh one's come from the same operations).
"""

from __future__ import annotations

import threading
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from mlxcache.types import Layers, Model

BACKBONES = ("model", "backbone", "transformer")
"""Where mlx-lm's model classes keep the module their head reads (the first one found)."""


class _LastPosition:
    """A backbone as the model's forward sees it during `last_logits`: its output cut to
    the last position on the thread that cut it (any other thread sees it whole)."""

    def __init__(self, backbone: nn.Module) -> None:
        self._backbone = backbone
        self._thread = threading.get_ident()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        out = self._backbone(*args, **kwargs)
        mine = threading.get_ident() == self._thread
        if not mine or not isinstance(out, mx.array) or out.ndim != 3:
            return out
        return out[:, -1:, :]

    def __getattr__(self, name: str) -> Any:  # the head reads the backbone's embeddings
        return getattr(self._backbone, name)


def _backbone_of(model: Model) -> tuple[nn.Module, str] | None:
    """The module whose forward calls the backbone, and the attribute it calls it by,
    through wrappers that forward to the model they keep as `_model` (`QuantizedKV`, the
    tests' spies); None where there is none (a model that wraps another, a test double):
    its forward is then left whole."""
    inner: Any = model
    while not isinstance(inner, nn.Module):
        inner = getattr(inner, "__dict__", {}).get("_model")
        if inner is None:
            return None
    for name in BACKBONES:
        if isinstance(inner.get(name), nn.Module) and name not in vars(inner):
            return inner, name
    return None


def last_logits(model: Model, inputs: mx.array, layers: Layers) -> mx.array:
    """`model(inputs, cache=layers)[:, -1, :]`, lazy, with the head applied to the last
    position only (where the model has a backbone to cut: `BACKBONES`)."""
    found = _backbone_of(model)
    if found is None:
        return model(inputs, cache=layers)[:, -1, :]
    module, name = found
    # An instance attribute is found before the module's child of the same name, and
    # goes with `del`: the model's parameters and children never change.
    object.__setattr__(module, name, _LastPosition(module[name]))
    try:
        return model(inputs, cache=layers)[:, -1, :]
    finally:
        del vars(module)[name]
