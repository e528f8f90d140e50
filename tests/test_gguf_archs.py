"""Every GGUF architecture mlxcache converts, checked against mlx-lm's own model class.

Each test builds a tiny random model with mlx-lm's class for the architecture, writes it
as llama.cpp's converter would (its tensor names, Q/K rows permuted for llama, Gemma's norm
weights stored as 1 + w), converts that file, and compares: the same logits bit for bit,
and the same greedy tokens through the model's own caches (Gemma 3's sliding windows
included, with a prompt longer than its window).
"""

from __future__ import annotations

import importlib
from functools import partial
from pathlib import Path
from typing import Any

import gguf
import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.generate import generate_step
from test_gguf_quants import gpt2_vocab
from tinymodel import llama_permute
from typer.testing import CliRunner

from mlxcache.engine import Engine
from mlxcache.errors import UnsupportedModelError
from mlxcache.model import load
from mlxcache_cli.main import app

EPS = 2.0**-20  # exact in float32: the metadata's epsilon is the reference's
HIDDEN, FFN, HEADS, VOCAB = 64, 128, 4, 262

# HF name part -> llama.cpp's GGUF tensor name, written out by hand (not from the gguf
# library's map, which the converter uses), so a wrong mapping fails here.
LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.qkv_proj": "attn_qkv",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.gate_up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
POST_ATTENTION = {  # what llama.cpp calls the norm after attention depends on the family
    "gemma3": {
        "post_attention_layernorm": "post_attention_norm",
        "pre_feedforward_layernorm": "ffn_norm",
        "post_feedforward_layernorm": "post_ffw_norm",
    },
}
TOP_NAMES = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}

ARCHS: dict[str, dict[str, Any]] = {
    "llama": {"model_type": "llama", "num_key_value_heads": 2, "tie_word_embeddings": False},
    "qwen2": {"model_type": "qwen2", "num_key_value_heads": 2, "tie_word_embeddings": True},
    "qwen3": {
        "model_type": "qwen3",
        "num_key_value_heads": 2,
        "head_dim": 32,
        "tie_word_embeddings": True,
    },
    "gemma3": {
        "model_type": "gemma3_text",
        "num_hidden_layers": 7,  # six sliding layers, then a global one
        "num_key_value_heads": 1,
        "head_dim": 32,
        "query_pre_attn_scalar": 32,
        "sliding_window": 8,
        "sliding_window_pattern": 6,
        "rope_local_base_freq": 10000.0,
    },
    "phi3": {"model_type": "phi3", "num_key_value_heads": HEADS, "tie_word_embeddings": False},
}


def reference(arch: str, vocab: int = VOCAB) -> tuple[Any, dict[str, Any]]:
    """mlx-lm's model for `arch` with random weights (norms near 1, or near 0 for Gemma)."""
    config = {
        "hidden_size": HIDDEN,
        "num_hidden_layers": 2,
        "intermediate_size": FFN,
        "num_attention_heads": HEADS,
        "rms_norm_eps": EPS,
        "vocab_size": vocab,
        "max_position_embeddings": 256,
        "rope_theta": 10000.0,
    } | ARCHS[arch]
    module = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    model = module.Model(module.ModelArgs.from_dict(config))
    rng = np.random.default_rng(sum(map(ord, arch)))
    weights = []
    for name, value in tree_flatten(model.parameters()):
        w = rng.standard_normal(value.shape).astype(np.float32) * 0.08
        if name.endswith("norm.weight"):
            # Gemma's +1 stays exact in float32: multiples of 2**-8 below 1/4.
            w = np.round(w * 256) / 256 if arch == "gemma3" else 1 + w
        weights.append((name, mx.array(w)))
    model.load_weights(weights)
    return model, config


def gguf_name(arch: str, hf: str) -> str:
    stem, _, suffix = hf.rpartition(".")
    if stem in TOP_NAMES:
        return f"{TOP_NAMES[stem]}.{suffix}"
    _, _, layer, part = stem.split(".", 3)
    names = LAYER_NAMES | POST_ATTENTION.get(arch, {"post_attention_layernorm": "ffn_norm"})
    return f"blk.{layer}.{names[part]}.{suffix}"


