"""Whether a grammar lets a model write an exact text (shared by the grammar tests)."""

from __future__ import annotations

from llguidance import LLMatcher

from mlxcache.constrain import ll_tokenizer
from mlxcache.model import LoadedModel


def accepts(model: LoadedModel, grammar: str | None, text: str) -> bool:
    """Whether the grammar lets the model write exactly `text` and then stop."""
    assert grammar is not None
    matcher = LLMatcher(ll_tokenizer(model.tokenizer, model.key), grammar, log_level=0)
    ids = model.tokenizer.encode(text, add_special_tokens=False)
    return bool(matcher.consume_tokens(ids) and matcher.is_accepting())
