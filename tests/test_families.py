"""The architecture matrix: every mlx-lm family kind resumes block by block, exactly.

Tiny random instances of mlx-lm's own model classes (tests/families.py) run the exactness
checks of tests/guarantees.py: each reply equal to a cold run's, bit for bit (logits
included), resumed where the cache geometry says, from memory, disk and after a fork.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from families import FAMILIES
from guarantees import (
    Rig,
    Variant,
    check_cancelled_decode,
    check_chat,
    check_disk,
    check_follow,
    check_fork,
    check_restore_repeatedly,
    check_warm,
)
from tinymodel import write_mlx_lm

from mlxcache.model import LoadedModel, load

CHECKS: list[Callable[[Rig], None]] = [
    check_warm,
    check_fork,
    check_chat,
    check_disk,
    check_restore_repeatedly,
    check_follow,
    check_cancelled_decode,
]


@pytest.fixture(scope="module")
def family_models(
    tiny: LoadedModel, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Variant]:
    root = tmp_path_factory.mktemp("families")
    return {
        name: Variant.of(name, load(str(write_mlx_lm(root / name, tiny.path, config))), False)
        for name, config in FAMILIES.items()
    }


@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__.removeprefix("check_"))
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family(
    family: str,
    check: Callable[[Rig], None],
    family_models: dict[str, Variant],
    tmp_path: Path,
) -> None:
    variant = family_models[family]
    assert variant.trimmable, f"{family} has no block layout"
    check(Rig(variant, tmp_path))
