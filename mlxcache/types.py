"""What mlxcache uses of mlx-lm's objects, as protocols.

mlx-lm ships no type hints, so to mypy its models, layer caches and tokenizer wrapper are
`Any`. These protocols name the part of each that mlxcache calls: a signature says what it
needs, and a use outside it fails type checking. They only describe: mlx-lm's own objects
are passed as they are (and test doubles that wrap them need only this much).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING, Any, Protocol, cast

import mlx.core as mx

if TYPE_CHECKING:
    import mlx.nn as nn
    from mlx_lm.tokenizer_utils import TokenizerWrapper


class LayerCache(Protocol):
    """One layer's cache as mlx-lm's `make_prompt_cache` makes it (`KVCache`,
    `RotatingKVCache`, `ArraysCache`, ...): its arrays are its `state`."""

    @property
    def state(self) -> Any: ...

    @state.setter
    def state(self, value: Any) -> None: ...

    def is_trimmable(self) -> bool: ...


class KVLayer(LayerCache, Protocol):
    """A plain attention layer's cache (`KVCache`): keys and values of `offset` tokens
    (the arrays may be longer: mlx-lm grows them in steps)."""

    keys: mx.array
    values: mx.array
    offset: int

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]: ...

    def trim(self, n: int) -> int: ...


Layers = Sequence[LayerCache]
"""A model's caches, one per layer, in layer order."""


class Model(Protocol):
    """An mlx-lm model: token ids (batch, length) in, logits (batch, length, vocab) out,
    each layer's cache in `cache` extended by the call."""

    def __call__(self, inputs: mx.array, cache: Layers | None = None) -> mx.array: ...

    @property
    def layers(self) -> Sequence[Any]:
        """Its blocks (`make_prompt_cache` makes one cache per block)."""
        ...


class Tokenizer(Protocol):
    """mlx-lm's `TokenizerWrapper` (a Hugging Face tokenizer underneath), as far as
    mlxcache uses it."""

    eos_token_ids: Collection[int]
    bos_token: str | None
    chat_template: str | None
    vocab_size: int

    @property
    def vocab(self) -> dict[str, int]: ...

    @property
    def detokenizer(self) -> Any:
        """mlx-lm's streaming detokenizer (its byte-level `tokenmap`, where it has one)."""
        ...

    def __len__(self) -> int: ...

    def __hash__(self) -> int:
        """By identity: what is derived from a tokenizer is kept per tokenizer."""
        ...

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str: ...

    def apply_chat_template(self, conversation: list[dict[str, Any]], **kwargs: Any) -> Any:
        """Token ids, or the text with `tokenize=False`."""
        ...


# mlx-lm's functions are typed to take its own classes; these say that ours are those.


def as_module(model: Model) -> nn.Module:
    """`model` as mlx-lm's functions take it: the `nn.Module` it is."""
    return cast("nn.Module", model)


def as_wrapper(tokenizer: Tokenizer) -> TokenizerWrapper:
    """`tokenizer` as mlx-lm's functions take it: the `TokenizerWrapper` it is."""
    return cast("TokenizerWrapper", tokenizer)


def new_layers(model: Model) -> list[LayerCache]:
    """Fresh, empty caches for `model`, one per layer (mlx-lm's `make_prompt_cache`), its
    sliding windows kept in time order (`ring.TimeRing`)."""
    from mlx_lm.models.cache import make_prompt_cache  # mlx_lm imports transformers

    from mlxcache.ring import time_ordered

    return time_ordered(list(make_prompt_cache(as_module(model))))


def positions(layers: Layers, most: int) -> int:
    """How many positions `layers` hold, at most `most`: their attention layers' count (a
    model of recurrent layers only holds every token fed to it)."""
    counts = [getattr(c, "offset", None) for c in layers]
    return min([*(n for n in counts if isinstance(n, int)), most])
