"""`Entry`: one kept prompt of a `PromptIndex`, and the bookkeeping its structures share;
`Node`: one node of the radix tree (`radix.py` keeps the tree's shape and walks). Both are
here so that the tree and the entries it holds need no import of each other.

An entry's public fields describe the prompt. The index-structure fields (last group below) belong
to the index and the two structures it drives, the radix tree (`radix.py`: `node`, `tail`)
and the victim order (`order.py`: `group`, `victim_class`); only `PromptIndex` changes them.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

Tokens = npt.NDArray[np.int32]

EXTENDED, REST = 0, 1
"""Victim classes, evicted in this order (see `order.victim_key`)."""


class Entry:
    """One kept prompt. Read its fields; change them only through its `PromptIndex`.

    Attributes:
        tokens: the token ids (a read-only int32 array).
        born: the index clock when it was added (unique, increasing).
        last_used: the index clock of its latest use (add, hit, touch).
        trimmable: its state can be rewound to a shorter prefix.
        pins: running requests using it; a pinned entry is never a victim.
        nbytes: the bytes its state takes, as told by the caller.

        node: the radix-tree node of its last whole block; `tail`: its tokens' bytes past it.
        group: the first block's bytes of a trimmable entry of at least one block (else None).
        victim_class: its class in the victim order while it stands there.
        extends: older entries that are proper prefixes of it (kept for trimmable entries).
        extenders: newer trimmable entries it is a proper prefix of (it is extended while
            there is one).
    """

    __slots__ = (
        "born",
        "extenders",
        "extends",
        "group",
        "last_used",
        "nbytes",
        "node",
        "pins",
        "tail",
        "tokens",
        "trimmable",
        "victim_class",
    )

    def __init__(self, tokens: Tokens, born: int, trimmable: bool, nbytes: int) -> None:
        self.tokens = tokens
        self.born = born
        self.last_used = born
        self.trimmable = trimmable
        self.pins = 0
        self.nbytes = nbytes
        self.node: Node
        self.tail: bytes
        self.group: bytes | None = None
        self.victim_class = REST
        self.extends: set[Entry] = set()
        self.extenders: set[Entry] = set()

    def __repr__(self) -> str:
        flags = "".join(f for f, on in (("t", self.trimmable), ("p", self.pins)) if on)
        return f"Entry(born={self.born}, len={len(self.tokens)}, used={self.last_used}, {flags})"


class Node:
    """One prefix of `depth` whole blocks, reached from `parent` by the blocks in `key`,
    with the aggregates lookups read."""

    __slots__ = ("best", "children", "depth", "entries", "key", "nt", "parent")

    def __init__(self, parent: Node | None, key: bytes, depth: int) -> None:
        self.parent = parent
        self.key = key
        self.depth = depth
        self.children: dict[bytes, Node] = {}  # by the first block of their key
        self.entries: dict[bytes, Entry] = {}
        # The trimmable entry of the subtree needing the least rewinding (the
        # shortest, then the newest): what a lookup resuming at this depth returns, or
        # anywhere on the edge above it (no entry hangs or branches there).
        self.best: Entry | None = None
        # Non-trimmable entries in the subtree: lets walks stop where none are left.
        self.nt = 0
