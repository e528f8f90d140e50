"""The engine's lanes: what a lane is (`Lane`: its kind, its phase, its generator) and the
work each kind does (`request_lane`, `warm_lane`, `follow_lane`), one model call per
step, over the model and cache of a `Work`. Whose turn it is, and what a lane's phase
becomes after a step, is the scheduler's (`scheduler.py`); the engine drives.

A lane generator yields events (`Prefill`, `Token`, `Done`) and, past its first token, asks
for its decode forwards (`decode.Forward`: made by the engine, its own or a row of the
decode batch) and what its caches need besides (`decode.Sync`, `decode.Leave`,
`decode.Rewind`: settled by `advance`); it keeps what it computed through its cache lease
and releases the lease however it ends.
"""

from __future__ import annotations

import contextlib
import enum
import time
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, cast

import mlx.core as mx
import numpy as np

from mlxcache.cache.base import Lease, NoCache, PrefixCache
from mlxcache.config import default_block_size
from mlxcache.decode import (
    Ask,
    Capture,
    Forward,
    Leave,
    Reply,
    Rewind,
    Share,
    Sync,
    Way,
    decode,
)
from mlxcache.decode_batch import DecodeBatch
from mlxcache.draft import Checkpoint
from mlxcache.drafting import Drafting, Plan
from mlxcache.encoder import Encoder, common_prefix
from mlxcache.errors import GenerationError, MemoryLimitError
from mlxcache.events import Done, Event, Prefill, Result, Stats, Token
from mlxcache.membudget import MemoryBudget
from mlxcache.model import LoadedModel
from mlxcache.model.kvquant import kv_width
from mlxcache.prefill import prefill
from mlxcache.request import Request
from mlxcache.scheduler import LaneKind, Phase, Step
from mlxcache.types import Model, positions


class NextTurn(enum.Enum):
    """How a conversation's next turn finds the reply before it kept: one rule
    (`next_turn_of`), read from the engine (`Engine.next_turn`) by every front end."""

    OFF = "off"
    """No cache, or warm-ahead off: the next turn prefills the reply."""
    KEPT = "kept"
    """The reply's own decode KV is kept as decoded (measured canonical on this device)."""
    FOLLOW = "follow"
    """A follow lane prefills each block of a followed reply as it completes it."""
    WARM = "warm"
    """Warm-ahead prefills the reply once it ended (a state that cannot be rewound)."""


def next_turn_of(cache: PrefixCache, decode_matches_prefill: bool, warm_ahead: bool) -> NextTurn:
    """The mechanism for a cache and what the device and settings allow: kept replies need
    nothing more; else a follow lane on trimmable KV, warm-ahead after the reply on
    states that cannot be trimmed (a follow lane could not rewind them between blocks)."""
    if isinstance(cache, NoCache):
        return NextTurn.OFF
    if decode_matches_prefill:
        return NextTurn.KEPT
    if not warm_ahead:
        return NextTurn.OFF
    return NextTurn.FOLLOW if cache.trimmable else NextTurn.WARM


