"""A reply as data: its tokens drawn step by step (sample, stream text, stop on end tokens or
stop strings), each forward asked of the engine (`Forward`)."""

from __future__ import annotations

import enum
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol, cast

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
from mlxcache.scheduler import TurnKind
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
    """A forward a lane asks of the engine (`Engine._turn`): `x` after `layers`. `kind`:
    a prefill chunk (`logits`: whether the chunk is the prompt's last, whose last row's
    logits are wanted), a decode step (one token) or a verify (a token and its drafts).
    A decode step's or verify's logits come back shaped (len(x), vocab) (fewer rows: a
    batch row whose drafts were not fed)."""

    kind: TurnKind
    x: mx.array
    layers: Layers
    logits: bool = True


class Place(Protocol):
    """Where a reply's caches are between its forwards: its own layers, or a row of the
    decode batch (`lanes.Lane`, which the engine moves into the batch)."""

    def sync(self, layers: Layers) -> None:
        """The caches as they are now, copied into `layers` (a block is to be captured)."""
        ...

    def leave(self, layers: Layers) -> None:
        """The reply needs no more forwards: its KV is all in `layers`, evaluated."""
        ...

    def rewind(self, n: int) -> None:
        """The last `n` positions fed (rejected drafts) leave the caches."""
        ...


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
    """How a reply's forwards are made (each is asked of the engine: `Forward`; its
    `Place` is left after the last). `share` (a sharded run): every pick
    becomes rank 0's, and a pick that fails there fails on every rank.
    `decode_matches_prefill` (so the reply's KV is kept): the layers end up holding the KV
    of every token drawn, the last one (an end token too) included, as mlx-lm's do: the
    next turn resumes after the whole reply instead of prefilling its last token in its
    own TTFT. `drafter` with `draft` k >= 1:
    speculative decoding (`Reply.step`; rejected drafts go with `Place.rewind`).
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


@dataclass(frozen=True, slots=True)
class Origin:
    """Where a reply starts: the layers that hold its prompt's KV, where they are
    (`Place`), the prompt's last logits, and the request's arrival (`time.perf_counter`),
    for its time to first token."""

    layers: Layers
    place: Place
    logits: mx.array
    arrival: float


class Stage(enum.Enum):
    """Where a reply is (`Reply.step`)."""

    DRAW = "draw"
    """Drawing its tokens."""
    ENDING = "ending"
    """Drawn: its held-back text is given, its last token fed where its KV is kept
    (`Way.decode_matches_prefill`), then its caches are left (`Place.leave`)."""
    DONE = "done"
    """Ended: `Reply.result`."""


@dataclass(eq=False)
class Reply:
    """A reply's state as its tokens are drawn, and the steps that draw it (`step`).

    What it has drawn: the token history (prompt + reply, kept on the host: an mx.array
    made from host data is readable at once, while a lazy concatenate would queue behind
    the forward in flight and stall a grammar's mask that should overlap it), the sampler
    (whose key is its position) and processors, text, stop strings, end tokens,
    log-probabilities, and the positions its layers hold (`fed`).

    Where it is: `pending`, the token drawn and not taken yet (plain decoding: its forward
    is asked before it is taken, so that graph building overlaps compute, as mlx-lm does),
    whether its forward is made (`pending_fed`) and what that forward gave (`ahead`); a
    drafted reply's last pick (`token`), its verify's rows and drafts and the row it reads.
    """

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
    layers: Layers
    place: Place
    pending: mx.array  # plain: the token drawn, not taken yet (then: the last one taken)
    pieces: list[str] = field(default_factory=list)
    finish: str = "length"
    ended_by: int | None = None
    drawn_from: deque[mx.array] = field(default_factory=deque)  # with logprobs: each pick's
    stage: Stage = Stage.DRAW
    started: bool = False  # the first token is drawn (`pending` held the prompt's logits)
    taken: bool = False  # `pending` is taken
    pending_fed: bool = False  # `pending`'s forward is made
    ahead: mx.array | None = None  # what `pending`'s forward gave (picked, without processors)
    decode_start: float = 0.0
    token: int = 0  # drafted: the last token picked
    rows: mx.array | None = None  # drafted: the last verify's logits, while they are read
    drafts: list[int] = field(default_factory=list)  # drafted: that verify's drafts
    row: int = 0  # drafted: the row read last

    @classmethod
    def of(
        cls,
        tokenizer: Tokenizer,
        rid: int,
        prompt: np.ndarray,
        ask: Ask,
        way: Way,
        stats: Stats,
        origin: Origin,
        out: list[int] | None = None,
    ) -> Reply:
        """The reply to `prompt`, none of it drawn yet, from `origin`. Its ids are appended
        to `out` as they come, when given (a follow lane reads them)."""
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
            origin.arrival,
            TextStream(tokenizer),
            StopScanner(ask.stop_strings),
            make_sampler(ask.sampling),
            procs,
            [] if out is None else out,
            int(prompt.size),
            origin.layers,
            origin.place,
            origin.logits,  # not drawn yet: the first step draws from them
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

    @property
    def verifies(self) -> bool:
        """Whether the next step asks a verify forward (drafted, its rows all read)."""
        if self.stage is not Stage.DRAW or not self.way.drafted or not self.started:
            return False
        if self.rows is not None and reads_on(self, self.token, self.drafts, self.row):
            return False  # the next row is read first
        return not self.stops.stopped and len(self.out) < self.ask.budget

    def step(self, logits: mx.array | None = None) -> Token | Forward | Result:
        """The reply's next step: a `Token`, a `Forward` it asks (the next step is given its
        logits), or its `Result` once it has ended, its KV all in `layers` (`Stage`).

        Tokens are drawn the way `way` says (`Way`): one per forward (`_plain`), or
        drafted and verified (`_drafted`). Each Token's text may be empty while a character
        or a possible stop string is incomplete. With `Ask.logprobs` k, each Token carries
        its log-probability and the k most likely tokens' (`_scored`), read from the
        distribution it was drawn from: after the processors, before temperature and the
        top-p/min-p/top-k filters.
        """
        if self.stage is Stage.DRAW:
            drawn = self._drafted(logits) if self.way.drafted else self._plain(logits)
            if drawn is not None:
                return drawn
            self.stats.decode_s = time.perf_counter() - self.decode_start
            if self.way.drafted:  # its last pick is not in the layers
                self.pending, self.pending_fed = mx.array([self.token]), False
            self.close()
            self.stage = Stage.ENDING
            self.stats.generated_tokens = len(self.out)
            if (tail := self.tail()) is not None:
                return tail
        elif logits is not None:  # the last token's forward: its logits are not needed
            self._fed()
        if self.way.decode_matches_prefill and not self.pending_fed:
            return Forward(TurnKind.DECODE, self.pending, self.layers)  # after every piece
        self.place.leave(self.layers)
        self.stage = Stage.DONE
        return self.result()

    def close(self) -> None:
        """Release the drafter (the reply ended, or its lane was stopped)."""
        if self.way.drafter is not None:
            self.way.drafter.close()

    def _fed(self) -> None:
        """`pending` is in the layers: a block the layers now complete is captured.
        Verify forwards pass block boundaries: a drafted reply notes none."""
        self.fed += 1
        self.pending_fed = True
        capture = None if self.way.drafted else self.way.capture
        if capture is not None and self.fed % capture.block == 0:
            self.place.sync(self.layers)
            capture.at(self.fed)

    def _first(self) -> None:
        """The first token is drawn: the time to it, and decode's clock starts."""
        self.stats.ttft_s = time.perf_counter() - self.start
        self.decode_start = time.perf_counter()

    def _plain(self, logits: mx.array | None) -> Token | Forward | None:
        """One token per forward; None once it has ended (`pending`: the last token drawn,
        `pending_fed`: whether the layers hold it). A token's forward is asked before it
        is taken, so that graph building overlaps compute, as mlx-lm does (but the
        first's: on MLX's CPU backend `async_eval` computes most of a forward before it
        returns, which would hold the first token back by a decode step). Without
        processors the next pick is queued with the forward; a processor (grammar) must
        see the token first."""
        if not self.started:  # `pending` holds the prompt's logits
            self.started = True
            self.pending = self.pick(self.pending)
            mx.async_eval(self.pending)
        elif logits is not None:  # `pending`'s forward
            self._fed()
            self.ahead = self.pick(logits) if not self.procs else logits
            mx.async_eval(self.ahead)
        budget = self.ask.budget
        if self.taken:
            if self.stops.stopped or len(self.out) >= budget:
                return None
            if not self.pending_fed:  # the first token's forward
                return Forward(TurnKind.DECODE, self.pending, self.layers)
            nxt = cast(mx.array, self.ahead)
            if self.procs:
                nxt = self.pick(nxt)
                mx.async_eval(nxt)
            self.pending, self.ahead, self.pending_fed, self.taken = nxt, None, False, False
        if not self.pending_fed and self.out and len(self.out) + 1 < budget:
            return Forward(TurnKind.DECODE, self.pending, self.layers)
        first = not self.out
        token = self.take(cast(int, self.pending.item()))
        self.taken = True
        if first:
            self._first()
        return token

    def _drafted(self, rows: mx.array | None) -> Token | Forward | None:
        """Speculative decoding: each forward feeds the last token and up to k drafts
        (`Way.drafter`, `Way.draft`); each row's logits are picked from exactly as plain
        decoding picks (`pick`: the same processors over the same history, the sampler's
        next key), and a draft is accepted while it equals the pick. The first pick that
        differs ends the round; the rejected drafts' KV is taken back out (`Place.rewind`:
        the lane's `draft.Checkpoint` of its own forward, or the decode batch's, whose
        forward may return the logits of the first inputs only, their drafts not fed).
        None once it has ended."""
        if not self.started:  # `pending` holds the prompt's logits
            self.started = True
            self.token = int(self.pick(self.pending).item())  # type: ignore[arg-type]
            self._first()
            return self.take(self.token)
        if rows is not None:  # the verify's
            self.rows, self.drafts, self.row = rows, self.drafts[: rows.shape[0] - 1], 0
            self.stats.verify_forwards += 1
            self.stats.drafted_tokens += len(self.drafts)
            return self._read()
        if self.rows is not None:
            if reads_on(self, self.token, self.drafts, self.row):
                self.stats.accepted_tokens += 1
                self.row += 1
                return self._read()
            self._rewind()
        if self.stops.stopped or len(self.out) >= self.ask.budget:
            return None
        budget = self.ask.budget - len(self.out) - 1
        drafter = cast(Drafter, self.way.drafter)  # `Way.drafted`
        self.drafts = drafter.propose(self.tokens(), min(self.way.draft, budget))
        return Forward(TurnKind.VERIFY, mx.array([self.token, *self.drafts]), self.layers)

    def _read(self) -> Token | None:
        """Pick from the verify's row `row`: its token, or None (an end token: the round's
        rejected drafts leave the caches)."""
        rows = cast(mx.array, self.rows)
        self.token = int(self.pick(rows[self.row : self.row + 1]).item())  # type: ignore[arg-type]
        taken = self.take(self.token)
        if taken is None:
            self._rewind()
        return taken

    def _rewind(self) -> None:
        """Rows 0..row were read: their inputs stay; the drafts after them go."""
        if len(self.drafts) > self.row:
            self.place.rewind(len(self.drafts) - self.row)
        self.rows = None


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
