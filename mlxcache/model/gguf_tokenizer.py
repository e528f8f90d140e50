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


def build_tokenizer(
    meta: dict[str, Any], out_dir: Path, arch: str, fallback_template: str | None = None
) -> None:
    """Write tokenizer.json and tokenizer_config.json for a GGUF's vocabulary (and chat
    template: the file's own, else `fallback_template`).

    A byte-level BPE vocabulary with the GPT-2 split (or SmolLM2's) is built here; any other
    (SentencePiece, BPE with another pre-tokenizer) by transformers' own GGUF tokenizer
    builders. Either way the result is checked against the vocabulary.

    Raises:
        UnsupportedModelError: a vocabulary neither reproduces exactly, or a damaged one.
    """
    from transformers import PreTrainedTokenizerFast

    kind = meta_value(meta, "tokenizer.ggml.model", str)
    pre = meta_value(meta, "tokenizer.ggml.pre", str, "default")
    tokens = meta_value(meta, "tokenizer.ggml.tokens", list)
    types = meta_value(meta, "tokenizer.ggml.token_type", list)
    if len(types) != len(tokens) or not all(isinstance(t, str) for t in tokens):
        raise UnsupportedModelError("GGUF vocabulary is damaged (token list and types disagree)")
    if kind == "gpt2" and pre in _DIGIT_SPLITTING_PRE | _PLAIN_PRE:
        tok = _byte_level(meta, pre, tokens, types)
    else:
        tok = _by_transformers(meta, arch, kind, pre)
    _check_vocabulary(tok, tokens, types)

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
    template = meta.get("tokenizer.chat_template") or fallback_template
    if template:
        fast.chat_template = str(template)
    fast.save_pretrained(str(out_dir))


def _byte_level(meta: dict[str, Any], pre: str, tokens: list[Any], types: list[Any]) -> Any:
    """GPT-2 style byte-level BPE, with the GPT-2 split or SmolLM2's digit split before it."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    merge_list = meta_value(meta, "tokenizer.ggml.merges", list)
    if not all(isinstance(m, str) for m in merge_list):
        raise UnsupportedModelError("GGUF vocabulary is damaged (a merge is not text)")
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
    return tok


def _by_transformers(meta: dict[str, Any], arch: str, kind: str, pre: str) -> Any:
    """transformers' GGUF builder for this vocabulary (SentencePiece with Gemma's and
    Phi-3's variants, byte-level BPE with Llama 3's, Qwen2's, ... splits)."""
    from transformers.integrations.gguf.gguf_tokenizer_mapping import (
        GGUF_PRE_TOKENIZER_SPLITS,
        GGUF_TOKENIZER_MAPPING,
        convert_gguf_tokenizer,
    )

    # A byte-level vocabulary split some other way than the builders know would encode
    # text into other tokens than the model was trained on: refused, not guessed.
    if kind == "gpt2" and pre not in GGUF_PRE_TOKENIZER_SPLITS:
        raise UnsupportedModelError(f"unsupported GGUF pre-tokenizer {pre!r}")
    if kind not in ("gpt2", "llama"):
        raise UnsupportedModelError(
            f"unsupported GGUF tokenizer model {kind!r} (supported: 'gpt2' BPE, 'llama' "
            f"SentencePiece)"
        )
    fields = {
        name: meta[f"tokenizer.{key}"]
        for key, name in GGUF_TOKENIZER_MAPPING["tokenizer"].items()
        if f"tokenizer.{key}" in meta
    }
    try:
        tok, _ = convert_gguf_tokenizer(arch, fields)
    except Exception as exc:  # whatever the builder meets in a damaged vocabulary
        raise UnsupportedModelError(f"cannot build the GGUF's {kind} tokenizer: {exc}") from exc
    return tok


def _check_vocabulary(tok: Any, tokens: list[Any], types: list[Any]) -> None:
    """The built tokenizer has exactly the file's ids, its control tokens at their ids."""
    size = tok.get_vocab_size(with_added_tokens=True)
    if size != len(tokens):
        raise UnsupportedModelError(
            f"the tokenizer built from the GGUF has {size} tokens, the file {len(tokens)}"
        )
    for i, t in enumerate(types):
        if t == _CONTROL and tok.token_to_id(tokens[i]) != i:
            raise UnsupportedModelError(
                f"the tokenizer built from the GGUF puts {tokens[i]!r} at another id than {i}"
            )
