"""A radix tree over blocks of B tokens: the prefix structure behind the prompt index.

A node stands for one distinct prefix of whole blocks that some entry covers. Children are
keyed by their block's token bytes, so a dict hit is an exact block match (no hash to verify).
An entry hangs on the node of its last whole block, keyed by its tail: the bytes of its
tokens past that block boundary (`b""` when it ends on the boundary).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

if TYPE_CHECKING:
    from mlxcache.cache.entry import Entry

Tokens = npt.NDArray[np.int32]
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


class Node:
    """One prefix of `depth` whole blocks, with the aggregates lookups read."""

    __slots__ = ("best", "children", "depth", "entries", "key", "nt", "parent")

    def __init__(self, parent: Node | None, key: bytes, depth: int) -> None:
        self.parent = parent
        self.key = key
        self.depth = depth
        self.children: dict[bytes, Node] = {}
        self.entries: dict[bytes, Entry] = {}
        # The live trimmable entry of the subtree needing the least rewinding (the
        # shortest, then the newest): what a lookup resuming at this depth returns.
        self.best: Entry | None = None
        # Live non-trimmable entries in the subtree: lets walks stop where none are left.
        self.nt = 0


def _less_rewinding(a: Entry, b: Entry | None) -> bool:
    return b is None or (len(a.tokens), -a.born) < (len(b.tokens), -b.born)


class BlockTree:
    """The tree, its walks, and the upkeep of its aggregates."""

    def __init__(self, block_size: int) -> None:
        self.root = Node(None, b"", 0)
        self.block_bytes = block_size * TOKEN_BYTES

    def walk(
        self, data: bytes, blocks: int, keep: Callable[[Node], bool] | None = None
    ) -> list[Node]:
        """Nodes of the first `blocks` whole blocks of `data`, root first, as far as they
        exist and `keep` accepts them."""
        node, path, bb = self.root, [self.root], self.block_bytes
        for j in range(blocks):
            child = node.children.get(data[j * bb : (j + 1) * bb])
            if child is None or (keep is not None and not keep(child)):
                break
            path.append(child)
            node = child
        return path

    def grow(self, data: bytes) -> list[Node]:
        """The path of every whole block of `data`, creating the missing nodes."""
        bb = self.block_bytes
        blocks = len(data) // bb
        path = self.walk(data, blocks)
        node = path[-1]
        for j in range(len(path) - 1, blocks):
            key = data[j * bb : (j + 1) * bb]
            node.children[key] = node = Node(node, key, j + 1)
            path.append(node)
        return path

    def find(self, data: bytes) -> Entry | None:
        """The entry whose tokens are exactly `data`, if any."""
        blocks = len(data) // self.block_bytes
        node = self.walk(data, blocks)[-1]
        if node.depth < blocks:
            return None
        return node.entries.get(data[blocks * self.block_bytes :])

    def prefixes(self, path: list[Node], data: bytes) -> list[Entry]:
        """Entries hanging on `path` whose tokens are a proper prefix of `data`."""
        out = []
        for node in path:
            base = node.depth * self.block_bytes
            for tail, e in node.entries.items():
                end = base + len(tail)
                if end < len(data) and data[base:end] == tail:
                    out.append(e)
        return out

    @staticmethod
    def raise_best(e: Entry) -> None:
        """Account for `e` becoming a live trimmable entry."""
        node: Node | None = e.node
        while node is not None and _less_rewinding(e, node.best):
            node.best = e
            node = node.parent

    @staticmethod
    def drop_best(e: Entry) -> None:
        """Account for `e` ceasing to be a live trimmable entry (expired or leaving)."""
        node: Node | None = e.node
        # Above the first node whose best is not `e`, no best can be `e` either.
        while node is not None and node.best is e:
            best = None
            for x in node.entries.values():
                if x is not e and x.trimmable and not x.expired and _less_rewinding(x, best):
                    best = x
            for child in node.children.values():
                if child.best is not None and _less_rewinding(child.best, best):
                    best = child.best
            node.best = best
            node = node.parent

    @staticmethod
    def count_nt(e: Entry, delta: int) -> None:
        """Account for the non-trimmable `e` becoming live (+1) or not (-1)."""
        node: Node | None = e.node
        while node is not None:
            node.nt += delta
            node = node.parent

    @staticmethod
    def prune(node: Node) -> None:
        """Drop `node` and its ancestors while nothing hangs on them any more."""
        while node.parent is not None and not node.entries and not node.children:
            del node.parent.children[node.key]
            node = node.parent
