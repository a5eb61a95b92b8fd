"""The ZeRO gradient step as one reduce-scatter per bucket group on NCCL (``parallel/data/reduce_scatter.py``),
on the CPU stand-in for NCCL (``tests/deadpool/fake_nccl.py``): threads, real autograd.

The fake's reduce-scatter sums every rank's piece in rank order, as the gloo path sums each
owner's inbox, so ZeRO-1 and ZeRO-2 on it must end bitwise equal to the gloo path (dp 3: three
addends, so an order slip would show; real NCCL sums in its ring order: equal to rounding,
see the module). The fake counts what was posted: reduce-scatters, no reduces."""

import pytest
import torch

from deadpool.parallel.data import ZeroOptimizer
from deadpool.parallel.data.reduce_scatter import aligned_edges, use_reduce_scatter
from deadpool.rank.comm import Communicator
from deadpool.topology import ParallelDims, Topology
from tests.deadpool import fake_nccl
from tests.deadpool.helpers import client, master_store, run_threads
from tests.deadpool.parallel.test_zero import HP
from tests.deadpool.parallel.test_zero2 import Net


def train(n, r, comm, *, zero2, rs, m, dtype, steps=3):
    net = Net().to(dtype)
    opt = ZeroOptimizer(list(net.parameters()), dp_size=n, dp_rank=r, bucket_bytes=32,
                        first_bucket_bytes=16, shard_grads=zero2, reduce_scatter=rs,
                        max_buckets_in_flight=2, **HP)
    g = torch.Generator().manual_seed(r)
    for _ in range(steps):
        opt.begin_step(comm, m)
        for _ in range(m):
            net(torch.randn(4, 6, generator=g).to(dtype)).square().mean().backward()
        opt.reduce_grads(comm)
        opt.step(comm)
    if comm.stream_ordered:
        comm.sync()
    return [t.clone() for _, t, _ in opt.state_tensors()], opt


def run(n, backend, **kw):
    master = master_store()

    def rank_fn(r):
        comm = Communicator.build(Topology(ParallelDims(dp=n, ranks_per_node=n), r, 0),
                                  client(master.port), backend, poll_s=0.01, timeout_s=30)
        try:
            state, opt = train(n, r, comm, **kw)
            return state, opt, comm.groups["dp"].pg if backend == "nccl" else None
        finally:
            comm.park()
    return run_threads(rank_fn, n)


@pytest.mark.parametrize("zero2,m,dtype", [(False, 1, torch.float32), (False, 3, torch.bfloat16),
                                           (True, 1, torch.float32), (True, 3, torch.float32)])
def test_reduce_scatter_on_nccl_is_bitwise_the_gloo_path(monkeypatch, zero2, m, dtype):
    fake_nccl.install(monkeypatch)
    n = 3
    gloo = run(n, "gloo", zero2=zero2, rs=True, m=m, dtype=dtype)  # gloo: per bucket still
    nccl = run(n, "nccl", zero2=zero2, rs=True, m=m, dtype=dtype)
    for (want, _, _), (got, opt, group) in zip(gloo, nccl):
        assert isinstance(group, fake_nccl.FakeNCCLGroup)
        groups = len(opt.buckets.edges) // n
        assert groups > 1  # several groups, each the same offset of every shard
        rounds = m if zero2 else 1  # ZeRO-2 reduces every micro-batch
        assert group.posts["reduce_scatter"] == 3 * rounds * groups, group.posts
        assert group.posts["reduce"] == 0 and group.posts["alltoall_base"] == 0
        assert len(want) == len(got)
        for a, b in zip(want, got):
            assert torch.equal(a, b)




def test_aligned_edges_repeat_one_cut_in_every_shard():
    edges = aligned_edges(10, 3, 4, bucket_bytes=16, first_bucket_bytes=8)
    assert edges == [(28, 30), (24, 28), (20, 24), (18, 20), (14, 18), (10, 14),
                     (8, 10), (4, 8), (0, 4)]


def test_the_setting_picks_reduce_scatter_on_nccl_only():
    assert use_reduce_scatter("auto", "nccl", "cpu", 1)
    assert use_reduce_scatter("auto", "auto", "cuda:0", 1)
    assert not use_reduce_scatter("auto", "auto", "cpu", 1)  # gloo: not abortable
    assert not use_reduce_scatter("reduce_scatter", "gloo", "cpu", 1)
    assert not use_reduce_scatter("auto", "nccl", "cpu", 2)  # ZeRO-2 keeps its memory bound
    assert use_reduce_scatter("reduce_scatter", "nccl", "cpu", 2)
    assert not use_reduce_scatter("reduce", "nccl", "cpu", 1)
    assert not use_reduce_scatter(None, "nccl", "cpu", 0)
    with pytest.raises(ValueError):
        use_reduce_scatter("allreduce", "nccl", "cpu", 1)
