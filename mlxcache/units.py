"""Units of work in flight on one engine: up to N at once, results in order.

A unit is a coroutine: it yields the requests of a step (submitted together), receives
their results in the same order, and returns its value. A JSONL batch line is a one-step
unit; a regress chat case is a unit whose later turns depend on earlier replies. The
requests run in the engine's lanes, which only interleave model calls, so every result is
the one its request gets alone.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterable, Iterator
from typing import TypeVar

from mlxcache.engine import Engine, Request
from mlxcache.events import Done, Result

K = TypeVar("K")
T = TypeVar("T")
Steps = Generator[list[Request], list[Result], T]


def one_request(make: Callable[[], Request]) -> Steps[Result]:
    """A unit of a single request, built when the unit starts (processors are stateful)."""
    (result,) = yield [make()]
    return result


def run_units(
    engine: Engine, units: Iterable[tuple[K, Callable[[], Steps[T]]]], width: int
) -> Iterator[tuple[K, T]]:
    """Run `units` (key, start) with up to `width` at once; yield (key, value) in unit order.

    A value is yielded as soon as it and every unit before it are done, after the next
    units started: the model keeps working while the caller handles it.
    """
    if width < 1:
        raise ValueError(f"width must be >= 1, got {width}")
    pending = iter(units)
    keys: list[K] = []
    active: dict[int, tuple[Steps[T], list[int], dict[int, Result]]] = {}  # by unit index
    owner: dict[int, int] = {}  # request id -> unit index
    finished: dict[int, T] = {}

    def advance(index: int, unit: Steps[T], results: list[Result] | None) -> None:
        """Feed `results` to the unit (None starts it) and submit its next step."""
        try:
            requests = next(unit) if results is None else unit.send(results)
            while not requests:  # a step without requests gets its (empty) results at once
                requests = unit.send([])
        except StopIteration as stop:
            finished[index] = stop.value
            return
        rids = [engine.submit(r) for r in requests]
        active[index] = (unit, rids, {})
        owner.update(dict.fromkeys(rids, index))

    def fill() -> None:
        while len(active) < width:
            started = next(pending, None)
            if started is None:
                return
            keys.append(started[0])
            advance(len(keys) - 1, started[1](), None)

    emitted = 0
    try:
        fill()
        while True:
            while emitted in finished:
                yield keys[emitted], finished.pop(emitted)
                emitted += 1
            if not active:
                return
            for event in engine.run():  # units started meanwhile join the next step
                if not isinstance(event, Done) or event.request_id not in owner:
                    continue
                index = owner.pop(event.request_id)
                unit, rids, got = active[index]
                got[event.request_id] = event.result
                if len(got) < len(rids):
                    continue
                del active[index]
                advance(index, unit, [got[r] for r in rids])
                fill()
                while emitted in finished:
                    yield keys[emitted], finished.pop(emitted)
                    emitted += 1
    finally:  # stopped early (closed, an exception): no request is left behind, pinned
        for rid in list(owner):
            engine.cancel(rid)
