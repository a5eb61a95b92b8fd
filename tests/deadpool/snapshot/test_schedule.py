"""The snapshot schedule: which interval a rank wants from what it measured, and the vote that
makes every rank of a job snapshot the same steps."""

import pytest

from deadpool.protocol import Keys
from deadpool.rounds import StoreRounds
from deadpool.snapshot import SnapshotSchedule
from tests.deadpool.helpers import client, master_store, run_threads


def feed(s, active=None, quiet=None, cycle=None, n=16):
    for _ in range(n):
        if active is not None:
            s.observe(active, True, cycle)
        if quiet is not None:
            s.observe(quiet, False, None)


def test_levels_and_bad_settings():
    assert SnapshotSchedule(1, 8).levels == [1, 2, 4, 8]
    assert SnapshotSchedule(2, 12, every=16).levels == [2, 4, 8]
    assert SnapshotSchedule(1, 8, adaptive=False).levels == [1]
    with pytest.raises(ValueError, match="multiple"):
        SnapshotSchedule(1, 8, every=12)
    with pytest.raises(ValueError, match=">= 1"):
        SnapshotSchedule(0, 8)
    with pytest.raises(ValueError, match="overhead_target"):
        SnapshotSchedule(1, 8, overhead_target=1.5)


def test_a_cycle_longer_than_a_step_widens_to_cover_it():
    s = SnapshotSchedule(1, 8)
    assert s.wanted() == 1  # nothing measured yet
    feed(s, active=0.1, cycle=0.25)  # 1.25 x 0.25 / 0.1 = 3.1 steps
    assert s.wanted() == 4
    s2 = SnapshotSchedule(1, 8)
    feed(s2, active=0.1, cycle=2.0)  # 25 steps: capped at the widest, the engine then blocks
    assert s2.wanted() == 8
    s3 = SnapshotSchedule(1, 8)
    feed(s3, active=0.1, cycle=0.05)
    assert s3.wanted() == 1


def test_measured_cost_widens_until_under_target_and_narrows_with_margin():
    s = SnapshotSchedule(1, 8, overhead_target=0.02)
    feed(s, active=0.110, quiet=0.100, cycle=0.02)  # 10 % on half the steps: 5 % at k = 1
    assert s.overhead() == pytest.approx(0.05)
    assert s.wanted() == 4  # 5 % / 4 = 1.25 % <= 2 %; 2.5 % at k = 2 is too much
    # once k = 4 is adopted, the cost is measured at k = 4: 5 % / 4
    s2 = SnapshotSchedule(1, 8, overhead_target=0.02)
    s2.interval = 4
    feed(s2, active=0.1025, quiet=0.100, cycle=0.02)  # 1.25 % at k = 4
    assert s2.wanted() == 4  # k = 2 would give 2.5 % > target / 2: stays
    s3 = SnapshotSchedule(1, 8, overhead_target=0.02)
    s3.interval = 4
    feed(s3, active=0.1002, quiet=0.100, cycle=0.02)
    assert s3.wanted() == 2  # the cost vanished: narrower, one level per vote
    s3.interval = 2
    assert s3.wanted() == 1  # still nothing: back to every step
    feed(s3, active=0.1002, quiet=0.100, cycle=0.25)  # a cycle of 3.1 steps: widening jumps
    s3.interval = 1
    assert s3.wanted() == 4
    s4 = SnapshotSchedule(1, 8, overhead_target=0.02)
    feed(s4, active=0.2, n=20)  # no quiet step measured: cost unknown, cycle fits
    assert s4.overhead() is None and s4.wanted() == 1


def test_probes_skip_snapshots_only_at_the_narrowest_interval():
    s = SnapshotSchedule(1, 8, overhead_target=0.02, probe_every=16)
    assert [t for t in range(1, 33) if not s.due(t)] == [13, 14, 15, 29, 30, 31]
    s.interval = 4
    assert [t for t in range(1, 33) if s.due(t)] == [4, 8, 12, 16, 20, 24, 28, 32]
    assert all(s.due(t) for t in range(1, 33)) is False
    s0 = SnapshotSchedule(1, 8)  # no cost target: no probes
    assert all(s0.due(t) for t in range(1, 33))


