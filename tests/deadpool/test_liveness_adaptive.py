"""The progress bound adapts to the job (deadpool/control/liveness.py, ``Liveness.bound``): a
phase once seen slow gets ``ADAPT_FACTOR`` x its longest, capped at ``ADAPT_CAP`` progress
timeouts; a bound is only ever lengthened."""

from __future__ import annotations

from deadpool.control.liveness import ADAPT_CAP, ADAPT_FACTOR, Liveness


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def walk(live, clock, slot, phases):
    """``phases``: (phase, seconds in it) in order; one reading per phase as it starts."""
    for n, (phase, seconds) in enumerate(phases):
        live.update(slot, n + 1, n + 1, 5, phase)
        clock.t += seconds


def test_a_phase_once_slow_gets_a_longer_bound_and_a_hang_is_still_found():
    clock = Clock()
    live = Liveness(1.0, 10.0, 3.0, clock=clock)
    assert live.bound("forward") == 3.0
    walk(live, clock, 0, [("forward", 1.5), ("allreduce", 9.0), ("optimizer", 0.1)])
    # forward took 1.5 s: its bound is 4.5 s now; the all-reduce (a peer wait) adapts nothing
    assert live.longest["forward"] == 1.5 and "allreduce" not in live.longest
    assert live.bound("forward") == ADAPT_FACTOR * 1.5 == 4.5
    assert live.bound("allreduce") == 3.0
    live.update(0, 10, 10, 6, "forward")
    clock.t += 4.0
    assert not live.stalled(0)  # 4 s: a hang under the fixed 3 s bound, not under 4.5 s
    clock.t += 0.6
    assert live.stalled(0)      # still found


def test_the_adapted_bound_is_capped_and_never_shortens_a_phases_own():
    clock = Clock()
    live = Liveness(1.0, 10.0, 3.0, clock=clock)
    walk(live, clock, 0, [("forward", 50.0), ("backward", 0.1)])
    assert live.bound("forward") == ADAPT_CAP * 3.0
    assert live.bound("build/100") == 100.0  # a bounded phase keeps its own when larger
    walk(live, clock, 1, [("idle", 500.0), ("forward", 0.1)])  # idle adapts nothing
    assert "idle" not in live.longest
