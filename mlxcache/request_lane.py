"""A request's lane (`RequestLane`): wait for memory, restore the longest cached prefix,
prefill the rest (`prefilling.Prefilling`), draw the reply (`decode.Reply`), keep what the
device allows, and end with its `Done`."""

from __future__ import annotations

import time
from typing import cast

import mlx.core as mx
import numpy as np

from mlxcache.cache.base import Lease, NoCache
from mlxcache.decode import Ask, Capture, Origin, Reply, Way
from mlxcache.drafting import Plan
from mlxcache.errors import GenerationError
from mlxcache.events import Done, Result, Stats
from mlxcache.lanes import Follow, Got, Lane, Work
from mlxcache.model.kvquant import kv_width
from mlxcache.prefilling import LeasedLane, Prefilling
from mlxcache.request import Request
from mlxcache.scheduler import LaneKind, Step
from mlxcache.types import positions


def request(
    work: Work, rid: int, tokens: np.ndarray, req: Request, follow: Follow | None, plan: Plan | None
) -> Lane:
    """A request's lane (`RequestLane`): past its first token it decodes in the batch
    where the engine batches (`Work.batch_decode`), but for a drafted request whose verify
    forwards cannot be rows of it (`Plan.batched`)."""
    solo = not work.batch_decode or bool(plan and not plan.batched)
    return RequestLane(work, rid, tokens, req, follow, plan, solo)


class RequestLane(LeasedLane):
    """A request: wait for memory, restore the longest cached prefix, prefill the rest
    (`Prefilling`), then draw the reply (`decode.Reply`) and keep what the device allows;
    its last step gives its `Done`, after its lease is released."""

    def __init__(
        self,
        work: Work,
        rid: int,
        tokens: np.ndarray,
        req: Request,
        followed: Follow | None,
        plan: Plan | None,
        solo: bool,
    ) -> None:
        super().__init__(work, rid, tokens, LaneKind.REQUEST)
        self.solo = solo
        self.req, self.followed, self.plan = req, followed, plan
        self.stats = Stats(prompt_tokens=int(tokens.size), kv=kv_width(work.loaded))
        self.start = time.perf_counter()
        self.logits: mx.array | None = None  # the prompt's last, once prefilled
        self.reply: Reply | None = None

    @property
    def verifies(self) -> bool:
        return self.reply is not None and self.reply.verifies

    def step(self, logits: mx.array | None) -> Got:
        try:
            return self._step(logits)
        except GenerationError as exc:
            # This request fails alone: the lanes beside it go on.
            return self._end(Result("", [], "error", self.stats, error=str(exc)))

    def _step(self, logits: mx.array | None) -> Got:
        work = self.work
        if self.lease is None:
            n = int(self.tokens.size)
            if work.budget and not work.budget.admit(
                self.rid, n, self.req.sampling.max_tokens, work.cache
            ):
                return Step.WAIT  # running requests hold the room: a turn without work
            self._restore()
        if (p := self.prefilling) is not None:
            if not p.asked:
                return p.chunk()
            event = p.took(self.rid)
            self.left = event.total - event.done
            if p.finished:
                self.prefilling, self.logits = None, logits
            return event
        if self.reply is None:
            self.reply = self._reply()
        got = self.reply.step(logits)
        if isinstance(got, Result):
            return self._finish(got)
        return got

    def _restore(self) -> None:
        """Look the prompt up: resume the longest cached prefix, prefill the rest."""
        work, tokens, stats = self.work, self.tokens, self.stats
        n = int(tokens.size)
        lease = work.cache.restore(tokens, decode_matches_prefill=work.decode_matches_prefill)
        self.lease = lease
        stats.cached_tokens = lease.length
        stats.prefilled_tokens = n - lease.length
        stats.miss_reason = "" if lease.length else miss_reason(work, n)
        stats.cached_from = lease.tier
        stats.restore_s = time.perf_counter() - self.start
        block = work.cache.block_size
        # Trimmable KV is kept after the prompt's last full block; a whole-state
        # checkpoint (recurrent / rotating layers) must be taken at the last boundary
        # before the end, so that the same prompt can resume from it.
        keep_at = (n // block if work.cache.trimmable else (n - 1) // block) * block
        if lease.logits is not None:  # this very prompt again: nothing to prefill
            self.logits = lease.logits
        else:
            self.prefilling = Prefilling.of(work, lease, tokens, lease.length, keep_at)

    def _reply(self) -> Reply:
        """The reply, from the prompt's last logits (kept with its tail when prefilled)."""
        work, lease, plan = self.work, cast(Lease, self.lease), self.plan
        if lease.logits is None:
            lease.keep_tail(self.tokens, self.logits)
        self.stats.draft = "" if plan is None else plan.kind
        return Reply.of(
            work.loaded.tokenizer,
            self.rid,
            self.tokens,
            ask_of(work, self.req, self.tokens),
            way_of(work, plan, Capture(work.cache.block_size, lease.capture)),
            self.stats,
            Origin(lease.layers, self, cast(mx.array, self.logits), self.start),
            None if self.followed is None else self.followed.reply,
        )

    def _finish(self, result: Result) -> Done:
        """The reply has ended, its KV all in the layers: kept where it is canonical."""
        if self.work.decode_matches_prefill:
            ended = [] if result.stop_token is None else [result.stop_token]
            keep_reply(self.work, self.tokens, [*result.tokens, *ended], cast(Lease, self.lease))
        return self._end(result)

    def _end(self, result: Result) -> Done:
        self.stop()  # out of the decode batch too, where it failed as a row of it
        return Done(self.rid, result)  # after the release: a finished request holds no pin

    def close(self) -> None:
        try:
            if self.reply is not None and not self.closed:
                self.reply.close()
        finally:
            super().close()
            if self.followed is not None:  # however the request ended: its follow lane may finish
                self.followed.closed = True


def miss_reason(work: Work, n: int) -> str:
    """Why a request of n tokens resumed nothing."""
    if isinstance(work.cache, NoCache):
        return "cache off"
    if n <= work.cache.block_size:
        return f"shorter than one block of {work.cache.block_size} tokens"
    return "no cached prefix"


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
    are its own or rows of the decode batch is the scheduler's (`Scheduler.advanced`)."""
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
