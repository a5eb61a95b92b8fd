"""ZeRO-2 (``parallel.zero=2``): gradients reduced per bucket during backward into a sharded fp32
buffer; no full gradient buffer. Threads on gloo, real autograd.

With one micro-batch per step the per-bucket sums are ZeRO-1's, so parameters and optimizer
state must be bit-identical to ZeRO-1's. With several micro-batches ZeRO-2 sums the ranks of each
micro-batch and then the micro-batches (ZeRO-1 the other way round): equal to fp32 rounding."""

import pytest
import torch

from deadpool.parallel.data import ZeroOptimizer
from tests.deadpool.helpers import master_store, run_threads
from tests.deadpool.parallel.test_zero import HP, build


class Net(torch.nn.Module):
    """Two linear layers and a parameter the forward may skip (``use_extra``)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(6, 5), torch.nn.Linear(5, 4)
        self.extra = torch.nn.Parameter(torch.zeros(3))
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g))

    def forward(self, x, use_extra=True):
        y = self.b(torch.tanh(self.a(x)))
        return y + self.extra.sum() if use_extra else y


def train(n, r, comm, *, zero2, m=1, dtype=torch.float32, reduce_dtype=torch.float32,
          use_extra=True, steps=3, in_flight=1):
    net = Net().to(dtype)
    opt = ZeroOptimizer(list(net.parameters()), dp_size=n, dp_rank=r, bucket_bytes=32,
                        first_bucket_bytes=16, shard_grads=zero2, grad_reduce_dtype=reduce_dtype,
                        max_buckets_in_flight=in_flight, **HP)
    g = torch.Generator().manual_seed(r)
    posted_in_backward = []
    for _ in range(steps):
        opt.begin_step(comm, m)
        for _ in range(m):
            net(torch.randn(4, 6, generator=g).to(dtype), use_extra).square().mean().backward()
        if zero2:
            posted_in_backward.append(opt.grads.posted)
            assert all(p.grad is None for p in net.parameters())  # nothing full-size kept
        opt.reduce_grads(comm)
        opt.step(comm)
    state = [t.clone() for _, t, _ in opt.state_tensors()]
    return state, opt, posted_in_backward


def run_both(n, **kw):
    master = master_store()

    def rank_fn(r):
        comm = build(n, r, master.port)
        one, opt1, _ = train(n, r, comm, zero2=False, **kw)
        two, opt2, posted = train(n, r, comm, zero2=True, **kw)
        return one, two, opt1, opt2, posted
    return run_threads(rank_fn, n)


@pytest.mark.parametrize("n,dtype,reduce_dtype,in_flight", [
    (2, torch.float32, torch.float32, 1), (3, torch.float32, torch.float32, 2),
    (2, torch.bfloat16, torch.float32, 1), (3, torch.bfloat16, torch.bfloat16, 4)])
def test_one_micro_batch_is_bitwise_zero1(n, dtype, reduce_dtype, in_flight):
    for one, two, opt1, opt2, posted in run_both(n, dtype=dtype, reduce_dtype=reduce_dtype,
                                                 in_flight=in_flight):
        assert opt2.flat_grads is None and opt2.main_grads is None
        assert opt2.grads.shard.numel() == opt1.shard_numel  # the gradient kept: one shard
        # every bucket was posted from backward's hooks, none left for reduce_grads
        assert posted == [len(opt2.grads.edges)] * 3 and len(opt2.grads.edges) > 3
        assert len(one) == len(two)
        for a, b in zip(one, two):
            assert torch.equal(a, b)


def test_micro_batches_match_zero1_to_rounding():
    """m = 3: ZeRO-2 reduces each micro-batch (sum over ranks, then micro-batches): within fp32
    rounding of ZeRO-1, over 3 AdamW steps (AdamW's update normalises by sqrt(v): a relative
    gradient error of ~1e-7 moves a parameter by ~lr x 1e-7)."""
    for one, two, opt1, opt2, posted in run_both(2, m=3):
        assert posted == [3 * len(opt2.grads.edges)] * 3  # every micro-batch's buckets
        for a, b in zip(one, two):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_a_parameter_the_forward_skips_waits_for_reduce_grads():
    """``extra`` never gets a gradient: its bucket (and the rest of the round) is posted by
    ``reduce_grads``, in the same order on every rank; the result is still ZeRO-1's bits."""
    for one, two, opt1, opt2, posted in run_both(2, use_extra=False):
        assert all(0 < k < len(opt2.grads.edges) for k in posted)
        for a, b in zip(one, two):
            assert torch.equal(a, b)


def test_gradients_written_outside_autograd_are_reduced():
    """Never armed (no ``begin_step``): ``reduce_grads`` reads each ``p.grad``."""
    master = master_store()

    def rank_fn(r):
        comm = build(2, r, master.port)
        out = []
        for zero2 in (False, True):
            net = Net()
            opt = ZeroOptimizer(list(net.parameters()), dp_size=2, dp_rank=r, bucket_bytes=32,
                                first_bucket_bytes=16, shard_grads=zero2, **HP)
            opt.zero_grad()
            for i, p in enumerate(net.parameters()):
                g = torch.full(p.shape, float(r + i) / 4)
                if zero2:
                    p.grad = g
                else:
                    p.grad.add_(g)
            opt.reduce_grads(comm)
            out.append(opt.grad_shard.clone())
        return out

    for one, two in run_threads(rank_fn, 2):
        assert torch.equal(one, two)


def test_dp1_or_unsharded_keeps_the_full_buffer():
    """ZeRO-2 needs a sharded optimizer over dp > 1; otherwise it is ZeRO-1 (or plain DP)."""
    for kw in (dict(dp_size=1, dp_rank=0), dict(dp_size=2, dp_rank=0, shard=False)):
        opt = ZeroOptimizer(list(Net().parameters()), shard_grads=True, **kw, **HP)
        assert opt.grads is None and opt.flat_grads is not None
