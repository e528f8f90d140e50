"""Log-probabilities in OpenAI's shapes: chat's `logprobs.content` (token, logprob, bytes,
top_logprobs) and the legacy completions' `tokens` / `token_logprobs` / `top_logprobs` /
`text_offset`.

The numbers are the decode loop's (`Token.logprob`, `Token.top_logprobs`), computed from
the logits the token was drawn from: bitwise the same whether the prompt was resumed from
the cache or prefilled, as the logits are.
"""

from __future__ import annotations

import codecs
import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer, SPMStreamingDetokenizer

UNLIKELY = -9999.0
"""What OpenAI reports for a token that cannot be drawn (one a grammar masks): JSON has no
-inf."""
_SPM_SPACE = "\u2581".encode()


@dataclass(frozen=True, slots=True)
class Scored:
    """One generated token, its log-probability and the most likely tokens' at its step."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]


@functools.lru_cache(maxsize=4)
def token_bytes(tokenizer: Any) -> tuple[bytes, ...]:
    """Each token id's bytes, as its text joins the reply's (a byte-level piece may be part
    of a character). Read from mlx-lm's detokenizer token map, built once per tokenizer."""
    detok = tokenizer.detokenizer
    if isinstance(detok, BPEStreamingDetokenizer):  # GPT-2 byte-level pieces ("Ġa" -> b" a")
        from transformers.convert_slow_tokenizer import bytes_to_unicode  # only needed here

        byte_of = {c: b for b, c in bytes_to_unicode().items()}
        return tuple(
            bytes(byte_of[c] for c in piece) if all(c in byte_of for c in piece) else piece.encode()
            for piece in detok.tokenmap
        )
    if isinstance(detok, SPMStreamingDetokenizer):  # "<0x0A>" already a byte, "▁" a space
        return tuple(piece.replace(_SPM_SPACE, b" ") for piece in detok.tokenmap)
    return tuple(tokenizer.decode([i]).encode() for i in range(len(tokenizer)))


def _text(raw: bytes) -> str:
    """A token's text; bytes that are not whole UTF-8 characters as \\x escapes, as OpenAI
    shows them (its `bytes` are exact)."""
    return raw.decode("utf-8", errors="backslashreplace")


def _value(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else UNLIKELY


class Formatter:
    """The logprobs objects of one reply, chunk by chunk (a completion's `text_offset` goes
    on from one chunk to the next)."""

    def __init__(self, vocab: tuple[bytes, ...]) -> None:
        self._vocab = vocab
        self._offset = 0
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")

    def _bytes(self, token: int) -> bytes:
        # Ids past the tokenizer's vocabulary (a padded output layer) have no text.
        return self._vocab[token] if 0 <= token < len(self._vocab) else b""

    def _item(self, token: int, logprob: float) -> dict[str, Any]:
        raw = self._bytes(token)
        return {"token": _text(raw), "logprob": _value(logprob), "bytes": list(raw)}

    def chat(self, scored: Sequence[Scored]) -> dict[str, Any]:
        """`choices[0].logprobs` of a chat completion (or chunk) for these tokens."""
        content = [
            {**self._item(s.token, s.logprob), "top_logprobs": [self._item(*t) for t in s.top]}
            for s in scored
        ]
        return {"content": content, "refusal": None}

    def completion(self, scored: Sequence[Scored]) -> dict[str, Any]:
        """`choices[0].logprobs` of a text completion (or chunk) for these tokens.

        `text_offset` counts characters of the tokens' own text, which is the reply's
        except where decoding drops something (special tokens, a leading SentencePiece
        space)."""
        offsets = []
        for s in scored:
            offsets.append(self._offset)
            self._offset += len(self._utf8.decode(self._bytes(s.token)))
        return {
            "tokens": [_text(self._bytes(s.token)) for s in scored],
            "token_logprobs": [_value(s.logprob) for s in scored],
            "top_logprobs": [{_text(self._bytes(t)): _value(v) for t, v in s.top} for s in scored],
            "text_offset": offsets,
        }
