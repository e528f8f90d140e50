"""Incremental detokenization: text deltas that never split a UTF-8 character."""

from __future__ import annotations

from mlxcache.types import Tokenizer


class TextStream:
    """Turns a growing list of token ids into text deltas.

    Decodes a short window of recent tokens rather than the whole reply, holding text
    back while it ends in an incomplete multi-byte character (U+FFFD).

    Not mlx-lm's streaming detokenizer: its BPE variant drops the leading space of a
    reply's first token, so its text differs from `tokenizer.decode(tokens)`, which is
    what replies (and regress goldens) are defined as.
    """

    __slots__ = ("_ids", "_prefix", "_read", "_tok")

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tok = tokenizer
        self._ids: list[int] = []
        self._prefix = 0  # window start: decoded context for the next delta
        self._read = 0  # tokens whose text has been emitted

    def _decode(self, ids: list[int]) -> str:
        return str(self._tok.decode(ids, skip_special_tokens=True))

    def add(self, token: int) -> str:
        """Add a token; return the new text it completes (may be empty)."""
        self._ids.append(token)
        done = self._decode(self._ids[self._prefix : self._read])
        text = self._decode(self._ids[self._prefix :])
        if text.endswith("\ufffd") or len(text) <= len(done):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return text[len(done) :]

    def flush(self) -> str:
        """Text still held back (an incomplete character at the very end)."""
        done = self._decode(self._ids[self._prefix : self._read])
        text = self._decode(self._ids[self._prefix :])
        self._prefix = self._read = len(self._ids)
        return text[len(done) :]
