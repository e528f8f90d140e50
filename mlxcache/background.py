"""The background lanes, which keep KV for later requests: warm-ahead (`WarmLane`) and a
followed request's follow lane (`FollowLane`). Each prefills canonical chunks
(`prefilling.Prefilling`), one a turn, and produces no events."""

from __future__ import annotations

from typing import cast

import mlx.core as mx
import numpy as np

from mlxcache.cache.base import Lease
from mlxcache.errors import MemoryLimitError
from mlxcache.lanes import Follow, Got, Lane, Work
from mlxcache.prefilling import LeasedLane, Prefilling
from mlxcache.scheduler import LaneKind, Step


def follow(work: Work, rid: int, tokens: np.ndarray, f: Follow) -> Lane:
    """The follow lane of a request of prompt `tokens` (`FollowLane`)."""
    return FollowLane(work, rid, tokens, f)


def warm(work: Work, rid: int, tokens: np.ndarray) -> Lane:
    """A warm-ahead lane that prefills `tokens` (`WarmLane`)."""
    return WarmLane(work, rid, tokens)


class WarmLane(LeasedLane):
    """Warm-ahead: prefill every full block of `tokens` and keep them. No logits are
    needed, and it is no request: not counted. Where decode KV is canonical, it resumes
    from the reply's own tail (only the next turn's new tokens are prefilled), and the
    turn it warms continues from its layers."""

    def __init__(self, work: Work, rid: int, tokens: np.ndarray) -> None:
        super().__init__(work, rid, tokens, LaneKind.WARM)

    def step(self, logits: mx.array | None) -> Got:
        work, tokens = self.work, self.tokens
        if self.lease is None:
            dmp = work.decode_matches_prefill
            whole = work.cache.cached_length(tokens, True, dmp) == len(tokens)
            if whole or not _room_now(work, self.rid, len(tokens)):
                self.close()  # nothing to compute: the layers that hold it (live ones too) stay
                return None
            self.lease = work.cache.restore(
                tokens, count=False, decode_matches_prefill=dmp, whole=True
            )
            if self.lease.length < len(tokens):
                self.prefilling = self._prefilling(self.lease)
        p = self.prefilling
        if p is not None and p.asked:
            p.took(self.rid)
            return Step.CHUNK
        if p is not None and not p.finished:
            return p.chunk()
        if work.decode_matches_prefill:  # the turn it warms continues from these layers
            self.lease.keep_live(tokens)
        self.close()
        return None

    def _prefilling(self, lease: Lease) -> Prefilling:
        return Prefilling.of(self.work, lease, self.tokens, lease.length, len(self.tokens))


def _room_now(work: Work, rid: int, n: int) -> bool:
    """Whether the memory budget (if any) takes background work of `n` tokens now: it is
    only ever a head start, so it never waits for room."""
    try:
        return work.budget is None or work.budget.admit(rid, n, 0, work.cache)
    except MemoryLimitError:
        return False


class FollowLane(LeasedLane):
    """A followed request's follow lane: prefill each block of prompt + reply as the reply
    completes it (stepped only when a block is complete or the request has ended), one
    chunk a turn, and keep it."""

    def __init__(self, work: Work, rid: int, tokens: np.ndarray, f: Follow) -> None:
        super().__init__(work, rid, tokens, LaneKind.FOLLOW)
        self.follow = f

    @property
    def f(self) -> Follow:
        """Its follow state (`Lane.follow`, which a follow lane always has)."""
        return cast(Follow, self.follow)

    def step(self, logits: mx.array | None) -> Got:
        work, f = self.work, self.f
        if self.prefilling is not None:  # its chunk's forward was made
            f.done = self.prefilling.took(self.rid).done
            self.prefilling = None
            return Step.CHUNK
        while (target := f.ready()) > f.done or not f.closed:
            if target <= f.done:
                return Step.WAIT  # nothing yet (what it found was kept): wait for the reply
            ids = f.tokens()[:target]
            # Blocks kept already (the same conversation before) are skipped, and the
            # layers held so far with them: a later miss restores from there.
            if (kept := work.cache.cached_length(ids, whole=True)) > f.done:
                f.done = kept
                self.release()
                continue
            if self.lease is None:
                self.lease = work.cache.restore(ids[: f.done], count=False, whole=True)
                f.done = self.lease.length
            self.prefilling = self._prefilling(self.lease, ids, target)
            return self.prefilling.chunk()
        self.close()
        return None

    def _prefilling(self, lease: Lease, ids: np.ndarray, target: int) -> Prefilling:
        stop = min(target, self.f.done + self.f.block)  # one chunk (a block) a turn
        return Prefilling.of(self.work, lease, ids[:stop], self.f.done, stop)
