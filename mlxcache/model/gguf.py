"""Convert a llama-architecture GGUF file into an mlx-lm model folder.

`mlx.core.load` reads GGUF tensors; Q4_0/Q4_1/Q8_0 come back as MLX affine-quantized
triples (weight, scales, biases; group size 32), F16/F32 as dense arrays. What is left
to do is renaming, undoing llama.cpp's rotary row permutation of Q/K, and writing the
config and tokenizer files mlx-lm expects.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx

from mlxcache.errors import (
    MlxcacheError,
    ModelConversionError,
    ModelNotFoundError,
    UnsupportedModelError,
)
from mlxcache.fileio import loads_json
from mlxcache.model.digest import file_digest
from mlxcache.model.gguf_tokenizer import build_tokenizer

Progress = Callable[[str, int, int], None]
"""progress(stage, done, total): called as conversion advances."""

_SUPPORTED_ARCHS = {"llama"}
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_PARTS = ("weight", "scales", "biases")
_GROUP_SIZE = 32  # every GGUF quant type MLX reads (Q4_0, Q4_1, Q8_0)
MANIFEST = "mlxcache-manifest.json"
"""Checksums of every other file of a converted folder, written last (see `check_folder`)."""


def _scalar(meta: dict[str, Any], key: str, default: Any = None) -> Any:
    value = meta.get(key, default)
    return value.item() if isinstance(value, mx.array) else value


def read_gguf(path: Path) -> tuple[dict[str, mx.array], dict[str, Any]]:
    """Read a GGUF file's tensors and metadata, with domain errors for bad files."""
    if not path.is_file():
        raise ModelNotFoundError(f"model file not found: {path}")
    if not os.access(path, os.R_OK):
        raise ModelNotFoundError(f"model file is not readable: {path}")
    try:
        weights, meta = mx.load(str(path), return_metadata=True)
    except Exception as exc:  # MLX raises bare RuntimeError/ValueError for bad files
        raise UnsupportedModelError(f"cannot read GGUF {path}: {exc}") from exc
    if not isinstance(weights, dict) or not isinstance(meta, dict):
        raise UnsupportedModelError(f"{path} is not a GGUF file")
    return weights, meta


def _hf_name(name: str) -> str:
    stem, _, part = name.rpartition(".")
    if part not in _PARTS:
        raise UnsupportedModelError(f"unexpected GGUF tensor {name!r}")
    if stem in _TOP_NAMES:
        return f"{_TOP_NAMES[stem]}.{part}"
    blk, layer, kind = stem.split(".", 2) if stem.count(".") == 2 else ("", "", stem)
    if blk != "blk" or kind not in _LAYER_NAMES:
        raise UnsupportedModelError(f"unsupported GGUF tensor {name!r} for a llama model")
    return f"model.layers.{layer}.{_LAYER_NAMES[kind]}.{part}"


def _unpermute_rows(x: mx.array, n_head: int) -> mx.array:
    """Invert llama.cpp's `permute()` of Q/K rows (exact: quantization groups run along columns)."""
    rows = x.shape[0]
    half = rows // n_head // 2
    return x.reshape(n_head, half, 2, *x.shape[1:]).swapaxes(1, 2).reshape(x.shape)


