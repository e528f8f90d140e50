"""Quantized KV (`--kv-bits`): kept and resumed exactly in its own namespace, fewer bytes
per token than full precision, layers without a quantized form left as they are, and bad
settings one line. The exactness matrix runs every check on an 8-bit variant too
(tests/test_exactness.py)."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from guarantees import (
    GREEDY,
    KV_GROUP,
    Rig,
    Variant,
    check_kv_apart,
    check_probes_kv_apart,
    prompt,
)
from tinymodel import write_sliding
from typer.testing import CliRunner

from mlxcache.cache.store import PromptCache
from mlxcache.config import CacheConfig
from mlxcache.engine import Engine, Request
from mlxcache.errors import SettingError, UserInputError
from mlxcache.model import LoadedModel, load
from mlxcache.model.kvquant import quantize_kv
from mlxcache.remote import Wanted, differences
from mlxcache.sampling import SamplingParams
from mlxcache_cli.main import app

runner = CliRunner()
B = 4


@pytest.mark.parametrize("name", ["quantized", "shaped-quantized"])
def test_precisions_keep_apart(name: str, variants: dict[str, Variant], tmp_path: Path) -> None:
    """Bits and group sizes (heads of 64: groups of 32 and 64), in one process and in new
    ones."""
    check_kv_apart(Rig(variants[name], tmp_path))


def test_probe_answers_are_per_kv_width(variants: dict[str, Variant], tmp_path: Path) -> None:
    check_probes_kv_apart(Rig(variants["quantized"], tmp_path))


@pytest.mark.parametrize("bits", [8, 4])
def test_resumed_equals_cold_and_blocks_cost_less(
    bits: int, quantizable: LoadedModel, tmp_path: Path
) -> None:
    """At each bit width a prompt resumed from memory and from disk replies as a cold run
    at that width, and a token's kept KV costs 8-bit at most a third of full precision's,
    4-bit at most a fifth (heads of 64, groups of 32)."""
    model = quantize_kv(quantizable, bits, KV_GROUP)
    config = CacheConfig(block_size=B, directory=tmp_path)
    params = SamplingParams(max_tokens=8, temperature=0.9, seed=2)
    first, turn = prompt(23, seed=1), [*prompt(23, seed=1), *prompt(6, seed=2)]
    cold = Engine(model, block_size=B).complete(Request(turn, params))
    engine = Engine(model, PromptCache(model.model, model.key, config, root=tmp_path / "kv"))
    engine.complete(Request(first, params))
    warm = engine.complete(Request(turn, params))
    assert (warm.stats.cached_tokens, warm.tokens) == (20, cold.tokens)
    reopened = PromptCache(model.model, model.key, config, root=tmp_path / "kv")
    disk = Engine(model, reopened).complete(Request(turn, params))
    # The second request kept its own blocks too: the whole turn but its last token.
    assert (disk.stats.cached_from, disk.stats.cached_tokens, disk.tokens) == (
        "disk",
        28,
        cold.tokens,
    )
    full = PromptCache(quantizable.model, quantizable.key, CacheConfig(block_size=B, disk_bytes=0))
    Engine(quantizable, full).complete(Request(first, params))
    per_token = engine.cache.report()["kv_bytes_per_token"]
    assert per_token * (3 if bits == 8 else 5) <= full.report()["kv_bytes_per_token"]


def test_a_sliding_window_stays_full_precision_and_resumes_exactly(
    quantizable: LoadedModel, tmp_path: Path
) -> None:
    """Ring buffers have no quantized form: said once, kept as they are beside the
    quantized layer, and the mixed model resumes as its cold run."""
    sliding = load(str(write_sliding(quantizable.path, tmp_path / "sliding")))
    said: list[str] = []
    model = quantize_kv(sliding, 8, KV_GROUP, said.append)
    assert said == [
        "--kv-bits: 1 of sliding's 2 layers (sliding window or recurrent) have no quantized "
        "form: they stay full precision"
    ]
    cache = PromptCache(model.model, model.key, CacheConfig(block_size=B, disk_bytes=0))
    assert cache.layout is not None and cache.layout.kinds == ["ring", "qkv"]
    engine = Engine(model, cache)
    tokens = prompt(30, seed=3)
    engine.complete(Request(tokens[:21], GREEDY))
    warm = engine.complete(Request(tokens, GREEDY))
    cold = Engine(model, block_size=B).complete(Request(tokens, GREEDY))
    assert (warm.stats.cached_tokens, warm.tokens) == (20, cold.tokens)


def test_a_group_that_does_not_divide_the_heads_is_one_line(tiny: LoadedModel) -> None:
    with pytest.raises(UserInputError) as caught:
        quantize_kv(tiny, 8, 32)  # the tiny model's heads are 16 wide
    assert str(caught.value) == (
        "--kv-group-size 32 does not divide tiny.gguf's attention head size (16)"
    )
    for bad in ({"kv_bits": 3}, {"kv_group_size": 48}):
        with pytest.raises(SettingError):
            CacheConfig(**bad)  # type: ignore[arg-type]


def test_a_server_quantizing_otherwise_is_named() -> None:
    found = {**Wanted("m", 16, True).identity(), "kv": "8-bit, groups of 64"}
    assert differences(found, Wanted("m", 16, True)) == [
        "KV quantization (--kv-bits): 8-bit, groups of 64 (server) vs full precision (this command)"
    ]


def test_the_cli_quantizes_resumes_and_refuses_bad_settings(
    quantizable: LoadedModel, tmp_path: Path
) -> None:
    args = ["generate", "--raw", "hello world, this is a test", "-m", str(quantizable.path)]
    args += ["--cache-dir", str(tmp_path), "-n", "6", "--json", "--block-size", "4"]
    quantized = [*args, "--kv-bits", "8", "--kv-group-size", "32"]
    docs = []
    for _ in range(2):
        result = runner.invoke(app, quantized)
        assert result.exit_code == 0, result.stderr
        docs.append(json.loads(result.stdout))
    assert docs[0]["stats"]["cached_tokens"] == 0 and docs[1]["stats"]["cached_tokens"] == 24
    assert docs[0]["tokens"] == docs[1]["tokens"]
    full = json.loads(runner.invoke(app, args).stdout)
    assert full["stats"]["cached_tokens"] == 0  # full precision reads none of its entries
    wide = [*args, "--kv-bits", "8", "--kv-group-size", "64"]  # heads of 64: groups of 64 fit
    for cached in (0, 24):  # none of 32's entries, then its own
        doc = json.loads(runner.invoke(app, wide).stdout)
        assert (doc["stats"]["cached_tokens"], doc["tokens"]) == (cached, docs[0]["tokens"])
    listed = runner.invoke(app, ["cache", "ls", "--json", "--cache-dir", str(tmp_path)])
    name = quantizable.path.name
    models = sorted({row["model"] for row in json.loads(listed.stdout)})
    assert models == [name, f"{name} (q8g32)", f"{name} (q8g64)"]
    for extra, line in [
        (["--kv-bits", "3"], "error: --kv-bits must be one of 4, 8, got 3\n"),
        (
            ["--kv-bits", "8", "--kv-group-size", "48"],
            "error: --kv-group-size must be one of 32, 64, 128, got 48\n",
        ),
        (
            ["--kv-bits", "8", "--kv-group-size", "128"],
            f"error: --kv-group-size 128 does not divide {quantizable.path.name}'s attention "
            "head size (64): try --kv-group-size 64\n",
        ),
    ]:
        result = runner.invoke(app, [*args, *extra])
        assert (result.exit_code, result.stdout, result.stderr) == (2, "", line)
    assert np.asarray(docs[0]["tokens"]).size == 6


@pytest.mark.skipif(mx.default_device() != mx.cpu, reason="measured on MLX's CPU backend")
@pytest.mark.parametrize("bits", [8, 4])
def test_the_probe_measures_quantized_attention(quantizable: LoadedModel, bits: int) -> None:
    """Quantized decode KV equals chunked prefill's on this CPU (kept replies then hold),
    a shape-sensitive model's does not, and quantized rows never decode as one batch."""
    from shapemodel import shaped

    from mlxcache.invariance import batch_matches_solo, decode_matches_prefill

    quantized = quantize_kv(quantizable, bits, KV_GROUP)
    assert decode_matches_prefill(quantized.model, 16)
    assert not decode_matches_prefill(shaped(quantized).model, 16)
    assert not batch_matches_solo(quantized.model, 4)
