"""Smoke test of the index benchmark: it runs and reports every figure (timings unchecked)."""

from __future__ import annotations

import json

import pytest

from mlxcache.bench import index_bench

OPS = {"lookup", "keep", "victim", "mlx_lm_lookup", "mlx_lm_keep"}


def test_run_reports_every_figure() -> None:
    result = index_bench.run(slots=20, runs=1, turns=12, block_size=64)
    assert result["bench"] == "index"
    assert (result["slots"], result["runs"], result["turns"], result["block_size"]) == (
        20,
        1,
        12,
        64,
    )
    assert set(result["ms"]) == OPS
    assert all(set(q) == {"p50_ms", "p99_ms"} for q in result["ms"].values())
    assert set(result["ratios"]) == {
        "lookup_p50_speedup",
        "keep_p50_speedup",
        "victim_p99_over_p50",
    }
    assert set(result["goals"]) == {
        "lookup_10x",
        "keep_10x",
        "victim_p50_le_0.05ms",
        "victim_p99_le_3x_p50",
    }
    assert result["pass"] == all(result["goals"].values())
    assert result["hits"] == 11  # every turn but the first resumes
    assert result["evictions"] > 0
    json.dumps(result)


def test_main_prints_one_json_line(capsys: pytest.CaptureFixture[str]) -> None:
    index_bench.main(["--slots", "20", "--runs", "1", "--turns", "8", "--scale-slots", "30"])
    out, err = capsys.readouterr()
    (line,) = out.splitlines()
    result = json.loads(line)
    assert result["scale"]["slots"] == 30
    assert "victim_scale_le_2x" in result["goals"]
    assert "victim" in err
