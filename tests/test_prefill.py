"""The canonical prefill schedule: chunks on absolute block multiples."""

from __future__ import annotations

import pytest

from mlxcache.prefill import schedule


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
