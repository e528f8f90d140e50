"""`mlxcache bench serve` end to end on the tiny model (figures are not asserted)."""

from __future__ import annotations

from pathlib import Path

import pytest
from tinymodel import write_tiny_gguf

from mlxcache.bench import serve_bench

pytestmark = pytest.mark.slow  # a benchmark run


def test_serve_bench(cache_root: Path, tmp_path: Path) -> None:
    write_tiny_gguf(tmp_path / "tiny4k.gguf", context=4096)
    result = serve_bench.run(
        str(tmp_path / "tiny4k.gguf"),
        clients=2,
        turns=2,
        tokens=6,
        load_requests=8,
        load_clients=4,
        max_queue=1,
    )
    ours, load = result["mlxcache"], result["load"]
    assert ours["solo_vs_concurrent_identical"] == [True, True]
    assert ours["requests"] == ours["answered"] == 8
    assert ours["cached_tokens"] > 0
    assert load["requests"] == load["answered"] + load["refused_429"] == 8
    assert load["left"] == {"pinned_entries": 0, "busy": False, "warming": False, "waiting": 0}
    assert result["mlxcache_exit"] == 0
    assert result["mlx_lm"]["requests"] == 8 and result["ttft_p50_ratio"] > 0
    assert set(result["goals"]) == {
        "identical_solo_vs_concurrent",
        "every_request_answered",
        "load_answered_or_429",
        "load_nothing_left",
        "load_rss_within_cache_budget",
        "ttft_p50_within_1.3x_mlx_lm",
        "solo_ttft_p50_within_1.1x_mlx_lm",
    }