def test_ranks_adopt_the_widest_wanted_interval_at_the_next_decision():
    n = 3
    master = master_store()
    wants = {0: 0.05, 1: 0.35, 2: 0.15}  # cycles -> k = 1, 8 (4.4 steps -> 8), 2

    def rank_fn(r):
        s = SnapshotSchedule(1, 8, every=8)
        s.start(StoreRounds(client(master.port), Keys(3), n))
        feed(s, active=0.1, cycle=wants[r])
        seen = []
        for step in range(1, 25):
            s.end_of_step(step, lambda: None)
            seen.append(s.interval)
        return seen

    for seen in run_threads(rank_fn, n):
        assert seen[:15] == [1] * 15      # steps 1..15: the vote of step 8 is read at 16
        assert seen[15:] == [8] * 9


def train(s, steps, store, world=1, step_s=0.100, slowdown=0.10, cycle_s=0.05):
    """Drive ``s`` as the trainer does: the snapshot taken after step t runs during step t + 1,
    which it slows by ``slowdown``. Returns the interval in force after each step."""
    s.start(StoreRounds(store, Keys(5), world))
    running, seen = False, []
    for t in range(1, steps + 1):
        dt = step_s * (1 + slowdown) if running else step_s
        took = s.due(t)
        s.end_of_step(t, lambda: None)
        s.observe(dt, running, cycle_s if running else None, step=t)
        running = took
        seen.append(s.interval)
    return seen


def test_default_probes_come_early_then_back_off():
    s = SnapshotSchedule(1, 8, overhead_target=0.02)  # every 16, probe_every 64: the defaults
    skipped = [t for t in range(1, 200) if not s.due(t)]
    assert skipped == [13, 14, 15, 29, 30, 31, 61, 62, 63, 125, 126, 127, 189, 190, 191]
    # the first probe ends at the first vote past warm-up and a few active steps
    s32 = SnapshotSchedule(1, 8, every=32, overhead_target=0.02)
    assert [t for t in range(1, 100) if not s32.due(t)] == [29, 30, 31, 61, 62, 63]


def test_a_costly_snapshot_widens_the_interval_from_step_40():
    master = master_store()
    seen = train(SnapshotSchedule(1, 8, overhead_target=0.02), 80, client(master.port))
    # 10 % on every step at k = 1: the probes of steps 13-15 and 29-31 measure it, the vote of
    # step 32 wants k = 8 (1.25 %; k = 4 would be 2.5 %) and rules from step 40 on
    assert seen[:39] == [1] * 39
    assert seen[39:] == [8] * 41


def test_a_cheap_snapshot_stays_every_step_and_keeps_probing():
    master = master_store()
    s = SnapshotSchedule(1, 8, overhead_target=0.02)
    assert train(s, 80, client(master.port), slowdown=0.01) == [1] * 80
    assert s.overhead() == pytest.approx(0.01, rel=1e-6)  # probes do not dilute the share


def test_warmup_steps_are_not_measured():
    s = SnapshotSchedule(1, 8, overhead_target=0.02, warmup=2)
    s.observe(5.0, False, None, step=1)  # the first step: lazy allocations
    s.observe(5.0, True, 4.0, step=2)
    assert s.overhead() is None and s.wanted() == 1  # a 40-step cycle would have meant k = 8
    feed(s, active=0.110, quiet=0.100, cycle=0.02)
    assert s.overhead() == pytest.approx(0.05)


def test_ranks_agree_at_the_default_decision_steps():
    n = 3
    master = master_store()
    slow = {0: 0.0, 1: 0.10, 2: 0.03}  # only rank 1 pays enough to want k = 8

    def rank_fn(r):
        return train(SnapshotSchedule(1, 8, overhead_target=0.02), 48, client(master.port),
                     world=n, slowdown=slow[r])

    for seen in run_threads(rank_fn, n):
        assert seen == [1] * 39 + [8] * 9
