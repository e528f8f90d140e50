"""Grammar-constrained decoding with llguidance, as an mlx-lm style logits processor.

A `GrammarProcessor` owns one llguidance matcher for one request. Each engine step hands
it (prompt + generated ids, logits); it feeds the token sampled last to the matcher and
masks every token the grammar forbids. Once the grammar is complete only the stop tokens
stay allowed, so the engine ends the reply with finish_reason "stop".
"""

from __future__ import annotations

import contextlib
import copy
import functools
import threading
from collections.abc import Collection
from pathlib import Path
from typing import TYPE_CHECKING, Any

import mlx.core as mx
import numpy as np
from llguidance import LLMatcher, LLParserLimits, LLTokenizer
from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

from mlxcache.errors import GenerationError, GrammarError, OutputFileError
from mlxcache.fileio import write_atomic

# Grammars as text (no model, no MLX) live in grammar.py, so that `json --check` starts
# fast; re-exported here, where the decoding side has always imported them from.
from mlxcache.grammar import JSON_OPTIONS as JSON_OPTIONS
from mlxcache.grammar import LENIENT_OPTIONS as LENIENT_OPTIONS
from mlxcache.grammar import grammar_check as grammar_check
from mlxcache.grammar import grammar_error as grammar_error
from mlxcache.grammar import grammar_from_json_schema as grammar_from_json_schema
from mlxcache.grammar import grammar_from_lark as grammar_from_lark
from mlxcache.grammar import regex_literal as regex_literal
from mlxcache.paths import cache_dir
from mlxcache.types import Tokenizer

if TYPE_CHECKING:
    from mlxcache.model import LoadedModel

_LIMITS_VERBOSE = False  # verbose errors dump parser state and the whole grammar

_tokenizers: dict[str, LLTokenizer] = {}
_tokenizers_lock = threading.Lock()


def ll_tokenizer(tokenizer: Tokenizer, key: str, directory: Path | None = None) -> LLTokenizer:
    """llguidance's view of an mlx-lm tokenizer wrapper, built once per model `key` (~0.4 s
    idle). Half of that is serializing the Hugging Face tokenizer for llguidance: kept in
    `directory` (the cache dir's `grammar/`), so another process reads it instead.

    Raises:
        GrammarError: the model has no fast Hugging Face tokenizer to build it from.
    """
    with _tokenizers_lock:
        cached = _tokenizers.get(key)
        if cached is not None:
            return cached
        hf: Any = getattr(tokenizer, "_tokenizer", tokenizer)  # the wrapped Hugging Face one
        eos = sorted(int(t) for t in getattr(tokenizer, "eos_token_ids", ()) or ())
        text = _serialized(hf, key, directory)
        built = LLTokenizer(text, eos_token=eos or hf.eos_token_id)
        _tokenizers[key] = built
        return built


def _serialized(hf: Any, key: str, directory: Path | None) -> str:
    """The Hugging Face tokenizer as llguidance reads it (`llguidance.hf.from_tokenizer`'s
    JSON), from `directory` where kept there, else serialized now and kept. The model key
    covers the tokenizer's files; the versions, how they are serialized and read."""
    import importlib.metadata as metadata

    import transformers

    if not isinstance(hf, transformers.PreTrainedTokenizerFast):
        raise GrammarError(
            "constrained decoding needs a fast Hugging Face tokenizer; this model has "
            f"{type(hf).__name__}"
        )
    versions = "-".join(metadata.version(p) for p in ("tokenizers", "llguidance"))
    path = None if directory is None else directory / f"{key}-{versions}.json"
    with contextlib.suppress(OSError, UnicodeDecodeError):
        if path is not None:
            return path.read_text()
    backend = copy.copy(hf.backend_tokenizer)  # as llguidance.hf: no padding, no truncation
    backend.no_padding()
    backend.no_truncation()
    text = str(backend.to_str())
    if path is not None:  # a file that cannot be written is only a lost shortcut
        with contextlib.suppress(OSError, OutputFileError):
            path.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(path, text)
            for old in path.parent.glob(f"{key}-*.json"):  # other versions': read no more
                if old != path and old.stem.count("-") == path.stem.count("-"):
                    old.unlink()
    return text


def grammar_dir(loaded: LoadedModel) -> Path:
    """Where grammar work on `loaded` kept across processes lives: the `grammar/` folder
    of the cache directory it was loaded under."""
    return (loaded.cache_root or cache_dir()) / "grammar"


def bitmask_to_bool(bitmask: np.ndarray, width: int) -> np.ndarray:
    """llguidance's packed mask (int32 words, bit t%32 of word t//32) as `width` booleans.

    Token ids past the mask (a model vocabulary padded beyond the tokenizer's) are
    forbidden; mask bits past `width` (the word padding) are dropped.
    """
    words = np.ascontiguousarray(bitmask, dtype="<i4").reshape(-1)
    bits = np.unpackbits(words.view(np.uint8), bitorder="little").astype(bool)
    if bits.size >= width:
        return bits[:width]
    return np.concatenate([bits, np.zeros(width - bits.size, dtype=bool)])


