"""Whether and how a request's reply is drafted: the engine's speculative decoding policy.

A request asks for a drafter (`Request.draft`, else the engine's `DraftConfig.mode`); it
gets one only where drafting keeps the reply plain decoding's, bit for bit: the verify
probe (`invariance.verify_probe`) found a forward width whose rows are one-row decode
steps on this device, for this model. Elsewhere drafting is off (said once), unless
`inexact` was asked for (said once too: replies may then differ from plain decoding).
Unless asked for, lookup's n and k are the pair that drafts cheapest per token on this
device (`choose`): what each pair yields is measured once, off the device (`PROFILE`),
what a forward of each width costs is the probe's timing here (a draft model's k is chosen
by the same rule). "auto" drafts only where that beats plain decoding: on MLX's CPU
backend a forward costs about the same per token whatever its width (`mlxcache bench
spec` measures it), so there it is off without a probe.

In a sharded run (`mlx.launch`) every rank feeds the verify forward the same rows: lookup
drafts are the same on every rank (they read the shared picks, and every rank takes rank
0's timed costs, so the same n and k), and a draft model's are rank 0's (`Shared`): the
other ranks' copies of it are never run (their chips may compute other bits).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np

from mlxcache.cache.base import PrefixCache
from mlxcache.config import DRAFTS, MAX_DRAFT, DraftConfig
from mlxcache.decode import Share
from mlxcache.decode_batch import batchable
from mlxcache.draft import Drafter, Lookup, ModelDrafter
from mlxcache.errors import UserInputError
from mlxcache.invariance import Note, Verify, batch_verify_probe, verify_probe
from mlxcache.model import LoadedModel
from mlxcache.types import new_layers

PROFILE: dict[tuple[int, int], tuple[float, float]] = {
    (1, 1): (1.327, 0.742),
    (1, 2): (1.504, 0.72),
    (1, 4): (1.669, 0.698),
    (1, MAX_DRAFT): (1.85, 0.676),
    (2, 1): (1.277, 0.481),
    (2, 2): (1.391, 0.447),
    (2, 4): (1.533, 0.417),
    (2, MAX_DRAFT): (1.624, 0.392),
    (3, 1): (1.279, 0.48),
    (3, 2): (1.405, 0.442),
    (3, 4): (1.544, 0.413),
    (3, MAX_DRAFT): (1.638, 0.387),
    (4, 1): (1.276, 0.481),
    (4, 2): (1.41, 0.44),
    (4, 4): (1.54, 0.414),
    (4, MAX_DRAFT): (1.638, 0.387),
}
"""Prompt lookup's yield for each (n-gram size n, k drafts), k a probed width less one:
(tokens a verify forward yields, share of the forwards that carry drafts; a lookup that
finds its n-gram drafts k tokens, else the forward is a plain step). Means over the `bench
spec` workloads (code rewrite, JSON batch, regress smoke suite, free-form chat), as
`mlxcache bench spec --sweep` measured them on SmolLM2: device-independent, since a
drafted reply is the plain one."""


def cost_of(costs: dict[int, float], width: int) -> float | None:
    """A verify forward of `width` rows in one-row steps' time: the probe's `costs`, linear
    between the widths it timed (one row costs one); None past the widest."""
    known = {1: 1.0, **costs}
    if width in known:
        return known[width]
    above = min((w for w in known if w > width), default=None)
    if above is None:
        return None
    below = max(w for w in known if w < width)
    share = (width - below) / (above - below)
    return known[below] + share * (known[above] - known[below])


def expected(
    costs: dict[int, float], ngram: int, k: int, profile: dict[tuple[int, int], tuple[float, float]]
) -> float:
    """The decode time of lookup drafting (n, k) against plain decoding's one forward per
    token, by this device's verify `costs` and the `profile`'s yield."""
    per_forward, share = profile[ngram, k]
    return (share * costs[k + 1] + (1 - share)) / per_forward


def choose(
    costs: dict[int, float],
    widest: int,
    ngram: int | None = None,
    k: int | None = None,
    profile: dict[tuple[int, int], tuple[float, float]] = PROFILE,
) -> tuple[int, int, float]:
    """(n, k) for lookup drafting on this device, and its expected decode time against
    plain decoding (`expected`): the profiled pair of forwards at most `widest` rows that
    this device's `costs` make cheapest per token, among those that keep the `ngram` or
    `k` asked for (any pair, where none does); what was asked for is kept."""
    pairs = [(n, j) for n, j in profile if j + 1 <= widest and j + 1 in costs]
    fitting = [(n, j) for n, j in pairs if ngram in (None, n) and k in (None, j)] or pairs
    ratio, n, j = min((expected(costs, n, j, profile), n, j) for n, j in fitting)
    return ngram or n, min(k or j, widest - 1), round(ratio, 3)


@dataclass(frozen=True, slots=True)
class Plan:
    """A request's drafting: the drafter's kind ("lookup" or "model"), k, the most tokens
    it drafts per verify forward, whether its verify forwards are rows of the decode batch
    (else its own, beside the batch), and lookup's longest n-gram."""

    kind: str
    k: int
    batched: bool = False
    ngram: int = 3


