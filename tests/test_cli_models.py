"""`mlxcache models ls | info` on the tiny model."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
from typer.testing import CliRunner

from mlxcache_cli.main import app
from mlxcache_cli.models_cmd import quantization

runner = CliRunner()


def test_info_then_ls(tiny_gguf: Path, tmp_path: Path) -> None:
    info = runner.invoke(
        app, ["models", "info", "-m", str(tiny_gguf), "--cache-dir", str(tmp_path), "--json"]
    )
    assert info.exit_code == 0, info.stderr
    doc = json.loads(info.stdout)
    assert (doc["architecture"], doc["context_length"], doc["layers"], doc["vocab_size"]) == (
        "llama",
        256,
        2,
        262,
    )
    assert doc["quantization"] is None and len(doc["key"]) == 32
    on_cpu = mx.default_device() == mx.cpu  # measured: MLX's CPU backend computes both exactly
    assert (doc["decode_kv"], doc["batched_decode"]) == (
        ("kept", True) if on_cpu else ("re-prefilled", False)
    )
    ls = runner.invoke(app, ["models", "ls", "--cache-dir", str(tmp_path), "--json"])
    assert ls.exit_code == 0, ls.stderr
    (row,) = json.loads(ls.stdout)
    assert row["gguf"] == str(tiny_gguf) and row["folder"] == doc["path"] and row["bytes"] > 0


def test_info_of_a_missing_model(tmp_path: Path) -> None:
    result = runner.invoke(
        app, ["models", "info", "-m", str(tmp_path / "x.gguf"), "--cache-dir", str(tmp_path)]
    )
    assert result.exit_code == 2 and result.stdout == ""
    assert result.stderr == f"error: model file not found: {tmp_path / 'x.gguf'}\n"


def test_plain_views_keep_whole_paths_and_read_as_text(tiny_gguf: Path, tmp_path: Path) -> None:
    deep = tmp_path / ("a-rather-long-folder-name-" * 4) / "cache"
    args = ["--cache-dir", str(deep)]
    info = runner.invoke(app, ["models", "info", "-m", str(tiny_gguf), *args])
    assert info.exit_code == 0, info.stderr
    lines = {k: v.strip() for k, v in (line.split(None, 1) for line in info.stdout.splitlines())}
    assert lines["quantization"] == "none" and lines["path"].startswith(str(deep))
    ls = runner.invoke(app, ["models", "ls", *args])
    (row,) = [line for line in ls.stdout.splitlines() if str(tiny_gguf) in line]
    assert Path(lines["path"]).name in row and " KiB " in row  # by name, the source whole


def test_quantization_as_text() -> None:
    assert quantization({"group_size": 32, "bits": 4}) == "4-bit, groups of 32"
    assert quantization({"bits": 8, "group_size": 64, "mode": "affine"}) == (
        "8-bit, groups of 64, mode affine"
    )
    assert quantization(None) == "none"
