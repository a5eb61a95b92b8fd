"""gloo collectives over CUDA tensors: how several ranks share one GPU (skipped without a GPU)."""

import pytest
import torch

from deadpool.rank.comm import Communicator
from deadpool.topology import ParallelDims, Topology
from tests.deadpool.helpers import client, master_store, run_threads


@pytest.mark.gpu
def test_gloo_allreduce_mean_of_cuda_tensors_is_exact_across_ranks():
    master = master_store()

    def rank_fn(r):
        comm = Communicator.build(Topology(ParallelDims(dp=3), r, 0), client(master.port),
                                  backend="gloo")
        t = torch.full((1 << 16,), float(r), device="cuda")
        comm.allreduce_mean(t)
        assert t.is_cuda
        return t.cpu()

    for t in run_threads(rank_fn, 3):
        assert torch.equal(t, torch.full((1 << 16,), 1.0))