@dataclass(frozen=True, slots=True)
class DraftModel:
    """A draft model and its own prompt cache (the model's key is its namespace)."""

    loaded: LoadedModel
    cache: PrefixCache


class Drafting:
    """The engine's drafting settings, with what the probe measured (once, when first asked).

    Args:
        loaded: the target model.
        config: the settings (`DraftConfig`).
        block_size: the engine's prefill chunk (the probe prefills its prefix with it).
        record: where probe answers are recorded; None: measured at each start (a sharded
            run: every rank must make the probe's forwards).
        draft_model: the draft model, when `config.model` names one.
        on_warning: told once when drafting asked for is off, runs inexact, or cannot pay
            (its expected time per token, `choose`, is plain decoding's or more).
        on_note: told as the probe measures (`events.Probing`; seconds to minutes on a
            real model, once).
        leader: False on the ranks other than 0 of a sharded run, which take rank 0's
            drafts of the draft model (`Shared`) instead of running their own.
        from_leader: a sharded run's collective giving rank 0's values on every rank:
            the probe's timed costs are rank 0's, so every rank drafts the same k.
    """

    def __init__(
        self,
        loaded: LoadedModel,
        config: DraftConfig,
        block_size: int,
        record: Path | None,
        draft_model: DraftModel | None = None,
        on_warning: Callable[[str], None] | None = None,
        on_note: Note | None = None,
        leader: bool = True,
        from_leader: Callable[[np.ndarray, str], np.ndarray] | None = None,
    ) -> None:
        self.loaded = loaded
        self.leader = leader
        self._from_leader = from_leader
        self.config = config
        self.block_size = block_size
        self.record = record
        self.draft_model = draft_model
        self._warn = on_warning or (lambda _msg: None)
        self._note = on_note
        self._said: set[str] = set()
        self._verify: Verify | None = None
        self._batch_width: int | None = None

    @classmethod
    def off(cls, loaded: LoadedModel, block_size: int) -> Drafting:
        """Never drafts (an engine built without drafting settings)."""
        return cls(loaded, DraftConfig(mode="off"), block_size, None)

    def verify(self) -> Verify:
        """What the probe found for the target model on this device (measured once)."""
        if self._verify is None:
            found = verify_probe(self.loaded, self.block_size, self.record, self._note)
            if self._from_leader is not None:
                widths = sorted(found.costs)
                mine = np.array([found.costs[w] for w in widths], np.float64)
                lead = self._from_leader(mine, "the verify costs")
                found = Verify(found.passed, dict(zip(widths, lead.tolist(), strict=True)))
            self._verify = found
        return self._verify

    def plan(self, mode: str | None = None, batch: bool = False) -> Plan | None:
        """How a request asking for `mode` (None: the engine's) is drafted; None: plain.
        `batch`: the engine decodes in a batch; the plan's verify forwards join it where
        the probe found drafted rows there exact (`invariance.batch_verify_width`, for
        any cache layout that batches; k is then at most what it passed).

        Raises:
            UserInputError: an unknown mode, or "model" without a draft model.
        """
        mode = self.config.mode if mode is None else mode
        if mode not in DRAFTS:
            raise UserInputError(f"draft must be one of {', '.join(DRAFTS)}, got {mode!r}")
        if mode == "model" and self.draft_model is None:
            raise UserInputError("draft 'model' needs a draft model (serve --draft-model)")
        if mode == "off":
            return None
        kind = "model" if mode == "model" or self.draft_model is not None else "lookup"
        if mode == "auto" and mx.default_device() == mx.cpu:  # a verify row costs a row here
            return None
        found = self.verify()
        exact = found.width >= 2
        if exact or self.config.inexact:
            widest = found.width if exact else MAX_DRAFT + 1
            n, k, ratio = choose(found.costs, widest, self.config.ngram, self.config.tokens)
            if mode == "auto" and (not exact or ratio >= 1):
                return None
            if ratio >= 1:
                self._once(
                    f"drafting cannot pay on this device: its measured verify forwards make "
                    f"{kind} drafting ~{ratio:.2f}x plain decoding's time per token (--draft "
                    "auto leaves it off where so)"
                )
            plan = Plan(kind, k, ngram=n)
            if exact:
                return self._batched(plan, batch)
            self._once(
                "drafting inexact: this device's verify forwards are not bitwise decode steps "
                "for this model, so drafted replies may differ from plain decoding"
            )
            return plan
        if mode != "auto":
            self._once(
                "drafting off: this device's verify forwards are not bitwise decode steps for "
                "this model (--draft-inexact drafts anyway; replies may then differ)"
            )
        return None

    def _batched(self, plan: Plan, batch: bool) -> Plan:
        """`plan` with its rows in the decode batch, where they are exact there."""
        if not batch:
            return plan
        if self._batch_width is None:  # caches without a batched form: not probed
            self._batch_width = (
                batch_verify_probe(self.loaded, self.block_size, self.record, self._note)
                if batchable(new_layers(self.loaded.model))
                else 1
            )
        if self._batch_width < 2:
            return plan
        return dataclasses.replace(plan, k=min(plan.k, self._batch_width - 1), batched=True)

    def drafter(self, plan: Plan, share: Share | None = None) -> Drafter:
        """A new drafter for one reply (`share`: a sharded run's, see `Shared`)."""
        if plan.kind == "model" and self.draft_model is not None:
            own = ModelDrafter(self.draft_model.loaded.model, self.draft_model.cache)
            return own if share is None else Shared(own if self.leader else None, share)
        return Lookup(plan.ngram)

    def _once(self, message: str) -> None:
        if message not in self._said:
            self._said.add(message)
            self._warn(message)


class Shared:
    """Rank 0's drafts on every rank of a sharded run (`own`: rank 0's drafter, None on the
    others): sent with the picks' collective (`decode.Share.token`) as a count and up to
    `MAX_DRAFT` tokens, so every rank's verify forward has the same rows."""

    def __init__(self, own: Drafter | None, share: Share) -> None:
        self.own = own
        self.share = share

    def propose(self, tokens: np.ndarray, k: int) -> list[int]:
        drafts = self.own.propose(tokens, k) if self.own is not None else []
        sent = np.zeros(MAX_DRAFT + 1, np.uint32)
        sent[0] = len(drafts)
        sent[1 : 1 + len(drafts)] = drafts
        got = np.array(self.share.token(mx.array(sent)))
        return [int(t) for t in got[1 : 1 + int(got[0])]]

    def close(self) -> None:
        if self.own is not None:
            self.own.close()
