"""The prompt cache: two prompt indexes (memory, disk) over shared KV blocks and checkpoints.

Models whose layers are plain KV, sliding-window or recurrent ("trimmable": they resume
at any block boundary) store blocks of B tokens keyed by chained hashes (`layout.Layout`
says what a block holds), so entries sharing a prefix share its blocks and memory follows
unique tokens. A block that only exists right after its prefill chunk (a sliding window's
keys, a recurrent state) is captured then (`capture`) and stored when the lane keeps its
prompt. Models with other cache kinds store one whole-state checkpoint per entry, taken at
a block boundary, and their entries are non-trimmable. Every insert path ends in `_fit()`,
which evicts through the index's victim order until the byte budget holds.

The memory tier of a trimmable model also remembers the tails of the last few whole
prompts: the KV past the last full block and the last token's logits, as the prompt's
own last prefill chunk computed them. The same prompt again (a retry, a regression run,
a repeated API call) then resumes whole, with nothing to prefill; that state is exactly
what a fresh prefill computes, since the chunk's input (the canonical KV of the full
blocks and the same tokens) is the same. Tails go first when memory is short, and with
the entry whose blocks they continue.
"""

from __future__ import annotations

import sqlite3
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import make_prompt_cache

from mlxcache.cache import blocks as kv
from mlxcache.cache.base import Resume, with_probe
from mlxcache.cache.disk import (
    DiskTier,
    Writer,
    block_writer,
    checkpoint_writer,
    digest_tokens,
    index_error,
)
from mlxcache.cache.index import Entry, Match, PromptIndex
from mlxcache.cache.layout import Block, Layout
from mlxcache.cache.layout import nbytes as block_nbytes
from mlxcache.config import CacheConfig
from mlxcache.errors import CacheStoreError, CorruptCacheFileError

# What the disk tier can raise that means "go on without it" (a corrupt file is handled apart).
_DISK_ERRORS = (sqlite3.Error, OSError, CacheStoreError)

MAX_TAILS = 32
"""Whole prompts whose tails the memory tier remembers (the most recently used)."""


@dataclass(slots=True)
class CacheStats:
    """Counters since the cache was opened, plus current sizes (see `PromptCache.stats`)."""

    hits: int = 0
    misses: int = 0
    cached_tokens: int = 0
    disk_hits: int = 0
    evictions_mem: int = 0
    evictions_disk: int = 0
    dropped_corrupt: int = 0
    disk_errors: int = 0


@dataclass(slots=True)
class _Block:
    data: Block
    refs: int = 0

    @property
    def nbytes(self) -> int:
        return block_nbytes(self.data)


