"""`PromptIndex` against the naive reference, operation by operation, on random workloads.

The second half proves the harness has teeth: each mutant below breaks one rule of the
reference the way an optimized implementation plausibly could, and the harness must notice.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import pytest
from index_harness import OPS, Run
from naive_index import NaiveEntry, NaiveIndex


def _runs(
    store: int,
    block_size: int,
    seeds: Sequence[int],
    ops: int,
    max_blocks: int = 12,
    mix: Sequence[str] = OPS,
) -> Counter[str]:
    total: Counter[str] = Counter()
    for seed in seeds:
        for internal in (False, True):
            run = Run(
                NaiveIndex,
                seed=seed,
                store=store,
                block_size=block_size,
                internal_evict=internal,
                max_blocks=max_blocks,
                ops=mix,
            )
            total += run.run(ops)
    print(dict(total))
    return total


def test_small_store_block_4() -> None:
    stats = _runs(store=24, block_size=4, seeds=range(4), ops=700)
    assert stats["evictions"] >= 1000, stats
    assert min(stats[k] for k in ("hits", "misses", "expire", "pin", "unpin", "remove")) > 50


def test_small_store_block_1() -> None:
    stats = _runs(store=24, block_size=1, seeds=range(2), ops=600, max_blocks=40)
    assert stats["evictions"] >= 250, stats


def test_large_store() -> None:
    # Mostly adds, so the store fills up and then evicts on almost every add.
    stats = _runs(store=200, block_size=4, seeds=[7], ops=1000, mix=("add",) * 6 + OPS)
    assert stats["evictions"] >= 50, stats


# Mutants of the reference. Each must make the harness fail.


class ExpiredExtenders(NaiveIndex):
    def extends(self, f: NaiveEntry, e: NaiveEntry) -> bool:
        return f.born > e.born and f.trimmable and f.tokens[: len(e.tokens)] == e.tokens != f.tokens


class NonTrimmableExtenders(NaiveIndex):
    def extends(self, f: NaiveEntry, e: NaiveEntry) -> bool:
        return (
            not f.expired and f.born > e.born and f.tokens[: len(e.tokens)] == e.tokens != f.tokens
        )


class OlderExtenders(NaiveIndex):
    def extends(self, f: NaiveEntry, e: NaiveEntry) -> bool:
        return not f.expired and f.trimmable and f.tokens[: len(e.tokens)] == e.tokens != f.tokens


class NoUsefulnessClass(NaiveIndex):
    def victim_key(self, e: NaiveEntry, prompt: Sequence[int] | None) -> tuple[int, ...]:
        cls, _, *rest = super().victim_key(e, prompt)
        return (cls, *rest)


class UsefulFirst(NaiveIndex):
    def victim_key(self, e: NaiveEntry, prompt: Sequence[int] | None) -> tuple[int, ...]:
        cls, useful, *rest = super().victim_key(e, prompt)
        return (cls, -useful, *rest)


class ExpiredNotFirst(NaiveIndex):
    def victim_key(self, e: NaiveEntry, prompt: Sequence[int] | None) -> tuple[int, ...]:
        cls, *rest = super().victim_key(e, prompt)
        return (max(cls, 1), *rest)


class OldestBornFirst(NaiveIndex):
    def victim_key(self, e: NaiveEntry, prompt: Sequence[int] | None) -> tuple[int, ...]:
        cls, useful, last_used, born = super().victim_key(e, prompt)
        return (cls, useful, born, last_used)


class NoBlockFloor(NaiveIndex):
    def usable(self, e: NaiveEntry, prompt: Sequence[int]) -> int:
        if e.trimmable and not e.expired:
            return max(0, min(_lcp(e.tokens, prompt), len(prompt) - 1))
        return super().usable(e, prompt)


class NoPromptCap(NaiveIndex):
    def usable(self, e: NaiveEntry, prompt: Sequence[int]) -> int:
        if e.trimmable and not e.expired:
            return _lcp(e.tokens, prompt) // self.block_size * self.block_size
        return super().usable(e, prompt)


class ExpiredUsable(NaiveIndex):
    def usable(self, e: NaiveEntry, prompt: Sequence[int]) -> int:
        expired, e.expired = e.expired, False
        try:
            return super().usable(e, prompt)
        finally:
            e.expired = expired


class NonTrimmableWholePrompt(NaiveIndex):
    def usable(self, e: NaiveEntry, prompt: Sequence[int]) -> int:
        if not e.trimmable and not e.expired and tuple(prompt[: len(e.tokens)]) == e.tokens:
            return len(e.tokens)
        return super().usable(e, prompt)


class NonTrimmableFloored(NaiveIndex):
    def usable(self, e: NaiveEntry, prompt: Sequence[int]) -> int:
        n = super().usable(e, prompt)
        return n if e.trimmable else n // self.block_size * self.block_size


class NewestOnTie(NaiveIndex):
    def lookup_key(self, e: NaiveEntry, usable: int) -> tuple[int, int, int]:
        return (usable, e.born, -len(e.tokens))


class LongestOnTie(NaiveIndex):
    def lookup_key(self, e: NaiveEntry, usable: int) -> tuple[int, int, int]:
        return (usable, len(e.tokens), e.born)


class HitIsNoUse(NaiveIndex):
    def touch(self, e: NaiveEntry) -> None:
        if _caller() != "lookup":
            super().touch(e)


class ReaddKeepsExpired(NaiveIndex):
    def readd(self, e: NaiveEntry, nbytes: int) -> None:
        expired = e.expired
        super().readd(e, nbytes)
        e.expired = expired


class ReaddIsNoUse(NaiveIndex):
    def readd(self, e: NaiveEntry, nbytes: int) -> None:
        e.expired, e.nbytes = False, nbytes


class ReaddKeepsNbytes(NaiveIndex):
    def readd(self, e: NaiveEntry, nbytes: int) -> None:
        super().readd(e, e.nbytes)


class ReaddTakesTrimmable(NaiveIndex):
    def add(self, tokens: Sequence[int], trimmable: bool = True, nbytes: int = 0) -> NaiveEntry:
        e = super().add(tokens, trimmable, nbytes)
        e.trimmable = trimmable
        return e


class EvictsAddedPrompt(NaiveIndex):
    """Slot eviction that ignores the prompt being added."""

    def victim(
        self, skip: NaiveEntry | None = None, prompt: Sequence[int] | None = None
    ) -> NaiveEntry | None:
        return super().victim(skip, None if _caller() == "add" else prompt)


def _lcp(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _caller() -> str:
    import sys

    return sys._getframe(2).f_code.co_name


MUTANTS = [
    ExpiredExtenders,
    NonTrimmableExtenders,
    OlderExtenders,
    NoUsefulnessClass,
    UsefulFirst,
    ExpiredNotFirst,
    OldestBornFirst,
    NoBlockFloor,
    NoPromptCap,
    ExpiredUsable,
    NonTrimmableWholePrompt,
    NonTrimmableFloored,
    NewestOnTie,
    LongestOnTie,
    HitIsNoUse,
    ReaddKeepsExpired,
    ReaddIsNoUse,
    ReaddKeepsNbytes,
    ReaddTakesTrimmable,
    EvictsAddedPrompt,
]


@pytest.mark.parametrize("mutant", MUTANTS, ids=lambda m: m.__name__)
def test_harness_catches(mutant: type[NaiveIndex]) -> None:
    with pytest.raises(AssertionError):
        for seed in range(3):
            for internal in (False, True):
                Run(mutant, seed=seed, store=24, block_size=4, internal_evict=internal).run(300)
