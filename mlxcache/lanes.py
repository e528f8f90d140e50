"""The engine's lanes as data: what a lane is (`Lane`: its kind, its phase, where its
caches are), what it runs on (`Work`), and the rules the engine reads of lanes. The work
each kind does, one step at a time, is its own module's (`request_lane.RequestLane`,
`background.WarmLane`, `background.FollowLane`). Whose turn it is, and what a lane's
phase becomes after a step, is the scheduler's (`scheduler.py`); the engine drives, and
makes every forward a lane asks for (`decode.Forward`: a prefill chunk, a decode step, a
verify), its own (`own_forward`) or a row of the decode batch's (`join`).

A step gives an event (`Prefill`, `Token`, `Done`), a `Step` (work without an event), or
the forward the lane asks for; the next step is given that forward's logits. A lane keeps
what it computed through its cache lease and releases the lease however it ends (`close`).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeAlias, cast

import mlx.core as mx
import numpy as np

from mlxcache.cache.base import NoCache, PrefixCache
from mlxcache.config import default_block_size
from mlxcache.decode import Forward, Share
from mlxcache.decode_batch import DecodeBatch
from mlxcache.draft import Checkpoint
from mlxcache.drafting import Drafting
from mlxcache.encoder import Encoder, common_prefix
from mlxcache.events import Done, Event, Prefill, Token
from mlxcache.membudget import MemoryBudget
from mlxcache.model import LoadedModel
from mlxcache.prefill import run_chunk
from mlxcache.request import Request
from mlxcache.scheduler import LaneKind, Phase, Step, TurnKind
from mlxcache.types import Layers, Model


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


Got: TypeAlias = Event | Step | Forward | None
"""What a lane's step gives (`Lane.step`): an event, a `Step` without one, the forward it
asks for, or None: it has ended (a background lane; a request ends with its `Done`)."""


@dataclass(frozen=True, slots=True)
class Mark:
    """The layers before a lane's own verify forward (`draft.Checkpoint`), the inputs it
    fed and the model that fed them: rejected drafts are taken back out from there."""

    checkpoint: Checkpoint
    fed: list[int]
    model: Model


class Lane:
    """A lane: what the scheduler reads and sets (`scheduler.Schedulable`), where its
    caches are between forwards (`decode.Place`: its own layers, or a row of the decode
    `batch`, which the engine moves it into), and its work, one step at a time (`step`).

    `solo`: every forward its own, never the batch's (an engine that does not batch, a
    request run alone: `Engine.generate`, a drafted one whose verify forwards cannot be
    rows of the batch: not `Plan.batched`). `left`: a request's prompt tokens to prefill,
    once looked up. `follow`: a follow lane's state."""

    def __init__(self, rid: int, tokens: np.ndarray, kind: LaneKind) -> None:
        self.rid = rid
        self.tokens = tokens
        self.kind = kind
        self.phase = Phase.RESTORING  # moved on by the scheduler (`Scheduler.advanced`)
        self.solo = False
        self.follow: Follow | None = None
        self.left: int | None = None
        self.batch: DecodeBatch | None = None  # the decode batch it is a row of
        self.mark: Mark | None = None  # before its last own verify forward

    @property
    def verifies(self) -> bool:
        """Whether its next forward is a verify (a drafted request's)."""
        return False

    def has_work(self) -> bool:
        """False only for a follow lane waiting for its reply to complete a block."""
        f = self.follow
        return f is None or f.closed or f.ready() > f.done

    def step(self, logits: mx.array | None) -> Got:
        """One step of its work, given the logits of the forward it asked for last (a
        prefill chunk's are None but for the prompt's last)."""
        raise NotImplementedError

    def close(self) -> None:
        """Stop here (ended, cancelled, failed): what it computed is kept, its lease and
        memory released. Closing again does nothing."""
        raise NotImplementedError

    def stop(self) -> None:
        """Stop now (cancelled, failed): out of the decode batch, and closed."""
        if self.batch is not None:
            self.batch.drop(self.rid)
            self.batch = None
        self.close()

    def sync(self, layers: Layers) -> None:
        if self.batch is not None:
            self.batch.sync(self.rid, layers)  # its own forwards left its layers current

    def leave(self, layers: Layers) -> None:
        if self.batch is not None:
            self.batch.leave(self.rid, layers)
            self.batch = None
        else:
            mx.eval([c.state for c in layers])  # the KV only: no LM head

    def rewind(self, n: int) -> None:
        if self.batch is not None:
            self.batch.rewind(self.rid, n)
        elif self.mark is not None:
            mark, self.mark = self.mark, None
            mark.checkpoint.rewind(mark.model, mark.fed[: len(mark.fed) - n], n)


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
    """What a lane's step gave, as the scheduler's rules read it (`Scheduler.advanced`)."""
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


def join(lane: Lane, ask: Forward, batch: DecodeBatch) -> Step:
    """A lane's forward as a row of the decode `batch`: it joins it, or (a row already)
    waits there with its next inputs."""
    if lane.batch is None:
        batch.join(lane.rid, ask.layers, ask.x)
        lane.batch = batch
    else:
        batch.wait(lane.rid, ask.x)
    return Step.JOINED


def own_forward(lane: Lane, ask: Forward, model: Model) -> mx.array | None:
    """A lane's own forward as it asked it: a prefill chunk (`prefill.run_chunk`), a decode
    step's or verify's logits, (len(x), vocab). A verify's inputs are noted with the
    layers before it (`Lane.mark`), for `Lane.rewind`."""
    if ask.kind is TurnKind.PREFILL:
        return run_chunk(model, ask.layers, ask.x, ask.logits)
    verify = ask.x.size > 1  # what it feeds may be taken back
    inputs = cast(list[int], ask.x.tolist()) if verify else []
    lane.mark = Mark(Checkpoint(ask.layers), inputs, model) if verify else None
    return model(ask.x.reshape(1, -1), cache=ask.layers)[0]
