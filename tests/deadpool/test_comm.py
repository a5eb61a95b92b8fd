import gc
import time
import weakref

import pytest
import torch

from deadpool.errors import Aborted
from deadpool.rank.comm import Communicator, resolve_backend
from deadpool.store.protocol import Keys
from deadpool.topology import ParallelDims, Topology
from tests.deadpool.helpers import client, master_store, run_threads


def test_allreduce_mean_is_exact_across_ranks():
    master = master_store()

    def rank_fn(r):
        comm = Communicator.build(Topology(ParallelDims(dp=3), r, 0), client(master.port))
        t = torch.full((5,), float(r))
        comm.allreduce_mean(t)
        return t

    for t in run_threads(rank_fn, 3):
        assert torch.equal(t, torch.full((5,), 1.0))


def test_survivors_leave_a_collective_promptly_when_the_generation_is_aborted():
    # rank 2 never joins the all-reduce (a hung peer); the coordinator sets the abort key
    master = master_store()
    left_after = {}

    def rank_fn(r):
        store = client(master.port)
        comm = Communicator.build(Topology(ParallelDims(dp=3), r, 4), store, poll_s=0.01)
        if r == 2:
            time.sleep(0.3)
            store.set(Keys(4).abort, "rank 2 hung")
            t_abort = time.time()
            time.sleep(1.0)
            return t_abort
        with pytest.raises(Aborted, match="hung"):
            comm.allreduce_mean(torch.ones(1 << 16))
        left_after[r] = time.time()
        return comm

    res = run_threads(rank_fn, 3)
    for r in (0, 1):  # left at the abort, not at the group's timeout (120 s)
        assert left_after[r] - res[2] < 120 / 4


def test_generations_use_disjoint_store_namespaces():
    master = master_store()

    def rank_fn(r):
        store = client(master.port)
        a = Communicator.build(Topology(ParallelDims(dp=2), r, 0), store)
        b = Communicator.build(Topology(ParallelDims(dp=2), r, 1), store)
        t = torch.ones(3) * (r + 1)
        b.allreduce_mean(t)
        a.park()
        return t

    for t in run_threads(rank_fn, 2):
        assert torch.equal(t, torch.full((3,), 1.5))


def test_a_kept_group_is_taken_over_and_still_works():
    master = master_store()

    def rank_fn(r):
        store = client(master.port)
        dims = ParallelDims(dp=2, tp=2, ranks_per_node=4)
        a = Communicator.build(Topology(dims, r, 0), store)
        t = torch.ones(2)
        a.allreduce(t, "tp")
        counts = a.group_counts()
        keep = {k for k in counts if k.startswith("tp/")}
        b = Communicator.build(Topology(dims, r, 1), store, previous=a, keep=keep)
        assert b.groups["tp"] is a.groups["tp"] and b.groups["dp"] is not a.groups["dp"]
        b.allreduce(t, "tp")
        b.allreduce(t, "dp")
        return t, counts

    for t, counts in run_threads(rank_fn, 4):
        assert torch.equal(t, torch.full((2,), 8.0))
        assert all(c == [1, 1] for k, c in counts.items() if k.startswith("tp/"))


def test_a_parked_generations_groups_are_released_but_the_kept_ones_live_on():
    # a parked group's TCP loop can spin on a dead peer's socket: what the next generation did
    # not keep must be dropped (and with it its gloo loop threads), what it kept must still work
    master = master_store()
    dims = ParallelDims(dp=2, tp=2, ranks_per_node=4)
    gen0 = run_threads(lambda r: Communicator.build(Topology(dims, r, 0), client(master.port)), 4)

    def next_gen(r):
        keep = {k for k in gen0[r].group_counts() if k.startswith("tp/")}
        return Communicator.build(Topology(dims, r, 1), client(master.port), previous=gen0[r], keep=keep)

    gen1 = run_threads(next_gen, 4)
    # the gloo groups each generation-0 communicator should let go of (not the kept tp group)
    dropped = [weakref.ref(a.groups[n].pg) for a in gen0 for n in a.groups if n != "tp"]
    assert dropped
    for a, b in zip(gen0, gen1):
        a.park()
        a.release(keep=set(b.kept)).join(10)
        assert set(a.groups) == {"tp"} and a.groups["tp"] is b.groups["tp"]
    gc.collect()
    assert all(ref() is None for ref in dropped), "a released group is still referenced"

    def train(r):
        t = torch.ones(2)
        gen1[r].allreduce(t, "tp")
        gen1[r].allreduce(t, "dp")
        return t

    for t in run_threads(train, 4):
        assert torch.equal(t, torch.full((2,), 4.0))


def test_backend_auto_follows_the_device_and_gloo_may_carry_cuda_tensors():
    assert resolve_backend("cpu") == "gloo"
    assert resolve_backend("cuda") == "nccl"
    assert resolve_backend("cuda:1", "auto") == "nccl"
    assert resolve_backend("cuda", "gloo") == "gloo"  # several ranks sharing one GPU
    with pytest.raises(ValueError, match="needs device=cuda"):
        resolve_backend("cpu", "nccl")
    with pytest.raises(ValueError, match="backend must be one of"):
        resolve_backend("cpu", "mpi")


def test_abort_watchers_stop_before_the_interpreter_finalizes(monkeypatch):
    # a daemon watcher still inside the store client's C++ code at finalization takes the
    # process down ("terminate called without an active exception"): the atexit hook stops it
    import deadpool.rank.abort as abort_mod

    monkeypatch.setattr(abort_mod, "_exiting", abort_mod.threading.Event())
    master = master_store()
    comm = Communicator.build(Topology(ParallelDims(dp=1), 0, 0), client(master.port), poll_s=0.01)
    del master  # the store server is gone: the watcher polls on, failing
    time.sleep(0.05)
    assert comm._watcher.is_alive()
    abort_mod._stop_watchers()
    assert not comm._watcher.is_alive()
