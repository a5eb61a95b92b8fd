"""The snapshot engine's pacing when its copier is slower than the step (one rank, nothing to
replicate), on the host path and on the CUDA path's shape, and the schedule fed as the trainer
feeds it. The CUDA path is modelled without a GPU: ``torch.cuda``'s stream and event calls are
replaced by fakes whose copy completes ``copy_s`` after it is issued, and a step that waited for
it on the "GPU" ends no earlier than that (the step's host sync)."""

import contextlib
import time

import pytest
import torch

import deadpool.snapshot.layout as layout
from deadpool.snapshot import SnapshotEngine, SnapshotSchedule
from deadpool.store.protocol import Keys
from deadpool.store.rounds import StoreRounds
from tests.deadpool.helpers import client, master_store


class FakeCuda:
    """The GPU's copy engine and the compute stream's waits, on the host clock."""

    def __init__(self, copy_s: float):
        self.copy_s, self.ready = copy_s, 0.0
        gpu = self

        class Event:
            def record(self):
                self.t = time.perf_counter() + gpu.copy_s

            def synchronize(self):
                time.sleep(max(0.0, self.t - time.perf_counter()))

            def query(self):
                return time.perf_counter() >= self.t

        class Stream:
            def wait_stream(self, other):
                pass

            def wait_event(self, ev):  # the compute stream may not go on before the copy is done
                gpu.ready = max(gpu.ready, ev.t)

        self.Event, self.Stream = Event, Stream

    def install(self, monkeypatch):
        monkeypatch.setattr(torch.cuda, "Event", self.Event)
        monkeypatch.setattr(torch.cuda, "current_stream", lambda: self.Stream())
        monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())

    def sync(self):
        """The step's host sync: it returns once the compute stream's waits are over."""
        time.sleep(max(0.0, self.ready - time.perf_counter()))


def slow_checksum(monkeypatch, seconds: float, torn: list):
    """Each checksum takes ``seconds``; a buffer that changes while it is hashed is recorded."""
    real = layout.checksum

    def checksum(flat):
        before = real(flat)
        time.sleep(seconds)
        if real(flat) != before:
            torn.append(before)
        return before

    monkeypatch.setattr(layout, "checksum", checksum)


def engine(cuda: FakeCuda | None, n=1 << 12):
    state = [("w", torch.zeros(n)), ("m", torch.zeros(n))]
    eng = SnapshotEngine(state, num_local_slots=3)
    eng.repl_region = "none"  # a job of one rank (start_replication decides this)
    if cuda is not None:  # the CUDA path (keyed on the side stream); its ring stays unpinned,
        eng._side_stream = cuda.Stream()  # as a host without a GPU cannot pin memory
    return eng, [t for _, t in state]


@pytest.mark.parametrize("path", ["host", "cuda"])
def test_a_slot_is_never_reused_before_its_copy_and_checksum_finished(monkeypatch, path):
    """The copier (checksum 30 ms a region) is slower than the step (5 ms): the queue must never
    hold a slot twice, no checksum may read a buffer being overwritten, and every snapshot left
    in the ring holds its own step's state under a matching checksum."""
    cuda = FakeCuda(copy_s=0.005) if path == "cuda" else None
    if cuda:
        cuda.install(monkeypatch)
    torn: list = []
    slow_checksum(monkeypatch, 0.03, torn)
    eng, tensors = engine(cuda)
    longest, done = 0, []
    for step in range(1, 13):
        time.sleep(0.005)  # forward and backward
        eng.wait_copy()
        for t in tensors:  # the optimizer step: the state is the step number
            t.fill_(step)
        if cuda:
            cuda.sync()
        eng.snapshot(step, {"step": step})
        longest = max(longest, eng._copy_q.qsize())
        done.append(eng.done_step)
    eng.drain()
    assert longest <= len(eng.slots) - 1
    assert torn == []
    assert done == sorted(done)  # the newest finished snapshot never goes back
    assert eng.local_steps() == [10, 11, 12]
    for s in eng.slots:
        assert torch.all(s.flat[:eng.layout.nbytes].view(torch.float32)[:8] == s.step)
        assert eng.verify_region(s.flat, "all", s.crc)
    assert eng.blocked_s >= 0.1  # the back-pressure is counted as blocked time
    eng.close()


def run_job(monkeypatch, steps=56, compute_s=0.02, copy_s=0.035, crc_s=0.035):
    """A one-rank job as the trainer drives it (trainer.train's snapshot and observe wiring), on
    the CUDA path: the step's optimizer waits on the GPU for the previous snapshot's copy, which
    makes the step copy-bound (0.02 s of compute, 0.035 s of copy: the H100's 0.22 vs 0.39 s at
    a tenth), and the host's checksum is slower still (2 x 0.035 s, the H100's 0.7 s)."""
    cuda = FakeCuda(copy_s)
    cuda.install(monkeypatch)
    slow_checksum(monkeypatch, crc_s, [])
    eng, tensors = engine(cuda)
    sched = SnapshotSchedule(1, 8, overhead_target=0.02)
    master = master_store()  # kept alive for the job
    sched.start(StoreRounds(client(master.port), Keys(1), 1))
    seen, rows = -1, []
    for step in range(steps):
        t0 = time.perf_counter()
        busy = eng.slows_step()
        time.sleep(compute_s)
        eng.wait_copy()
        cuda.sync()
        s = step + 1
        if sched.due(s):
            eng.snapshot(s, {"step": s})
        sched.end_of_step(s, lambda: None)
        dt = time.perf_counter() - t0
        cycle = None
        if eng.done_step != seen:
            seen, cycle = eng.done_step, eng.last_cycle_s
        sched.observe(dt, busy, cycle, step=s, pending_s=eng.pending_cycle_s())
        rows.append((s, dt, busy, sched.interval))
    eng.close()
    del master
    return sched, rows


def test_a_copy_bound_step_widens_the_schedule_on_the_cuda_path(monkeypatch):
    """The H100 run's shape: snapshots every step cost 80 % there and the interval stayed 1. Here
    the probes' steps must read as quiet (the copy is done, only the host's checksum runs), the
    slowed steps as active, the cost be measured, and the interval widen to 8 from step 40."""
    sched, rows = run_job(monkeypatch)
    probe = [r for r in rows if r[0] in (14, 15, 16)]
    assert not any(busy for _, _, busy, _ in probe), probe
    assert sched.overhead() is not None and sched.overhead() > 0.02
    interval = {s: k for s, _, _, k in rows}
    assert interval[40] >= 4 and interval[56] == 8, interval


def test_an_unfinished_cycle_counts_as_a_lower_bound():
    s = SnapshotSchedule(1, 8, warmup=0)
    for _ in range(8):
        s.observe(0.1, True, None, pending_s=None)
    assert s.wanted() == 1  # no cycle ever finished
    s.observe(0.1, True, None, pending_s=0.5)  # one has run 5 steps and is still running
    assert s.wanted() == 8  # 1.25 x 0.5 / 0.1 = 6.25 steps
    s.observe(0.1, True, 0.05, pending_s=None)
    assert s.wanted() == 1
