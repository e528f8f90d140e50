"""Every script in examples/ runs and prints what its README section shows."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.model
EXAMPLES = Path(__file__).parent.parent / "examples"

EXPECTED = {
    "generate.py": [
        "[cold] 0/37 prompt tokens from the cache",
        "[warm] 37/37 prompt tokens from the cache",
    ],
    "chat_session.py": ["assistant: The capital of France is Paris.", "saved and reloaded 2 turns"],
    "json_extract.py": ['{"city": "Rome", "country": "ITL"} stop'],
    "tools_call.py": ["{'name': 'get_weather', 'arguments': {'city': 'Paris'}}"],
    "regression.py": ["recorded: True, checked: True, resumed tokens: 48"],
}


@pytest.mark.parametrize("script", sorted(EXPECTED))
def test_example_runs(cache_root: Path, script: str) -> None:
    out = subprocess.run(
        [sys.executable, str(EXAMPLES / script)], capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    for line in EXPECTED[script]:
        assert line in lines, out.stdout


def test_every_example_is_tested() -> None:
    assert sorted(p.name for p in EXAMPLES.glob("*.py")) == sorted(EXPECTED)
