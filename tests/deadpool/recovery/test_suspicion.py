"""Liveness-only suspicions that would lose a copy are held back (deadpool/recovery/suspicion.py):
the predicate, the hold with a fake clock, and the coordinator's detection pass end to end on an
in-memory store (no processes)."""

from __future__ import annotations

import pytest

from deadpool.control.liveness import Liveness
from deadpool.recovery import detect, plan
from deadpool.recovery.suspicion import Suspicions, copies_survive, hold_seconds
from deadpool.store.protocol import Keys, RankStatus
from deadpool.topology import ParallelDims
from tests.deadpool.recovery.helpers import coordinator

FT = {"buddy_policy": "ring_over_nodes", "replicas": 1, "replicate": "unique",
      "state_sources": ["peer", "replica"]}


def dims(dp=4, zero=True, tp=1, pp=1, ranks_per_node=4):
    return ParallelDims.from_config({"dp": dp, "tp": tp, "pp": pp, "zero": zero,
                                     "ranks_per_node": ranks_per_node})


def test_a_rank_and_its_replica_holder_together_leave_a_zero_shard_without_a_copy():
    d = dims()  # one node: rank r's replica is held by rank r + 1 (the ring)
    assert copies_survive(d, FT, True, set())
    assert copies_survive(d, FT, True, {1})          # its buddy 2 holds its shard
    assert copies_survive(d, FT, True, {0, 2})       # buddies 1 and 3 survive
    assert not copies_survive(d, FT, True, {1, 2})   # rank 1's shard was only in 1 and 2
    assert not copies_survive(d, FT, False, {1})     # no replicas: a shard is only its own
    # without ZeRO, data-parallel peers hold every rank's whole state
    assert copies_survive(dims(zero=False), FT, True, {1, 2})
    assert copies_survive(dims(zero=False), FT, False, {0, 1, 2})
    assert not copies_survive(dims(zero=False), FT, False, {0, 1, 2, 3})


def test_the_predicate_is_the_plans_notion_of_a_copy():
    # two buddies per rank on four nodes: losing a rank and its first buddy leaves the second
    d = dims(ranks_per_node=1)
    two = dict(FT, replicas=2)
    assert not copies_survive(d, FT, True, {1, 2})
    assert copies_survive(d, two, True, {1, 2})
    assert not copies_survive(d, two, True, {1, 2, 3})


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def suspicions(survive, clock, hold_s=3.0, soft=lambda slot: True, logs=None):
    return Suspicions(hold_s, survive, soft, log=(logs.append if logs is not None else
                                                   lambda line: None), clock=clock)


def ring_survive(fenced):
    return copies_survive(dims(), FT, True, fenced)


def test_a_single_slow_rank_is_fenced_at_once_a_swap_at_worst():
    s = suspicions(ring_survive, Clock())
    assert s.filter({1: "progress"}, int, 0) == {1: "progress"}
    assert s.held == []


def test_a_slow_pair_is_held_back_and_cleared_when_it_progresses():
    clock, logs = Clock(), []
    s = suspicions(ring_survive, clock, logs=logs)
    pair = {1: "progress", 2: "progress"}
    assert s.filter(pair, int, 0) == {}
    clock.t += 2.9
    assert s.filter(pair, int, 0) == {}
    clock.t += 0.05
    assert s.filter({}, int, 0) == {}  # both progressed: nothing to fence, the hold cleared
    (rec,) = s.held
    assert rec["ranks"] == [1, 2] and rec["outcome"] == "cleared" and rec["held_s"] == 2.95
    assert any("held back up to 3 s" in line for line in logs)
    assert any("rank 2 cleared" in line for line in logs)
    clock.t += 10  # a fresh stall later is a fresh hold, not the old one's expiry
    assert s.filter(pair, int, 0) == {}


def test_a_truly_hung_pair_is_fenced_once_the_hold_runs_out():
    clock = Clock()
    s = suspicions(ring_survive, clock)
    pair = {1: "progress", 2: "progress"}
    assert s.filter(pair, int, 0) == {}
    clock.t += 3.0
    assert s.filter(pair, int, 0) == pair  # still stalled when the hold ran out: fenced
    assert s.since == {} and s.held[0]["outcome"] == "confirmed"


