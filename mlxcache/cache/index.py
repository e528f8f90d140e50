"""The prompt index: which kept prompts exist, which one a prompt resumes from, which goes.

Pure Python and numpy, no MLX. The semantics are in docs/architecture.md ("The prompt
index"); the decisions behind them in docs/index-decisions.md. Costs: a lookup walks the
prompt once through a path-compressed radix tree, per node rather than per block
(`radix.py`); extension links are made when an entry joins and dropped when it leaves;
victims come from sorted lists (`order.py`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from mlxcache.cache.entry import Entry
from mlxcache.cache.order import VictimOrder, victim_class
from mlxcache.cache.radix import BlockTree, Node, Walk, as_tokens, common_prefix

TokenSeq = Sequence[int] | npt.NDArray[np.integer]


@dataclass(frozen=True, slots=True)
class Match:
    """A lookup hit: restore `entry` to its first `length` tokens."""

    entry: Entry
    length: int


_NO_ENTRIES: frozenset[Entry] = frozenset()


class PromptIndex:
    """Entries, their births and uses, extension links, lookup and victim choice.

    It holds no limit: the caller evicts (`victim`, `remove`) to keep its own budgets.

    Args:
        block_size: B, the resume granularity for trimmable entries.

    Raises:
        ValueError: block_size is not a positive int.
    """

    def __init__(self, block_size: int) -> None:
        if not _positive_int(block_size):
            raise ValueError(f"block_size must be a positive int, got {block_size!r}")
        self.block_size = block_size
        self._tree = BlockTree(block_size)
        self._order = VictimOrder()
        self._entries: dict[int, Entry] = {}  # by born, so in born order
        self._clock = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[Entry]:
        return iter(tuple(self._entries.values()))

    def __contains__(self, e: object) -> bool:
        return isinstance(e, Entry) and self._entries.get(e.born) is e

    def add(self, tokens: TokenSeq, trimmable: bool = True, nbytes: int = 0) -> Entry:
        """Keep `tokens` as an entry, or reuse the entry that already has exactly them.

        Reusing counts as a use, sets `nbytes`, and keeps the entry's own `trimmable` flag.

        Raises:
            ValueError: empty or invalid tokens, or a negative nbytes.
        """
        arr = as_tokens(tokens, "tokens")
        if not arr.size:
            raise ValueError("cannot add an empty token sequence")
        if not isinstance(nbytes, int) or nbytes < 0:
            raise ValueError(f"nbytes must be a non-negative int, got {nbytes!r}")
        data = arr.tobytes()
        # One walk serves the search and the insert.
        walk = self._tree.walk(data, len(data) // self._tree.block_bytes)
        e = self._tree.find(data, walk)
        if e is not None:
            self._unplace(e)
            e.nbytes = nbytes
            e.last_used = self._tick()
            self._place(e)
            return e
        return self._insert(data, walk, bool(trimmable), nbytes)

    def remove(self, e: Entry) -> None:
        """Forget `e` and its extension links.

        Raises:
            ValueError: `e` is not in the index, or is pinned.
        """
        self._check(e)
        if e.pins:
            raise ValueError(f"cannot remove {e!r}: it is pinned by a running request")
        self._order.detach(e)
        if e.trimmable:
            self._tree.drop_best(e)
        else:
            self._tree.count_nt(e, -1)
        for p in e.extends:
            self._link(p, e, False)
        for f in e.extenders:
            f.extends.discard(e)
        del e.node.entries[e.tail]
        self._tree.prune(e.node)
        del self._entries[e.born]

    def pin(self, e: Entry) -> None:
        """Mark `e` in use by one more running request: it is never a victim until unpinned."""
        self._check(e)
        if not e.pins:
            self._order.detach(e)
        e.pins += 1

    def unpin(self, e: Entry) -> None:
        """Undo one `pin(e)`.

        Raises:
            ValueError: `e` is not in the index, or not pinned.
        """
        self._check(e)
        if not e.pins:
            raise ValueError(f"cannot unpin {e!r}: it is not pinned")
        e.pins -= 1
        self._place(e)

    def touch(self, e: Entry) -> None:
        """Count a use of `e`."""
        self._check(e)
        self._unplace(e)
        e.last_used = self._tick()
        self._place(e)

    def lookup(self, prompt: TokenSeq) -> Match | None:
        """The entry restoring the most of `prompt` and how much; a hit counts as a use.

        Ties go to the entry needing the least rewinding (the shortest), then the newest.
        """
        arr = as_tokens(prompt, "prompt")
        cap = (len(arr) - 1) // self.block_size
        if cap < 0:
            return None
        data = arr.tobytes()
        path, depth, inside = self._tree.walk(data, cap, _resumable)
        found: Match | None = None
        if inside is not None and inside.best is not None:  # deepest: inside an edge
            found = Match(inside.best, depth * self.block_size)
        else:
            for node in reversed(path[1:]):
                if node.best is not None:
                    found = Match(node.best, node.depth * self.block_size)
                    break
        for e in self._nt_prefixes(path, data):
            if found is None or _rank(e, len(e.tokens)) > _rank(found.entry, found.length):
                found = Match(e, len(e.tokens))
        if found is not None:
            self.touch(found.entry)
        return found

    def continuation(self, prompt: TokenSeq, length: int) -> tuple[Entry, int] | None:
        """The trimmable entry that follows `prompt` furthest into the block after its first
        `length` tokens (a whole number of blocks all in the tree), and how many tokens of
        that block it shares with `prompt` (0 < k < B): positions a device on which a
        token's KV does not depend on its chunk may resume mid-block. Not a use.
        """
        arr = as_tokens(prompt, "prompt")
        blocks, b = length // self.block_size, self.block_size
        walk = self._tree.walk(arr.tobytes(), blocks, _resumable)
        if walk.depth != blocks or length % b:
            return None
        bb = self._tree.block_bytes
        if walk.inside is not None:  # the point is inside an edge: one way on
            at = (blocks - walk.path[-1].depth) * bb
            nexts = [(walk.inside.key[at : at + bb], walk.inside.best)]
        else:
            nexts = [(c.key[:bb], c.best) for c in walk.path[-1].children.values()]
        want = arr[length : length + b]
        best: tuple[Entry, int] | None = None
        for block, entry in nexts:
            if entry is None:
                continue
            k = common_prefix(np.frombuffer(block, np.int32), want)
            if k and (best is None or k > best[1]):
                best = (entry, k)
        return best

    def victim(self, skip: Entry | None = None, prompt: TokenSeq | None = None) -> Entry | None:
        """The entry to evict next, never a pinned one nor `skip`; changes nothing.

        Order: extended, then the rest; within each, entries of no use to
        `prompt` first, then the least recently used.

        Raises:
            ValueError: `skip` is not in the index.
        """
        group, prefixes = self._useful(prompt)
        if skip is None or skip.pins:
            if skip is not None:
                self._check(skip)
            return self._order.pick(group, prefixes)
        self._check(skip)
        self._order.detach(skip)
        try:
            return self._order.pick(group, prefixes)
        finally:
            self._order.attach(skip, skip.victim_class)

    def _insert(self, data: bytes, walk: Walk, trimmable: bool, nbytes: int) -> Entry:
        path = self._tree.grow(data, walk)
        # A read-only view of `data`, the bytes copy already made: no second copy.
        tokens = np.frombuffer(data, dtype=np.int32)
        e = Entry(tokens, self._tick(), trimmable, nbytes)
        e.node = path[-1]
        e.tail = data[e.node.depth * self._tree.block_bytes :]
        e.node.entries[e.tail] = e
        self._entries[e.born] = e
        if trimmable:
            if e.node.depth:
                e.group = data[: self._tree.block_bytes]
            # Links are only needed from trimmable entries: only those extend.
            for p in self._tree.prefixes(path, data):
                e.extends.add(p)
                self._link(p, e, True)
            self._tree.raise_best(e)
        else:
            self._tree.count_nt(e, +1)
        self._place(e)
        return e

    def _link(self, p: Entry, f: Entry, add: bool) -> None:
        """`f` starts (`add`) or stops extending `p`. Its first extender moves `p` into the
        extended class, its last one out of it."""
        moves = not p.extenders if add else p.extenders == {f}
        if moves:
            self._unplace(p)
        if add:
            p.extenders.add(f)
        else:
            p.extenders.discard(f)
        if moves:
            self._place(p)

    # Non-trimmable entries hanging on `path` that are proper prefixes of `data`.
    def _nt_prefixes(self, path: list[Node], data: bytes) -> list[Entry]:
        n = 0
        while n < len(path) and path[n].nt:
            n += 1
        return [e for e in self._tree.prefixes(path[:n], data) if not e.trimmable]

    # What tells the entries that can restore some of `prompt` (see order.py): the prompt's
    # first block, for trimmable entries, and the non-trimmable proper prefixes.
    def _useful(self, prompt: TokenSeq | None) -> tuple[bytes | None, frozenset[Entry]]:
        if prompt is None:
            return None, _NO_ENTRIES
        arr = as_tokens(prompt, "prompt")
        cap = (len(arr) - 1) // self.block_size
        if cap < 0:
            return None, _NO_ENTRIES
        group = arr[: self.block_size].tobytes() if cap else None
        if not self._tree.root.nt:
            return group, _NO_ENTRIES
        data = arr.tobytes()
        return group, frozenset(self._nt_prefixes(self._tree.walk(data, cap, _has_nt).path, data))

    def _place(self, e: Entry) -> None:
        if not e.pins:
            self._order.attach(e, victim_class(e))

    def _unplace(self, e: Entry) -> None:
        if not e.pins:
            self._order.detach(e)

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _check(self, e: Entry) -> None:
        if e not in self:
            raise ValueError(f"{e!r} is not in this index")


# Lookup preference: more tokens restored, then less rewinding, then newer.
def _rank(e: Entry, length: int) -> tuple[int, int, int]:
    return (length, -len(e.tokens), e.born)


# Whether some entry under `n` could restore a prompt through it.
def _resumable(n: Node) -> bool:
    return n.best is not None or n.nt > 0


def _has_nt(n: Node) -> bool:
    return n.nt > 0


def _positive_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 1
