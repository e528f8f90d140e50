"""`Request`: one generation as the engine takes it (prompt ids, sampling, processors,
stops), and the one rule for using it again (`take_processors`). A bottom module: the
lanes, the memory budget and every front end name it without importing each other."""

from __future__ import annotations

import types
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mlxcache.errors import UserInputError
from mlxcache.sampling import LogitsProcessor, SamplingParams


@dataclass(slots=True)
class Request:
    """One generation: prompt token ids, sampling, and optional logits processors."""

    tokens: Sequence[int] | np.ndarray
    sampling: SamplingParams = field(default_factory=SamplingParams)
    processors: list[LogitsProcessor] = field(default_factory=list)
    stop_tokens: frozenset[int] | None = None
    """Token ids that end the reply; default: the tokenizer's end-of-turn ids."""
    stop_strings: tuple[str, ...] = ()
    """Texts that end the reply; the reply's text stops before the first one."""
    follow: bool = False
    """The client may send the next turn the moment this reply ends: the engine keeps the
    reply for it by its own mechanism (`NextTurn`), a follow lane where that is FOLLOW."""
    logprobs: int | None = None
    """k: every Token carries its log-probability and the k most likely tokens' (`decode`)."""
    draft: str | None = None
    """Speculative decoding: "auto", "lookup", "model" or "off" (`drafting`); None: the
    engine's setting. A drafted reply is the plain one, bit for bit."""


_TAKEN: dict[int, Callable[[], Any]] = {}
"""The stateful logits processors a submission has taken, by identity (see
`take_processors`): a weak reference each, dropped with its processor, or the processor
itself where it takes no weak reference. By identity, not by hash: a processor need not be
hashable (an `eq` dataclass is not)."""


def take_processors(request: Request) -> None:
    """Mark `request`'s stateful logits processors as serving its reply: the one place
    that decides reuse. A processor object (a grammar matcher, a thinking budget) advances
    with the reply it serves, so a request is reusable only without one; plain functions
    (mlx-lm's penalties and bias) read the tokens they are given and hold no state.

    Raises:
        UserInputError: a processor of `request` served an earlier submission (its state
            is that run's: the reply would degenerate silently).
    """
    stateful = [p for p in request.processors if not isinstance(p, types.FunctionType)]
    if any(_taken(p) for p in stateful):
        raise UserInputError(
            "this request was submitted before: its logits processors (a grammar, a thinking "
            "budget) hold that run's state; build a new request for each submission"
        )
    for p in stateful:
        _take(p)


def _taken(processor: Any) -> bool:
    ref = _TAKEN.get(id(processor))
    return ref is not None and ref() is processor


def _take(processor: Any) -> None:
    key = id(processor)
    try:
        _TAKEN[key] = weakref.ref(processor, lambda _ref: _TAKEN.pop(key, None))
    except TypeError:  # no weak reference to it: kept itself, so its id is never reused
        _TAKEN[key] = lambda: processor
