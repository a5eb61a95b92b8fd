from deadpool.watchdog import Liveness, Progress


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def beat(live, slot, n, prog: Progress):
    live.observe(slot, f"{n} {prog.encode()}")


def test_heartbeat_age_is_measured_on_the_coordinators_clock_not_the_senders():
    clock = Clock()
    live = Liveness(soft_s=1.0, hard_s=10.0, progress_s=5.0, clock=clock)
    p = Progress()
    beat(live, 0, 1, p)
    clock.t += 0.5
    beat(live, 0, 1, p)  # same beat number again: no news
    clock.t += 0.6
    assert live.beat_age(0) > 1.0
    assert not live.beat_lost(0, is_stopped=lambda s: False)  # soft: only suspect
    assert live.beat_lost(0, is_stopped=lambda s: True)       # ... unless seen stopped
    clock.t += 9
    assert live.beat_lost(0, is_stopped=lambda s: False)      # hard
    beat(live, 0, 2, p)
    assert live.beat_age(0) == 0.0


def test_a_hung_training_thread_with_a_live_heartbeat_is_found_and_peers_waiting_are_not_blamed():
    clock = Clock()
    live = Liveness(soft_s=1.0, hard_s=10.0, progress_s=5.0, clock=clock)
    ps = {s: Progress() for s in range(3)}
    ps[0].set(7, "backward")   # hung here
    ps[1].set(7, "allreduce")  # waiting for rank 0
    ps[2].set(7, "allreduce")
    for n in range(1, 8):
        for s in ps:
            beat(live, s, n, ps[s])  # heartbeats keep coming
        clock.t += 1
    hung, stuck = live.hung([0, 1, 2])
    assert hung == [0] and not stuck


def test_everyone_waiting_on_everyone_is_a_stuck_generation_and_idle_is_never_a_stall():
    clock = Clock()
    live = Liveness(soft_s=1.0, hard_s=10.0, progress_s=5.0, clock=clock)
    ps = {s: Progress() for s in range(3)}
    for s in (0, 1):
        ps[s].set(3, "allreduce")
    ps[2].set(-1, "idle")
    for n in range(1, 8):
        for s in ps:
            beat(live, s, n, ps[s])
        clock.t += 1
    assert live.hung([0, 1, 2]) == ([], True)


def test_a_slow_but_moving_rank_keeps_its_waiting_peers_from_looking_stuck():
    clock = Clock()
    live = Liveness(soft_s=1.0, hard_s=10.0, progress_s=5.0, clock=clock)
    ps = {s: Progress() for s in range(2)}
    ps[0].set(3, "allreduce")  # waits 8 s for rank 1, which moves through its phases
    for n in range(1, 9):
        ps[1].set(3, ["forward", "backward"][n % 2])
        for s in ps:
            beat(live, s, n, ps[s])
        clock.t += 1
    assert live.hung([0, 1]) == ([], False)