def test_a_held_rank_whose_partner_woke_first_keeps_its_hold():
    clock = Clock()
    s = suspicions(ring_survive, clock)
    assert s.filter({1: "progress", 2: "progress"}, int, 0) == {}
    clock.t += 1.0
    # 2 woke a moment before 1: fencing 1 alone would be safe but needless
    assert s.filter({1: "progress"}, int, 0) == {}
    clock.t += 0.01
    assert s.filter({}, int, 0) == {}
    assert s.held[0]["outcome"] == "cleared" and s.held[0]["cleared"] == [2, 1]
    # alone and still stalled when its hold runs out, it is fenced (a swap)
    assert s.filter({1: "progress", 2: "progress"}, int, 0) == {}
    clock.t += 1.0
    assert s.filter({1: "progress"}, int, 0) == {}
    clock.t += 2.0
    assert s.filter({1: "progress"}, int, 0) == {1: "progress"}
    assert s.held[1]["outcome"] == "mixed"


def test_the_hold_is_bounded_by_the_oldest_suspicion_however_many_join():
    clock = Clock()
    s = suspicions(ring_survive, clock)
    assert s.filter({1: "progress", 2: "progress"}, int, 0) == {}
    clock.t += 2.0
    assert s.filter({1: "progress", 2: "progress", 3: "heartbeat"}, int, 0) == {}
    clock.t += 1.0  # 3 s after the first, 1 s after rank 3 joined
    got = s.filter({1: "progress", 2: "progress", 3: "heartbeat"}, int, 0)
    assert got == {1: "progress", 2: "progress", 3: "heartbeat"}
    assert [r["outcome"] for r in s.held] == ["confirmed", "confirmed"]


def test_hard_evidence_is_fenced_at_once_and_the_liveness_only_holder_waits():
    clock = Clock()
    s = suspicions(ring_survive, clock, soft=lambda slot: slot != 1)
    # rank 1 lost its beat for good (hard); 2, its replica's holder, only stalls: 1 is fenced
    # now, 2 is not (its copy of 1's shard is the last)
    assert s.filter({1: "heartbeat", 2: "progress"}, int, 0) == {1: "heartbeat"}
    # 0 and 1 hard: 0's shard is on 1 (fenced) and 1's on 2: fencing them leaves... 1's on 2,
    # so 2 (liveness only) is held; hard ones that lose a copy on their own hold nothing back
    s2 = suspicions(ring_survive, clock, soft=lambda slot: slot == 3)
    assert s2.filter({1: "exit", 2: "exit", 3: "progress"}, int, 0) == \
        {1: "exit", 2: "exit", 3: "progress"}
    assert s2.held == []


def test_a_hold_of_0_seconds_is_todays_behaviour():
    s = suspicions(ring_survive, Clock(), hold_s=0.0)
    pair = {1: "progress", 2: "progress"}
    assert s.filter(pair, int, 0) == pair


def test_the_hold_defaults_to_one_progress_timeout_capped():
    assert hold_seconds({"progress_timeout_s": 3, "liveness_hold_s": None}) == 3.0
    assert hold_seconds({"progress_timeout_s": 600}) == 30.0
    assert hold_seconds({"progress_timeout_s": 600, "liveness_hold_s": 120}) == 120.0


def test_silent_beating_ranks_holding_the_only_copies_get_one_more_window_for_statuses():
    s = suspicions(ring_survive, Clock())
    s.decide = lambda statuses: plan.RecoveryDecision(None, {}, 0)
    assert s.status_grace(None, [2], int) == 3.0
    assert s.held[-1]["outcome"] == "status_wait"
    s.decide = lambda statuses: plan.RecoveryDecision(5, {}, 0)
    assert s.status_grace(None, [2], int) == 0.0  # a plan exists without them
    hard = suspicions(ring_survive, Clock(), soft=lambda slot: False)
    hard.decide = lambda statuses: plan.RecoveryDecision(None, {}, 0)
    assert hard.status_grace(None, [2], int) == 0.0  # they stopped beating: no wait


# -- the coordinator's detection pass, heartbeats in a store, fake clocks ------------------------
def beat(coord, slot: int, n: int, progress: int, phase: str = "forward"):
    coord.store.set(Keys.heartbeat(slot), f"{n} {progress} 5 {phase}")


@pytest.fixture
def coord(tmp_path):
    logs: list[str] = []
    c = coordinator(tmp_path, ["ft.progress_timeout_s=3", "ft.persist_interval_steps=0"],
                    logs=logs)
    clock = Clock()
    c.live = Liveness(1.0, 10.0, 3.0, clock=clock)
    c.suspicion.clock = clock
    c.ft["heartbeat_interval_s"] = 0.0  # read every pass
    c.clock, c.logs = clock, logs
    return c


