"""Randomized differential runs: `PromptIndex` and a reference index, driven in lockstep.

After every operation the whole visible state is compared: the entries and their fields,
whether each is extended, a `victim()` with a random skip and prompt, and a `lookup()` of a
random prompt (applied to both, since a hit counts as a use). Any difference fails an assert
that names the operation. Adds evict as the store does: to free a slot before the add
(`evict_first`), or to fit a budget after it, never the entry just added.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

from index_tree import check_tree
from naive_index import NaiveIndex

from mlxcache.cache.index import PromptIndex

OPS = ("add", "add", "add", "add", "lookup", "lookup", "pin", "unpin", "touch", "remove")


class Run:
    def __init__(
        self,
        ref_cls: type[NaiveIndex],
        *,
        seed: int,
        store: int,
        block_size: int,
        evict_first: bool,
        vocab: int = 3,
        max_blocks: int = 12,
        ops: Sequence[str] = OPS,
    ) -> None:
        self.rng = random.Random(seed)
        self.real = PromptIndex(block_size)
        self.ref = ref_cls(block_size)
        self.store = store
        self.evict_first = evict_first
        self.b = block_size
        self.vocab = vocab
        self.max_len = max_blocks * block_size
        self.history: list[tuple[int, ...]] = []
        self.ops = ops
        self.stats: Counter[str] = Counter()
        self.step = ""

    # Prompts: mostly continuations and forks of what is stored, so prefixes run long.

    def _suffix(self, n: int) -> tuple[int, ...]:
        return tuple(self.rng.randrange(self.vocab) for _ in range(n))

    def prompt(self) -> tuple[int, ...]:
        rng, pool = self.rng, [e.tokens for e in self.ref.entries] + self.history[-8:]
        r = rng.random()
        if not pool or r < 0.08:
            out = self._suffix(rng.randint(1, self.max_len))
        else:
            base = tuple(rng.choice(pool))
            if r < 0.40:  # fork: an earlier state, then something new
                out = base[: rng.randint(0, len(base))] + self._suffix(rng.randint(0, 3 * self.b))
            elif r < 0.55:  # exactly a stored prompt
                out = base
            elif r < 0.80:  # a resumed conversation
                out = base + self._suffix(rng.randint(1, 3 * self.b))
            else:  # a shorter prefix, often on a block boundary
                cut = rng.randint(0, len(base))
                out = base[: cut // self.b * self.b if rng.random() < 0.5 else cut]
        out = out[: self.max_len]
        if out:
            self.history.append(out)
        return out

    # Operations, applied to both indexes.

    def _pick(self, want: Callable[[Any], bool]) -> tuple[Any, Any] | None:
        pairs = [p for p in zip(self.real, self.ref.entries, strict=True) if want(p[1])]
        return self.rng.choice(pairs) if pairs else None

    def add(self) -> None:
        tokens = self.prompt() or self._suffix(1)
        trimmable = self.rng.random() < 0.85
        nbytes = self.rng.randrange(100)
        while self.evict_first and len(self.ref.entries) >= self.store:
            if not self.evict(tokens, None, None):
                break
        e = self.real.add(tokens, trimmable=trimmable, nbytes=nbytes)
        r = self.ref.add(tokens, trimmable=trimmable, nbytes=nbytes)
        assert e.born == r.born, f"{self.step}: add -> {e.born}, reference {r.born}"
        self.stats["adds"] += 1
        while not self.evict_first and len(self.ref.entries) > self.store:
            if not self.evict(tokens, e, r):
                break

    def evict(self, prompt: tuple[int, ...], skip: Any, rskip: Any) -> bool:
        """Remove the victim for `prompt` (never `skip`) from both; False if there is none."""
        v, rv = self.real.victim(skip, prompt), self.ref.victim(rskip, prompt)
        assert _born(v) == _born(rv), f"{self.step}: evict victim {v} vs {_born(rv)}"
        if v is None or rv is None:
            return False
        self.real.remove(v)
        self.ref.remove(rv)
        self.stats["evictions"] += 1
        return True

    def lookup(self) -> None:
        prompt = self.prompt()
        m, rm = self.real.lookup(prompt), self.ref.lookup(prompt)
        got = None if m is None else (m.entry.born, m.length)
        want = None if rm is None else (rm[0].born, rm[1])
        assert got == want, f"{self.step}: lookup({prompt}) -> {got}, reference {want}"
        self.stats["hits" if got else "misses"] += 1

    def op(self, name: str) -> None:
        if name in ("add", "lookup"):
            getattr(self, name)()
            return
        if name == "unpin":
            pair = self._pick(lambda e: e.pins > 0)
        elif name in ("pin", "remove"):
            # Keep most entries unpinned so victims and evictions stay interesting.
            pinned = sum(e.pins > 0 for e in self.ref.entries)
            pair = self._pick(lambda e: e.pins == 0) if name == "remove" or pinned < 3 else None
        else:
            pair = self._pick(lambda e: True)
        if pair is not None:
            getattr(self.real, name)(pair[0])
            getattr(self.ref, name)(pair[1])
            self.stats[name] += 1

    # The comparison after every operation.

    def check(self) -> None:
        check_tree(self.real, self.step)
        real, ref = list(self.real), self.ref.entries
        assert len(real) == len(ref), f"{self.step}: {len(real)} entries, reference {len(ref)}"
        for e, r in zip(real, ref, strict=True):
            got = (e.born, e.last_used, e.trimmable, e.pins, e.nbytes)
            want = (r.born, r.last_used, r.trimmable, r.pins, r.nbytes)
            assert got == want, f"{self.step}: entry {got}, reference {want}"
            assert tuple(e.tokens.tolist()) == r.tokens, f"{self.step}: tokens of {e}"
            extended = bool(e.extenders)
            assert extended == self.ref.extended(r), f"{self.step}: extended({e}) {extended}"
        prompt = self.prompt() if self.rng.random() < 0.8 else None
        i = self.rng.randrange(len(real) + 1)
        skip, rskip = (real[i], ref[i]) if i < len(real) else (None, None)
        v, rv = self.real.victim(skip, prompt), self.ref.victim(rskip, prompt)
        assert _born(v) == _born(rv), f"{self.step}: victim(skip={skip}) {v} vs {_born(rv)}"
        self.lookup()

    def run(self, ops: int) -> Counter[str]:
        for n in range(ops):
            name = self.rng.choice(self.ops)
            self.step = f"op {n} ({name})"
            self.op(name)
            self.check()
        return self.stats


def _born(e: Any) -> int | None:
    return None if e is None else int(e.born)
