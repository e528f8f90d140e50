"""Speculative decoding's parts: drafters, and taking rejected drafts back out of the layers.

A drafter proposes the next few tokens of a reply; one forward of the model over the last
token and the drafts (a verify forward) gives each position's logits, and decode picks
from them exactly as plain decoding picks (`decode`): a draft is accepted while it equals
that pick, and the first pick that differs replaces it. What the reply is never depends on
the drafts: only how many forwards it takes. That holds bit for bit where a verify
forward's rows are bitwise one-row decode steps, which `invariance.verify_width` measures.

Drafters: `Lookup` (prompt lookup: the tokens that followed the reply's last n-gram where
it occurred before in prompt + reply; no second model) and `ModelDrafter` (a smaller model
that shares the tokenizer, greedy, resuming its own prompt from the prompt cache).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, cast

import mlx.core as mx
import numpy as np
from mlx.utils import tree_map
from mlx_lm.models.cache import KVCache

from mlxcache.cache.base import Lease, PrefixCache
from mlxcache.encoder import common_prefix
from mlxcache.last_logits import last_logits
from mlxcache.prefill import prefill
from mlxcache.types import KVLayer, Layers, Model


class Drafter(Protocol):
    """Proposes how a reply goes on."""

    def propose(self, tokens: np.ndarray, k: int) -> list[int]:
        """At most `k` tokens that may follow `tokens` (prompt + reply so far)."""
        ...

    def close(self) -> None:
        """The reply has ended: release what the drafter holds (again: nothing)."""
        ...


class Lookup:
    """Prompt lookup: the `k` tokens that followed the latest earlier occurrence of the
    last n tokens of prompt + reply, for the longest n up to `ngram` that occurred (and at
    least 2, when `ngram` allows it: a lone token's last occurrence predicts little, and a
    draft that is rejected costs a verify row)."""

    def __init__(self, ngram: int) -> None:
        self.ngram = ngram

    def propose(self, tokens: np.ndarray, k: int) -> list[int]:
        if k < 1:
            return []
        for n in range(min(self.ngram, len(tokens) - 1), min(self.ngram, 2) - 1, -1):
            # Windows over tokens[:-1]: the last n-gram itself is not an earlier occurrence.
            windows = np.lib.stride_tricks.sliding_window_view(tokens[:-1], n)
            hits = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
            if hits.size:
                # Copied as LZ77 copies: a copy that runs into its own end repeats.
                start, n_seen = int(hits[-1]) + n, len(tokens)
                drafts: list[int] = []
                for i in range(start, start + k):
                    drafts.append(int(tokens[i]) if i < n_seen else drafts[i - n_seen])
                return drafts
        return []

    def close(self) -> None:
        return None


def replay(
    drafter: Drafter,
    prompt: Sequence[int],
    reply: Sequence[int],
    ended: bool,
    k: int,
    budget: int,
) -> list[tuple[int, int]]:
    """The verify forwards a drafted run of `reply` makes, (drafts fed, drafts accepted)
    each, without the model: a drafted reply is the plain one (`reply`, its end token left
    out; `ended`: it ended with one, whose pick takes a forward too), and the drafter sees
    only prompt + reply so far, as `decode.Reply._drafted` feeds it (`budget`: the most tokens
    the reply was allowed)."""
    tokens = np.asarray([*prompt, *reply], np.int32)
    at = 1  # the first token comes with the prompt's logits
    rounds = []
    while at < len(reply) + int(ended):
        drafts = drafter.propose(tokens[: len(prompt) + at], min(k, budget - at - 1))
        accepted = common_prefix(drafts, reply[at : at + len(drafts)])
        rounds.append((len(drafts), accepted))
        at += accepted + 1
    return rounds


class ModelDrafter:
    """Greedy drafts of a draft model (its tokenizer maps token for token onto the
    target's). Its own KV follows the reply: each proposal feeds what was accepted since the
    last and trims what was not. The prompt resumes from the draft model's prompt cache
    (its own namespace) and its full blocks are kept there, so a chat's next turn does not
    prefill the draft model from token 0 either."""

    def __init__(self, model: Model, cache: PrefixCache) -> None:
        self.model = model
        self.cache = cache
        self.lease: Lease | None = None
        self.fed: list[int] = []  # what the layers hold

    def _layers(self, tokens: np.ndarray) -> Layers:
        if self.lease is None:  # the first proposal: the prompt, from the cache
            self.lease = lease = self.cache.restore(tokens, count=False)
            block = self.cache.block_size
            if lease.length < len(tokens):
                for stop, _ in prefill(self.model, lease.layers, tokens, lease.length, block):
                    if stop % block == 0:
                        lease.keep(tokens[:stop])
            self.fed = [int(t) for t in tokens]
        return self.lease.layers

    def propose(self, tokens: np.ndarray, k: int) -> list[int]:
        if k < 1:
            return []
        layers = cast(list[KVLayer], self._layers(tokens))
        same = common_prefix(self.fed, tokens)
        if same == len(tokens):  # keep one token to feed: its logits start the drafts
            same -= 1
        for c in layers:
            c.trim(len(self.fed) - same)
        feed = [int(t) for t in tokens[same:]]
        self.fed = self.fed[:same]
        drafts: list[int] = []
        while True:
            # The head over the last position alone: a feed of accepted tokens reads one row.
            logits = last_logits(self.model, mx.array([feed]), layers)[0]
            self.fed += feed
            drafts.append(cast(int, mx.argmax(logits).item()))
            if len(drafts) == k:
                return drafts
            feed = drafts[-1:]

    def close(self) -> None:
        if self.lease is not None:
            self.lease.release()
            self.lease = None


class Checkpoint:
    """The layers as they were before a verify forward, so that rejected drafts leave
    nothing behind: plain KV is trimmed; other caches (ring buffers, recurrent states) are
    put back as they were and the accepted tokens fed again."""

    def __init__(self, layers: Layers) -> None:
        self.layers = layers
        plain = all(type(c) is KVCache for c in layers)
        self.saved = None if plain else [snapshot(c.state) for c in layers]

    def rewind(self, model: Model, inputs: Sequence[int], rejected: int) -> None:
        """The verify forward fed `inputs` and then `rejected` more tokens: keep only
        `inputs` in the layers."""
        if rejected == 0:
            return
        if self.saved is None:
            for kv in cast(list[KVLayer], self.layers):
                kv.trim(rejected)
            return
        self.restore()
        model(mx.array([list(inputs)]), cache=self.layers)

    def restore(self) -> None:
        """The layers as they were before the verify forward."""
        for c, state in zip(self.layers, self.saved or (), strict=True):
            c.state = state


def snapshot(state: Any) -> Any:
    """A copy of a layer cache's `state`: a ring buffer is written in place
    (`keys[..., i] = k`), so keeping its arrays would keep what is written later."""
    return tree_map(lambda v: mx.array(v) if isinstance(v, mx.array) else v, state)


def same_vocabulary(a: Any, b: Any) -> bool:
    """Whether two tokenizers map every token to the same id (a draft model's must)."""
    return bool(a.vocab == b.vocab) and set(a.eos_token_ids) == set(b.eos_token_ids)
