"""Faults of the environment: a full disk, a damaged index or conversion, odd cache dirs.

Each either keeps going with one warning (and loses nothing) or stops with one error line;
nothing half-written is left behind.
"""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
import yaml
from typer.testing import CliRunner

from mlxcache.cache.disk import DiskTier
from mlxcache.cache.store import PromptCache
from mlxcache.config import CacheConfig
from mlxcache.engine import Engine, Request
from mlxcache.errors import CacheStoreError
from mlxcache.fileio import MAX_DEPTH, load_yaml, loads_json
from mlxcache.model import LoadedModel, load
from mlxcache.model.gguf import MANIFEST, check_folder
from mlxcache.sampling import SamplingParams
from mlxcache_cli.main import app

runner = CliRunner()
PROMPT = "abcdefghijklmnopqrstuvwx"  # 23 tokens of the tiny model: 5 blocks of 4
_save = mx.save_safetensors


def gen(tiny_gguf: Path, cache: Path, *extra: str) -> tuple[int, str, list[str]]:
    args = ["generate", "--raw", PROMPT, "-m", str(tiny_gguf), "-n", "3", "--block-size", "4"]
    result = runner.invoke(app, [*args, "--cache-dir", str(cache), "--json", *extra])
    return result.exit_code, result.stdout, result.stderr.splitlines()


def cache_cmd(*args: str) -> tuple[int, str, list[str]]:
    result = runner.invoke(app, ["cache", *args])
    return result.exit_code, result.stdout, result.stderr.splitlines()


