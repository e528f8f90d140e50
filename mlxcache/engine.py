"""The engine: token ids -> lookup -> prefill -> decode -> keep -> events (`encoder`
turns messages into token ids, on the front end's thread).

Requests run as lanes over one model and one cache. Each lane makes exactly the forward
calls it would make alone (batch 1, canonical prefill), and lanes are interleaved call
by call, so a reply never depends on what runs beside it.

Warm-ahead lanes are low-priority work: they canonically prefill a token prefix the next
request is expected to start with (a conversation plus its last reply) and keep its full
blocks, only while no request is running. A request that arrives meanwhile takes over:
an overlapping warm lane is stopped between two chunks and keeps what it computed, and
the request resumes from there instead of redoing it. Warm lanes compute exactly the
chunks a fresh prefill computes, so what they keep is canonical KV like any other.

A request may also be followed (`Request.follow`: clients that send the next turn as soon
as a reply ends): a follow lane prefills each block of prompt + reply as the reply
completes it, interleaved with the requests' steps while none of them is prefilling, so
the next turn finds all but the reply's last partial block kept.

Whose turn it is, for each kind of lane (`LaneKind`), is decided by `scheduler.Scheduler`.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import time
from collections.abc import Callable, Generator, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, ParamSpec, TypeVar, cast

import mlx.core as mx
import numpy as np

from mlxcache.cache.base import Lease, NoCache, PrefixCache
from mlxcache.config import WARM_AHEAD, default_block_size
from mlxcache.decode import Forward, Leave, decode
from mlxcache.decode_batch import DecodeBatch
from mlxcache.encoder import Encoder, common_prefix
from mlxcache.errors import GenerationError, UserInputError
from mlxcache.events import Done, Event, Prefill, Result, Stats, Token
from mlxcache.model import LoadedModel
from mlxcache.peers import TOLD, Peers
from mlxcache.prefill import prefill
from mlxcache.sampling import LogitsProcessor, SamplingParams
from mlxcache.scheduler import BACKGROUND, BATCH, LaneKind, Scheduler
from mlxcache.sysmem import release_unused
from mlxcache.types import KVLayer, Model

P = ParamSpec("P")
R = TypeVar("R")


@dataclass(slots=True)
class Request:
    """One generation: prompt token ids, sampling, and optional logits processors."""

    tokens: Sequence[int] | np.ndarray
    sampling: SamplingParams = field(default_factory=SamplingParams)
    processors: list[LogitsProcessor] = field(default_factory=list)
    stop_tokens: frozenset[int] | None = None
    """Token ids that end the reply; default: the tokenizer's end-of-turn ids."""
    stop_strings: tuple[str, ...] = ()
    """Texts that end the reply; the reply's text stops before the first one."""
    follow: bool = False
    """Keep prompt + reply warm while the reply is generated (see the module's doc)."""
    logprobs: int | None = None
    """k: every Token carries its log-probability and the k most likely tokens' (`decode`)."""


@dataclass(slots=True)
class _Follow:
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
class _Lane:
    """A lane's generator and what the scheduler reads of it (`scheduler.Schedulable`)."""

    gen: Generator[Any, Any, None]  # Events, and a batched decode's Forward / Leave
    tokens: np.ndarray
    kind: LaneKind
    prefilling: bool = False  # a request that has not yet given its first token
    batched: bool = False  # decoding in the batch: it steps with the batch
    follow: _Follow | None = None  # a follow lane's state

    def has_work(self) -> bool:
        """False only for a follow lane waiting for its reply to complete a block."""
        f = self.follow
        return f is None or f.closed or f.ready() > f.done


def _told(method: Callable[P, R]) -> Callable[P, R]:
    """An engine call that changes which forward calls are made (one of `peers.TOLD`): on
    rank 0 of a sharded run, the other ranks are told to make it too, unless it is made
    from within another such call (which they make themselves)."""
    if method.__name__ not in TOLD:
        raise TypeError(f"{method.__name__} is not an engine call the ranks are told")

    @functools.wraps(method)
    def call(*args: P.args, **kwargs: P.kwargs) -> R:
        engine = cast("Engine", args[0])
        ranks = engine.ranks
        if ranks is None or ranks.stepping:
            return method(*args, **kwargs)
        if ranks.leader:
            ranks.tell(engine, method.__name__, args[1:], kwargs)
        with ranks.step():
            return method(*args, **kwargs)

    return call


