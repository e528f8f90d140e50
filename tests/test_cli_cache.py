"""`mlxcache cache …` and cache options of `generate`, on the tiny model."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from mlxcache.model import load
from mlxcache_cli.main import app

runner = CliRunner()


def gen(tiny_gguf: Path, cache: Path, text: str, *extra: str) -> dict:
    args = ["generate", "--raw", text, "-m", str(tiny_gguf), "-n", "3", "--block-size", "4"]
    result = runner.invoke(app, [*args, "--cache-dir", str(cache), "--json", *extra])
    assert result.exit_code == 0, result.stderr
    return json.loads(result.stdout)


def cache(*args: str) -> object:
    result = runner.invoke(app, ["cache", *args, "--json"])
    assert result.exit_code == 0, result.stderr
    return json.loads(result.stdout)


def test_generate_resumes_across_processes_and_cache_commands(
    cache_root: Path, tiny_gguf: Path, tmp_path: Path
) -> None:
    first = gen(tiny_gguf, tmp_path, "abcdefghijklmnop")  # 15 tokens ("ab" merges)
    again = gen(tiny_gguf, tmp_path, "abcdefghijklmnop")
    bypass = gen(tiny_gguf, tmp_path, "abcdefghijklmnop", "--no-cache")
    assert (first["stats"]["cached_tokens"], again["stats"]["cached_tokens"]) == (0, 12)
    assert bypass["stats"]["cached_tokens"] == 0
    assert first["tokens"] == again["tokens"] == bypass["tokens"]
    gen(tiny_gguf, tmp_path, "abcdefgh-other-prompt")
    d = str(tmp_path)
    stats = cache("stats", "--cache-dir", d, "--check")
    assert stats["entries"] == 2 and stats["models"] == ["tiny.gguf"] and stats["problems"] == []
    assert stats["tokens"] == 12 + 20  # whole blocks of 15 and 20 prompt tokens
    rows = cache("ls", "--cache-dir", d)
    assert [r["tokens"] for r in rows] == [12, 20]  # least recently used first
    assert [(r["model"], r["block_size"]) for r in rows] == [("tiny.gguf", 4), ("tiny.gguf", 4)]
    assert rows[0]["used"] <= rows[1]["used"] and isinstance(rows[0]["used"], float)
    tokenizer = load(str(tiny_gguf), cache_root=cache_root).tokenizer
    ids = tokenizer.encode("abcdefgh-other-prompt")
    assert rows[1]["preview"] == tokenizer.decode(ids[8:20])  # its last 12 cached tokens
    pruned = cache("prune", "--max-size", "1", "--cache-dir", d)
    assert pruned == {"removed": 2, "bytes_before": stats["bytes"], "bytes_after": 0}
    gen(tiny_gguf, tmp_path, "abcdefghijklmnop")
    held = cache("stats", "--cache-dir", d)["bytes"]
    assert held > 0
    assert cache("clear", "--cache-dir", d) == {"removed": 1, "bytes_freed": held}
    assert cache("stats", "--cache-dir", d)["bytes"] == 0


def test_prune_keeps_the_most_recent(cache_root: Path, tiny_gguf: Path, tmp_path: Path) -> None:
    for text in ("first prompt!!", "second prompt!", "third prompt!!"):
        gen(tiny_gguf, tmp_path, text)
    one = cache("stats", "--cache-dir", str(tmp_path))["bytes"] // 3
    assert cache("prune", "--max-size", str(one), "--cache-dir", str(tmp_path))["removed"] == 2
    rows = cache("ls", "--cache-dir", str(tmp_path))
    assert len(rows) == 1
    assert gen(tiny_gguf, tmp_path, "third prompt!!x")["stats"]["cached_tokens"] == 12


def test_bad_prune_size(cache_root: Path) -> None:
    result = runner.invoke(app, ["cache", "prune", "--max-size", "lots"])
    assert result.exit_code == 2 and result.stderr == "error: not a size: 'lots' (try 512M or 2G)\n"


def test_prune_across_models_goes_by_last_use(
    cache_root: Path, tiny_gguf: Path, tmp_path: Path
) -> None:
    from tinymodel import write_tiny_gguf

    other = tmp_path / "other.gguf"
    write_tiny_gguf(other, seed=7)
    gen(tiny_gguf, tmp_path, "first model, first")
    gen(other, tmp_path, "second model, only")
    gen(tiny_gguf, tmp_path, "first model, latest")
    d = str(tmp_path)
    rows = cache("ls", "--cache-dir", d)
    assert len(rows) == 3 and [r["model"] for r in rows] == ["tiny.gguf", "tiny.gguf", "other.gguf"]
    oldest = min(rows, key=lambda r: r["used"])
    total = cache("stats", "--cache-dir", d)["bytes"]
    assert cache("prune", "--max-size", str(total - 1), "--cache-dir", d)["removed"] == 1
    assert oldest["id"] not in [r["id"] for r in cache("ls", "--cache-dir", d)]
    total = cache("stats", "--cache-dir", d)["bytes"]
    assert cache("prune", "--max-size", str(total - 1), "--cache-dir", d)["removed"] == 1
    (left,) = cache("ls", "--cache-dir", d)
    assert left["used"] == max(r["used"] for r in rows)
