"""Settings: sizes, the per-device block size, and their one home."""

from __future__ import annotations

import pytest

from mlxcache.config import CPU_BLOCK_SIZE, CacheConfig, default_block_size, format_size, parse_size
from mlxcache.errors import UserInputError


@pytest.mark.parametrize(
    ("text", "n"), [("2G", 2 << 30), ("512M", 512 << 20), ("1.5GiB", 1536 << 20), ("1000", 1000)]
)
def test_parse_size(text: str, n: int) -> None:
    assert parse_size(text) == n


@pytest.mark.parametrize("n", [2 << 30, 20 << 30, 1536 << 20, 1000, 0, 3 << 40])
def test_format_size_round_trips(n: int) -> None:
    assert parse_size(format_size(n)) == n
    assert format_size(2 << 30) == "2G"


def test_block_size_default_env_and_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MLXCACHE_BLOCK_SIZE", raising=False)
    assert default_block_size() == CPU_BLOCK_SIZE == CacheConfig().block_size  # this CPU
    monkeypatch.setenv("MLXCACHE_BLOCK_SIZE", "64")
    assert CacheConfig().block_size == 64
    for bad in ("0", "x", "-3"):
        monkeypatch.setenv("MLXCACHE_BLOCK_SIZE", bad)
        with pytest.raises(UserInputError, match="MLXCACHE_BLOCK_SIZE"):
            CacheConfig()
