"""The scheduler's queues on their own: whose turn it is, for each kind of lane."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from mlxcache.scheduler import BACKGROUND, BATCH, Batch, LaneKind, Phase, Scheduler, Step

REQUEST, WARM, FOLLOW = LaneKind.REQUEST, LaneKind.WARM, LaneKind.FOLLOW


@dataclass
class FakeLane:
    kind: LaneKind
    phase: Phase = Phase.DECODING
    work: bool = True

    def has_work(self) -> bool:
        return self.work


def turns(sched: Scheduler[FakeLane], n: int, **kwargs: bool) -> list[int | Batch | None]:
    """n turns, each lane requeued after its turn (as the engine does for a lane that goes on)."""
    out: list[int | Batch | None] = []
    for _ in range(n):
        turn = sched.next_turn(**kwargs)
        out.append(turn)
        if isinstance(turn, int):
            sched.requeue(turn)
    return out


def test_requests_take_turns_round_robin_and_leave_when_finished() -> None:
    sched: Scheduler[FakeLane] = Scheduler()
    for rid in (0, 1, 2):
        sched.add(rid, FakeLane(REQUEST))
    assert turns(sched, 4) == [0, 1, 2, 0]
    sched.finish(2)
    assert turns(sched, 3) == [1, 0, 1]
    sched.add(3, FakeLane(REQUEST))  # a new request joins at the back of the round
    assert turns(sched, 4) == [0, 1, 3, 0]
    assert 2 not in sched and len(sched) == 3


def test_the_oldest_warm_lane_runs_to_its_end_and_only_when_no_request_can() -> None:
    sched: Scheduler[FakeLane] = Scheduler()
    sched.add(0, FakeLane(WARM))
    sched.add(1, FakeLane(WARM))
    assert turns(sched, 3) == [0, 0, 0]  # one warm lane (one restored KV copy) at a time
    sched.add(2, FakeLane(REQUEST))
    assert turns(sched, 2) == [2, 2]
    sched.finish(2)
    sched.finish(0)
    assert turns(sched, 2) == [1, 1]
    assert turns(sched, 1, background=False) == [None]  # requests are waiting to start


def test_follow_lanes_take_turns_in_the_round_only_with_work_and_no_request_prefilling() -> None:
    sched: Scheduler[FakeLane] = Scheduler()
    a, follow, b = FakeLane(REQUEST), FakeLane(FOLLOW, work=False), FakeLane(REQUEST)
    sched.add(0, a)
    sched.add(1, follow, follows=0)
    sched.add(2, b)
    assert turns(sched, 3) == [0, 2, 0]  # waiting for its reply to complete a block
    follow.work = True
    assert turns(sched, 3) == [1, 2, 0]
    b.phase = Phase.PREFILLING  # a request waits for its first token: follow lanes wait
    assert turns(sched, 3) == [2, 0, 2]
    b.phase = Phase.DECODING
    assert turns(sched, 2, background=False) == [0, 2]  # requests waiting: no background turn
    assert turns(sched, 1) == [1]


def test_a_lone_follow_lane_runs_before_warm_lanes() -> None:
    sched: Scheduler[FakeLane] = Scheduler()
    sched.add(0, FakeLane(WARM))
    sched.add(1, FakeLane(FOLLOW), follows=9)  # its request has finished
    assert turns(sched, 2) == [1, 1]
    sched.finish(1)
    assert turns(sched, 1) == [0]


def test_the_decode_batch_alternates_with_the_lanes() -> None:
    sched: Scheduler[FakeLane] = Scheduler()
    sched.add(0, FakeLane(REQUEST, Phase.BATCHED))
    sched.add(1, FakeLane(REQUEST, Phase.PREFILLING))
    sched.add(2, FakeLane(WARM))
    assert turns(sched, 5, batch=True) == [1, BATCH, 1, BATCH, 1]
    sched.finish(1)
    assert turns(sched, 2, batch=True) == [BATCH, BATCH]  # no lane of the round may run
    assert turns(sched, 1, batch=False) == [2]


def test_cancelling_a_request_takes_its_follow_lane_and_finishing_it_does_not() -> None:
    sched: Scheduler[FakeLane] = Scheduler()
    sched.add(0, FakeLane(REQUEST))
    sched.add(1, FakeLane(FOLLOW), follows=0)
    sched.add(2, FakeLane(REQUEST))
    sched.add(3, FakeLane(FOLLOW), follows=2)
    assert [rid for rid, _ in sched.cancel(0)] == [0, 1]
    assert sched.cancel(0) == [] and sched.cancel(42) == []
    sched.finish(2)
    assert [(rid, lane.kind) for rid, lane in sched.lanes()] == [(3, FOLLOW)]
    assert [rid for rid, _ in sched.cancel(3)] == [3]


def test_lanes_and_counts_name_the_kinds() -> None:
    sched: Scheduler[FakeLane] = Scheduler()
    sched.add(0, FakeLane(REQUEST))
    sched.add(1, FakeLane(FOLLOW), follows=0)
    sched.add(2, FakeLane(WARM))
    sched.add(3, FakeLane(WARM))
    sched.requeue(0)
    assert [rid for rid, _ in sched.lanes()] == [2, 3, 1, 0]
    assert [rid for rid, _ in sched.lanes(*BACKGROUND)] == [2, 3, 1]
    assert [rid for rid, _ in sched.lanes(FOLLOW)] == [1]
    assert (sched.count(REQUEST), sched.count(WARM), sched.count(*BACKGROUND)) == (1, 2, 3)
    assert sched[1].kind is FOLLOW


def test_a_follow_lane_and_only_a_follow_lane_names_its_request() -> None:
    sched: Scheduler[FakeLane] = Scheduler()
    with pytest.raises(ValueError, match="only a follow lane"):
        sched.add(0, FakeLane(FOLLOW))
    with pytest.raises(ValueError, match="only a follow lane"):
        sched.add(0, FakeLane(WARM), follows=1)
    sched.add(0, FakeLane(REQUEST))
    with pytest.raises(ValueError, match="lane 0 is queued already"):
        sched.add(0, FakeLane(REQUEST))


def test_a_request_moves_through_its_phases_by_what_each_advance_gives() -> None:
    """The rules the engine follows: a prefill chunk ends the turn; the last chunk's turn
    goes on to the first token; a token ends the turn, or goes on to join the decode batch
    when there is one; a joined request waits there; an ended one is forgotten."""
    sched: Scheduler[FakeLane] = Scheduler()
    lane, other = FakeLane(REQUEST, Phase.RESTORING), FakeLane(REQUEST, Phase.PREFILLING)
    sched.add(0, lane)
    sched.add(1, other)
    assert sched.alone(0)  # its forwards are its own until its first token
    assert not sched.advanced(0, Step.CHUNK, batch=True)
    assert (lane.phase, turns(sched, 1)) == (Phase.PREFILLING, [1])  # to the back
    assert sched.advanced(0, Step.PROMPT_DONE, batch=True)  # the first token: same turn
    assert lane.phase is Phase.PREFILLING and sched.alone(0)
    assert sched.advanced(0, Step.TOKEN, batch=True)  # on to the batch, same turn
    assert lane.phase is Phase.DECODING and not sched.alone(0)
    assert not sched.advanced(0, Step.JOINED, batch=True)
    assert lane.phase is Phase.BATCHED and turns(sched, 2) == [1, 1]  # the batch has it
    sched.batch_forward(0)
    assert lane.phase is Phase.DECODING
    assert not sched.advanced(0, Step.TOKEN, batch=False)  # no batch: its own turns
    assert not sched.advanced(0, Step.ENDED, batch=False)
    assert lane.phase is Phase.DONE and 0 not in sched


def test_background_lanes_take_one_step_a_turn_whatever_it_gave() -> None:
    sched: Scheduler[FakeLane] = Scheduler()
    warm, request = FakeLane(WARM, Phase.RESTORING), FakeLane(REQUEST, Phase.RESTORING)
    sched.add(0, warm)
    sched.add(1, FakeLane(FOLLOW, Phase.RESTORING), follows=9)  # its request has ended
    for step in (Step.CHUNK, Step.PROMPT_DONE):
        assert not sched.advanced(0, step, batch=True)
        assert not sched.advanced(1, step, batch=True)
    assert warm.phase is Phase.PREFILLING and sched.alone(0) and sched.alone(1)
    sched.add(2, request)
    assert turns(sched, 1) == [2]  # a request waiting for its first token: no follow turn


@dataclass
class Prompted(FakeLane):
    group: int = 0  # lanes of one group share most of their prompt


def test_a_request_waits_for_an_earlier_one_prefilling_the_prompt_it_shares() -> None:
    sched: Scheduler[Prompted] = Scheduler(waits=lambda lane, earlier: lane.group == earlier.group)
    sched.add(0, Prompted(REQUEST, Phase.PREFILLING, group=1))
    sched.add(1, Prompted(REQUEST, Phase.RESTORING, group=1))  # waits for 0
    sched.add(2, Prompted(REQUEST, Phase.RESTORING, group=2))  # shares nothing: runs
    assert turns(sched, 4) == [0, 2, 0, 2]  # type: ignore[arg-type]
    sched[0].phase = Phase.DECODING  # 0's prompt is kept: 1 starts, resuming it
    assert turns(sched, 1) == [1]  # type: ignore[arg-type]
    # Only requests not started wait (a started one goes on), and only for earlier ones.
    sched.add(3, Prompted(REQUEST, Phase.PREFILLING, group=3))
    sched.add(4, Prompted(REQUEST, Phase.PREFILLING, group=3))
    sched.add(5, Prompted(REQUEST, Phase.RESTORING, group=3))
    assert {3, 4} <= set(turns(sched, 6)) and 5 not in turns(sched, 6)  # type: ignore[arg-type]
