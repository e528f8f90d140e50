"""`PromptIndex` against the naive reference, operation by operation, on random workloads.

The rest proves the harness has teeth: each mutant of the reference breaks one rule of
the index semantics (docs/architecture.md) the way an optimized implementation plausibly could, each mutant of the index
plants a bug its structures could plausibly have, and the harness must notice every one.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

import pytest
from index_harness import OPS, Run
from naive_index import NaiveEntry, NaiveIndex

from mlxcache.cache import radix
from mlxcache.cache.index import PromptIndex
from mlxcache.cache.order import VictimOrder
from mlxcache.cache.radix import BlockTree, Walk

pytestmark = pytest.mark.slow  # random workloads against the reference, with mutants


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
        for first in (False, True):
            run = Run(
                NaiveIndex,
                seed=seed,
                store=store,
                block_size=block_size,
                evict_first=first,
                max_blocks=max_blocks,
                ops=mix,
            )
            total += run.run(ops)
    return total


def test_small_store_block_4() -> None:
    stats = _runs(store=24, block_size=4, seeds=range(4), ops=700)
    assert stats["evictions"] >= 1000, stats
    assert min(stats[k] for k in ("hits", "misses", "pin", "unpin", "remove")) > 50


def test_small_store_block_1() -> None:
    stats = _runs(store=24, block_size=1, seeds=range(2), ops=600, max_blocks=40)
    assert stats["evictions"] >= 250, stats


def test_large_store() -> None:
    # Mostly adds, so the store fills up and then evicts on almost every add.
    stats = _runs(store=200, block_size=4, seeds=[7], ops=1000, mix=("add",) * 6 + OPS)
    assert stats["evictions"] >= 50, stats


# Mutants of the reference. Each must make the harness fail.


class NonTrimmableExtenders(NaiveIndex):
    def extends(self, f: NaiveEntry, e: NaiveEntry) -> bool:
        return f.born > e.born and f.tokens[: len(e.tokens)] == e.tokens != f.tokens


class OlderExtenders(NaiveIndex):
    def extends(self, f: NaiveEntry, e: NaiveEntry) -> bool:
        return f.trimmable and f.tokens[: len(e.tokens)] == e.tokens != f.tokens


class NoUsefulnessClass(NaiveIndex):
    def victim_key(self, e: NaiveEntry, prompt: Sequence[int] | None) -> tuple[int, ...]:
        cls, _, *rest = super().victim_key(e, prompt)
        return (cls, *rest)


class UsefulFirst(NaiveIndex):
    def victim_key(self, e: NaiveEntry, prompt: Sequence[int] | None) -> tuple[int, ...]:
        cls, useful, *rest = super().victim_key(e, prompt)
        return (cls, -useful, *rest)


class OldestBornFirst(NaiveIndex):
    def victim_key(self, e: NaiveEntry, prompt: Sequence[int] | None) -> tuple[int, ...]:
        cls, useful, last_used, born = super().victim_key(e, prompt)
        return (cls, useful, born, last_used)


class NoBlockFloor(NaiveIndex):
    def usable(self, e: NaiveEntry, prompt: Sequence[int]) -> int:
        if e.trimmable:
            return max(0, min(_lcp(e.tokens, prompt), len(prompt) - 1))
        return super().usable(e, prompt)


class NoPromptCap(NaiveIndex):
    def usable(self, e: NaiveEntry, prompt: Sequence[int]) -> int:
        if e.trimmable:
            return _lcp(e.tokens, prompt) // self.block_size * self.block_size
        return super().usable(e, prompt)


class NonTrimmableWholePrompt(NaiveIndex):
    def usable(self, e: NaiveEntry, prompt: Sequence[int]) -> int:
        if not e.trimmable and tuple(prompt[: len(e.tokens)]) == e.tokens:
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


class ReaddIsNoUse(NaiveIndex):
    def readd(self, e: NaiveEntry, nbytes: int) -> None:
        e.nbytes = nbytes


class ReaddKeepsNbytes(NaiveIndex):
    def readd(self, e: NaiveEntry, nbytes: int) -> None:
        super().readd(e, e.nbytes)


class ReaddTakesTrimmable(NaiveIndex):
    def add(self, tokens: Sequence[int], trimmable: bool = True, nbytes: int = 0) -> NaiveEntry:
        e = super().add(tokens, trimmable, nbytes)
        e.trimmable = trimmable
        return e


def _lcp(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _caller() -> str:
    import sys

    return sys._getframe(2).f_code.co_name


MUTANTS = [
    NonTrimmableExtenders,
    OlderExtenders,
    NoUsefulnessClass,
    UsefulFirst,
    OldestBornFirst,
    NoBlockFloor,
    NoPromptCap,
    NonTrimmableWholePrompt,
    NonTrimmableFloored,
    NewestOnTie,
    LongestOnTie,
    HitIsNoUse,
    ReaddIsNoUse,
    ReaddKeepsNbytes,
    ReaddTakesTrimmable,
]


@pytest.mark.parametrize("mutant", MUTANTS, ids=lambda m: m.__name__)
def test_harness_catches(mutant: type[NaiveIndex]) -> None:
    with pytest.raises(AssertionError):
        for seed in range(3):
            for first in (False, True):
                Run(mutant, seed=seed, store=24, block_size=4, evict_first=first).run(300)


# Mutants of the optimized index itself (bugs its structures could plausibly have). The
# harness must catch each against the correct reference.


def _newest_best_first(a: Any, b: Any) -> bool:
    return b is None or (len(a.tokens), a.born) < (len(b.tokens), b.born)


def _stale_best(e: Any) -> None:
    """drop_best that leaves a removed entry as a subtree's best."""


