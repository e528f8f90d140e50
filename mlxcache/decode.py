"""The decode loop of one request: sample, stream text, stop on end tokens or stop strings."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Generator
from dataclasses import dataclass
from typing import Any, Protocol, cast

import mlx.core as mx
import numpy as np

from mlxcache.detok import TextStream
from mlxcache.errors import GenerationError
from mlxcache.events import Result, Stats, Token
from mlxcache.sampling import LogitsProcessor, SamplingParams, make_processors, make_sampler
from mlxcache.stops import StopScanner
from mlxcache.types import KVLayer, Layers, Model, Tokenizer

FAILED = 2**32 - 1
"""A shared token that says rank 0's pick failed (`Share.fail`)."""


class Share(Protocol):
    """A sharded run's picks (`distributed.Ranks`): rank 0's token on every rank."""

    def token(self, token: mx.array) -> mx.array: ...

    def fail(self) -> None:
        """Rank 0's pick failed: every rank's fails (its token reads as `FAILED`)."""
        ...


@dataclass(frozen=True, slots=True)
class Forward:
    """Batched decode: the engine runs this decode step's forward (`y` after `layers`,
    within a batch of lanes) and sends back its logits, shaped (1, vocab)."""

    y: mx.array
    layers: list[KVLayer]


@dataclass(frozen=True, slots=True)
class Leave:
    """Batched decode: the reply needs no more forwards; the engine puts its KV back
    into `layers` (from the batch) before the lane goes on."""

    layers: list[KVLayer]


