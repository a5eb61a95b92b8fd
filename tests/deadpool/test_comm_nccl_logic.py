"""The NCCL code paths of the communicator, driven with fake groups on CPU (multi-rank NCCL
cannot run here; GPU machines run experiments/gpu/ checks)."""

import time

import pytest

from deadpool.comm import Communicator
from deadpool.errors import Aborted
from deadpool.launcher import local_rank
from deadpool.protocol import Keys
from deadpool.topology import ParallelDims, Topology
from tests.deadpool.helpers import client, master_store


class FakeWork:
    def __init__(self, done_after: int | None):
        self.polls, self.done_after, self.timed_waits = 0, done_after, 0

    def is_completed(self):
        self.polls += 1
        return self.done_after is not None and self.polls >= self.done_after

    def wait(self, timeout=None):
        if timeout is not None:
            self.timed_waits += 1  # on NCCL this would abort the communicator
        return True


class FakeGroup:
    def __init__(self):
        self.aborted = 0

    def abort(self):
        self.aborted += 1


def nccl_comm(generation=0):
    master = master_store()
    comm = Communicator(Topology(ParallelDims(dp=2), 0, generation), client(master.port), "nccl",
                        poll_s=0.01, timeout_s=30)
    comm.groups = {"dp": FakeGroup(), "tp": FakeGroup(), "repl_out": FakeGroup()}
    return master, comm


def test_nccl_wait_polls_completion_and_never_waits_with_a_timeout():
    _, comm = nccl_comm()
    work = FakeWork(done_after=50)
    comm.wait(work)
    assert work.polls == 50 and work.timed_waits == 0


def test_nccl_wait_leaves_on_abort_and_the_watcher_aborts_device_groups_only():
    master, comm = nccl_comm(generation=3)
    watcher = comm.start_watcher()
    client(master.port).set(Keys(3).abort, "rank 1 died")
    t0 = time.monotonic()
    with pytest.raises(Aborted, match="rank 1 died"):
        comm.wait(FakeWork(done_after=None))  # a collective whose peer is gone: never completes
    assert time.monotonic() - t0 < comm.timeout_s / 4  # at the abort, not at the timeout
    watcher.join(2.0)
    assert not watcher.is_alive()
    assert comm.groups["dp"].aborted == 1 and comm.groups["tp"].aborted == 1
    assert comm.groups["repl_out"].aborted == 0  # host replication groups stay parked
    comm.park()  # parking after the watcher aborts nothing twice
    assert comm.groups["dp"].aborted == 1


def test_park_stops_the_watcher_and_aborts_device_groups():
    _, comm = nccl_comm()
    watcher = comm.start_watcher()
    comm.park()
    watcher.join(2.0)
    assert not watcher.is_alive() and comm.groups["dp"].aborted == 1


def test_local_ranks_map_processes_round_robin_onto_gpus():
    assert [local_rank(s, 4) for s in range(6)] == [0, 1, 2, 3, 0, 1]
    assert local_rank(5, 0) == 0
