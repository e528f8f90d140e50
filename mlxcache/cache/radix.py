"""A path-compressed radix tree over blocks of B tokens: the prefix structure behind the index.

A node stands for one distinct prefix of whole blocks (`depth` blocks) that some entry
needs: one an entry hangs on, or one where entries' prefixes branch. The edge to a node
(`key`) holds the token bytes of one or more whole blocks, so a walk costs one dict hit and
one memcmp per node, not per block: a 30k-token chat at B=32 is ~930 blocks but only as
many nodes as kept prompts and forks along it. Children are keyed by the first block of
their edge, so a dict hit is an exact block match (no hash to verify), and the rest of the
edge is compared in place (`bytes.startswith` at an offset: no slice copied).

An entry hangs on the node of its last whole block, keyed by its tail: the bytes of its
tokens past that block boundary (`b""` when it ends on the boundary). Every node but the
root has entries or at least two children (`grow` splits an edge where a new prompt leaves
it, `prune` drops and merges what nothing needs any more), so the tree stays as small as
the entries make it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np
import numpy.typing as npt

from mlxcache.cache.entry import Entry, Node, Tokens

TOKEN_BYTES = 4
_MAX_ID = 2**31 - 1
_INT32 = np.dtype(np.int32)


def as_tokens(seq: Sequence[int] | npt.NDArray[np.integer], what: str) -> Tokens:
    """`seq` as a 1-D int32 array (no copy when it already is one).

    Raises:
        ValueError: `seq` is not a flat sequence of ids in 0..2**31-1.
    """
    arr = np.asarray(seq)
    if arr.dtype == _INT32 and arr.ndim == 1:  # what the engine passes: take it as it is
        return arr
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        raise ValueError(f"{what} must be a flat sequence of integer token ids")
    # Narrowing silently wraps, and a wrapped id could match another prompt's token.
    if arr.size and (arr.min() < 0 or arr.max() > _MAX_ID):
        raise ValueError(f"{what} has token ids outside 0..{_MAX_ID}")
    return arr.astype(np.int32)


def common_prefix(a: Sequence[int] | np.ndarray, b: Sequence[int] | np.ndarray) -> int:
    """Length of the longest common prefix of two token sequences."""
    n = min(len(a), len(b))
    diff = np.nonzero(np.asarray(a[:n]) != np.asarray(b[:n]))[0]
    return int(diff[0]) if diff.size else n


class Walk(NamedTuple):
    """How far some data's blocks follow the tree.

    `path`: the nodes whose whole edge matched, root first. `depth`: the blocks matched:
    `path[-1].depth`, or more when the match ends inside the edge of `inside`, a child of
    `path[-1]` (None when it ends on `path[-1]`). Everything below that point lies in
    `inside`'s subtree, so its aggregates are the point's.
    """

    path: list[Node]
    depth: int
    inside: Node | None


def _less_rewinding(a: Entry, b: Entry | None) -> bool:
    return b is None or (len(a.tokens), -a.born) < (len(b.tokens), -b.born)


class BlockTree:
    """The tree, its walks, and the upkeep of its shape and aggregates."""

    def __init__(self, block_size: int) -> None:
        self.root = Node(None, b"", 0)
        self.block_bytes = block_size * TOKEN_BYTES

    def walk(self, data: bytes, blocks: int, keep: Callable[[Node], bool] | None = None) -> Walk:
        """Follow the first `blocks` whole blocks of `data` as far as the tree has them and
        `keep` accepts the nodes whose edges they enter."""
        bb = self.block_bytes
        node, path, pos, end = self.root, [self.root], 0, blocks * bb
        while pos < end:
            child = node.children.get(data[pos : pos + bb])
            if child is None or (keep is not None and not keep(child)):
                break
            stop = pos + len(child.key)
            if stop > end or not data.startswith(child.key, pos):
                return Walk(path, self._common(data, pos, child.key, end) // bb, child)
            path.append(child)
            node, pos = child, stop
        return Walk(path, pos // bb, None)

    def _common(self, data: bytes, pos: int, key: bytes, end: int) -> int:
        """The end of the whole blocks `data[pos:end]` shares with `key` (the first block is
        known to match). A binary search of in-place prefix comparisons: log(blocks)
        memcmps instead of a Python step per block."""
        bb, view = self.block_bytes, memoryview(key)
        lo, hi = 1, min(len(key), end - pos) // bb  # blocks known to match; most that could
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if data.startswith(view[: mid * bb], pos):
                lo = mid
            else:
                hi = mid - 1
        return pos + lo * bb

    def grow(self, data: bytes, walk: Walk) -> list[Node]:
        """The nodes on the path of `data`'s whole blocks, root first, the last at its last
        whole block: splits the edge `data` leaves or ends inside, adds one node for the
        blocks the tree lacks. `walk`: of all those blocks, taken since the tree last changed."""
        bb = self.block_bytes
        blocks = len(data) // bb
        path, depth, inside = walk
        if inside is not None:
            path.append(self._split(inside, depth))
        if depth < blocks:
            node = path[-1]
            child = Node(node, data[depth * bb : blocks * bb], blocks)
            node.children[child.key[:bb]] = child
            path.append(child)
        return path

    def _split(self, node: Node, depth: int) -> Node:
        """Cut `node`'s edge at `depth` blocks; the new node above it is returned. Its
        subtree is `node`'s, so it takes `node`'s aggregates."""
        parent, bb = node.parent, self.block_bytes
        assert parent is not None  # the root has no edge
        cut = (depth - parent.depth) * bb
        upper = Node(parent, node.key[:cut], depth)
        upper.best, upper.nt = node.best, node.nt
        parent.children[upper.key[:bb]] = upper
        node.key, node.parent = node.key[cut:], upper
        upper.children[node.key[:bb]] = node
        return upper

    def find(self, data: bytes, walk: Walk) -> Entry | None:
        """The entry whose tokens are exactly `data`, if any; `walk`: of all its whole blocks."""
        path, depth, inside = walk
        if depth < len(data) // self.block_bytes or inside is not None:
            return None
        return path[-1].entries.get(data[depth * self.block_bytes :])

    def prefixes(self, path: list[Node], data: bytes) -> list[Entry]:
        """Entries hanging on `path` whose tokens are a proper prefix of `data`."""
        out = []
        for node in path:
            base = node.depth * self.block_bytes
            for tail, e in node.entries.items():
                end = base + len(tail)
                if end < len(data) and data.startswith(tail, base):
                    out.append(e)
        return out

    @staticmethod
    def raise_best(e: Entry) -> None:
        """Account for the trimmable `e` joining."""
        node: Node | None = e.node
        while node is not None and _less_rewinding(e, node.best):
            node.best = e
            node = node.parent

    @staticmethod
    def drop_best(e: Entry) -> None:
        """Account for the trimmable `e` leaving."""
        node: Node | None = e.node
        # Above the first node whose best is not `e`, no best can be `e` either.
        while node is not None and node.best is e:
            best = None
            for x in node.entries.values():
                if x is not e and x.trimmable and _less_rewinding(x, best):
                    best = x
            for child in node.children.values():
                if child.best is not None and _less_rewinding(child.best, best):
                    best = child.best
            node.best = best
            node = node.parent

    @staticmethod
    def count_nt(e: Entry, delta: int) -> None:
        """Account for the non-trimmable `e` joining (+1) or leaving (-1)."""
        node: Node | None = e.node
        while node is not None:
            node.nt += delta
            node = node.parent

    def prune(self, node: Node) -> None:
        """Restore the tree's shape after an entry left `node`: drop it and its ancestors
        while nothing hangs on them nor below them, then merge the first node left with
        no entries and one child into that child."""
        bb = self.block_bytes
        while node.parent is not None and not node.entries:
            parent = node.parent
            if len(node.children) == 1:
                (child,) = node.children.values()
                # The child's subtree is node's (node holds no entries): aggregates stand.
                child.key, child.parent = node.key + child.key, parent
                parent.children[node.key[:bb]] = child
                return
            if node.children:
                return
            del parent.children[node.key[:bb]]
            node = parent
