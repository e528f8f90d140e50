"""Sampling settings and samplers with explicit randomness (no global `mx.random.seed`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx

Sampler = Callable[[mx.array], mx.array]
"""logprobs (1, vocab) -> token id array (1,)."""


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to pick tokens. temperature 0 is greedy; a seed makes sampling reproducible."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    max_tokens: int = 256

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not 0 <= self.seed < 2**63:
            raise ValueError(f"seed must be in [0, 2**63), got {self.seed}")


def _top_p(logprobs: mx.array, top_p: float) -> mx.array:
    sorted_lp = mx.sort(logprobs, axis=-1)
    probs = mx.exp(sorted_lp)
    mass_above = mx.cumsum(probs, axis=-1, reverse=True, inclusive=False)
    dropped = (mass_above >= top_p).sum(axis=-1, keepdims=True)
    threshold = mx.take_along_axis(sorted_lp, dropped, axis=-1)
    return mx.where(logprobs < threshold, -mx.inf, logprobs)


def make_sampler(params: SamplingParams) -> Sampler:
    """A sampler owning its own key stream: step i always draws with key i of `seed`.

    Replies therefore depend only on (seed, logits), never on other requests in flight.
    """
    if params.temperature == 0:
        return lambda logprobs: mx.argmax(logprobs, axis=-1)

    key = mx.random.key(params.seed)
    inv_temp = 1.0 / params.temperature

    def sample(logprobs: mx.array) -> mx.array:
        nonlocal key
        key, sub = mx.random.split(key)
        if params.top_p < 1.0:
            logprobs = _top_p(logprobs, params.top_p)
        return mx.random.categorical(logprobs * inv_temp, key=sub)

    return sample