SPM_SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>"]
SPM_PIECES = ["\u2581", "a", "b", "ab", "\u2581a", "\u2581ab"]
SPM_TOKENS = SPM_SPECIALS + [f"<0x{b:02X}>" for b in range(256)] + SPM_PIECES


def gemma_vocab(writer: gguf.GGUFWriter) -> None:
    """A tiny SentencePiece vocabulary as Gemma files hold one: no merges, no template."""
    types = [3] * len(SPM_SPECIALS) + [6] * 256 + [1] * len(SPM_PIECES)
    writer.add_string("tokenizer.ggml.model", "llama")
    writer.add_string("tokenizer.ggml.pre", "default")
    writer.add_array("tokenizer.ggml.tokens", SPM_TOKENS)
    scores = [-1000.0] * (len(SPM_SPECIALS) + 256) + [-float(i) for i in range(len(SPM_PIECES))]
    writer.add_array("tokenizer.ggml.scores", scores)
    writer.add_array("tokenizer.ggml.token_type", types)
    writer.add_uint32("tokenizer.ggml.bos_token_id", 2)
    writer.add_uint32("tokenizer.ggml.eos_token_id", 1)
    writer.add_uint32("tokenizer.ggml.unknown_token_id", 3)
    writer.add_uint32("tokenizer.ggml.padding_token_id", 0)
    writer.add_bool("tokenizer.ggml.add_bos_token", True)
    writer.add_bool("tokenizer.ggml.add_space_prefix", False)


