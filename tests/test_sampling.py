"""Sampling options (top-k, min-p, the penalties): exact under resume, and each one acts."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from mlxcache.config import CacheConfig
from mlxcache.engine import Engine, Request
from mlxcache.events import Result
from mlxcache.model import LoadedModel
from mlxcache.runtime import make_cache
from mlxcache.sampling import SamplingParams, make_processors

PROMPT = [int(t) for t in np.random.default_rng(7).integers(3, 250, size=22)]


def fresh_engine(tiny: LoadedModel) -> Engine:
    return Engine(tiny, make_cache(tiny, CacheConfig(block_size=4, disk_bytes=0)))


def reply(engine: Engine, params: SamplingParams, tokens: list[int] = PROMPT) -> Result:
    return engine.complete(Request(tokens, params))


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.9, seed=3, top_k=5, max_tokens=8),
        SamplingParams(temperature=1.2, seed=4, min_p=0.05, max_tokens=8),
        SamplingParams(repetition_penalty=1.5, repetition_context=30, max_tokens=8),
        SamplingParams(presence_penalty=1.5, frequency_penalty=-0.5, max_tokens=8),
        SamplingParams(
            temperature=0.7, seed=5, top_p=0.9, top_k=20, min_p=0.02, repetition_penalty=1.2
        ),
    ],
    ids=["top_k", "min_p", "repetition", "presence_frequency", "all"],
)
def test_resumed_equals_fresh(tiny: LoadedModel, params: SamplingParams) -> None:
    warm = fresh_engine(tiny)
    reply(warm, params, PROMPT[:13])  # leaves PROMPT's first 12 tokens (3 blocks) cached
    resumed = reply(warm, params)
    cold = reply(fresh_engine(tiny), params)
    assert resumed.stats.cached_tokens == 12 and cold.stats.cached_tokens == 0
    assert resumed.tokens == cold.tokens and resumed.text == cold.text


def test_each_option_changes_the_reply(tiny: LoadedModel) -> None:
    engine = fresh_engine(tiny)
    greedy = reply(engine, SamplingParams(max_tokens=12)).tokens
    assert len(set(greedy)) < len(greedy)  # the random model repeats itself ...
    penalised = reply(engine, SamplingParams(max_tokens=12, repetition_penalty=2.0)).tokens
    assert penalised != greedy  # ... which the penalty discourages
    # top-k 1 keeps only the best token: any temperature and seed is greedy.
    assert (
        reply(engine, SamplingParams(temperature=5.0, seed=9, top_k=1, max_tokens=12)).tokens
        == greedy
    )
    hot = SamplingParams(temperature=5.0, seed=9, max_tokens=12)
    assert reply(engine, hot).tokens != greedy
    # A k as large as the vocabulary keeps every token: the same draws as no top-k.
    wide = SamplingParams(temperature=5.0, seed=9, max_tokens=12, top_k=10_000)
    assert reply(engine, wide).tokens == reply(engine, hot).tokens


def test_repetition_penalty_scales_recent_logits_only() -> None:
    (proc,) = make_processors(SamplingParams(repetition_penalty=2.0, repetition_context=2), 0)
    logits = mx.array([[4.0, -4.0, 4.0, -4.0]])
    out = proc(mx.array([0, 3, 1]), logits)  # the last 2 tokens: 3 and 1
    assert out.tolist() == [[4.0, -8.0, 4.0, -8.0]]
    assert make_processors(SamplingParams(), 0) == []


def openai_penalties(prompt: int, presence: float, frequency: float) -> Any:
    """OpenAI's definition, written apart: logit[j] -= c[j] * frequency + (c[j] > 0) *
    presence, c[j] counting token j in the reply so far (not the prompt)."""

    def apply(tokens: mx.array, logits: mx.array) -> mx.array:
        counts = np.bincount(np.array(tokens[prompt:]), minlength=logits.shape[-1])
        adjust = frequency * counts + presence * (counts > 0)
        return logits - mx.array(adjust[None, :], dtype=logits.dtype)

    return apply


@pytest.mark.parametrize(("presence", "frequency"), [(2.0, 0.0), (0.0, 1.5), (-1.0, 2.0)])
def test_presence_and_frequency_penalties_count_the_reply_only(
    tiny: LoadedModel, presence: float, frequency: float
) -> None:
    params = SamplingParams(max_tokens=12, presence_penalty=presence, frequency_penalty=frequency)
    engine = fresh_engine(tiny)
    reference = Request(
        PROMPT, SamplingParams(max_tokens=12), [openai_penalties(len(PROMPT), presence, frequency)]
    )
    got = reply(engine, params)
    assert got.tokens == engine.complete(reference).tokens
    assert got.tokens != reply(engine, SamplingParams(max_tokens=12)).tokens


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("top_k", -1, "top_k must be >= 0, got -1"),
        ("min_p", 1.0, "min_p must be in [0, 1), got 1.0"),
        ("repetition_penalty", 0.0, "repetition_penalty must be > 0, got 0.0"),
        ("presence_penalty", 2.5, "presence_penalty must be in [-2, 2], got 2.5"),
        ("frequency_penalty", float("nan"), "frequency_penalty must be in [-2, 2], got nan"),
        ("frequency_penalty", -2.01, "frequency_penalty must be in [-2, 2], got -2.01"),
    ],
)
def test_bad_values(field: str, value: float, message: str) -> None:
    with pytest.raises(ValueError) as info:
        SamplingParams(**{field: value})  # type: ignore[arg-type]
    assert str(info.value) == message
