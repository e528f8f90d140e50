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
from mlxcache.model.gguf_arch import architecture, base_config, hf_names
from mlxcache.model.gguf_file import open_gguf
from mlxcache.model.gguf_tensors import GROUP_SIZE, to_mlx
from mlxcache.model.gguf_tokenizer import build_tokenizer

Progress = Callable[[str, int, int], None]
"""progress(stage, done, total): called as conversion advances."""

MANIFEST = "mlxcache-manifest.json"
"""Checksums of every other file of a converted folder, written last (see `check_folder`)."""


def _unpermute_rows(x: mx.array, n_head: int) -> mx.array:
    """Invert llama.cpp's `permute()` of Q/K rows (exact: quantization groups run along columns)."""
    rows = x.shape[0]
    if n_head <= 0 or rows % (2 * n_head):
        raise UnsupportedModelError(f"{rows} rows of Q or K do not split into {n_head} heads")
    half = rows // n_head // 2
    return x.reshape(n_head, half, 2, *x.shape[1:]).swapaxes(1, 2).reshape(x.shape)


def _quantization(weights: dict[str, mx.array]) -> dict[str, int] | None:
    """The config's quantization entry: mlx-lm infers each layer's bits from its tensors'
    shapes (SmolLM2: 8-bit embedding, 4-bit layers); this entry marks the model quantized."""
    bits = {
        weights[n[: -len("scales")] + "weight"].shape[-1] // weights[n].shape[-1]
        for n in weights
        if n.endswith(".scales")
    }
    return {"group_size": GROUP_SIZE, "bits": min(bits)} if bits else None


def convert_weights(
    reader: GGUFReader, meta: dict[str, Any], progress: Progress | None = None
) -> tuple[dict[str, mx.array], dict[str, Any]]:
    """Read the GGUF's tensors as mlx-lm's model names and holds them; returns (weights, config).

    Raises:
        UnsupportedModelError: an architecture, metadata or tensor mlxcache cannot convert
            (checked before any tensor is read, but for a tensor's type).
    """
    arch, spec = architecture(meta)
    config = base_config(meta, arch, spec)
    names = [t.name for t in reader.tensors]
    config["tie_word_embeddings"] = "output.weight" not in names
    hf = hf_names(arch, config, names)
    parts: dict[str, mx.array] = {}
    for i, tensor in enumerate(reader.tensors):
        stem = tensor.name.rpartition(".")[0]
        value = to_mlx(tensor)
        if isinstance(value, dict):  # affine triple of a quantized matrix
            parts |= {f"{stem}.{part}": v for part, v in value.items()}
        else:
            parts[tensor.name] = value
        if progress:
            progress("weights", i + 1, len(reader.tensors))
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    out: dict[str, mx.array] = {}
    # In the order of the GGUF names, as conversions since version 1 write them: the same
    # file bytes, so the same model key (and cache entries) for the same weights.
    for name in sorted(parts):
        stem, _, part = name.rpartition(".")
        value = parts[name]
        kind = stem.rpartition(".")[2]
        if spec.permute_qk and kind in ("attn_q", "attn_k"):
            value = _unpermute_rows(value, heads if kind == "attn_q" else kv_heads)
        if spec.norm_shift and kind.endswith("norm"):
            value = value - spec.norm_shift
        source = name if name in hf else f"{stem}.weight"
        target = hf[source].rpartition(".")[0]
        out[f"{target}.{part}"] = value
    config["quantization"] = _quantization(out)
    if config["quantization"] is None:
        del config["quantization"]
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
        arch, spec = architecture(meta)
        build_tokenizer(meta, tmp, arch, spec.chat_template)
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
