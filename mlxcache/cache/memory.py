"""The memory tier: kept prompts as MLX arrays, the index over them, and their eviction.

Models whose layers are plain KV, sliding-window or recurrent ("trimmable": they resume
at any block boundary) store blocks of B tokens keyed by chained hashes (`layout.Layout`
says what a block holds), shared between entries with a reference count, so entries sharing
a prefix share its blocks and memory follows unique tokens. A block that only exists right
after its prefill chunk (a sliding window's keys, a recurrent state) is captured then
(`capture`) and stored when the lane keeps its prompt. Models with other cache kinds store
one whole-state checkpoint per entry, taken at a block boundary, and their entries are
non-trimmable.

The tier also remembers the tails of the last few whole prompts of a trimmable model
(`tails.Tails`): the KV past the last full block and the last token's logits, as the
prompt's own last prefill chunk computed them. The same prompt again (a retry, a regression
run, a repeated API call) then resumes whole, with nothing to prefill; that state is
exactly what a fresh prefill computes, since the chunk's input (the canonical KV of the full
blocks and the same tokens) is the same. Where the engine has measured decode KV canonical,
a finished reply's own tail is kept too (without logits), and a prompt may resume inside a
block from a kept block or a tail that follows it (`partial`).

Eviction (`reserve`, `make_room`) follows the index's victim order within the tier's two
limits, a slot count and a byte budget. `store.PromptCache` coordinates this tier with the
disk tier.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import numpy as np

from mlxcache.cache import blocks as kv
from mlxcache.cache.base import CacheStats, Keeper, Lease, with_probe
from mlxcache.cache.disk import digest_tokens
from mlxcache.cache.index import Entry, Match, PromptIndex
from mlxcache.cache.layout import Block, Layout
from mlxcache.cache.layout import nbytes as block_nbytes
from mlxcache.cache.radix import common_prefix
from mlxcache.cache.tails import Tail, Tails
from mlxcache.config import CacheConfig
from mlxcache.types import LayerCache, Layers

EXTRA_STATE_SHARE = 8
"""Recurrent states kept between two strides, in memory only, take at most this fraction
(1/8) of the memory budget: the newest first, dropped before any entry is evicted."""


@dataclass(slots=True)
class _Block:
    data: Block
    refs: int = 0

    @property
    def nbytes(self) -> int:
        return block_nbytes(self.data)


@dataclass(slots=True)
class Kept:
    """What `MemoryTier.keep` stored: the entry, its tokens, and its state (the blocks by
    name, in the entry's order, or its whole-state checkpoint), for the disk tier."""

    entry: Entry
    tokens: np.ndarray
    blocks: dict[str, Block] = field(default_factory=dict)
    checkpoint: list[Any] | None = None


class MemoryTier:
    """The memory tier of one model's prompt cache.

    Args:
        layout: what a block holds (`Layout.of` the model's caches); None: checkpoints.
        ns: the namespace the block names are chained under (`blocks.namespace`).
        config: block size, byte budget (`mem_bytes`), slot limit (`max_entries`), state stride.
        stats: the cache's counters; evictions are counted in `evictions_mem`.
    """

    def __init__(
        self, layout: Layout | None, ns: str, config: CacheConfig, stats: CacheStats
    ) -> None:
        self.layout = layout
        self.ns = ns
        self.block_size = config.block_size
        self.budget = config.mem_bytes
        self.max_entries = config.max_entries
        self.index = PromptIndex(config.block_size)
        self._nbytes = 0  # blocks and checkpoints; the tails count their own
        self.token_bytes = 0  # KV bytes per token, learned from the first block kept
        self._stats = stats
        self._blocks: dict[str, _Block] = {}
        self._entry_blocks: dict[Entry, list[str]] = {}
        self._checkpoints: dict[Entry, list[Any]] = {}
        self._tails = Tails()
        # Blocks a lane captured are staged on its lease (`Lease.staged`) until it keeps
        # them; outside the budget, like the lanes' own layers.
        self._stride = config.state_stride
        # States between strides: kept in memory only (never written to disk), oldest
        # first, within `extra_budget` (a lease's staged extras, `Lease.extras`, too).
        self._extra: OrderedDict[str, None] = OrderedDict()
        self.extra_budget = config.mem_bytes // EXTRA_STATE_SHARE

    # -- views ----------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self.index)

    def __iter__(self) -> Iterator[Entry]:
        """The entries, oldest first (a snapshot)."""
        return iter(self.index)

    @property
    def nbytes(self) -> int:
        """The bytes kept: blocks, checkpoints and tails."""
        return self._nbytes + self._tails.nbytes

    @property
    def tails(self) -> int:
        """How many whole prompts' tails are remembered."""
        return len(self._tails)

    def pinned(self) -> int:
        """Entries in use by running requests."""
        return sum(1 for e in self.index if e.pins)

    def has_block(self, name: str) -> bool:
        """Whether the block (or recurrent state) `name` is held."""
        return name in self._blocks

    # -- lookup and resume ------------------------------------------------------------------

    def lookup(self, tokens: np.ndarray) -> Match | None:
        """The entry restoring the most of `tokens` (counted as a use)."""
        return self.index.lookup(tokens)

    def tail(self, tokens: np.ndarray) -> Tail | None:
        """The remembered tail of exactly `tokens`, with its logits, if any."""
        return self._tails.whole(digest_tokens(tokens)) if len(self._tails) else None

    def partial(self, tokens: np.ndarray, length: int, limit: int) -> tuple[Block, int] | None:
        """The KV of `tokens[length:length+k]` (0 < k <= `limit`, k < B) where a kept block
        or a remembered tail continues `tokens`' first `length` tokens (whole blocks):
        what a device on which a token's KV does not depend on its chunk may resume
        mid-block from. The longest such run; None if none. Attention layers keep KV per
        position, so any run of a block or tail will do; a recurrent state is known only at
        a tail's end, so with recurrent layers only a whole tail does."""
        found = self._continuation(tokens, length, limit)
        if found is None:
            return None
        assert self.layout is not None  # only a block layout continues
        block, k = found
        return (block if self.layout.has_state else self.layout.head(block, k)), k

    def continues(self, tokens: np.ndarray, length: int, limit: int) -> int:
        """How many tokens `partial` would give (0: none), without cutting them."""
        found = self._continuation(tokens, length, limit)
        return 0 if found is None else found[1]

    def _continuation(
        self, tokens: np.ndarray, length: int, limit: int
    ) -> tuple[Block, int] | None:
        """The kept block or tail `partial` continues from, whole, and how many of its
        tokens it gives."""
        if self.layout is None or limit <= 0:
            return None
        per_position = not self.layout.has_state
        best: tuple[Block, int] | None = None
        found = self.index.continuation(tokens, length) if per_position else None
        if found is not None:
            entry, k = found
            best = (self._blocks[self._entry_blocks[entry][length // self.block_size]].data, k)
        prefix = None
        for tail in self._tails:
            if tail.prefix and len(tail.ids) and (best is None or len(tail.ids) > best[1]):
                prefix = prefix or digest_tokens(tokens[:length])
                if tail.prefix == prefix:
                    k = common_prefix(tail.ids, tokens[length:])
                    whole = k == len(tail.ids) <= limit
                    if k and (per_position or whole) and (best is None or k > best[1]):
                        best = (tail.kv, k)
        if best is None:
            return None
        return best[0], min(best[1], limit)  # a whole tail is within the limit already

    def resumable(self, entry: Entry, length: int) -> int:
        """The longest resume point up to `length` in `entry` whose recurrent state is kept
        (`length` itself for models without recurrent layers)."""
        if self.layout is None or not self.layout.has_state:
            return length
        names = self._entry_blocks.get(entry, [])
        for j in range(length // self.block_size - 1, -1, -1):
            if state_name(names[j]) in self._blocks:
                return (j + 1) * self.block_size
        return 0

    def resume(
        self,
        keeper: Keeper,
        entry: Entry,
        length: int,
        shared: int,
        tokens: np.ndarray,
        tail: Tail | None,
    ) -> Lease:
        """A lease (of `keeper`) on fresh layers holding `entry`'s first `length` tokens,
        the entry pinned, room made for the rest of `tokens`; with `tail` (of `tokens`,
        whose full blocks these are) the whole prompt and its logits. `shared`: how far
        `tokens` follow the entry."""
        layers = self._layers(entry, length)  # before the pin: if this fails, none is left
        if tail is None:  # after: room made may drop the state between strides it starts from
            self.reserve_prefill(tokens, length, entry)
        # Where this prompt leaves the entry: its state is kept there (computed if this
        # resume starts before it; made a kept state, on disk too, if it is an extra).
        branch = shared // self.block_size - 1
        logits = None
        if tail is not None:
            # Tails are kept for block layouts only; `tail()` gives those with logits.
            assert self.layout is not None and tail.logits is not None
            self.layout.append(layers, tail.kv)
            self._tails.used(tail)
            # A copy: logits processors (the repetition penalty) write into their input.
            length, logits = len(tokens), mx.array(tail.logits)
        self.index.pin(entry)
        return Lease(keeper, layers, length, entry, logits, branch=branch)

    def release(self, lease: Lease) -> None:
        """Unpin `lease`'s entry; forget what its lane captured and did not keep (at once:
        a lane may hold its lease a while longer)."""
        lease.staged.clear()
        lease.extras.clear()
        if lease.entry is not None and lease.entry in self.index:
            self.index.unpin(lease.entry)

    def _layers(self, entry: Entry, length: int) -> list[LayerCache]:
        if entry in self._checkpoints:
            return kv.from_snapshot(self._checkpoints[entry])
        assert self.layout is not None  # an entry of blocks: the model has a layout
        names = self._entry_blocks[entry][: length // self.block_size]
        state = self._blocks.get(state_name(names[-1]))
        blocks = [self._blocks[h].data for h in names]
        return self.layout.join(blocks, self.block_size, state.data if state else None)

    # -- keeping ------------------------------------------------------------------------------

    def capture(self, n: int, lease: Lease) -> None:
        """Note the block of the lease's layers that ends at `n` (right after the chunk or
        step that completed it: `Lease.capture`) when the layout cannot cut it later;
        `keep` of this lease stores it."""
        if self.layout is None or not self.layout.needs_capture:
            return
        j = n // self.block_size - 1
        start = j * self.block_size
        staged = lease.staged
        staged[j] = self.layout.cut(lease.layers, start, n)
        # The block before is no longer the last: unless `keep` keeps its state on disk too
        # (`_fresh_blocks`), it is an extra, staged within the extras' budget; past it the
        # oldest staged extra lets go of its state (else a long prefill of a large-state
        # hybrid would hold one state per block: gigabytes on a real Qwen3-Next).
        before = staged.get(j - 1)
        if before is not None and j - 1 != lease.branch:
            blocks, state = self.layout.split(before)
            if state and not self._keeps_state(j - 1, state, blocks):
                extras = lease.extras
                extras.append(j - 1)
                # A model's states all have one size.
                while extras and len(extras) * block_nbytes(state) > self.extra_budget:
                    k = extras.popleft()
                    if k in staged:
                        staged[k] = self.layout.split(staged[k])[0]

    def keep(self, tokens: np.ndarray, lease: Lease) -> Kept | None:
        """Store the first len(tokens) positions of the lease's layers (int32 `tokens`) as
        an entry, after freeing a slot; None when not even its first block can be stored."""
        self.make_room(tokens)
        if self.layout is None:
            checkpoint = kv.snapshot(lease.layers)
            return Kept(self.add_checkpoint(tokens, checkpoint), tokens, checkpoint=checkpoint)
        names, fresh, extras = self._fresh_blocks(tokens, lease)
        if not names:
            return None
        tokens = self._whole_blocks(tokens, names)
        entry = self.add_blocks(tokens, names, fresh)
        self._extra.update(dict.fromkeys(extras))
        while sum(self._blocks[n].nbytes for n in self._extra) > self.extra_budget:
            self._drop_extra(next(iter(self._extra)))
        # Extras stay in memory: the disk tier keeps the strided states only.
        stored = {h: self._blocks[h].data for h in names if h not in self._extra}
        return Kept(entry, tokens, stored)

    def _fresh_blocks(
        self, tokens: np.ndarray, lease: Lease
    ) -> tuple[list[str], dict[str, Block], list[str]]:
        """The names an entry of `tokens` holds (its blocks, then the recurrent states it
        keeps), the blocks among them not stored yet (captured ones, or cut out of
        the lease's layers: plain KV), and the fresh states among them that are extras. It stops
        before the first block that is neither stored nor captured. States are kept after
        every `stride`-th block, after the last, and after the block where this prompt
        left the entry it resumed from (had it a state there, it would have resumed
        there: the next prompt that shares as much will); the others captured are extras
        (memory only). An extra that one of those positions now needs stops being one."""
        assert self.layout is not None
        b, layout = self.block_size, self.layout
        names = kv.chain_hashes(tokens, b, self.ns)
        staged, branch, layers = lease.staged, lease.branch, lease.layers
        n = next(
            (j for j, h in enumerate(names) if h not in self._blocks and j not in staged),
            len(names),
        )
        if not layout.needs_capture:  # (quantized) plain KV: cut out of any state
            n = len(names)
        fresh: dict[str, Block] = {}
        states: list[str] = []
        extras: list[str] = []
        for j, h in enumerate(names[:n]):
            piece = staged.pop(j, None)
            if piece is None and h not in self._blocks:
                piece = layout.cut(layers, j * b, (j + 1) * b)
            blocks, state = layout.split(piece) if piece is not None else ({}, {})
            if h not in self._blocks:
                fresh[h] = blocks
            if not layout.has_state:
                continue
            name = state_name(h)
            kept = j in (n - 1, branch) or (bool(state) and self._keeps_state(j, state, blocks))
            if name not in self._blocks and state:
                fresh[name] = state
                if not kept:
                    extras.append(name)
            elif kept:
                self._extra.pop(name, None)
            if name in self._blocks or name in fresh:
                states.append(name)
        return names[:n] + states, fresh, extras

    def _whole_blocks(self, tokens: np.ndarray, names: list[str]) -> np.ndarray:
        """The tokens of the blocks among `names`: what an entry of them holds."""
        return tokens[: sum(not is_state(h) for h in names) * self.block_size]

    def _keeps_state(self, j: int, state: Block, blocks: Block) -> bool:
        """Whether block j keeps its recurrent state (on disk too): every `stride`-th one.
        The stride is set, or measured the first time: strided states may cost a quarter of
        what the blocks' attention arrays cost, so that with a prompt's last state a kept
        prompt stays within 1.5x its KV (a state per block can outweigh a hybrid's KV
        many times). States between strides are memory's extras."""
        if self._stride is None:
            kv_bytes = block_nbytes(blocks) or 1
            self._stride = max(1, -(-4 * block_nbytes(state) // kv_bytes))
        return (j + 1) % self._stride == 0

    def add_checkpoint(self, tokens: np.ndarray, checkpoint: list[Any]) -> Entry:
        """Add an entry backed by a whole-state checkpoint."""
        entry = self.index.add(tokens, trimmable=False, nbytes=kv.state_nbytes(checkpoint))
        if entry not in self._checkpoints:
            self._checkpoints[entry] = checkpoint
            self._nbytes += entry.nbytes
        return entry

    def add_blocks(self, tokens: np.ndarray, names: list[str], fresh: dict[str, Block]) -> Entry:
        """Add an entry backed by blocks `names`; `fresh` holds those not stored yet."""
        mx.eval([list(block.values()) for block in fresh.values()])  # see `keep_tail`
        added = 0
        for h, block in fresh.items():
            self._blocks[h] = _Block(block)
            added += self._blocks[h].nbytes
            if not is_state(h):
                self.token_bytes = self._blocks[h].nbytes // self.block_size
        entry = self.index.add(tokens, trimmable=True, nbytes=added)
        if entry not in self._entry_blocks:
            self._entry_blocks[entry] = names
            for h in names:
                self._blocks[h].refs += 1
        self._nbytes += added
        return entry

    def keep_tail(self, tokens: np.ndarray, layers: Layers, logits: mx.array | None) -> bool:
        """Remember `tokens`' tail in `layers` (past its last full block) and its logits
        (None: a reply's tail, for `partial` only); False when there is none to keep (no
        block layout, its blocks are gone, or nothing past them without logits)."""
        at = len(tokens) // self.block_size * self.block_size
        if self.layout is None or at == 0 or (logits is None and at == len(tokens)):
            return False  # a checkpoint holds the whole state; no block to continue
        found = self.index.lookup(with_probe(tokens[:at]))
        if found is None or found.length < at:
            return False  # its blocks are gone already (memory too small)
        tail = self.layout.cut(layers, at, len(tokens))
        if logits is not None:
            logits = mx.array(logits)
        # Evaluated now: a lazy cut keeps the whole arrays it reads alive (after a batched
        # decode, every row's KV), far more than the tail's own bytes, counted in the budget.
        mx.eval(list(tail.values()), logits)
        ids = np.array(tokens[at:], dtype=np.int32)
        prefix = digest_tokens(tokens[:at])
        self._tails.add(Tail(digest_tokens(tokens), found.entry, tail, logits, prefix, ids))
        return True

    # -- eviction ---------------------------------------------------------------------------

    def make_room(self, tokens: np.ndarray) -> None:
        """Free a slot before adding (before cutting blocks: eviction may free shared ones)."""
        while len(self.index) >= self.max_entries:
            if not self._evict(self.index.victim(prompt=tokens)):
                break

    def reserve_prefill(self, tokens: np.ndarray, start: int, skip: Entry | None) -> None:
        """Make room for prefilling `tokens[start:]` (their KV, at the bytes per token learned)."""
        self.reserve(self.token_bytes * (len(tokens) - start), skip, tokens)

    def reserve(
        self, n_bytes: int, skip: Entry | None = None, prompt: np.ndarray | None = None
    ) -> None:
        """Evict until `n_bytes` more fit the budget; stops when all that is left is pinned
        (or `skip`).

        Remembered tails go first (the oldest first), then states between strides (the
        oldest first), then entries in the victim order.
        """
        self._evict_to(self.budget - n_bytes, skip, prompt)

    def shed(self, n_bytes: int) -> int:
        """Evict (in `reserve`'s order) until `n_bytes` are freed or only pinned entries
        are left; returns the bytes freed."""
        before = self.nbytes
        self._evict_to(before - n_bytes)
        return before - self.nbytes

    def _evict_to(
        self, n_bytes: int, skip: Entry | None = None, prompt: np.ndarray | None = None
    ) -> None:
        while self.nbytes > n_bytes:
            if self._tails.drop_oldest():
                continue
            if self._extra:
                self._drop_extra(next(iter(self._extra)))
            elif not self._evict(self.index.victim(skip=skip, prompt=prompt)):
                break

    def _evict(self, entry: Entry | None) -> bool:
        """Remove one entry and the blocks only it used. False when there is none."""
        if entry is None:
            return False
        self.index.remove(entry)
        self._stats.evictions_mem += 1
        self._tails.drop_of(entry)
        if entry in self._checkpoints:
            del self._checkpoints[entry]
            self._nbytes -= entry.nbytes
            return True
        for h in self._entry_blocks.pop(entry):
            block = self._blocks[h]
            block.refs -= 1
            if block.refs == 0:
                del self._blocks[h]
                self._nbytes -= block.nbytes
                self._extra.pop(h, None)
        return True

    def _drop_extra(self, name: str) -> None:
        """Forget a state between strides: its entries resume at an earlier kept state."""
        del self._extra[name]
        block = self._blocks.pop(name)
        self._nbytes -= block.nbytes
        for names in self._entry_blocks.values():
            if name in names:
                names.remove(name)


def state_name(block: str) -> str:
    """The name of the recurrent state kept after block `block`."""
    return f"{block}.s"


def is_state(name: str) -> bool:
    return name.endswith(".s")
