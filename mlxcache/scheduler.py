"""Which lane makes the engine's next model call: the lanes' queues and their kinds.

The engine runs three kinds of lanes over one model (`LaneKind`). The scheduler holds
them in two queues and picks whose turn it is (`whose_turn`: a `Turn`, which lists its
lanes and says what their forward is); the engine advances the lane and tells the
scheduler what became of it (`advanced`, `cancel`):

- **the round**: requests and follow lanes, in turn order. A lane that had its turn goes
  to the back. Requests always take their turn; a follow lane only while no request is
  prefilling (so it never delays a first token) and only when it has work (a block of
  prompt + reply completed, or its request has ended).
- **first tokens soonest**: a turn that falls to a request prefilling its prompt goes to
  the prefilling request due first: the one with the fewest prompt tokens left, counted
  from the prefill clock at its arrival (the tokens the requests had prefilled by then).
  Requests prefilling side by side would all give their first token late (four equal
  prompts: each after all four); one after the other, the first comes after one, the
  next after two... A short prompt goes before a long one's rest, but only by what the
  long one has waited, so none waits for ever. A request whose prompt is not looked up
  yet (or that waits for memory) takes its turns in the round: its first turn finds what
  it resumes, and so how much it has left.
- **waiting on a shared prompt**: a request not started yet whose prompt is mostly an
  earlier request's still being prefilled (`waits`: the engine's rule) waits for it, and
  then resumes what it kept instead of computing the same blocks beside it.
- **the warm queue**: warm-ahead lanes, oldest first. The oldest runs until it ends (one
  restored KV copy at a time), and only when the round has nothing to run.

Warm and follow lanes are the background kinds (`BACKGROUND`): `whose_turn(background=False)`
(requests are waiting to start) gives them no turn at all.

With batched decode, requests past their first token wait in the engine's decode batch
(`Phase.BATCHED`) and take their steps together: the batch's turn alternates with the lanes'.

A lane is data: its kind and its `Phase`. The engine advances a lane by a step and tells
the scheduler what that gave (`advanced`, a `Step`); the scheduler moves the lane to its
next phase and place and says whether the same turn goes on (`Go`): a request's first
token comes with its prompt's last chunk (sampling it is no model call, and waiting for
the next round would delay it by every other lane's turn), and a request past its first
token joins the decode batch at once (unless it is `solo`).
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar


class LaneKind(enum.Enum):
    """What a lane does, and so when it may run."""

    REQUEST = "request"
    """A request: prefill, then decode its reply; its events go to the caller."""
    WARM = "warm"
    """Warm-ahead: prefill a prefix the next request is expected to start with, and keep it."""
    FOLLOW = "follow"
    """Prefill and keep each block of a followed request's prompt + reply as it completes."""


class Phase(enum.Enum):
    """Where a lane is in its work."""

    RESTORING = "restoring"
    """Queued: its prompt not looked up yet (before its first turn)."""
    PREFILLING = "prefilling"
    """Computing its prompt's KV (a request before its first token; background lanes)."""
    DECODING = "decoding"
    """A request past its first token, taking its steps in its own turns."""
    BATCHED = "batched"
    """A request past its first token, waiting in the decode batch for its next forward."""
    DONE = "done"
    """Ended: out of the queues."""


PROMPT_PHASES = (Phase.RESTORING, Phase.PREFILLING)
"""A request in these has not given its first token: its forwards are its own."""


class Step(enum.Enum):
    """What one advance of a lane gave (`Scheduler.advanced`)."""

    CHUNK = "chunk"
    """Work that ends the turn: a prefill chunk, a background lane's step."""
    WAIT = "wait"
    """A turn without work: a request's, the memory budget has no room for it yet; a
    follow lane's, its reply has not completed a block past what is kept."""
    PROMPT_DONE = "prompt done"
    """A request's last prefill chunk: its prompt is all in the layers."""
    TOKEN = "token"
    """A request gave a token."""
    JOINED = "joined"
    """A request joined the decode batch to wait for its next forward."""
    ENDED = "ended"
    """The lane ended (a request with its `Done`)."""


class Go(enum.Enum):
    """Whether a lane's turn goes on after a step (`Scheduler.advanced`)."""

    END = "end"
    """The turn ends."""
    ON = "on"
    """It goes on (a request's first token, after its prompt's last chunk: sampling it is
    no model call), a forward the lane asks its own unless it is a row of the batch."""
    JOIN = "join"
    """It goes on to the decode batch: the lane's next forward is a row of the batch's."""


BACKGROUND = (LaneKind.WARM, LaneKind.FOLLOW)
"""The kinds that only keep KV for later requests: no events, and no turn while requests wait."""


