"""Build a Hugging Face fast tokenizer from a GGUF file's `tokenizer.ggml.*` metadata."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mlxcache.errors import UnsupportedModelError

# GGUF token types (llama.cpp `llama_token_type`).
_CONTROL = 3
_USER_DEFINED = 4

# Pre-tokenizer regexes by `tokenizer.ggml.pre`. SmolLM2 ("smollm") splits digits one by one
# before the GPT-2 byte-level split; plain "gpt2"/"default" is the GPT-2 split alone.
_DIGIT_SPLITTING_PRE = {"smollm"}
_PLAIN_PRE = {"gpt2", "default"}


def _scalar(value: Any) -> Any:
    return value.item() if hasattr(value, "item") else value


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

    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    types = [int(t) for t in meta["tokenizer.ggml.token_type"].tolist()]
    vocab = {tok: i for i, tok in enumerate(tokens)}

    bpe = models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False)
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
        idx = meta.get(f"tokenizer.ggml.{key}_token_id")
        return None if idx is None else tokens[int(_scalar(idx))]

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=special("bos"),
        eos_token=special("eos"),
        unk_token=special("unknown"),
        pad_token=special("padding"),
        additional_special_tokens=[tokens[i] for i, t in enumerate(types) if t == _CONTROL],
        clean_up_tokenization_spaces=False,
        add_bos_token=bool(_scalar(meta.get("tokenizer.ggml.add_bos_token", False))),
    )
    template = meta.get("tokenizer.chat_template")
    if template:
        fast.chat_template = template
    fast.save_pretrained(str(out_dir))
