"""The scheduler's queues on their own: whose turn it is, for each kind of lane."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from mlxcache.scheduler import BACKGROUND, Go, LaneKind, Phase, Scheduler, Step, Turn, TurnKind

REQUEST, WARM, FOLLOW = LaneKind.REQUEST, LaneKind.WARM, LaneKind.FOLLOW


@dataclass
class FakeLane:
    kind: LaneKind
    phase: Phase = Phase.DECODING
    work: bool = True
    left: int | None = None
    solo: bool = False
    verifies: bool = False

    def has_work(self) -> bool:
        return self.work


BATCH = "batch"
"""The decode batch's turn, in `turns`' lists."""


def turns(
    sched: Scheduler[FakeLane], n: int, background: bool = True, batch: tuple[int, ...] = ()
) -> list[int | str | None]:
    """n turns, each lane requeued after its turn (as the engine does for a lane that goes on)."""
    out: list[int | str | None] = []
    for _ in range(n):
        turn = sched.whose_turn(background, batch)
        if turn is None or turn.kind is TurnKind.BATCH:
            out.append(None if turn is None else BATCH)
            continue
        out.append(turn.lane)
        sched.requeue(turn.lane)
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
    assert turns(sched, 5, batch=(0,)) == [1, BATCH, 1, BATCH, 1]
    sched.finish(1)
    assert turns(sched, 2, batch=(0,)) == [BATCH, BATCH]  # no lane of the round may run
    assert turns(sched, 1) == [2]


def test_a_turn_lists_its_lanes_and_what_their_forward_is() -> None:
    """A lane's turn names the lane, a prefill chunk until a request's first token (and a
    background lane's always), then a decode step, or a verify where the lane's next
    forward is one; the batch's turn lists its rows."""
    sched: Scheduler[FakeLane] = Scheduler()
    prompt = FakeLane(REQUEST, Phase.RESTORING)
    sched.add(0, prompt)
    sched.add(1, FakeLane(REQUEST, Phase.BATCHED))
    sched.add(2, FakeLane(REQUEST, Phase.BATCHED))
    sched.add(3, FakeLane(WARM, Phase.PREFILLING))
    assert sched.whose_turn(batch=(1, 2)) == Turn(TurnKind.PREFILL, (0,))
    assert sched.whose_turn(batch=(1, 2)) == Turn(TurnKind.BATCH, (1, 2))
    prompt.phase = Phase.PREFILLING
    assert sched.whose_turn(batch=(1, 2)) == Turn(TurnKind.PREFILL, (0,))
    prompt.phase = Phase.DECODING
    sched.whose_turn(batch=(1, 2))
    assert sched.whose_turn(batch=(1, 2)) == Turn(TurnKind.DECODE, (0,))
    prompt.verifies = True
    sched.whose_turn(batch=(1, 2))
    assert sched.whose_turn(batch=(1, 2)) == Turn(TurnKind.VERIFY, (0,))
    sched.finish(0)
    assert sched.whose_turn() == Turn(TurnKind.PREFILL, (3,))
    with pytest.raises(ValueError, match="rows"):
        _ = Turn(TurnKind.BATCH, (1, 2)).lane


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
    assert sched.advanced(0, Step.WAIT) is Go.END  # no room in the memory budget yet
    assert (lane.phase, turns(sched, 1)) == (Phase.RESTORING, [1])  # to the back, unstarted
    assert sched.advanced(0, Step.CHUNK) is Go.END
    assert (lane.phase, turns(sched, 1)) == (Phase.PREFILLING, [1])  # to the back
    assert sched.advanced(0, Step.PROMPT_DONE) is Go.ON  # the first token: same turn
    assert lane.phase is Phase.PREFILLING
    assert sched.advanced(0, Step.TOKEN) is Go.JOIN  # on to the batch, same turn
    assert lane.phase is Phase.DECODING
    assert sched.advanced(0, Step.JOINED) is Go.END
    assert lane.phase is Phase.BATCHED and turns(sched, 2) == [1, 1]  # the batch has it
    sched.forwarded(0)
    assert lane.phase is Phase.DECODING
    lane.solo = True  # (an engine that does not batch: every request's forwards its own)
    assert sched.advanced(0, Step.TOKEN) is Go.END  # its own turns
    assert sched.advanced(0, Step.ENDED) is Go.END
    assert lane.phase is Phase.DONE and 0 not in sched


def test_a_solo_request_makes_every_forward_its_own_and_never_joins_the_batch() -> None:
    """A request run alone (or drafted past what the batch can verify) takes its token's
    turn alone even where the engine decodes in a batch, and its forwards stay its own past
    its first token; a request beside it joins the batch as before."""
    sched: Scheduler[FakeLane] = Scheduler()
    solo, other = FakeLane(REQUEST, Phase.RESTORING, solo=True), FakeLane(REQUEST)
    sched.add(0, solo)
    sched.add(1, other)
    assert sched.advanced(0, Step.PROMPT_DONE) is Go.ON
    assert sched.advanced(0, Step.TOKEN) is Go.END  # its turn ends: no batch to join
    assert solo.phase is Phase.DECODING
    assert sched.advanced(1, Step.TOKEN) is Go.JOIN


def test_background_lanes_take_one_step_a_turn_whatever_it_gave() -> None:
    sched: Scheduler[FakeLane] = Scheduler()
    warm, request = FakeLane(WARM, Phase.RESTORING), FakeLane(REQUEST, Phase.RESTORING)
    sched.add(0, warm)
    sched.add(1, FakeLane(FOLLOW, Phase.RESTORING), follows=9)  # its request has ended
    for step in (Step.CHUNK, Step.WAIT):
        assert sched.advanced(0, step) is Go.END
        assert sched.advanced(1, step) is Go.END
    assert warm.phase is Phase.PREFILLING
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


def prefills(sched: Scheduler[FakeLane], n: int, chunk: int = 10) -> list[int]:
    """n turns as the engine takes them for prefilling requests: the lane whose turn it is
    prefills a chunk (its first turn looks its prompt up: `looked_up` says what is left),
    then its first token comes with its last chunk and it decodes."""
    out: list[int] = []
    for _ in range(n):
        turn = sched.whose_turn()
        assert turn is not None and turn.kind is TurnKind.PREFILL
        rid = turn.lane
        out.append(rid)
        lane = sched[rid]
        assert lane.phase in (Phase.RESTORING, Phase.PREFILLING)
        if lane.left is None:
            lane.left = LOOKED_UP[rid]
        lane.left = max(lane.left - chunk, 0)
        step = Step.CHUNK if lane.left else Step.PROMPT_DONE
        if sched.advanced(rid, step) is Go.ON:
            sched.advanced(rid, Step.TOKEN)  # its first token: it decodes
            lane.phase = Phase.BATCHED  # out of the round's turns
    return out


LOOKED_UP: dict[int, int] = {}
"""Each fake request's prompt tokens left once its first turn looked it up."""


def requests(sched: Scheduler[FakeLane], **left: int) -> None:
    for rid, n in ((int(k[1:]), n) for k, n in left.items()):
        LOOKED_UP[rid] = n
        sched.add(rid, FakeLane(REQUEST, Phase.RESTORING))


def test_prompts_prefill_one_after_another_and_not_side_by_side() -> None:
    """Four equal prompts: each first looks its own up (a chunk), then the oldest goes on to
    its first token before the next starts: the first tokens come after 6, 8, 10 and 12
    turns (side by side, as the round alone would take them: after 9, 10, 11 and 12)."""
    sched: Scheduler[FakeLane] = Scheduler()
    requests(sched, r0=30, r1=30, r2=30, r3=30)
    assert prefills(sched, 12) == [0, 1, 2, 3, 0, 0, 1, 1, 2, 2, 3, 3]
    assert [sched[r].phase for r in range(4)] == [Phase.BATCHED] * 4


def test_a_short_prompt_goes_before_a_long_one_s_rest_only_by_what_that_one_waited() -> None:
    sched: Scheduler[FakeLane] = Scheduler()
    requests(sched, r0=200)
    assert prefills(sched, 3) == [0, 0, 0]  # 170 left; 20 prefilled since it arrived
    requests(sched, r1=40)  # its first turn in the round looks it up, then it is due at
    assert prefills(sched, 5) == [0, 1, 1, 1, 1]  # 20 + 30, before 0 (at 0 + 160)
    assert sched[1].phase is Phase.BATCHED


def test_short_prompts_coming_all_the_time_delay_a_long_one_by_its_length_at_most() -> None:
    """A 30-token request every three turns: each goes before the 200-token one (due at
    0 + what it has left) while it arrives before that one's due clock; the later ones wait
    (pure shortest-first would keep the long one waiting for as long as they come)."""
    sched: Scheduler[FakeLane] = Scheduler()
    requests(sched, r0=200)
    order: list[int] = []
    for k in range(1, 16):  # 45 turns
        requests(sched, **{f"r{k}": 30})
        order += prefills(sched, 3)
    first_token = max(i for i, r in enumerate(order) if r == 0) + 1
    assert order[:first_token] == [
        *(0, 1, 1, 1, 0, 2, 2, 2, 0, 3, 3, 3, 0, 4, 5, 4, 4, 5, 5),
        *(0, 6, 7, 6, 6, 7, 7, 0, 8, 9, 0, 10, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0),
    ]
    assert order[first_token:] == [8]  # then the ones that waited, oldest first


def test_a_prompt_not_looked_up_takes_its_turn_in_the_round() -> None:
    sched: Scheduler[FakeLane] = Scheduler()
    requests(sched, r0=50)
    assert prefills(sched, 2) == [0, 0]
    sched.add(1, FakeLane(REQUEST, Phase.PREFILLING))  # waiting for memory: never looked up
    LOOKED_UP[1] = 0
    assert turns(sched, 3) == [0, 1, 0]  # round robin: it does not jump ahead, nor starve