def decode(
    model: Model,
    tokenizer: Tokenizer,
    rid: int,
    prompt: np.ndarray,
    layers: Layers,
    logits: mx.array,
    *,
    sampling: SamplingParams,
    processors: list[LogitsProcessor],
    stop_tokens: frozenset[int],
    stop_strings: tuple[str, ...],
    budget: int,
    stats: Stats,
    start: float,
    out: list[int] | None = None,
    logprobs: int | None = None,
    batched: bool = False,
    share: Share | None = None,
    to_end: bool = False,
) -> Generator[Token | Forward | Leave, Any, Result]:
    """Generate up to `budget` tokens after `prompt`, whose last logits are `logits`.

    Yields one `Token` per generated token (its text may be empty while a character or a
    possible stop string is incomplete) and returns the `Result`. The generated ids are
    appended to `out` as they come, when given (a follow lane reads them). With
    `logprobs` k, each Token carries its log-probability and the k most likely tokens'
    (`_scored`), read from the distribution it was drawn from: after the processors,
    before temperature and the top-p/min-p/top-k filters. `batched`: each forward is
    asked of the engine (`Forward`), and `Leave` comes after the last. `share` (a sharded
    run): every pick becomes rank 0's, and a pick that fails there fails on every rank.
    `to_end`: the layers end up holding the KV of every token drawn, the last one (an end
    token too) included, as mlx-lm's do: where decode KV is kept, the next turn resumes
    after the whole reply instead of prefilling its last token in its own TTFT.
    """
    sampler = make_sampler(sampling)
    # Only plain KV models decode as one batch (the engine checks their layout).
    kv = cast(list[KVLayer], layers)
    # Sampling's own processors (penalties) first, then the request's (bias, grammar).
    procs = [*make_processors(sampling, prompt.size), *processors]
    # Token history for processors, kept on the host: an mx.array made from host data is
    # readable at once, while a lazy concatenate would queue behind the forward in flight
    # and stall the grammar's mask computation that should overlap it.
    host = np.empty(prompt.size + budget, dtype=np.int32)
    host[: prompt.size] = prompt
    history = mx.array(prompt)
    text = TextStream(tokenizer)
    stops = StopScanner(stop_strings)
    out = [] if out is None else out
    pieces: list[str] = []
    finish = "length"
    drawn_from: deque[mx.array] = deque()  # with logprobs: each queued pick's log-probs

    def pick(logits: mx.array) -> mx.array:
        try:
            for proc in procs:
                logits = proc(history, logits)
        except Exception:
            if share is not None:  # the others wait for this pick: they fail with it
                share.fail()
            raise
        logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        if logprobs is not None:
            drawn_from.append(logp)
        return sampler(logp) if share is None else share.token(sampler(logp))

    def feed(y: mx.array) -> Generator[Forward, Any, mx.array]:
        """`y` into the layers; its logits, lazy (batched: the engine runs the forward)."""
        if batched:
            return (yield Forward(y, kv))
        return model(y.reshape(1, 1), cache=layers)[:, -1, :]

    def forward(y: mx.array) -> Generator[Forward, Any, mx.array]:
        """The next forward, queued. Without processors the sampling is queued too; a
        processor (grammar) must see the token first."""
        nxt = yield from feed(y)
        nxt = pick(nxt) if not procs else nxt
        mx.async_eval(nxt)
        return nxt

    y = pick(logits)
    mx.async_eval(y)
    decode_start = 0.0
    nxt = y
    ended_by: int | None = None
    while True:
        more = len(out) + 1 < budget
        first = not out
        held = more and not first  # y's own forward is queued (the layers will hold y)
        if held:
            # Queue the next forward before waiting on this token: graph building overlaps
            # compute (as mlx-lm does). Not before the first: on MLX's CPU backend
            # `async_eval` computes most of a forward before it returns, which would hold
            # the first token back by a decode step.
            nxt = yield from forward(y)
        token = cast(int, y.item())
        if token == FAILED:  # no sampler draws it: rank 0's pick failed (`share`)
            raise GenerationError("the request failed on rank 0")
        if not out:
            stats.ttft_s = time.perf_counter() - start
            decode_start = time.perf_counter()
        logprob: float | None = None
        top: tuple[tuple[int, float], ...] = ()
        if logprobs is not None:
            logprob, top = _scored(drawn_from.popleft(), token, logprobs)
        if token in stop_tokens:
            finish, ended_by = "stop", token
            break
        out.append(token)
        piece = stops.feed(text.add(token))
        pieces.append(piece)
        yield Token(rid, token, piece, logprob, top)
        if stops.stopped:
            finish = "stop"
            break
        if not more:
            break
        if first:
            nxt = yield from forward(y)
            held = True
        if procs:
            host[prompt.size + len(out) - 1] = token
            history = mx.array(host[: prompt.size + len(out)])
            nxt = pick(nxt)
            mx.async_eval(nxt)
        y = nxt
    tail = stops.feed(text.flush()) + stops.flush()
    if tail:
        pieces.append(tail)
        yield Token(rid, out[-1], tail)
    stats.generated_tokens = len(out)
    stats.decode_s = time.perf_counter() - decode_start
    if to_end and not held:  # after every piece of text: the client has it all already
        yield from feed(y)  # its logits are not needed
        if not batched:
            mx.eval([c.state for c in layers])  # the KV only: no LM head
    if batched:
        yield Leave(kv)
    # `out` may be a follow lane's
    return Result("".join(pieces), list(out), finish, stats, stop_token=ended_by)


def _scored(logp: mx.array, token: int, top: int) -> tuple[float, tuple[tuple[int, float], ...]]:
    """`token`'s log-probability in `logp` and the `top` most likely (id, log-probability),
    most likely first (ties: lower id first, so the list never depends on the sort)."""
    row = logp.reshape(-1)
    chosen = cast(float, row[token].item())
    k = min(top, row.size)
    if k == 0:
        return chosen, ()
    ids = mx.argpartition(-row, kth=k - 1)[:k]
    pairs = zip(cast(list[int], ids.tolist()), cast(list[float], row[ids].tolist()), strict=True)
    return chosen, tuple(sorted(pairs, key=lambda p: (-p[1], p[0])))
