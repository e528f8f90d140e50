"""GGUF architectures mlxcache converts: each one's mlx-lm model, config and tensor conventions.

Tensor names come from the `gguf` library's own map (`TensorNameMap`, the table llama.cpp's
converter names tensors with), applied to the parameter names of mlx-lm's model class for
the architecture: each GGUF tensor goes where that model expects it, with no table of our
own to drift. What a name map cannot say is written here: the config keys, and what
llama.cpp's converter did to some tensors (the rotary row permutation of llama's Q/K, the
+1 of Gemma's norm weights), which conversion undoes.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

from gguf import MODEL_ARCH_NAMES, get_tensor_name_map
from mlx.utils import tree_flatten

from mlxcache.errors import UnsupportedModelError
from mlxcache.model.gguf_file import meta_value

Meta = dict[str, Any]


@dataclass(frozen=True)
class Arch:
    """How one GGUF architecture becomes an mlx-lm model."""

    model_type: str
    """mlx-lm's model module (`mlx_lm.models.<model_type>`)."""
    permute_qk: bool = False
    """llama.cpp permuted Q/K rows for its rotary layout (llama); conversion undoes it."""
    norm_shift: float = 0.0
    """llama.cpp added this to every norm weight (Gemma scales by 1 + w); conversion subtracts it."""
    extra: Callable[[Meta, str, dict[str, Any]], dict[str, Any]] = field(
        default=lambda meta, arch, config: {}
    )
    """Config entries beyond the common ones: (metadata, GGUF arch, common config) -> entries."""
    refuse: tuple[str, ...] = ()
    """GGUF tensors whose presence means a variant mlxcache does not convert."""
    chat_template: str | None = None
    """The family's turn format, for files that carry no template (base models)."""


