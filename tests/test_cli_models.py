"""`mlxcache models ls | info` on the tiny model."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from mlxcache_cli.main import app

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