def apply_mask(logits: mx.array, allowed: np.ndarray) -> mx.array:
    """`logits` with every forbidden token set to -inf (one `mx.where`, any backend)."""
    neg_inf = mx.array(-np.inf, dtype=logits.dtype)
    return mx.where(mx.array(allowed), logits, neg_inf)


@functools.lru_cache(maxsize=16)
def compiled_matcher(tokenizer: LLTokenizer, grammar: str) -> LLMatcher:
    """A fresh matcher of `grammar`, compiled once and then copied (`deep_copy` takes
    microseconds; compiling a large schema's grammar takes seconds): every request of a
    batch, and every server request with the same schema, starts from a copy. Never
    advanced itself.

    Raises:
        GrammarError: the grammar does not compile (not cached: raised each time).
    """
    limits = LLParserLimits(verbose_errors=_LIMITS_VERBOSE)
    matcher = LLMatcher(tokenizer, grammar, log_level=0, limits=limits)
    if matcher.is_error():
        raise GrammarError(f"cannot compile the grammar: {matcher_error(matcher)}")
    return matcher


def matcher_error(matcher: LLMatcher) -> str:
    """The matcher's error on one line."""
    return " ".join(str(matcher.get_error()).split()) or "unknown matcher error"


class GrammarProcessor:
    """Logits processor enforcing one grammar on one request's reply.

    The engine's contract: the first call gets the prompt ids (not fed to the matcher,
    the grammar covers the reply only); each later call gets prompt + generated ids, the
    last one being the token just sampled, which the matcher consumes.

    Args:
        tokenizer: from `ll_tokenizer`.
        grammar: an llguidance grammar (`grammar_from_json_schema`, `grammar_from_lark`).
        stop_tokens: the ids that end the reply; the only ones allowed once the grammar
            is complete.

    Raises:
        GrammarError: the grammar does not compile.
    """

    def __init__(self, tokenizer: LLTokenizer, grammar: str, stop_tokens: Collection[int]) -> None:
        if not stop_tokens:
            raise ValueError("stop_tokens must not be empty: a complete grammar needs a way out")
        self.matcher = compiled_matcher(tokenizer, grammar).deep_copy()
        self._stop = np.fromiter(sorted(stop_tokens), dtype=np.int64)
        self._bitmask = allocate_token_bitmask(1, tokenizer.vocab_size)
        self._prompt_len: int | None = None
        self.consumed: list[int] = []

    @property
    def complete(self) -> bool:
        """The grammar is satisfied and nothing more can be added."""
        return bool(self.matcher.is_stopped() and not self.matcher.is_error())

    def _error(self) -> str:
        return matcher_error(self.matcher)

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        n = int(tokens.shape[-1])
        if self._prompt_len is None:
            self._prompt_len = n
        else:
            start = self._prompt_len + len(self.consumed)
            # Slice on the host: a lazy mx slice would wait behind the forward in flight.
            new: list[int] = np.asarray(tokens).reshape(-1)[start:].tolist()
            for token in new:
                if not self.matcher.consume_token(token):
                    raise GenerationError(f"the grammar rejected token {token}: {self._error()}")
                self.consumed.append(token)
        return apply_mask(logits, self.allowed(int(logits.shape[-1])))

    def allowed(self, width: int) -> np.ndarray:
        """Boolean mask of the tokens the grammar allows next, over a `width` vocabulary.

        Raises:
            GenerationError: the matcher failed or allows nothing (sampling would give NaN).
        """
        if self.matcher.is_error():
            raise GenerationError(f"constrained decoding failed: {self._error()}")
        if self.matcher.is_stopped():
            # Complete: force the end of the reply (the stop ids may differ from llguidance's eos).
            allowed = np.zeros(width, dtype=bool)
            allowed[self._stop[self._stop < width]] = True
            return allowed
        fill_next_token_bitmask(self.matcher, self._bitmask)
        if self.matcher.is_error():
            raise GenerationError(f"constrained decoding failed: {self._error()}")
        allowed = bitmask_to_bool(self._bitmask, width)
        if self.matcher.is_accepting():
            allowed[self._stop[self._stop < width]] = True
        if not allowed.any():
            raise GenerationError(
                "constrained decoding failed: the grammar allows no token of this model's "
                "vocabulary"
            )
        return allowed


def compile_for(loaded: LoadedModel, grammar: str) -> None:
    """Compile `grammar` for `loaded`'s vocabulary now (`compiled_matcher`), so that the
    processors `processor_for` makes of it later are copies.

    Raises:
        GrammarError: the grammar does not compile.
    """
    compiled_matcher(ll_tokenizer(loaded.tokenizer, loaded.key, grammar_dir(loaded)), grammar)


def processor_for(
    loaded: LoadedModel, grammar: str, stop_tokens: Collection[int] | None = None
) -> GrammarProcessor:
    """A fresh processor for one request on `loaded`."""
    tokenizer = ll_tokenizer(loaded.tokenizer, loaded.key, grammar_dir(loaded))
    stop = stop_tokens if stop_tokens is not None else loaded.tokenizer.eos_token_ids
    return GrammarProcessor(tokenizer, grammar, frozenset(int(t) for t in stop))
