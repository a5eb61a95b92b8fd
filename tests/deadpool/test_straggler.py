"""The straggler rule (deadpool/rank/straggler.py) without processes: the board word, the window
minimum, comparisons within a pipeline stage position, the quiet steps after a start or a
recovery, and the compute clock's exclusion of waits on peers."""

from __future__ import annotations

import random
import time
from types import SimpleNamespace

from deadpool.rank.faults import Fault, FaultEvent, FaultInjector
from deadpool.rank.straggler import (ComputeClock, StragglerDetector, pack_compute, pack_paused,
                                settings, unpack_compute)
from deadpool.rank.watchdog import Progress


def words(step: int, times: dict[int, float]) -> dict[int, int]:
    return {r: pack_compute(step, c) for r, c in times.items()}


def test_word_round_trip_and_pause_marker():
    assert unpack_compute(pack_compute(123, 0.0456)) == (123, 0.0456)
    assert unpack_compute(pack_paused(77)) == (77, None)
    assert pack_compute(0, 0.0) > 0  # 0 means "no word yet": a real one never is


def test_a_slow_rank_is_found_once_and_only_in_its_stage_position():
    det = StragglerDetector(threshold=0.3, steps=5, skip_steps=10)
    pos = {r: r // 4 for r in range(8)}  # two stage positions of four ranks
    # the last stage is twice as slow as the first by nature (head + loss): never a straggler
    base = {r: 0.010 if pos[r] == 0 else 0.020 for r in range(8)}
    assert det.observe(words(20, base), pos) == []
    slow = {**base, 5: 0.030}  # +50 % against its own position's median (0.020)
    assert det.observe(words(21, slow), pos) == []  # one window: not yet
    assert det.observe(words(24, slow), pos) == []
    assert det.observe(words(25, base), pos) == []  # a record where it is not slow: start again
    assert det.observe(words(26, slow), pos) == []
    assert det.observe(words(30, slow), pos) == []
    assert det.observe(words(31, slow), pos) == [5]  # slow in every record over 5 more steps
    assert det.observe(words(40, slow), pos) == []  # reported once
    det.restarted(40)
    assert det.observe(words(50, slow), pos) == []  # within the quiet steps after a recovery
    assert det.observe(words(55, slow), pos) == []
    assert det.observe(words(60, slow), pos) == [5]


def test_no_false_positive_from_jitter_warm_up_or_small_excess():
    det = StragglerDetector(threshold=0.3, steps=5, skip_steps=10, min_excess_s=0.005)
    pos = {r: 0 for r in range(4)}
    # warm-up: the first steps of a job are slow on some ranks
    assert det.observe(words(3, {0: 0.5, 1: 0.01, 2: 0.01, 3: 0.01}), pos) == []
    # 40 % slower but by 2 ms only: below min_excess_s
    assert det.observe(words(20, {0: 0.007, 1: 0.005, 2: 0.005, 3: 0.005}), pos) == []
    # jitter: each step one random rank is 3x slower; the ranks publish their window's minimum
    rng = random.Random(0)
    clocks = {r: [] for r in range(4)}
    for step in range(15, 200):
        hit = rng.randrange(4)
        for r in range(4):
            clocks[r] = (clocks[r] + [0.03 * (3 if r == hit else 1) * rng.uniform(0.9, 1.1)])[-5:]
        if step >= 20:
            assert det.observe(words(step, {r: min(c) for r, c in clocks.items()}), pos) == []


def test_compute_clock_excludes_waits_on_peers_and_counts_a_slow_fault():
    progress = Progress()
    board = SimpleNamespace(word=None)
    board.set_compute = lambda index, w: setattr(board, "word", w)
    comm = SimpleNamespace(topo=SimpleNamespace(generation=0),
                           link=SimpleNamespace(board=board, index=0))
    clock = ComputeClock(progress, steps=2)
    for step in (1, 2):
        clock.begin(comm, delay_s=0.02)  # a slow fault's sleep is compute
        progress.set(step, "forward")
        t = time.perf_counter()
        while time.perf_counter() - t < 0.01:  # compute (busy: the CPU clock counts it too)
            pass
        progress.set(step, "allreduce")  # waiting on peers: not compute
        time.sleep(0.05)
        progress.set(step, "optimizer")
        c = clock.end(step)
        assert 0.028 <= c < 0.065, c  # with the 50 ms wait it would be >= 0.08
    s, c = unpack_compute(board.word)
    assert s == 2 and 0.028 <= c < 0.065
    cpu = ComputeClock(progress, steps=1, cpu=True)  # a CPU device: the thread's CPU time
    cpu.begin(comm, delay_s=0.02)
    time.sleep(0.05)  # descheduled or blocked: not this rank's compute
    assert 0.02 <= cpu.end(3) < 0.03
    comm.topo.generation = 1  # a new generation: the window restarts, nothing published yet
    board.word = None
    clock.begin(comm)
    clock.end(3)
    assert board.word is None


def test_slow_fault_stays_with_the_process_that_fired_it():
    ev = FaultEvent.from_cfg({"rank": 1, "step": 10, "kind": "slow", "delay_s": 0.05})
    assert ev.kind is Fault.SLOW and ev.phase == "step_start" and ev.delay_s == 0.05
    inj = FaultInjector([ev], slot=1)
    inj.set_rank(1)
    inj.fire(9, "step_start")
    assert inj.delay_s == 0.0
    inj.fire(10, "step_start")
    assert inj.delay_s == 0.05
    inj.set_rank(None)  # the process keeps sleeping whatever rank it holds
    assert inj.delay_s == 0.05


def test_settings_defaults_and_overrides():
    assert settings({})["threshold"] == 0.3
    assert settings({"straggler": {"steps": 3}})["steps"] == 3