def _config(meta: dict[str, Any], weights: dict[str, mx.array]) -> dict[str, Any]:
    arch = _scalar(meta, "general.architecture")
    if arch not in _SUPPORTED_ARCHS:
        raise UnsupportedModelError(f"unsupported GGUF architecture {arch!r} (supported: llama)")

    def need(key: str) -> Any:
        value = _scalar(meta, f"{arch}.{key}")
        if value is None:
            raise UnsupportedModelError(f"GGUF metadata lacks {arch}.{key}")
        return value

    hidden = int(need("embedding_length"))
    heads = int(need("attention.head_count"))
    config: dict[str, Any] = {
        "model_type": "llama",
        "hidden_size": hidden,
        "num_hidden_layers": int(need("block_count")),
        "intermediate_size": int(need("feed_forward_length")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(_scalar(meta, f"{arch}.attention.head_count_kv", heads)),
        "head_dim": int(_scalar(meta, f"{arch}.rope.dimension_count", hidden // heads)),
        "rms_norm_eps": float(need("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(_scalar(meta, f"{arch}.rope.freq_base", 10000.0)),
        "max_position_embeddings": int(need("context_length")),
        "vocab_size": len(meta["tokenizer.ggml.tokens"]),
        "tie_word_embeddings": "lm_head.weight" not in weights,
        "eos_token_id": int(_scalar(meta, "tokenizer.ggml.eos_token_id")),
        "bos_token_id": int(_scalar(meta, "tokenizer.ggml.bos_token_id")),
    }
    # mlx-lm infers each layer's bits from its tensors' shapes (SmolLM2: 8-bit embedding,
    # 4-bit layers); the top-level entry just marks the model quantized.
    bits = {
        weights[n[: -len("scales")] + "weight"].shape[-1] // weights[n].shape[-1]
        for n in weights
        if n.endswith(".scales")
    }
    if bits:
        config["quantization"] = {"group_size": _GROUP_SIZE, "bits": min(bits)}
    return config


def convert_weights(
    weights: dict[str, mx.array], meta: dict[str, Any], progress: Progress | None = None
) -> tuple[dict[str, mx.array], dict[str, Any]]:
    """Rename, un-permute and re-type GGUF tensors; returns (weights, config)."""
    out: dict[str, mx.array] = {}
    total = len(weights)
    for i, (name, value) in enumerate(sorted(weights.items())):
        if value.dtype not in (mx.float32, mx.float16, mx.bfloat16, mx.uint32):
            raise UnsupportedModelError(f"unsupported GGUF tensor type {value.dtype} for {name}")
        out[_hf_name(name)] = value
        if progress:
            progress("weights", i + 1, total)
    config = _config(meta, out)
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    for name, value in out.items():
        if ".self_attn.q_proj." in name:
            value = _unpermute_rows(value, heads)
        elif ".self_attn.k_proj." in name:
            value = _unpermute_rows(value, kv_heads)
        # Float32 everywhere but the packed ints: MLX's CPU quantized matmul is ~40x
        # slower with float16 scales, and float32 activations keep results exact.
        if value.dtype != mx.uint32:
            value = value.astype(mx.float32)
        out[name] = value
    return out, config


def check_folder(folder: Path) -> str | None:
    """What is wrong with a converted folder, or None when every file matches its manifest."""
    try:
        listed = loads_json((folder / MANIFEST).read_text(encoding="utf-8"))["files"]
        if not isinstance(listed, dict) or not listed:
            raise ValueError
    except FileNotFoundError:
        return "no checksum manifest: converted by an older mlxcache, or interrupted"
    except (OSError, ValueError, KeyError, TypeError):
        return f"{MANIFEST} is unreadable"
    for name, digest in listed.items():
        path = folder / str(name)
        if not path.is_file():
            return f"{name} is missing"
        if file_digest(path) != digest:
            return f"{name} does not match its checksum"
    return None


def convert_gguf(path: Path, out_dir: Path, progress: Progress | None = None) -> Path:
    """Convert `path` into an mlx-lm folder at `out_dir` (atomically: temp dir, then rename).

    The folder's manifest is written last, so a folder that passes `check_folder` is whole.

    Raises:
        ModelConversionError: the folder cannot be written (full or read-only disk); no
            part of it is left behind.
    """
    weights, meta = read_gguf(path)
    converted, config = convert_weights(weights, meta, progress)
    try:
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=out_dir.parent))
    except OSError as exc:
        raise ModelConversionError(
            f"cannot convert {path.name} into {out_dir.parent}: {exc}"
        ) from exc
    try:
        build_tokenizer(meta, tmp)
        mx.eval(converted)
        mx.save_safetensors(str(tmp / "model.safetensors"), converted, metadata={"format": "mlx"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
        (tmp / "mlxcache-source.json").write_text(json.dumps({"gguf": str(path)}))
        digests = {f.name: file_digest(f) for f in sorted(tmp.iterdir())}
        (tmp / MANIFEST).write_text(json.dumps({"files": digests}, indent=1))
        if progress:
            progress("write", 1, 1)
        try:
            tmp.rename(out_dir)
        except OSError:
            if check_folder(out_dir) is not None:  # not a concurrent converter's win
                raise
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(exc, MlxcacheError) or not isinstance(exc, Exception):
            raise
        # MLX reports a full disk as a plain RuntimeError ("[write] Unable to write ...").
        raise ModelConversionError(
            f"cannot convert {path.name} into {out_dir.parent}: {exc}"
        ) from exc
    return out_dir
