"""Tiny random-weight instances of mlx-lm model families, for the tests and `bench reuse`.

One per kind of layer cache the store lays out: full attention (qwen3, a MoE, MLA), sliding
windows (gemma3_text, gpt_oss), recurrent hybrids (qwen3_next: gated delta; lfm2: short
convolutions; nemotron_h: Mamba 2). Built from mlx-lm's own model classes, nothing is
downloaded: the weights are random, so they test mechanics, not answers.
"""

from __future__ import annotations

import importlib
import json
import shutil
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten

COMMON: dict[str, Any] = {"vocab_size": 262, "max_position_embeddings": 256}
"""The tests' tiny tokenizer's vocabulary; `build` takes another one."""
FAMILIES: dict[str, dict[str, Any]] = {
    "qwen3": {
        "model_type": "qwen3",
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "rms_norm_eps": 1e-6,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "tie_word_embeddings": True,
        "rope_theta": 10000.0,
    },
    "gemma3_text": {
        "model_type": "gemma3_text",
        "hidden_size": 64,
        "num_hidden_layers": 3,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "head_dim": 16,
        "num_key_value_heads": 1,
        "query_pre_attn_scalar": 16,
        "sliding_window": 8,
        "sliding_window_pattern": 3,
    },
    "gpt_oss": {
        "model_type": "gpt_oss",
        "num_hidden_layers": 2,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "hidden_size": 64,
        "intermediate_size": 64,
        "head_dim": 16,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "sliding_window": 8,
        "layer_types": ["sliding_attention", "full_attention"],
    },
    "qwen3_next": {
        "model_type": "qwen3_next",
        "hidden_size": 64,
        "num_hidden_layers": 4,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "linear_num_value_heads": 4,
        "linear_num_key_heads": 2,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
        "linear_conv_kernel_dim": 4,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "decoder_sparse_step": 1,
        "shared_expert_intermediate_size": 64,
        "mlp_only_layers": [],
        "moe_intermediate_size": 32,
        "rms_norm_eps": 1e-6,
        "num_key_value_heads": 2,
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.5,
        "head_dim": 16,
        "full_attention_interval": 2,
    },
    "nemotron_h": {
        "model_type": "nemotron_h",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "attention_bias": False,
        "mamba_num_heads": 4,
        "mamba_head_dim": 16,
        "mamba_proj_bias": False,
        "ssm_state_size": 16,
        "conv_kernel": 4,
        "n_groups": 1,
        "mlp_bias": False,
        "layer_norm_epsilon": 1e-5,
        "use_bias": False,
        "use_conv_bias": True,
        "hybrid_override_pattern": ["*", "M", "-", "*"],
        "head_dim": 16,
        "time_step_limit": [0.0, 1e9],
    },
    "deepseek_v3": {
        "model_type": "deepseek_v3",
        "hidden_size": 64,
        "intermediate_size": 128,
        "moe_intermediate_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "n_shared_experts": 1,
        "n_routed_experts": 4,
        "kv_lora_rank": 32,
        "q_lora_rank": 32,
        "qk_rope_head_dim": 8,
        "v_head_dim": 16,
        "qk_nope_head_dim": 16,
        "num_experts_per_tok": 2,
        "first_k_dense_replace": 1,
        "n_group": 1,
        "topk_group": 1,
    },
    "qwen3_moe": {
        "model_type": "qwen3_moe",
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "moe_intermediate_size": 32,
        "rms_norm_eps": 1e-6,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
        "norm_topk_prob": True,
    },
}
for v in FAMILIES.values():
    v.update(COMMON)

# Convolutions (their state, an ArraysCache, is recurrent) between two attention layers:
# the last one spreads what a wrong state changes to every later position, past the
# convolutions' own window.
FAMILIES["lfm2"] = {
    "model_type": "lfm2",
    "hidden_size": 64,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "norm_eps": 1e-5,
    "conv_bias": False,
    "conv_L_cache": 3,
    "block_dim": 64,
    "block_multiple_of": 16,
    "block_ffn_dim_multiplier": 1.0,
    "block_auto_adjust_ff_dim": False,
    "block_ff_dim": 128,
    "full_attn_idxs": [0, 3],
    "tie_word_embeddings": True,
    **COMMON,
}


def build(
    dest: Path, tokenizer_dir: Path, config: dict[str, Any], seed: int = 0, **overrides: Any
) -> Path:
    """An mlx-lm model folder of random weights for `config` (any of mlx-lm's model types)
    with `overrides` (e.g. another `vocab_size`), and the tokenizer files of
    `tokenizer_dir` (a converted model's folder)."""
    config = {**config, **overrides}
    module = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    mx.random.seed(seed)
    model = module.Model(module.ModelArgs.from_dict(config))
    dest.mkdir(parents=True)
    mx.save_safetensors(str(dest / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (dest / "config.json").write_text(json.dumps(config))
    for f in tokenizer_dir.iterdir():
        if f.name.startswith("tokenizer") or f.suffix == ".jinja":
            shutil.copy(f, dest / f.name)
    return dest