class TurnKind(enum.Enum):
    """What a turn's model call is (`Turn`)."""

    PREFILL = "prefill"
    """A lane's prefill chunk: a request before its first token (which comes with its last
    chunk: sampling it is no model call), or a background lane's step."""
    DECODE = "decode"
    """A request past its first token, outside the batch: its own decode forward (a drafted
    request's: none, while it reads the rows of its last verify)."""
    VERIFY = "verify"
    """A drafted request outside the batch: its own verify forward (its last token and its
    drafts), then the first of its rows read."""
    BATCH = "batch"
    """The decode batch's forward: one for every row, each then on to its next token."""


@dataclass(frozen=True, slots=True)
class Turn:
    """Whose turn it is (`Scheduler.whose_turn`): the lanes whose forward the engine makes,
    and what that forward is. A lane's turn lists one lane; the batch's, its rows."""

    kind: TurnKind
    lanes: tuple[int, ...]

    @property
    def lane(self) -> int:
        """The lane of a lane's turn (not the batch's)."""
        if self.kind is TurnKind.BATCH:
            raise ValueError("the batch's turn has rows, not a lane")
        return self.lanes[0]


class Schedulable(Protocol):
    """What the scheduler reads of a lane."""

    @property
    def kind(self) -> LaneKind: ...

    @property
    def phase(self) -> Phase: ...

    @phase.setter
    def phase(self, phase: Phase) -> None: ...

    @property
    def solo(self) -> bool:
        """Whether every forward of the lane is its own: it never joins the decode batch (an
        engine that does not batch, a request run alone, or a drafted one whose verify
        forwards cannot be rows of it)."""
        ...

    @property
    def left(self) -> int | None:
        """A request's prompt tokens not prefilled yet; None before its prompt is looked up
        in the cache (or for a background lane)."""
        ...

    @property
    def verifies(self) -> bool:
        """Whether its next forward is a verify (a drafted request's)."""
        ...

    def has_work(self) -> bool:
        """Whether a turn would do something (a follow lane may wait for its reply)."""
        ...


L = TypeVar("L", bound=Schedulable)