def _pick_ignoring_usefulness(self: VictimOrder, group: Any, prefixes: Any) -> Any:
    return _PICK(self, None, ())


def _useful_trimmable_only(self: PromptIndex, prompt: Any) -> Any:
    return _USEFUL(self, prompt)[0], ()


def _link_keeping_the_class(self: PromptIndex, p: Any, f: Any, add: bool) -> None:
    if add:
        p.extenders.add(f)
    else:
        p.extenders.discard(f)


def _lookup_without_cap(self: PromptIndex, prompt: Any) -> Any:
    return _LOOKUP(self, [*list(prompt), 10**6])


def _nt_prefixes_first_block_only(self: PromptIndex, path: Any, data: bytes) -> Any:
    return _NT_PREFIXES(self, path[:2], data)


def _split_without_aggregates(self: BlockTree, node: Any, depth: int) -> Any:
    upper = _SPLIT(self, node, depth)
    upper.best, upper.nt = None, 0
    return upper


def _prune_without_merging(self: BlockTree, node: Any) -> None:
    bb = self.block_bytes
    while node.parent is not None and not node.entries and not node.children:
        del node.parent.children[node.key[:bb]]
        node = node.parent


def _walk_stopping_before_a_partial_edge(
    self: BlockTree, data: bytes, blocks: int, keep: Any = None
) -> Any:
    path, depth, inside = _WALK(self, data, blocks, keep)
    return Walk(path, path[-1].depth, None) if inside is not None else Walk(path, depth, inside)


def _common_counting_the_differing_block(
    self: BlockTree, data: bytes, pos: int, key: bytes, end: int
) -> int:
    common = _COMMON(self, data, pos, key, end)
    return common + self.block_bytes if common < pos + min(len(key), end - pos) else common


_PICK, _USEFUL = VictimOrder.pick, PromptIndex._useful
_LOOKUP, _NT_PREFIXES = PromptIndex.lookup, PromptIndex._nt_prefixes
_SPLIT, _WALK, _COMMON = BlockTree._split, BlockTree.walk, BlockTree._common
IMPL_MUTANTS = {
    "lookup tie to the newest": (radix, "_less_rewinding", _newest_best_first),
    "best not recomputed on removal": (BlockTree, "drop_best", staticmethod(_stale_best)),
    "victim without the usefulness class": (VictimOrder, "pick", _pick_ignoring_usefulness),
    "non-trimmable prefixes not useful": (PromptIndex, "_useful", _useful_trimmable_only),
    "victim class not updated by links": (PromptIndex, "_link", _link_keeping_the_class),
    "no len(prompt) - 1 cap": (PromptIndex, "lookup", _lookup_without_cap),
    "non-trimmable walk stops early": (PromptIndex, "_nt_prefixes", _nt_prefixes_first_block_only),
    "split edge without aggregates": (BlockTree, "_split", _split_without_aggregates),
    "pruned node not merged": (BlockTree, "prune", _prune_without_merging),
    "partial edge not walked": (BlockTree, "walk", _walk_stopping_before_a_partial_edge),
    "partial edge one block long": (BlockTree, "_common", _common_counting_the_differing_block),
}


@pytest.mark.parametrize("mutant", IMPL_MUTANTS.values(), ids=list(IMPL_MUTANTS))
def test_harness_catches_index_bug(mutant: tuple[Any, str, Any], monkeypatch: Any) -> None:
    monkeypatch.setattr(*mutant)
    with pytest.raises(AssertionError):
        for seed in range(3):
            for first in (False, True):
                Run(NaiveIndex, seed=seed, store=24, block_size=4, evict_first=first).run(300)
