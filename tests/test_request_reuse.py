"""A request is reusable, or refuses reuse, by one rule (`request.take_processors`): its
stateful logits processors (a grammar matcher, a thinking budget) serve one reply; a second
submission of them is a clear error, never a silently degenerate reply. Front ends that
submit the same work again build a new request each time."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
from mlx_lm.sample_utils import make_logits_processors

from mlxcache.cache.base import NoCache
from mlxcache.config import CacheConfig
from mlxcache.engine import Engine, Request
from mlxcache.errors import UserInputError
from mlxcache.model import LoadedModel
from mlxcache.modes import json_mode
from mlxcache.modes.reasoning import Thinking, ThinkingBudget
from mlxcache.regress.runner import run_sequential
from mlxcache.regress.suite import Case
from mlxcache.runtime import make_cache
from mlxcache.sampling import SamplingParams

BOOLEAN = json_mode.JsonTask.create({"type": "boolean"})
PARAMS = SamplingParams(max_tokens=8)


def _json_request(engine: Engine) -> Request:
    ids = engine.encoder.encode_chat(BOOLEAN.messages("Is it?"))
    return json_mode.request(engine, ids, BOOLEAN, PARAMS)


def test_a_used_grammar_request_is_refused(tiny: LoadedModel) -> None:
    """Submitted again (alone or in a batch, on any engine), a request whose grammar served
    a reply is refused before anything is queued; a new request gives the first reply."""
    engine = Engine(tiny)
    used = _json_request(engine)
    first = engine.complete(used)
    assert json_mode.read_reply(BOOLEAN, first).error is None
    for again in (engine, Engine(tiny, NoCache(tiny.model, 16))):
        with pytest.raises(UserInputError, match="submitted before"):
            again.submit(used)
        assert not again.busy
    with pytest.raises(UserInputError, match="submitted before"):
        list(engine.generate(used))
    assert engine.complete(_json_request(engine)).tokens == first.tokens


def test_a_thinking_budget_serves_one_reply(tiny: LoadedModel) -> None:
    thinking = Thinking("<think>", "</think>", enabled=True, opened=True)
    engine = Engine(tiny)
    ids = engine.encoder.encode_chat([{"role": "user", "content": "Hm?"}])
    used = Request(ids, PARAMS, [ThinkingBudget(thinking, tiny.tokenizer, 2)])
    engine.complete(used)
    with pytest.raises(UserInputError, match="submitted before"):
        engine.submit(Request(ids, PARAMS, used.processors))  # the same processor, new request


def test_a_request_without_state_is_reusable(tiny: LoadedModel) -> None:
    """Plain functions (mlx-lm's penalties and bias) hold no state: the same request again
    gives the same reply."""
    engine = Engine(tiny)
    ids = engine.encoder.encode_chat([{"role": "user", "content": "Hi."}])
    bias = make_logits_processors(logit_bias={5: 3.0})
    request = Request(ids, SamplingParams(max_tokens=6, temperature=0.8, seed=3), bias)
    assert engine.complete(request).tokens == engine.complete(request).tokens


def test_a_refused_request_leaves_the_engine_going(tiny: LoadedModel) -> None:
    engine = Engine(tiny)
    used = _json_request(engine)
    engine.complete(used)
    with pytest.raises(UserInputError):
        engine.submit(used)
    fresh = _json_request(engine)
    rid = engine.submit(fresh)
    assert [e.request_id for e in engine.run()][-1] == rid


def test_regress_runs_a_json_case_twice_with_new_requests(
    tiny: LoadedModel, tmp_path: Path
) -> None:
    """The regress variants (and `bench spec`'s rounds) run a case again on one engine:
    each run builds its own requests, so both give the same valid replies."""
    case = Case(
        "yes-no",
        "json",
        None,
        PARAMS,
        {"schema": {"type": "boolean"}, "prompts": ["Is it?", "Is it not?"]},
    )
    engine = Engine(tiny, make_cache(tiny, CacheConfig(directory=tmp_path, block_size=16)))
    first = run_sequential(lambda _c: engine, (case,))
    assert run_sequential(lambda _c: engine, (case,)) == first
    assert all(o["finish_reason"] == "stop" for o in first["yes-no"])


def test_the_worker_fails_a_used_request_and_goes_on(tiny: LoadedModel) -> None:
    """Through the engine thread (serve, chat's backend), a used request fails with the
    same words, and the next request runs."""
    from mlxcache.errors import GenerationError
    from mlxcache.worker import EngineWorker

    engine = Engine(tiny)
    used = _json_request(engine)
    with EngineWorker(engine) as worker:
        first = worker.complete(used)
        with pytest.raises(GenerationError, match="submitted before"):
            worker.complete(used)
        assert worker.complete(_json_request(engine)).tokens == first.tokens


@dataclasses.dataclass
class _EqProcessor:
    """A processor a library user may write: an `eq` dataclass (not hashable)."""

    calls: int = 0

    def __call__(self, tokens: Any, logits: Any) -> Any:
        self.calls += 1
        return logits


class _SlotsProcessor:
    """A processor with `__slots__` and no `__weakref__` (no weak reference to it)."""

    __slots__ = ("calls",)

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, tokens: Any, logits: Any) -> Any:
        self.calls += 1
        return logits


@pytest.mark.parametrize("make", [_EqProcessor, _SlotsProcessor])
def test_any_processor_object_serves_one_reply(tiny: LoadedModel, make: Any) -> None:
    """Reuse is told by the processor's identity: one that is not hashable, or takes no
    weak reference, is refused the second time too (never a TypeError)."""
    engine = Engine(tiny)
    processor = make()
    engine.complete(Request([5, 6, 7], PARAMS, [processor]))
    assert processor.calls > 0
    with pytest.raises(UserInputError, match="submitted before"):
        engine.submit(Request([5, 6, 7], PARAMS, [processor]))
    assert engine.complete(Request([5, 6, 7], PARAMS, [make()])).tokens