def run(coord, seconds: float, stalled=(1, 2), beats=[0]):
    """Every slot beats every 0.5 s of ``seconds``; the ``stalled`` ones make no progress.
    Returns the first ``detect.failures`` answer that names someone (or None)."""
    for _ in range(int(seconds / 0.5)):
        beats[0] += 1
        coord.clock.t += 0.5
        for slot in range(4):
            prog = 1 if slot in stalled else beats[0]
            beat(coord, slot, beats[0], prog, "allreduce" if slot not in stalled else "forward")
        found = detect.failures(coord)
        if found is not None:
            return found[0]
    return None


def test_the_coordinator_holds_back_a_stalled_pair_and_lets_it_go_on(coord):
    assert run(coord, 6.0) is None  # suspected at 3 s, held; 6 s is within the hold (3 + 3)
    assert run(coord, 2.0, stalled=()) is None  # they progress again: cleared
    (rec,) = coord.suspicion.held
    assert rec["ranks"] == [1, 2] and rec["outcome"] == "cleared"
    assert any("held back" in line for line in coord.logs)


def test_the_coordinator_fences_a_hung_pair_after_the_hold(coord):
    assert run(coord, 20.0) == {1: "progress", 2: "progress"}
    (rec,) = coord.suspicion.held
    assert rec["outcome"] == "confirmed" and 3.0 <= rec["held_s"] <= 3.5


def test_a_silent_beating_holder_of_the_only_copy_gets_longer_to_report_its_status(tmp_path):
    import threading
    import time

    from deadpool.store import reports

    coord = coordinator(tmp_path, ["ft.status_timeout_s=0.3", "ft.liveness_hold_s=2"])
    keys = Keys(0)
    for s in range(5):
        beat(coord, s, 1, 1)
    # rank 1 exited; 2 holds the only replica of its shard and answers 0.8 s after the abort
    for r, ward in ((0, 3), (3, 2)):
        reports.post(coord.store, coord.seal, keys.status(r),
                     RankStatus(r, r, 7, [6, 7], {ward: [6, 7]}).to_json())
    late = RankStatus(2, 2, 7, [6, 7], {1: [6, 7]}).to_json()
    timer = threading.Timer(0.8, lambda: reports.post(coord.store, coord.seal, keys.status(2), late))
    timer.start()
    failed = {1: "exit"}
    t0 = time.monotonic()
    statuses = detect.collect_statuses(coord, failed, keys)
    timer.join()
    assert sorted(statuses) == [0, 2, 3] and failed == {1: "exit"}, failed
    assert time.monotonic() - t0 < 2.3  # bounded: the status timeout plus one hold at most
    assert coord.suspicion.held[-1]["outcome"] == "status_wait"
    assert plan.decide(coord, statuses).resume_step == 7


def test_a_rank_and_its_holder_suspected_a_beat_apart_are_judged_together():
    pair = {1: "progress", 2: "progress"}
    for settle_s, fenced_alone in ((0.5, False), (0.0, True)):
        clock = Clock()
        s = Suspicions(3.0, ring_survive, lambda slot: True, log=lambda line: None, clock=clock,
                       settle_s=settle_s)
        got = s.filter({1: "progress"}, int, 0)  # 2's stall is seen one record later
        assert (got == {1: "progress"}) is fenced_alone
        if fenced_alone:
            continue  # (today's course: 1 fenced, then 2 silent to the abort)
        assert got == {}
        clock.t += 0.25
        assert s.filter(pair, int, 0) == {}
        clock.t += 0.25  # 1 ripe: the pair is judged as one and held
        assert s.filter(pair, int, 0) == {} and s.held[0]["ranks"] == [1, 2]
        clock.t += 3.0
        assert s.filter(pair, int, 0) == pair  # still stalled after the hold: fenced


def test_a_lone_slow_rank_waits_only_the_settle_time():
    clock = Clock()
    s = Suspicions(3.0, ring_survive, lambda slot: True, log=lambda line: None, clock=clock,
                   settle_s=0.5)
    assert s.filter({1: "progress", 0: "exit"}, int, 0) == {0: "exit"}  # hard: at once
    clock.t += 0.5
    assert s.filter({1: "progress"}, int, 0) == {1: "progress"}
    assert s.held == []
