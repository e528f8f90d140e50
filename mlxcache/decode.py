"""The decode loop of one request: sample, stream text, stop on end tokens or stop strings."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any, Protocol, cast

import mlx.core as mx
import numpy as np

from mlxcache.detok import TextStream
from mlxcache.draft import Checkpoint, Drafter
from mlxcache.errors import GenerationError
from mlxcache.events import Result, Stats, Token
from mlxcache.sampling import LogitsProcessor, SamplingParams, make_processors, make_sampler
from mlxcache.stops import StopScanner
from mlxcache.types import Layers, Model, Tokenizer

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
    """Batched decode: the engine runs this forward (`y`, one token or a verify's token and
    drafts, after `layers`, within a batch of lanes) and sends back its logits, shaped
    (len(y), vocab)."""

    y: mx.array
    layers: Layers


@dataclass(frozen=True, slots=True)
class Rewind:
    """Batched drafting: the last `n` positions fed (rejected drafts) leave the caches, in
    the batch or in `layers` (`DecodeBatch.rewind`, `draft.Checkpoint`)."""

    layers: Layers
    n: int


@dataclass(frozen=True, slots=True)
class Leave:
    """Batched decode: the reply needs no more forwards; the engine puts its KV back
    into `layers` (from the batch) before the lane goes on."""

    layers: Layers


@dataclass(frozen=True, slots=True)
class Sync:
    """Batched decode: the engine copies the reply's caches as the batch holds them into
    `layers` (it stays in the batch), for a block to be captured from them."""

    layers: Layers


class _Reply:
    """The reply as its tokens are drawn: text, stop strings, end tokens, log-probabilities,
    and the token history logits processors read (prompt + reply, kept on the host: an
    mx.array made from host data is readable at once, while a lazy concatenate would queue
    behind the forward in flight and stall a grammar's mask that should overlap it)."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        rid: int,
        prompt: np.ndarray,
        budget: int,
        stop_tokens: frozenset[int],
        stop_strings: tuple[str, ...],
        out: list[int],
        logprobs: int | None,
    ) -> None:
        self.rid = rid
        self.prompt = int(prompt.size)
        self.host = np.empty(prompt.size + budget, dtype=np.int32)
        self.host[: prompt.size] = prompt
        self.stop_tokens = stop_tokens
        self.text = TextStream(tokenizer)
        self.stops = StopScanner(stop_strings)
        self.out = out
        self.pieces: list[str] = []
        self.finish = "length"
        self.ended_by: int | None = None
        self.logprobs = logprobs
        self.drawn_from: deque[mx.array] = deque()  # with logprobs: each queued pick's

    def tokens(self) -> np.ndarray:
        """Prompt + reply so far (a view: read it before the next token is taken)."""
        return self.host[: self.prompt + len(self.out)]

    def take(self, token: int) -> Token | None:
        """The drawn `token` as the reply's next Token; None when it is an end token (the
        reply has ended: `finish`, `ended_by`)."""
        if token == FAILED:  # no sampler draws it: rank 0's pick failed (`share`)
            raise GenerationError("the request failed on rank 0")
        logprob: float | None = None
        top: tuple[tuple[int, float], ...] = ()
        if self.logprobs is not None:
            logprob, top = _scored(self.drawn_from.popleft(), token, self.logprobs)
        if token in self.stop_tokens:
            self.finish, self.ended_by = "stop", token
            return None
        self.host[self.prompt + len(self.out)] = token
        self.out.append(token)
        piece = self.stops.feed(self.text.add(token))
        self.pieces.append(piece)
        if self.stops.stopped:
            self.finish = "stop"
        return Token(self.rid, token, piece, logprob, top)

    def tail(self) -> Token | None:
        """Text held back until the end (an incomplete character, a possible stop string)."""
        tail = self.stops.feed(self.text.flush()) + self.stops.flush()
        if not tail:
            return None
        self.pieces.append(tail)
        return Token(self.rid, self.out[-1], tail)

    def result(self, stats: Stats) -> Result:
        # `out` may be a follow lane's
        return Result(
            "".join(self.pieces),
            list(self.out),
            self.finish,
            stats,
            stop_token=self.ended_by,
            stop_string=self.stops.matched,
        )


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
    drafter: Drafter | None = None,
    draft: int = 0,
    capture: Capture | None = None,
) -> Generator[Token | Forward | Leave | Sync | Rewind, Any, Result]:
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
    `drafter` with `draft` k >= 1: speculative decoding (`_drafted`; batched, rejected
    drafts go with `Rewind`).
    `capture` (decode KV kept): told each time a one-token step leaves the
    layers holding a whole number of blocks (`Capture`); a verify forward that passes a
    boundary does not stop there, so a drafted reply's blocks are not captured.
    """
    sampler = make_sampler(sampling)
    # Sampling's own processors (penalties) first, then the request's (bias, grammar).
    procs = [*make_processors(sampling, prompt.size), *processors]
    reply = _Reply(
        tokenizer,
        rid,
        prompt,
        budget,
        stop_tokens,
        stop_strings,
        [] if out is None else out,
        logprobs,
    )
    out = reply.out

    def pick(logits: mx.array) -> mx.array:
        """The token plain decoding draws from `logits`, after prompt + reply so far."""
        try:
            if procs:
                history = mx.array(reply.tokens())
                for proc in procs:
                    logits = proc(history, logits)
        except Exception:
            if share is not None:  # the others wait for this pick: they fail with it
                share.fail()
            raise
        logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        if logprobs is not None:
            reply.drawn_from.append(logp)
        return sampler(logp) if share is None else share.token(sampler(logp))

    held = int(prompt.size)  # positions the layers hold

    def feed(y: mx.array) -> Generator[Forward | Sync, Any, mx.array]:
        """`y` into the layers; its logits, lazy (batched: the engine runs the forward)."""
        nonlocal held
        if batched:
            logits = yield Forward(y, layers)
        else:
            logits = model(y.reshape(1, 1), cache=layers)[:, -1, :]
        held += 1
        if capture is not None and held % capture.block == 0:
            if batched:
                yield Sync(layers)
            capture.at(held)
        return cast(mx.array, logits)

    if drafter is not None and draft > 0:
        capture = None  # verify forwards pass block boundaries: nothing to note
        last = yield from _drafted(
            model, layers, logits, reply, pick, drafter, draft, budget, stats, start, batched
        )
        fed = False
    else:
        last, fed = yield from _plain(feed, pick, logits, reply, bool(procs), budget, stats, start)
    tail = reply.tail()
    if tail is not None:
        yield tail
    stats.generated_tokens = len(out)
    if to_end and not fed:  # after every piece of text: the client has it all already
        yield from feed(last)  # its logits are not needed
        if not batched:
            mx.eval([c.state for c in layers])  # the KV only: no LM head
    if batched:
        yield Leave(layers)
    return reply.result(stats)


Pick = Callable[[mx.array], mx.array]


@dataclass(frozen=True, slots=True)
class Capture:
    """Where a kept reply's blocks must be noted as decode reaches them (sliding windows
    and recurrent state keep no block for later): `at(n)` when the layers hold exactly n
    tokens, n a multiple of `block` (`Lease.capture`)."""

    block: int
    at: Callable[[int], None]


def _plain(
    feed: Callable[[mx.array], Generator[Forward | Sync, Any, mx.array]],
    pick: Pick,
    logits: mx.array,
    reply: _Reply,
    procs: bool,
    budget: int,
    stats: Stats,
    start: float,
) -> Generator[Token | Forward | Sync, Any, tuple[mx.array, bool]]:
    """One token per forward. Returns the last token drawn and whether the layers hold it."""
    out = reply.out

    def forward(y: mx.array) -> Generator[Forward | Sync, Any, mx.array]:
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
        token = reply.take(cast(int, y.item()))
        if first:
            stats.ttft_s = time.perf_counter() - start
            decode_start = time.perf_counter()
        if token is None:
            break
        yield token
        if reply.stops.stopped or not more:
            break
        if first:
            nxt = yield from forward(y)
            held = True
        if procs:
            nxt = pick(nxt)
            mx.async_eval(nxt)
        y = nxt
    stats.decode_s = time.perf_counter() - decode_start
    return y, held


def _drafted(
    model: Model,
    layers: Layers,
    logits: mx.array,
    reply: _Reply,
    pick: Pick,
    drafter: Drafter,
    k: int,
    budget: int,
    stats: Stats,
    start: float,
    batched: bool,
) -> Generator[Token | Forward | Rewind, Any, mx.array]:
    """Speculative decoding: each forward feeds the last token and up to `k` drafts
    (`draft.Drafter`); each row's logits are picked from exactly as plain decoding picks
    (`pick`: the same processors over the same history, the sampler's next key), and a
    draft is accepted while it equals the pick. The first pick that differs ends the
    round; the rejected drafts' KV is taken back out (`Checkpoint`; `batched`: the engine
    runs the forward, in the decode batch, which may return the logits of the first
    inputs only (their drafts not fed), and `Rewind` takes them out). Returns the last
    token drawn (not in the layers)."""
    out = reply.out
    token = int(pick(logits).item())  # type: ignore[arg-type]
    stats.ttft_s = time.perf_counter() - start
    decode_start = time.perf_counter()
    try:
        taken = reply.take(token)
        if taken is not None:
            yield taken
        while taken is not None and not reply.stops.stopped and len(out) < budget:
            drafts = drafter.propose(reply.tokens(), min(k, budget - len(out) - 1))
            inputs = [token, *drafts]
            if batched:
                rows = yield Forward(mx.array(inputs), layers)
                drafts = drafts[: rows.shape[0] - 1]
            else:
                mark = Checkpoint(layers)
                rows = model(mx.array([inputs]), cache=layers)[0]
            stats.verify_forwards += 1
            stats.drafted_tokens += len(drafts)
            i = 0
            while True:
                token = int(pick(rows[i : i + 1]).item())  # type: ignore[arg-type]
                taken = reply.take(token)
                if taken is None:
                    break
                yield taken
                if not reads_on(reply, token, drafts, i):
                    break
                stats.accepted_tokens += 1
                i += 1
            # Rows 0..i were read: their inputs stay; the drafts after them go.
            if not batched:
                mark.rewind(model, inputs[: i + 1], len(drafts) - i)
            elif len(drafts) > i:
                yield Rewind(layers, len(drafts) - i)
    finally:
        drafter.close()
    stats.decode_s = time.perf_counter() - decode_start
    return mx.array([token])


def accepts(token: int, drafts: list[int], i: int) -> bool:
    """Whether row i's pick accepts the i-th draft (and the next row is read)."""
    return i < len(drafts) and token == drafts[i]


def reads_on(reply: _Reply, token: int, drafts: list[int], i: int) -> bool:
    """Whether a verify round reads row i + 1: row i's pick accepts its draft and did not
    end the reply at a stop string (the rows after a stop lie past the reply's end, as
    plain decoding never computes them)."""
    return not reply.stops.stopped and accepts(token, drafts, i)


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
