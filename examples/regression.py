"""A regression suite in code: record a golden, then check a second run against it.

Run: .venv/bin/python examples/regression.py
(The CLI does the same: `mlxcache regress record|check`; see examples/smoke.yaml.)
"""

import tempfile
from pathlib import Path

from mlxcache.regress import golden, suite
from mlxcache.regress.runner import LocalRunner

cases = suite.parse(
    {
        "defaults": {"temperature": 0, "max_tokens": 8},
        "cases": [
            {"name": "capital", "kind": "plain", "prompt": "What is the capital of France?"},
            {"name": "follow-up", "kind": "chat", "turns": ["Hi!", "What is 2+2?"]},
        ],
    }
)
with tempfile.TemporaryDirectory() as d:
    out = Path(d) / "golden.json"
    recorded = golden.record(LocalRunner(cases, Path(d) / "record"), out, ("cold", "warm"))
    checked = golden.check(LocalRunner(cases, Path(d) / "check"), out, ("cold", "warm"))
    print(
        f"recorded: {recorded.ok}, checked: {checked.ok}, resumed tokens: {checked.variants['warm']['cached_tokens']}"
    )
