"""`Entry`: one kept prompt of a `PromptIndex`, and the bookkeeping its structures share.

Its public fields describe the prompt. The index-structure fields (last group below) belong
to the index and the two structures it drives, the radix tree (`radix.py`: `node`, `tail`)
and the victim order (`order.py`: `group`, `victim_class`); only `PromptIndex` changes them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mlxcache.cache.radix import Node, Tokens

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
