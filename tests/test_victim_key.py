"""`victim_key` is the eviction policy: the index's fast victim pick is its minimum."""

from __future__ import annotations

import numpy as np
from naive_index import usable

from mlxcache.cache.index import Entry, PromptIndex
from mlxcache.cache.order import victim_key


def spec_victim(index: PromptIndex, prompt: list[int], skip: Entry | None) -> Entry | None:
    candidates = [e for e in index if not e.pins and e is not skip]
    key = lambda e: victim_key(e, usable(e.tokens.tolist(), e.trimmable, prompt, 2) > 0)  # noqa: E731
    return min(candidates, key=key, default=None)


def test_pick_is_the_minimum_of_victim_key() -> None:
    rng = np.random.default_rng(11)
    index = PromptIndex(block_size=2)
    stems = [list(rng.integers(0, 4, size=6)) for _ in range(4)]
    checked = 0
    for _ in range(600):
        stem = stems[rng.integers(len(stems))]
        tokens = [
            int(t)
            for t in [*stem[: rng.integers(1, 7)], *rng.integers(0, 4, size=rng.integers(0, 3))]
        ]
        entries = list(index)
        op = rng.integers(5)
        if op <= 1 or not entries:
            if len(index) < 40:
                index.add(tokens, trimmable=bool(rng.integers(4)))
        elif op == 2:
            e = entries[rng.integers(len(entries))]
            index.unpin(e) if e.pins and rng.integers(2) else index.pin(e)
        elif op == 3:
            index.lookup(tokens)
        else:
            victim = index.victim(prompt=tokens)
            if victim is not None:
                index.remove(victim)
        entries = list(index)
        skip = entries[rng.integers(len(entries))] if entries and rng.integers(2) else None
        assert index.victim(skip=skip, prompt=tokens) is spec_victim(index, tokens, skip)
        checked += 1
    assert checked == 600 and len(index) > 5
