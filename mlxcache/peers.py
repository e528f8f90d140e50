"""The engine's seam for sharded runs: what it needs of the other ranks (`Peers`), and the
engine calls rank 0 may tell them to make (`TOLD`).

`distributed.Ranks` implements `Peers`; the engine knows only this protocol, so it never
imports `distributed` (which imports the engine to make the calls it is told).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, ParamSpec, Protocol, TypeVar

from mlxcache.decode import Share
from mlxcache.errors import RankError


class Peers(Share, Protocol):
    """The other processes of a sharded run, as the engine sees them."""

    stepping: bool
    """Inside an engine call every rank makes (`step`)."""

    @property
    def leader(self) -> bool:
        """This process is rank 0: it tells the others each call it makes."""
        ...

    def step(self) -> AbstractContextManager[None]:
        """Around an engine call every rank makes."""
        ...

    def tell(self, engine: Any, op: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Rank 0: the others are to make engine call `op` (one of `TOLD`) now."""
        ...

    def lost(self, exc: Exception) -> RankError:
        """The run cannot go on (`exc` left the ranks out of step): the error to raise."""
        ...

    def close(self) -> None:
        """Rank 0: the run is over, the others stop following."""
        ...


P = ParamSpec("P")
R = TypeVar("R")

TOLD = frozenset({"submit", "warm", "step", "cancel", "cancel_warm", "_whole_turn"})
"""The engine calls that change which forward calls are made: rank 0 tells the others to
make each (the engine's methods marked `told`: it refuses to mark any other), and a follower
makes no other (`replay`). `tests/test_distributed.py` checks that each is one."""


def told(method: Callable[P, R]) -> Callable[P, R]:
    """An engine call that changes which forward calls are made (one of `peers.TOLD`): on
    rank 0 of a sharded run, the other ranks are told to make it too, unless it is made
    from within another such call (which they make themselves)."""
    if method.__name__ not in TOLD:
        raise TypeError(f"{method.__name__} is not an engine call the ranks are told")

    @functools.wraps(method)
    def call(*args: P.args, **kwargs: P.kwargs) -> R:
        engine: Any = args[0]  # the engine whose method this is
        ranks: Peers | None = engine.ranks
        if ranks is None or ranks.stepping:
            return method(*args, **kwargs)
        if ranks.leader:
            ranks.tell(engine, method.__name__, args[1:], kwargs)
        with ranks.step():
            return method(*args, **kwargs)

    return call


def replay(engine: Any, op: str) -> Callable[..., Any]:
    """The engine call named `op`, as a follower makes it when rank 0 tells it to.

    Raises:
        RankError: `op` is not a call rank 0 tells (another version of mlxcache on rank 0).
    """
    if op not in TOLD:
        raise RankError(f"rank 0 asked for engine call {op!r}, which no rank makes")
    method: Callable[..., Any] = getattr(engine, op)
    return method
