"""GGUF conversion: exact weights (Q/K un-permuted), supported types, clear errors."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.llama import Model, ModelArgs
from tinymodel import write_tiny_gguf

from mlxcache.engine import Engine, Request
from mlxcache.errors import ModelNotFoundError, UnsupportedModelError
from mlxcache.model import load
from mlxcache.model.loader import LoadedModel


def reference_logits(hf: dict[str, np.ndarray], config: dict, ids: list[int]) -> mx.array:
    """Logits of mlx-lm's llama built straight from the HF-layout weights."""
    model = Model(ModelArgs.from_dict(config))
    model.load_weights([(k, mx.array(v)) for k, v in hf.items()])
    return model(mx.array([ids]))


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16])
def test_converted_model_matches_reference(tmp_path: Path, dtype: mx.Dtype) -> None:
    gguf = tmp_path / "m.gguf"
    hf = write_tiny_gguf(gguf, dtype=dtype)
    if dtype == mx.float16:  # the reference sees the same rounded weights
        hf = {
            k: v if "norm" in k else v.astype(np.float16).astype(np.float32) for k, v in hf.items()
        }
    loaded = load(str(gguf), cache_root=tmp_path / "cache")
    ids = [5, 80, 81, 100, 7, 3]
    ours = loaded.model(mx.array([ids]))
    ref = reference_logits(hf, loaded.config, ids)
    assert mx.array_equal(ours, ref)
    # Converted once: a second load reuses the folder (same path, same key).
    again = load(str(gguf), cache_root=tmp_path / "cache")
    assert (again.path, again.key) == (loaded.path, loaded.key)


def test_model_key_depends_on_weights(tmp_path: Path) -> None:
    write_tiny_gguf(tmp_path / "a.gguf", seed=1)
    write_tiny_gguf(tmp_path / "b.gguf", seed=2)
    a = load(str(tmp_path / "a.gguf"), cache_root=tmp_path / "c")
    b = load(str(tmp_path / "b.gguf"), cache_root=tmp_path / "c")
    assert a.key != b.key and len(a.key) == 32


def test_unsupported_architecture(tmp_path: Path) -> None:
    write_tiny_gguf(tmp_path / "q.gguf", arch="qwen3moe")
    with pytest.raises(UnsupportedModelError) as err:
        load(str(tmp_path / "q.gguf"), cache_root=tmp_path / "c")
    assert str(err.value) == (
        "unsupported GGUF: architecture 'qwen3moe' (supported: gemma3, llama, phi3, qwen2, qwen3)"
    )
    assert not (tmp_path / "c" / "models").exists() or not any(
        (tmp_path / "c" / "models").iterdir()
    )


def test_not_a_gguf_file(tmp_path: Path) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 10)
    with pytest.raises(UnsupportedModelError) as err:
        load(str(bad), cache_root=tmp_path / "c")
    assert str(err.value) == (
        f"cannot read GGUF {bad}: unsupported or damaged header: GGUF version 0 (known: 2, 3)"
    )


def test_missing_model(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError, match="model file not found"):
        load(str(tmp_path / "nope.gguf"), cache_root=tmp_path / "c")
    with pytest.raises(ModelNotFoundError, match="model not found"):
        load(str(tmp_path / "nope"), cache_root=tmp_path / "c")


@pytest.mark.model
def test_embedded_model_answers_paris(smol: LoadedModel) -> None:
    assert smol.config["quantization"] == {"group_size": 32, "bits": 4}
    engine = Engine(smol)
    ids = engine.encoder.encode_chat(
        [{"role": "user", "content": "What is the capital of France?"}]
    )
    assert "Paris" in engine.complete(Request(ids)).text


@pytest.mark.parametrize(("qtype", "bits"), [("Q4_0", 4), ("Q4_1", 4), ("Q8_0", 8)])
def test_quantized_gguf_types(tmp_path: Path, qtype: str, bits: int) -> None:
    """llama.cpp-quantized files load as MLX affine-quantized layers with the same weights."""
    from tinymodel import write_quantized_gguf

    gguf = tmp_path / f"m-{qtype}.gguf"
    hf = write_quantized_gguf(gguf, qtype)
    loaded = load(str(gguf), cache_root=tmp_path / "cache")
    assert loaded.config["quantization"] == {"group_size": 32, "bits": bits}
    ids = [5, 80, 81, 100, 7, 3]
    ours = loaded.model(mx.array([ids]))
    ref = reference_logits(hf, loaded.config | {"quantization": None}, ids)
    # Quantized vs dense kernels: same weights, different summation order.
    assert mx.allclose(ours, ref, atol=1e-4, rtol=1e-4)
    assert mx.array_equal(mx.argmax(ours, axis=-1), mx.argmax(ref, axis=-1))


def test_raw_prompts_keep_the_bos_the_tokenizer_adds(tmp_path: Path) -> None:
    """`--raw` encodes as mlx-lm does: a tokenizer that adds a BOS (Gemma, Llama 3) gets it."""
    from gguf import GGMLQuantizationType
    from test_gguf_quants import write_random_quantized_llama
    from typer.testing import CliRunner

    from mlxcache_cli.main import app

    gguf = tmp_path / "bos.gguf"
    write_random_quantized_llama(gguf, GGMLQuantizationType.Q8_0, add_bos=True)
    loaded = load(str(gguf), cache_root=tmp_path)
    engine = Engine(loaded)
    plain = loaded.tokenizer.encode("ab ab", add_special_tokens=False)
    assert engine.encoder.encode("ab ab") == [1, *plain] == loaded.tokenizer.encode("ab ab")
    assert engine.encoder.encode("<|im_start|>ab ab") == [1, *plain]  # never a second BOS
    args = ["generate", "--raw", "-m", str(gguf), "--cache-dir", str(tmp_path), "-n", "1"]
    result = CliRunner().invoke(app, [*args, "--json", "ab ab"])
    assert result.exit_code == 0, result.stderr
    assert json.loads(result.stdout)["stats"]["prompt_tokens"] == 1 + len(plain)
    # A tokenizer that adds nothing (SmolLM2's, the tiny model's) is encoded as before.
    tiny = tmp_path / "tiny.gguf"
    write_tiny_gguf(tiny)
    no_bos = load(str(tiny), cache_root=tmp_path)
    assert Engine(no_bos).encoder.encode("ab ab") == no_bos.tokenizer.encode(
        "ab ab", add_special_tokens=False
    )
