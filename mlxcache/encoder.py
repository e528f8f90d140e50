"""The front end's half of a request: messages and text to token ids, and their limits.

The engine core sees token ids only (as vLLM v1's does): chat templates and tokenizer
calls happen here, on whichever thread prepares the request (the chat prompt's, an HTTP
handler's), never on the thread that owns MLX.

Threads: every method may be called from any thread. A fast (Rust) tokenizer used from
two threads at once can fail with "Already borrowed": transformers re-applies its
truncation and padding settings on each encode call, which needs the tokenizer
exclusively. So every encode made here holds `lock`, and a front end that calls the
tokenizer itself (`len(tokenizer)`, a thinking budget's tag tokens) holds it too.
Decoding only reads the tokenizer: the engine thread's detokenizer takes no lock.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from mlxcache.cache.radix import common_prefix
from mlxcache.errors import ContextLengthError, UserInputError

if TYPE_CHECKING:
    from mlxcache.model import LoadedModel

# Placeholder contents of the next message: what two renders with different contents share
# is the part of the next prompt that does not depend on what that message says.
_PROBES = ("\x01", "Z z")


def next_turn_prefix(
    encode: Callable[[list[dict[str, Any]]], list[int]],
    messages: list[dict[str, Any]],
    role: str = "user",
    **fields: Any,
) -> list[int]:
    """The token prefix every next prompt of a conversation starts with.

    `messages` ends with the last reply; the next prompt renders it followed by a message
    of `role` (with `fields`, e.g. a tool result's name). Templates may render earlier
    turns differently once a turn follows (e.g. dropping an assistant's reasoning), so
    this renders exactly that with `encode`, with two different placeholder messages, and
    keeps what both renders share: what does not depend on the next message's text.
    """
    a, b = (encode([*messages, {"role": role, "content": p, **fields}]) for p in _PROBES)
    return a[: common_prefix(a, b)]


class Encoder:
    """A model's tokenizer and context length, as front ends use them (thread-safe).

    Args:
        tokenizer: the model's tokenizer (mlx-lm's wrapper of a transformers tokenizer).
        context_length: the model's context, in tokens.
        model_name: how errors name the model.
    """

    def __init__(self, tokenizer: Any, context_length: int, model_name: str) -> None:
        self.tokenizer = tokenizer
        self.context_length = context_length
        self.model_name = model_name
        self.lock = threading.RLock()
        """Held by every encode here; hold it around any other tokenizer call made off the
        engine thread (re-entrant: an encode inside it is fine)."""

    @classmethod
    def of(cls, loaded: LoadedModel) -> Encoder:
        return cls(loaded.tokenizer, loaded.context_length, loaded.name)

    def encode_chat(self, messages: list[dict[str, Any]], **template_kwargs: Any) -> list[int]:
        """Token ids of `messages` rendered with the model's chat template, ready to reply.

        Raises:
            UserInputError: the model has no chat template (a base model's GGUF or folder).
        """
        if not getattr(self.tokenizer, "has_chat_template", True):
            raise UserInputError(
                f"model {self.model_name} has no chat template: send the prompt as raw "
                f"text (generate --raw, or the server's /v1/completions)"
            )
        with self.lock:
            ids = self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, **template_kwargs
            )
        return [int(t) for t in ids]

    def encode_next_turn(self, messages: list[dict[str, Any]], **template_kwargs: Any) -> list[int]:
        """The token prefix every next prompt of this conversation starts with (see
        `next_turn_prefix`); `messages` ends with the last reply."""
        return next_turn_prefix(lambda m: self.encode_chat(m, **template_kwargs), messages)

    def encode(self, text: str) -> list[int]:
        """Token ids of raw text (no template), as mlx-lm's generate and server encode it:
        with the special tokens the tokenizer adds itself (the BOS of Gemma or Llama 3, which
        their replies degrade without), unless the text already starts with the BOS."""
        bos = self.tokenizer.bos_token
        add = bos is None or not text.startswith(bos)
        with self.lock:
            ids = self.tokenizer.encode(text, add_special_tokens=add)
        return [int(t) for t in ids]

    def reply_room(self, ids: Sequence[int] | np.ndarray, max_tokens: int) -> int:
        """How many tokens a reply to `ids` may have: max_tokens, or less near the context's end."""
        return min(max_tokens, self.context_length - len(ids))

    def prompt(self, tokens: Sequence[int] | np.ndarray) -> np.ndarray:
        """A request's prompt as int32 ids, validated.

        Raises:
            UserInputError: empty prompt.
            ContextLengthError: the prompt leaves no room in the model's context.
        """
        ids = np.asarray(tokens, dtype=np.int32).reshape(-1)
        if ids.size == 0:
            raise UserInputError("the prompt is empty")
        self.check_fits(ids, "the prompt")
        return ids

    def check_fits(self, ids: Sequence[int] | np.ndarray, where: str = "the prompt") -> None:
        """Refuse a prompt that leaves no room for a reply in the model's context.

        Raises:
            ContextLengthError: naming `where` and both lengths.
        """
        if len(ids) >= self.context_length:
            raise ContextLengthError(
                f"{where} has {len(ids)} tokens; the model's context is {self.context_length}"
            )
