"""GGUF tensors read exactly: every type against llama.cpp's own dequantizer (`gguf.quants`).

Blocks are random bytes with finite float16 scale fields, so every bit pattern of the
quantized values, sub-block scales and high bits is exercised: no quantizer needed, which
is how Q4_K and Q5_K (that `gguf.quants` cannot quantize) are written.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import mlx.core as mx
import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants
from mlx_lm.models.llama import Model, ModelArgs
from tinymodel import CHATML, SPECIALS, byte_chars, tiny_weights
from tinymodel import _gguf_name as gguf_name

from mlxcache.errors import UnsupportedModelError
from mlxcache.model import load
from mlxcache.model.gguf_file import open_gguf
from mlxcache.model.gguf_tensors import AFFINE, pack, to_mlx

T = GGMLQuantizationType
# Byte ranges of each type's float16 fields (d, and dmin or m where there is one).
_F16_FIELDS = {
    T.Q4_0: [0],
    T.Q4_1: [0, 2],
    T.Q5_0: [0],
    T.Q5_1: [0, 2],
    T.Q8_0: [0],
    T.Q4_K: [0, 2],
    T.Q5_K: [0, 2],
    T.Q2_K: [80, 82],
    T.Q3_K: [108],
    T.Q6_K: [208],
    T.IQ4_NL: [0],
    T.IQ4_XS: [0],
    T.IQ2_XXS: [0],
    T.IQ3_S: [0],
}
_DENSE = [T.Q2_K, T.Q3_K, T.Q6_K, T.IQ4_NL, T.IQ4_XS, T.IQ2_XXS, T.IQ3_S]


def random_blocks(qtype: GGMLQuantizationType, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Raw `qtype` data for a (rows, cols) tensor: random bytes, finite float16 scales."""
    block, size = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows * cols // block, size), dtype=np.uint8)
    for at in _F16_FIELDS[qtype]:
        scale = (rng.standard_normal(raw.shape[0]) * 2e-3).astype(np.float16)
        raw[:, at : at + 2] = scale.view(np.uint8).reshape(-1, 2)
    return raw.reshape(rows, cols // block * size)


def write_tensors(
    path: Path, tensors: dict[str, tuple[np.ndarray, GGMLQuantizationType | None]]
) -> None:
    """A GGUF holding just `tensors` (raw bytes with their type, or float arrays)."""
    writer = gguf.GGUFWriter(str(path), arch="llama")
    for name, (data, qtype) in tensors.items():
        writer.add_tensor(name, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def read_back(
    tmp_path: Path, raw: np.ndarray, qtype: GGMLQuantizationType
) -> mx.array | dict[str, mx.array]:
    write_tensors(tmp_path / "t.gguf", {"w.weight": (raw, qtype)})
    reader, _ = open_gguf(tmp_path / "t.gguf")
    return to_mlx(reader.tensors[0])


@pytest.mark.parametrize("qtype", list(AFFINE), ids=lambda t: t.name)
def test_affine_types_repack_exactly(tmp_path: Path, qtype: GGMLQuantizationType) -> None:
    raw = random_blocks(qtype, 6, 512)
    got = read_back(tmp_path, raw, qtype)
    assert isinstance(got, dict)
    bits = AFFINE[qtype][0]
    assert (got["scales"].dtype, got["biases"].dtype) == (mx.float32, mx.float32)
    assert got["weight"].shape == (6, 512 * bits // 32) and got["scales"].shape == (6, 16)
    ours = np.array(mx.dequantize(*got.values(), group_size=32, bits=bits))
    ref = quants.dequantize(raw, qtype)
    assert ref.dtype == np.float32 and np.isfinite(ref).all()
    # Equal values (a zero may differ in sign: d*(q-8) vs d*q + -8d), and nothing else.
    assert np.array_equal(ours, ref)
    same_bits = ours.view(np.uint32) == ref.view(np.uint32)
    assert (same_bits | (ref == 0)).all()


@pytest.mark.parametrize("qtype", _DENSE, ids=lambda t: t.name)
def test_other_types_dequantize_to_float32(tmp_path: Path, qtype: GGMLQuantizationType) -> None:
    raw = random_blocks(qtype, 3, 512)
    got = read_back(tmp_path, raw, qtype)
    assert isinstance(got, mx.array) and got.dtype == mx.float32
    ref = quants.dequantize(raw, qtype)
    assert np.array_equal(np.array(got), ref, equal_nan=True)


def test_float_types_become_float32(tmp_path: Path) -> None:
    value = np.random.default_rng(1).standard_normal((4, 64)).astype(np.float16)
    write_tensors(
        tmp_path / "f.gguf",
        {"a.weight": (value, None), "b.weight": (value.astype(np.float32), None)},
    )
    reader, _ = open_gguf(tmp_path / "f.gguf")
    for tensor in reader.tensors:
        got = to_mlx(tensor)
        assert (
            isinstance(got, mx.array)
            and got.dtype == mx.float32
            and np.array_equal(np.array(got), value.astype(np.float32))
        )


def test_a_type_nothing_can_read_is_one_line(tmp_path: Path) -> None:
    write_tensors(
        tmp_path / "i.gguf", {"blk.0.ffn_down.weight": (np.zeros((4, 32), np.int32), None)}
    )
    reader, _ = open_gguf(tmp_path / "i.gguf")
    with pytest.raises(UnsupportedModelError) as err:
        to_mlx(reader.tensors[0])
    assert str(err.value) == (
        "tensor blk.0.ffn_down.weight has type I32, which mlxcache cannot read "
        "(the gguf library cannot dequantize it)"
    )


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
def test_pack_is_mlx_packing(bits: int) -> None:
    q = np.random.default_rng(bits).integers(0, 1 << bits, size=(3, 128), dtype=np.uint8)
    ones = mx.ones((3, 4))
    got = mx.dequantize(mx.array(pack(q, bits)), ones, mx.zeros((3, 4)), group_size=32, bits=bits)
    assert np.array_equal(np.array(got), q.astype(np.float32))


def unpermute(value: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's rotary row permutation (the reference's own, not the converter's)."""
    rows = value.shape[0]
    return value.reshape(n_head, rows // n_head // 2, 2, -1).swapaxes(1, 2).reshape(value.shape)


def gpt2_vocab(
    writer: gguf.GGUFWriter, template: str = CHATML, add_bos: bool = False, pre: str = "default"
) -> None:
    """The tiny model's byte-level BPE vocabulary and chat template (none if empty);
    `add_bos`: its tokenizer adds a BOS token (`<|im_start|>`, id 1) as Llama 3's does;
    `pre`: the pre-tokenizer it names."""
    tokens = SPECIALS + byte_chars() + ["ab", "abab", "Ġa"]
    writer.add_string("tokenizer.ggml.model", "gpt2")
    writer.add_string("tokenizer.ggml.pre", pre)
    writer.add_array("tokenizer.ggml.tokens", tokens)
    writer.add_array("tokenizer.ggml.token_type", [3] * 3 + [1] * (len(tokens) - 3))
    writer.add_array("tokenizer.ggml.merges", ["a b", "ab ab", "Ġ a"])
    writer.add_uint32("tokenizer.ggml.bos_token_id", 1)
    writer.add_uint32("tokenizer.ggml.eos_token_id", 2)
    writer.add_bool("tokenizer.ggml.add_bos_token", add_bos)
    if template:
        writer.add_string("tokenizer.chat_template", template)


def write_random_quantized_llama(
    path: Path, qtype: GGMLQuantizationType, *, add_bos: bool = False
) -> dict[str, np.ndarray]:
    """A tiny llama whose matrices are random `qtype` blocks (norms F32, embedding Q8_0);
    `add_bos`: its tokenizer adds a BOS token (`<|im_start|>`, id 1) as Llama 3's does.

    Returns the HF-layout float32 weights the file holds (dequantized by `gguf.quants`).
    """
    shapes = {k: v.shape for k, v in tiny_weights(hidden=256, ffn=512).items()}
    writer = gguf.GGUFWriter(str(path), arch="llama")
    for key, value in {
        "llama.embedding_length": 256,
        "llama.block_count": 2,
        "llama.feed_forward_length": 512,
        "llama.attention.head_count": 4,
        "llama.attention.head_count_kv": 2,
        "llama.context_length": 256,
    }.items():
        writer.add_uint32(key, value)
    writer.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    gpt2_vocab(writer, add_bos=add_bos)
    hf: dict[str, np.ndarray] = {}
    for seed, (name, shape) in enumerate(sorted(shapes.items())):
        gname, n_head = gguf_name(name)
        kind = T.Q8_0 if gname == "token_embd.weight" else None if "norm" in gname else qtype
        if kind is None:
            data = 1 + np.random.default_rng(seed).standard_normal(shape).astype(np.float32) * 0.1
            writer.add_tensor(gname, data)
            value = data
        else:
            data = random_blocks(kind, *shape, seed=seed)
            writer.add_tensor(gname, data, raw_dtype=kind)
            value = quants.dequantize(data, kind)
        hf[name] = unpermute(value, n_head) if n_head else value
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return hf


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q5_K, T.Q5_0, T.Q5_1, T.Q6_K], ids=lambda t: t.name)
def test_quantized_llama_matches_its_dequantized_weights(
    tmp_path: Path, qtype: GGMLQuantizationType
) -> None:
    """The converted model computes with exactly the file's weights: a dense llama built
    from `gguf.quants.dequantize` agrees with it (up to kernel summation order)."""
    hf = write_random_quantized_llama(tmp_path / "m.gguf", qtype)
    loaded = load(str(tmp_path / "m.gguf"), cache_root=tmp_path / "cache")
    bits = AFFINE[qtype][0] if qtype in AFFINE else None
    q_proj = loaded.model.model.layers[0].self_attn.q_proj
    assert getattr(q_proj, "bits", None) == bits
    for name, value in hf.items():  # every weight, quantized or not, is the file's own
        module = loaded.model
        for part in name.removesuffix(".weight").split("."):
            module = module[int(part)] if part.isdigit() else getattr(module, part)
        if hasattr(module, "scales"):
            got = mx.dequantize(
                module.weight, module.scales, module.biases, group_size=32, bits=module.bits
            )
        else:
            got = module.weight
        assert np.array_equal(np.array(got), value), name
    ids = [5, 80, 81, 100, 7, 3]
    reference = Model(ModelArgs.from_dict(loaded.config | {"quantization": None}))
    reference.load_weights([(k, mx.array(v)) for k, v in hf.items()])
    ours, ref = loaded.model(mx.array([ids])), reference(mx.array([ids]))
    assert mx.allclose(ours, ref, atol=1e-3, rtol=1e-3)
