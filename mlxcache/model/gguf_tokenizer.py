"""Build a Hugging Face fast tokenizer from a GGUF file's `tokenizer.ggml.*` metadata."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mlxcache.errors import UnsupportedModelError
from mlxcache.model.gguf_file import meta_value

# GGUF token types (llama.cpp `llama_token_type`).
_CONTROL = 3
_USER_DEFINED = 4

# Pre-tokenizer regexes by `tokenizer.ggml.pre`. SmolLM2 ("smollm") splits digits one by one
# before the GPT-2 byte-level split; plain "gpt2"/"default" is the GPT-2 split alone.
_DIGIT_SPLITTING_PRE = {"smollm"}
_PLAIN_PRE = {"gpt2", "default"}


def build_tokenizer(meta: dict[str, Any], out_dir: Path) -> None:
    """Write tokenizer.json and tokenizer_config.json for a GGUF's byte-level BPE vocabulary.

    Raises:
        UnsupportedModelError: if the vocabulary is not GPT-2 style BPE or its
            pre-tokenizer is one we do not reproduce exactly.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise UnsupportedModelError(f"unsupported GGUF tokenizer model {kind!r} (only 'gpt2' BPE)")
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in _DIGIT_SPLITTING_PRE | _PLAIN_PRE:
        raise UnsupportedModelError(f"unsupported GGUF pre-tokenizer {pre!r}")

    tokens = meta_value(meta, "tokenizer.ggml.tokens", list)
    merge_list = meta_value(meta, "tokenizer.ggml.merges", list)
    types = meta_value(meta, "tokenizer.ggml.token_type", list)
    if len(types) != len(tokens) or not all(isinstance(t, str) for t in tokens + merge_list):
        raise UnsupportedModelError("GGUF vocabulary is damaged (token list and types disagree)")
    merges = [tuple(m.split(" ", 1)) for m in merge_list]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    try:
        bpe = models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False)
    except Exception as exc:  # tokenizers raises a bare Exception for bad merges
        raise UnsupportedModelError(f"GGUF vocabulary is damaged: {exc}") from exc
    tok = Tokenizer(bpe)
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _DIGIT_SPLITTING_PRE:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level]
        )
    else:
        tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    # Control tokens must be special: never split by BPE, skipped when decoding with
    # skip_special_tokens. User-defined tokens are atomic but printable.
    tok.add_special_tokens(
        [
            AddedToken(tokens[i], special=True, normalized=False)
            for i, t in enumerate(types)
            if t == _CONTROL
        ]
    )
    tok.add_tokens(
        [
            AddedToken(tokens[i], special=False, normalized=False)
            for i, t in enumerate(types)
            if t == _USER_DEFINED
        ]
    )

    def special(key: str) -> str | None:
        name = f"tokenizer.ggml.{key}_token_id"
        if name not in meta:
            return None
        idx = meta_value(meta, name, int)
        if not 0 <= idx < len(tokens):
            raise UnsupportedModelError(f"GGUF metadata {name} is {idx}, outside the vocabulary")
        return str(tokens[idx])

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=special("bos"),
        eos_token=special("eos"),
        unk_token=special("unknown"),
        pad_token=special("padding"),
        additional_special_tokens=[tokens[i] for i, t in enumerate(types) if t == _CONTROL],
        clean_up_tokenization_spaces=False,
        add_bos_token=meta_value(meta, "tokenizer.ggml.add_bos_token", bool, False),
    )
    template = meta.get("tokenizer.chat_template")
    if template:
        fast.chat_template = template
    fast.save_pretrained(str(out_dir))
