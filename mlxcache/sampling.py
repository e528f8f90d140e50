"""Sampling settings and samplers with explicit randomness (no global `mx.random.seed`).

The filters (top-p, min-p, top-k) and the repetition penalty are mlx-lm's own
(`mlx_lm.sample_utils`); only the draw is ours, so that every request owns its key stream.
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx

# SamplingParams (settings only, no MLX) lives in config.py and is imported here as well:
# the CLI reads its defaults at start-up, before anything needs MLX. mlx_lm is imported
# where a sampler is built: importing it imports transformers (seconds).
from mlxcache.config import SamplingParams

Sampler = Callable[[mx.array], mx.array]
"""logprobs (1, vocab) -> token id array (1,)."""

LogitsProcessor = Callable[[mx.array, mx.array], mx.array]
"""mlx-lm's contract: (prompt + generated token ids, logits (1, vocab)) -> logits."""


def make_processors(params: SamplingParams, prompt: int) -> list[LogitsProcessor]:
    """The logits processors `params` asks for (none by default), for a reply after a
    prompt of `prompt` tokens (processors are called with prompt + reply)."""
    if params.repetition_penalty == 1.0 and not (
        params.presence_penalty or params.frequency_penalty
    ):
        return []
    from mlx_lm.sample_utils import make_logits_processors

    procs: list[LogitsProcessor] = []
    if params.repetition_penalty != 1.0:
        procs += make_logits_processors(
            repetition_penalty=params.repetition_penalty,
            repetition_context_size=params.repetition_context,
        )
    # The reply never exceeds max_tokens, so that window counts all of it.
    reply = make_logits_processors(
        presence_penalty=params.presence_penalty,
        presence_context_size=params.max_tokens,
        frequency_penalty=params.frequency_penalty,
        frequency_context_size=params.max_tokens,
    )
    return procs + [on_reply(proc, prompt) for proc in reply]


def on_reply(proc: LogitsProcessor, prompt: int) -> LogitsProcessor:
    """`proc` seeing only the reply's tokens (decode passes prompt + reply)."""
    return lambda tokens, logits: proc(tokens[prompt:], logits)


def make_sampler(params: SamplingParams) -> Sampler:
    """A sampler owning its own key stream: step i always draws with key i of `seed`.

    Replies therefore depend only on (seed, logits), never on other requests in flight.
    """
    if params.temperature == 0:
        return greedy
    from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

    key = mx.random.key(params.seed)
    inv_temp = 1.0 / params.temperature
    filters: list[Callable[[mx.array], mx.array]] = []
    if params.top_p < 1.0:
        filters.append(lambda lp: apply_top_p(lp, params.top_p))
    if params.min_p > 0.0:
        filters.append(lambda lp: apply_min_p(lp, params.min_p))
    if params.top_k > 0:
        # mlx-lm rejects k >= vocab; keeping every token is what such a k means.
        filters.append(
            lambda lp: lp if params.top_k >= lp.shape[-1] else apply_top_k(lp, params.top_k)
        )

    def sample(logprobs: mx.array) -> mx.array:
        nonlocal key
        key, sub = mx.random.split(key)
        kept = logprobs
        for keep in filters:
            kept = keep(kept)
        scaled = kept * inv_temp
        # A temperature so close to 0 that 1/T overflows the logits' dtype, or a top-p that
        # rounds to 0, leaves no finite logit, and a draw among those picks any token, the
        # least likely included: take their common limit, the most likely token (greedy).
        # Otherwise the draw is used as is (the same key, the same token as without this).
        usable = mx.isfinite(mx.max(scaled, axis=-1))
        return mx.where(usable, mx.random.categorical(scaled, key=sub), greedy(logprobs))

    return sample


def greedy(logprobs: mx.array) -> mx.array:
    """The most likely token (temperature 0)."""
    return mx.argmax(logprobs, axis=-1)
