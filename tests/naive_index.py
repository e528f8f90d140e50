"""The prompt index written straight from its semantics (docs/architecture.md), with no care for cost.

The reference the optimized `mlxcache.cache.index.PromptIndex` is checked against. Every
rule is one short method, so the differential tests can break exactly one of them.
"""

from __future__ import annotations

from collections.abc import Sequence


class NaiveEntry:
    def __init__(self, tokens: tuple[int, ...], born: int, trimmable: bool, nbytes: int) -> None:
        self.tokens = tokens
        self.born = born
        self.last_used = born
        self.trimmable = trimmable
        self.pins = 0
        self.nbytes = nbytes


def lcp(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    while n < len(a) and n < len(b) and a[n] == b[n]:
        n += 1
    return n


def usable(tokens: Sequence[int], trimmable: bool, prompt: Sequence[int], block_size: int) -> int:
    """How many tokens of `prompt` an entry of `tokens` restores (the spec's usable length)."""
    if trimmable:
        return max(0, min(lcp(tokens, prompt), len(prompt) - 1)) // block_size * block_size
    is_prefix = tuple(prompt[: len(tokens)]) == tuple(tokens)
    return len(tokens) if is_prefix and len(tokens) < len(prompt) else 0


class NaiveIndex:
    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.entries: list[NaiveEntry] = []  # in born order
        self.clock = 0
        # extended() is O(E * L) and asked for every entry after every step: remember the
        # answers until the next change of entries or clock.
        self.changes = 0
        self.memo: dict[NaiveEntry, bool] = {}
        self.memo_at = -1

    def tick(self) -> int:
        self.changes += 1
        self.clock += 1
        return self.clock

    def usable(self, e: NaiveEntry, prompt: Sequence[int]) -> int:
        return usable(e.tokens, e.trimmable, prompt, self.block_size)

    def extends(self, f: NaiveEntry, e: NaiveEntry) -> bool:
        return (
            f.trimmable
            and f.born > e.born
            and len(f.tokens) > len(e.tokens)
            and f.tokens[: len(e.tokens)] == e.tokens
        )

    def extended(self, e: NaiveEntry) -> bool:
        if self.memo_at != self.changes:
            self.memo, self.memo_at = {}, self.changes
        if e not in self.memo:
            self.memo[e] = any(self.extends(f, e) for f in self.entries)
        return self.memo[e]

    def lookup_key(self, e: NaiveEntry, usable: int) -> tuple[int, int, int]:
        return (usable, -len(e.tokens), e.born)

    def lookup(self, prompt: Sequence[int]) -> tuple[NaiveEntry, int] | None:
        scored = [(self.lookup_key(e, self.usable(e, prompt)), e) for e in self.entries]
        if not scored:
            return None
        _, best = max(scored, key=lambda s: s[0])
        length = self.usable(best, prompt)
        if length == 0:
            return None
        self.touch(best)
        return best, length

    def victim_key(self, e: NaiveEntry, prompt: Sequence[int] | None) -> tuple[int, ...]:
        cls = 0 if self.extended(e) else 1
        useful = prompt is not None and self.usable(e, prompt) > 0
        return (cls, int(useful), e.last_used, e.born)

    def victim(
        self, skip: NaiveEntry | None = None, prompt: Sequence[int] | None = None
    ) -> NaiveEntry | None:
        candidates = [e for e in self.entries if not e.pins and e is not skip]
        return min(candidates, key=lambda e: self.victim_key(e, prompt), default=None)

    def add(self, tokens: Sequence[int], trimmable: bool = True, nbytes: int = 0) -> NaiveEntry:
        tokens = tuple(int(t) for t in tokens)
        for e in self.entries:
            if e.tokens == tokens:
                self.readd(e, nbytes)
                return e
        e = NaiveEntry(tokens, self.tick(), trimmable, nbytes)
        self.entries.append(e)
        return e

    def readd(self, e: NaiveEntry, nbytes: int) -> None:
        e.nbytes = nbytes
        self.touch(e)

    def remove(self, e: NaiveEntry) -> None:
        self.changes += 1
        self.entries.remove(e)

    def pin(self, e: NaiveEntry) -> None:
        e.pins += 1

    def unpin(self, e: NaiveEntry) -> None:
        e.pins -= 1

    def touch(self, e: NaiveEntry) -> None:
        e.last_used = self.tick()
