"""Unit tests of the prompt index with exact expectations (B = 4 unless stated)."""

from __future__ import annotations

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import given, settings

from mlxcache.cache.index import Entry, Match, PromptIndex
from mlxcache.cache.radix import common_prefix


def ones(n: int) -> list[int]:
    return [1] * n


@pytest.fixture
def idx() -> PromptIndex:
    return PromptIndex(block_size=4)


# Construction and input validation.


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "4", None])
def test_block_size_must_be_a_positive_int(bad: object) -> None:
    with pytest.raises(ValueError, match="block_size"):
        PromptIndex(block_size=bad)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "tokens",
    [[], np.zeros(0, np.int32), [[1, 2]], [1.0, 2.0], [True], [-1], [2**31], np.array([2**40])],
)
def test_add_rejects_bad_tokens(idx: PromptIndex, tokens: object) -> None:
    with pytest.raises(ValueError):
        idx.add(tokens)  # type: ignore[arg-type]
    assert len(idx) == 0


@pytest.mark.parametrize("nbytes", [-1, 1.5])
def test_add_rejects_bad_nbytes(idx: PromptIndex, nbytes: object) -> None:
    with pytest.raises(ValueError, match="nbytes"):
        idx.add([1], nbytes=nbytes)  # type: ignore[arg-type]


def test_tokens_are_an_immutable_copy(idx: PromptIndex) -> None:
    src = np.arange(6, dtype=np.int32)
    e = idx.add(src)
    src[0] = 99
    assert e.tokens.tolist() == [0, 1, 2, 3, 4, 5]
    assert e.tokens.dtype == np.int32
    with pytest.raises(ValueError):
        e.tokens[0] = 7


def test_lists_and_arrays_of_any_int_dtype_are_the_same_tokens(idx: PromptIndex) -> None:
    e = idx.add([5, 6, 7])
    assert idx.add(np.array([5, 6, 7], dtype=np.int64)) is e
    assert idx.add(np.array([5, 6, 7], dtype=np.uint16)) is e
    assert len(idx) == 1


# Entries, clock, iteration.


def test_one_clock_for_born_and_last_used(idx: PromptIndex) -> None:
    a = idx.add([1, 2], nbytes=10)
    b = idx.add([3])
    assert (a.born, a.last_used, b.born, b.last_used) == (1, 1, 2, 2)
    idx.touch(a)
    assert a.last_used == 3
    c = idx.add([4], trimmable=False)
    assert (c.born, c.trimmable, c.pins, a.nbytes) == (4, False, 0, 10)


def test_entries_are_distinct_objects_iterated_by_born(idx: PromptIndex) -> None:
    a, b, c = idx.add([3]), idx.add([1]), idx.add([2])
    assert list(idx) == [a, b, c]
    assert len(idx) == 3 and a != b and len({a, b, c}) == 3
    idx.remove(b)
    idx.add([1, 1])
    assert [e.born for e in idx] == [1, 3, 4]
    assert a in idx and b not in idx and "x" not in idx


def test_adding_known_tokens_returns_that_entry(idx: PromptIndex) -> None:
    e = idx.add([1, 2, 3], trimmable=False, nbytes=5)
    idx.add([9])
    again = idx.add(np.array([1, 2, 3], dtype=np.int32), trimmable=True, nbytes=8)
    assert again is e
    assert (e.last_used, e.trimmable, e.nbytes, len(idx)) == (3, False, 8, 2)


def test_readding_an_extender_keeps_its_links(idx: PromptIndex) -> None:
    a, b = idx.add(ones(4)), idx.add(ones(8))
    assert idx.add(ones(8)) is b
    assert (a.extenders, b.extends) == ({b}, {a})


# lookup(): the usable length of the best entry.


def _usable(idx: PromptIndex, prompt: list[int]) -> int:
    found = idx.lookup(prompt)
    return 0 if found is None else found.length


def test_usable_trimmable_floors_to_blocks_and_caps_below_the_prompt(idx: PromptIndex) -> None:
    idx.add(list(range(10)))
    prompts = {
        12: list(range(12)),  # lcp 10 -> 8
        10: list(range(10)),  # whole entry: capped at 9 -> 8
        9: list(range(9)),  # 8
        8: list(range(8)),  # capped at 7 -> 4
        5: list(range(5)),  # 4
        4: list(range(4)),  # capped at 3 -> 0
        1: [0],
        0: [],
    }
    got = {n: _usable(idx, p) for n, p in prompts.items()}
    assert got == {12: 8, 10: 8, 9: 8, 8: 4, 5: 4, 4: 0, 1: 0, 0: 0}
    assert _usable(idx, [0, 1, 2, 3, 4, 9, 9, 9, 9, 9]) == 4  # lcp 5