def write_gguf(
    path: Path, arch: str, model: Any, config: dict[str, Any], vocab: Any = gpt2_vocab
) -> None:
    """`model` as llama.cpp's converter writes it (F32 tensors), with `vocab`'s tokenizer."""
    writer = gguf.GGUFWriter(str(path), arch=arch)
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim", HIDDEN // heads)
    for key, value in {
        "context_length": config["max_position_embeddings"],
        "embedding_length": HIDDEN,
        "block_count": config["num_hidden_layers"],
        "feed_forward_length": FFN,
        "attention.head_count": heads,
        "attention.head_count_kv": kv_heads,
        "rope.dimension_count": head_dim,
    }.items():
        writer.add_uint32(f"{arch}.{key}", value)
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", EPS)
    writer.add_float32(f"{arch}.rope.freq_base", config["rope_theta"])
    if "head_dim" in config:
        writer.add_uint32(f"{arch}.attention.key_length", head_dim)
        writer.add_uint32(f"{arch}.attention.value_length", head_dim)
    if arch == "gemma3":
        writer.add_uint32(f"{arch}.attention.sliding_window", config["sliding_window"])
    vocab(writer)
    for name, value in tree_flatten(model.parameters()):
        data = np.array(value)
        if arch == "llama" and ".q_proj." in name:
            data = llama_permute(data, heads)
        elif arch == "llama" and ".k_proj." in name:
            data = llama_permute(data, kv_heads)
        elif arch == "gemma3" and name.endswith("norm.weight"):
            data = data + np.float32(1)
        writer.add_tensor(gguf_name(arch, name), data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def greedy(model: Any, prompt: list[int], n: int) -> list[int]:
    steps = generate_step(mx.array(prompt), model, max_tokens=n)
    return [int(token) for token, _ in steps]


@pytest.mark.parametrize("arch", list(ARCHS))
def test_converted_architecture_is_mlx_lms_model(tmp_path: Path, arch: str) -> None:
    model, config = reference(arch)
    write_gguf(tmp_path / f"{arch}.gguf", arch, model, config)
    loaded = load(str(tmp_path / f"{arch}.gguf"), cache_root=tmp_path / "cache")
    assert loaded.config["model_type"] == config["model_type"]
    prompt = [5, 80, 81, 100, 7, 3, 42, 43, 44, 200, 201, 9, 17, 18, 19, 120, 121]
    assert len(prompt) > config.get("sliding_window", 0)
    assert mx.array_equal(loaded.model(mx.array([prompt])), model(mx.array([prompt])))
    assert greedy(loaded.model, prompt, 12) == greedy(model, prompt, 12)


def test_gemma_sentencepiece_vocabulary_bos_and_turn_format(tmp_path: Path) -> None:
    """A Gemma file as the base models come: SentencePiece without merges, BOS added, no
    chat template (the family's turn format stands in), `<end_of_turn>` ends a reply."""
    model, config = reference("gemma3", vocab=len(SPM_TOKENS))
    write_gguf(tmp_path / "g.gguf", "gemma3", model, config, gemma_vocab)
    loaded = load(str(tmp_path / "g.gguf"), cache_root=tmp_path / "cache")
    engine = Engine(loaded)
    ab, space_ab = SPM_TOKENS.index("ab"), SPM_TOKENS.index("\u2581ab")
    assert engine.encoder.encode("ab ab") == [2, ab, space_ab]
    assert loaded.tokenizer.decode([ab, space_ab, SPM_TOKENS.index("<0x21>")]) == "ab ab!"
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    assert loaded.tokenizer.decode(engine.encoder.encode_chat(messages)) == (
        "<bos><start_of_turn>user\nS\n\nU<end_of_turn>\n<start_of_turn>model\n"
    )
    assert loaded.config["eos_token_id"] == [1, SPM_TOKENS.index("<end_of_turn>")]
    prompt = engine.encoder.encode("ab ab ab ab ab ab")
    assert mx.array_equal(loaded.model(mx.array([prompt])), model(mx.array([prompt])))


def test_a_model_without_chat_template_is_one_error_line(tmp_path: Path) -> None:
    """A llama file without a template (no family format to fall back on): chat prompts are
    refused in one line; raw prompts work."""
    model, config = reference("llama")
    untemplated = partial(gpt2_vocab, template="")
    write_gguf(tmp_path / "base.gguf", "llama", model, config, untemplated)
    args = ["generate", "-m", str(tmp_path / "base.gguf"), "--cache-dir", str(tmp_path), "-n", "2"]
    result = CliRunner().invoke(app, [*args, "hi"])
    assert (result.exit_code, result.stdout) == (2, "")
    assert result.stderr == (
        "error: model base.gguf has no chat template: send the prompt as raw text "
        "(generate --raw, or the server's /v1/completions)\n"
    )
    assert CliRunner().invoke(app, [*args, "--raw", "hi"]).exit_code == 0


@pytest.mark.parametrize(
    ("pre", "error"), [("qwen2", None), ("llama-bpe", None), ("tiktoken-x", True)]
)
def test_byte_level_vocabularies_with_other_splits(tmp_path: Path, pre: str, error: Any) -> None:
    """Qwen2's and Llama 3's splits come from transformers' builders; an unknown split is
    refused (it would cut text where the model never saw it cut)."""
    model, config = reference("qwen2")
    write_gguf(tmp_path / "q.gguf", "qwen2", model, config, partial(gpt2_vocab, pre=pre))
    if error:
        with pytest.raises(UnsupportedModelError) as err:
            load(str(tmp_path / "q.gguf"), cache_root=tmp_path / "cache")
        assert str(err.value) == f"unsupported GGUF pre-tokenizer {pre!r}"
        return
    loaded = load(str(tmp_path / "q.gguf"), cache_root=tmp_path / "cache")
    ours = tmp_path / "default.gguf"  # the same vocabulary through mlxcache's own builder
    write_gguf(ours, "qwen2", model, config, gpt2_vocab)
    text = "ab abab 12! Ġa"
    ids = Engine(loaded).encoder.encode(text)
    assert ids == Engine(load(str(ours), cache_root=tmp_path / "cache")).encoder.encode(text)
    assert ids[:3] == [259, 35, 260] and loaded.tokenizer.decode(ids) == text
