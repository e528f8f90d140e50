"""Sampling settings and samplers with explicit randomness (no global `mx.random.seed`).

The filters (top-p, min-p, top-k) and the repetition penalty are mlx-lm's own
(`mlx_lm.sample_utils`); only the draw is ours, so that every request owns its key stream.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, fields
from numbers import Integral, Real

import mlx.core as mx

from mlxcache.errors import Setting, SettingError, Worded

# mlx_lm is imported where a sampler is built, not here: importing it imports transformers
# (seconds), and the CLI reads SamplingParams' defaults at start-up.

Sampler = Callable[[mx.array], mx.array]
"""logprobs (1, vocab) -> token id array (1,)."""

LogitsProcessor = Callable[[mx.array, mx.array], mx.array]
"""mlx-lm's contract: (prompt + generated token ids, logits (1, vocab)) -> logits."""


def _invalid(name: str, why: str) -> SettingError:
    return SettingError(Worded(Setting(name), why))


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to pick tokens. temperature 0 is greedy; a seed makes sampling reproducible.

    top_k 0, min_p 0, repetition_penalty 1 and the presence and frequency penalties 0
    switch their step off. The repetition penalty looks at the last `repetition_context`
    tokens of prompt + reply, so it is the same whether the prompt was resumed from the
    cache or prefilled. The presence and frequency penalties are OpenAI's: subtracted from
    the logit of each token the reply has so far, once (presence) or per occurrence
    (frequency); the prompt plays no part.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    max_tokens: int = 256
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    repetition_context: int = 20
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0

    def __post_init__(self) -> None:
        # Types first (settings also come from JSON files): a float seed or a string
        # temperature would otherwise fail deep inside MLX, or be silently coerced.
        for f in fields(self):
            value = getattr(self, f.name)
            whole = isinstance(f.default, int)
            if isinstance(value, bool) or not isinstance(value, Integral if whole else Real):
                kind = "an integer" if whole else "a number"
                raise _invalid(f.name, f" must be {kind}, got {value!r}")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise _invalid("temperature", f" must be a finite number >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise _invalid("top_p", f" must be in (0, 1], got {self.top_p}")
        if self.max_tokens < 1:
            raise _invalid("max_tokens", f" must be >= 1, got {self.max_tokens}")
        if not 0 <= self.seed < 2**63:
            raise _invalid("seed", f" must be in [0, 2**63), got {self.seed}")
        if self.top_k < 0:
            raise _invalid("top_k", f" must be >= 0, got {self.top_k}")
        if not 0.0 <= self.min_p < 1.0:
            raise _invalid("min_p", f" must be in [0, 1), got {self.min_p}")
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0):
            raise _invalid("repetition_penalty", f" must be > 0, got {self.repetition_penalty}")
        if self.repetition_context < 1:
            raise _invalid("repetition_context", f" must be >= 1, got {self.repetition_context}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:  # OpenAI's range (NaN is outside it too)
                raise _invalid(name, f" must be in [-2, 2], got {value}")


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