def test_usable_non_trimmable_needs_a_proper_prefix(idx: PromptIndex) -> None:
    idx.add(ones(6), trimmable=False)
    assert _usable(idx, ones(7)) == 6  # not floored to blocks
    assert _usable(idx, ones(6)) == 0  # not shorter than the prompt
    assert _usable(idx, [*ones(5), 2, 2]) == 0


def test_lookup_lengths(idx: PromptIndex) -> None:
    e = idx.add(list(range(10)))
    assert idx.lookup(list(range(12))) == Match(e, 8)
    assert idx.lookup(list(range(10))) == Match(e, 8)
    assert idx.lookup(list(range(8))) == Match(e, 4)
    assert idx.lookup(list(range(5))) == Match(e, 4)
    assert idx.lookup(list(range(4))) is None
    assert idx.lookup([]) is None
    assert idx.lookup([7] * 20) is None


def test_lookup_hit_is_a_use_and_a_miss_is_not(idx: PromptIndex) -> None:
    e = idx.add(ones(8))
    idx.add([2])
    assert idx.lookup([3] * 9) is None
    assert e.last_used == 1
    idx.lookup(ones(9))
    assert e.last_used == 3


def test_lookup_ties_go_to_the_shortest_then_the_newest(idx: PromptIndex) -> None:
    prompt = ones(8) + [3] * 5
    a = idx.add(ones(8))
    b = idx.add(ones(8) + [2] * 4)
    c = idx.add(ones(8) + [4] * 4)
    assert idx.lookup(prompt) == Match(a, 8)
    idx.remove(a)
    assert idx.lookup(prompt) == Match(c, 8)
    idx.remove(c)
    assert idx.lookup(prompt) == Match(b, 8)


def test_lookup_rewinds_a_longer_entry(idx: PromptIndex) -> None:
    long = idx.add(ones(20))
    assert idx.lookup([*ones(9), 2]) == Match(long, 8)


def test_lookup_mixes_trimmable_and_non_trimmable(idx: PromptIndex) -> None:
    t = idx.add(ones(12))
    nt = idx.add(ones(6), trimmable=False)
    assert idx.lookup(ones(9)) == Match(t, 8)  # 8 beats 6
    assert idx.lookup(ones(7)) == Match(nt, 6)  # t gives only 4
    nt8 = idx.add(ones(8), trimmable=False)
    assert idx.lookup(ones(10)) == Match(nt8, 8)  # tie at 8: the shorter one


def test_lookup_skips_removed_entries(idx: PromptIndex) -> None:
    short, long = idx.add(ones(5)), idx.add(ones(12))
    idx.remove(long)
    assert idx.lookup(ones(13)) == Match(short, 4)
    idx.remove(short)
    assert idx.lookup(ones(13)) is None


def test_block_size_one_resumes_anywhere() -> None:
    idx = PromptIndex(block_size=1)
    e = idx.add([1, 2, 3, 4, 5])
    assert idx.lookup([1, 2, 3, 9]) == Match(e, 3)
    assert idx.lookup([1, 2, 3, 4, 5]) == Match(e, 4)
    assert idx.lookup([1]) is None


# Extension links (an entry is extended while it has an extender).


def test_extenders_are_newer_longer_trimmable_entries(idx: PromptIndex) -> None:
    a, b = idx.add(ones(4)), idx.add(ones(8))
    assert (a.extenders, b.extenders, b.extends) == ({b}, set(), {a})
    c = idx.add(ones(12), trimmable=False)  # a non-trimmable entry extends nothing
    assert (a.extenders, b.extenders, c.extends) == ({b}, set(), set())
    older = idx.add([2] * 8)
    newer_prefix = idx.add([2] * 4)
    assert not newer_prefix.extenders and not older.extenders
    idx.remove(b)
    assert not a.extenders


