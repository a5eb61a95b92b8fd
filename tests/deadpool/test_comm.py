import time

import pytest
import torch

from deadpool.comm import Aborted, Communicator, resolve_backend
from deadpool.protocol import Keys
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
    for r in (0, 1):
        assert left_after[r] - res[2] < 0.5  # far below the 120 s group timeout


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


def test_backend_auto_follows_the_device_and_gloo_may_carry_cuda_tensors():
    assert resolve_backend("cpu") == "gloo"
    assert resolve_backend("cuda") == "nccl"
    assert resolve_backend("cuda:1", "auto") == "nccl"
    assert resolve_backend("cuda", "gloo") == "gloo"  # several ranks sharing one GPU
    with pytest.raises(ValueError, match="needs device=cuda"):
        resolve_backend("cpu", "nccl")
    with pytest.raises(ValueError, match="backend must be one of"):
        resolve_backend("cpu", "mpi")