def follow_of(
    request: Request, tokens: np.ndarray, turn: NextTurn, block: int, limit: int
) -> Follow | None:
    """A followed request's follow state, where the engine's mechanism is a follow lane."""
    if not request.follow or turn is not NextTurn.FOLLOW:
        return None
    return Follow(tokens, [], len(tokens) // block * block, block, limit)


@dataclass(slots=True)
class Follow:
    """What a follow lane prefills: a prompt and the reply its request appends to."""

    prompt: np.ndarray
    reply: list[int]
    done: int  # where the follow lane's canonical KV ends (a block boundary)
    block: int
    limit: int  # the last position a block may end at (the context's, less one)
    closed: bool = False  # the request has ended: the reply will not grow

    def tokens(self) -> np.ndarray:
        return np.concatenate([self.prompt, np.asarray(self.reply, dtype=np.int32)])

    def ready(self) -> int:
        """The end of the last full block of prompt + reply so far (within `limit`)."""
        return min(len(self.prompt) + len(self.reply), self.limit) // self.block * self.block


@dataclass(slots=True)
class Lane:
    """A lane: its generator, and what the scheduler reads and sets (`scheduler.Schedulable`)."""

    gen: Generator[Any, Any, None]  # Events, and its decode's asks (`advance`)
    tokens: np.ndarray
    kind: LaneKind
    phase: Phase = Phase.RESTORING  # moved on by the scheduler (`Scheduler.advanced`)
    follow: Follow | None = None  # a follow lane's state
    # Every forward its own, never the batch's: in an engine that does not batch, a request
    # run alone (`Engine.generate`), a drafted one whose verify forwards cannot be rows of
    # the batch (not `Plan.batched`).
    solo: bool = False
    left: int | None = None  # a request's prompt tokens to prefill, once looked up
    asked: Forward | None = None  # the forward it asked for, its own (`own_forward`)
    # Drafting: the caches before its last verify forward made alone, and its inputs.
    mark: tuple[Checkpoint, list[int]] | None = None

    def has_work(self) -> bool:
        """False only for a follow lane waiting for its reply to complete a block."""
        f = self.follow
        return f is None or f.closed or f.ready() > f.done


class Settings(Protocol):
    """What a lane reads of the engine when it is queued (`Work.of`)."""

    @property
    def loaded(self) -> LoadedModel: ...
    @property
    def encoder(self) -> Encoder: ...
    @property
    def cache(self) -> PrefixCache: ...
    @property
    def decode_matches_prefill(self) -> bool: ...
    @property
    def batch_decode(self) -> bool: ...
    @property
    def ranks(self) -> Share | None: ...
    @property
    def drafting(self) -> Drafting: ...
    @property
    def budget(self) -> MemoryBudget | None: ...


@dataclass(frozen=True, slots=True)
class Work:
    """What a lane runs on, fixed when it is queued: the model, its cache, and what the
    device was measured to allow (`Engine.decode_matches_prefill`, `Engine.batch_decode`);
    `share`: a sharded run's picks (`decode.Share`); `drafting`: how replies are drafted."""

    loaded: LoadedModel
    encoder: Encoder
    cache: PrefixCache
    decode_matches_prefill: bool
    batch_decode: bool
    share: Share | None
    drafting: Drafting
    budget: MemoryBudget | None = None

    @property
    def model(self) -> Model:
        return self.loaded.model

    @classmethod
    def of(cls, engine: Settings) -> Work:
        """What a lane queued now runs on: the engine's model, cache and settings as they are."""
        return cls(
            engine.loaded,
            engine.encoder,
            engine.cache,
            engine.decode_matches_prefill,
            engine.batch_decode,
            engine.ranks,
            engine.drafting,
            engine.budget,
        )


def cache_of(loaded: LoadedModel, cache: PrefixCache | None, block_size: int | None) -> PrefixCache:
    """An engine's cache: `cache`, or one that keeps nothing with prefill chunks of
    `block_size` (default: the device's default block size).

    Raises:
        ValueError: a block size below 1, or one that differs from the cache's.
    """
    if block_size is not None and block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    if cache is not None and block_size not in (None, cache.block_size):
        raise ValueError(f"block_size {block_size} differs from the cache's {cache.block_size}")
    return cache or NoCache(loaded.model, block_size or default_block_size())


def warm_prefix(
    tokens: Sequence[int] | np.ndarray, cache: PrefixCache, limit: int
) -> np.ndarray | None:
    """What a warm lane prefills of `tokens`: its full blocks ending by `limit`; None when
    there is nothing to do (no cache, or shorter than one block)."""
    ids = np.asarray(tokens, dtype=np.int32).reshape(-1)
    target = min(len(ids), limit) // cache.block_size * cache.block_size
    return None if isinstance(cache, NoCache) or target == 0 else ids[:target]


def waiting_rule(cache: PrefixCache) -> Callable[[Lane, Lane], bool] | None:
    """The scheduler's rule for a request waiting on an earlier one's prefill (`waits_for`):
    it pays only where blocks are kept whole-block (trimmable KV, a real cache)."""
    if not cache.trimmable or isinstance(cache, NoCache):
        return None
    return lambda lane, earlier: waits_for(lane, earlier, cache.block_size)


def step_of(got: Event | Step | None) -> Step:
    """What an advance gave, as the scheduler's rules read it (`Scheduler.advanced`)."""
    if isinstance(got, Step):
        return got
    if got is None or isinstance(got, Done):
        return Step.ENDED
    if isinstance(got, Token):
        return Step.TOKEN
    if isinstance(got, Prefill) and got.done == got.total:
        return Step.PROMPT_DONE
    return Step.CHUNK


def overtaken(lane: Lane, tokens: np.ndarray, block: int) -> tuple[bool, bool]:
    """What a new request's prompt (`tokens`) does to a background lane: whether it stops
    now (keeping what it computed, so the request resumes from it), and whether its
    warm-ahead is queued again (from what it kept) to finish later. A warm lane stops when
    the request shares a block with it, and goes on later when the request shares only
    part of it (another conversation with the same system prompt); a finished reply's
    follow lane stops when the request (its next turn) needs what it has not done yet;
    one whose reply still runs goes on."""
    if lane.follow is not None:
        f = lane.follow
        return f.closed and common_prefix(f.tokens(), tokens) // block * block > f.done, False
    shared = common_prefix(lane.tokens, tokens)
    return shared >= block, block <= shared < len(lane.tokens)


def waits_for(lane: Lane, earlier: Lane, block: int) -> bool:
    """Whether a request not started yet (`lane`) waits for an earlier one's prefill: when
    at least a block of its prompt, and at least half of the earlier prompt, is the same
    (agents sharing a system prompt and tools, a fork sent beside its original). Then it
    resumes the earlier one's kept blocks instead of computing them at the same time; a
    small share is not worth the wait."""
    shared = common_prefix(lane.tokens, earlier.tokens) // block * block
    return shared >= block and 2 * shared >= len(earlier.tokens)


def advance(
    lane: Lane, rid: int, value: mx.array | None, own: bool, model: Model, batch: DecodeBatch
) -> Event | Step | Forward | None:
    """Send `value` to lane `rid` and settle what it asks until it gives an event or asks
    for a forward: where that is its `own`, the ask is noted (`Lane.asked`) and returned
    for the engine to make (`Engine._forward`), else it joins (or waits in) the decode
    `batch` and this returns `Step.JOINED`; None once it has ended. Its errors propagate."""
    try:
        step = lane.gen.send(value)
        while isinstance(step, Leave | Sync | Rewind) or (isinstance(step, Forward) and not own):
            if isinstance(step, Forward):
                if rid in batch:
                    batch.wait(rid, step.y)
                else:
                    batch.join(rid, step.layers, step.y)
                return Step.JOINED
            settle(lane, rid, step, model, batch)
            step = lane.gen.send(None)
        if isinstance(step, Prefill) and lane.kind is LaneKind.REQUEST:
            lane.left = step.total - step.done
        if isinstance(step, Forward):
            lane.asked = step
        return cast(Event | Forward, step)
    except StopIteration:
        return None


def settle(
    lane: Lane, rid: int, ask: Leave | Sync | Rewind, model: Model, batch: DecodeBatch
) -> None:
    """What a reply asks of its caches besides a forward, in the decode `batch` where it is
    a row of it, else in its own layers, which its own forwards left current: its KV put
    back (`Leave`; its own evaluated), copied out for a block's capture (`Sync`), rejected
    drafts taken back out (`Rewind`: from before its own verify, `Lane.mark`)."""
    if isinstance(ask, Rewind):
        if rid in batch:
            batch.rewind(rid, ask.n)
        elif lane.mark is not None:
            (mark, fed), lane.mark = lane.mark, None
            mark.rewind(model, fed[: len(fed) - ask.n], ask.n)
    elif rid in batch:
        (batch.leave if isinstance(ask, Leave) else batch.sync)(rid, ask.layers)
    elif isinstance(ask, Leave):
        mx.eval([c.state for c in ask.layers])  # the KV only: no LM head


def own_forward(lane: Lane, model: Model) -> mx.array:
    """A lane's own forward as it asked it (`Lane.asked`): its logits, (len(y), vocab).
    A verify's inputs are noted with the layers before it (`Lane.mark`), for `Rewind`."""
    ask, lane.asked = cast(Forward, lane.asked), None
    verify = ask.y.size > 1  # what it feeds may be taken back
    lane.mark = (Checkpoint(ask.layers), cast(list[int], ask.y.tolist())) if verify else None
    return model(ask.y.reshape(1, -1), cache=ask.layers)[0]


def miss_reason(work: Work, n: int) -> str:
    """Why a request of n tokens resumed nothing."""
    if isinstance(work.cache, NoCache):
        return "cache off"
    if n <= work.cache.block_size:
        return f"shorter than one block of {work.cache.block_size} tokens"
    return "no cached prefix"


def request(
    work: Work, rid: int, tokens: np.ndarray, req: Request, follow: Follow | None, plan: Plan | None
) -> Lane:
    """A request's lane (`request_lane`): past its first token it decodes in the batch
    where the engine batches (`Work.batch_decode`), but for a drafted request whose verify
    forwards cannot be rows of it (`Plan.batched`)."""
    gen = request_lane(work, rid, tokens, req, follow, plan)
    solo = not work.batch_decode or bool(plan and not plan.batched)
    return Lane(gen, tokens, LaneKind.REQUEST, solo=solo)


def follow(work: Work, rid: int, tokens: np.ndarray, f: Follow) -> Lane:
    """The follow lane of a request of prompt `tokens` (`follow_lane`)."""
    return Lane(follow_lane(work, rid, f), tokens, LaneKind.FOLLOW, follow=f)


def request_lane(
    work: Work,
    rid: int,
    tokens: np.ndarray,
    req: Request,
    follow: Follow | None,
    plan: Plan | None = None,
) -> Generator[Event | Forward | Leave | Sync | Rewind | Step, Any, None]:
    n = int(tokens.size)
    stats = Stats(prompt_tokens=n, kv=kv_width(work.loaded))
    start = time.perf_counter()
    lease = None
    try:
        while work.budget and not work.budget.admit(rid, n, req.sampling.max_tokens, work.cache):
            yield Step.WAIT  # running requests hold the room: a turn without work
        lease = work.cache.restore(tokens, decode_matches_prefill=work.decode_matches_prefill)
        stats.cached_tokens = lease.length
        stats.prefilled_tokens = n - lease.length
        stats.miss_reason = "" if lease.length else miss_reason(work, n)
        stats.cached_from = lease.tier
        stats.restore_s = time.perf_counter() - start
        block = work.cache.block_size
        # Trimmable KV is kept after the prompt's last full block; a whole-state
        # checkpoint (recurrent / rotating layers) must be taken at the last boundary
        # before the end, so that the same prompt can resume from it.
        keep_at = (n // block if work.cache.trimmable else (n - 1) // block) * block
        if lease.logits is not None:  # this very prompt again: nothing to prefill
            logits = lease.logits
        else:
            logits = yield from prefill_blocks(work, rid, tokens, lease, lease.length, keep_at)
            lease.keep_tail(tokens, logits)
        stats.draft = "" if plan is None else plan.kind
        reply = Reply.of(
            work.loaded.tokenizer,
            rid,
            tokens,
            ask_of(work, req, tokens),
            way_of(work, plan, Capture(block, lease.capture)),
            stats,
            start,
            None if follow is None else follow.reply,
        )
        result = yield from decode(lease.layers, logits, reply)
        if work.decode_matches_prefill:
            ended = [] if result.stop_token is None else [result.stop_token]
            keep_reply(work, tokens, [*result.tokens, *ended], lease)
    except GenerationError as exc:
        # This request fails alone: the lanes beside it go on.
        result = Result("", [], "error", stats, error=str(exc))
    finally:
        if lease is not None:
            lease.release()
        if work.budget is not None:
            work.budget.release(rid)
        if follow is not None:  # however the request ended: its follow lane may finish
            follow.closed = True
    yield Done(rid, result)  # after the release: a finished request holds no pin


def ask_of(work: Work, req: Request, tokens: np.ndarray) -> Ask:
    """What `req` asks of its reply (the model's end tokens unless it names its own)."""
    stop = req.stop_tokens
    if stop is None:
        stop = frozenset(work.loaded.tokenizer.eos_token_ids)
    budget = work.encoder.reply_room(tokens, req.sampling.max_tokens)
    return Ask(req.sampling, req.processors, stop, req.stop_strings, budget, req.logprobs)


def way_of(work: Work, plan: Plan | None, capture: Capture) -> Way:
    """How a reply's forwards are made: drafted by its plan, and fed to its end with its
    blocks captured where its KV is kept (`Engine.decode_matches_prefill`). Whether they
    are its own or rows of the decode batch is the scheduler's (`Scheduler.own`)."""
    return Way(
        share=work.share,
        decode_matches_prefill=work.decode_matches_prefill,
        drafter=None if plan is None else work.drafting.drafter(plan, work.share),
        draft=0 if plan is None else plan.k,
        capture=capture if work.decode_matches_prefill else None,
    )


def keep_reply(work: Work, prompt: np.ndarray, reply: list[int], lease: Lease) -> None:
    """Keep the full blocks of prompt + reply (its end token included) that the lease's
    layers hold past the prompt's own, and the rest as a tail to resume mid-block from
    (decode KV, canonical on this device: see `decode_matches_prefill`)."""
    block = work.cache.block_size
    ids = np.concatenate([prompt, np.asarray(reply, np.int32)])
    ids = ids[: positions(lease.layers, len(ids))]
    if len(ids) // block > prompt.size // block:
        lease.keep(ids[: len(ids) // block * block])
    lease.keep_tail(ids, None)
    lease.keep_live(ids)  # the next turn continues from these layers themselves


def warm_lane(work: Work, rid: int, tokens: np.ndarray) -> Generator[Event, None, None]:
    # No logits needed: every full block. Warm work is not a request: not counted.
    # Where decode KV is canonical, it resumes from the reply's own tail: only the
    # next turn's new tokens are prefilled.
    whole = work.cache.cached_length(tokens, True, work.decode_matches_prefill) == len(tokens)
    if whole or not _room_now(work, rid, len(tokens)):
        return  # nothing to compute: the layers that hold it (live ones too) stay as they are
    try:
        with work.cache.restore(
            tokens, count=False, decode_matches_prefill=work.decode_matches_prefill, whole=True
        ) as lease:
            if lease.length < len(tokens):
                yield from prefill_blocks(work, rid, tokens, lease, lease.length, len(tokens))
            if work.decode_matches_prefill:  # the turn it warms continues from these layers
                lease.keep_live(tokens)
    finally:
        if work.budget is not None:
            work.budget.release(rid)


def _room_now(work: Work, rid: int, n: int) -> bool:
    """Whether the memory budget (if any) takes background work of `n` tokens now: it is
    only ever a head start, so it never waits for room."""
    try:
        return work.budget is None or work.budget.admit(rid, n, 0, work.cache)
    except MemoryLimitError:
        return False


def follow_lane(work: Work, rid: int, f: Follow) -> Generator[Event | Step, None, None]:
    # Stepped only when a block is complete or the request has ended (`step`).
    block = work.cache.block_size
    lease = None
    try:
        while (target := f.ready()) > f.done or not f.closed:
            if target <= f.done:
                yield Step.WAIT  # nothing yet (what it found was kept): wait for the reply
                continue
            ids = f.tokens()[:target]
            # Blocks kept already (the same conversation before) are skipped, and the
            # layers held so far with them: a later miss restores from there.
            if (kept := work.cache.cached_length(ids, whole=True)) > f.done:
                f.done = kept
                if lease is not None:
                    lease.release()
                    lease = None
                continue
            if lease is None:
                lease = work.cache.restore(ids[: f.done], count=False, whole=True)
                f.done = lease.length
            stop = min(target, f.done + block)  # one chunk per step
            yield from prefill_blocks(work, rid, ids[:stop], lease, f.done, stop)
            f.done = stop
    finally:
        if lease is not None:
            lease.release()


@dataclass(slots=True)
class Prefilling:
    """A prompt's prefill as data: `tokens[start:]` go into the lease's layers in canonical
    chunks; `tokens[:done]` are in them (`at_end`: exactly those, the chunk that reached
    `done` complete), `tokens[:keep_at]` are kept once reached, `kept`: how far they are."""

    lease: Lease
    tokens: np.ndarray
    block: int
    start: int
    keep_at: int
    done: int
    kept: int
    at_end: bool = False

    def reached(self, stop: int) -> None:
        """A chunk ended at `stop`: every block it completed is captured (a merged chunk
        completes several), and the prompt is kept at `keep_at` (tried once: not again
        while unwinding if it fails)."""
        first = self.done // self.block * self.block + self.block
        self.done, self.at_end = stop, True
        for end in range(first, min(stop, self.keep_at) + 1, self.block):
            self.lease.capture(end)
        if self.kept < self.keep_at <= stop:  # a merged chunk may pass it
            self.kept = self.keep_at
            self.lease.keep(self.tokens[: self.keep_at])

    def stopped(self, trimmable: bool) -> None:
        """Cancelled between chunks (GeneratorExit) or interrupted inside one: what is fully
        computed is canonical KV, kept. A trimmable cache cuts it out of any state; a
        whole-state checkpoint needs the layers to hold exactly `done` tokens."""
        usable = self.done % self.block == 0 and (trimmable or self.at_end)
        if self.done > self.kept and usable:
            # Best effort while unwinding: a failed keep must not replace what stopped
            # the lane (a cancel, Ctrl-C) nor fail the request that pre-empted it.
            with contextlib.suppress(Exception):
                self.lease.keep(self.tokens[: self.done])


def prefill_blocks(
    work: Work,
    rid: int,
    tokens: np.ndarray,
    lease: Lease,
    start: int,
    keep_at: int,
) -> Generator[Event, None, mx.array]:
    """Prefill tokens[start:] into the lease's layers canonically and keep
    tokens[:keep_at]; returns the last logits (`Prefilling`).

    Stopped early (cancelled, interrupted), it keeps the full blocks it computed.
    """
    n, block = int(tokens.size), work.cache.block_size
    state = Prefilling(lease, tokens, block, start, keep_at, start, start)
    logits = None
    try:
        # A resume inside a block only where decode KV is canonical: see `restore`.
        chunks = prefill(
            work.model, lease.layers, tokens, start, block, work.decode_matches_prefill
        )
        for stop, out in chunks:
            logits = out
            state.reached(stop)
            yield Prefill(rid, stop, n, start)
            state.at_end = False
    except BaseException:
        state.stopped(work.cache.trimmable)
        raise
    if logits is None:  # prefill() always ends with the logits chunk
        raise GenerationError("prefill produced no logits")
    return logits