def test_extension_is_by_prefix_not_by_block(idx: PromptIndex) -> None:
    a = idx.add([1, 2, 3])
    b = idx.add([1, 2, 3, 4, 5, 6])
    c = idx.add([1, 2, 4, 4, 5, 6])
    assert (a.extenders, b.extenders, c.extenders) == ({b}, set(), set())
    nt = idx.add([7], trimmable=False)
    f = idx.add([7, 7])
    assert nt.extenders == {f}  # any entry can be extended; only trimmable ones extend


def test_losing_its_last_extender_moves_an_entry_out_of_the_extended_class(
    idx: PromptIndex,
) -> None:
    a, b, c = idx.add(ones(4)), idx.add(ones(8)), idx.add(ones(4) + [2] * 4)
    d = idx.add([3])
    idx.touch(a)
    idx.pin(b)
    idx.pin(c)
    assert idx.victim() is a  # extended, though used after d
    idx.unpin(b)
    idx.remove(b)
    assert idx.victim() is a  # c still extends it
    idx.unpin(c)
    idx.remove(c)
    assert idx.victim() is d  # a is back among the rest


# victim().


def _drain(idx: PromptIndex, prompt: list[int] | None) -> list[Entry]:
    order = []
    while (v := idx.victim(prompt=prompt)) is not None:
        order.append(v)
        idx.remove(v)
    return order


def _mixed_index() -> tuple[PromptIndex, dict[str, Entry]]:
    idx = PromptIndex(block_size=4)
    es = {
        "a": idx.add(ones(4)),  # extended by b and e
        "b": idx.add(ones(8)),
        "c": idx.add([2] * 8),
        "d": idx.add([3] * 8),
        "e": idx.add(ones(4) + [5] * 4),
        "f": idx.add([4] * 3, trimmable=False),
        "g": idx.add(ones(3), trimmable=False),  # a proper prefix of the prompt
        "h": idx.add(ones(2)),  # a prefix, but shorter than a block: of no use
    }
    idx.touch(es["c"])
    return idx, es


def test_victim_order_with_a_prompt() -> None:
    idx, es = _mixed_index()
    names = {id(e): n for n, e in es.items()}
    order = _drain(idx, [*ones(8), 9])
    # extended; the rest: of no use by last_used (d 4, f 6, h 8, c 9), then useful ones.
    assert [names[id(e)] for e in order] == ["a", "d", "f", "h", "c", "b", "e", "g"]


def test_victim_order_without_a_prompt() -> None:
    idx, es = _mixed_index()
    names = {id(e): n for n, e in es.items()}
    order = _drain(idx, None)
    assert [names[id(e)] for e in order] == ["a", "b", "d", "e", "f", "g", "h", "c"]


def test_victim_with_a_prompt_of_one_block_finds_nothing_useful() -> None:
    idx, es = _mixed_index()
    names = {id(e): n for n, e in es.items()}
    # ones(4): no trimmable entry is usable (cap 3 -> 0); g (3 tokens) is a proper prefix.
    order = _drain(idx, ones(4))
    assert [names[id(e)] for e in order] == ["a", "b", "d", "e", "f", "h", "c", "g"]


def test_victim_never_picks_pinned_or_skip_and_changes_nothing(idx: PromptIndex) -> None:
    a, b, c = idx.add([1]), idx.add([2]), idx.add([3])
    idx.pin(a)
    assert idx.victim() is b
    assert idx.victim(skip=b) is c
    idx.pin(c)
    assert idx.victim(skip=b) is None
    assert idx.victim(skip=a) is b  # skipping a pinned entry
    assert [(e.last_used, e.pins) for e in idx] == [(1, 1), (2, 0), (3, 1)]
    idx.pin(a)
    idx.unpin(a)
    assert idx.victim() is b
    idx.unpin(a)
    assert idx.victim() is a


def test_victim_of_an_empty_index(idx: PromptIndex) -> None:
    assert idx.victim() is None
    assert idx.victim(prompt=[1, 2]) is None


# Entries from elsewhere, wrong pin counts.


def test_foreign_or_removed_entries_are_rejected(idx: PromptIndex) -> None:
    idx.add([1])
    alien = PromptIndex(block_size=4).add([1])  # same tokens and born, another index
    gone = idx.add([2])
    idx.remove(gone)
    for e in (gone, alien):
        for call in (idx.remove, idx.pin, idx.unpin, idx.touch):
            with pytest.raises(ValueError, match="not in this index"):
                call(e)
        with pytest.raises(ValueError, match="not in this index"):
            idx.victim(skip=e)
    with pytest.raises(ValueError, match="not in this index"):
        idx.remove("not an entry")  # type: ignore[arg-type]