def fail_writes_under(part: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """MLX writing files whose path contains `part` fails as on a full disk: half a file is
    written, then MLX's own RuntimeError."""

    def save(path: str, arrays: dict, metadata: dict | None = None) -> None:
        if part not in path:
            return _save(path, arrays, metadata=metadata) if metadata else _save(path, arrays)
        Path(path).write_bytes(b"\0" * 100)
        raise RuntimeError(f"[write] Unable to write 4096 bytes to file {path}.")

    monkeypatch.setattr(mx, "save_safetensors", save)


def test_full_disk_while_writing_blocks_warns_once_and_replies(
    tiny_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    code, out, err = gen(tiny_gguf, tmp_path / "ok", "--no-cache")
    assert code == 0
    expected = json.loads(out)["tokens"]
    fail_writes_under("/kv/files/", monkeypatch)
    code, out, err = gen(tiny_gguf, tmp_path / "full")
    assert code == 0 and json.loads(out)["tokens"] == expected
    warnings = [line for line in err if line.startswith("warning:")]
    assert len(warnings) == 1 and warnings[0].startswith(
        "warning: disk cache disabled: cannot write "
    ), err
    assert "[write] Unable to write 4096 bytes" in warnings[0]
    assert list((tmp_path / "full" / "kv" / "files").iterdir()) == []  # no orphan, no temp
    code, out, _ = cache_cmd("stats", "--check", "--json", "--cache-dir", str(tmp_path / "full"))
    assert code == 0 and json.loads(out) | {"directory": ""} == {
        "directory": "",
        "entries": 0,
        "bytes": 0,
        "models": [],
        "tokens": 0,
        "problems": [],
    }


def test_a_failed_index_update_takes_the_new_files_back(tmp_path: Path) -> None:
    disk = DiskTier(tmp_path)
    tokens = np.arange(8, dtype=np.int32)
    disk.add_entry("ns", tokens, True, {"a": lambda p: p.write_bytes(b"A")}, 1)

    def full(*_args: object) -> int:
        raise sqlite3.OperationalError("database or disk is full")

    disk._link = full  # type: ignore[method-assign]
    files = {"a": lambda p: p.write_bytes(b"A"), "b": lambda p: p.write_bytes(b"B")}
    with pytest.raises(CacheStoreError, match="database or disk is full"):
        disk.add_entry("ns", tokens[:4], True, files, 2)
    # "b" was written for the failed entry and taken back; "a" belongs to the first entry.
    assert sorted(p.name for p in disk.files.iterdir()) == ["a.safetensors"]
    assert DiskTier(tmp_path).verify() == []


def test_no_space_to_convert_is_one_error_and_leaves_nothing(
    tiny_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fail_writes_under("/models/", monkeypatch)
    code, out, err = gen(tiny_gguf, tmp_path)
    assert (code, out) == (1, "") and len(err) == 1, err
    assert err[0].startswith(f"error: cannot convert tiny.gguf into {tmp_path / 'models'}: ")
    assert "[write] Unable to write 4096 bytes to file" in err[0]
    assert list((tmp_path / "models").iterdir()) == []


@pytest.mark.parametrize(
    ("damage", "problem"),
    [
        (
            lambda d: (d / "tokenizer.json").write_text("{}"),
            "tokenizer.json does not match its checksum",
        ),
        (lambda d: (d / "model.safetensors").unlink(), "model.safetensors is missing"),
        (
            lambda d: (d / MANIFEST).unlink(),
            "no checksum manifest: converted by an older mlxcache, or interrupted",
        ),
        (lambda d: (d / MANIFEST).write_text("[" * 500), f"{MANIFEST} is unreadable"),
    ],
)
def test_a_damaged_conversion_is_converted_again(
    tiny_gguf: Path, tmp_path: Path, damage: object, problem: str
) -> None:
    first = load(str(tiny_gguf), cache_root=tmp_path)
    assert check_folder(first.path) is None
    damage(first.path)  # type: ignore[operator]
    warnings: list[str] = []
    again = load(str(tiny_gguf), cache_root=tmp_path, on_warning=warnings.append)
    assert warnings == [
        f"converted model {first.path} is damaged ({problem}): converting tiny.gguf again"
    ]
    assert (again.path, again.key) == (first.path, first.key)
    assert check_folder(again.path) is None
    assert [p.name for p in (tmp_path / "models").iterdir()] == [first.path.name]
    assert load(str(tiny_gguf), cache_root=tmp_path, on_warning=warnings.append).key == first.key
    assert len(warnings) == 1  # the new conversion passes its check


def test_a_garbage_index_is_reported_with_its_fix_and_cleared(
    tiny_gguf: Path, tmp_path: Path
) -> None:
    # A directory no connection of this process has open (SQLite shares open files
    # within a process, which would hide the damage).
    (tmp_path / "kv" / "files").mkdir(parents=True)
    (tmp_path / "kv" / "files" / "old.safetensors").write_bytes(b"x")
    (tmp_path / "kv" / "index.sqlite").write_bytes(b"garbage" * 1000)
    d = ["--cache-dir", str(tmp_path)]
    fix = "`mlxcache cache clear` resets the directory"
    damaged = f"the cache index {tmp_path / 'kv' / 'index.sqlite'} is damaged"
    # Generation warns once and replies without the disk tier.
    code, out, err = gen(tiny_gguf, tmp_path)
    assert code == 0 and json.loads(out)["stats"]["cached_tokens"] == 0
    assert [line for line in err if line.startswith("warning:")] == [
        f"warning: disk cache disabled: {damaged} (file is not a database); {fix}"
    ]
    for verb in (["stats"], ["ls"], ["prune", "--max-size", "1"]):
        assert cache_cmd(*verb, *d) == (
            1,
            "",
            [f"error: {damaged} (file is not a database); {fix}"],
        )
    code, out, err = cache_cmd("stats", "--check", "--json", *d)
    assert code == 1 and json.loads(out) == {
        "directory": str(tmp_path / "kv"),
        "problems": [f"{damaged} (file is not a database); {fix}"],
    }
    assert err == ["error: the check found 1 problem(s), listed on stdout"]
    assert cache_cmd("clear", *d) == (
        0,
        "removed 0 entries (1 B freed)\n",  # old.safetensors
        [
            "warning: the cache index was damaged (file is not a database): "
            "deleted it and every block file"
        ],
    )
    assert cache_cmd("stats", "--check", *d)[0] == 0
    assert not (tmp_path / "kv" / "files" / "old.safetensors").exists()
    assert gen(tiny_gguf, tmp_path)[0] == 0
    assert json.loads(gen(tiny_gguf, tmp_path)[1])["stats"]["cached_tokens"] == 20


def test_stats_check_exits_1_when_a_file_is_missing(tiny_gguf: Path, tmp_path: Path) -> None:
    assert gen(tiny_gguf, tmp_path)[0] == 0
    victim = sorted((tmp_path / "kv" / "files").iterdir())[0]
    victim.unlink()
    code, out, err = cache_cmd("stats", "--check", "--json", "--cache-dir", str(tmp_path))
    assert code == 1 and len(json.loads(out)["problems"]) == 1
    assert json.loads(out)["problems"][0].startswith(f"{victim.stem}: ")
    assert err == ["error: the check found 1 problem(s), listed on stdout"]


def test_looking_at_a_missing_cache_dir_creates_nothing(tmp_path: Path) -> None:
    missing = tmp_path / "nothing-here"
    empty = {"entries": 0, "bytes": 0, "models": [], "tokens": 0}
    result = runner.invoke(app, ["cache", "stats", "--json", "--cache-dir", str(missing)])
    assert result.exit_code == 0
    assert json.loads(result.stdout) == {"directory": str(missing / "kv"), **empty}
    for verb in (["ls"], ["prune", "--max-size", "1"], ["clear"], ["stats", "--check"]):
        assert cache_cmd(*verb, "--json", "--cache-dir", str(missing))[0] == 0
    assert not missing.exists()


def test_clear_removes_block_files_no_index_names(tmp_path: Path) -> None:
    files = tmp_path / "kv" / "files"
    files.mkdir(parents=True)
    (files / "stray.safetensors").write_bytes(b"x")
    assert cache_cmd("clear", "--cache-dir", str(tmp_path)) == (
        0,
        "removed 0 entries (1 B freed)\n",
        [],
    )
    assert not files.exists()


def test_a_cache_dir_that_is_a_file_is_one_error(tiny_gguf: Path, tmp_path: Path) -> None:
    blocked = tmp_path / "blocked"
    blocked.write_text("not a directory")
    code, out, err = gen(tiny_gguf, blocked / "below")
    assert (code, out, err) == (
        2,
        "",
        [f"error: cache directory {blocked / 'below'} is not a directory ({blocked} is a file)"],
    )


def test_json_nesting_limit_is_exact() -> None:
    assert loads_json("[" * MAX_DEPTH + "]" * MAX_DEPTH) is not None
    assert loads_json('["' + "[" * 5000 + '"]') == ["[" * 5000]  # brackets in strings are text
    with pytest.raises(json.JSONDecodeError) as info:
        loads_json('{"a": ' + "[" * MAX_DEPTH + "]" * MAX_DEPTH + "}")
    assert (info.value.msg, info.value.pos) == (f"nested deeper than {MAX_DEPTH} levels", 6 + 99)


def test_yaml_refuses_depth_cycles_and_alias_bombs() -> None:
    assert load_yaml("a: " + "[" * (MAX_DEPTH - 1) + "]" * (MAX_DEPTH - 1)) is not None
    for text, message in [
        ("a: " + "[" * MAX_DEPTH + "]" * MAX_DEPTH, "nested deeper than 100 levels"),
        ("&a [*a]", "nested deeper than 100 levels"),
        (
            "a: &a [" + ", ".join(["x"] * 100) + "]\n"
            "b: &b [" + ", ".join(["*a"] * 100) + "]\n"
            "c: [" + ", ".join(["*b"] * 100) + "]\n",
            "more than 1000000 values once its aliases are expanded",
        ),
    ]:
        with pytest.raises(yaml.YAMLError, match=message):
            load_yaml(text)


def test_a_full_disk_under_a_batch_output_keeps_the_lines_written(
    tiny_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import os

    (tmp_path / "in.jsonl").write_text('{"prompt": "a"}\n{"prompt": "b"}\n')
    out = tmp_path / "out.jsonl"
    args = ["json", "--schema", '{"type": "string", "maxLength": 3}', "-m", str(tiny_gguf)]
    args += ["--input", str(tmp_path / "in.jsonl"), "-o", str(out), "-n", "8"]
    calls = []

    def full(fd: int) -> None:  # the first record reaches the file, its fsync fails
        calls.append(fd)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    result = runner.invoke(app, args)
    assert (result.exit_code, result.stdout) == (1, "") and len(calls) == 1
    assert result.stderr.splitlines() == [
        f"error: cannot write output file {out}: No space left on device; the lines written "
        "before are kept and a rerun goes on from there"
    ]
    monkeypatch.undo()
    again = runner.invoke(app, args)
    assert again.exit_code == 0, again.stderr
    assert [json.loads(line)["line"] for line in out.read_text().splitlines()] == [1, 2]
    assert "1 lines run, 1 already in" in again.stderr


def test_an_index_damaged_while_in_use_names_its_fix(tiny: LoadedModel, tmp_path: Path) -> None:
    warnings: list[str] = []
    config = CacheConfig(block_size=4)
    cache = PromptCache(tiny.model, tiny.key, config, tmp_path / "kv", warnings.append)

    def malformed(*_args: object) -> list[object]:
        raise sqlite3.DatabaseError("database disk image is malformed")

    cache.disk.entries = malformed  # type: ignore[union-attr, method-assign]
    result = Engine(tiny, cache).complete(Request(list(range(3, 20)), SamplingParams(max_tokens=2)))
    assert result.finish_reason == "length" and cache.disk is None
    assert warnings == [
        f"disk cache disabled: the cache index {tmp_path / 'kv' / 'index.sqlite'} is damaged "
        "(database disk image is malformed); `mlxcache cache clear` resets the directory"
    ]
