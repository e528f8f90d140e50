"""Benchmarks: each prints one machine-readable JSON line and compares with its baseline."""

from __future__ import annotations

from pathlib import Path

SMOKE = Path("examples/smoke.yaml")
"""The regress smoke suite, where the benchmarks run from a checkout."""


def suite_or_smoke(suite: Path | None) -> Path | None:
    """`suite`, or the smoke suite when none is given and it is here."""
    return suite if suite is not None else (SMOKE if SMOKE.is_file() else None)
