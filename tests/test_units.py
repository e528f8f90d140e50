"""Units in flight: multi-step units, results in unit order, equal to running alone."""

from __future__ import annotations

from functools import partial

import numpy as np
import pytest

from mlxcache.config import CacheConfig
from mlxcache.engine import Engine, Request
from mlxcache.model import LoadedModel
from mlxcache.runtime import make_cache
from mlxcache.sampling import SamplingParams
from mlxcache.units import Steps, one_request, run_units

P = SamplingParams(max_tokens=3)


def prompt(seed: int, n: int = 9) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(3, 250, size=n)]


def chain(engine: Engine, seed: int, steps: int) -> Steps[list[list[int]]]:
    """A unit whose later steps depend on earlier replies; one step asks nothing."""
    got: list[list[int]] = []
    tokens = prompt(seed)
    for _ in range(steps):
        first, second = yield [Request(tokens, P), Request(prompt(seed + 100), P)]
        got += [first.tokens, second.tokens]
        tokens = [*tokens, *first.tokens]
        assert (yield []) == []
    return got


def alone(engine: Engine, seed: int, steps: int) -> list[list[int]]:
    unit = chain(engine, seed, steps)
    try:
        reqs = next(unit)
        while True:
            reqs = unit.send([engine.complete(r) for r in reqs])
    except StopIteration as stop:
        return stop.value  # type: ignore[no-any-return]


@pytest.mark.parametrize("width", [1, 2, 5])
def test_units_in_order_and_equal_to_alone(tiny: LoadedModel, width: int) -> None:
    engine = Engine(tiny, make_cache(tiny, CacheConfig(block_size=4, disk_bytes=0)))
    plan = [("a", 1, 3), ("b", 2, 1), ("c", 3, 2), ("d", 4, 0)]
    units = [(key, partial(chain, engine, seed, steps)) for key, seed, steps in plan]
    got = list(run_units(engine, units, width))
    assert [k for k, _ in got] == ["a", "b", "c", "d"]
    reference = Engine(tiny, make_cache(tiny, CacheConfig(block_size=4, enabled=False)))
    assert [v for _, v in got] == [alone(reference, seed, steps) for _, seed, steps in plan]
    assert [len(v) for _, v in got] == [6, 2, 4, 0]


def test_one_request_units_and_bad_width(tiny: LoadedModel) -> None:
    engine = Engine(tiny, make_cache(tiny, CacheConfig(block_size=4, enabled=False)))
    units = [(i, partial(one_request, partial(Request, prompt(i), P))) for i in range(3)]
    assert [(k, r.tokens) for k, r in run_units(engine, units, 2)] == [
        (i, engine.complete(Request(prompt(i), P)).tokens) for i in range(3)
    ]
    with pytest.raises(ValueError, match="width must be >= 1, got 0"):
        list(run_units(engine, units, 0))
