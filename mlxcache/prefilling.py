"""A prompt's prefill as data (`Prefilling`): its canonical chunks (`prefill.chunks_for`),
one forward each, asked of the engine one at a time; the blocks each completes captured,
and the prompt kept where its lane says. Every lane kind prefills so, through a cache
lease (`LeasedLane`)."""

from __future__ import annotations

import contextlib
from collections import deque
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from mlxcache.cache.base import Lease
from mlxcache.decode import Forward
from mlxcache.events import Prefill
from mlxcache.lanes import Lane, Work
from mlxcache.prefill import chunks_for
from mlxcache.scheduler import LaneKind, TurnKind


@dataclass(slots=True)
class Prefilling:
    """A prompt's prefill as data: `tokens[start:]` go into the lease's layers in canonical
    `chunks` (`prefill.chunks_for`), one forward each, the first asked for next (`asked`:
    it is out); `tokens[:done]` are in them (exactly those while no chunk is out),
    `tokens[:keep_at]` are kept once reached, `kept`: how far."""

    lease: Lease
    tokens: np.ndarray
    block: int
    start: int
    keep_at: int
    done: int
    kept: int
    chunks: deque[tuple[int, int]]
    asked: bool = False

    @classmethod
    def of(
        cls, work: Work, lease: Lease, tokens: np.ndarray, start: int, keep_at: int
    ) -> Prefilling:
        """Prefill tokens[start:] into the lease's layers and keep tokens[:keep_at] (a resume
        inside a block only where decode KV is canonical: see `restore`)."""
        block = work.cache.block_size
        chunks = chunks_for(lease.layers, len(tokens), start, block, work.decode_matches_prefill)
        return cls(lease, tokens, block, start, keep_at, start, start, deque(chunks))

    @property
    def finished(self) -> bool:
        return not self.chunks

    def chunk(self) -> Forward:
        """The next chunk's forward (the prompt's last one wants its logits)."""
        start, stop = self.chunks[0]
        self.asked = True  # its layers change
        x = mx.array(self.tokens[start:stop])
        return Forward(TurnKind.PREFILL, x, self.lease.layers, logits=stop == len(self.tokens))

    def took(self, rid: int) -> Prefill:
        """The chunk asked for is in the layers: its progress event."""
        _, stop = self.chunks.popleft()
        self.asked = False
        self.reached(stop)
        return Prefill(rid, stop, len(self.tokens), self.start)

    def reached(self, stop: int) -> None:
        """A chunk ended at `stop`: every block it completed is captured (a merged chunk
        completes several), and the prompt is kept at `keep_at` (tried once: not again
        while unwinding if it fails)."""
        first = self.done // self.block * self.block + self.block
        self.done = stop
        for end in range(first, min(stop, self.keep_at) + 1, self.block):
            self.lease.capture(end)
        if self.kept < self.keep_at <= stop:  # a merged chunk may pass it
            self.kept = self.keep_at
            self.lease.keep(self.tokens[: self.keep_at])

    def stopped(self, trimmable: bool) -> None:
        """Cancelled between chunks or stopped inside one (an error, Ctrl-C): what is fully
        computed is canonical KV, kept. A trimmable cache cuts it out of any state; a
        whole-state checkpoint needs the layers to hold exactly `done` tokens: no chunk out,
        none stopped inside."""
        usable = self.done % self.block == 0 and (trimmable or not self.asked)
        if self.done > self.kept and usable:
            # Best effort while unwinding: a failed keep must not replace what stopped
            # the lane (a cancel, Ctrl-C) nor fail the request that pre-empted it.
            with contextlib.suppress(Exception):
                self.lease.keep(self.tokens[: self.done])


class LeasedLane(Lane):
    """A lane that prefills into the layers of a cache lease (`lease`, once it has one;
    `prefilling`, while it prefills), over its `work`. Closed, it keeps the full blocks its
    prefill computed and releases its lease and its room in the memory budget."""

    def __init__(self, work: Work, rid: int, tokens: np.ndarray, kind: LaneKind) -> None:
        super().__init__(rid, tokens, kind)
        self.work = work
        self.lease: Lease | None = None
        self.prefilling: Prefilling | None = None
        self.closed = False

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            if self.prefilling is not None:
                self.prefilling.stopped(self.work.cache.trimmable)
        finally:
            self.release()
            if self.work.budget is not None:
                self.work.budget.release(self.rid)

    def release(self) -> None:
        """Its lease released (a lane may take another later)."""
        if self.lease is not None:
            self.lease.release()
            self.lease = None
