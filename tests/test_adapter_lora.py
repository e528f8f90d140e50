"""A real `mlx_lm.lora` run on SmolLM2 (two iterations on a few lines written here): the
folder it saves loads, replies as mlx-lm's own `load(model, adapter_path=)`, and regresses."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest
import yaml
from adapters import mlx_lm_reply
from cli_run import run as run_cli

from mlxcache.encoder import Encoder
from mlxcache.model import LoadedModel, load
from mlxcache.sampling import SamplingParams

pytestmark = [pytest.mark.slow, pytest.mark.model]

LINES = [
    "The capital of France is Paris.",
    "The capital of Italy is Rome.",
    "The capital of Spain is Madrid.",
    "The capital of Japan is Tokyo.",
]


def train(model: Path, out: Path, data: Path) -> None:
    """`mlx_lm.lora --train`, as small as it goes: one layer, two steps of one short line."""
    data.mkdir()
    for split in ("train", "valid"):
        rows = "".join(json.dumps({"text": line}) + "\n" for line in LINES)
        (data / f"{split}.jsonl").write_text(rows)
    args = ["--model", str(model), "--train", "--data", str(data), "--adapter-path", str(out)]
    args += ["--iters", "2", "--batch-size", "1", "--num-layers", "1", "--max-seq-length", "16"]
    args += ["--val-batches", "1", "--steps-per-eval", "1000", "--steps-per-report", "1"]
    args += ["--learning-rate", "1e-2", "--save-every", "1000", "--seed", "0"]
    done = subprocess.run(
        [sys.executable, "-m", "mlx_lm", "lora", *args],
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert done.returncode == 0, done.stderr[-2000:]


def test_an_adapter_mlx_lm_lora_saved_loads_replies_and_regresses(
    smol: LoadedModel, tmp_path: Path
) -> None:
    adapter = tmp_path / "adapter"
    train(smol.path, adapter, tmp_path / "data")
    weights = mx.load(str(adapter / "adapters.safetensors"))
    assert isinstance(weights, dict)
    assert any(k.endswith("lora_b") and mx.any(v != 0).item() for k, v in weights.items())

    tuned = load(adapter=adapter)
    params = SamplingParams(max_tokens=4)
    prompt = Encoder.of(tuned).encode_chat([{"role": "user", "content": "Capital of Peru?"}])
    from mlxcache.engine import Engine, Request

    got = Engine(tuned).complete(Request(prompt, params)).tokens
    assert got and got == mlx_lm_reply(smol.path, adapter, prompt, params)[: len(got)]

    suite, golden = tmp_path / "suite.yaml", tmp_path / "golden.json"
    doc = {
        "adapter": str(adapter),
        "defaults": {"temperature": 0, "max_tokens": 4},
        "cases": [{"name": "peru", "kind": "plain", "prompt": "Capital of Peru?"}],
    }
    suite.write_text(yaml.safe_dump(doc))
    code, _, err = run_cli(
        "regress", "record", str(suite), "-o", str(golden), "--variants", "cold,warm"
    )
    assert code == 0, err
    case = json.loads(golden.read_text())["cases"]["peru"]
    assert tuned.adapter is not None
    assert case["adapter"] == {"name": "adapter", "digest": tuned.adapter.digest}
    assert case["outputs"][0]["tokens"] == got
    code, out, err = run_cli("regress", "check", str(suite), str(golden), "--variants", "cold")
    lines = out.splitlines()
    assert (code, lines[0]) == (0, "ok                     peru"), err
    assert re.fullmatch(r"1 case under 1 variant: 1 passed, 0 failed \(\d+\.\d+ s\)", lines[1])