def final_result(events: Iterable[Event], on_event: Callable[[Event], None] | None) -> Result:
    """The `Result` of a request's event stream, each event shown to `on_event` first."""
    for event in events:
        if on_event is not None:
            on_event(event)
        if isinstance(event, Done):
            return event.result
    raise GenerationError("the request ended without a result")  # unreachable by design


class Engine:
    """Serves requests over one model and one prefix cache.

    Args:
        loaded: the model, tokenizer and model key from `mlxcache.model.load`.
        cache: a prefix cache (see `mlxcache.cache.store.PromptCache`); None keeps nothing.
        block_size: the prefill chunk of an engine without a cache (default: the device's
            default block size); given with a cache, it must equal the cache's.
        warm_ahead: whether `warm_chat` (called by the modes after each reply) queues work;
            `warm` always does.

    Raises:
        ValueError: a block size below 1, or one that differs from the cache's.
    """

    def __init__(
        self,
        loaded: LoadedModel,
        cache: PrefixCache | None = None,
        *,
        block_size: int | None = None,
        warm_ahead: bool = WARM_AHEAD,
        keep_replies: bool = False,
        batch_decode: bool = False,
        on_warning: Callable[[str], None] | None = None,
        ranks: Peers | None = None,
    ) -> None:
        if block_size is not None and block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if cache is not None and block_size not in (None, cache.block_size):
            raise ValueError(f"block_size {block_size} differs from the cache's {cache.block_size}")
        self.loaded = loaded
        self.encoder = Encoder.of(loaded)
        """Messages and text to token ids (front ends use it, from any thread)."""
        self.cache: PrefixCache = cache or NoCache(loaded.model, block_size or default_block_size())
        self.warm_ahead = warm_ahead
        # Keep a reply's own KV as its decode steps computed it: only where the device was
        # measured to compute decode KV bitwise as canonical prefill does (`invariance`),
        # for a plain KV model. Followed requests then need no follow lane.
        self.keep_replies = keep_replies
        # Requests past their first token decode as one batch: only where the device was
        # measured to give each row the bits it gets alone (`invariance`, `decode_batch`).
        self.batch_decode = batch_decode
        self._batch = DecodeBatch()
        self._warn = on_warning or (lambda _msg: None)
        self._ids = itertools.count()
        self._sched: Scheduler[_Lane] = Scheduler()
        self.ranks = ranks
        """The other processes of a sharded run (`distributed`); None when alone."""

    @property
    def model(self) -> Model:
        """The mlx-lm model module (forward calls go through this attribute)."""
        return self.loaded.model

    def check(self, request: Request) -> np.ndarray:
        """The request's prompt as int32 ids, validated (safe to call from any thread).

        Raises:
            UserInputError: empty prompt.
            ContextLengthError: the prompt leaves no room in the model's context.
        """
        tokens = np.asarray(request.tokens, dtype=np.int32).reshape(-1)
        if tokens.size == 0:
            raise UserInputError("the prompt is empty")
        self.encoder.check_fits(tokens, "the prompt")
        return tokens

    # -- lanes ------------------------------------------------------------------------------

    @_told
    def submit(self, request: Request) -> int:
        """Queue a request as a new lane; returns its id. Validates it first.

        Warm lanes whose work this request would repeat stop now and keep what they
        computed, so the request resumes from it.

        Raises:
            UserInputError: empty prompt.
            ContextLengthError: the prompt leaves no room in the model's context.
        """
        tokens = self.check(request)
        block = self.cache.block_size
        for rid, lane in self._sched.lanes(*BACKGROUND):
            if lane.follow is not None:
                # A finished reply's follow lane stops if this request (its next turn) needs
                # what it has not done yet; one whose reply still runs goes on.
                f = lane.follow
                if f.closed and common_prefix(f.tokens(), tokens) // block * block > f.done:
                    self.cancel(rid)
            elif (shared := common_prefix(lane.tokens, tokens)) >= block:
                self.cancel(rid)
                if shared < len(lane.tokens):  # e.g. another conversation, same system prompt:
                    self.warm(lane.tokens)  # its warm-ahead goes on later, from what it kept
        rid = next(self._ids)
        follow = None
        if (
            request.follow
            and self.cache.trimmable
            and not self.keep_replies
            and not isinstance(self.cache, NoCache)
        ):
            limit = self.loaded.context_length - 1
            follow = _Follow(tokens, [], len(tokens) // block * block, block, limit)
        gen = self._lane(rid, tokens, request, follow)
        self._sched.add(rid, _Lane(gen, tokens, LaneKind.REQUEST, prefilling=True))
        if follow is not None:
            follower = next(self._ids)
            lane = _Lane(
                self._follow_lane(follower, follow), tokens, LaneKind.FOLLOW, follow=follow
            )
            self._sched.add(follower, lane, follows=rid)
        return rid

    @_told
    def warm(self, tokens: Sequence[int] | np.ndarray) -> int | None:
        """Queue low-priority work: prefill `tokens`' full blocks and keep them.

        Runs only while no request does (`step`, `run(warm=True)`); a prefix already
        cached costs a lookup. Returns the lane id, or None when there is nothing to do
        (no cache, or shorter than one block).
        """
        ids = np.asarray(tokens, dtype=np.int32).reshape(-1)
        block = self.cache.block_size
        target = min(len(ids), self.loaded.context_length - 1) // block * block
        if isinstance(self.cache, NoCache) or target == 0:
            return None
        ids = ids[:target]
        for rid, lane in self._sched.lanes(LaneKind.WARM):
            if common_prefix(lane.tokens, ids) == len(lane.tokens):  # the same or a shorter prefix
                self.cancel(rid)
        rid = next(self._ids)
        self._sched.add(rid, _Lane(self._warm_lane(rid, ids), ids, LaneKind.WARM))
        return rid

    def warm_chat(self, messages: list[dict[str, Any]], **template_kwargs: Any) -> int | None:
        """Warm ahead for a conversation whose last message is the reply just given.

        `template_kwargs` must be those the next turn is rendered with (e.g. its tools).
        Returns None when warm-ahead is off or there is nothing to do.
        """
        if not self.warm_ahead:
            return None
        return self.warm(self.encoder.encode_next_turn(messages, **template_kwargs))

    @property
    def busy(self) -> bool:
        """Whether a request (`LaneKind.REQUEST`) is queued or running."""
        return self._sched.count(LaneKind.REQUEST) > 0

    @property
    def warming(self) -> bool:
        """Whether background work is queued: warm-ahead lanes and follow lanes (a follow
        lane may outlive its request, to keep the reply's last block)."""
        return self._sched.count(*BACKGROUND) > 0

    def lanes(self) -> list[tuple[int, LaneKind]]:
        """Every live lane's id and kind: warm-ahead lanes oldest first, then requests and
        follow lanes in the order of their next turns (`scheduler.Scheduler.lanes`)."""
        return [(rid, lane.kind) for rid, lane in self._sched.lanes()]

    @_told
    def step(self, background: bool = True) -> list[Event]:
        """One lane's turn, one model call: the next request lane (or follow lane with work,
        while no request is prefilling), round robin; else the oldest warm lane with work.
        A request's last prefill chunk comes with its first token (and the next decode
        step queued behind it). With batched decode, requests past their first token take
        their steps together (`_batch_step`), every other turn while lanes are prefilling.
        `background` False (requests are waiting to start): warm and follow lanes get no
        turn. See `scheduler.Scheduler.next_turn`.

        Returns the events of requests it produced (warm and follow lanes produce none).
        """
        turn = self._sched.next_turn(background, batch=len(self._batch) > 0)
        if turn is BATCH:
            return self._batch_step()
        return [] if turn is None else list(self._turn(turn))

    def release_memory(self) -> None:
        """If no lane runs, hand freed memory back to the system (`sysmem`): `run` and
        `generate` do when they end; a caller of `step` when it is left idle."""
        if not self._sched:
            release_unused()

    def _turn(self, rid: int, alone: bool = False) -> Iterator[Event]:
        """Advance lane `rid` by one turn and yield the request events it produced, telling
        the scheduler what became of the lane. `alone` (`generate`): every forward is the
        lane's own, none joins the decode batch.

        Events are yielded as they come, so a consumer that stops (`generate` closed) stops
        the turn between two of them; the lane is still queued then, for `cancel`.
        """
        lane = self._sched[rid]
        event = self._advance(rid, lane, alone=alone)
        if event is None and lane.batched:  # it joined the batch: it steps with it
            self._sched.requeue(rid)
            return
        if event is None or isinstance(event, Done):
            self._sched.finish(rid)
            if event is not None and lane.kind is LaneKind.REQUEST:
                yield event
            return
        if lane.kind is not LaneKind.REQUEST:  # background work produces no events
            self._sched.requeue(rid)
            return
        yield event
        if isinstance(event, Prefill) and event.done == event.total:
            # The first token comes with the prompt's last chunk: sampling it is no model
            # call, and waiting for the next round would delay it by every other lane's turn.
            event = self._advance(rid, lane, alone=alone)
            if event is None or isinstance(event, Done):
                self._sched.finish(rid)
                if event is not None:
                    yield event
                return
            yield event
        lane.prefilling = not isinstance(event, Token)
        self._sched.requeue(rid)  # requests take turns: to the back of the round
        if self.batch_decode and not alone and not lane.prefilling:  # on to the batch
            more = self._advance(rid, lane)
            if more is not None:
                if isinstance(more, Done):
                    self._sched.finish(rid)
                yield more

    def _batch_step(self) -> list[Event]:
        """One forward for every request in the batch, then each on to its next one."""
        rows = list(self._batch.rows)
        try:
            logits = self._batch.forward(self.model)
        except Exception as exc:  # every row fails alone, as a lane's own call would
            if self.ranks is not None:  # ... but the other ranks' did not fail: out of step
                raise self.ranks.lost(exc) from exc
            events: list[Event] = []
            for rid in rows:
                self._batch.drop(rid)
                self.cancel(rid)
                events.append(Done(rid, Result("", [], "error", Stats(), error=str(exc))))
            return events
        events = []
        for i, rid in enumerate(rows):
            lane = self._sched[rid]
            lane.batched = False
            event = self._advance(rid, lane, logits[i : i + 1])
            while event is not None:  # its Token, then on to its next forward or its end
                events.append(event)
                if isinstance(event, Done):
                    self._sched.finish(rid)
                    break
                event = self._advance(rid, lane)
        return events

    def _advance(
        self, rid: int, lane: _Lane, value: mx.array | None = None, alone: bool = False
    ) -> Event | None:
        """The lane's next event (sending it `value`); None once it has ended (a warm lane,
        or a broken one) or when it joined the decode batch to wait for its next forward.

        A request's first forward, and every forward of a request run `alone`, is its own.
        A broken lane ends alone (its finally released its pin): a request with an error
        `Done`, a warm or follow lane with a warning (it only cost the blocks it did not keep).
        """
        try:
            step = lane.gen.send(value)
            while isinstance(step, Forward | Leave):
                if isinstance(step, Leave):
                    if rid in self._batch:
                        self._batch.leave(rid, step.layers)
                    step = lane.gen.send(None)
                elif alone or lane.prefilling:
                    step = lane.gen.send(
                        self.model(step.y.reshape(1, 1), cache=step.layers)[:, -1, :]
                    )
                else:
                    if rid in self._batch:
                        self._batch.wait(rid, step.y)
                    else:
                        self._batch.join(rid, step.layers, step.y)
                    lane.batched = True
                    return None
            return step
        except StopIteration:
            return None
        except Exception as exc:
            if self.ranks is not None:  # the other ranks did not fail with it: out of step
                raise self.ranks.lost(exc) from exc
            if rid in self._batch:
                self._batch.drop(rid)
            if lane.kind is LaneKind.REQUEST:
                return Done(rid, Result("", [], "error", Stats(), error=str(exc)))
            self._warn(f"warm-ahead stopped early: {type(exc).__name__}: {exc}")
            return None

    def run(self, warm: bool = False) -> Iterator[Event]:
        """Advance the lanes until every request is done (and, with `warm`, the background
        lanes too: warm-ahead and follow)."""
        while self.busy or (warm and self.warming):
            yield from self.step()
        self.release_memory()

    def generate(self, request: Request) -> Iterator[Event]:
        """Run one request alone and yield its events; other lanes wait (see `submit`).

        The request's lane is queued like any other and advanced by the same turns as in
        `step`, but every turn is its own (none for other lanes, each forward its own) until
        it ends; its follow lane, if any, runs later with `step`.
        Closing the iterator early (Ctrl-C, a consumer that stops) cancels the request.
        A failed request raises GenerationError here; `run()` instead ends it with a
        `Done` whose result carries the error, so the other lanes go on.
        """
        rid = self.submit(request)
        try:
            while rid in self._sched:
                turn = self._turn(rid, alone=True) if self.ranks is None else self._whole_turn(rid)
                for event in turn:
                    if isinstance(event, Done) and event.result.error is not None:
                        raise GenerationError(event.result.error)
                    yield event
        finally:
            self.cancel(rid)
            self.release_memory()

    @_told
    def _whole_turn(self, rid: int) -> list[Event]:
        """`generate`'s turn in a sharded run: made whole, as the other ranks make it."""
        return list(self._turn(rid, alone=True))

    @_told
    def cancel(self, rid: int) -> None:
        """Stop a lane now: its pin is released and it yields nothing more.

        A lane stopped during prefill keeps the full blocks it has computed. A request
        stopped before its end takes its follow lane with it. Unknown or ended ids: nothing.
        """
        for r, lane in self._sched.cancel(rid):
            if r in self._batch:
                self._batch.drop(r)
            lane.gen.close()

    @_told
    def cancel_warm(self) -> None:
        """Stop every background lane: warm-ahead and follow lanes (each keeps the full
        blocks it has computed). Requests, and so a running reply, go on unfollowed."""
        for rid, _lane in self._sched.lanes(*BACKGROUND):
            self.cancel(rid)

    def complete(self, request: Request, on_event: Callable[[Event], None] | None = None) -> Result:
        """Run one request to the end and return its result; `on_event` sees every event
        (e.g. prefill progress).

        Raises:
            GenerationError: the request failed (e.g. its grammar allowed no token).
        """
        return final_result(self.generate(request), on_event)

    # -- one lane -----------------------------------------------------------------------

    def _miss_reason(self, n: int) -> str:
        """Why a request of n tokens resumed nothing."""
        if isinstance(self.cache, NoCache):
            return "cache off"
        if n <= self.cache.block_size:
            return f"shorter than one block of {self.cache.block_size} tokens"
        return "no cached prefix"

    def _lane(
        self, rid: int, tokens: np.ndarray, req: Request, follow: _Follow | None
    ) -> Generator[Event | Forward | Leave, Any, None]:
        n = int(tokens.size)
        stats = Stats(prompt_tokens=n)
        start = time.perf_counter()
        lease = None
        try:
            lease = self.cache.restore(tokens, anywhere=self.keep_replies)
            stats.cached_tokens = lease.length
            stats.prefilled_tokens = n - lease.length
            stats.miss_reason = "" if lease.length else self._miss_reason(n)
            stats.cached_from = lease.tier
            stats.restore_s = time.perf_counter() - start
            block = self.cache.block_size
            # Trimmable KV is kept after the prompt's last full block; a whole-state
            # checkpoint (recurrent / rotating layers) must be taken at the last boundary
            # before the end, so that the same prompt can resume from it.
            keep_at = (n // block if self.cache.trimmable else (n - 1) // block) * block
            if lease.logits is not None:  # this very prompt again: nothing to prefill
                logits = lease.logits
            else:
                logits = yield from self._prefill(rid, tokens, lease, lease.length, keep_at)
                lease.keep_tail(tokens, logits)
            stop = req.stop_tokens
            if stop is None:
                stop = frozenset(self.loaded.tokenizer.eos_token_ids)
            result = yield from decode(
                self.model,
                self.loaded.tokenizer,
                rid,
                tokens,
                lease.layers,
                logits,
                sampling=req.sampling,
                processors=req.processors,
                stop_tokens=stop,
                stop_strings=req.stop_strings,
                budget=self.encoder.reply_room(tokens, req.sampling.max_tokens),
                stats=stats,
                start=start,
                out=None if follow is None else follow.reply,
                logprobs=req.logprobs,
                batched=self.batch_decode,
                share=self.ranks,
                to_end=self.keep_replies,
            )
            if self.keep_replies:
                ended = [] if result.stop_token is None else [result.stop_token]
                self._keep_reply(tokens, [*result.tokens, *ended], lease)
        except GenerationError as exc:
            # This request fails alone: the lanes beside it go on.
            result = Result("", [], "error", stats, error=str(exc))
        finally:
            if lease is not None:
                lease.release()
            if follow is not None:  # however the request ended: its follow lane may finish
                follow.closed = True
        yield Done(rid, result)  # after the release: a finished request holds no pin

    def _keep_reply(self, prompt: np.ndarray, reply: list[int], lease: Lease) -> None:
        """Keep the full blocks of prompt + reply (its end token included) that the lease's
        layers hold past the prompt's own, and the rest as a tail to resume mid-block from
        (decode KV, canonical on this device: see `keep_replies`)."""
        block = self.cache.block_size
        held = min(cast(KVLayer, lease.layers[0]).offset, prompt.size + len(reply))
        ids = np.concatenate([prompt, np.asarray(reply, np.int32)])[:held]
        if held // block > prompt.size // block:
            lease.keep(ids[: held // block * block])
        lease.keep_tail(ids, None)

    def _warm_lane(self, rid: int, tokens: np.ndarray) -> Generator[Event, None, None]:
        # No logits needed: every full block. Warm work is not a request: not counted.
        # Where decode KV is canonical, it resumes from the reply's own tail: only the
        # next turn's new tokens are prefilled.
        with self.cache.restore(
            tokens, count=False, anywhere=self.keep_replies, whole=True
        ) as lease:
            if lease.length < len(tokens):
                yield from self._prefill(rid, tokens, lease, lease.length, len(tokens))

    def _follow_lane(self, rid: int, f: _Follow) -> Generator[Event, None, None]:
        # Stepped only when a block is complete or the request has ended (`step`).
        block = self.cache.block_size
        lease = None
        try:
            while (target := f.ready()) > f.done or not f.closed:
                if target <= f.done:
                    yield Prefill(rid, f.done, f.done)  # nothing yet: wait for the reply
                    continue
                ids = f.tokens()[:target]
                # Blocks kept already (the same conversation before) are skipped, and the
                # layers held so far with them: a later miss restores from there.
                if (kept := self.cache.cached_length(ids, whole=True)) > f.done:
                    f.done = kept
                    if lease is not None:
                        lease.release()
                        lease = None
                    continue
                if lease is None:
                    lease = self.cache.restore(ids[: f.done], count=False, whole=True)
                    f.done = lease.length
                stop = min(target, f.done + block)  # one chunk per step
                yield from self._prefill(rid, ids[:stop], lease, f.done, stop)
                f.done = stop
        finally:
            if lease is not None:
                lease.release()

    def _prefill(
        self,
        rid: int,
        tokens: np.ndarray,
        lease: Lease,
        start: int,
        keep_at: int,
    ) -> Generator[Event, None, mx.array]:
        """Prefill tokens[start:] into the lease's layers canonically and keep
        tokens[:keep_at]; returns the last logits.

        Stopped early (cancelled, interrupted), it keeps the full blocks it computed.
        """
        n, block = int(tokens.size), self.cache.block_size
        done = kept = start
        logits = None
        at_chunk_end = False  # the layers hold exactly `done` tokens
        try:
            # A resume inside a block only where decode KV is canonical: see `restore`.
            chunks = prefill(self.model, lease.layers, tokens, start, block, self.keep_replies)
            for stop, out in chunks:
                done, logits, at_chunk_end = stop, out, True
                if stop % block == 0 and stop <= keep_at:
                    lease.capture(tokens[:stop])
                if stop == keep_at and keep_at > start:
                    kept = keep_at  # tried once: not again while unwinding if it fails
                    lease.keep(tokens[:keep_at])
                yield Prefill(rid, stop, n)
                at_chunk_end = False
        except BaseException:
            # Cancelled between chunks (GeneratorExit) or interrupted inside one: what is
            # fully computed is canonical KV. A trimmable cache cuts it out of any state; a
            # whole-state checkpoint needs the layers to hold exactly `done` tokens.
            usable = done % block == 0 and (self.cache.trimmable or at_chunk_end)
            if done > kept and usable:
                # Best effort while unwinding: a failed keep must not replace what stopped
                # the lane (a cancel, Ctrl-C) nor fail the request that pre-empted it.
                with contextlib.suppress(Exception):
                    lease.keep(tokens[:done])
            raise
        if logits is None:  # prefill() always ends with the logits chunk
            raise GenerationError("prefill produced no logits")
        return logits