@dataclass(slots=True)
class _Tail:
    base: Entry  # holds the prompt's full blocks; the tail goes with it
    kv: Block  # positions [last full block end, prompt end) (maybe none), states at the end
    logits: mx.array

    @property
    def nbytes(self) -> int:
        return block_nbytes(self.kv) + int(self.logits.nbytes)


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
        model: Any,
        model_key: str,
        config: CacheConfig,
        root: Path | None = None,
        on_warning: Callable[[str], None] | None = None,
        label: tuple[str, str] | None = None,
    ) -> None:
        self._model = model
        self.block_size = config.block_size
        self.layout = Layout.of(make_prompt_cache(model), config.block_size)
        self.trimmable = self.layout is not None
        mixed = self.layout is not None and not self.layout.plain
        self.ns = kv.namespace(model_key, config.block_size, "layout-v1" if mixed else "")
        self.config = config
        self.stats = CacheStats()
        self._warn = on_warning or (lambda _msg: None)
        self.mem = PromptIndex(config.block_size)
        self._blocks: dict[str, _Block] = {}
        self._entry_blocks: dict[Entry, list[str]] = {}
        self._checkpoints: dict[Entry, list[Any]] = {}
        self._tails: OrderedDict[str, _Tail] = OrderedDict()  # by prompt digest, oldest first
        # Blocks captured by running lanes (by id of their layers, then block number) until
        # they keep them; outside the budget, like the lanes' own layers.
        self._staged: dict[int, dict[int, Block]] = {}
        self._stride = config.state_stride
        self._branches: dict[int, int] = {}  # id of a lane's layers -> its branch block
        self._mem_bytes = 0
        self._token_bytes = 0  # KV bytes per token, learned from the first block kept
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

    def restore(self, tokens: np.ndarray, count: bool = True) -> Resume:
        """Fresh caches restored to the longest reusable prefix of `tokens`, entry pinned;
        the whole prompt, with its last logits, when its tail is remembered. `count`
        False (warm-ahead work): the request counters (hits, misses, cached tokens,
        disk hits) stay as they are."""
        stats = self.stats if count else CacheStats()
        self._sync_disk()
        key = digest_tokens(tokens) if self._tails else ""
        tail = self._tails.get(key)
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
                return self._miss(tokens, stats)
            shared, length = length, self._resumable(entry, length)
            if length == 0:  # no recurrent state kept on the way
                return self._miss(tokens, stats)
            stats.hits += 1
            if tier == "disk":
                stats.disk_hits += 1
            if length != len(tokens) // self.block_size * self.block_size:
                tail = None  # its full blocks are not all here: an ordinary resume
            if tail is None:
                self.reserve(self._token_bytes * (len(tokens) - length), entry, tokens)
            layers = self._layers(entry, length)  # before the pin: if this fails, none is left
            if shared > length:  # where this prompt leaves the entry: keep its state there
                self._branches[id(layers)] = shared // self.block_size - 1
            logits = None
            if tail is not None:
                assert self.layout is not None  # tails are kept for block layouts only
                self.layout.append(layers, tail.kv)
                self._tails.move_to_end(key)
                # A copy: logits processors (the repetition penalty) write into their input.
                length, logits = len(tokens), mx.array(tail.logits)
            stats.cached_tokens += length
            self.mem.pin(entry)
            return Resume(layers, length, entry, logits, tier)

    def _miss(self, tokens: np.ndarray, stats: CacheStats) -> Resume:
        """Fresh caches holding nothing, room made for the prompt's KV."""
        stats.misses += 1
        self.reserve(self._token_bytes * len(tokens), None, tokens)
        return Resume(make_prompt_cache(self._model), 0)

    def keep(self, tokens: np.ndarray, layers: list[Any]) -> None:
        """Store the first len(tokens) positions of `layers`, in memory and on disk."""
        tokens = np.array(tokens, dtype=np.int32)
        self._make_room(tokens)
        if self.layout is not None:
            names, fresh = self._fresh_blocks(tokens, layers)
            if not names:
                return
            tokens = self._whole_blocks(tokens, names)
            entry = self._add_blocks(tokens, names, fresh)
            self._write_blocks(tokens, names)
        else:
            checkpoint = kv.snapshot(layers)
            entry = self._add_checkpoint(tokens, checkpoint)
            self._write_checkpoint(tokens, checkpoint)
        self._fit(skip=entry, prompt=tokens)

    def _fresh_blocks(
        self, tokens: np.ndarray, layers: list[Any]
    ) -> tuple[list[str], dict[str, Block]]:
        """The names an entry of `tokens` holds (its blocks, then the recurrent states it
        keeps) and the blocks among them not stored yet: captured ones, or cut out of
        `layers` (plain KV). It stops before the first block that is neither stored nor
        captured. States are kept after every `stride`-th block, after the last, and
        after the block where this prompt left the entry it resumed from (had it a state
        there, it would have resumed there: the next prompt that shares as much will)."""
        assert self.layout is not None
        b, layout = self.block_size, self.layout
        names = kv.chain_hashes(tokens, b, self.ns)
        staged = self._staged.get(id(layers), {})
        branch = self._branches.get(id(layers))
        n = next(
            (j for j, h in enumerate(names) if h not in self._blocks and j not in staged),
            len(names),
        )
        if layout.plain:  # plain KV: cut out of any state
            n = len(names)
        fresh: dict[str, Block] = {}
        states: list[str] = []
        for j, h in enumerate(names[:n]):
            piece = staged.pop(j, None)
            if piece is None and h not in self._blocks:
                piece = layout.cut(layers, j * b, (j + 1) * b)
            blocks, state = layout.split(piece) if piece is not None else ({}, {})
            if h not in self._blocks:
                fresh[h] = blocks
            if not layout.has_state:
                continue
            name = _state_name(h)
            ends = j in (n - 1, branch)
            if name not in self._blocks and state and (ends or self._keeps_state(j, state, blocks)):
                fresh[name] = state
            if name in self._blocks or name in fresh:
                states.append(name)
        return names[:n] + states, fresh

    def _whole_blocks(self, tokens: np.ndarray, names: list[str]) -> np.ndarray:
        """The tokens of the blocks among `names`: what an entry of them holds."""
        return tokens[: sum(not _is_state(h) for h in names) * self.block_size]

    def _keeps_state(self, j: int, state: Block, blocks: Block) -> bool:
        """Whether block j keeps its recurrent state: every `stride`-th one. The stride is
        set, or measured the first time: states may cost about half of what the blocks'
        attention arrays cost (a state per block can outweigh a hybrid's KV many times)."""
        if self._stride is None:
            kv_bytes = block_nbytes(blocks) or 1
            self._stride = max(1, -(-2 * block_nbytes(state) // kv_bytes))
        return (j + 1) % self._stride == 0

    def capture(self, tokens: np.ndarray, layers: list[Any]) -> None:
        """Note the last block of `layers` (holding exactly `tokens`, right after its chunk)
        when the layout cannot cut it later; `keep` with these layers stores it."""
        if self.layout is None or not self.layout.needs_capture:
            return
        j = len(tokens) // self.block_size - 1
        start = j * self.block_size
        self._staged.setdefault(id(layers), {})[j] = self.layout.cut(layers, start, len(tokens))

    def cached_length(self, tokens: np.ndarray) -> int:
        """How many of `tokens` a restore would resume now (a lookup, counted as a use of
        what it finds; nothing is copied)."""
        self._sync_disk()
        return max((m.length for m in self._lookup(tokens) if m is not None), default=0)

    def _lookup(self, tokens: np.ndarray) -> tuple[Match | None, Match | None]:
        """The memory and disk tiers' matches for `tokens` (each counted as a use)."""
        return self.mem.lookup(tokens), self.disk_index.lookup(tokens) if self.disk else None

    def keep_tail(self, tokens: np.ndarray, layers: list[Any], logits: mx.array) -> None:
        """Remember `tokens`' tail in `layers` (past its last full block) and its logits."""
        at = len(tokens) // self.block_size * self.block_size
        if self.layout is None or at == 0:
            return  # a checkpoint holds the whole state; no block to continue
        found = self.mem.lookup(with_probe(tokens[:at]))
        if found is None or found.length < at:
            return  # its blocks are gone already (memory too small)
        tail = self.layout.cut(layers, at, len(tokens))
        logits = mx.array(logits)
        mx.eval(logits)
        key = digest_tokens(tokens)
        self._drop_tail(key)
        self._tails[key] = _Tail(found.entry, tail, logits)
        self._mem_bytes += self._tails[key].nbytes
        while len(self._tails) > MAX_TAILS:
            self._drop_tail(next(iter(self._tails)))
        self._fit(prompt=None)

    def _drop_tail(self, key: str) -> None:
        tail = self._tails.pop(key, None)
        if tail is not None:
            self._mem_bytes -= tail.nbytes

    def release(self, resume: Resume) -> None:
        self._staged.pop(id(resume.layers), None)  # what the lane captured and did not keep
        self._branches.pop(id(resume.layers), None)
        if resume.lease is not None and resume.lease in self.mem:
            self.mem.unpin(resume.lease)
        self._fit(prompt=None)  # entries kept over budget go once nothing runs on them

    # -- sizes and stats ------------------------------------------------------------------

    def usage(self) -> dict[str, int]:
        """Entries and bytes per tier, for this model's namespace."""
        disk_entries, disk_bytes = self.disk.usage(self.ns) if self.disk else (0, 0)
        return {
            "mem_entries": len(self.mem),
            "mem_tails": len(self._tails),
            "mem_bytes": self._mem_bytes,
            "disk_entries": disk_entries,
            "disk_bytes": disk_bytes,
        }

    def report(self) -> dict[str, Any]:
        """Counters and sizes as one JSON-able dict."""
        return {
            **asdict(self.stats),
            **self.usage(),
            "block_size": self.block_size,
            "kv_bytes_per_token": self._token_bytes,
            "pinned_entries": sum(1 for e in self.mem if e.pins),
        }

    # -- memory tier ------------------------------------------------------------------------

    def _layers(self, entry: Entry, length: int) -> list[Any]:
        if entry in self._checkpoints:
            return kv.from_snapshot(self._checkpoints[entry])
        assert self.layout is not None  # an entry of blocks: the model has a layout
        names = self._entry_blocks[entry][: length // self.block_size]
        state = self._blocks.get(_state_name(names[-1]))
        blocks = [self._blocks[h].data for h in names]
        return self.layout.join(blocks, self.block_size, state.data if state else None)

    def _resumable(self, entry: Entry, length: int) -> int:
        """The longest resume point up to `length` in `entry` whose recurrent state is kept
        (`length` itself for models without recurrent layers)."""
        if self.layout is None or not self.layout.has_state:
            return length
        names = self._entry_blocks.get(entry, [])
        for j in range(length // self.block_size - 1, -1, -1):
            if _state_name(names[j]) in self._blocks:
                return (j + 1) * self.block_size
        return 0

    def _add_checkpoint(self, tokens: np.ndarray, checkpoint: list[Any]) -> Entry:
        """Add a memory entry backed by a whole-state checkpoint."""
        entry = self.mem.add(tokens, trimmable=False, nbytes=kv.state_nbytes(checkpoint))
        if entry not in self._checkpoints:
            self._checkpoints[entry] = checkpoint
            self._mem_bytes += entry.nbytes
        return entry

    def _add_blocks(self, tokens: np.ndarray, names: list[str], fresh: dict[str, Block]) -> Entry:
        """Add a memory entry backed by blocks `names`; `fresh` holds those not stored yet."""
        added = 0
        for h, block in fresh.items():
            self._blocks[h] = _Block(block)
            added += self._blocks[h].nbytes
            if not _is_state(h):
                self._token_bytes = self._blocks[h].nbytes // self.block_size
        entry = self.mem.add(tokens, trimmable=True, nbytes=added)
        if entry not in self._entry_blocks:
            self._entry_blocks[entry] = names
            for h in names:
                self._blocks[h].refs += 1
        self._mem_bytes += added
        return entry

    def _make_room(self, tokens: np.ndarray) -> None:
        """Free a slot before adding (before cutting blocks: eviction may free shared ones)."""
        while len(self.mem) >= self.config.max_entries:
            if not self._evict_mem(self.mem.victim(prompt=tokens)):
                break

    def reserve(
        self, n_bytes: int, skip: Entry | None = None, prompt: np.ndarray | None = None
    ) -> None:
        """Evict until `n_bytes` more fit the memory budget (before a long prefill).

        Remembered tails go first (the oldest first), then entries in the victim order.
        """
        while self._mem_bytes + n_bytes > self.config.mem_bytes:
            if self._tails:
                self._drop_tail(next(iter(self._tails)))
            elif not self._evict_mem(self.mem.victim(skip=skip, prompt=prompt)):
                break

    def _evict_mem(self, entry: Entry | None) -> bool:
        """Remove one memory entry and the blocks only it used. False when there is none."""
        if entry is None:
            return False
        self.mem.remove(entry)
        self.stats.evictions_mem += 1
        for key in [k for k, tail in self._tails.items() if tail.base is entry]:
            self._drop_tail(key)
        if entry in self._checkpoints:
            del self._checkpoints[entry]
            self._mem_bytes -= entry.nbytes
            return True
        for h in self._entry_blocks.pop(entry):
            block = self._blocks[h]
            block.refs -= 1
            if block.refs == 0:
                del self._blocks[h]
                self._mem_bytes -= block.nbytes
        return True

    def _fit(self, skip: Entry | None = None, prompt: np.ndarray | None = None) -> None:
        """Evict by the victim order until both tiers are within budget."""
        self.reserve(0, skip, prompt)  # stops when everything left is pinned
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

    def _write_blocks(self, tokens: np.ndarray, names: list[str]) -> None:
        """Store an entry of blocks `names` (all in memory now) on disk."""
        files = {h: block_writer(self._blocks[h].data) for h in names}
        nbytes = sum(self._blocks[h].nbytes for h in names)
        self._write_disk(tokens, True, files, nbytes)

    def _write_checkpoint(self, tokens: np.ndarray, checkpoint: list[Any]) -> None:
        files = {self._checkpoint_name(tokens): checkpoint_writer(checkpoint)}
        self._write_disk(tokens, False, files, kv.state_nbytes(checkpoint))

    def _write_disk(
        self, tokens: np.ndarray, trimmable: bool, files: dict[str, Writer], nbytes: int
    ) -> None:
        if not self.disk:
            return
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
        self._make_room(tokens)
        try:
            if entry.trimmable and self.layout is not None:
                names = kv.chain_hashes(tokens, self.block_size, self.ns)
                fresh = {h: self.disk.read_block(h) for h in names if h not in self._blocks}
                if not all(self.layout.check(block) for block in fresh.values()):
                    raise CorruptCacheFileError("a block file lacks arrays its model needs")
                if self.layout.has_state:  # the last state kept on the way: where it resumes
                    stored = self.disk.stored([_state_name(h) for h in names])
                    name = next((n for n in reversed(stored) if n not in self._blocks), None)
                    if name is not None:
                        fresh[name] = self.disk.read_block(name)
                        if not self.layout.check_state(fresh[name]):
                            raise CorruptCacheFileError(f"{name}: not a state of this model")
                    names += [n for n in stored if n in self._blocks or n in fresh]
                mx.eval([list(block.values()) for block in fresh.values()])
                mem_entry = self._add_blocks(tokens, names, fresh)
            else:
                checkpoint = self.disk.read_checkpoint(self._checkpoint_name(tokens))
                mem_entry = self._add_checkpoint(tokens, checkpoint)
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


def _state_name(block: str) -> str:
    """The name of the recurrent state kept after block `block`."""
    return f"{block}.s"


def _is_state(name: str) -> bool:
    return name.endswith(".s")
