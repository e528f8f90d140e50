"""Damaged GGUF files and damaged conversions (issue 20's rows): one error line, nothing kept.

A GGUF header followed by random bytes crashed MLX's own reader (segmentation fault): that
case runs in a child process, so the old crash fails the test instead of killing pytest.
"""

from __future__ import annotations

import random
import struct
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from test_gguf_quants import write_random_quantized_llama
from typer.testing import CliRunner

from mlxcache.errors import UnsupportedModelError
from mlxcache.model import load
from mlxcache.model.gguf_file import open_gguf
from mlxcache.model.loader import default_model_path
from mlxcache_cli.main import app

runner = CliRunner()
Commands = list[list[str]]


def commands(model: Path, cache: Path) -> Commands:
    at = ["--cache-dir", str(cache)]
    return [
        ["models", "info", "-m", str(model), *at],
        ["generate", "--model", str(model), "-n", "2", *at, "hello"],
    ]


def smol_head(size: int) -> bytes:
    """The first `size` bytes of the embedded SmolLM2 GGUF: a real file, truncated."""
    with default_model_path().open("rb") as f:
        return f.read(size)


def header_then_random() -> bytes:
    """A GGUF header (version 3, 2 tensors, 3 metadata entries), then random bytes."""
    noise = np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes()
    return b"GGUF" + struct.pack("<IQQ", 3, 2, 3) + noise


DAMAGED: dict[str, tuple[Callable[[], bytes], str]] = {
    "empty.gguf": (lambda: b"", "the file is empty"),
    "notes.gguf": (lambda: b"shopping list\n", "not a GGUF file (it does not start with 'GGUF')"),
    "short.gguf": (lambda: b"GGUF\x03", "truncated: the file ends inside the header"),
    "cut.gguf": (
        lambda: smol_head(5_000_000),
        "truncated: tensor token_embd.weight (Q8_0, bytes 1785664..31866688) ends past the "
        "end of the file (5000000 bytes)",
    ),
    "cut_header.gguf": (
        lambda: smol_head(100_000),
        "truncated or damaged header: an array of 49152 items at byte 1095 runs past the end "
        "of the file (100000 bytes)",
    ),
    "noise.gguf": (
        header_then_random,
        "truncated or damaged header: it runs past the end of the file (4120 bytes)",
    ),
}


def assert_nothing_converted(cache: Path) -> None:
    models = cache / "models"
    assert not models.exists() or list(models.iterdir()) == []


@pytest.mark.parametrize("name", [n for n in DAMAGED if n != "noise.gguf"])
def test_a_damaged_gguf_is_one_error_line(tmp_path: Path, name: str) -> None:
    content, problem = DAMAGED[name]
    model = tmp_path / name
    model.write_bytes(content())
    for args in commands(model, tmp_path / "cache"):
        result = runner.invoke(app, args)
        assert (result.exit_code, result.stdout) == (2, ""), args
        assert result.stderr == f"error: cannot read GGUF {model}: {problem}\n", args
    assert_nothing_converted(tmp_path / "cache")


def test_header_then_random_bytes_is_an_error_not_a_crash(tmp_path: Path) -> None:
    model = tmp_path / "noise.gguf"
    model.write_bytes(header_then_random())
    for args in commands(model, tmp_path / "cache"):
        done = subprocess.run(
            [sys.executable, "-m", "mlxcache_cli", *args],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert (done.returncode, done.stdout) == (2, ""), (args, done.stderr)
        assert done.stderr == f"error: cannot read GGUF {model}: {DAMAGED['noise.gguf'][1]}\n"
    assert_nothing_converted(tmp_path / "cache")


def test_a_huge_array_length_is_refused_without_reading_it(tmp_path: Path) -> None:
    """2**40 one-byte items announced in a 68-byte file: refused at once, no loop."""
    key = b"general.junk"
    entry = struct.pack("<Q", len(key)) + key + struct.pack("<IIQ", 9, 0, 1 << 40)
    (tmp_path / "a.gguf").write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + entry + b"\0" * 8)
    with pytest.raises(UnsupportedModelError) as err:
        open_gguf(tmp_path / "a.gguf")
    assert str(err.value).endswith(
        "truncated or damaged header: an array of 1099511627776 items at byte 48 runs past "
        "the end of the file (68 bytes)"
    )


def test_damaged_copies_of_a_good_file_load_or_fail_with_one_error(tmp_path: Path) -> None:
    """A seeded sweep: a tiny Q4_K file cut at many places and with bytes of its header
    changed. Each copy either loads or raises UnsupportedModelError; none crashes, and no
    half-converted folder is left behind."""
    good = tmp_path / "good.gguf"
    write_random_quantized_llama(good, __import__("gguf").GGMLQuantizationType.Q4_K)
    data = good.read_bytes()
    header_end, _ = open_gguf(good)[0].data_offset, None
    rng = random.Random(20)
    copies = [data[:cut] for cut in sorted(rng.sample(range(len(data)), 25))]
    for _ in range(40):
        changed = bytearray(data)
        for _ in range(rng.randint(1, 3)):
            changed[rng.randrange(header_end)] = rng.randrange(256)
        copies.append(bytes(changed))
    outcomes = {"loaded": 0, "refused": 0}
    for i, blob in enumerate(copies):
        model = tmp_path / f"copy{i}.gguf"
        model.write_bytes(blob)
        try:
            load(str(model), cache_root=tmp_path / "cache")
            outcomes["loaded"] += 1
        except UnsupportedModelError as exc:
            assert "\n" not in str(exc)
            outcomes["refused"] += 1
        model.unlink()
    assert outcomes["refused"] >= 25  # every cut copy, at least
    leftovers = [p.name for p in (tmp_path / "cache" / "models").iterdir()]
    assert len(leftovers) == outcomes["loaded"] and not any(n.startswith(".") for n in leftovers)


def test_a_truncated_conversion_is_rebuilt(tiny_gguf: Path, tmp_path: Path) -> None:
    """`truncate -s` of a converted folder's weights: found by its checksums, converted again."""
    args = ["generate", "--raw", "-m", str(tiny_gguf), "-n", "4", "--cache-dir", str(tmp_path)]
    first = runner.invoke(app, [*args, "--no-cache", "ab ab"])
    assert first.exit_code == 0, first.stderr
    (folder,) = (tmp_path / "models").iterdir()
    weights = folder / "model.safetensors"
    with weights.open("r+b") as f:
        f.truncate(weights.stat().st_size // 2)
    again = runner.invoke(app, [*args, "--no-cache", "ab ab"])
    assert again.exit_code == 0, again.stderr
    assert again.stderr.splitlines()[0] == (
        f"warning: converted model {folder} is damaged (model.safetensors does not match its "
        f"checksum): converting {tiny_gguf.name} again"
    )
    assert again.stdout == first.stdout


def test_a_damaged_mlx_lm_folder_is_one_error_line(tiny_gguf: Path, tmp_path: Path) -> None:
    """A user's own mlx-lm folder whose weights are cut short: MLX's RuntimeError is one line."""
    folder = load(str(tiny_gguf), cache_root=tmp_path / "cache").path
    weights = folder / "model.safetensors"
    with weights.open("r+b") as f:
        f.truncate(weights.stat().st_size // 2)
    result = runner.invoke(app, ["generate", "-m", str(folder), "--cache-dir", str(tmp_path), "hi"])
    assert (result.exit_code, result.stdout) == (2, "")
    (line,) = result.stderr.splitlines()
    assert line.startswith(f"error: cannot load model {folder}: [load_safetensors] ")
