"""The snapshot schedule: which interval a rank wants from what it measured, and the vote that
makes every rank of a job snapshot the same steps."""

import math

import pytest

from deadpool.snapshot import SnapshotSchedule
from deadpool.store.protocol import Keys
from deadpool.store.rounds import StoreRounds
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


def train(s, steps, store, world=1, step_s=0.100, slowdown=0.10, cycle_s=0.05, host=None):
    """Drive ``s`` as the trainer does: the snapshot taken after step t runs during step t + 1,
    which it slows by ``slowdown``; ``host(t)``: the host's speed factor at step t (drift).
    Returns the interval in force after each step."""
    s.start(StoreRounds(store, Keys(5), world))
    running, seen = False, []
    for t in range(1, steps + 1):
        base = step_s * (host(t) if host else 1.0)
        dt = base * (1 + slowdown) if running else base
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


def test_a_drifting_host_neither_hides_a_costly_snapshot_nor_delays_the_widening():
    """The host's speed swings by +-10 % over 40 steps (a shared CPU box); a snapshot slows the
    step it runs in by 6 % (6 % at k = 1, 3 times the target). Comparing the probes' quiet
    steps with the active steps next to them cancels the drift, at every phase of the swing; a
    cost read from medians of quiet and active steps far apart (the previous estimator) left
    the job at every step until step 56 or later at 4 of these 12 phases."""
    for i in range(12):
        def host(t, i=i):
            return 1 + 0.10 * math.sin(2 * math.pi * t / 40 + i * math.pi / 6)
        master = master_store()  # a store of its own: no phase reads another's votes
        seen = train(SnapshotSchedule(1, 8, overhead_target=0.02), 64, client(master.port),
                     slowdown=0.06, host=host)
        assert seen[39] >= 4 and seen[55] == 8, (i, seen[39], seen[55])


def test_the_interval_is_chosen_on_the_upper_bound_of_the_cost():
    """Equal median slowdowns, one measured steadily and one with a spread: the steady one keeps
    every step, the uncertain one widens until its bound fits under the target."""
    steady = SnapshotSchedule(1, 8, overhead_target=0.02, history=40, warmup=0)
    noisy = SnapshotSchedule(1, 8, overhead_target=0.02, history=40, warmup=0)
    spread = [0.00, 0.04, -0.04, 0.08, -0.08]  # around a median of 2 %, halved by the active share
    for i in range(20):
        steady.observe(0.102, True, 0.01)
        steady.observe(0.100, False, None)
        noisy.observe(0.100 * (1.02 + spread[i % 5]), True, 0.01)
        noisy.observe(0.100, False, None)
    assert steady.overhead() == pytest.approx(0.01) == steady.overhead_bound()
    assert noisy.overhead() == pytest.approx(0.01)
    # the median's standard error from its absolute deviation: 1.2533 x 1.4826 x 0.04 / sqrt(20)
    se = 1.2533 * 1.4826 * 0.04 / 20 ** 0.5
    assert noisy.overhead_bound() == pytest.approx((0.02 + 2 * se) / 2)
    assert steady.wanted() == 1
    assert noisy.wanted() == 2  # bound 2.7 % at k = 1, 1.3 % at k = 2
