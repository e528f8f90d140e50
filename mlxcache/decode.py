"""The decode loop of one request: sample, stream text, stop on end tokens or stop strings."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import Any, Protocol, cast

import mlx.core as mx
import numpy as np

from mlxcache.detok import TextStream
from mlxcache.draft import Drafter
from mlxcache.errors import GenerationError
from mlxcache.events import Result, Stats, Token
from mlxcache.sampling import (
    LogitsProcessor,
    Sampler,
    SamplingParams,
    make_processors,
    make_sampler,
)
from mlxcache.stops import StopScanner
from mlxcache.types import Layers, Tokenizer

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
    """A reply's next forward, asked of the engine: `y` (one token, or a verify's token and
    drafts) after `layers`, the lane's own forward or a row of the decode batch's; the
    engine sends back its logits, shaped (len(y), vocab) (fewer rows: a batch row whose
    drafts were not fed)."""

    y: mx.array
    layers: Layers


@dataclass(frozen=True, slots=True)
class Rewind:
    """Drafting: the last `n` positions fed (rejected drafts) leave the caches, in the
    batch or in `layers` (`DecodeBatch.rewind`, `draft.Checkpoint`)."""

    layers: Layers
    n: int


@dataclass(frozen=True, slots=True)
class Leave:
    """The reply needs no more forwards: its KV is all in `layers` before the lane goes on
    (the engine puts it back from the batch, or evaluates its own)."""

    layers: Layers


@dataclass(frozen=True, slots=True)
class Sync:
    """A block is to be captured from `layers`: the engine copies the reply's caches as the
    batch holds them into them (it stays in the batch; its own forwards left them current)."""

    layers: Layers


@dataclass(frozen=True, slots=True)
class Ask:
    """What a request asks of its reply: how each token is drawn (`sampling`, then the
    request's own `processors`), where the reply ends (`stop_tokens`, `stop_strings`, at
    most `budget` tokens), and `logprobs`: the k most likely tokens with each token."""

    sampling: SamplingParams
    processors: list[LogitsProcessor]
    stop_tokens: frozenset[int]
    stop_strings: tuple[str, ...]
    budget: int
    logprobs: int | None = None


@dataclass(frozen=True, slots=True)
class Way:
    """How a reply's forwards are made (each is asked of the engine: `Forward`, and `Leave`
    comes after the last). `share` (a sharded run): every pick
    becomes rank 0's, and a pick that fails there fails on every rank.
    `decode_matches_prefill` (so the reply's KV is kept): the layers end up holding the KV
    of every token drawn, the last one (an end token too) included, as mlx-lm's do: the
    next turn resumes after the whole reply instead of prefilling its last token in its
    own TTFT. `drafter` with `draft` k >= 1:
    speculative decoding (`Reply.drafted`; rejected drafts go with `Rewind`).
    `capture` (decode KV kept): told each time a one-token step leaves the layers holding
    a whole number of blocks (`Capture`); a verify forward that passes a boundary does not
    stop there, so a drafted reply's blocks are not captured."""

    share: Share | None = None
    decode_matches_prefill: bool = False
    drafter: Drafter | None = None
    draft: int = 0
    capture: Capture | None = None

    @property
    def drafted(self) -> bool:
        return self.drafter is not None and self.draft > 0


@dataclass(frozen=True, slots=True)
class Capture:
    """Where a kept reply's blocks must be noted as decode reaches them (sliding windows
    and recurrent state keep no block for later): `at(n)` when the layers hold exactly n
    tokens, n a multiple of `block` (`Lease.capture`)."""

    block: int
    at: Callable[[int], None]


@dataclass(eq=False)
class Reply:
    """A reply's state as its tokens are drawn: the token history (prompt + reply, kept on
    the host: an mx.array made from host data is readable at once, while a lazy
    concatenate would queue behind the forward in flight and stall a grammar's mask that
    should overlap it), the sampler (whose key is its position) and processors, text, stop
    strings, end tokens, log-probabilities, and the positions its layers hold (`fed`).
    `plain` and `drafted` draw it; `decode` drives them."""

    rid: int
    prompt: int  # the prompt's length: `host` starts with it
    host: np.ndarray
    ask: Ask
    way: Way
    stats: Stats
    start: float  # the request's arrival (`time.perf_counter`), for its time to first token
    text: TextStream
    stops: StopScanner
    sampler: Sampler
    procs: list[LogitsProcessor]
    out: list[int]  # the reply's tokens (may be a follow lane's list)
    fed: int  # the positions the layers hold
    pieces: list[str] = field(default_factory=list)
    finish: str = "length"
    ended_by: int | None = None
    drawn_from: deque[mx.array] = field(default_factory=deque)  # with logprobs: each pick's

    @classmethod
    def of(
        cls,
        tokenizer: Tokenizer,
        rid: int,
        prompt: np.ndarray,
        ask: Ask,
        way: Way,
        stats: Stats,
        start: float,
        out: list[int] | None = None,
    ) -> Reply:
        """The reply to `prompt`, none of it drawn yet; its ids are appended to `out` as
        they come, when given (a follow lane reads them)."""
        host = np.empty(prompt.size + ask.budget, dtype=np.int32)
        host[: prompt.size] = prompt
        # Sampling's own processors (penalties) first, then the request's (bias, grammar).
        procs = [*make_processors(ask.sampling, prompt.size), *ask.processors]
        return cls(
            rid,
            int(prompt.size),
            host,
            ask,
            way,
            stats,
            start,
            TextStream(tokenizer),
            StopScanner(ask.stop_strings),
            make_sampler(ask.sampling),
            procs,
            [] if out is None else out,
            int(prompt.size),
        )

    def tokens(self) -> np.ndarray:
        """Prompt + reply so far (a view: read it before the next token is taken)."""
        return self.host[: self.prompt + len(self.out)]

    def pick(self, logits: mx.array) -> mx.array:
        """The token plain decoding draws from `logits`, after prompt + reply so far."""
        share = self.way.share
        try:
            if self.procs:
                history = mx.array(self.tokens())
                for proc in self.procs:
                    logits = proc(history, logits)
        except Exception:
            if share is not None:  # the others wait for this pick: they fail with it
                share.fail()
            raise
        logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        if self.ask.logprobs is not None:
            self.drawn_from.append(logp)
        return self.sampler(logp) if share is None else share.token(self.sampler(logp))

    def take(self, token: int) -> Token | None:
        """The drawn `token` as the reply's next Token; None when it is an end token (the
        reply has ended: `finish`, `ended_by`)."""
        if token == FAILED:  # no sampler draws it: rank 0's pick failed (`share`)
            raise GenerationError("the request failed on rank 0")
        logprob: float | None = None
        top: tuple[tuple[int, float], ...] = ()
        if self.ask.logprobs is not None:
            logprob, top = _scored(self.drawn_from.popleft(), token, self.ask.logprobs)
        if token in self.ask.stop_tokens:
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

    def result(self) -> Result:
        # `out` may be a follow lane's
        return Result(
            "".join(self.pieces),
            list(self.out),
            self.finish,
            self.stats,
            stop_token=self.ended_by,
            stop_string=self.stops.matched,
        )

    def feed(self, layers: Layers, y: mx.array) -> Generator[Forward | Sync, Any, mx.array]:
        """`y` into the layers; its logits, lazy (the engine runs the forward)."""
        logits = yield Forward(y, layers)
        self.fed += 1
        # Verify forwards pass block boundaries: a drafted reply notes none.
        capture = None if self.way.drafted else self.way.capture
        if capture is not None and self.fed % capture.block == 0:
            yield Sync(layers)
            capture.at(self.fed)
        return cast(mx.array, logits)

    def _queue(self, layers: Layers, y: mx.array) -> Generator[Forward | Sync, Any, mx.array]:
        """The next forward, queued. Without processors the sampling is queued too; a
        processor (grammar) must see the token first."""
        nxt = yield from self.feed(layers, y)
        nxt = self.pick(nxt) if not self.procs else nxt
        mx.async_eval(nxt)
        return nxt

    def plain(
        self, layers: Layers, logits: mx.array
    ) -> Generator[Token | Forward | Sync, Any, tuple[mx.array, bool]]:
        """One token per forward. Returns the last token drawn and whether the layers hold it."""
        out, budget, stats = self.out, self.ask.budget, self.stats
        y = self.pick(logits)
        mx.async_eval(y)
        decode_start = 0.0
        nxt = y
        while True:
            more = len(out) + 1 < budget
            first = not out
            queued = more and not first  # y's own forward is queued (the layers will hold y)
            if queued:
                # Queue the next forward before waiting on this token: graph building
                # overlaps compute (as mlx-lm does). Not before the first: on MLX's CPU
                # backend `async_eval` computes most of a forward before it returns, which
                # would hold the first token back by a decode step.
                nxt = yield from self._queue(layers, y)
            token = self.take(cast(int, y.item()))
            if first:
                stats.ttft_s = time.perf_counter() - self.start
                decode_start = time.perf_counter()
            if token is None:
                break
            yield token
            if self.stops.stopped or not more:
                break
            if first:
                nxt = yield from self._queue(layers, y)
                queued = True
            if self.procs:
                nxt = self.pick(nxt)
                mx.async_eval(nxt)
            y = nxt
        stats.decode_s = time.perf_counter() - decode_start
        return y, queued

    def drafted(
        self, layers: Layers, logits: mx.array
    ) -> Generator[Token | Forward | Rewind, Any, mx.array]:
        """Speculative decoding: each forward feeds the last token and up to k drafts
        (`Way.drafter`, `Way.draft`); each row's logits are picked from exactly as plain
        decoding picks (`pick`: the same processors over the same history, the sampler's
        next key), and a draft is accepted while it equals the pick. The first pick that
        differs ends the round; the rejected drafts' KV is taken back out (`Rewind`: the
        engine's `draft.Checkpoint` of a lane's own forward, or the decode batch's, whose
        forward may return the logits of the first inputs only, their drafts not fed).
        Returns the last token drawn (not in the layers)."""
        out, budget, stats = self.out, self.ask.budget, self.stats
        drafter = cast(Drafter, self.way.drafter)  # `Way.drafted`
        token = int(self.pick(logits).item())  # type: ignore[arg-type]
        stats.ttft_s = time.perf_counter() - self.start
        decode_start = time.perf_counter()
        try:
            taken = self.take(token)
            if taken is not None:
                yield taken
            while taken is not None and not self.stops.stopped and len(out) < budget:
                drafts = drafter.propose(self.tokens(), min(self.way.draft, budget - len(out) - 1))
                inputs = [token, *drafts]
                rows = yield Forward(mx.array(inputs), layers)
                drafts = drafts[: rows.shape[0] - 1]
                stats.verify_forwards += 1
                stats.drafted_tokens += len(drafts)
                i = 0
                while True:
                    token = int(self.pick(rows[i : i + 1]).item())  # type: ignore[arg-type]
                    taken = self.take(token)
                    if taken is None:
                        break
                    yield taken
                    if not reads_on(self, token, drafts, i):
                        break
                    stats.accepted_tokens += 1
                    i += 1
                # Rows 0..i were read: their inputs stay; the drafts after them go.
                if len(drafts) > i:
                    yield Rewind(layers, len(drafts) - i)
        finally:
            drafter.close()
        stats.decode_s = time.perf_counter() - decode_start
        return mx.array([token])


def decode(
    layers: Layers, logits: mx.array, reply: Reply
) -> Generator[Token | Forward | Leave | Sync | Rewind, Any, Result]:
    """Draw `reply` after its prompt, whose KV `layers` hold and whose last logits are
    `logits`, the way `reply.way` says (`Way`), asking the engine for each forward.

    Yields one `Token` per generated token (its text may be empty while a character or a
    possible stop string is incomplete) and returns the `Result`. With `Ask.logprobs` k,
    each Token carries its log-probability and the k most likely tokens' (`_scored`), read
    from the distribution it was drawn from: after the processors, before temperature and
    the top-p/min-p/top-k filters.
    """
    way = reply.way
    if way.drafted:
        last = yield from reply.drafted(layers, logits)
        fed = False
    else:
        last, fed = yield from reply.plain(layers, logits)
    tail = reply.tail()
    if tail is not None:
        yield tail
    reply.stats.generated_tokens = len(reply.out)
    if way.decode_matches_prefill and not fed:  # after every piece: the client has it all
        yield from reply.feed(layers, last)  # its logits are not needed
    yield Leave(layers)
    return reply.result()


def accepts(token: int, drafts: list[int], i: int) -> bool:
    """Whether row i's pick accepts the i-th draft (and the next row is read)."""
    return i < len(drafts) and token == drafts[i]


def reads_on(reply: Reply, token: int, drafts: list[int], i: int) -> bool:
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