class Scheduler(Generic[L]):
    """The engine's lanes by id, in their queues (see the module's doc). `waits(lane,
    earlier)`: whether a request not started yet waits for an earlier one's prefill."""

    def __init__(self, waits: Callable[[L, L], bool] | None = None) -> None:
        self._waits = waits
        self._lanes: dict[int, L] = {}
        self._round: deque[int] = deque()  # requests and follow lanes, next turn first
        self._warm: deque[int] = deque()  # warm-ahead lanes, oldest first
        self._follower: dict[int, int] = {}  # a followed request -> its follow lane
        self._batch_next = False  # the batch's turn comes next (it alternates with lanes)
        self._clock = 0  # prompt tokens the requests prefilled, all together (but for
        # each one's first chunk, made before its `left` is known)
        self._arrival: dict[int, int] = {}  # a request's clock when it was queued
        self._left: dict[int, int] = {}  # a request's `left` at its last turn

    def __contains__(self, rid: object) -> bool:
        return rid in self._lanes

    def __len__(self) -> int:
        return len(self._lanes)

    def __getitem__(self, rid: int) -> L:
        return self._lanes[rid]

    def add(self, rid: int, lane: L, follows: int | None = None) -> None:
        """Queue a new lane at the back of its queue; a follow lane names its request."""
        if rid in self._lanes:
            raise ValueError(f"lane {rid} is queued already")
        if (lane.kind is LaneKind.FOLLOW) != (follows is not None):
            raise ValueError("a follow lane, and only a follow lane, follows a request")
        self._lanes[rid] = lane
        (self._warm if lane.kind is LaneKind.WARM else self._round).append(rid)
        self._arrival[rid] = self._clock
        if follows is not None:
            self._follower[follows] = rid

    def whose_turn(self, background: bool = True, batch: Sequence[int] = ()) -> Turn | None:
        """Whose turn it is (a `Turn`), or None: nothing to run.

        The first lane of the round that may run (see the module's doc); while the decode
        batch has rows (`batch`, their ids), every other turn is the batch's, and every
        turn when no lane of the round may run; else the oldest warm lane. `background`
        False: warm and follow lanes get no turn.
        """
        prefilling = any(self._prefilling(self._lanes[r]) for r in self._round)
        rid = next(
            (
                r
                for r in self._round
                if self._may_run(self._lanes[r], background and not prefilling)
                and not self._waiting(r)
            ),
            None,
        )
        if batch and (self._batch_next or rid is None):
            self._batch_next = False
            return Turn(TurnKind.BATCH, tuple(batch))
        self._batch_next = True
        if rid is not None and self._looked_up(rid) is not None:
            rid = self._due_first()
        if rid is None and background and self._warm:
            rid = self._warm[0]
        if rid is None:
            return None
        lane = self._lanes[rid]
        if lane.kind is not LaneKind.REQUEST or self._prefilling(lane):
            return Turn(TurnKind.PREFILL, (rid,))
        return Turn(TurnKind.VERIFY if lane.verifies else TurnKind.DECODE, (rid,))

    def _due_first(self) -> int:
        """The prefilling request looked up whose first token is due first: the fewest
        tokens left, from its arrival's clock (then the oldest)."""
        due = {
            r: self._arrival[r] + left
            for r in self._round
            if (left := self._looked_up(r)) is not None
        }
        return min(due, key=lambda r: (due[r], r))

    def _looked_up(self, rid: int) -> int | None:
        """A prefilling request's prompt tokens left, once looked up; else None."""
        lane = self._lanes[rid]
        return lane.left if self._prefilling(lane) else None

    def _waiting(self, rid: int) -> bool:
        """A request not started yet that waits for an earlier request's prefill."""
        lane = self._lanes[rid]
        if self._waits is None or lane.kind is not LaneKind.REQUEST:
            return False
        if lane.phase is not Phase.RESTORING:
            return False
        return any(
            r < rid and self._waits(lane, self._lanes[r])
            for r in self._round
            if self._prefilling(self._lanes[r])
        )

    @staticmethod
    def _prefilling(lane: Schedulable) -> bool:
        return lane.kind is LaneKind.REQUEST and lane.phase in PROMPT_PHASES

    @staticmethod
    def _may_run(lane: Schedulable, follow: bool) -> bool:
        # follow: follow lanes may have a turn now (background, and no request prefilling)
        if lane.kind is LaneKind.REQUEST:
            return lane.phase is not Phase.BATCHED
        return follow and lane.has_work()

    def advanced(self, rid: int, step: Step) -> Go:
        """Lane `rid` was advanced and gave `step`: its next phase and place, and whether
        its turn goes on (`Go`): a request's first token comes with its prompt's last
        chunk, and a request that gave a token joins the decode batch at once unless it is
        `solo`."""
        lane = self._lanes[rid]
        if step is Step.ENDED:
            lane.phase = Phase.DONE
            self.finish(rid)
            return Go.END
        if step is Step.JOINED:
            lane.phase = Phase.BATCHED
            return Go.END
        if lane.kind is not LaneKind.REQUEST:  # background work: one step a turn
            lane.phase = Phase.PREFILLING
            self.requeue(rid)
            return Go.END
        left, before = lane.left, self._left.get(rid)
        if left is not None:
            self._clock += 0 if before is None else before - left
            self._left[rid] = left
        if step is Step.PROMPT_DONE:
            lane.phase = Phase.PREFILLING
            return Go.ON
        if step in (Step.CHUNK, Step.WAIT):  # requests take turns: to the back of the round
            if step is Step.CHUNK:  # (one waiting for room stays as it was: not started)
                lane.phase = Phase.PREFILLING
            self.requeue(rid)
            return Go.END
        lane.phase = Phase.DECODING
        self.requeue(rid)
        return Go.END if lane.solo else Go.JOIN

    def forwarded(self, rid: int) -> None:
        """The decode batch's forward gave request `rid` its logits: it decodes its token
        (then `advanced` says it joins the batch again, or it ends)."""
        self._lanes[rid].phase = Phase.DECODING

    def requeue(self, rid: int) -> None:
        """The lane had its turn and goes on: a lane of the round to its back; a warm lane
        stays at the head of the warm queue."""
        if self._lanes[rid].kind is not LaneKind.WARM:
            self._round.remove(rid)
            self._round.append(rid)

    def finish(self, rid: int) -> L:
        """Forget a lane that has ended. A finished request's follow lane goes on (it
        completes the reply's last block)."""
        self._follower.pop(rid, None)
        return self._remove(rid)

    def cancel(self, rid: int) -> list[tuple[int, L]]:
        """Take a lane out before its end, a request's follow lane with it; returns what
        was taken out (the lane first), for the engine to stop. Unknown ids: nothing."""
        if rid not in self._lanes:
            return []
        taken = [(rid, self._remove(rid))]
        follower = self._follower.pop(rid, None)
        if follower is not None and follower in self._lanes:
            taken.append((follower, self._remove(follower)))
        return taken

    def _remove(self, rid: int) -> L:
        self._arrival.pop(rid, None)
        self._left.pop(rid, None)
        lane = self._lanes.pop(rid)
        (self._warm if lane.kind is LaneKind.WARM else self._round).remove(rid)
        return lane

    def lanes(self, *kinds: LaneKind) -> list[tuple[int, L]]:
        """The lanes of `kinds` (default: all): the warm queue, oldest first, then the round,
        next turn first."""
        wanted = kinds or tuple(LaneKind)
        return [
            (r, self._lanes[r])
            for r in (*self._warm, *self._round)
            if self._lanes[r].kind in wanted
        ]

    def count(self, *kinds: LaneKind) -> int:
        """How many lanes of `kinds` are queued or running."""
        return sum(lane.kind in kinds for lane in self._lanes.values())
