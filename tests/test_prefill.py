"""The canonical prefill schedule: chunks on absolute block multiples."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from spy import spied

from mlxcache.model import LoadedModel
from mlxcache.prefill import MERGED_BLOCKS, prefill, schedule
from mlxcache.ring import TimeRing
from mlxcache.types import new_layers


def test_chunks_are_whole_blocks_then_a_partial_one() -> None:
    assert schedule(0, 35, 16) == [(0, 16), (16, 32), (32, 35)]
    assert schedule(16, 32, 16) == [(16, 32)]
    assert schedule(0, 5, 16) == [(0, 5)]


def test_a_start_inside_a_block_runs_to_the_next_boundary_when_allowed() -> None:
    assert schedule(20, 35, 16, decode_matches_prefill=True) == [(20, 32), (32, 35)]
    assert schedule(20, 30, 16, decode_matches_prefill=True) == [(20, 30)]
    assert schedule(20, 64, 16, decode_matches_prefill=True) == [(20, 32), (32, 48), (48, 64)]


def test_a_start_inside_a_block_is_refused_otherwise() -> None:
    with pytest.raises(ValueError, match="block boundary, got 20"):
        schedule(20, 35, 16)


@pytest.mark.parametrize("start,end", [(16, 16), (32, 16), (-16, 8)])
def test_an_empty_range_is_refused(start: int, end: int) -> None:
    with pytest.raises(ValueError, match="empty prefill range"):
        schedule(start, end, 16, decode_matches_prefill=True)


def test_merged_chunks_span_up_to_the_widest_and_end_on_block_boundaries() -> None:
    assert MERGED_BLOCKS == 4
    assert schedule(61, 85, 16, decode_matches_prefill=True, merge_to=1 << 20) == [
        (61, 85)
    ]  # a turn: one forward
    assert schedule(0, 64, 16, merge_to=64) == [(0, 64)]
    assert schedule(0, 65, 16, merge_to=65) == [(0, 64), (64, 65)]
    assert schedule(3, 150, 16, decode_matches_prefill=True, merge_to=1 << 20) == [
        (3, 64),
        (64, 128),
        (128, 150),
    ]
    assert schedule(61, 85, 16, decode_matches_prefill=True) == [(61, 64), (64, 80), (80, 85)]


def test_chunks_merge_only_up_to_merge_to_and_go_on_canonically_past_it() -> None:
    """Merged chunks end by `merge_to` (a sliding window's size less one); past it the
    canonical chunks, as a cold prefill makes them there."""
    assert schedule(0, 100, 8, merge_to=40) == [
        (0, 32),
        (32, 40),
        *((s, s + 8) for s in range(40, 96, 8)),
        (96, 100),
    ]
    assert schedule(3, 30, 8, True, merge_to=15) == [(3, 8), (8, 16), (16, 24), (24, 30)]
    assert schedule(3, 30, 8, True, merge_to=16) == [(3, 16), (16, 24), (24, 30)]
    assert schedule(40, 60, 8, True, merge_to=39) == [(40, 48), (48, 56), (56, 60)]


def test_prefill_merges_only_where_allowed_and_the_layers_keep_every_position(
    tiny: LoadedModel,
) -> None:
    """Allowed (`decode_matches_prefill`: the probe passed) and plain KV: merged; not
    allowed: canonical chunks. A sliding window's ring merges only inside the window (its
    size less one), and not at all once it has dropped a position."""
    tokens = np.arange(1, 40, dtype=np.int32)
    loaded, spy = spied(tiny)

    def calls(decode_matches_prefill: bool, layers: list[Any]) -> list[tuple[int, int]]:
        spy.reset()
        for _ in prefill(loaded.model, layers, tokens, 0, 8, decode_matches_prefill):
            pass
        return spy.calls

    canonical = [(0, 8), (8, 8), (16, 8), (24, 8), (32, 7)]
    assert calls(True, new_layers(tiny.model)) == [(0, 32), (32, 7)]
    assert calls(False, new_layers(tiny.model)) == canonical
    assert calls(True, [TimeRing(max_size=64) for _ in new_layers(tiny.model)]) == [
        (0, 32),
        (32, 7),
    ]
    assert calls(True, [TimeRing(max_size=25) for _ in new_layers(tiny.model)]) == [
        (0, 24),
        (24, 8),
        (32, 7),
    ]
    assert calls(True, [TimeRing(max_size=16) for _ in new_layers(tiny.model)]) == canonical