# Gemma 3's turn format (a system message opens the first user turn; the assistant is
# `model`), and ChatML (Qwen2, Qwen3), as their own templates render plain text messages.
_GEMMA_TURNS = (
    "{{ bos_token }}"
    "{%- if messages and messages[0]['role'] == 'system' -%}"
    "{%- set first = messages[0]['content'] + '\n\n' -%}{%- set turns = messages[1:] -%}"
    "{%- else -%}{%- set first = '' -%}{%- set turns = messages -%}{%- endif -%}"
    "{%- for m in turns -%}"
    "{{ '<start_of_turn>' + ('model' if m['role'] == 'assistant' else m['role']) + '\n'"
    " + (first if loop.first else '') + m['content'] | trim + '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)
_CHATML = (
    "{%- for m in messages -%}"
    "{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\n' }}{%- endif -%}"
)


def _qwen3(meta: Meta, arch: str, config: dict[str, Any]) -> dict[str, Any]:
    return {"head_dim": config["head_dim"]}


def _gemma3(meta: Meta, arch: str, config: dict[str, Any]) -> dict[str, Any]:
    # What llama.cpp's gemma3 loader fixes in code rather than metadata: five sliding layers
    # per global one, a local rope base of 10000, and attention scaled by 1/sqrt(head_dim),
    # except on the 27B model (62 layers), scaled by 1/sqrt(hidden / heads).
    layers, hidden, heads = (
        config["num_hidden_layers"],
        config["hidden_size"],
        config["num_attention_heads"],
    )
    out: dict[str, Any] = {
        "sliding_window": meta_value(meta, f"{arch}.attention.sliding_window", int),
        "sliding_window_pattern": 6,
        "rope_local_base_freq": 10000.0,
        "query_pre_attn_scalar": hidden // heads if layers == 62 else config["head_dim"],
    }
    scaling = meta.get(f"{arch}.rope.scaling.type")
    if scaling == "linear":
        factor = meta_value(meta, f"{arch}.rope.scaling.factor", float)
        out["rope_scaling"] = {"rope_type": "linear", "factor": factor}
    elif scaling not in (None, "none"):
        raise UnsupportedModelError(f"unsupported GGUF: {arch} with rope scaling {scaling!r}")
    return out


def _phi3(meta: Meta, arch: str, config: dict[str, Any]) -> dict[str, Any]:
    rotary = meta_value(meta, f"{arch}.rope.dimension_count", int, config["head_dim"])
    return {"partial_rotary_factor": rotary / config["head_dim"]}


ARCHS: dict[str, Arch] = {
    "llama": Arch("llama", permute_qk=True),  # also Mistral 7B, written as llama
    "qwen2": Arch("qwen2", chat_template=_CHATML),
    "qwen3": Arch("qwen3", extra=_qwen3, chat_template=_CHATML),
    "gemma3": Arch("gemma3_text", norm_shift=1.0, extra=_gemma3, chat_template=_GEMMA_TURNS),
    "phi3": Arch("phi3", extra=_phi3, refuse=("rope_factors_long.weight",)),
}


def architecture(meta: Meta) -> tuple[str, Arch]:
    """The file's GGUF architecture name and how to convert it.

    Raises:
        UnsupportedModelError: an architecture mlxcache does not convert.
    """
    name = meta.get("general.architecture")
    if name not in ARCHS:
        supported = ", ".join(sorted(ARCHS))
        raise UnsupportedModelError(
            f"unsupported GGUF: architecture {name!r} (supported: {supported})"
        )
    return str(name), ARCHS[name]


def base_config(meta: Meta, arch: str, spec: Arch) -> dict[str, Any]:
    """The mlx-lm config.json entries the metadata gives (tensors add the rest)."""

    def num(key: str, kind: type[int | float] = int, default: float | None = None) -> Any:
        return meta_value(meta, f"{arch}.{key}", kind, default)

    hidden = num("embedding_length")
    heads = num("attention.head_count")
    if heads <= 0:
        raise UnsupportedModelError(f"GGUF metadata {arch}.attention.head_count is {heads}")
    # The head size: stated as the key length, else as llama's rotary dimension count.
    head_dim = num(
        "attention.key_length", default=num("rope.dimension_count", default=hidden // heads)
    )
    config: dict[str, Any] = {
        "model_type": spec.model_type,
        "hidden_size": hidden,
        "num_hidden_layers": num("block_count"),
        "intermediate_size": num("feed_forward_length"),
        "num_attention_heads": heads,
        "num_key_value_heads": num("attention.head_count_kv", default=heads),
        "head_dim": head_dim,
        "rms_norm_eps": num("attention.layer_norm_rms_epsilon", float),
        "rope_theta": num("rope.freq_base", float, 10000.0),
        "max_position_embeddings": num("context_length"),
        "vocab_size": len(meta_value(meta, "tokenizer.ggml.tokens", list)),
        "eos_token_id": _eos_ids(meta, arch),
        "bos_token_id": meta_value(meta, "tokenizer.ggml.bos_token_id", int),
    }
    return config | spec.extra(meta, arch, config)


def _eos_ids(meta: Meta, arch: str) -> int | list[int]:
    """The end-of-sequence id, and the end-of-turn ids a chat reply ends with."""
    ids = [meta_value(meta, "tokenizer.ggml.eos_token_id", int)]
    for key in ("eot", "eom"):
        if f"tokenizer.ggml.{key}_token_id" in meta:
            ids.append(meta_value(meta, f"tokenizer.ggml.{key}_token_id", int))
    if arch == "gemma3":  # instruct models end a turn with <end_of_turn>, which files omit
        tokens = meta_value(meta, "tokenizer.ggml.tokens", list)
        ids += [i for i, t in enumerate(tokens) if t == "<end_of_turn>"]
    ids = list(dict.fromkeys(ids))
    return ids[0] if len(ids) == 1 else ids


def hf_names(arch: str, config: dict[str, Any], gguf_names: list[str]) -> dict[str, str]:
    """GGUF tensor name -> name in mlx-lm's model, for every tensor of the file.

    Raises:
        UnsupportedModelError: a tensor that has no place in the model (another variant of
            the architecture), or one that marks a variant mlxcache does not convert.
    """
    spec = ARCHS[arch]
    for name in gguf_names:
        if name in spec.refuse:
            raise UnsupportedModelError(
                f"unsupported GGUF: {spec.model_type} with tensor {name} (not converted)"
            )
    module = importlib.import_module(f"mlx_lm.models.{spec.model_type}")
    # The untrained model's parameters are never evaluated: only their names are read.
    model = module.Model(module.ModelArgs.from_dict(config))
    known = next(k for k, v in MODEL_ARCH_NAMES.items() if v == arch)
    name_map = get_tensor_name_map(known, config["num_hidden_layers"])
    ours: dict[str, str] = {}
    params = cast(list[tuple[str, Any]], tree_flatten(model.parameters()))
    for param, _ in params:
        stem, _, suffix = param.rpartition(".")
        gguf_stem = name_map.get_name(stem)
        if gguf_stem is not None:
            ours[f"{gguf_stem}.{suffix}"] = param
    missing = [name for name in gguf_names if name not in ours]
    if missing:
        raise UnsupportedModelError(
            f"unsupported GGUF: tensor {missing[0]} has no place in mlx-lm's "
            f"{spec.model_type} model"
        )
    return {name: ours[name] for name in gguf_names}
