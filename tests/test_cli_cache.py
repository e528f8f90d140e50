"""`mlxcache cache …` and cache options of `generate`, on the tiny model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cli_run import run
from tinymodel import write_tiny_gguf
from typer.testing import CliRunner

from mlxcache.cache.disk import DiskTier
from mlxcache.invariance import PROBES, probe
from mlxcache.model import load
from mlxcache_cli import ui
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


def cache_with_index(root: Path) -> Path:
    DiskTier(root / "kv").close()
    return root / "kv" / "files"


def test_cache_clear_leaves_a_stray_directory_with_a_warning(tmp_path: Path) -> None:
    files = cache_with_index(tmp_path)
    (files / "x").mkdir()
    (files / "ours.safetensors").write_bytes(b"block")
    assert run("cache", "clear", "--cache-dir", str(tmp_path)) == (
        0,
        "removed 0 entries (5 B freed)\n",  # ours.safetensors
        f"warning: left {files / 'x'} as it is: not a file mlxcache wrote (links are not "
        "followed)\n",
    )
    assert [p.name for p in files.iterdir()] == ["x"]


@pytest.mark.parametrize("index", [True, False])
def test_cache_clear_never_follows_a_link_out_of_the_cache(tmp_path: Path, index: bool) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "precious.txt").write_text("keep me")
    cache = tmp_path / "cache"
    files = cache_with_index(cache) if index else cache / "kv" / "files"
    if index:
        files.rmdir()
    files.parent.mkdir(parents=True, exist_ok=True)
    files.symlink_to(outside)
    assert run("cache", "clear", "--cache-dir", str(cache)) == (
        0,
        "removed 0 entries (0 B freed)\n",
        f"warning: left {files} as it is: not a file mlxcache wrote (links are not followed)\n",
    )
    assert (outside / "precious.txt").read_text() == "keep me"


def test_cache_ls_explains_its_sizes_and_clear_says_what_it_freed(
    cache_root: Path, tiny_gguf: Path, tmp_path: Path
) -> None:
    d = ["--cache-dir", str(tmp_path)]
    base = ["generate", "--raw", "-m", str(tiny_gguf), "-n", "2", "--block-size", "4", *d]
    for text in ("abcdefghijklmnop", "abcdefghijklmnopqrstuvwx"):  # share 3 blocks
        assert runner.invoke(app, [*base, text]).exit_code == 0
    stats = json.loads(runner.invoke(app, ["cache", "stats", "--json", *d]).stdout)
    rows = json.loads(runner.invoke(app, ["cache", "ls", "--json", *d]).stdout)
    assert sum(r["bytes"] for r in rows) > stats["bytes"]  # shared blocks count twice
    listing = runner.invoke(app, ["cache", "ls", *d]).stdout.splitlines()
    header = [cell.strip() for cell in listing[1].strip("┃").split("┃")]
    assert header == ["model", "block", "tokens", "size", "used", "prompt ends with"]  # no id
    assert listing[-1] == (
        f"2 entries, {ui.human_bytes(stats['bytes'])} on disk (an entry's size counts every "
        "block it resumes; entries that share a prefix share its blocks)"
    )
    cleared = runner.invoke(app, ["cache", "clear", *d])
    assert cleared.stdout == f"removed 2 entries ({ui.human_bytes(stats['bytes'])} freed)\n"


@pytest.mark.parametrize("index", [True, False])
def test_cache_clear_empties_a_cache_whose_folder_is_a_file(
    cache_root: Path, tiny_gguf: Path, tmp_path: Path, index: bool
) -> None:
    """A regular file where the block folder goes (our own path name) is deleted like a
    block file: clear empties the cache, its entries counted (issue 53, item 14)."""
    files = tmp_path / "kv" / "files"
    if index:
        gen(tiny_gguf, tmp_path, "abcdefghijklmnop")
        for block in files.iterdir():
            block.unlink()
        files.rmdir()
    files.parent.mkdir(parents=True, exist_ok=True)
    files.write_bytes(b"stray")
    assert run("cache", "clear", "--cache-dir", str(tmp_path)) == (
        0,
        f"removed {1 if index else 0} {'entry' if index else 'entries'} (5 B freed)\n",
        "",
    )
    assert not files.is_file()
    listed = runner.invoke(app, ["cache", "ls", "--json", "--cache-dir", str(tmp_path)])
    assert json.loads(listed.stdout) == []


def test_a_one_shot_reads_the_recorded_probe_and_never_measures_it(
    cache_root: Path, tiny_gguf: Path, tmp_path: Path
) -> None:
    """Nothing recorded: `generate` measures nothing and keeps the prompt's blocks only.
    Recorded (as chat or serve records it): it keeps its reply's decode KV too."""
    text = "abcdefghijklmnop"  # 15 tokens, then 3 drawn and the last one fed: 18
    fresh, recorded = tmp_path / "fresh", tmp_path / "recorded"
    gen(tiny_gguf, fresh, text)
    assert not (fresh / PROBES).exists()
    assert max(r["tokens"] for r in cache("ls", "--cache-dir", str(fresh))) == 12
    if not probe(load(str(tiny_gguf), cache_root=cache_root), 4, recorded)["decode"]:
        pytest.skip("decode KV is not canonical on this device")
    gen(tiny_gguf, recorded, text)
    assert max(r["tokens"] for r in cache("ls", "--cache-dir", str(recorded))) == 16
