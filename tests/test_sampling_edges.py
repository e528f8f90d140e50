"""Sampling at its numeric edges (a temperature whose inverse overflows, a top-p that rounds to 0) is greedy in the CLI (the server: tests/test_server_faults.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from cli_run import run


@pytest.mark.parametrize(
    "edge",
    [
        ["--temp", "1e-39", "--seed", "1"],  # 1/T overflows float32
        ["--temp", "1e-310", "--seed", "2"],  # 1/T overflows float64
        ["--temp", "1", "--top-p", "1e-300", "--seed", "3"],  # top-p rounds to 0
    ],
)
def test_sampling_at_its_edges_is_greedy(
    edge: list[str], tiny_gguf: Path, cache_root: Path
) -> None:
    base = ["generate", "--raw", "Once upon a time", "-m", str(tiny_gguf), "-n", "12"]
    greedy = run(*base, "--cache-disk", "0")
    assert greedy[0] == 0 and greedy[1]
    assert run(*base, "--cache-disk", "0", *edge)[:2] == greedy[:2]
