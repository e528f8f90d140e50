"""A tiny random-weight llama model written as a GGUF file, built in the test (no download)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

CHATML = (
    "{% for m in messages %}{{'<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def byte_chars() -> list[str]:
    """GPT-2's printable stand-ins for the 256 byte values."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    extra = iter(range(256, 512))
    return [chr(b) if b in keep else chr(next(extra)) for b in range(256)]


def llama_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's rotary row permutation of Q/K (what its converter writes)."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def tiny_weights(
    seed: int = 0,
    hidden: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    ffn: int = 128,
    vocab: int = 262,
) -> dict[str, np.ndarray]:
    """HF-named random weights for a tiny llama."""
    rng = np.random.default_rng(seed)
    head_dim = hidden // heads

    def w(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.08).astype(np.float32)

    out = {"model.embed_tokens.weight": w(vocab, hidden), "model.norm.weight": 1 + w(hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        out |= {
            p + "self_attn.q_proj.weight": w(heads * head_dim, hidden),
            p + "self_attn.k_proj.weight": w(kv_heads * head_dim, hidden),
            p + "self_attn.v_proj.weight": w(kv_heads * head_dim, hidden),
            p + "self_attn.o_proj.weight": w(hidden, heads * head_dim),
            p + "mlp.gate_proj.weight": w(ffn, hidden),
            p + "mlp.up_proj.weight": w(ffn, hidden),
            p + "mlp.down_proj.weight": w(hidden, ffn),
            p + "input_layernorm.weight": 1 + w(hidden),
            p + "post_attention_layernorm.weight": 1 + w(hidden),
        }
    return out


_GGUF_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}


def write_tiny_gguf(
    path: Path,
    *,
    dtype: Any = mx.float32,
    arch: str = "llama",
    context: int = 256,
    seed: int = 0,
    heads: int = 4,
    kv_heads: int = 2,
    template: str = CHATML,
    hidden: int = 64,
) -> dict[str, np.ndarray]:
    """Write a tiny llama GGUF (Q/K permuted as llama.cpp does); returns the HF-layout weights."""
    hf = tiny_weights(seed, hidden=hidden, heads=heads, kv_heads=kv_heads)
    tensors: dict[str, mx.array] = {}
    for name, value in hf.items():
        gname, n_head = _gguf_name(name, heads, kv_heads)
        if n_head:
            value = llama_permute(value, n_head)
        is_norm = "norm" in gname
        tensors[gname] = mx.array(value).astype(mx.float32 if is_norm else dtype)
    tokens = SPECIALS + byte_chars() + ["ab", "abab", "Ġa"]
    types = [3] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS))
    hidden = hf["model.norm.weight"].shape[0]
    meta: dict[str, Any] = {
        "general.architecture": arch,
        f"{arch}.embedding_length": mx.array(hidden, dtype=mx.uint32),
        f"{arch}.block_count": mx.array(2, dtype=mx.uint32),
        f"{arch}.feed_forward_length": mx.array(128, dtype=mx.uint32),
        f"{arch}.attention.head_count": mx.array(heads, dtype=mx.uint32),
        f"{arch}.attention.head_count_kv": mx.array(kv_heads, dtype=mx.uint32),
        f"{arch}.attention.layer_norm_rms_epsilon": mx.array(1e-5, dtype=mx.float32),
        f"{arch}.rope.freq_base": mx.array(10000.0, dtype=mx.float32),
        f"{arch}.context_length": mx.array(context, dtype=mx.uint32),
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "default",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": mx.array(types, dtype=mx.int32),
        "tokenizer.ggml.merges": ["a b", "ab ab", "Ġ a"],
        "tokenizer.ggml.bos_token_id": mx.array(1, dtype=mx.uint32),
        "tokenizer.ggml.eos_token_id": mx.array(2, dtype=mx.uint32),
        "tokenizer.chat_template": template,
    }
    mx.save_gguf(str(path), tensors, meta)
    return hf


def write_sliding(model_dir: Path, dest: Path, window: int = 8) -> Path:
    """A copy of an mlx-lm model folder whose first layer is sliding-window attention (a
    ring buffer: blocks are captured right after the chunk or step that computed them)."""
    shutil.copytree(model_dir, dest)
    config = json.loads((dest / "config.json").read_text())
    config |= {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": window}
    (dest / "config.json").write_text(json.dumps(config))
    return dest


def write_quantized_gguf(path: Path, qtype_name: str, seed: int = 0) -> dict[str, np.ndarray]:
    """The tiny llama as llama.cpp would quantize it (Q4_0, Q4_1, Q8_0; norms stay F32).

    Written with the `gguf` package (llama.cpp's own writer). Returns the HF-layout weights
    as the file holds them, i.e. dequantized, so a reference model can be built from them.
    """
    import gguf
    from gguf import quants

    qtype = gguf.GGMLQuantizationType[qtype_name]
    staging = path.with_suffix(".f32.gguf")
    hf = write_tiny_gguf(staging, seed=seed)  # F32 file: names, permutation and metadata
    tensors, meta = mx.load(str(staging), return_metadata=True)
    staging.unlink()
    writer = gguf.GGUFWriter(str(path), arch="llama")
    for key, value in meta.items():
        if key == "general.architecture":
            continue
        if isinstance(value, str):
            writer.add_string(key, value)
        elif isinstance(value, list):
            writer.add_array(key, value)
        elif value.ndim:  # token types
            writer.add_array(key, [int(v) for v in value.tolist()])
        elif value.dtype == mx.float32:
            writer.add_float32(key, float(value.item()))
        else:
            writer.add_uint32(key, int(value.item()))
    exact: dict[str, np.ndarray] = {}
    for name, value in tensors.items():
        data = np.array(value)
        if "norm" not in name:
            packed = quants.quantize(data, qtype)
            writer.add_tensor(name, packed, raw_dtype=qtype)
            data = quants.dequantize(packed, qtype)
        else:
            writer.add_tensor(name, data)
        exact[name] = data
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    # Back to HF names and row order (undo the Q/K permutation) for the reference model.
    out = {}
    for hf_name in hf:
        gname, n_head = _gguf_name(hf_name)
        value = exact[gname]
        if n_head:
            value = (
                value.reshape(n_head, value.shape[0] // n_head // 2, 2, -1)
                .swapaxes(1, 2)
                .reshape(value.shape)
            )
        out[hf_name] = value.astype(np.float32)
    return out


def _gguf_name(hf_name: str, heads: int = 4, kv_heads: int = 2) -> tuple[str, int]:
    """GGUF tensor name of an HF weight, and the head count its rows were permuted with."""
    if hf_name == "model.embed_tokens.weight":
        return "token_embd.weight", 0
    if hf_name == "model.norm.weight":
        return "output_norm.weight", 0
    _, _, layer, rest = hf_name.split(".", 3)
    module = rest.rsplit(".", 1)[0]
    n_head = {"self_attn.q_proj": heads, "self_attn.k_proj": kv_heads}.get(module, 0)
    return f"blk.{layer}.{_GGUF_NAMES[module]}.weight", n_head
