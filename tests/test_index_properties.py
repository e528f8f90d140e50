"""Hypothesis: a state machine drives `PromptIndex` and the naive reference together, and
checks the invariants the index semantics (docs/architecture.md) imply on every step."""

from __future__ import annotations

from typing import Any

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from index_tree import check_tree
from naive_index import NaiveIndex, usable

from mlxcache.cache.index import Entry, PromptIndex

pytestmark = pytest.mark.slow  # long random operation sequences

B = 3
SLOTS = 7


class IndexMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.real = PromptIndex(B)
        self.ref = NaiveIndex(B)

    def pairs(self) -> list[tuple[Entry, Any]]:
        return list(zip(self.real, self.ref.entries, strict=True))

    def draw_prompt(self, data: st.DataObject) -> list[int]:
        bases = [()] + [r.tokens for r in self.ref.entries]
        base = data.draw(st.sampled_from(bases))
        cut = data.draw(st.just(len(base)) | st.integers(0, len(base)))
        return list(base[:cut]) + data.draw(st.lists(st.integers(0, 2), max_size=2 * B + 1))

    def draw_pair(self, data: st.DataObject) -> tuple[Entry, Any]:
        return data.draw(st.sampled_from(self.pairs()))

    @rule(data=st.data(), trimmable=st.booleans(), nbytes=st.integers(0, 9))
    def add(self, data: st.DataObject, trimmable: bool, nbytes: int) -> None:
        """An add that first frees a slot, as the store does (none when all are pinned)."""
        tokens = self.draw_prompt(data) or [0]
        while len(self.real) >= SLOTS:
            v, rv = self.real.victim(prompt=tokens), self.ref.victim(prompt=tokens)
            assert (v and v.born) == (rv and rv.born)
            if v is None or rv is None:
                break
            self.real.remove(v)
            self.ref.remove(rv)
        e = self.real.add(tokens, trimmable=trimmable, nbytes=nbytes)
        assert e.born == self.ref.add(tokens, trimmable=trimmable, nbytes=nbytes).born
        assert len(self.real) <= SLOTS or all(x.pins for x in self.real if x is not e)

    @rule(data=st.data())
    def lookup(self, data: st.DataObject) -> None:
        prompt = self.draw_prompt(data)
        best = max(
            (usable(e.tokens.tolist(), e.trimmable, prompt, B) for e in self.real), default=0
        )
        m, rm = self.real.lookup(prompt), self.ref.lookup(prompt)
        assert (m and (m.entry.born, m.length)) == (rm and (rm[0].born, rm[1]))
        if m is None:
            assert best == 0
            return
        assert m.length == best > 0
        assert m.length < len(prompt)
        assert m.entry.tokens[: m.length].tolist() == prompt[: m.length]
        if m.entry.trimmable:
            assert m.length % B == 0
        else:
            assert m.length == len(m.entry.tokens)

    @rule(data=st.data())
    def victim(self, data: st.DataObject) -> None:
        prompt = self.draw_prompt(data) if data.draw(st.booleans()) else None
        pairs = self.pairs()
        skip, rskip = data.draw(st.sampled_from([(None, None), *pairs]))
        v, rv = self.real.victim(skip, prompt), self.ref.victim(rskip, prompt)
        assert (v and v.born) == (rv and rv.born)
        candidates = [e for e, _ in pairs if not e.pins and e is not skip]
        assert (v is None) == (not candidates)
        if v is not None:
            assert not v.pins and v is not skip

            def key(e: Entry) -> tuple[int, ...]:
                cls = 0 if e.extenders else 1
                useful = (
                    prompt is not None and usable(e.tokens.tolist(), e.trimmable, prompt, B) > 0
                )
                return (cls, useful, e.last_used, e.born)

            assert key(v) == min(map(key, candidates))

    @precondition(lambda self: len(self.real) > 0)
    @rule(data=st.data(), op=st.sampled_from(["touch", "pin", "unpin", "remove"]))
    def change(self, data: st.DataObject, op: str) -> None:
        e, r = self.draw_pair(data)
        if (op == "unpin" and not e.pins) or (op == "remove" and e.pins):
            return
        getattr(self.real, op)(e)
        getattr(self.ref, op)(r)

    @invariant()
    def tree_shape(self) -> None:
        check_tree(self.real)

    @invariant()
    def same_entries(self) -> None:
        for e, r in self.pairs():
            assert (e.born, e.last_used, e.trimmable, e.pins, e.nbytes) == (
                r.born,
                r.last_used,
                r.trimmable,
                r.pins,
                r.nbytes,
            )
            assert tuple(e.tokens.tolist()) == r.tokens

    @invariant()
    def extended_has_a_witness(self) -> None:
        entries = list(self.real)
        for e in entries:
            n = len(e.tokens)
            witness = any(
                f.trimmable
                and f.born > e.born
                and len(f.tokens) > n
                and f.tokens[:n].tolist() == e.tokens.tolist()
                for f in entries
            )
            assert bool(e.extenders) == witness

    @invariant()
    def born_order_and_unique_clock(self) -> None:
        borns = [e.born for e in self.real]
        assert borns == sorted(borns)
        stamps = [e.last_used for e in self.real]
        assert len(set(stamps)) == len(stamps)


IndexMachine.TestCase.settings = settings(
    max_examples=200,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestIndexMachine = IndexMachine.TestCase
