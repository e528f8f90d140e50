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

import itertools
from collections.abc import Callable, Iterable, Iterator, Sequence

import mlx.core as mx
import numpy as np

from mlxcache import background, lanes, request_lane
from mlxcache.cache.base import PrefixCache
from mlxcache.config import WARM_AHEAD
from mlxcache.decode import Forward
from mlxcache.decode_batch import DecodeBatch
from mlxcache.drafting import Drafting
from mlxcache.encoder import Encoder, common_prefix
from mlxcache.errors import GenerationError
from mlxcache.events import Done, Event, Result, Stats
from mlxcache.lanes import Lane, NextTurn
from mlxcache.membudget import MemoryBudget
from mlxcache.model import LoadedModel
from mlxcache.peers import Peers, told
from mlxcache.request import Request, take_processors
from mlxcache.scheduler import BACKGROUND, Go, LaneKind, Scheduler, Step, TurnKind
from mlxcache.sysmem import release_unused
from mlxcache.types import Model

__all__ = ["Engine", "Request", "final_result"]  # Request: the lanes' own, as callers know it


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
        warm_ahead: whether front ends queue warm-ahead after each reply
            (`modes.chat.warm_next_turn`); `warm` itself always queues work.
        decode_matches_prefill: the device was measured to compute decode KV bitwise as
            canonical prefill does (`invariance`), for a model of plain or quantized KV: a
            reply's own KV is kept as its decode steps computed it.
        batch_decode: requests past their first token decode as one batch; only where the
            device was measured to give each row the bits it gets alone (`decode_batch`).
        budget: the process's memory budget (`membudget.MemoryBudget`); None: no limit.

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
        decode_matches_prefill: bool = False,
        batch_decode: bool = False,
        on_warning: Callable[[str], None] | None = None,
        ranks: Peers | None = None,
        drafting: Drafting | None = None,
        budget: MemoryBudget | None = None,
    ) -> None:
        self.loaded = loaded
        self.encoder = Encoder.of(loaded)
        """Messages and text to token ids (front ends use it, from any thread)."""
        self.cache: PrefixCache = lanes.cache_of(loaded, cache, block_size)
        self.warm_ahead = warm_ahead
        self.decode_matches_prefill = decode_matches_prefill
        self.batch_decode = batch_decode
        self._batch = DecodeBatch()
        self._warn = on_warning or (lambda _msg: None)
        self._ids = itertools.count()
        self._sched: Scheduler[Lane] = Scheduler(waits=lanes.waiting_rule(self.cache))
        self.ranks = ranks
        """The other processes of a sharded run (`distributed`); None when alone."""
        self.drafting = drafting or Drafting.off(loaded, self.cache.block_size)
        """Speculative decoding's settings (`drafting.Drafting`): never, by default."""
        self.budget = budget

    @property
    def next_turn(self) -> NextTurn:
        """How a conversation's next turn finds this engine's replies kept (`NextTurn`)."""
        return lanes.next_turn_of(self.cache, self.decode_matches_prefill, self.warm_ahead)

    @property
    def model(self) -> Model:
        """The mlx-lm model module (forward calls go through this attribute)."""
        return self.loaded.model

    @told
    def submit(self, request: Request) -> int:
        """Queue a request as a new lane; returns its id. Validates it first.

        Warm lanes whose work this request would repeat stop now and keep what they
        computed, so the request resumes from it.

        Raises:
            UserInputError: empty prompt, or stateful logits processors that served an
                earlier submission (`request.take_processors`).
            ContextLengthError: the prompt leaves no room in the model's context.
            MemoryLimitError: it would not fit the memory budget even alone.
        """
        tokens = self.encoder.prompt(request.tokens)
        if self.budget is not None:
            self.budget.check(request, self.cache, now=False)
        plan = self.drafting.plan(request.draft, batch=self.batch_decode)
        take_processors(request)  # the last check: a refused request takes nothing
        block = self.cache.block_size
        for rid, lane in self._sched.lanes(*BACKGROUND):
            stop, rewarm = lanes.overtaken(lane, tokens, block)
            if stop:
                self.cancel(rid)
            if rewarm:  # its warm-ahead goes on later, from what it kept
                self.warm(lane.tokens)
        rid = next(self._ids)
        follow = lanes.follow_of(
            request, tokens, self.next_turn, block, self.loaded.context_length - 1
        )
        work = lanes.Work.of(self)
        self._sched.add(rid, request_lane.request(work, rid, tokens, request, follow, plan))
        if follow is not None:
            fid = next(self._ids)
            self._sched.add(fid, background.follow(work, fid, tokens, follow), follows=rid)
        return rid

    @told
    def warm(self, tokens: Sequence[int] | np.ndarray) -> int | None:
        """Queue low-priority work: prefill `tokens`' full blocks and keep them, while no
        request runs (`step`, `run(warm=True)`). Returns the lane id, or None when there is
        nothing to do (no cache, or shorter than one block)."""
        ids = lanes.warm_prefix(tokens, self.cache, self.loaded.context_length - 1)
        if ids is None:
            return None
        for rid, lane in self._sched.lanes(LaneKind.WARM):
            if common_prefix(lane.tokens, ids) == len(lane.tokens):  # the same or a shorter prefix
                self.cancel(rid)
        rid = next(self._ids)
        self._sched.add(rid, background.warm(lanes.Work.of(self), rid, ids))
        return rid

    @property
    def busy(self) -> bool:
        """Whether a request (`LaneKind.REQUEST`) is queued or running."""
        return self._sched.count(LaneKind.REQUEST) > 0

    @property
    def warming(self) -> bool:
        """Whether warm-ahead or follow lanes (which may outlive their request) are queued."""
        return self._sched.count(*BACKGROUND) > 0

    def lanes(self) -> list[tuple[int, LaneKind]]:
        """Every live lane's id and kind, in `scheduler.Scheduler.lanes`'s order."""
        return [(rid, lane.kind) for rid, lane in self._sched.lanes()]

    @told
    def step(self, background: bool = True) -> list[Event]:
        """One turn (`Scheduler.whose_turn`): a lane's (`_turn`), or the decode batch's
        forward (`_batch_turn`). `background` False (requests are waiting to start): warm
        and follow lanes get no turn. Returns the events of requests it produced."""
        turn = self._sched.whose_turn(background, self._batch.rows)
        if turn is None:
            return []
        if turn.kind is TurnKind.BATCH:
            return self._batch_turn(turn.lanes)
        return self._turn(turn.lane)

    def release_memory(self) -> None:
        """If no lane runs, hand freed memory back to the system (`sysmem`), as `run` and
        `generate` do when they end and a caller of `step` does when it is left idle."""
        if not self._sched:
            release_unused()

    def _turn(self, rid: int, logits: mx.array | None = None) -> list[Event]:
        """Lane `rid`'s turn: its steps (the first given `logits`: its row of the batch's
        forward), and the forwards they ask for, each made as soon as it is asked, its own
        (`lanes.own_forward`) or, where it is a row of the decode batch or `Go.JOIN`s it,
        the batch's (`lanes.join`), until the scheduler ends the turn
        (`Scheduler.advanced`). A failed step or call fails the lane alone. Returns its
        request events."""
        lane, events = self._sched[rid], []
        go = Go.ON
        while go is not Go.END:
            try:
                got = lane.step(logits)
                logits = None
                if isinstance(got, Forward) and (go is Go.JOIN or lane.batch is not None):
                    got = lanes.join(lane, got, self._batch)
                elif isinstance(got, Forward):  # its own: made now, the turn goes on from it
                    logits = lanes.own_forward(lane, got, self.model)
                    continue
            except Exception as exc:
                got = self._failed(lane, exc)
            except BaseException:  # interrupted (Ctrl-C): it stops here, keeping what it computed
                self.cancel(rid)
                raise
            go = self._sched.advanced(rid, lanes.step_of(got))  # ended: forgotten, then Done
            if lane.kind is LaneKind.REQUEST and isinstance(got, Event):
                events.append(got)  # background work produces no events
        return events

    def _batch_turn(self, rows: Sequence[int]) -> list[Event]:
        """The decode batch's forward, its one model call, then each row's turn on from its
        logits. A failed call fails each row alone."""
        try:
            logits = self._batch.forward(self.model)
        except Exception as exc:  # each lane fails alone, as its own call would
            failed = [self._failed(self._sched[rid], exc) for rid in rows]
            for rid in rows:
                self._sched.advanced(rid, Step.ENDED)
            return [done for done in failed if done is not None]
        events = []
        for rid, out in zip(rows, logits, strict=True):
            self._sched.forwarded(rid)
            events += self._turn(rid, out)
        return events

    def _failed(self, lane: Lane, exc: Exception) -> Done | None:
        """A lane's step or call failed: it ends alone (closed, keeping what it computed),
        a request with an error `Done`, a warm or follow lane with a warning. A sharded run
        is out of step (the others did not fail)."""
        if self.ranks is not None:
            raise self.ranks.lost(exc) from exc
        lane.stop()
        if lane.kind is LaneKind.REQUEST:
            return Done(lane.rid, Result("", [], "error", Stats(), error=str(exc)))
        self._warn(f"warm-ahead stopped early: {type(exc).__name__}: {exc}")
        return None

    def run(self, warm: bool = False) -> Iterator[Event]:
        """Advance the lanes until every request (`warm`: every lane) is done."""
        while self.busy or (warm and self.warming):
            yield from self.step()
        self.release_memory()

    def generate(self, request: Request) -> Iterator[Event]:
        """Run one request alone and yield its events: its lane is queued like any other
        (`submit`) and `solo`, and takes every turn until it ends (its follow lane runs
        later, with `step`). Closing the iterator early (Ctrl-C) cancels the request. A
        failed request raises GenerationError (`run` ends it with an error `Done`)."""
        rid = self.submit(request)
        self._sched[rid].solo = True  # every forward its own, none the batch's
        try:
            while rid in self._sched:
                turn = self._turn(rid) if self.ranks is None else self._whole_turn(rid)
                for event in turn:
                    if isinstance(event, Done) and event.result.error is not None:
                        raise GenerationError(event.result.error)
                    yield event
        finally:
            self.cancel(rid)
            self.release_memory()

    @told
    def _whole_turn(self, rid: int) -> list[Event]:
        """`generate`'s turn in a sharded run: made whole, as the other ranks make it (a
        follower's lane is `solo` by this call, as rank 0's is by `generate`)."""
        self._sched[rid].solo = True
        return self._turn(rid)

    @told
    def cancel(self, rid: int) -> None:
        """Stop a lane now (its pin released; the full blocks a prefill computed kept), a
        request's follow lane with it. Unknown or ended ids: nothing."""
        for _r, lane in self._sched.cancel(rid):
            lane.stop()

    @told
    def cancel_warm(self) -> None:
        """Stop every background lane: warm-ahead and follow lanes (each keeps the full
        blocks it has computed). Requests, and so a running reply, go on unfollowed."""
        for rid, _lane in self._sched.lanes(*BACKGROUND):
            self.cancel(rid)

    def complete(self, request: Request, on_event: Callable[[Event], None] | None = None) -> Result:
        """Run one request to the end and return its result; `on_event` sees every event
        (e.g. prefill progress). Raises GenerationError: the request failed."""
        return final_result(self.generate(request), on_event)
