"""Whether and how a request's reply is drafted: the engine's speculative decoding policy.

A request asks for a drafter (`Request.draft`, else the engine's `DraftConfig.mode`); it
gets one only where drafting keeps the reply plain decoding's, bit for bit: the verify
probe (`invariance.verify_probe`) found a forward width whose rows are one-row decode
steps on this device, for this model. Elsewhere drafting is off (said once), unless
`inexact` was asked for (said once too: replies may then differ from plain decoding).
"auto" drafts only where verify is also cheap: on MLX's CPU backend a forward costs the
same per token whatever its width (`mlxcache bench spec` measures it), so there it is off
without a probe.

In a sharded run (`mlx.launch`) every rank feeds the verify forward the same rows: lookup
drafts are the same on every rank (they read the shared picks), and a draft model's are
rank 0's (`Shared`): the other ranks' copies of it are never run (their chips may compute
other bits).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np

from mlxcache.cache.base import PrefixCache
from mlxcache.config import DRAFTS, MAX_DRAFT, DraftConfig
from mlxcache.decode import Share
from mlxcache.decode_batch import plain
from mlxcache.draft import Drafter, Lookup, ModelDrafter
from mlxcache.errors import UserInputError
from mlxcache.invariance import Verify, batch_verify_probe, verify_probe
from mlxcache.model import LoadedModel
from mlxcache.types import new_layers

PAYS_OFF = 0.5
"""auto: draft where a verify forward of w rows costs at most this much of w one-row steps."""


@dataclass(frozen=True, slots=True)
class Plan:
    """A request's drafting: the drafter's kind ("lookup" or "model"), k, the most tokens
    it drafts per verify forward, and whether its verify forwards are rows of the decode
    batch (else its own, beside the batch)."""

    kind: str
    k: int
    batched: bool = False


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
        on_warning: told once when drafting asked for is off, or runs inexact.
        on_note: told when the probe measures (seconds on a real model, once).
        leader: False on the ranks other than 0 of a sharded run, which take rank 0's
            drafts of the draft model (`Shared`) instead of running their own.
    """

    def __init__(
        self,
        loaded: LoadedModel,
        config: DraftConfig,
        block_size: int,
        record: Path | None,
        draft_model: DraftModel | None = None,
        on_warning: Callable[[str], None] | None = None,
        on_note: Callable[[str], None] | None = None,
        leader: bool = True,
    ) -> None:
        self.loaded = loaded
        self.leader = leader
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
            self._verify = verify_probe(self.loaded, self.block_size, self.record, self._note)
        return self._verify

    def plan(self, mode: str | None = None, batch: bool = False) -> Plan | None:
        """How a request asking for `mode` (None: the engine's) is drafted; None: plain.
        `batch`: the engine decodes in a batch; the plan's verify forwards join it where
        the model's KV is plain and the probe found drafted rows there exact
        (`invariance.batch_verify_width`; k is then at most what it passed).

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
        k = self.config.tokens
        if mode == "auto":
            if mx.default_device() == mx.cpu:  # a verify row costs a decode step here
                return None
            found = self.verify()
            if found.width < 2 or found.cost > PAYS_OFF * found.width:
                return None
            return self._batched(Plan(kind, min(k, found.width - 1)), batch)
        found = self.verify()
        if found.width >= 2:
            return self._batched(Plan(kind, min(k, found.width - 1)), batch)
        if self.config.inexact:
            self._once(
                "drafting inexact: this device's verify forwards are not bitwise decode steps "
                "for this model, so drafted replies may differ from plain decoding"
            )
            return Plan(kind, k)
        self._once(
            "drafting off: this device's verify forwards are not bitwise decode steps for "
            "this model (--draft-inexact drafts anyway; replies may then differ)"
        )
        return None

    def _batched(self, plan: Plan, batch: bool) -> Plan:
        """`plan` with its rows in the decode batch, where they are exact there."""
        if not batch:
            return plan
        if self._batch_width is None:  # other caches have no per-row rewind: not probed
            self._batch_width = (
                batch_verify_probe(self.loaded, self.block_size, self.record, self._note)
                if plain(new_layers(self.loaded.model))
                else 1
            )
        if self._batch_width < 2:
            return plan
        return Plan(plan.kind, min(plan.k, self._batch_width - 1), batched=True)

    def drafter(self, plan: Plan, share: Share | None = None) -> Drafter:
        """A new drafter for one reply (`share`: a sharded run's, see `Shared`)."""
        if plan.kind == "model" and self.draft_model is not None:
            own = ModelDrafter(self.draft_model.loaded.model, self.draft_model.cache)
            return own if share is None else Shared(own if self.leader else None, share)
        return Lookup(self.config.ngram)

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
