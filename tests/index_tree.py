"""A white-box check of the prompt index's radix tree (`mlxcache/cache/radix.py`).

The differential tests see only what the index answers; this sees its shape: every edge is
whole blocks, every node but the root is needed (entries hang on it, or its children branch
there), each entry hangs where its tokens say, and the aggregates equal their definitions.
A tree that answers right but keeps dead or unmerged nodes, which only costs speed, fails here.
"""

from __future__ import annotations

from typing import Any

from mlxcache.cache.index import PromptIndex
from mlxcache.cache.radix import Node


def check_tree(index: PromptIndex, where: str = "") -> None:
    tree = index._tree
    bb = tree.block_bytes
    hung: list[Any] = []

    def visit(node: Node, prefix: bytes) -> tuple[Any, int]:
        best, nt = None, 0
        for tail, e in node.entries.items():
            assert e.node is node and e.tail == tail, f"{where}: {e} hangs wrongly"
            assert e.tokens.tobytes() == prefix + tail and len(tail) < bb, f"{where}: {e} tokens"
            group = prefix[:bb] if e.trimmable and prefix else None
            assert e.group == group, f"{where}: {e} in group {e.group!r}, want {group!r}"
            hung.append(e)
            if not e.trimmable:
                nt += 1
            elif _less_rewinding(e, best):
                best = e
        for first, child in node.children.items():
            assert child.parent is node, f"{where}: a child's parent"
            assert child.key and len(child.key) % bb == 0, f"{where}: an edge of part blocks"
            assert child.key[:bb] == first, f"{where}: a child under another first block"
            assert child.depth == node.depth + len(child.key) // bb, f"{where}: a depth"
            assert child.entries or len(child.children) > 1, f"{where}: an unneeded node"
            b, n = visit(child, prefix + child.key)
            nt += n
            if b is not None and _less_rewinding(b, best):
                best = b
        assert node.best is best, f"{where}: best {node.best}, want {best}"
        assert node.nt == nt, f"{where}: nt {node.nt}, want {nt}"
        return best, nt

    visit(tree.root, b"")
    assert sorted(e.born for e in hung) == [e.born for e in index], f"{where}: entries hung"


# The lookup tie rule (docs/architecture.md), restated here rather than imported from the
# code under check: the shortest, then the newest.
def _less_rewinding(a: Any, b: Any) -> bool:
    return b is None or (len(a.tokens), -a.born) < (len(b.tokens), -b.born)
