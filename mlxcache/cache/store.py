"""The prompt cache: the coordinator of a memory tier and a disk tier.

The memory tier (`memory.MemoryTier`) holds blocks or checkpoints as MLX arrays, the
remembered tails of whole prompts, its index and its eviction. The disk tier is a
`disk.DiskTier` (shared with other processes) and a `PromptIndex` of its rows, kept here.
`PromptCache` looks a prompt up in both, promotes a disk hit into memory, writes what memory
keeps through to disk, keeps both tiers within their budgets (`_fit`, after every insert),
drops the disk tier on its errors, and counts.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from mlxcache.cache import blocks as kv
from mlxcache.cache.base import CacheStats, Lease, with_probe
from mlxcache.cache.disk import (
    DiskTier,
    Writer,
    block_writer,
    checkpoint_writer,
    digest_tokens,
    index_error,
)
from mlxcache.cache.index import Entry, Match, PromptIndex
from mlxcache.cache.layout import Layout, kv_tag
from mlxcache.cache.layout import nbytes as block_nbytes
from mlxcache.cache.live import Live
from mlxcache.cache.memory import Kept, MemoryTier, state_name
from mlxcache.config import CacheConfig
from mlxcache.errors import CacheStoreError, CorruptCacheFileError
from mlxcache.types import Model, new_layers

# What the disk tier can raise that means "go on without it" (a corrupt file is handled apart).
_DISK_ERRORS = (sqlite3.Error, OSError, CacheStoreError)


def _furthest(tokens: np.ndarray, whole: bool) -> int:
    """The furthest a resume of `tokens` may reach: all of them where no logits are wanted
    (`whole`), else one short of the end (its logits come from the prefill)."""
    return len(tokens) - (0 if whole else 1)


class PromptCache:
    """A prefix cache for one model (see `mlxcache.cache.base.PrefixCache`).

    Args:
        model: the mlx-lm model (used to make fresh caches and learn the layer kinds).
        model_key: the model's fingerprint; entries of another key are never seen.
        config: block size, budgets, directory.
        on_warning: called with a one-line message when the disk tier has to be dropped.
        label: (model name, model folder) recorded beside the disk tier's namespace, so that
            `mlxcache cache ls` can name the model and show prompts without loading it.
    """

    def __init__(
        self,
        model: Model,
        model_key: str,
        config: CacheConfig,
        root: Path | None = None,
        on_warning: Callable[[str], None] | None = None,
        label: tuple[str, str] | None = None,
    ) -> None:
        self._model = model
        self.block_size = config.block_size
        fresh = new_layers(model)
        self.layout = Layout.of(fresh, config.block_size)
        self.trimmable = self.layout is not None
        # The last reply's layers, by reference (`keep_live`): outside the memory tier's
        # budget, like a lane's own layers, but freeable (`held`): one conversation at a
        # time, dropped first when memory is shed.
        self._live: Live | None = None
        # Whole-state checkpoints name their KV quantization alone (a layout names it too).
        shape = self.layout.name if self.layout is not None else kv_tag(fresh)
        self.ns = kv.namespace(model_key, config.block_size, shape)
        self.config = config
        self.stats = CacheStats()
        self._open: set[Lease] = set()  # restored and not yet released: none while idle
        self._warn = on_warning or (lambda _msg: None)
        self.mem = MemoryTier(self.layout, self.ns, config, self.stats)
        self.disk_index = PromptIndex(config.block_size)
        self._disk_ids: dict[Entry, int] = {}
        self._disk_seen = 0
        self.disk: DiskTier | None = None
        if config.disk_bytes > 0 and root is not None:
            try:
                self.disk = DiskTier(root)
                if label is not None:
                    self.disk.name_namespace(self.ns, *label, config.block_size)
            except _DISK_ERRORS as exc:
                self._drop_disk(exc)
            self._sync_disk()

    # -- PrefixCache ------------------------------------------------------------------------

    def restore(
        self,
        tokens: np.ndarray,
        count: bool = True,
        decode_matches_prefill: bool = False,
        whole: bool = False,
    ) -> Lease:
        """A lease on fresh caches restored to the longest reusable prefix of `tokens`,
        entry pinned; the whole prompt, with its last logits, when its tail is remembered.
        `count` False (warm-ahead work): the request counters (hits, misses, cached
        tokens, disk hits) stay as they are. `decode_matches_prefill` (a device measured
        shape-invariant): the prefix may end inside a block, where a kept block or tail
        stops following it. `whole`: the prefix may be all of `tokens` (no logits wanted,
        so no remembered tail either)."""
        resume = self._take_live(tokens, whole) if decode_matches_prefill else None
        if resume is None:
            resume = self._restore(with_probe(tokens) if whole else tokens)
            if decode_matches_prefill and resume.logits is None:
                self._continue(resume, tokens, whole)
        self._open.add(resume)
        if count:
            self.stats.hits += resume.length > 0
            self.stats.misses += resume.length == 0
            self.stats.disk_hits += resume.tier == "disk"
            self.stats.cached_tokens += resume.length
        return resume

    def _continue(self, resume: Lease, tokens: np.ndarray, whole: bool) -> None:
        """Extend `resume` mid-block as far as the memory tier's KV follows `tokens`, one
        token short of the end (the last one's logits come from the prefill) unless
        `whole`."""
        limit = _furthest(tokens, whole) - resume.length
        found = self.mem.partial(tokens, resume.length, limit)
        if found is None:
            return
        piece, k = found
        assert self.layout is not None  # `partial` finds pieces of block layouts only
        self.layout.append(resume.layers, piece)
        resume.length += k
        resume.tier = resume.tier or "memory"

    def _take_live(self, tokens: np.ndarray, whole: bool) -> Lease | None:
        """A lease on the live layers (`keep_live`) rewound to as far as they follow
        `tokens` (one token short of the end unless `whole`), where nothing kept reaches
        further (this very prompt's tail brings its logits too): no block is restored,
        joined or copied."""
        live = self._live
        if live is None:
            return None
        k = live.reach(tokens, _furthest(tokens, whole))
        if not whole and self.mem.tail(tokens) is not None:
            return None
        if k == 0 or k < self._restored_reach(tokens, whole):
            return None
        self._live = None
        self.mem.reserve_prefill(tokens, k, None)
        return Lease(self, live.take(k), k, tier="memory")

    def _restore(self, tokens: np.ndarray) -> Lease:
        self._sync_disk()
        tail = self.mem.tail(tokens)
        # A whole prompt resumes from its last full block, even when that is its end.
        probe = tokens if tail is None else with_probe(tokens)
        while True:
            mem, disk = self._lookup(probe)
            if disk is not None and (mem is None or disk.length > mem.length):
                entry = self._promote(disk.entry, disk.length)
                if entry is None:
                    continue  # the file was bad: dropped and counted; look again
                length, tier = disk.length, "disk"
            elif mem is not None:
                entry, length, tier = mem.entry, mem.length, "memory"
            else:
                return self._miss(tokens)
            shared, length = length, self.mem.resumable(entry, length)
            if length == 0:  # no recurrent state kept on the way
                return self._miss(tokens)
            if length != len(tokens) // self.block_size * self.block_size:
                tail = None  # its full blocks are not all here: an ordinary resume
            resume = self.mem.resume(self, entry, length, shared, tokens, tail)
            resume.tier = tier
            return resume

    def _miss(self, tokens: np.ndarray) -> Lease:
        """A lease on fresh caches holding nothing, room made for the prompt's KV."""
        self.mem.reserve_prefill(tokens, 0, None)
        return Lease(self, new_layers(self._model), 0)

    # -- Keeper: what a lease hands its calls to ------------------------------------------

    def keep(self, tokens: np.ndarray, lease: Lease) -> None:
        """Store the first len(tokens) positions of the lease's layers, in memory and on
        disk."""
        kept = self.mem.keep(np.array(tokens, dtype=np.int32), lease)
        if kept is None:
            return
        self._write_disk(kept)
        self._fit(skip=kept.entry, prompt=kept.tokens)

    def capture(self, n: int, lease: Lease) -> None:
        """Note the block of the lease's layers that ends at `n` (`Lease.capture`) when the
        layout cannot cut it later; `keep` stores it."""
        self.mem.capture(n, lease)

    def keep_tail(self, tokens: np.ndarray, lease: Lease, logits: mx.array | None) -> None:
        """Remember `tokens`' tail in the lease's layers (past its last full block) and its
        logits (None: for resuming mid-block only)."""
        if self.mem.keep_tail(tokens, lease.layers, logits):
            self._fit(prompt=None)

    def keep_live(self, tokens: np.ndarray, lease: Lease) -> None:
        """Hold the lease's layers (exactly the KV of `tokens`) for the next turn, where
        they can be rewound (`live.whole_until`); they replace the live layers held before."""
        self._live = Live.hold(tokens, lease.layers)

    def release(self, lease: Lease) -> None:
        self._open.discard(lease)
        self.mem.release(lease)
        self._fit(prompt=None)  # entries kept over budget go once nothing runs on them

    # -- lookups ------------------------------------------------------------------------------

    def cached_length(
        self, tokens: np.ndarray, whole: bool = False, decode_matches_prefill: bool = False
    ) -> int:
        """How many of `tokens` a restore of these arguments would resume now (a lookup,
        counted as a use of what it finds; nothing is copied): whole blocks, and with
        `decode_matches_prefill` on inside a block as far as a kept block or tail
        (`_continue`) or the live layers follow them."""
        if not decode_matches_prefill:
            return self._blocks_reach(tokens, whole)
        live = self._live
        reach = self._restored_reach(tokens, whole)
        return max(reach, live.reach(tokens, _furthest(tokens, whole)) if live else 0)

    def _blocks_reach(self, tokens: np.ndarray, whole: bool) -> int:
        """How far kept entries resume `tokens` (whole blocks, or a whole entry)."""
        self._sync_disk()
        probe = with_probe(tokens) if whole else tokens
        return max((m.length for m in self._lookup(probe) if m is not None), default=0)

    def _restored_reach(self, tokens: np.ndarray, whole: bool) -> int:
        """How far a restore resumes `tokens` from what is kept, inside a block too
        (`_continue`), the live layers aside."""
        n = self._blocks_reach(tokens, whole)
        return n + self.mem.continues(tokens, n, _furthest(tokens, whole) - n)

    def _lookup(self, tokens: np.ndarray) -> tuple[Match | None, Match | None]:
        """The memory and disk tiers' matches for `tokens` (each counted as a use)."""
        return self.mem.lookup(tokens), self.disk_index.lookup(tokens) if self.disk else None

    # -- sizes and stats ------------------------------------------------------------------

    def usage(self) -> dict[str, int]:
        """Entries and bytes per tier, for this model's namespace."""
        disk_entries, disk_bytes = self.disk.usage(self.ns) if self.disk else (0, 0)
        return {
            "mem_entries": len(self.mem),
            "mem_tails": self.mem.tails,
            "mem_bytes": self.mem.nbytes,
            "disk_entries": disk_entries,
            "disk_bytes": disk_bytes,
        }

    def held(self) -> int:
        """The bytes the memory tier and the live layers hold (all of it freeable). Read
        on any thread (`MemoryBudget.check`) while the engine's takes or drops the live
        layers: read once."""
        live = self._live
        return self.mem.nbytes + (0 if live is None else live.nbytes)

    def shed(self, n_bytes: int) -> int:
        """Free about `n_bytes`: the live layers first (the next turn restores the kept
        blocks instead), then the memory tier (its copies on disk stay resumable); returns
        the bytes freed."""
        freed = 0 if self._live is None else self._live.nbytes
        self._live = None
        return freed + self.mem.shed(max(n_bytes - freed, 0))

    def report(self) -> dict[str, Any]:
        """Counters and sizes as one JSON-able dict."""
        return {
            **asdict(self.stats),
            **self.usage(),
            "block_size": self.block_size,
            "kv_bytes_per_token": self.mem.token_bytes,
            "pinned_entries": self.mem.pinned(),
            "open_leases": len(self._open),
        }

    def _fit(self, skip: Entry | None = None, prompt: np.ndarray | None = None) -> None:
        """Evict by the victim order until both tiers are within budget."""
        self.mem.reserve(0, skip, prompt)  # stops when everything left is pinned
        try:
            # The disk budget is per model (namespace); `mlxcache cache prune` bounds the
            # whole directory.
            while self.disk and self.disk.usage(self.ns)[1] > self.config.disk_bytes:
                victim = self.disk_index.victim(skip=None, prompt=prompt)
                if victim is None:
                    break
                self._remove_disk(victim)
                self.stats.evictions_disk += 1
        except _DISK_ERRORS as exc:
            self._drop_disk(exc)

    # -- disk tier --------------------------------------------------------------------------

    def _checkpoint_name(self, tokens: np.ndarray) -> str:
        """Checkpoints are per entry (not shared): named by namespace and token digest."""
        return f"c-{self.ns[:16]}-{digest_tokens(tokens)}"

    def _drop_disk(self, error: Exception) -> None:
        """Go on without the disk tier (read-only or full directory, broken index)."""
        self.stats.disk_errors += 1
        reason: Exception = error
        if self.disk is not None:
            if isinstance(error, sqlite3.Error):  # a damaged index names its fix
                reason = index_error(self.disk.root, error)
            self.disk.close()
        self.disk = None
        self._warn(f"disk cache disabled: {reason}")

    def _sync_disk(self) -> None:
        """Index entries other processes (or earlier runs) wrote since we last looked."""
        if not self.disk:
            return
        try:
            rows = self.disk.entries(self.ns, self._disk_seen)
        except _DISK_ERRORS as exc:
            self._drop_disk(exc)
            return
        for row in rows:
            entry = self.disk_index.add(row.tokens, trimmable=row.trimmable, nbytes=row.nbytes)
            self._disk_ids[entry] = row.id
            self._disk_seen = max(self._disk_seen, row.id)

    def _write_disk(self, kept: Kept) -> None:
        """Store what memory just kept on disk too."""
        if not self.disk:
            return
        files: dict[str, Writer]
        if kept.checkpoint is None:
            files = {h: block_writer(block) for h, block in kept.blocks.items()}
            nbytes = sum(block_nbytes(block) for block in kept.blocks.values())
        else:
            files = {self._checkpoint_name(kept.tokens): checkpoint_writer(kept.checkpoint)}
            nbytes = kv.state_nbytes(kept.checkpoint)
        tokens, trimmable = kept.tokens, kept.checkpoint is None
        try:
            row = self.disk.add_entry(self.ns, tokens, trimmable, files, nbytes)
        except _DISK_ERRORS as exc:  # full, read-only, locked: nothing was left half-written
            self._drop_disk(exc)
            return
        entry = self.disk_index.add(tokens, trimmable=trimmable, nbytes=nbytes)
        self._disk_ids[entry] = row

    def _remove_disk(self, entry: Entry) -> None:
        self.disk_index.remove(entry)
        row = self._disk_ids.pop(entry)
        if self.disk:
            try:
                self.disk.remove_entry(row)
            except _DISK_ERRORS as exc:
                self._drop_disk(exc)

    def _promote(self, entry: Entry, length: int) -> Entry | None:
        """Load a disk entry's first `length` tokens into memory; None if its files are bad."""
        if not self.disk:
            return None
        tokens = np.asarray(entry.tokens[:length], dtype=np.int32)
        self.mem.make_room(tokens)
        try:
            if entry.trimmable and self.layout is not None:
                names = kv.chain_hashes(tokens, self.block_size, self.ns)
                fresh = {h: self.disk.read_block(h) for h in names if not self.mem.has_block(h)}
                if not all(self.layout.check(block) for block in fresh.values()):
                    raise CorruptCacheFileError("a block file lacks arrays its model needs")
                if self.layout.has_state:  # the last state kept on the way: where it resumes
                    stored = self.disk.stored([state_name(h) for h in names])
                    name = next((n for n in reversed(stored) if not self.mem.has_block(n)), None)
                    if name is not None:
                        fresh[name] = self.disk.read_block(name)
                        if not self.layout.check_state(fresh[name]):
                            raise CorruptCacheFileError(f"{name}: not a state of this model")
                    names += [n for n in stored if self.mem.has_block(n) or n in fresh]
                mx.eval([list(block.values()) for block in fresh.values()])
                mem_entry = self.mem.add_blocks(tokens, names, fresh)
            else:
                checkpoint = self.disk.read_checkpoint(self._checkpoint_name(tokens))
                mem_entry = self.mem.add_checkpoint(tokens, checkpoint)
            self.disk.touch(self._disk_ids[entry])
        except CorruptCacheFileError:
            self.stats.dropped_corrupt += 1
            self._remove_disk(entry)
            return None
        except _DISK_ERRORS as exc:  # e.g. the index stayed locked by other processes
            self._drop_disk(exc)
            return None
        self._fit(skip=mem_entry, prompt=tokens)
        return mem_entry