def test_pin_rules(idx: PromptIndex) -> None:
    e = idx.add([1])
    with pytest.raises(ValueError, match="not pinned"):
        idx.unpin(e)
    idx.pin(e)
    with pytest.raises(ValueError, match="pinned"):
        idx.remove(e)
    idx.unpin(e)
    idx.remove(e)
    assert len(idx) == 0


# Continuation inside a block (resumes mid-block on shape-invariant devices).


def test_continuation_finds_the_entry_going_furthest_into_the_next_block(idx: PromptIndex) -> None:
    a = idx.add([1, 2, 3, 4, 5, 6, 7, 8])
    b = idx.add([1, 2, 3, 4, 5, 6, 9, 9, 9, 9, 9, 9])
    idx.add([1, 2, 3, 4, 7, 7, 7, 7])
    assert idx.continuation([1, 2, 3, 4, 5, 6, 7, 0, 0], 4) == (a, 3)
    assert idx.continuation([1, 2, 3, 4, 5, 6, 9, 0], 4) == (b, 3)
    assert idx.continuation([1, 2, 3, 4, 7, 0], 4) is not None
    assert idx.continuation([1, 2, 3, 4, 8, 0], 4) is None  # no next block starts with 8


def test_continuation_inside_an_edge_and_from_the_root(idx: PromptIndex) -> None:
    e = idx.add([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12])  # one edge of three blocks
    assert idx.continuation([1, 2, 3, 4, 5, 6, 0], 4) == (e, 2)
    assert idx.continuation([1, 2, 3, 4, 5, 6, 7, 8, 9, 0], 8) == (e, 1)
    assert idx.continuation([1, 2, 0], 0) == (e, 2)


def test_continuation_needs_the_whole_blocks_before_it(idx: PromptIndex) -> None:
    idx.add([1, 2, 3, 4, 5, 6, 7, 8])
    assert idx.continuation([1, 2, 3, 9, 5, 6], 4) is None  # first block differs
    assert idx.continuation([1, 2, 3, 4, 5, 6, 7, 8, 9], 2) is None  # not a block boundary
    assert idx.continuation([1, 2, 3, 4, 5, 6, 7, 8, 9], 8) is None  # nothing past the entry


def test_continuation_is_not_a_use(idx: PromptIndex) -> None:
    a = idx.add([1, 2, 3, 4, 5, 6, 7, 8])
    used = a.last_used
    idx.continuation([1, 2, 3, 4, 5, 0], 4)
    assert a.last_used == used


def test_continuation_skips_checkpoint_entries(idx: PromptIndex) -> None:
    idx.add([1, 2, 3, 4, 5, 6, 7, 8], trimmable=False)
    assert idx.continuation([1, 2, 3, 4, 5, 6, 0], 4) is None


@settings(max_examples=300, deadline=None)
@given(
    entries=st.lists(
        st.tuples(st.lists(st.integers(1, 3), min_size=1, max_size=14), st.booleans()),
        max_size=8,
    ),
    prompt=st.lists(st.integers(1, 3), min_size=1, max_size=14),
    blocks=st.integers(0, 3),
)
def test_continuation_matches_a_naive_scan(
    entries: list[tuple[list[int], bool]], prompt: list[int], blocks: int
) -> None:
    idx, b, length = PromptIndex(block_size=4), 4, blocks * 4
    kept = [idx.add(tokens, trimmable=trimmable) for tokens, trimmable in entries]
    want = [
        common_prefix(e.tokens[length : length + b], prompt[length:])
        for e in set(kept)
        if e.trimmable
        and len(e.tokens) >= length + b
        and list(e.tokens[:length]) == prompt[:length]
    ]
    best = max([k for k in want if k], default=0)
    got = idx.continuation(prompt, length)
    if best == 0:
        assert got is None
    else:
        assert got is not None
        entry, k = got
        assert k == best
        assert list(entry.tokens[:length]) == prompt[:length]
        assert common_prefix(entry.tokens[length : length + b], prompt[length:]) == k
