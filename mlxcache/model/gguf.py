"""Convert a llama-architecture GGUF file into an mlx-lm model folder.

`gguf_file.open_gguf` reads the file with llama.cpp's own `gguf` library, checking it
first; `gguf_tensors.to_mlx` turns each tensor into MLX arrays with exactly the values
llama.cpp's dequantizer gives (affine-quantized, group size 32, where the type maps onto
MLX's quantization; dense float32 otherwise). What is left to do here is renaming, undoing
llama.cpp's rotary row permutation of Q/K, and writing the config and tokenizer files
mlx-lm expects.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
from gguf import GGUFReader

from mlxcache.errors import MlxcacheError, ModelConversionError, UnsupportedModelError
from mlxcache.fileio import loads_json
from mlxcache.model.digest import file_digest
from mlxcache.model.folder import load_folder
from mlxcache.model.gguf_file import meta_value, open_gguf
from mlxcache.model.gguf_tensors import GROUP_SIZE, to_mlx
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
MANIFEST = "mlxcache-manifest.json"
"""Checksums of every other file of a converted folder, written last (see `check_folder`)."""


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
    if n_head <= 0 or rows % (2 * n_head):
        raise UnsupportedModelError(f"{rows} rows of Q or K do not split into {n_head} heads")
    half = rows // n_head // 2
    return x.reshape(n_head, half, 2, *x.shape[1:]).swapaxes(1, 2).reshape(x.shape)


def _architecture(meta: dict[str, Any]) -> str:
    arch = meta.get("general.architecture")
    if arch not in _SUPPORTED_ARCHS:
        supported = ", ".join(sorted(_SUPPORTED_ARCHS))
        raise UnsupportedModelError(
            f"unsupported GGUF architecture {arch!r} (supported: {supported})"
        )
    return str(arch)


def _config(meta: dict[str, Any], weights: dict[str, mx.array]) -> dict[str, Any]:
    arch = _architecture(meta)

    def num(key: str, kind: type[int | float] = int, default: float | None = None) -> Any:
        return meta_value(meta, f"{arch}.{key}", kind, default)

    hidden = num("embedding_length")
    heads = num("attention.head_count")
    config: dict[str, Any] = {
        "model_type": "llama",
        "hidden_size": hidden,
        "num_hidden_layers": num("block_count"),
        "intermediate_size": num("feed_forward_length"),
        "num_attention_heads": heads,
        "num_key_value_heads": num("attention.head_count_kv", default=heads),
        "head_dim": num("rope.dimension_count", default=hidden // max(heads, 1)),
        "rms_norm_eps": num("attention.layer_norm_rms_epsilon", float),
        "rope_theta": num("rope.freq_base", float, 10000.0),
        "max_position_embeddings": num("context_length"),
        "vocab_size": len(meta_value(meta, "tokenizer.ggml.tokens", list)),
        "tie_word_embeddings": "lm_head.weight" not in weights,
        "eos_token_id": meta_value(meta, "tokenizer.ggml.eos_token_id", int),
        "bos_token_id": meta_value(meta, "tokenizer.ggml.bos_token_id", int),
    }
    # mlx-lm infers each layer's bits from its tensors' shapes (SmolLM2: 8-bit embedding,
    # 4-bit layers); the top-level entry just marks the model quantized.
    bits = {
        weights[n[: -len("scales")] + "weight"].shape[-1] // weights[n].shape[-1]
        for n in weights
        if n.endswith(".scales")
    }
    if bits:
        config["quantization"] = {"group_size": GROUP_SIZE, "bits": min(bits)}
    return config


def convert_weights(
    reader: GGUFReader, meta: dict[str, Any], progress: Progress | None = None
) -> tuple[dict[str, mx.array], dict[str, Any]]:
    """Read, rename and un-permute the GGUF's tensors; returns (weights, config)."""
    _architecture(meta)  # before any tensor is read
    parts: dict[str, mx.array] = {}
    for i, tensor in enumerate(reader.tensors):
        stem = tensor.name.removesuffix(".weight")
        parts |= {f"{stem}.{part}": value for part, value in to_mlx(tensor).items()}
        if progress:
            progress("weights", i + 1, len(reader.tensors))
    # In the order of the GGUF names, as conversions since version 1 write them: the same
    # file bytes, so the same model key (and cache entries) for the same weights.
    out = {_hf_name(name): parts[name] for name in sorted(parts)}
    config = _config(meta, out)
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    for name, value in out.items():
        if ".self_attn.q_proj." in name:
            out[name] = _unpermute_rows(value, heads)
        elif ".self_attn.k_proj." in name:
            out[name] = _unpermute_rows(value, kv_heads)
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
        UnsupportedModelError: the file is damaged, or its architecture, a tensor's type or
            its shapes are not what mlx-lm can run.
        ModelConversionError: the folder cannot be written (full or read-only disk).
        Either way, no part of the folder is left behind.
    """
    reader, meta = open_gguf(path)
    converted, config = convert_weights(reader, meta, progress)
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
        # mlx-lm must accept the folder (shapes that fit the config) before it is kept.
        load_folder(tmp, lazy=True, what=f"{path.name} as an mlx-lm model")
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
