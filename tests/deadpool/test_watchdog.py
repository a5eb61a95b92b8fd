from deadpool.control.liveness import Liveness
from deadpool.rank.watchdog import Progress


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


def test_on_step_sees_the_new_step_already_set():
    """``Progress.on_step`` runs once ``step`` holds the new value: a heartbeat thread that reads
    ``progress.step`` while the callback runs must not see the step being left (issue 36, item 8)."""
    p = Progress()
    seen = []
    p.on_step = lambda step: seen.append((step, p.step))
    p.set(4, "forward")
    p.set(5, "forward")
    assert seen == [(4, 4), (5, 5)]


def test_a_beat_never_lowers_the_step_word_the_training_thread_wrote(tmp_path):
    """The heartbeat thread read ``progress.step`` (4) just before the training thread entered
    step 5 and wrote the step word (``on_step``); its beat, written after, must leave 5 there: a
    kill in that window is a failure in step 5, not 4 (issue 36, item 8)."""
    from deadpool.agent.board import NodeBoard

    board = NodeBoard.create(tmp_path / "board", [3])
    board.write_beat(0, pid=77, beat=1, progress=1, step=4, phase="forward")
    assert board.read_beat(0)[3] == 4  # the process's first beat claims its record
    board.set_step(0, 5)                # the training thread enters step 5
    board.write_beat(0, pid=77, beat=2, progress=2, step=4, phase="forward")  # the older copy
    assert board.read_beat(0)[1:4] == (2, 2, 5)
    board.set_step(0, 2)                # a rollback (recovery) lowers it: the training thread's
    board.write_beat(0, pid=77, beat=3, progress=3, step=5, phase="forward")
    assert board.read_beat(0)[3] == 2
    board.write_beat(0, pid=78, beat=1, progress=0, step=-1, phase="start")  # a new process
    assert board.read_beat(0)[:4] == (78, 1, 0, -1)
